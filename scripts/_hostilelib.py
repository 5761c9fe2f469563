"""Attacker's tools for scripts/bench_hostile.py (issue 10, lines 1-4): the material
(decompression bombs, zstd `container_index` messages, announces with fresh DIDs),
an authenticated peer connection that reports a refusal instead of raising, and
the meters (RSS with a ceiling, /v1/health latency, connection counters), with
a way to run any of them inside a network namespace built by tests/netns.py.

Nothing here sends traffic anywhere but to loopback or into namespaces the
benchmark created."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import nacl.utils  # noqa: E402
import orjson  # noqa: E402

from hmpnode.client import read_node_file  # noqa: E402
from hmpnode.container.build import build_container  # noqa: E402
from hmpnode.container.verify import Verifier, encode_wire  # noqa: E402
from hmpnode.identity import Identity  # noqa: E402
from hmpnode.net.announce import build_peer_announce  # noqa: E402
from hmpnode.net.mce import index_entry  # noqa: E402
from hmpnode.net.link import CLOSE_REFUSED  # noqa: E402
from hmpnode.net.connections import PEER_PATH  # noqa: E402
from hmpnode.net.transport import (PROLOGUE, PROTOCOL, KeyPair, NoiseHandshake, Transport,  # noqa: E402
                                   TransportError, UnitReader, make_announce_checker, make_payload)

MB = 1024 * 1024


def utc_now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


# -- material ---------------------------------------------------------------------------

#: what a bomb is made of: an ordinary-looking line, repeated (zstd shrinks it ~8000x);
#: no character JSON escapes, so the decompressed payload is the size asked for
_FILLER = "event=tick sensor=hostile-bench value=12345 unit=ms; "


def filler(size: int) -> str:
    return (_FILLER * (size // len(_FILLER) + 1))[:size]


def bomb_containers(identity: Identity, count: int, decompressed: int, *, tag: str = "b") -> list[dict[str, Any]]:
    """`count` signed broadcast `note` containers, zstd, each ~`decompressed` bytes once opened
    (each under the 16 MiB per-container limit, so each one alone is acceptable)."""
    now = utc_now()
    text = filler(decompressed - 64)
    return [build_container(identity, "note", {"text": text, "n": f"{tag}{i}"}, now=now, broadcast=True,
                            compression="zstd") for i in range(count)]


def index_bombs(identity: Identity, peer_did: str, count: int, decompressed: int, *,
                first: int = 0) -> list[dict[str, Any]]:
    """`count` distinct MCE `container_index` messages for `peer_did`, payload zstd,
    each ~`decompressed` bytes of made-up index entries once opened (numbered from
    `first`: messages of one sender must differ, a replay is refused)."""
    now = utc_now()
    entry = index_entry(build_container(identity, "note", {"text": "x"}, now=now)["hmp_container"])
    per = len(orjson.dumps(entry)) + 45  # one entry and its key
    n = max(1, decompressed // per)
    out = []
    for m in range(count):
        payload = {f"did:hmp:container:m{first + m:04d}x{i:020d}": entry for i in range(n)}
        out.append(build_container(identity, "container_index", payload, now=now, recipients=[peer_did],
                                   compression="zstd"))
    return out


def offer_messages(identity: Identity, peer_did: str, count: int, *, dids: int, payload_bytes: int,
                   first: int = 0) -> list[bytes]:
    """`count` `mce` frames (plain bytes, ready to encrypt), each a signed `container_index`
    for `peer_did` offering `dids` made-up container DIDs, payload zstd, its index entries
    padded (a `tags` list, as a real head may carry) so that the payload opens to just
    under `payload_bytes` (numbered from `first`: the DIDs, so the messages, all differ)."""
    now = utc_now()
    base = index_entry(build_container(identity, "note", {"text": "x"}, now=now)["hmp_container"])

    def payload(entry: dict[str, Any], m: int) -> dict[str, Any]:
        return {f"did:hmp:container:o{m:06d}x{i:039d}": entry for i in range(dids)}

    room = (payload_bytes - 1024 - len(orjson.dumps(payload(base, 0)))) // dids - len(',"tags":[]')
    full = max(0, min(room // 64, 1000))  # a head has at most 1 000 tags (schema)
    tags = ["t" * 61] * full  # 64 bytes each with quotes and comma
    if full < 1000 and room - 64 * full > 3:
        tags.append("t" * (room - 64 * full - 3))
    entry = {"head": {**base["head"], "tags": tags}} if tags else base
    if len(orjson.dumps(payload(entry, 0))) > payload_bytes:
        raise ValueError(f"{dids} DIDs do not fit in {payload_bytes} bytes")
    return [orjson.dumps({"type": "mce", "container": build_container(
        identity, "container_index", payload(entry, m), now=now, recipients=[peer_did], compression="zstd")})
        for m in range(first, first + count)]


def announce_datagram(identity: Identity, addresses: list[str]) -> bytes:
    """A LAN discovery datagram: the signed `peer_announce` of `identity` naming `addresses`."""
    return encode_wire(build_peer_announce(identity, addresses=addresses, now=utc_now()))


# -- an authenticated peer -----------------------------------------------------------------


@dataclass
class Refused:
    """How a connection attempt ended without a session: `kind` is http_<status>,
    error:<reason> (an error frame), closed, timeout or connect_error."""

    kind: str
    detail: str = ""


class Peer:
    """An authenticated (v2) session with the node under attack: frames go out and come
    in as the session's records."""

    def __init__(self, identity: Identity, ws: aiohttp.ClientWebSocketResponse, node_did: str,
                 transport: Transport, backlog: list[bytes]):
        self.identity, self.ws, self.node_did = identity, ws, node_did
        self.transport = transport
        self._backlog = backlog
        self.errors: list[str] = []

    @property
    def closed(self) -> bool:
        return self.ws.closed

    async def send(self, value: dict[str, Any] | bytes) -> bool:
        """False when the node has closed the connection."""
        data = value if isinstance(value, bytes) else orjson.dumps(value)
        try:
            await self.ws.send_bytes(self.transport.encrypt(data))
            return True
        except (ConnectionError, RuntimeError, aiohttp.ClientError, TransportError):
            return False

    async def drain(self, timeout: float = 0.0) -> list[tuple[str, Any]]:
        """Frames received so far (type, value), waiting at most `timeout` for the first."""
        out: list[tuple[str, Any]] = []
        while not self.ws.closed or self._backlog:
            if not self._backlog:
                try:
                    msg = await self.ws.receive(timeout=timeout if not out else 0.001)
                except (TimeoutError, asyncio.TimeoutError):
                    break
                if msg.type != aiohttp.WSMsgType.BINARY:
                    break
                try:
                    self._backlog += self.transport.feed(msg.data)
                except TransportError:
                    break
                continue
            value = orjson.loads(self._backlog.pop(0))
            kind = value.get("type")
            if kind == "error":
                self.errors.append(str(value.get("reason")))
                out.append(("error", value.get("reason")))
            elif kind == "mce":
                body = value["container"]["hmp_container"]
                out.append((body["head"]["class"], body.get("payload")))
            else:
                out.append((str(kind), value))
        return out

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close()


