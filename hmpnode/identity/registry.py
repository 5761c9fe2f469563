"""Key registry interface used by verification (profile section 4).

Verification never consults globals: the caller hands it a registry. The
node implements this on top of its database; `MemoryKeyRegistry` serves the
offline CLI, tests and vectors.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from hmpnode.identity.keys import did_matches_key, is_self_certifying_did

__all__ = ["KeyRegistry", "MemoryKeyRegistry", "KeyBinding", "bind_key"]


class KeyRegistry(Protocol):
    def pinned_key(self, did: str) -> bytes | None:
        """The Ed25519 public key pinned for `did`, or None when none is known."""

    def revoked_at(self, did: str) -> datetime | None:
        """When `did` revoked its key (`key_is_falsified`), or None."""


@dataclass(slots=True)
class KeyBinding:
    """Outcome of binding a signer's DID to a key (profile section 4)."""

    key: bytes | None
    reason: str | None = None  # key_mismatch, unknown_key or revoked
    detail: str = ""
    #: the signer's DID is of a foreign form and has no pinned key yet: pin on acceptance (TOFU)
    pin: bool = False
    #: signed before the signer's revocation: kept, but flagged
    revoked_later: bool = False


def bind_key(
    did: str,
    offered: bytes | None,
    registry: KeyRegistry | None,
    signed_at: datetime | None,
    *,
    self_certified: bool | None = None,
) -> KeyBinding:
    """Which key may sign for `did`, given the key a message offers (or None).

    A self-certifying DID must hash to the key; a pinned key must be the offered
    one; a message timestamped after the DID's revocation is refused (the
    revocation itself, timestamped at the same instant, is not); with no
    timestamp (`signed_at` None) any revocation refuses. `self_certified`
    lets a caller that has already checked the hash skip doing it again.
    """
    pinned = registry.pinned_key(did) if registry is not None else None
    key = offered if offered is not None else pinned
    if key is None:
        return KeyBinding(None, "unknown_key", "no public key given and none known for the DID")
    certifying = is_self_certifying_did(did)
    if certifying and not (self_certified and offered is not None) and not did_matches_key(did, key):
        return KeyBinding(None, "key_mismatch", "the DID is not the hash of the public key")
    if pinned is not None and bytes(pinned) != key:
        return KeyBinding(None, "key_mismatch", "the public key differs from the key pinned for the DID")
    revoked = registry.revoked_at(did) if registry is not None else None
    if revoked is not None and (signed_at is None or signed_at > revoked):
        return KeyBinding(None, "revoked", f"the DID revoked its key at {revoked.isoformat()}")
    return KeyBinding(key, pin=pinned is None and not certifying, revoked_later=revoked is not None)


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
