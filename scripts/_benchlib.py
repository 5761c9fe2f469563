"""What the benchmark scripts share."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def p50_p95(values: list[float]) -> dict[str, float]:
    """Milliseconds (or any sample) as {"p50", "p95"}, rounded to 0.01."""
    return {"p50": round(statistics.median(values), 2), "p95": round(percentile(values, 0.95), 2)}


def report(result: dict) -> int:
    """Print a benchmark's figures, one `key: value` line each, then all of them as one
    JSON line (the last line, for scripts that read it); exit status 0."""
    for key, value in result.items():
        print(f"{key}: {value}")
    print(json.dumps(result))
    return 0


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a usage error otherwise, not a traceback later)."""

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1."""
    return [positive_int(part) for part in text.split(",")]


def nonnegative_ints(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 0."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("values must be >= 0")
    return values


def rss_kib(pid: int) -> int:
    """VmRSS of process `pid`, in KiB."""
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


def start_node(data_dir: Path, env: dict[str, str], *, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """`hmpnode run` on `data_dir` with `env`, API on a free port, in a session of its own
    (so that it can be signalled as a group); wait for it with `wait_ready`."""
    return subprocess.Popen(
        [sys.executable, "-m", "hmpnode", "run", "--data-dir", str(data_dir), "--api-port", "0",
         "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True, env=env,
    )


def stop_node(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM to a node started by `start_node` (its whole group), SIGKILL if it is not
    gone within `timeout` seconds."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def wait_ready(data_dir: Path, proc: subprocess.Popen, deadline: float) -> dict:
    """node.json of a node started as `proc` (once it is ready), before `deadline` (monotonic)."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"node exited with {proc.returncode}")
        try:
            return json.loads((data_dir / "node.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            await asyncio.sleep(0.1)
    raise TimeoutError("node did not become ready")


@contextlib.asynccontextmanager
async def node_session(data_dir: Path, proc: subprocess.Popen, *, ready_s: float = 60, total_s: float = 600):
    """(API url, an aiohttp session holding the node's API token) of a node started by
    `start_node`, once it is ready."""
    import aiohttp

    info = await wait_ready(data_dir, proc, time.monotonic() + ready_s)
    token = (data_dir / "api.token").read_text().strip()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"},
                                     timeout=aiohttp.ClientTimeout(total=total_s)) as session:
        yield info["api"]["url"].rstrip("/"), session


@contextlib.asynccontextmanager
async def in_process_node(items: list, stored: int, clock, **options):
    """An in-process Node (hmpnode imported from sys.path as the caller set it) on a fresh
    temporary data dir, its verify workers started when `verify_processes` asks for them,
    holding `items[:stored]` (ingested 500 at a time); stopped and removed afterwards."""
    import shutil
    import tempfile

    from hmpnode.identity import Identity
    from hmpnode.node import Node

    tmp = tempfile.mkdtemp(prefix="hmpnode-probe-")
    node = Node(Identity(bytes(32)), Path(tmp), clock=clock, **options)
    await node.start()
    try:
        if options.get("verify_processes"):
            await node.verify_procs.start()
        for i in range(0, stored, 500):
            await node.ingest(items[i:i + 500])
        yield node
    finally:
        await node.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# -- instruction counts (valgrind cachegrind): a figure that does not move with the machine's load --


def ensure_valgrind() -> str | None:
    """Path of valgrind; installed with apt-get (quietly) when missing and we are root.
    None, after saying how to install it, when that is not possible."""
    import shutil

    found = shutil.which("valgrind")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing valgrind (apt-get) ...", file=sys.stderr)
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}}
        subprocess.run(["apt-get", "update", "-qq"], check=False, **quiet)
        subprocess.run(["apt-get", "install", "-y", "-qq", "valgrind"], check=False, **quiet)
        found = shutil.which("valgrind")
    if found is None:
        print("instruction counts skipped: valgrind is missing (install it: sudo apt-get install valgrind)",
              file=sys.stderr)
    return found


def cachegrind_ir(valgrind: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Instructions executed (Ir, every thread) by `argv` under cachegrind, without cache
    simulation. PYTHONHASHSEED is fixed so that two runs of one workload agree."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hmpnode-ir-") as tmp:
        out = Path(tmp) / "cachegrind.out"
        subprocess.run([valgrind, "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}", *argv],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONHASHSEED": "0", **(env or {})})
        for line in out.read_text().splitlines():
            if line.startswith("summary:"):
                return int(line.split()[1])
    raise RuntimeError("cachegrind wrote no summary")


def ir_per_op(script: str, data: bytes, modes: list[str], n: int) -> dict[str, int] | None:
    """Instructions per operation of each workload `mode` of `script` (run as
    `script --ir-work MODE --ir-data FILE`, FILE holding `data`, doing n operations),
    less those of mode "none" (the same process doing the same setup and no
    operation). None when valgrind is missing and cannot be installed."""
    import tempfile

    valgrind = ensure_valgrind()
    if valgrind is None:
        return None
    with tempfile.TemporaryDirectory(prefix="hmpnode-bench-") as tmp:
        path = Path(tmp) / "work"
        path.write_bytes(data)

        def ir(mode: str) -> int:
            return cachegrind_ir(valgrind, [sys.executable, script, "--ir-work", mode, "--ir-data", str(path)])

        base = ir("none")
        return {mode: round((ir(mode) - base) / n) for mode in modes}
