"""A TCP proxy on loopback that breaks one peer link on demand (tests and scripts).

A `FaultProxy` is one link: it listens on `host`, and forwards each connection it
accepts to `target_port` on `target_host`, dialling from `host` too, so that both
nodes see the proxy's address and a session that went around it shows another
one. It reads each direction as the peers speak it (the HTTP upgrade, then
WebSocket frames; anything else passes as raw chunks), so that a fault can aim
at a frame. Faults, each until `heal()`:

- `latency(delay, jitter)`: every frame waits `delay` + up to `jitter` seconds
  (order kept; reading goes on meanwhile, so it is latency, not a throttle);
- `stall(seconds)`: nothing is forwarded for a while; the connections stay up;
- `reset()`: every current connection is cut with a RST on both sides;
- `partition("refuse" | "blackhole")`: current connections are reset; new ones
  are reset at once, or accepted and left hanging (forwarded nowhere) until the
  partition ends;
- `flip(to_server)`: one bit of the payload of the next binary frame in that
  direction is flipped (a future tells which connection it hit).

Randomness (jitter, where a bit is flipped) comes from the `rng` given, so a
seeded run makes the same choices. Subclasses may watch or rewrite what goes
through (`admit`, `forward`, `finish`: tests/test_mesh_v2.py's attacks).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
from dataclasses import dataclass

__all__ = ["HEAD", "RAW", "Frame", "ws_frame", "flip_bit", "read_frame", "Connection", "FaultProxy"]

#: the opcode given to the HTTP upgrade request/response, and to chunks of a non-WebSocket stream
HEAD, RAW = -1, -2
BINARY = 0x2
_RAW_CHUNK = 65536
_DOWN = (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError)


@dataclass(frozen=True, slots=True)
class Frame:
    """One unit read from a stream: a WebSocket frame as sent (header, mask, payload), or the HTTP head."""

    data: bytes
    opcode: int
    #: bytes before the payload
    header: int

    @property
    def size(self) -> int:
        return len(self.data) - self.header


def ws_frame(opcode: int, payload: bytes, masked: bool) -> bytes:
    """One WebSocket frame (RFC 6455 5.2), FIN set; a client's frames are masked."""
    head = bytes([0x80 | opcode])
    n = len(payload)
    mbit = 0x80 if masked else 0
    if n < 126:
        head += bytes([mbit | n])
    elif n < 65536:
        head += bytes([mbit | 126]) + struct.pack(">H", n)
    else:
        head += bytes([mbit | 127]) + struct.pack(">Q", n)
    if not masked:
        return head + payload
    key = random.randbytes(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def flip_bit(frame: Frame, at: int, bit: int) -> Frame:
    """`frame` with bit `bit` of its payload byte `at` flipped (a masked payload byte
    flips the same bit of the unmasked one)."""
    i = frame.header + at
    return Frame(frame.data[:i] + bytes([frame.data[i] ^ (1 << bit)]) + frame.data[i + 1:], frame.opcode, frame.header)


async def read_frame(reader: asyncio.StreamReader, mode: int = BINARY) -> Frame:
    """The next unit of a stream: `mode` HEAD reads the HTTP head, RAW a chunk, else a WebSocket frame."""
    if mode == HEAD:
        head = await reader.readuntil(b"\r\n\r\n")
        return Frame(head, HEAD, len(head))
    if mode == RAW:
        chunk = await reader.read(_RAW_CHUNK)
        if not chunk:
            raise asyncio.IncompleteReadError(b"", None)
        return Frame(chunk, RAW, 0)
    b0, b1 = await reader.readexactly(2)
    size = b1 & 0x7F
    ext = b""
    if size == 126:
        ext = await reader.readexactly(2)
        size = struct.unpack(">H", ext)[0]
    elif size == 127:
        ext = await reader.readexactly(8)
        size = struct.unpack(">Q", ext)[0]
    mask = await reader.readexactly(4) if b1 & 0x80 else b""
    body = await reader.readexactly(size)
    return Frame(bytes([b0, b1]) + ext + mask + body, b0 & 0x0F, 2 + len(ext) + len(mask))


def _rst(writer: asyncio.StreamWriter | None) -> None:
    """Close with a RST (SO_LINGER 0), not a FIN."""
    if writer is None or writer.transport.is_closing():
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class Connection:
    """One accepted connection: the client's streams and, once dialled, the target's."""

    def __init__(self, index: int, client: tuple[asyncio.StreamReader, asyncio.StreamWriter]):
        self.index = index
        self.client_reader, self.client_writer = client
        self.server_reader: asyncio.StreamReader | None = None
        self.server_writer: asyncio.StreamWriter | None = None
        self.opened = time.monotonic()
        #: when both directions ended or the proxy cut it (monotonic), None while it lasts
        self.ended: float | None = None
        self.tasks: list[asyncio.Task] = []
        self._directions = 2

    def writer(self, to_server: bool) -> asyncio.StreamWriter | None:
        return self.server_writer if to_server else self.client_writer

    async def send(self, to_server: bool, data: bytes) -> None:
        """Write towards one side; nothing once that side is closed."""
        writer = self.writer(to_server)
        if writer is None or writer.transport.is_closing():
            return
        writer.write(data)
        with contextlib.suppress(*_DOWN):
            await writer.drain()

    def close_side(self, to_server: bool) -> None:
        """A FIN towards one side (its peer ended the other direction)."""
        writer = self.writer(to_server)
        if writer is not None and not writer.transport.is_closing():
            writer.close()

    def reset(self) -> None:
        _rst(self.client_writer)
        _rst(self.server_writer)
        self._end()

    def _direction_done(self) -> None:
        self._directions -= 1
        if self._directions <= 0:
            self._end()

    def _end(self) -> None:
        if self.ended is None:
            self.ended = time.monotonic()


@dataclass(slots=True)
class _Flip:
    to_server: bool
    min_size: int
    offset: float | None
    done: asyncio.Future


class FaultProxy:
    """One link (module docstring)."""

    def __init__(self, target_port: int, *, target_host: str = "127.0.0.1", host: str = "127.0.0.1",
                 rng: random.Random | None = None, name: str = ""):
        self.target_host, self.target_port = target_host, target_port
        self.host = host
        self.rng = rng or random.Random()
        self.name = name
        self.port = 0
        self.connections: list[Connection] = []
        #: (connection, when) of every flip made
        self.flips: list[tuple[Connection, float]] = []
        self.resets = 0
        self._delay = self._jitter = 0.0
        self._flow = asyncio.Event()
        self._flow.set()
        self._stall_timer: asyncio.TimerHandle | None = None
        self._partition: str | None = None
        self._hanging: list[Connection] = []
        self._armed: list[_Flip] = []
        self._server: asyncio.AbstractServer | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._accept, self.host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.heal()
        tasks = [t for c in self.connections for t in c.tasks]
        for conn in self.connections:
            conn.reset()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for flip in self._armed:
            flip.done.cancel()
        self._armed.clear()

    @property
    def live(self) -> list[Connection]:
        return [c for c in self.connections if c.ended is None]

    # -- faults ----------------------------------------------------------------------------

    def latency(self, delay: float, jitter: float = 0.0) -> None:
        self._delay, self._jitter = max(0.0, delay), max(0.0, jitter)

    def stall(self, seconds: float) -> None:
        """Forward nothing for `seconds` (a later stall that ends later extends it)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        if self._stall_timer is not None:
            if self._stall_timer.when() >= until:
                return
            self._stall_timer.cancel()
        self._flow.clear()
        self._stall_timer = loop.call_at(until, self._resume)

    def _resume(self) -> None:
        self._stall_timer = None
        self._flow.set()

    def reset(self) -> None:
        """RST every current connection, both sides."""
        for conn in self.live:
            conn.reset()
            self.resets += 1

    def partition(self, mode: str | None) -> None:
        """"refuse" or "blackhole" from now on (current connections are reset), None: over."""
        if mode not in (None, "refuse", "blackhole"):
            raise ValueError(f"partition mode: {mode!r}")
        if mode is not None:
            self.reset()
        else:
            for conn in self._hanging:
                conn.reset()
            self._hanging.clear()
        self._partition = mode

    def flip(self, to_server: bool, *, min_size: int = 1, offset: float | None = None) -> asyncio.Future:
        """Flip one bit of the payload of the next binary frame of at least `min_size`
        bytes going that way: at `offset` (a fraction of the payload) or anywhere, a
        random bit. The future gives the Connection hit."""
        done = asyncio.get_running_loop().create_future()
        self._armed.append(_Flip(to_server, max(1, min_size), offset, done))
        return done

    def heal(self) -> None:
        """Every fault off (armed flips are dropped); live connections go on as they are."""
        self._delay = self._jitter = 0.0
        if self._stall_timer is not None:
            self._stall_timer.cancel()
        self._resume()
        self.partition(None)
        for flip in self._armed:
            flip.done.cancel()
        self._armed.clear()

    # -- hooks for subclasses --------------------------------------------------------------

    def admit(self, conn: Connection) -> bool:
        """Whether to forward this connection (else it is closed)."""
        return True

    async def forward(self, conn: Connection, to_server: bool, frame: Frame) -> None:
        """Deliver one unit (after latency, stalls and a flip)."""
        await conn.send(to_server, frame.data)

    async def finish(self, conn: Connection, to_server: bool) -> None:
        """The other side ended this direction."""
        conn.close_side(to_server)

    # -- the forwarding ----------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(len(self.connections), (reader, writer))
        self.connections.append(conn)
        if self._partition == "refuse":
            conn.reset()
            return
        if self._partition == "blackhole":
            self._hanging.append(conn)
            return
        if not self.admit(conn):
            writer.close()
            conn._end()
            return
        try:
            conn.server_reader, conn.server_writer = await asyncio.open_connection(
                self.target_host, self.target_port, local_addr=(self.host, 0))
        except OSError:
            conn.reset()
            return
        if conn.ended is not None:  # reset while dialling
            _rst(conn.server_writer)
            return
        conn.tasks = [asyncio.ensure_future(self._direction(conn, True)),
                      asyncio.ensure_future(self._direction(conn, False))]

    def _ready_at(self, last: float) -> float:
        now = asyncio.get_running_loop().time()
        return max(last, now + self._delay + self._jitter * self.rng.random())

    async def _direction(self, conn: Connection, to_server: bool) -> None:
        """Read one direction into a queue; a second task delivers it in order, each unit
        when its latency has passed and no stall is on."""
        src = conn.client_reader if to_server else conn.server_reader
        assert src is not None
        queue: asyncio.Queue[tuple[float, Frame | None]] = asyncio.Queue()
        deliver = asyncio.ensure_future(self._deliver(conn, to_server, queue))
        conn.tasks.append(deliver)
        last = 0.0
        mode = HEAD
        try:
            while True:
                frame = await read_frame(src, mode)
                if mode == HEAD:
                    mode = BINARY if b"upgrade: websocket" in frame.data.lower() else RAW
                last = self._ready_at(last)
                queue.put_nowait((last, frame))
        except _DOWN:
            pass
        queue.put_nowait((self._ready_at(last), None))
        await deliver

    async def _deliver(self, conn: Connection, to_server: bool, queue: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                ready_at, frame = await queue.get()
                wait = ready_at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._flow.wait()
                if frame is None:
                    await self.finish(conn, to_server)
                    return
                await self.forward(conn, to_server, self._flipped(conn, to_server, frame))
        finally:
            conn._direction_done()

    def _flipped(self, conn: Connection, to_server: bool, frame: Frame) -> Frame:
        if frame.opcode != BINARY:
            return frame
        for flip in self._armed:
            if flip.to_server == to_server and frame.size >= flip.min_size and not flip.done.done():
                self._armed.remove(flip)
                at = int(frame.size * flip.offset) if flip.offset is not None else self.rng.randrange(frame.size)
                self.flips.append((conn, time.monotonic()))
                flip.done.set_result(conn)
                return flip_bit(frame, min(at, frame.size - 1), self.rng.randrange(8))
        return frame
