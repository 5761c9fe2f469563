"""Shared fixtures: fixed identities and a fixed clock (the core never reads the clock)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from hmpnode.identity import Identity

#: A busy machine must not fail a property test: Hypothesis' per-example deadline (200 ms)
#: and its "too slow" health check measure wall-clock time. A test's own @settings still
#: override the rest of this profile.
settings.register_profile("hmpnode", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("hmpnode")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
#: The reason every test that reads ../shared gives when it is missing: those skips are
#: reported once, as one line of the summary (`pytest_runtest_makereport` below).
NO_SHARED = "../shared (the spec, the vectors) is not beside the repo: the tests that read it are skipped"
NOW = datetime(2026, 11, 29, 10, 15, 0, tzinfo=timezone.utc)


class Clock:
    """A clock the test sets by hand (`clock.now = ...`); the node reads it."""

    def __init__(self, now: datetime = NOW):
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def bare_node(data_dir: Path) -> Any:
    """What `Mesh.__init__` reads of a node, nothing started (settings reaching the mesh)."""
    from types import SimpleNamespace

    from hmpnode.identity.registry import MemoryKeyRegistry

    return SimpleNamespace(identity=Identity(bytes([6]) * 32), store_hooks=[], data_dir=data_dir,
                           registry=MemoryKeyRegistry(), refuse=lambda *args: None, last_seq=0, now_us=lambda: 0)


@contextlib.asynccontextmanager
async def running_node(identity: Identity, data_dir: Path, *, clock: Clock | None = None,
                       **options: Any) -> AsyncIterator[Any]:
    """An in-process Node on `data_dir`, started, stopped at the end."""
    from hmpnode.node import Node

    node = Node(identity, data_dir, clock=clock or Clock(), batch_wait_ms=0.5, **options)
    await node.start()
    try:
        yield node
    finally:
        await node.stop()


#: A test that asks for one of these fixtures (directly or through another fixture) starts
#: real node processes or network namespaces: it is marked `slow` without saying so, and
#: `./scripts/test -m "not slow"` leaves it out of the quick loop.
SLOW_FIXTURES = frozenset({"nodes", "netlab"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


#: Where the run's temporary files go: a directory of its own, made at the start of the run
#: (the controller's, under the usual temp dir) and given to every test, xdist worker, node
#: and browser through TMPDIR; pytest's own tmp_path base stays where pytest keeps it.
#: At the end it is measured, what is left is named in the summary, and it is removed.
RUN_TMP = pytest.StashKey[Path]()
LEFT_OVER = pytest.StashKey[list]()


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # an xdist worker: it inherited the controller's TMPDIR
    config._tmp_path_factory.getbasetemp()  # pytest's base (with its retention) before the switch
    run_tmp = Path(tempfile.mkdtemp(prefix="hmpt-"))  # short: unix socket paths hold 108 bytes
    config.stash[RUN_TMP] = run_tmp
    os.environ["TMPDIR"] = str(run_tmp)
    tempfile.tempdir = str(run_tmp)


def left_over(root: Path) -> list[tuple[int, str]]:
    """(bytes, name) of each entry directly under `root` (a directory: the files under it),
    largest first."""
    found = []
    for entry in os.scandir(root):
        size = 0
        if entry.is_dir(follow_symlinks=False):
            for dirpath, _dirs, files in os.walk(entry.path):
                for name in files:
                    with contextlib.suppress(OSError):
                        size += os.lstat(os.path.join(dirpath, name)).st_size
        else:
            with contextlib.suppress(OSError):
                size = entry.stat(follow_symlinks=False).st_size
        found.append((size, entry.name + ("/" if entry.is_dir(follow_symlinks=False) else "")))
    return sorted(found, reverse=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    run_tmp = config.stash.get(RUN_TMP, None)
    if run_tmp is not None:
        # an empty pytest-of-<user>/ is an inner pytest run's (tests that run pytest), cleaned
        config.stash[LEFT_OVER] = [(size, name) for size, name in left_over(run_tmp)
                                   if size or not name.startswith("pytest-of-")]
        shutil.rmtree(run_tmp, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """One line when the run's tests left temporary files behind outside tmp_path (removed
    now), naming the largest, so that a test that stops cleaning up is seen."""
    found = config.stash.get(LEFT_OVER, [])
    if found:
        total = sum(size for size, _ in found)
        largest = ", ".join(f"{path} ({size} B)" for size, path in found[:5])
        entries = f"{len(found)} {'entry' if len(found) == 1 else 'entries'}"
        terminalreporter.write_line(f"temporary files left by the tests (now removed): {total} B in "
                                    f"{entries} under TMPDIR; largest: {largest}", yellow=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """A skip for want of ../shared is placed at one location with one reason, so that the
    short summary folds them all into one line ("SKIPPED [N] tests/conftest.py: ...")
    instead of one line per test: visible once, not per test."""
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple) and str(report.longrepr[2]).endswith(NO_SHARED):
        report.longrepr = (__file__, None, NO_SHARED)
    return report


@pytest.fixture(autouse=True)
def _environment_unchanged():
    """A worker runs many tests in one process: a test that left os.environ changed would
    change the ones after it. Use monkeypatch.setenv, or pass `env=` to a subprocess."""
    before = dict(os.environ)
    yield
    changed = sorted(k for k in before.keys() | os.environ.keys()
                     if before.get(k) != os.environ.get(k) and k != "PYTEST_CURRENT_TEST")  # pytest's own
    if changed:
        for key in changed:
            if key in before:
                os.environ[key] = before[key]
            else:
                del os.environ[key]
        pytest.fail(f"the test left the environment changed: {changed}")


@pytest.fixture
def now() -> datetime:
    return NOW


@pytest.fixture
def alice() -> Identity:
    return Identity(bytes([1]) * 32)


@pytest.fixture
def bob() -> Identity:
    return Identity(bytes([2]) * 32)


@pytest.fixture
def carol() -> Identity:
    return Identity(bytes([3]) * 32)


@pytest.fixture
def nodes():
    """Real `hmpnode run` processes; every one is killed (process group) at the end."""
    from tests.nodeproc import Nodes

    factory = Nodes()
    try:
        yield factory
    finally:
        factory.cleanup()
