"""The fault proxy of the delivery tests (tests/faultproxy.py) against an echo server:
what each fault does to a connection, and that a seeded proxy flips the same bit."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.faultproxy import BINARY, FaultProxy, read_frame, ws_frame

UPGRADE = b"GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n"


@pytest.fixture
async def echo():
    """A server that sends back every byte it gets (so the HTTP head too: both
    directions read as a WebSocket connection)."""
    async def serve(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


@pytest.fixture
async def proxy(echo):
    p = FaultProxy(echo, rng=random.Random(7))
    await p.start()
    yield p
    await p.close()


async def _connect(proxy: FaultProxy):
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(UPGRADE)
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == UPGRADE
    return reader, writer


async def _echoed(reader, writer, payload: bytes, timeout: float = 5):
    writer.write(ws_frame(BINARY, payload, masked=False))
    frame = await asyncio.wait_for(read_frame(reader), timeout)
    return frame.data[frame.header:]


async def _nothing_within(reader, seconds: float) -> bool:
    try:
        await asyncio.wait_for(reader.read(1), seconds)
    except asyncio.TimeoutError:
        return True
    return False


async def test_frames_go_both_ways_in_order_and_no_sooner_than_the_latency(proxy):
    reader, writer = await _connect(proxy)
    proxy.latency(0.4, 0.2)
    for i in range(20):
        writer.write(ws_frame(BINARY, bytes([i]) * (1 + i * 100), masked=False))
    assert await _nothing_within(reader, 0.3)  # each way waits >= 0.4 s
    got = [await asyncio.wait_for(read_frame(reader), 10) for _ in range(20)]
    assert [f.data[f.header:] for f in got] == [bytes([i]) * (1 + i * 100) for i in range(20)]
    writer.close()


async def test_a_stall_holds_everything_back_and_keeps_the_connection(proxy):
    reader, writer = await _connect(proxy)
    proxy.stall(1.0)
    writer.write(ws_frame(BINARY, b"held", masked=False))
    assert await _nothing_within(reader, 0.5)
    frame = await asyncio.wait_for(read_frame(reader), 5)
    assert frame.data[frame.header:] == b"held" and len(proxy.live) == 1
    writer.close()


async def test_a_reset_cuts_both_sides_with_a_rst(proxy):
    reader, writer = await _connect(proxy)
    proxy.reset()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(1), 5)
    assert proxy.resets == 1 and not proxy.live
    writer.close()


@pytest.mark.parametrize("mode", ["refuse", "blackhole"])
async def test_a_partition_cuts_what_is_open_and_lets_nothing_through_until_it_ends(proxy, mode):
    reader, writer = await _connect(proxy)
    proxy.partition(mode)
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(1), 5)
    other_reader, other_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    other_writer.write(UPGRADE)
    if mode == "refuse":
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(other_reader.read(1), 5)
    else:
        assert await _nothing_within(other_reader, 0.5)
    proxy.partition(None)
    if mode == "blackhole":  # what hung is cut when the partition ends
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(other_reader.read(1), 5)
    reader, writer = await _connect(proxy)
    assert await _echoed(reader, writer, b"back") == b"back"
    writer.close()


async def _flipped(proxy: FaultProxy, to_server: bool) -> tuple[int, int]:
    """(byte, bit) the proxy flipped in a 64-byte frame of zeros, after a smaller one it left alone."""
    reader, writer = await _connect(proxy)
    done = proxy.flip(to_server, min_size=10)
    assert await _echoed(reader, writer, bytes(5)) == bytes(5)
    got = await _echoed(reader, writer, bytes(64))
    assert (await done) is proxy.connections[-1]
    assert await _echoed(reader, writer, bytes(64)) == bytes(64)  # one flip only
    writer.close()
    (at,) = [i for i, b in enumerate(got) if b]
    assert bin(got[at]).count("1") == 1
    return at, got[at].bit_length() - 1


@pytest.mark.parametrize("to_server", [True, False], ids=["to_server", "to_client"])
async def test_a_seeded_proxy_flips_one_bit_the_same_way_each_time(echo, to_server):
    runs = []
    for _ in range(2):
        p = FaultProxy(echo, rng=random.Random(21))
        await p.start()
        try:
            runs.append(await _flipped(p, to_server))
            assert len(p.flips) == 1
        finally:
            await p.close()
    assert runs[0] == runs[1]


async def test_heal_ends_every_fault(proxy):
    reader, writer = await _connect(proxy)
    proxy.latency(5.0)
    proxy.stall(5.0)
    pending = proxy.flip(False)
    proxy.heal()
    assert await _echoed(reader, writer, bytes(8), timeout=2) == bytes(8)
    assert pending.cancelled()
    writer.close()
