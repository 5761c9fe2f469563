"""What a node reconciles with a peer on connect: item sets per scope class (sans-IO).

Catch-up (docs/protocol.md 22.4) runs range-based set reconciliation
(`hmpnode.net.reconcile`) over the **broadcast** containers both sides may
send each other, in two independent sets, each reconciled on its own:

- ``global``: unscoped (`network` "") broadcasts, unexpired. Every peer on every
  channel may receive them and may send them back, so this is ONE node-wide
  snapshot shared by all sessions (~50 bytes an item: the `SortedItems`, the
  seq of each item and an index by id to map an id back to the store).
- ``scoped``: broadcasts whose `network` is `localhost` or `lan:<cidr>`, restricted
  to the scopes this peer may receive over this connection (`scope.may_forward`
  for a broadcast head of that scope, the peer's address and channel). Peers with
  the same passing scopes share one set (a "channel class"), cached per snapshot.

Directed containers stay out of both: they are one-directional (A may send a
container addressed to B's agent, B may not send it back unless A is a relay),
so putting them in would make the sets differ for ever (protocol.md 22.4). They
travel by the outbox (23.3) and the relay's offer on connect (24.2).

The rule is symmetric: the same container is in both sides' set of the same
class, or in neither (scope and broadcast are properties of the container;
both sides evaluate the same scope rule for the connection). Containers whose
`ttl` falls within `margin_us` are left out, so that a container expiring
during the exchange (the clocks differ) is in neither set.
"""

from __future__ import annotations

import hashlib
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from hmpnode.net.reconcile import ID_SIZE, MAX_TIMESTAMP, SortedItems
from hmpnode.net.scope import may_forward

__all__ = ["SET_NAMES", "MARGIN_US", "FRAME_LIMIT", "MAX_WANT", "MAX_OVERLAY", "SyncRow", "Snapshot", "Merged",
           "SyncState", "build_state", "extend_state", "item_of", "scope_key"]

#: the two sets a session reconciles, in the order the initiator sends them
SET_NAMES = ("global", "scoped")
#: distinct channel classes whose scoped set one SyncState caches
MAX_SCOPED_CLASSES = 64
#: containers expiring within this margin are in neither side's set (clocks differ by up to minutes)
MARGIN_US = 600 * 1_000_000
#: reconciliation message limit, both ways (reconcile's L and max_message_size: one 64 KB message)
FRAME_LIMIT = 65536
#: ids per `want` frame (and per reconcile id list)
MAX_WANT = 1024
#: items added to the shared set since its base was built beyond which the base is rebuilt
MAX_OVERLAY = 4096


@dataclass(frozen=True, slots=True)
class SyncRow:
    """A held broadcast container, as the store lists it (`store.mesh.sync_rows`)."""

    seq: int
    did: str
    ts_us: int
    ttl_us: int | None
    network: str


