"""Shared fixtures: fixed identities and a fixed clock (the core never reads the clock)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from hmpnode.identity import Identity

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
NOW = datetime(2026, 11, 29, 10, 15, 0, tzinfo=timezone.utc)


class Clock:
    """A clock the test sets by hand (`clock.now = ...`); the node reads it."""

    def __init__(self, now: datetime = NOW):
        self.now = now

    def __call__(self) -> datetime:
        return self.now


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
