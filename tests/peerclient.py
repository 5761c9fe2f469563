"""A made-up peer for hostile tests: it passes the handshake with a DID of its
own (fresh ones cost milliseconds of proof of work) and then does what a test
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
from hmpnode.net.handshake import Handshake
from hmpnode.net.mesh import PEER_PATH


async def authenticate(session: aiohttp.ClientSession, port: int, identity: Identity, host: str = "127.0.0.1"):
    """Connect as a peer and pass the handshake; the open WebSocket, or the refusal
    (the HTTP status of a refused upgrade, an error frame's reason, a message type)."""
    now = datetime.now(timezone.utc).replace(microsecond=0)
    announce = build_peer_announce(identity, addresses=["tcp://127.0.0.1:9"], now=now)
    try:
        ws = await session.ws_connect(f"http://{host}:{port}{PEER_PATH}")
    except aiohttp.WSServerHandshakeError as exc:
        return exc.status
    hs = Handshake(identity, announce, role="initiator", rng=nacl.utils.random, now=now, verifier=Verifier(),
                   min_difficulty=3, supported_compression=["zstd"], supported_encryption=[])
    for message in hs.start():
        await ws.send_str(orjson.dumps(message).decode())
    deadline = time.monotonic() + 10
    while not hs.done and time.monotonic() < deadline:
        msg = await ws.receive(timeout=10)
        if msg.type != aiohttp.WSMsgType.TEXT:
            return msg.type
        value = orjson.loads(msg.data)
        if value.get("type") == "error":
            await ws.close()
            return value["reason"]
        for reply in hs.receive(value):
            await ws.send_str(orjson.dumps(reply).decode())
    assert hs.done, hs.reason
    return ws


async def closed_reason(ws: aiohttp.ClientWebSocketResponse, wait: float = 0.3) -> str | None:
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
        held: dict[str, aiohttp.ClientWebSocketResponse] = {}
        for identity in identities:
            result = await authenticate(http, args.port, identity, args.host)
            if isinstance(result, aiohttp.ClientWebSocketResponse):
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
