"""What the benchmark scripts share."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a usage error otherwise, not a traceback later)."""
    import argparse

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
