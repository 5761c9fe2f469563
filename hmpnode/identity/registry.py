"""Key registry interface used by verification (profile section 4).

Verification never consults globals: the caller hands it a registry. The
node implements this on top of its database; `MemoryKeyRegistry` serves the
offline CLI, tests and vectors.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

__all__ = ["KeyRegistry", "MemoryKeyRegistry"]


class KeyRegistry(Protocol):
    def pinned_key(self, did: str) -> bytes | None:
        """The Ed25519 public key pinned for `did`, or None when none is known."""

    def revoked_at(self, did: str) -> datetime | None:
        """When `did` revoked its key (`key_is_falsified`), or None."""


class MemoryKeyRegistry:
    """In-memory KeyRegistry: pins and revocations held in dicts."""

    def __init__(self) -> None:
        self._pins: dict[str, bytes] = {}
        self._revoked: dict[str, datetime] = {}

    def pinned_key(self, did: str) -> bytes | None:
        return self._pins.get(did)

    def revoked_at(self, did: str) -> datetime | None:
        return self._revoked.get(did)

    def pin(self, did: str, public_key: bytes) -> bool:
        """Pin `public_key` for `did` unless a key is pinned already (trust on first use).
        Returns False when a different key was pinned before."""
        current = self._pins.setdefault(did, bytes(public_key))
        return current == public_key

    def revoke(self, did: str, at: datetime) -> None:
        """Record a revocation; the earliest revocation time wins."""
        prev = self._revoked.get(did)
        if prev is None or at < prev:
            self._revoked[did] = at
