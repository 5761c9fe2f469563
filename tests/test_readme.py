"""The README's tour runs: its blocks marked `<!-- tour -->` are run in order, as one bash
script with `set -euo pipefail`, at the top of this repository (they call ./scripts/node),
with a temporary HOME and TMPDIR and the tour's data dirs (/tmp/alice, /tmp/bob) moved
under a temporary directory. The nodes keep to loopback on a discovery port of this run
(tests.nodeproc.LOOPBACK_MESH). Every process the script started is killed at the end
(its own process group); the script is bounded in time. What the tour prints is checked
for what it shows a newcomer: the refusals it shows, the note that reached bob, what
interests kept from alice, and no log line of the backgrounded nodes (their logs go to
files)."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.nodeproc import REPO, node_env

TOUR_TIMEOUT = 300.0
MARKER = "<!-- tour -->"
DATA_DIRS = re.compile(r"/tmp/(alice|bob)\b")
#: a line of a node's log (hmpnode.logs.TextFormatter): time, level, logger
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) +[\w.]+: ", re.M)


def tour_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, body) of each shell block right after a tour marker."""
    blocks = []
    for match in re.finditer("^" + re.escape(MARKER) + r"\n```(?:sh|bash)\n(.*?)```", text, re.S | re.M):
        blocks.append((text.count("\n", 0, match.start()) + 2, match.group(1)))
    return blocks


def _venv_current() -> bool:
    """Whether ./scripts/node would use the repository's .venv as it is (no install)."""
    stamp = REPO / ".venv" / ".hmpnode-installed"
    try:
        return stamp.read_text().strip() == hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()
    except OSError:
        return False


def tour_script(text: str, tmp: Path) -> str:
    lines = ["set -euo pipefail"]
    for number, body in tour_blocks(text):
        body = DATA_DIRS.sub(lambda m: f"{tmp}/{m.group(1)}", body)
        if not _venv_current():  # never install from the test: run the node of this interpreter's venv
            body = body.replace("./scripts/node", f"{sys.executable} -m hmpnode run")
        lines += [f"echo '=== README.md line {number}' >&2", body]
    return "\n".join(lines) + "\n"


def _untracked() -> set[str]:
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    return set(out.stdout.splitlines()) if out.returncode == 0 else set()


def test_tour_blocks_are_found():
    text = (REPO / "README.md").read_text()
    bodies = [body for _, body in tour_blocks(text)]
    assert len(bodies) >= 6 and len(re.findall("^" + re.escape(MARKER) + "$", text, re.M)) == len(bodies)
    tour = "".join(bodies)
    for needed in ("./scripts/node --data-dir /tmp/alice > /tmp/alice.log 2>&1 &", "hmpnode wait",
                   "--data-dir /tmp/bob --roles relay,mailman > /tmp/bob.log 2>&1 &", "interests set", "hmpnode stop --data-dir /tmp/alice"):
        assert needed in tour, needed
    # every node started in the background writes its log to a file, not into the shell
    for line in tour.splitlines():
        code = line.split("#")[0].rstrip()
        if re.search(r"(?<!&)&$", code):
            assert re.search(r"> \S+\.log 2>&1 &$", code), line
    assert "Qm..." not in tour and "python " not in tour  # real DIDs; one python spelling


def test_readme_tour_runs(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "tmp"
    work.mkdir()
    script = tmp_path / "tour.sh"
    script.write_text(tour_script((REPO / "README.md").read_text(), tmp_path))
    env = node_env(HOME=str(home), TMPDIR=str(work), HMPNODE_PEER_DISCOVERY_INTERVAL_MS="500")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    before = _untracked()
    log = tmp_path / "tour.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(script)], cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=TOUR_TIMEOUT)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _end_group(proc.pid)
    transcript = log.read_text(errors="replace")
    assert code == 0, f"the tour failed (exit {code}) after the block at:\n{_tail(transcript)}"
    assert "Traceback" not in transcript, _tail(transcript)
    # the refusals the tour shows did refuse (two offline, the goal not at bob's, the chat note
    # not at alice's); the note sent to bob arrived and was opened
    assert transcript.count("(exit 1)") == 4, _tail(transcript)
    assert '"for bob only"' in transcript, _tail(transcript)
    # alice declared interests: bob shows the one broadcast he kept from her, his index lists
    # it, and it comes once she wants everything again
    assert '"everything":false' in transcript and '"interests_withheld": 1' in transcript, _tail(transcript)
    kept = re.findall(r"^hmpnode: not_found: no container (\S+)$", transcript, re.M)
    assert len(kept) == 2, _tail(transcript)  # the goal at bob's, the chat note at alice's
    chat = re.escape(kept[1])
    assert re.search(r'^\{"peer":.*"' + chat + '"', transcript, re.M), _tail(transcript)  # peer-index
    assert re.search(r'^\{"did":"' + chat + '"', transcript, re.M), _tail(transcript)  # list --tag chat
    # the nodes' logs went to their files, none into the tour's shell
    assert not LOG_LINE.search(transcript), LOG_LINE.search(transcript).group(0)
    for name in ("alice", "bob"):
        assert "node ready" in (tmp_path / f"{name}.log").read_text(errors="replace"), name
    assert _untracked() == before, "the tour wrote into the repository"
    for name in ("alice", "bob"):
        assert not (tmp_path / name / "node.json").exists(), f"{name} did not stop cleanly"


def _end_group(pgid: int) -> None:
    """SIGTERM the script's process group (the nodes it started), then SIGKILL what is left."""
    for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _tail(transcript: str) -> str:
    marks = [m.start() for m in re.finditer(r"^=== README\.md line", transcript, re.M)]
    return transcript[marks[-1]:][-6000:] if marks else transcript[-6000:]
