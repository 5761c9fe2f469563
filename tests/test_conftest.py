"""What tests/conftest.py and the pytest settings promise the whole suite: skips for want of
../shared reported once; a run cleans up its temporary files and names what a test left."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODES = pytest.mark.parametrize("mode", [["-p", "no:xdist"], ["-n", "2"]], ids=["one-process", "xdist"])


def _clone(root: Path, files: dict[str, str]) -> Path:
    """The suite's settings and conftest, and `files` (tests/NAME: text, or None for the
    repo's file), in a tree of their own with no ../shared beside it (nor docs/)."""
    clone = root / "clone"
    (clone / "tests").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", clone)
    for name in ("__init__.py", "conftest.py"):
        shutil.copy(REPO / "tests" / name, clone / "tests")
    for name, text in files.items():
        if text is None:
            shutil.copy(REPO / "tests" / name, clone / "tests")
        else:
            (clone / "tests" / name).write_text(text)
    assert not (root / "shared").exists()
    return clone


def _pytest(clone: Path, mode: list[str], *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HMPNODE_"))}
    return subprocess.run([sys.executable, "-m", "pytest", *mode, "-p", "no:cacheprovider",
                           "-p", "no:randomly", *args], cwd=clone, env={**base, **env},
                          capture_output=True, text=True, timeout=300)


@MODES
def test_the_tests_that_need_shared_are_skipped_with_one_summary_line(tmp_path, mode):
    clone = _clone(tmp_path, {"test_spec_examples.py": None})
    proc = _pytest(clone, mode, "tests/test_spec_examples.py")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1, "\n".join(skipped) or out
    assert skipped[0].startswith("SKIPPED [4] ") and "../shared" in skipped[0], skipped[0]
    assert "is not beside the repo" in skipped[0], skipped[0]
    assert "4 skipped" in out.splitlines()[-1], out


LEAKY = '''
import os
import tempfile


def test_a_store_in_tmp_path(tmp_path):
    (tmp_path / "store.db").write_bytes(b"x" * 100_000)


def test_a_file_left_in_the_temp_dir():
    directory = tempfile.mkdtemp(prefix="leaky-")
    with open(os.path.join(directory, "left"), "wb") as fh:
        fh.write(b"y" * 1234)
'''


@MODES
def test_a_passing_run_leaves_no_temporary_files_and_names_what_a_test_left(tmp_path, mode):
    clone = _clone(tmp_path, {"test_leaky.py": LEAKY})
    temp = tmp_path / "temp"
    temp.mkdir()
    proc = _pytest(clone, mode, "tests/test_leaky.py", TMPDIR=str(temp))
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    files = [os.path.join(d, f) for d, _, names in os.walk(temp) for f in names]
    assert files == [], files  # tmp_path's store and the leaked file: both gone
    line = [ln for ln in out.splitlines() if ln.startswith("temporary files left by the tests")]
    assert len(line) == 1 and "1234 B in 1 entry" in line[0] and "leaky-" in line[0], out
