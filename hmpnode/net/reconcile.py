"""Range-based set reconciliation (sans-IO): what two nodes hold, in O(difference).

The algorithm is the one of negentropy (Doug Hoyte; Nostr NIP-77), written
from its description, with our own wire format (docs: "Set reconciliation").
Each side holds a set of items ``(timestamp, id)`` sorted by timestamp, then
id. The initiator sends fingerprints of ranges of its items; where the other
side's fingerprint of the same range differs, that side splits the range into
``buckets`` sub-ranges and answers with their fingerprints, or, when the range
holds fewer than ``2 * buckets`` of its items, with the ids themselves. The
exchange recurses until every range either matches or has been compared id by
id. Only the initiator learns the difference: ``have`` (ids it holds that the
responder lacks) and ``need`` (ids the responder holds that it lacks); it then
drives the transfer, so the two sides never both push the same container.

- ``id`` = SHA-256 of the container DID's UTF-8 bytes (`item_id`), 32 bytes:
  one rule for every DID form, ids uniformly distributed.
- ``timestamp`` = an integer in ``[0, MAX_TIMESTAMP]``; for containers the Unix
  seconds of ``head.timestamp`` (`item_timestamp`), so both sides agree.
- Fingerprint of a range = SHA-256(sum of its ids as little-endian integers
  mod 2**256, 32 bytes LE || LEB128(count))[:16]. Additive, so a storage can
  answer the fingerprint of any index range from prefix sums.

Which items a side puts in its set is the caller's decision (scope: every item
a side passes here may be revealed to the peer); see the protocol document.

No sockets, no clock, no randomness. Every message is checked against explicit
limits before anything is allocated for it; bad input raises `ReconcileError`
with a stable reason code (`REASONS`), never another exception.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Protocol

__all__ = [
    "VERSION",
    "ID_SIZE",
    "FINGERPRINT_SIZE",
    "MAX_TIMESTAMP",
    "MODE_SKIP",
    "MODE_FINGERPRINT",
    "MODE_IDLIST",
    "MODE_IDLIST_REPLY",
    "MIN_FRAME_SIZE_LIMIT",
    "MAX_IDS_PER_LIST",
    "REASONS",
    "ReconcileError",
    "ItemStorage",
    "SortedItems",
    "Reconciler",
    "fingerprint",
    "item_id",
    "item_timestamp",
    "encode_varint",
]

VERSION = 0x01
ID_SIZE = 32
FINGERPRINT_SIZE = 16
#: the largest item timestamp; 2**64 - 1 is the "infinity" bound, never an item
MAX_TIMESTAMP = 2**64 - 2
_INF_TS = 2**64 - 1
_ZERO_ID = bytes(ID_SIZE)
_INFINITY = (_INF_TS, _ZERO_ID)
_LOWEST = (0, _ZERO_ID)
_MASK = 2**256 - 1
_STRIDE = 16  # SortedItems keeps a prefix sum every _STRIDE items

MODE_SKIP = 0
MODE_FINGERPRINT = 1
MODE_IDLIST = 2
MODE_IDLIST_REPLY = 3

#: a frame limit below this could not carry one range's answer (16 fingerprint
#: ranges of <= 61 bytes, or an id list of <= 63 ids) plus the cut-off range
MIN_FRAME_SIZE_LIMIT = 4096
_MAX_BUCKETS = 32
#: the most ids (and bitfield bits) one range of a message may carry
MAX_IDS_PER_LIST = 1024
# room kept free in a frame: a pending skip range (bound <= 43 bytes + mode) before
# the next range, then what a cut-off appends (a skip, and a fingerprint range to
# infinity: 2 + 1 + 16 bytes)
_CUTOFF_RESERVE = 128

REASONS = frozenset(
    {
        "message_too_large",  # longer than max_message_size
        "unsupported_version",  # first byte is not VERSION
        "truncated",  # the message ends inside a field
        "malformed_varint",  # > 10 bytes, >= 2**64, or not minimal
        "bound_overflow",  # a bound's timestamp passes MAX_TIMESTAMP
        "malformed_bound",  # id prefix longer than 32, or infinity with a prefix
        "ranges_out_of_order",  # bounds not strictly increasing, or a range after infinity
        "too_many_ranges",  # more than max_ranges ranges in one message
        "unknown_mode",  # mode not 0..3
        "too_many_ids",  # an id list (or bitfield) longer than MAX_IDS_PER_LIST
        "malformed_idlist",  # the same id twice in one list
        "malformed_reply",  # an id-list reply that does not fit the range it answers
        "unexpected_mode",  # an id-list reply sent to the responder
        "unexpected_message",  # initiate twice, reconcile after done, or before initiate
        "too_many_rounds",  # more than max_rounds messages in one reconciliation
    }
)


class ReconcileError(Exception):
    """Bad reconciliation input; `reason` is one of REASONS (a stable code)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# --- items ---------------------------------------------------------------


