"""The punched stream (docs/protocol.md 34.4) on loopback: the v2 handshake and records over
a raw TCP stream (hmpnode.net.carrier), and TCP simultaneous open between two bound ports
(hmpnode.net.punching.simultaneous_open)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import aiohttp
import pytest

from hmpnode.net.carrier import StreamCarrier
from hmpnode.net.link import Opening
from hmpnode.net.punching import bind_port, simultaneous_open
from tests.test_transport import ALICE, BOB, _hs


async def _carrier_pair(chunk: int) -> tuple[StreamCarrier, StreamCarrier, asyncio.AbstractServer]:
    accepted: asyncio.Queue[StreamCarrier] = asyncio.Queue()

    async def on_client(reader, writer):
        await accepted.put(StreamCarrier(reader, writer, chunk=chunk))

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    return StreamCarrier(reader, writer, chunk=chunk), await asyncio.wait_for(accepted.get(), 5), server


async def _frame(carrier: StreamCarrier, transport, sizes: list[int]) -> bytes:
    """Read the carrier until the transport completes one frame (each read's size noted)."""
    while True:
        msg = await asyncio.wait_for(carrier.receive(), 5)
        assert msg.type == aiohttp.WSMsgType.BINARY
        sizes.append(len(msg.data))
        frames = transport.feed(msg.data)
        if frames:
            assert len(frames) == 1
            return frames[0]


async def test_a_v2_session_runs_on_a_raw_tcp_stream() -> None:
    """The handshake's units and the records go on the stream as they are (28.2): the links'
    Opening runs on the carrier unchanged, A initiator; frames then travel both ways, a
    large one in bounded reads; a close is seen as CLOSED by the other side."""
    chunk = 4096
    a, n, server = await _carrier_pair(chunk)
    try:
        deadline = time.monotonic() + 10
        hs_a, hs_n = _hs(ALICE, "initiator", expected_did=BOB.did), _hs(BOB, "responder", expected_did=ALICE.did)
        (t_a, rest_a), (t_n, rest_n) = await asyncio.gather(
            Opening(a, hs_a, deadline, Counter()).exchange(), Opening(n, hs_n, deadline, Counter()).exchange())
        assert hs_a.peer.did == BOB.did and hs_n.peer.did == ALICE.did
        assert t_a.handshake_hash == t_n.handshake_hash and rest_a == rest_n == []
        ping = b'{"type":"ping"}'
        await a.send_bytes(t_a.encrypt(ping))
        assert await _frame(n, t_n, []) == ping
        big = bytes(range(256)) * 800  # 204 800 bytes: four records, many reads
        await n.send_bytes(t_n.encrypt(big))
        sizes: list[int] = []
        assert await _frame(a, t_a, sizes) == big
        assert len(sizes) > 1 and max(sizes) <= chunk
        await a.close()
        assert (await asyncio.wait_for(n.receive(), 5)).type == aiohttp.WSMsgType.CLOSED
        with pytest.raises(ConnectionError):
            await a.send_bytes(b"\x00\x01x")
    finally:
        await n.close()
        server.close()
        await server.wait_closed()


def _dial_in_thread(local: tuple[str, int], peer_port: int, window: float, out: dict, key: str,
                    start: threading.Barrier) -> None:
    async def go():
        start.wait()
        now = time.monotonic()
        return await simultaneous_open(local, (f"tcp://127.0.0.1:{peer_port}",), now, now + window, 1_000_000)

    out[key] = asyncio.run(go())


def test_simultaneous_open_between_two_bound_ports() -> None:
    """Both sides connect, from their bound port P, to the other's P, and listen on P
    meanwhile. Whichever way the SYNs meet (crossing: simultaneous open; one reaching the
    other's listener: an accept) it is one connection, held by both sides; a SYN that
    arrives before the other side's port is open meets a reset and is sent again at once.
    So success does not hang on timing: only on both sides starting within the window.
    Each side is its own thread and event loop, as two nodes are."""
    holders = [bind_port("127.0.0.1"), bind_port("127.0.0.1")]  # the punch's ports, held as the driver does
    pa, pb = (h.getsockname()[1] for h in holders)
    out: dict = {}
    start = threading.Barrier(2)
    threads = [threading.Thread(target=_dial_in_thread, args=(("127.0.0.1", pa), pb, 10.0, out, "a", start)),
               threading.Thread(target=_dial_in_thread, args=(("127.0.0.1", pb), pa, 10.0, out, "b", start))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        (sa, ra), (sb, rb) = out["a"], out["b"]
        assert sa is not None and sb is not None, (ra, rb)
        # one connection: each end's peer is the other's port
        assert sa.getsockname()[1] == pa and sa.getpeername()[1] == pb
        assert sb.getsockname()[1] == pb and sb.getpeername()[1] == pa
        sa.setblocking(True), sb.setblocking(True)
        sa.sendall(b"punched")
        sb.settimeout(5)
        assert sb.recv(16) == b"punched"
    finally:
        for s in [*holders, *(v[0] for v in out.values() if v[0] is not None)]:
            s.close()


async def test_a_peer_that_never_dials_is_refused_within_the_syn_bound() -> None:
    """Its port is bound (not listening): every SYN meets a reset; the dialler stops at
    max_syns long before its window ends, and says "refused"."""
    holder, target = bind_port("127.0.0.1"), bind_port("127.0.0.1")
    try:
        now = time.monotonic()
        sock, reason = await simultaneous_open(holder.getsockname()[:2],
                                               (f"tcp://127.0.0.1:{target.getsockname()[1]}",), now, now + 60, 5)
        assert (sock, reason) == (None, "refused")
    finally:
        holder.close(), target.close()
