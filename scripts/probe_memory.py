"""Where an idle node's memory goes: one `hmpnode run` at a time, on loopback, under
variants that remove what the brief's stack loads, against the bare interpreter
and the bare imports (issue 4's target: <= 40 MB RSS per idle node).

Variants (the last two are experiments, not supported ways to run a node):
  node          `hmpnode run` as shipped
  no-openssl    the same process with ssl, _ssl and _hashlib unimportable: aiohttp and
                asyncio then skip TLS, hashlib falls back to Python's own SHA-2
  no-openssl-OO the same under `python -OO` (docstrings and asserts stripped)

Each node is measured after it has been idle for --idle seconds (its first heap
trims are done by then), as VmRSS and as PSS (shared pages divided among the
processes that map them). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.nodeproc import node_env  # noqa: E402

NO_OPENSSL = "import sys; sys.modules.update(ssl=None, _ssl=None, _hashlib=None); "
RUN = "from hmpnode.cli import main; sys.argv = ['hmpnode', 'run', '--data-dir', sys.argv[1], '--api-port', '0']; main()"
IMPORTS = ("import sys, asyncio, aiohttp.web, nacl.bindings, zstandard, orjson, sqlite3, kademlia.network, time; "
           "sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)")
BARE = "import sys, time; sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)"

VARIANTS = {
    "python": ([], BARE),
    "imports": ([], IMPORTS),
    "node": ([], "import sys; " + RUN),
    "no-openssl": ([], NO_OPENSSL + RUN),
    "no-openssl-OO": (["-OO"], NO_OPENSSL + RUN),
}


def memory_kib(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as fh:
        rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        pss = next(int(line.split()[1]) for line in fh if line.startswith("Pss:"))
    return {"rss": rss, "pss": pss}


def measure(name: str, idle: float) -> dict[str, float]:
    flags, code = VARIANTS[name]
    with tempfile.TemporaryDirectory(prefix="hmpnode-mem-") as tmp:
        data_dir = Path(tmp) / "node"
        proc = subprocess.Popen([sys.executable, *flags, "-c", code, str(data_dir)], env=node_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            if name in ("python", "imports"):
                assert proc.stdout is not None
                proc.stdout.readline()
            else:
                while not (data_dir / "node.json").exists():
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{name}: the node did not start (exit {proc.poll()})")
                    time.sleep(0.1)
            time.sleep(idle)
            kib = memory_kib(proc.pid)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {"rss_mb": round(kib["rss"] / 1024, 1), "pss_mb": round(kib["pss"] / 1024, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=float, default=15.0, help="seconds idle before measuring (default 15)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    results = {}
    for name in names:
        results[name] = measure(name, args.idle if name not in ("python", "imports") else 0.5)
        print(f"{name:14s} RSS {results[name]['rss_mb']:5.1f} MB   PSS {results[name]['pss_mb']:5.1f} MB", flush=True)
    print(json.dumps({"idle_s": args.idle, "python": sys.version.split()[0], "variants": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
