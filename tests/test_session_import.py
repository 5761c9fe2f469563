"""The peer session imports as a pure module: neither the store (sqlite3) nor the event loop
(asyncio) comes with it, so a simulator or another driver can use it as it is."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_session_pulls_in_neither_sqlite3_nor_asyncio():
    code = ("import sys, hmpnode.net.session; "
            "bad = sorted(m for m in ('sqlite3', 'asyncio') if m in sys.modules); "
            "assert not bad, f'imported: {bad}'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
