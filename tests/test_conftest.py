"""What tests/conftest.py promises the whole suite: skips for want of ../shared reported once."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _clone_without_shared(root: Path) -> Path:
    """The suite's conftest and the spec-example tests in a tree with no ../shared beside it
    (nor docs/protocol.md): the situation of a clone on its own."""
    clone = root / "clone"
    (clone / "tests").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", clone)
    for name in ("__init__.py", "conftest.py", "test_spec_examples.py"):
        shutil.copy(REPO / "tests" / name, clone / "tests")
    assert not (root / "shared").exists()
    return clone


@pytest.mark.parametrize("mode", [["-p", "no:xdist"], ["-n", "2"]], ids=["one-process", "xdist"])
def test_the_tests_that_need_shared_are_skipped_with_one_summary_line(tmp_path, mode):
    clone = _clone_without_shared(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HMPNODE_"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", *mode, "-p", "no:cacheprovider",
                           "-p", "no:randomly", "tests/test_spec_examples.py"],
                          cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1, "\n".join(skipped) or out
    assert skipped[0].startswith("SKIPPED [4] ") and "../shared" in skipped[0], skipped[0]
    assert "is not beside the repo" in skipped[0], skipped[0]
    assert "4 skipped" in out.splitlines()[-1], out
