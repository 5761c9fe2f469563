"""The pure rules of `container_delta` `modified` and `removed` (docs/protocol.md 32): the
queue of changes to announce, the entries and what a peer's entries ask of us, the removals
as read and as sent. No store, no event loop: the session and the simulator import these
without sqlite3 or asyncio; `hmpnode.net.delta` is the adapter around them (store reads,
sessions, the flush loop) and says what the deltas are for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hmpnode.net import mce as M
from hmpnode.net.penalty import TokenBucket

__all__ = ["DeltaLimits", "Removal", "DeltaQueue", "modified_entry", "plan_modified", "read_removals",
           "removal_wire", "REASONS", "EXPIRED", "REVOKED"]

#: why a container is removed (`removed_reasons`)
EXPIRED, REVOKED = "expired", "revoked"
REASONS = frozenset({EXPIRED, REVOKED})


@dataclass(frozen=True, slots=True)
class DeltaLimits:
    """The [delta] settings (config/hmpnode.example.toml says why each default; built once by
    hmpnode.config.DeltaSettings.delta_limits)."""

    #: changes of one DID within this window go out as one entry
    flush_seconds: float = 1.0
    #: modified + removed entries the node sends per second, all peers' messages counted once
    entries_per_second: float = 500.0
    burst: int = 2000
    #: entries of one flush, hence of one message to one peer
    max_batch: int = 1000
    #: DIDs waiting to be announced; changes beyond are dropped (counted)
    max_pending: int = 20_000


@dataclass(frozen=True, slots=True)
class Removal:
    reason: str
    #: the revoking peer_announce's DID (a revocation)
    proof: str | None = None


class DeltaQueue:
    """The changes waiting to be announced: coalesced per DID (a modified DID remembers
    only the peers every one of its changes came from: those are not told), a removal
    replacing a pending modification, at most `max_pending` DIDs; `take` hands out at
    most `max_batch` per call within the node-wide rate, removals first."""

    def __init__(self, limits: DeltaLimits = DeltaLimits()):
        self.limits = limits
        self.bucket = TokenBucket(limits.entries_per_second, float(limits.burst))
        self.modified: dict[str, frozenset[str]] = {}
        self.removed: dict[str, Removal] = {}
        self.dropped = 0
        self.coalesced = 0

    def __len__(self) -> int:
        return len(self.modified) + len(self.removed)

    def changed(self, did: str, origin: str | None = None) -> bool:
        """`did` gained blocks (`origin`: the peer they came from; None: the agent)."""
        if did in self.removed:
            return False
        skip = frozenset(() if origin is None else (origin,))
        if did in self.modified:
            self.modified[did] &= skip
            self.coalesced += 1
            return True
        if len(self) >= self.limits.max_pending:
            self.dropped += 1
            return False
        self.modified[did] = skip
        return True

    def gone(self, did: str, removal: Removal) -> bool:
        """`did` is no longer served (expired, revoked)."""
        if did in self.removed:
            return True
        if did not in self.modified and len(self) >= self.limits.max_pending:
            self.dropped += 1
            return False
        self.modified.pop(did, None)
        self.removed[did] = removal
        return True

    def take(self, mono: float) -> tuple[dict[str, frozenset[str]], dict[str, Removal]]:
        """What goes out now: up to `max_batch` entries the rate allows (removals first)."""
        want = min(len(self), self.limits.max_batch)
        if not want:
            return {}, {}
        self.bucket.take(mono, 0.0)  # refill
        n = min(want, int(self.bucket.tokens))
        if n <= 0:
            return {}, {}
        self.bucket.take(mono, n)
        removed = {d: self.removed.pop(d) for d in list(self.removed)[:n]}
        modified = {d: self.modified.pop(d) for d in list(self.modified)[:n - len(removed)]}
        return modified, removed


# -- pure decisions ---------------------------------------------------------------------------


def modified_entry(hmp: dict[str, Any], hashes: dict[str, str]) -> dict[str, Any]:
    """A `modified` entry: the index head (a peer that lacks the container can judge the
    offer, 22.1) and the hashes of its current blocks (spec 5.2.4)."""
    return {**M.index_entry(hmp), **hashes}


def plan_modified(entries: dict[str, Any], local: dict[str, dict[str, str] | None]
                  ) -> tuple[list[str], list[str], list[str]]:
    """What to do with a peer's `modified` entries, given our blocks' hashes per DID
    (None: not held): (offered: DIDs to treat as an offer, referenced-by to ask for,
    evaluations to ask for). A hash we already have, or none, asks for nothing."""
    offered, ask_rb, ask_ev = [], [], []
    for did, entry in entries.items():
        mine = local.get(did)
        if mine is None:
            offered.append(did)
            continue
        if not isinstance(entry, dict):
            continue
        theirs = entry.get("referenced-by_hash")
        if isinstance(theirs, str) and theirs != mine.get("referenced-by_hash"):
            ask_rb.append(did)
        theirs = entry.get("evaluations_hash")
        if isinstance(theirs, str) and theirs != mine.get("evaluations_hash"):
            ask_ev.append(did)
    return offered, ask_rb, ask_ev


def read_removals(payload: dict[str, Any], limit: int) -> tuple[list[str], dict[str, Removal]]:
    """The `removed` DIDs of a delta (at most `limit`) and the reasons it gives
    (`removed_reasons`, an hmpnode extension: anything unreadable is no reason)."""
    raw = payload.get("removed")
    dids = [d for d in raw if isinstance(d, str) and d.startswith("did:")][:limit] if isinstance(raw, list) else []
    given = payload.get("removed_reasons")
    reasons: dict[str, Removal] = {}
    if isinstance(given, dict):
        for did in dids:
            why = given.get(did)
            if isinstance(why, dict) and why.get("reason") in REASONS:
                proof = why.get("revocation")
                reasons[did] = Removal(why["reason"], proof if isinstance(proof, str) and proof.startswith("did:")
                                       and len(proof) <= 512 else None)
    return dids, reasons


def removal_wire(removed: dict[str, Removal]) -> tuple[list[str], dict[str, Any]]:
    """`removed` and `removed_reasons` as sent."""
    reasons = {d: {"reason": r.reason, **({"revocation": r.proof} if r.proof else {})} for d, r in removed.items()}
    return list(removed), reasons
