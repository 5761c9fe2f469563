"""The simulator's store: the mesh core's store port over dicts (`hmpnode.net.core.StorePort`).

It keeps what the core reads and writes (held containers, what the agent forgot, relay
holdings and their chains, the outbox) and stores verified containers the way the
node does for the mesh's purposes: one row per DID, a `seq` in ingest order, the
agent's forgotten DIDs refused. It survives a simulated crash (a node restarts with
its store, as the node's SQLite file does). Not modelled: referenced-by, evaluations,
conflicts, full-text search (the mesh decisions do not depend on them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hmpnode.container.encoding import parse_time
from hmpnode.container.payload import recipients_of
from hmpnode.net.relayquota import RelayUsage
from hmpnode.net.syncset import SyncRow
from hmpnode.store.records import StoredContainer, to_us

__all__ = ["MemoryStore", "Result"]


@dataclass(slots=True)
class Result:
    """One ingest outcome, as the node's IngestResult reads to the core and the session."""

    status: str
    did: str | None = None
    seq: int | None = None
    reason: str | None = None
    detail: str = ""
    evaluations: dict | None = None


@dataclass(slots=True)
class _Hold:
    recipient: str
    seq: int
    did: str
    size: int
    sender: str
    address: str
    known: int
    until_us: int | None


