"""Shared fixtures: fixed identities and a fixed clock (the core never reads the clock)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from hmpnode.identity import Identity

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
NOW = datetime(2026, 11, 29, 10, 15, 0, tzinfo=timezone.utc)


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