def item_id(did: str) -> bytes:
    """The 32-byte reconciliation id of a container DID: SHA-256 of its UTF-8."""
    return hashlib.sha256(did.encode("utf-8")).digest()


def item_timestamp(when: datetime) -> int:
    """Whole Unix seconds of `when` (naive means UTC), clamped to [0, MAX_TIMESTAMP]."""
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    seconds = int(when.timestamp() // 1)
    return min(max(seconds, 0), MAX_TIMESTAMP)


def fingerprint(id_sum: int, count: int) -> bytes:
    """Fingerprint of a range whose ids sum (LE, mod 2**256) to `id_sum`."""
    return hashlib.sha256((id_sum & _MASK).to_bytes(32, "little") + encode_varint(count)).digest()[
        :FINGERPRINT_SIZE
    ]


class ItemStorage(Protocol):
    """A fixed, sorted item set; the reconciler's only view of it.

    Items are ``(timestamp, id)``, sorted by timestamp then id (bytes order),
    no two equal. Indexes are 0-based; ranges ``[lo, hi)``. The set must not
    change while a reconciliation runs over it. A SQLite-backed storage can
    answer these from an index on (timestamp, id) plus stored prefix sums.
    """

    def __len__(self) -> int: ...

    def item(self, index: int) -> tuple[int, bytes]:
        """The item at `index`."""
        ...

    def lower_bound(self, timestamp: int, id_: bytes, lo: int, hi: int) -> int:
        """The first index in [lo, hi] whose item is >= (timestamp, id_) (hi if none)."""
        ...

    def id_sum(self, lo: int, hi: int) -> int:
        """Sum of the ids in [lo, hi) as little-endian integers, mod 2**256."""
        ...

    def ids(self, lo: int, hi: int) -> list[bytes]:
        """The ids in [lo, hi), in item order."""
        ...


class _IdView(Sequence):
    """The ids of a packed blob as a sequence, so that `bisect` can search it."""

    __slots__ = ("_blob",)

    def __init__(self, blob: bytes) -> None:
        self._blob = blob

    def __len__(self) -> int:
        return len(self._blob) // ID_SIZE

    def __getitem__(self, i):  # type: ignore[override]
        return self._blob[i * ID_SIZE : (i + 1) * ID_SIZE]


class SortedItems:
    """In-memory, immutable `ItemStorage`: packed arrays, ~42 bytes an item.

    Timestamps in an ``array('Q')``, ids in one bytes blob, and the prefix sums
    of the ids (mod 2**256) at every 16th item in another, so that the sum of
    any range costs two checkpoint lookups and at most 30 id additions: O(1).
    Building is O(n log n) (the sort); 1 M items take ~1-2 s and ~42 MB.
    """

    def __init__(self, items: Iterable[tuple[int, bytes]] = ()) -> None:
        ordered = sorted(set(items))
        for ts, id_ in ordered:
            _check_item(ts, id_)
        if len({id_ for _, id_ in ordered}) != len(ordered):
            raise ValueError("an id with two timestamps (an id names one container)")
        self._build(array("Q", (ts for ts, _ in ordered)), b"".join(id_ for _, id_ in ordered))

    @classmethod
    def from_sorted(cls, timestamps: array, id_blob: bytes) -> SortedItems:
        """Build from already sorted, distinct packed items (order checked, O(n)).

        Ids must also be distinct across timestamps (not checked here, to spare
        a set of n ids): the same id twice would make the peer refuse our id lists.
        """
        if timestamps.typecode != "Q" or len(id_blob) != len(timestamps) * ID_SIZE:
            raise ValueError("timestamps must be array('Q') with 32 id bytes each")
        ids = _IdView(id_blob)
        prev = None
        for i, ts in enumerate(timestamps):
            if ts > MAX_TIMESTAMP:
                raise ValueError(f"timestamp {ts} above MAX_TIMESTAMP")
            cur = (ts, ids[i])
            if prev is not None and cur <= prev:
                raise ValueError(f"items not strictly increasing at index {i}")
            prev = cur
        self = cls.__new__(cls)
        self._build(timestamps, bytes(id_blob))
        return self

    def _build(self, timestamps: array, id_blob: bytes) -> None:
        self._ts = timestamps
        self._blob = id_blob
        self._ids = _IdView(id_blob)
        n = len(timestamps)
        out = bytearray(32 * (n // _STRIDE + 1))
        acc = 0
        view = memoryview(id_blob)
        from_bytes = int.from_bytes
        for i in range(n):
            acc = (acc + from_bytes(view[i * 32 : i * 32 + 32], "little")) & _MASK
            if (i + 1) % _STRIDE == 0:
                j = (i + 1) // _STRIDE
                out[j * 32 : j * 32 + 32] = acc.to_bytes(32, "little")
        self._checkpoints = bytes(out)

    def _prefix(self, i: int) -> int:
        """Sum of the first i ids, mod 2**256 (not reduced)."""
        j = i // _STRIDE
        acc = int.from_bytes(self._checkpoints[j * 32 : j * 32 + 32], "little")
        b = self._blob
        for k in range(j * _STRIDE, i):
            acc += int.from_bytes(b[k * 32 : k * 32 + 32], "little")
        return acc

    @property
    def packed(self) -> tuple[array, bytes]:
        """(timestamps, id blob): to derive another set cheaply with `from_sorted`."""
        return self._ts, self._blob

    def __len__(self) -> int:
        return len(self._ts)

    def item(self, index: int) -> tuple[int, bytes]:
        return self._ts[index], self._ids[index]

    def lower_bound(self, timestamp: int, id_: bytes, lo: int, hi: int) -> int:
        start = bisect.bisect_left(self._ts, timestamp, lo, hi)
        end = bisect.bisect_right(self._ts, timestamp, start, hi)
        return bisect.bisect_left(self._ids, id_, start, end)

    def id_sum(self, lo: int, hi: int) -> int:
        return (self._prefix(hi) - self._prefix(lo)) & _MASK

    def ids(self, lo: int, hi: int) -> list[bytes]:
        b = self._blob
        return [b[i * ID_SIZE : (i + 1) * ID_SIZE] for i in range(lo, hi)]


def _check_item(ts: object, id_: object) -> None:
    if not isinstance(ts, int) or isinstance(ts, bool) or not 0 <= ts <= MAX_TIMESTAMP:
        raise ValueError(f"item timestamp must be an int in [0, {MAX_TIMESTAMP}]: {ts!r}")
    if not isinstance(id_, bytes) or len(id_) != ID_SIZE:
        raise ValueError(f"item id must be {ID_SIZE} bytes")


# --- wire primitives -------------------------------------------------------


def encode_varint(n: int) -> bytes:
    """Unsigned LEB128: 7 bits a byte, least significant group first."""
    if n < 0:
        raise ValueError("varint must be >= 0")
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def remaining(self) -> int:
        return len(self.data) - self.pos

    def varint(self) -> int:
        value = 0
        for shift in range(0, 70, 7):
            if self.pos >= len(self.data):
                raise ReconcileError("truncated", "inside a varint")
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                if byte == 0 and shift:
                    raise ReconcileError("malformed_varint", "not minimal")
                if value >= 2**64:
                    raise ReconcileError("malformed_varint", "value >= 2**64")
                return value
        raise ReconcileError("malformed_varint", "longer than 10 bytes")

    def take(self, n: int) -> bytes:
        if n > self.remaining():
            raise ReconcileError("truncated", f"{n} bytes wanted, {self.remaining()} left")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk


class _Range:
    __slots__ = ("upper", "mode", "fp", "ids", "bits", "nbits")

    def __init__(self, upper, mode, fp=None, ids=None, bits=None, nbits=0):
        self.upper = upper
        self.mode = mode
        self.fp = fp
        self.ids = ids
        self.bits = bits
        self.nbits = nbits


class _Writer:
    """Builds one message; bounds are delta-encoded against the previous one."""

    __slots__ = ("buf", "prev_ts", "nonskip")

    def __init__(self) -> None:
        self.buf = bytearray([VERSION])
        self.prev_ts = 0
        self.nonskip = 0

    def bound(self, bound: tuple[int, bytes]) -> None:
        ts, id_ = bound
        if ts == _INF_TS:
            self.buf += b"\x00\x00"
            return
        self.buf += encode_varint(ts - self.prev_ts + 1)
        self.prev_ts = ts
        prefix = id_.rstrip(b"\x00")
        self.buf += encode_varint(len(prefix))
        self.buf += prefix

    def range(self, upper, mode: int, payload: bytes = b"") -> None:
        self.bound(upper)
        self.buf += encode_varint(mode)
        self.buf += payload
        if mode != MODE_SKIP:
            self.nonskip += 1


# --- the reconciler --------------------------------------------------------


class Reconciler:
    """One side of one reconciliation over a fixed `ItemStorage` (or plain items).

    Initiator: ``msg = r.initiate()``; then for each reply,
    ``msg, have, need = r.reconcile(reply)`` until ``msg is None``. ``have``
    and ``need`` are the ids newly learnt at that step (each id reported once);
    the totals are `have_ids` / `need_ids`. Responder: ``reply, _, _ =
    r.reconcile(msg)`` for each message; a responder learns nothing. After a
    `ReconcileError` the reconciliation is over (`done`): further calls raise
    ``unexpected_message``, and the failing message changed nothing.

    Limits: messages it writes stay within `frame_size_limit` bytes; messages
    it reads may be at most `max_message_size` bytes, `max_ranges` ranges and
    MAX_IDS_PER_LIST ids per list; one reconciliation takes at most
    `max_rounds` messages (`max_message_size` must be at least the peer's
    `frame_size_limit`; both default to 65536). Work per message is O(ranges * (buckets + log n))
    plus the ids it writes (bounded by the frame) plus, at the initiator, the
    ids it holds in each range the responder listed (what it then reports).
    """

    def __init__(
        self,
        storage: ItemStorage | Iterable[tuple[int, bytes]],
        *,
        frame_size_limit: int = 65536,
        buckets: int = 8,
        max_message_size: int = 65536,
        max_ranges: int = 8192,
        max_rounds: int = 1024,
        idlist_threshold: int = 8,
    ) -> None:
        if frame_size_limit < MIN_FRAME_SIZE_LIMIT:
            raise ValueError(f"frame_size_limit must be >= {MIN_FRAME_SIZE_LIMIT}")
        if not 2 <= buckets <= _MAX_BUCKETS:
            raise ValueError(f"buckets must be in [2, {_MAX_BUCKETS}]")
        if not 2 <= idlist_threshold <= 2 * buckets:
            raise ValueError("idlist_threshold must be in [2, 2 * buckets]")
        if not hasattr(storage, "id_sum"):
            storage = SortedItems(storage)  # plain (timestamp, id) pairs
        self.storage: ItemStorage = storage
        self.frame_size_limit = frame_size_limit
        self.buckets = buckets
        self.idlist_threshold = idlist_threshold
        self.max_message_size = max_message_size
        self.max_ranges = max_ranges
        self.max_rounds = max_rounds
        self.is_initiator: bool | None = None
        self.done = False
        self.rounds = 0
        self._have: set[bytes] = set()
        self._need: set[bytes] = set()

    @property
    def have_ids(self) -> set[bytes]:
        """Ids this side (initiator) holds and the responder lacks, so far."""
        return set(self._have)

    @property
    def need_ids(self) -> set[bytes]:
        """Ids the responder holds and this side (initiator) lacks, so far."""
        return set(self._need)

    # -- public API --

    def initiate(self) -> bytes:
        """The first message: the whole item set as one range to compare."""
        if self.is_initiator is not None:
            raise ReconcileError("unexpected_message", "initiate after the reconciliation started")
        self.is_initiator = True
        w = _Writer()
        self._split(w, 0, len(self.storage), _INFINITY)
        return bytes(w.buf)

    def reconcile(self, msg: bytes) -> tuple[bytes | None, list[bytes], list[bytes]]:
        """Process one message; returns (message to send or None when done, have, need)."""
        if self.done:
            raise ReconcileError("unexpected_message", "the reconciliation is done")
        if self.is_initiator is None:
            self.is_initiator = False
        self.rounds += 1
        if self.rounds > self.max_rounds:
            self.done = True
            raise ReconcileError("too_many_rounds", f"more than {self.max_rounds} messages")
        have: list[bytes] = []
        need: list[bytes] = []
        w = _Writer()
        try:
            self._process(self._decode(msg), w, have, need)
        except ReconcileError:
            # Bad input ends the reconciliation, and what this message taught is dropped.
            self._have.difference_update(have)
            self._need.difference_update(need)
            self.done = True
            raise
        if self.is_initiator and w.nonskip == 0:
            self.done = True
            return None, have, need
        return bytes(w.buf), have, need

    # -- decoding --

    def _decode(self, msg: bytes) -> list[_Range]:
        if not isinstance(msg, (bytes, bytearray, memoryview)):
            raise TypeError("a reconciliation message is bytes")  # a caller's bug, not input
        if len(msg) > self.max_message_size:
            raise ReconcileError("message_too_large", f"{len(msg)} > {self.max_message_size} bytes")
        msg = bytes(msg)
        if not msg:
            raise ReconcileError("truncated", "empty message")
        if msg[0] != VERSION:
            raise ReconcileError("unsupported_version", f"version byte 0x{msg[0]:02x}")
        r = _Reader(msg)
        r.pos = 1
        prev_ts = 0
        prev = _LOWEST
        ranges: list[_Range] = []
        while r.remaining():
            if prev == _INFINITY:
                raise ReconcileError("ranges_out_of_order", "a range after the infinity bound")
            if len(ranges) >= self.max_ranges:
                raise ReconcileError("too_many_ranges", f"more than {self.max_ranges}")
            code = r.varint()
            plen = r.varint()
            if plen > ID_SIZE:
                raise ReconcileError("malformed_bound", f"id prefix of {plen} bytes")
            prefix = r.take(plen)
            if code == 0:
                if plen:
                    raise ReconcileError("malformed_bound", "infinity bound with an id prefix")
                upper = _INFINITY
            else:
                ts = prev_ts + code - 1
                if ts > MAX_TIMESTAMP:
                    raise ReconcileError("bound_overflow", f"timestamp {ts}")
                prev_ts = ts
                upper = (ts, prefix + bytes(ID_SIZE - plen))
            if upper <= prev:
                raise ReconcileError("ranges_out_of_order", "bounds must strictly increase")
            prev = upper
            mode = r.varint()
            if mode == MODE_SKIP:
                ranges.append(_Range(upper, mode))
            elif mode == MODE_FINGERPRINT:
                ranges.append(_Range(upper, mode, fp=r.take(FINGERPRINT_SIZE)))
            elif mode == MODE_IDLIST:
                ranges.append(_Range(upper, mode, ids=self._read_ids(r)))
            elif mode == MODE_IDLIST_REPLY:
                if not self.is_initiator:
                    raise ReconcileError("unexpected_mode", "an id-list reply sent to the responder")
                ids = self._read_ids(r)
                nbits = r.varint()
                if nbits > MAX_IDS_PER_LIST:
                    raise ReconcileError("too_many_ids", f"bitfield of {nbits} bits")
                bits = r.take((nbits + 7) // 8)
                if nbits % 8 and bits[-1] >> (nbits % 8):
                    raise ReconcileError("malformed_reply", "bitfield padding bits set")
                ranges.append(_Range(upper, mode, ids=ids, bits=bits, nbits=nbits))
            else:
                raise ReconcileError("unknown_mode", f"mode {mode}")
        return ranges

    def _read_ids(self, r: _Reader) -> list[bytes]:
        n = r.varint()
        if n > MAX_IDS_PER_LIST:
            raise ReconcileError("too_many_ids", f"{n} ids > {MAX_IDS_PER_LIST}")
        blob = r.take(n * ID_SIZE)
        ids = [blob[i * ID_SIZE : (i + 1) * ID_SIZE] for i in range(n)]
        if len(set(ids)) != n:
            raise ReconcileError("malformed_idlist", "an id twice in one list")
        return ids

    # -- processing --

    def _process(self, ranges: list[_Range], w: _Writer, have: list[bytes], need: list[bytes]) -> None:
        st = self.storage
        n = len(st)
        lo = 0
        pending_skip = None  # upper bound of skipped ranges not yet written
        for rng in ranges:
            upper = rng.upper
            hi = n if upper == _INFINITY else st.lower_bound(upper[0], upper[1], lo, n)
            out = _Writer()
            out.prev_ts = w.prev_ts if pending_skip is None else pending_skip[0]
            resume = None  # index from which the rest is left to the next round
            if rng.mode == MODE_SKIP:
                pass
            elif rng.mode == MODE_FINGERPRINT:
                if fingerprint(st.id_sum(lo, hi), hi - lo) != rng.fp:
                    self._split(out, lo, hi, upper)
            elif rng.mode == MODE_IDLIST:
                if self.is_initiator:
                    self._record(st.ids(lo, hi), rng.ids, have, need)
                else:
                    room = self.frame_size_limit - len(w.buf) - _CUTOFF_RESERVE
                    resume = self._answer_idlist(out, lo, hi, upper, rng.ids, room)
            else:  # MODE_IDLIST_REPLY, initiator only (checked when decoding)
                self._apply_reply(lo, hi, rng, have, need)
            if not out.nonskip and resume is None:
                pending_skip = upper
                lo = hi
                continue
            if w.nonskip and len(w.buf) + len(out.buf) - 1 + _CUTOFF_RESERVE > self.frame_size_limit:
                out = None  # does not fit: this range and the rest go to the next round
                resume = lo
            if pending_skip is not None:
                w.range(pending_skip, MODE_SKIP)
                pending_skip = None
            if out is not None:
                w.buf += out.buf[1:]
                w.prev_ts = out.prev_ts
                w.nonskip += out.nonskip
            if resume is not None:
                # Everything from the item at `resume` on, as one fingerprint: the
                # other side compares it and the exchange goes on from there.
                w.range(_INFINITY, MODE_FINGERPRINT, fingerprint(st.id_sum(resume, n), n - resume))
                return
            lo = hi

    def _split(self, w: _Writer, lo: int, hi: int, upper) -> None:
        """Describe our items in [lo, hi) (range ends at `upper`): ids or fingerprints."""
        st = self.storage
        count = hi - lo
        if count < self.idlist_threshold:
            w.range(upper, MODE_IDLIST, encode_varint(count) + b"".join(st.ids(lo, hi)))
            return
        b = min(self.buckets, count)
        per, extra = divmod(count, b)
        start = lo
        for i in range(b):
            end = start + per + (1 if i < extra else 0)
            bound = upper if i == b - 1 else _between(st.item(end - 1), st.item(end))
            w.range(bound, MODE_FINGERPRINT, fingerprint(st.id_sum(start, end), end - start))
            start = end

    def _answer_idlist(self, w: _Writer, lo: int, hi: int, upper, theirs: list[bytes], room: int) -> int | None:
        """Responder, for an id list of theirs over our items [lo, hi).

        Few items here: a reply (our ids they lack + a bitfield of theirs we lack),
        or nothing if the sets are equal. Many: they listed all of theirs, so the
        difference is about our items; we list them as consecutive id lists of at
        most MAX_IDS_PER_LIST (the initiator compares each with its own), as many as
        fit in `room` bytes; returns the index of the first item not listed, if any.
        """
        if hi - lo < self.idlist_threshold:
            ours = self.storage.ids(lo, hi)
            their_set, our_set = set(theirs), set(ours)
            missing_here = [i for i in ours if i not in their_set]
            bits = bytearray((len(theirs) + 7) // 8)
            lacking = 0
            for k, id_ in enumerate(theirs):
                if id_ not in our_set:
                    bits[k >> 3] |= 1 << (k & 7)
                    lacking += 1
            if missing_here or lacking:
                payload = encode_varint(len(missing_here)) + b"".join(missing_here)
                w.range(upper, MODE_IDLIST_REPLY, payload + encode_varint(len(theirs)) + bytes(bits))
            return None
        st = self.storage
        pos = lo
        while pos < hi:
            # bound (<= 43) + mode (1) + count (<= 2) per list, then 32 bytes an id
            fit = (room - (len(w.buf) - 1) - 46) // ID_SIZE
            take = min(MAX_IDS_PER_LIST, hi - pos, fit)
            if take < 1:
                return pos
            end = pos + take
            bound = upper if end == hi else _between(st.item(end - 1), st.item(end))
            w.range(bound, MODE_IDLIST, encode_varint(take) + b"".join(st.ids(pos, end)))
            pos = end
        return None

    def _record(self, ours: list[bytes], theirs: list[bytes], have, need) -> None:
        their_set = set(theirs)
        our_set = set(ours)
        for id_ in ours:
            if id_ not in their_set:
                self._learn(self._have, id_, have)
        for id_ in theirs:
            if id_ not in our_set:
                self._learn(self._need, id_, need)

    def _apply_reply(self, lo: int, hi: int, rng: _Range, have, need) -> None:
        if hi - lo != rng.nbits:
            raise ReconcileError("malformed_reply", f"{rng.nbits} bits for a range of {hi - lo} items")
        ours = self.storage.ids(lo, hi)
        our_set = set(ours)
        for k, id_ in enumerate(ours):
            if rng.bits[k >> 3] >> (k & 7) & 1:
                self._learn(self._have, id_, have)
        for id_ in rng.ids:
            if id_ in our_set:
                raise ReconcileError("malformed_reply", "a 'missing' id that we listed")
            self._learn(self._need, id_, need)

    @staticmethod
    def _learn(acc: set[bytes], id_: bytes, step: list[bytes]) -> None:
        if id_ not in acc:
            acc.add(id_)
            step.append(id_)


def _between(prev: tuple[int, bytes], cur: tuple[int, bytes]) -> tuple[int, bytes]:
    """The smallest-to-encode bound b with prev < b <= cur (normalised, 32-byte id)."""
    if prev[0] != cur[0]:
        return (cur[0], _ZERO_ID)
    a, c = prev[1], cur[1]
    common = 0
    while a[common] == c[common]:
        common += 1
    return (cur[0], c[: common + 1] + bytes(ID_SIZE - common - 1))
