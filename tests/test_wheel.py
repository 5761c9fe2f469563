"""hmpnode outside the repository: the wheel builds, holds what the node reads at
run time, installs into a fresh virtual environment (as pip or pipx would) and a
node started from that install answers. Slow (~1 min: a venv and its dependencies)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from hmpnode import __version__
from tests.nodeproc import REPO, node_env

pytestmark = pytest.mark.slow

#: files the node opens at run time besides its modules
RUNTIME_FILES = ("hmpnode/api/openapi.json", "hmpnode/_schemas/container.schema.json",
                 "hmpnode/_schemas/classes/peer_announce.json", "hmpnode/_schemas/classes/diary_entry.json",
                 "hmpnode/memory/english.txt.gz")


def _run(*cmd: str, cwd: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, timeout=timeout, env=env)
    assert proc.returncode == 0, (cmd, proc.stdout.decode()[-2000:], proc.stderr.decode()[-4000:])
    return proc.stdout.decode()


def _outside_env() -> dict[str, str]:
    """The test nodes' environment, but nothing pointing into the repository."""
    env = node_env()
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(REPO)))
    return env


def test_wheel_installs_into_a_fresh_venv_and_runs_a_node(tmp_path):
    env = _outside_env()
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO), cwd=tmp_path,
         timeout=300, env=env)
    (wheel,) = dist.glob("hmpnode-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(RUNTIME_FILES) <= names, set(RUNTIME_FILES) - names
    assert not any(n.startswith(("tests/", "scripts/")) for n in names)

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", str(venv), cwd=tmp_path, timeout=120, env=env)
    _run(str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel), cwd=tmp_path, timeout=600,
         env=env)
    hmpnode = str(venv / "bin" / "hmpnode")
    assert _run(hmpnode, "--version", cwd=tmp_path, timeout=60, env=env).strip() == f"hmpnode {__version__}"
    where = json.loads(_run(str(venv / "bin" / "python"), "-c",
                            "import json, hmpnode, hmpnode.container.schema as s;"
                            "print(json.dumps([hmpnode.__file__, str(s.schema_dir())]))",
                            cwd=tmp_path, timeout=60, env=env))
    assert all(p.startswith(str(venv)) for p in where), where  # the installed copy, not the repo's

    data = tmp_path / "node"
    log = open(tmp_path / "node.log", "wb")
    proc = subprocess.Popen([hmpnode, "run", "--data-dir", str(data), "--api-port", "0"], cwd=tmp_path,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        info = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                info = json.loads((data / "node.json").read_bytes())
                if info.get("pid") == proc.pid:
                    break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.1)
        assert info and info.get("pid") == proc.pid, (tmp_path / "node.log").read_text()
        token = (data / "api.token").read_text().strip()
        request = urllib.request.Request(info["api"]["url"] + "/v1/health",
                                         headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 200 and json.loads(resp.read()) == {"ok": True}
        with urllib.request.urlopen(info["api"]["url"] + "/healthz", timeout=10) as resp:
            assert json.loads(resp.read()) == {"status": "ok"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()