async def authenticate(http: aiohttp.ClientSession, host: str, port: int, identity: Identity, *,
                       addresses: list[str] | None = None, timeout: float = 15.0) -> Peer | Refused:
    """Open the peer endpoint and pass the v2 handshake as `identity` (a fresh DID costs
    only the announce's proof of work); a Peer once the node admitted it (its empty
    first frame), or how the node refused: http_<status>, error:<reason> (a refusal
    close during the handshake, or an error frame after it), closed, timeout."""
    now = utc_now()
    announce = build_peer_announce(identity, addresses=addresses or ["tcp://127.0.0.1:9"], now=now,
                                   protocols=[PROTOCOL])
    try:
        ws = await asyncio.wait_for(http.ws_connect(f"http://{host}:{port}{PEER_PATH}", max_msg_size=0), timeout)
    except aiohttp.WSServerHandshakeError as exc:
        return Refused(f"http_{exc.status}", exc.message or "")
    except (aiohttp.ClientError, OSError) as exc:
        return Refused("connect_error", type(exc).__name__)
    except asyncio.TimeoutError:
        return Refused("timeout", "opening the connection")
    static = KeyPair.generate(nacl.utils.random)
    hs = NoiseHandshake("initiator", static, PROLOGUE, make_payload(identity, orjson.dumps(announce), static.public),
                        nacl.utils.random, verify_announce=make_announce_checker(Verifier(), min_difficulty=3, now=now),
                        own_did=identity.did)
    reader, units, backlog = UnitReader(), [], []
    transport: Transport | None = None
    deadline = time.monotonic() + timeout
    try:
        while not backlog:
            if not hs.complete and hs.my_turn():
                await ws.send_bytes(hs.write_message())
                if hs.complete:
                    transport = hs.transport()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                await ws.close()
                return Refused("timeout", "handshake")
            msg = await ws.receive(timeout=remaining)
            if msg.type == aiohttp.WSMsgType.CLOSE and msg.data == CLOSE_REFUSED:
                await ws.close()
                return Refused(f"error:{msg.extra}", "refused during the handshake")
            if msg.type != aiohttp.WSMsgType.BINARY:
                await ws.close()
                return Refused("closed", str(msg.type))
            if transport is None:
                units += reader.feed(msg.data)
                while units and not hs.my_turn() and not hs.complete:
                    hs.read_message(units.pop(0))
            else:
                backlog += transport.feed(msg.data)
    except (asyncio.TimeoutError, TimeoutError):
        await ws.close()
        return Refused("timeout", "handshake")
    except TransportError as exc:
        await ws.close()
        return Refused(f"error:{exc.reason}", exc.detail[:200])
    except (ConnectionError, RuntimeError, aiohttp.ClientError) as exc:
        await ws.close()
        return Refused("closed", type(exc).__name__)
    first = backlog.pop(0)
    if first:  # the node's verdict is an error frame: refused after the handshake
        value = orjson.loads(first)
        await ws.close()
        return Refused(f"error:{value.get('reason')}", str(value.get("detail", ""))[:200])
    assert hs.peer is not None and transport is not None
    return Peer(identity, ws, hs.peer.did, transport, backlog)