class MemoryStore:
    """One simulated node's store; itself the port (every call is one 'transaction')."""

    def __init__(self) -> None:
        self.by_did: dict[str, StoredContainer] = {}
        self.by_seq: dict[int, StoredContainer] = {}
        self.last_seq = 0
        self.forgotten: set[str] = set()
        self.holds: dict[tuple[str, str], _Hold] = {}
        self.chains: dict[int, list] = {}
        #: (did, recipient) -> [seq, next_us, tries, pushed_us]
        self.outbox: dict[tuple[str, str], list[int]] = {}

    # -- storing (what Node.ingest does, for the mesh's purposes) -------------------------

    def put(self, container: dict[str, Any], did: str, source: str, now_us: int) -> Result:
        if did in self.forgotten:
            return Result("rejected", did, reason="forgotten", detail="the agent forgot it")
        row = self.by_did.get(did)
        if row is not None:
            return Result("duplicate", did, seq=row.seq)
        head = container["hmp_container"]["head"]
        self.last_seq += 1
        ttl = head.get("ttl")
        row = StoredContainer(self.last_seq, did, container["hmp_container"], to_us(parse_time(head["timestamp"])),
                              to_us(parse_time(ttl)) if isinstance(ttl, str) else None, now_us, source, [], False,
                              0)
        self.by_did[did] = self.by_seq[row.seq] = row
        return Result("stored", did, seq=row.seq)

    def forget(self, did: str) -> None:
        """The agent forgot `did`: gone, and never stored again."""
        row = self.by_did.pop(did, None)
        if row is not None:
            del self.by_seq[row.seq]
        self.forgotten.add(did)
        for key in [k for k in self.holds if k[1] == did]:
            del self.holds[key]
        for key in [k for k in self.outbox if k[0] == did]:
            del self.outbox[key]

    # -- the port -----------------------------------------------------------------------------

    def settled(self, dids: Sequence[str]) -> set[str]:
        return {d for d in dids if d in self.by_did or d in self.forgotten}

    def rows_by_did(self, dids: Sequence[str]) -> list[StoredContainer]:
        return [r for r in (self.by_did.get(d) for d in dids) if r is not None]

    def rows_by_seq(self, seqs: Sequence[int]) -> list[StoredContainer]:
        return [r for r in (self.by_seq.get(s) for s in seqs) if r is not None]

    def containers_after(self, after: int, limit: int) -> list[StoredContainer]:
        return sorted((r for s, r in self.by_seq.items() if s > after), key=lambda r: r.seq)[:limit]

    def sync_rows(self, after_ttl_us: int, after_seq: int) -> tuple[int, list[SyncRow]]:
        rows = [SyncRow(r.seq, r.did, r.ts_us, r.ttl_us, r.hmp_container["head"].get("network") or "")
                for r in self.by_seq.values()
                if r.seq > after_seq and r.hmp_container["head"].get("broadcast") is True
                and (r.ttl_us is None or r.ttl_us > after_ttl_us)]
        return self.last_seq, rows

    def evaluations_of(self, dids: Sequence[str]) -> dict[str, list]:
        return {}

    def backlinks_of(self, dids: Sequence[str]) -> dict[str, list]:
        return {d: [] for d in dids}

    def relay_usage(self, recipients: Iterable[str], sender: str, address: str | None) -> RelayUsage:
        usage = RelayUsage()
        wanted = set(recipients)
        usage.recipients = {r: [0, 0] for r in wanted}
        usage.senders[sender] = [0, 0]
        if address is not None:
            usage.addresses[address] = [0, 0]
        for h in self.holds.values():
            counted = [usage.total]
            if h.recipient in wanted:
                counted.append(usage.recipients[h.recipient])
            if h.sender == sender:
                counted.append(usage.senders[sender])
            if address is not None and h.address == address:
                counted.append(usage.addresses[address])
            if not h.known:
                counted.append(usage.unknown)
            for pair in counted:
                pair[0] += 1
                pair[1] += h.size
        return usage

    def relay_hold(self, entries: list[tuple]) -> None:
        for recipient, seq, did, size, sender, address, known, until_us in entries:
            self.holds.setdefault((recipient, did), _Hold(recipient, seq, did, size, sender, address, known, until_us))

    def relay_held_for(self, recipient: str, after: int, limit: int) -> list[StoredContainer]:
        seqs = sorted(h.seq for h in self.holds.values() if h.recipient == recipient and h.seq > after)[:limit]
        return self.rows_by_seq(seqs)

    def relay_release(self, recipient: str, dids: Sequence[str], own: str) -> int:
        released = [d for d in dids if self.holds.pop((recipient, d), None) is not None]
        self._drop_unheld(released, own)
        return len(released)

    def _drop_unheld(self, dids: Iterable[str], own: str) -> None:
        """Of these, the containers held only for others that nobody waits for any more go."""
        waiting = {h.did for h in self.holds.values()}
        for did in set(dids) - waiting:
            row = self.by_did.get(did)
            if row is None or row.source == "agent" or row.hmp_container["head"].get("broadcast") is True \
                    or own in recipients_of(row.hmp_container["head"]):
                continue
            del self.by_did[did], self.by_seq[row.seq]

    def relay_expire(self, now_us: int, soon_us: int, own: str) -> tuple[dict[str, int], dict[str, int], int]:
        expired: dict[str, int] = {}
        ending: dict[str, int] = {}
        for h in self.holds.values():
            if h.until_us is not None and h.until_us <= soon_us:
                ending[h.recipient] = ending.get(h.recipient, 0) + 1
                if h.until_us <= now_us:
                    expired[h.recipient] = expired.get(h.recipient, 0) + 1
        dropped = [k for k, h in self.holds.items() if h.until_us is not None and h.until_us <= now_us]
        for key in dropped:
            del self.holds[key]
        self._drop_unheld((did for _, did in dropped), own)
        return expired, ending, len(dropped)

    def relay_chains(self, seqs: Sequence[int]) -> dict[int, list]:
        return {s: list(self.chains.get(s, [])) for s in seqs}

    def save_relay_chains(self, chains: list[tuple[int, list]]) -> None:
        self.chains.update(chains)

    def outbox_add(self, rows: list[tuple[str, str, int, int]]) -> None:
        for did, recipient, seq, next_us in rows:
            self.outbox.setdefault((did, recipient), [seq, next_us, 0, 0])

    def outbox_due(self, now_us: int, limit: int) -> list[tuple[str, str, int, int, int]]:
        due = sorted((e[1], did, r) for (did, r), e in self.outbox.items() if e[1] <= now_us)[:limit]
        return [(did, r, self.outbox[did, r][0], self.outbox[did, r][2], self.outbox[did, r][3]) for _, did, r in due]

    def outbox_wake(self, now_us: int, recipients: Iterable[str] | None) -> int:
        wanted = None if recipients is None else set(recipients)
        woken = 0
        for (_, r), e in self.outbox.items():
            if (wanted is None or r in wanted) and e[1] > now_us:
                e[1] = now_us
                woken += 1
        return woken

    def outbox_done(self, pairs: Iterable[tuple[str, str]]) -> None:
        for pair in pairs:
            self.outbox.pop(tuple(pair), None)

    def outbox_retry(self, rows: Iterable[tuple[int, str, str]]) -> None:
        for next_us, did, r in rows:
            e = self.outbox.get((did, r))
            if e is not None:
                e[1], e[2] = next_us, e[2] + 1

    def outbox_sent(self, sent: Iterable[tuple[int, int, str, str]], waiting: Iterable[tuple[int, str, str]]) -> None:
        for next_us, pushed_us, did, r in sent:
            e = self.outbox.get((did, r))
            if e is not None:
                e[1], e[2], e[3] = next_us, e[2] + 1, pushed_us
        for next_us, did, r in waiting:
            e = self.outbox.get((did, r))
            if e is not None:
                e[1] = next_us