def item_of(did: str, ts_us: int) -> tuple[int, bytes]:
    """The reconciliation item of a container: (whole seconds of head.timestamp, SHA-256(DID))."""
    return min(max(ts_us // 1_000_000, 0), MAX_TIMESTAMP), hashlib.sha256(did.encode("utf-8")).digest()


class _ById(Sequence):
    """The ids of a snapshot in id order (through a permutation), for bisect."""

    __slots__ = ("_blob", "_perm")

    def __init__(self, blob: bytes, perm: array) -> None:
        self._blob, self._perm = blob, perm

    def __len__(self) -> int:
        return len(self._perm)

    def __getitem__(self, i):  # type: ignore[override]
        j = self._perm[i]
        return self._blob[j * ID_SIZE:(j + 1) * ID_SIZE]


class Snapshot:
    """An immutable item set and the store seq of each item (to answer requests by id)."""

    __slots__ = ("items", "seqs", "_by_id")

    def __init__(self, entries: Iterable[tuple[int, bytes, int]]) -> None:
        """`entries`: (timestamp, id, seq); an id given twice is kept once (the first)."""
        first: dict[bytes, tuple[int, bytes, int]] = {}
        for e in entries:
            first.setdefault(e[1], e)
        ordered = sorted(first.values())
        ts = array("Q", (e[0] for e in ordered))
        blob = b"".join(e[1] for e in ordered)
        self.items = SortedItems.from_sorted(ts, blob)
        self.seqs = array("q", (e[2] for e in ordered))
        perm = array("I", sorted(range(len(ordered)), key=lambda i: blob[i * ID_SIZE:(i + 1) * ID_SIZE]))
        self._by_id = _ById(blob, perm)

    def __len__(self) -> int:
        return len(self.seqs)

    def seq_of(self, id_: bytes) -> int | None:
        """The store seq of the container with this id, None if not in the set."""
        ids = self._by_id
        i = bisect_left(ids, id_)
        if i < len(ids) and ids[i] == id_:
            return self.seqs[ids._perm[i]]
        return None


class _MergedItems:
    """`ItemStorage` over a big base and a small overlay (recent additions), without a copy.

    The overlay's j-th item sits at merged position ``pos[j] = base.lower_bound(item) + j``;
    every operation is a few bisections of `pos` plus base/overlay lookups, so a node
    adds new containers to the shared set in O(k log n) instead of rebuilding n items.
    """

    __slots__ = ("base", "over", "pos", "_n")

    def __init__(self, base: SortedItems, over: SortedItems) -> None:
        self.base, self.over = base, over
        nb = len(base)
        self.pos = [base.lower_bound(*over.item(j), 0, nb) + j for j in range(len(over))]
        self._n = nb + len(over)

    def __len__(self) -> int:
        return self._n

    def item(self, index: int) -> tuple[int, bytes]:
        c = bisect_left(self.pos, index)
        if c < len(self.pos) and self.pos[c] == index:
            return self.over.item(c)
        return self.base.item(index - c)

    def lower_bound(self, timestamp: int, id_: bytes, lo: int, hi: int) -> int:
        g = self.base.lower_bound(timestamp, id_, 0, len(self.base)) + \
            self.over.lower_bound(timestamp, id_, 0, len(self.over))
        return max(lo, min(hi, g))

    def _prefix(self, i: int) -> int:
        c = bisect_left(self.pos, i)
        return self.base.id_sum(0, i - c) + self.over.id_sum(0, c)

    def id_sum(self, lo: int, hi: int) -> int:
        return (self._prefix(hi) - self._prefix(lo)) % (1 << 256)

    def ids(self, lo: int, hi: int) -> list[bytes]:
        return [self.item(i)[1] for i in range(lo, hi)]


class Merged:
    """A base `Snapshot` plus an overlay `Snapshot` of items added since (ids disjoint)."""

    __slots__ = ("items", "base", "over")

    def __init__(self, base: Snapshot, over: Snapshot) -> None:
        self.base, self.over = base, over
        self.items = _MergedItems(base.items, over.items)

    def __len__(self) -> int:
        return len(self.items)

    def seq_of(self, id_: bytes) -> int | None:
        seq = self.over.seq_of(id_)
        return seq if seq is not None else self.base.seq_of(id_)


def scope_key(networks: Iterable[str], *, peer_ip: str, channel: str, now: datetime) -> frozenset[str]:
    """The scoped networks (among `networks`) a broadcast may travel in to this peer."""
    return frozenset(n for n in networks if may_forward({"network": n, "broadcast": True}, peer_ip=peer_ip,
                                                         channel=channel, now=now).ok)


@dataclass(slots=True)
class SyncState:
    """One view of the node's sets: the global set (a base snapshot plus an overlay of
    what was stored since it was built) and the scoped rows."""

    base: Snapshot
    #: (timestamp, id, seq) of global items stored after the base was built
    overlay: list[tuple[int, bytes, int]]
    #: network -> [(timestamp, id, seq)] of the scoped broadcasts
    scoped_rows: dict[str, list[tuple[int, bytes, int]]]
    #: the store's last seq this view includes, and when the base was read (µs)
    last_seq: int
    built_us: int
    #: the earliest time an included container comes within the margin of its ttl (µs)
    stale_at_us: int
    global_set: Snapshot | Merged | None = None
    _scoped: dict[frozenset[str], Snapshot] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.global_set is None:
            self.global_set = Merged(self.base, Snapshot(self.overlay)) if self.overlay else self.base

    def scoped(self, key: frozenset[str]) -> Snapshot:
        """The scoped set of a channel class (built once per class and view)."""
        snap = self._scoped.get(key)
        if snap is None:
            snap = Snapshot(e for n in key for e in self.scoped_rows.get(n, ()))
            if len(self._scoped) >= MAX_SCOPED_CLASSES:
                self._scoped.pop(next(iter(self._scoped)))
            self._scoped[key] = snap
        return snap


def _split(rows: Iterable[SyncRow], limit_us: int):
    stale_at = 2**63 - 1
    plain: list[tuple[int, bytes, int]] = []
    scoped: dict[str, list[tuple[int, bytes, int]]] = {}
    for row in rows:
        if row.ttl_us is not None:
            if row.ttl_us <= limit_us:
                continue
            stale_at = min(stale_at, row.ttl_us)
        ts, id_ = item_of(row.did, row.ts_us)
        if row.network:
            scoped.setdefault(row.network, []).append((ts, id_, row.seq))
        else:
            plain.append((ts, id_, row.seq))
    return plain, scoped, stale_at


def build_state(rows: Iterable[SyncRow], *, now_us: int, margin_us: int, last_seq: int) -> SyncState:
    """The sets of a store's broadcast rows as of `now_us` (rows expiring within the margin left out)."""
    plain, scoped, stale_at = _split(rows, now_us + margin_us)
    return SyncState(Snapshot(plain), [], scoped, last_seq, now_us, stale_at - margin_us)


def extend_state(state: SyncState, rows: Iterable[SyncRow], *, now_us: int, margin_us: int,
                 last_seq: int) -> SyncState:
    """`state` plus the rows stored since (seq > state.last_seq): the base is shared, the
    overlay grows (a container already in the base, e.g. stored again, is not added twice)."""
    plain, scoped, stale_at = _split(rows, now_us + margin_us)
    base = state.base
    fresh = [e for e in plain if base.seq_of(e[1]) is None]
    merged_scoped = {n: list(v) for n, v in state.scoped_rows.items()}
    for n, v in scoped.items():
        merged_scoped.setdefault(n, []).extend(v)
    return SyncState(base, state.overlay + fresh, merged_scoped, last_seq, state.built_us,
                     min(state.stale_at_us, stale_at - margin_us))