# -- network namespaces --------------------------------------------------------------------

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def enter_netns(name: str) -> None:
    """Move the calling thread (only it) into network namespace `name`: the sockets
    it creates from now on live there."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


class LoopThread:
    """An asyncio loop in its own thread, optionally inside a network namespace;
    `call(coro_fn, ...)` runs a coroutine there and returns its result."""

    def __init__(self, netns: str | None = None, name: str = "loop"):
        self.netns = netns
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            if self.netns:
                enter_netns(self.netns)
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            self._error = exc
            self._ready.set()
            return
        asyncio.set_event_loop(self.loop)
        self._ready.set()
        self.loop.run_forever()

    def call(self, fn: Callable[..., Awaitable[Any]], *args: Any, timeout: float | None = 600, **kwargs: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), self.loop).result(timeout)

    def submit(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any):
        """Start it and return a concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), self.loop)

    def close(self) -> None:
        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


class ConnectionCounter:
    """TCP listeners that count the connections arriving (and close them at once):
    they stand for hosts the node must not dial. Run on a LoopThread."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.first: dict[str, float] = {}
        self._servers: list[asyncio.AbstractServer] = []

    async def listen(self, label: str, host: str, port: int) -> None:
        self.counts.setdefault(label, 0)

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.counts[label] += 1
            self.first.setdefault(label, time.monotonic())
            writer.close()

        self._servers.append(await asyncio.start_server(on_connect, host, port, reuse_address=True))

    async def close(self) -> None:
        for server in self._servers:
            server.close()
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._servers.clear()


# -- meters --------------------------------------------------------------------------------


def _status_kib(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1])
    except OSError:
        pass
    return out


@dataclass
class _Watched:
    pid: int
    kill: Callable[[], None]
    base_kib: int = 0
    peak_kib: int = 0
    exceeded: bool = False
    killed_at: float | None = None


class RssWatch:
    """Samples VmRSS of the watched node processes every `every` s; a process over
    `ceiling_kib` is SIGKILLed (the machine is shared) and marked exceeded. `reset`
    starts a measurement: it clears the kernel's peak (VmHWM, via clear_refs) and
    records the current RSS; `growth` is then max(sampled peak, VmHWM) - that RSS."""

    def __init__(self, ceiling_kib: int, every: float = 0.05):
        self.ceiling_kib = ceiling_kib
        self.every = every
        self.watched: dict[str, _Watched] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)
        self._thread.start()

    def watch(self, name: str, pid: int, kill: Callable[[], None]) -> None:
        with self._lock:
            self.watched[name] = _Watched(pid, kill)
        self.reset(name)

    def unwatch(self, name: str) -> None:
        with self._lock:
            self.watched.pop(name, None)

    def reset(self, name: str) -> None:
        w = self.watched[name]
        with contextlib.suppress(OSError):
            with open(f"/proc/{w.pid}/clear_refs", "w") as fh:
                fh.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        rss = _status_kib(w.pid).get("VmRSS", 0)
        with self._lock:
            w.base_kib = w.peak_kib = rss

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            with self._lock:
                items = list(self.watched.values())
            for w in items:
                if w.exceeded:
                    continue
                st = _status_kib(w.pid)
                rss = max(st.get("VmRSS", 0), st.get("VmHWM", 0))
                if rss > w.peak_kib:
                    w.peak_kib = rss
                if rss > self.ceiling_kib:
                    w.exceeded = True
                    w.killed_at = time.monotonic()
                    w.kill()

    def report(self, name: str) -> dict[str, Any]:
        w = self.watched[name]
        if not w.exceeded:
            st = _status_kib(w.pid)
            w.peak_kib = max(w.peak_kib, st.get("VmHWM", 0), st.get("VmRSS", 0))
        return {"rss_before_mb": round(w.base_kib / 1024, 1), "rss_peak_mb": round(w.peak_kib / 1024, 1),
                "rss_growth_mb": round((w.peak_kib - w.base_kib) / 1024, 1), "exceeded": w.exceeded}

    def exceeded(self, name: str) -> bool:
        w = self.watched.get(name)
        return bool(w and w.exceeded)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class HealthProbe:
    """GET /v1/health of one node on a fixed schedule (every `every` s, open loop: a
    probe is sent when due whether or not the earlier ones were answered, so that a
    stalled node shows as many slow probes, not as one), each timed from when it was
    due. Runs in a process of its own (`python scripts/_hostilelib.py probe ...`,
    inside the node's namespace if given): the benchmark's own work never delays it."""

    def __init__(self, data_dir: Path, netns: str | None = None, every: float = 0.05, timeout: float = 30.0):
        import subprocess

        info, token = read_node_file(data_dir)
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self.samples: list[tuple[float, float, str]] = []  # (due, seconds, "ok" | "timeout" | "error")
        self.pending: set[float] = set()  # due times of probes sent and not answered yet
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(Path(__file__).resolve()), "probe", info["api"]["url"],
             str(Path(data_dir) / "api.token"), str(every), str(timeout)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        assert token
        self._reader = threading.Thread(target=self._read, name="health", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split()
            if parts[0] == b"s":  # sent, not answered yet
                self.pending.add(float(parts[1]))
            else:
                due = float(parts[1])
                self.pending.discard(due)
                self.samples.append((due, float(parts[2]), parts[3].decode()))

    def mark(self) -> float:
        return time.monotonic()

    def window(self, since: float, until: float | None = None) -> dict[str, Any]:
        """Latency of the probes due in [since, until]: answered ones, timed-out ones (at
        the timeout) and those still unanswered now (at least their age). Probes that
        failed otherwise (connection refused: a node killed at the RSS ceiling) are
        counted as errors, not as latencies."""
        now = time.monotonic()
        until = until if until is not None else now
        inside = [(s, kind) for t, s, kind in list(self.samples) if since <= t <= until]
        waiting = [now - t for t in list(self.pending) if since <= t <= until]
        ms = [s * 1000 for s, kind in inside if kind != "error"] + [s * 1000 for s in waiting]
        errors = sum(1 for _, kind in inside if kind == "error")
        if not ms:
            return {"probes": 0, "errors": errors}
        from _benchlib import percentile

        return {"probes": len(ms), "errors": errors, "unanswered": len(waiting),
                "timeouts": sum(1 for _, kind in inside if kind == "timeout"),
                "p50_ms": round(percentile(ms, 0.5), 1), "p90_ms": round(percentile(ms, 0.9), 1),
                "p99_ms": round(percentile(ms, 0.99), 1), "max_ms": round(max(ms), 1)}

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(self.timeout_s)
            except Exception:  # noqa: BLE001
                kill_group(self.proc.pid)
                self.proc.wait(5)
        self._reader.join(5)

    timeout_s = 40.0


class LoopLagSampler:
    """The node's own event-loop lag gauge (`loop_lag_seconds` of /v1/status: how late its
    0.1 s timer fired, `last` and `max` since the node started), read every `every` s on a
    task of the caller's loop. A window's figures: the `last` samples as p50/p99/max in
    ms, and `gauge_max_ms`, the node's own `max` when it rose during the window (None
    when it did not: nothing in the window was later than what came before). Each read
    costs the node one status answer, the same in every window compared."""

    def __init__(self, client: Any, every: float = 0.1):
        self.client, self.every = client, every
        self.samples: list[tuple[float, float, float]] = []  # (monotonic, last, max) in seconds
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a node that does not answer: no sample
                lag = (await asyncio.wait_for(self.client.status(), 10))["loop_lag_seconds"]
                self.samples.append((time.monotonic(), lag["last"], lag["max"]))
            await asyncio.sleep(self.every)

    def window(self, since: float, until: float | None = None) -> dict[str, Any]:
        until = until if until is not None else time.monotonic()
        inside = [(last, top) for t, last, top in self.samples if since <= t <= until]
        if not inside:
            return {"samples": 0}
        from _benchlib import percentile

        ms = [last * 1000 for last, _ in inside]
        before = max((top for t, _, top in self.samples if t < since), default=0.0)
        top = inside[-1][1]
        return {"samples": len(ms), "p50_ms": round(percentile(ms, 0.5), 1), "p99_ms": round(percentile(ms, 0.99), 1),
                "max_ms": round(max(ms), 1), "gauge_max_ms": round(top * 1000, 1) if top > before else None}

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def _probe_main(url: str, token_file: str, every: float, timeout: float) -> None:
    """The probe process: GET url/v1/health every `every` s until stdin closes;
    lines on stdout: "s DUE" when a probe is sent, "d DUE SECONDS ok|timeout|error" when
    it ends (DUE: monotonic seconds, comparable across processes)."""
    token = Path(token_file).read_text("ascii").strip()
    headers = {"Authorization": f"Bearer {token}"}
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not os.read(sys.stdin.fileno(), 4096) else None)
    out = sys.stdout

    async def one(http: aiohttp.ClientSession, due: float) -> None:
        kind = "error"
        out.write(f"s {due:.6f}\n")
        out.flush()
        try:
            async with http.get(url.rstrip("/") + "/v1/health", headers=headers) as resp:
                await resp.read()
                kind = "ok" if resp.status == 200 else "error"
        except asyncio.TimeoutError:
            kind = "timeout"
        except (aiohttp.ClientError, OSError):
            pass
        out.write(f"d {due:.6f} {time.monotonic() - due:.6f} {kind}\n")
        out.flush()

    tasks: set[asyncio.Task] = set()
    connector = aiohttp.TCPConnector(limit=512)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        t0, k = time.monotonic(), 0
        while not stop.is_set():
            due = t0 + k * every
            k += 1
            delay = due - time.monotonic()
            if delay > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                if stop.is_set():
                    break
            elif delay < -1.0:  # this process itself was held up: skip, do not burst
                t0, k = time.monotonic(), 1
                due = t0
            task = asyncio.create_task(one(http, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout + 1)


def kill_group(pid: int) -> None:
    """SIGKILL the process group of a node we started (it runs in its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


@dataclass
class Tally:
    """Outcomes of connection attempts by kind (connected, http_503, error:banned, ...)."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, outcome: Peer | Refused) -> None:
        kind = "connected" if isinstance(outcome, Peer) else outcome.kind
        self.counts[kind] = self.counts.get(kind, 0) + 1


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "probe":
        asyncio.run(_probe_main(sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])))
    else:
        sys.exit("usage: _hostilelib.py probe URL TOKEN_FILE EVERY TIMEOUT")
