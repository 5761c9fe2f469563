"""A made-up peer for hostile tests: it passes the v2 handshake (hmpnode.net.transport)
with a DID of its own (fresh ones cost milliseconds of proof of work) and then does what a test
asks. Used in-process (`authenticate`) and, where the attacker needs an address
of its own, as a program run inside a network namespace:

    python -m tests.peerclient HOST PORT --count 63 [--seed HEX ...] [--hold 30]

which prints one JSON line per attempt ({"did", "result"}: "ok", the HTTP status
of a refused upgrade such as "503", or the reason of an error frame), then
{"held": n, "closed": {did: reason}} for the sessions still open after a short
wait, and keeps those open for up to --hold seconds (until stdin closes)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import threading
import time
from datetime import datetime, timezone

import aiohttp
import nacl.utils
import orjson

from hmpnode.container.verify import Verifier
from hmpnode.identity import Identity
from hmpnode.net.announce import build_peer_announce
from hmpnode.net.link import CLOSE_REFUSED
from hmpnode.net.connections import PEER_PATH
from hmpnode.net.transport import (PROLOGUE, PROTOCOL, KeyPair, NoiseHandshake, Transport, TransportError,
                                   UnitReader, make_announce_checker, make_payload)


class PeerSocket:
    """A v2 session seen as a WebSocket of JSON text frames, so that hostile tests
    write frames as before: `send_str`/`send_json`/`send_frame` encrypt one frame
    into the session's records (one binary message), `receive` decrypts the next
    frame (a TEXT message; the carrier's own messages such as CLOSE as they come),
    `raw` is the WebSocket underneath (for a test that sends bytes of its own)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, transport: Transport, backlog: list[bytes]):
        self.raw = ws
        self.transport = transport
        self._backlog = backlog

    @property
    def closed(self) -> bool:
        return self.raw.closed

    async def send_frame(self, data: bytes) -> None:
        await self.raw.send_bytes(self.transport.encrypt(data))

    async def send_str(self, text: str) -> None:
        await self.send_frame(text.encode())

    async def send_json(self, value) -> None:
        await self.send_frame(orjson.dumps(value))

    async def receive(self, timeout: float | None = None) -> aiohttp.WSMessage:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._backlog:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            msg = await self.raw.receive(timeout=remaining)
            if msg.type != aiohttp.WSMsgType.BINARY:
                return msg
            try:
                self._backlog.extend(self.transport.feed(msg.data))
            except TransportError as exc:
                return aiohttp.WSMessage(aiohttp.WSMsgType.ERROR, exc, None)
        return aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, self._backlog.pop(0).decode(), None)

    async def close(self) -> None:
        await self.raw.close()


async def authenticate(session: aiohttp.ClientSession, port: int, identity: Identity, host: str = "127.0.0.1",
                       addresses: list[str] | None = None, hashes: list[bytes] | None = None,
                       versions: tuple[str, ...] = (PROTOCOL,), path: str = PEER_PATH):
    """Connect as a peer and pass the v2 handshake; a PeerSocket once the node admitted
    us (its empty first frame), or the refusal: the HTTP status of a refused upgrade,
    the reason of a refusal close (before the handshake completed) or of an error
    frame (after), or the type of whatever else the node sent. The handshake hash of a
    completed handshake is appended to `hashes` (the rule of protocol.md 21.3 reads it).
    `versions`: what the handshake payload offers (with hmp-nat/1, the node sends `nat` frames);
    `path`: where the WebSocket goes (a circuit relay's `/hmp/v2/circuit?to=<did>`: the node behind it)."""
    now = datetime.now(timezone.utc).replace(microsecond=0)
    announce = build_peer_announce(identity, addresses=addresses or ["tcp://127.0.0.1:9"], now=now,
                                   protocols=[PROTOCOL])
    try:
        ws = await session.ws_connect(f"http://{host}:{port}{path}", max_msg_size=8 * 1024 * 1024)
    except aiohttp.WSServerHandshakeError as exc:
        return exc.status
    static = KeyPair.generate(nacl.utils.random)
    hs = NoiseHandshake("initiator", static, PROLOGUE, make_payload(identity, orjson.dumps(announce), static.public, versions),
                        nacl.utils.random, verify_announce=make_announce_checker(Verifier(), min_difficulty=3, now=now),
                        own_did=identity.did)
    reader, units = UnitReader(), []
    backlog: list[bytes] = []
    transport = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not backlog:
        if not hs.complete and hs.my_turn():
            await ws.send_bytes(hs.write_message())
            if hs.complete:
                transport = hs.transport()
                if hashes is not None:
                    hashes.append(transport.handshake_hash)
            continue
        msg = await ws.receive(timeout=max(0.01, deadline - time.monotonic()))
        if msg.type == aiohttp.WSMsgType.CLOSE and msg.data == CLOSE_REFUSED:
            await ws.close()
            return msg.extra
        if msg.type != aiohttp.WSMsgType.BINARY:
            await ws.close()
            return msg.type
        if transport is None:
            units += reader.feed(msg.data)
            while units and not hs.my_turn() and not hs.complete:
                hs.read_message(units.pop(0))  # a failure raises: the test sees why
        else:
            backlog += transport.feed(msg.data)
    assert transport is not None and backlog, "no verdict from the node within 10 s"
    first = backlog.pop(0)
    if first:  # not admitted: an error frame inside the channel
        await ws.close()
        return orjson.loads(first)["reason"]
    return PeerSocket(ws, transport, backlog)


async def closed_reason(ws: PeerSocket, wait: float = 0.3) -> str | None:
    """Read what the node sent so far: None while the connection is open, else the
    reason of its last error frame ("closed" without one)."""
    reason = None
    while True:
        try:
            msg = await ws.receive(timeout=wait)
        except (TimeoutError, asyncio.TimeoutError):
            return None
        if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING,
                        aiohttp.WSMsgType.ERROR):
            return reason or "closed"
        if msg.type == aiohttp.WSMsgType.TEXT:
            value = orjson.loads(msg.data)
            if value.get("type") == "error":
                reason = value.get("reason")


def _print(value) -> None:
    sys.stdout.write(orjson.dumps(value).decode() + "\n")
    sys.stdout.flush()


async def _main(args: argparse.Namespace) -> None:
    identities = [Identity(bytes.fromhex(s)) for s in args.seed]
    identities += [Identity.generate() for _ in range(max(0, args.count - len(identities)))]
    async with aiohttp.ClientSession() as http:
        held: dict[str, PeerSocket] = {}
        for identity in identities:
            result = await authenticate(http, args.port, identity, args.host)
            if isinstance(result, PeerSocket):
                held[identity.did] = result
                _print({"did": identity.did, "result": "ok"})
            else:
                _print({"did": identity.did, "result": str(result)})
            if args.pause:
                await asyncio.sleep(args.pause)
        reasons = await asyncio.gather(*(closed_reason(ws) for ws in held.values()))
        closed = {did: r for did, r in zip(held, reasons, strict=True) if r is not None}
        _print({"held": len(held) - len(closed), "closed": closed})
        if args.hold:  # until stdin closes (a daemon thread: an unread stdin never blocks the exit)
            loop, eof = asyncio.get_running_loop(), asyncio.Event()
            threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(eof.set)),
                             daemon=True).start()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(eof.wait(), args.hold)
        for ws in held.values():
            await ws.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.peerclient")
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--seed", action="append", default=[], help="hex Ed25519 seed of a DID to use (first)")
    parser.add_argument("--hold", type=float, default=0.0, help="seconds to keep the sessions open (at most)")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between attempts")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
