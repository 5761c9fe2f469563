"""Rules a second implementation must reproduce byte for byte (docs/protocol.md 28.5, 29.5,
29.6, 31.3), pinned from the rule as the document states it: each expected byte string is
built here by a few lines that follow the text (their own varints, bounds and fingerprints),
not by the code under test, so a changed rule or a changed node breaks them."""

from __future__ import annotations

import hashlib
import random
from datetime import datetime, timezone

import pytest

from hmpnode.container.build import build_container
from hmpnode.container.canonical import canonical_json
from hmpnode.identity import Identity
from hmpnode.net import index as IX
from hmpnode.net import noise
from hmpnode.net.reconcile import Reconciler, ReconcileError, SortedItems
from hmpnode.net.transport import Transport

# -- 28.5: the records of a frame ------------------------------------------------------------------

FRAGMENT = 65_518  # 65 535 - 16 (tag) - 1 (flags)
KEY, OTHER = bytes(range(32)), bytes(range(1, 33))


def _sender() -> Transport:
    return Transport(noise.CipherState(KEY), noise.CipherState(OTHER), max_frame=1 << 22, handshake_hash=b"")


def _receiver() -> Transport:
    return Transport(noise.CipherState(OTHER), noise.CipherState(KEY), max_frame=1 << 22, handshake_hash=b"")


def _open(wire: bytes) -> list[tuple[int, int, bytes]]:
    """The units of `wire` opened with the sender's key: (length prefix, flags, fragment)."""
    cs, out, pos = noise.CipherState(KEY), [], 0
    while pos < len(wire):
        size = int.from_bytes(wire[pos : pos + 2], "big")
        plain = cs.decrypt_with_ad(b"", wire[pos + 2 : pos + 2 + size])
        out.append((size, plain[0], plain[1:]))
        pos += 2 + size
    return out


@pytest.mark.parametrize("size", [0, 1, FRAGMENT - 1, FRAGMENT, FRAGMENT + 1, 2 * FRAGMENT, 2 * FRAGMENT + 1,
                                  3 * FRAGMENT])
def test_a_frame_is_cut_into_full_fragments_and_a_last_one_never_empty_unless_the_frame_is(size):
    """max(1, ceil(size / 65 518)) records; a frame of exactly k x 65 518 bytes is k full
    records, the k-th flagged 0x00: no empty record follows it."""
    frame = random.Random(size).randbytes(size)
    wire = _sender().encrypt(frame)
    records = _open(wire)
    count = max(1, -(-size // FRAGMENT))
    assert len(records) == count
    assert [flags for _, flags, _ in records] == [0x01] * (count - 1) + [0x00]
    assert [len(f) for _, _, f in records] == [FRAGMENT] * (count - 1) + [size - (count - 1) * FRAGMENT]
    assert [n for n, _, _ in records] == [len(f) + 17 for _, _, f in records]
    assert b"".join(f for _, _, f in records) == frame
    assert len(wire) == size + 19 * count


def test_a_receiver_takes_empty_fragments_anywhere_in_a_frame():
    """Another sender may end a frame of k x 65 518 bytes with an empty 0x00 record, or
    send empty 0x01 ones: the frame is the same bytes."""
    seal = noise.CipherState(KEY)

    def record(flags: int, fragment: bytes) -> bytes:
        body = seal.encrypt_with_ad(b"", bytes([flags]) + fragment)
        return len(body).to_bytes(2, "big") + body

    full = random.Random(1).randbytes(FRAGMENT)
    wire = record(0x01, full) + record(0x00, b"") + record(0x01, b"") + record(0x01, b"ab") + record(0x00, b"")
    assert _receiver().feed(wire) == [full, b"ab"]


# -- 29.5 / 29.6: reconciliation ------------------------------------------------------------------

T0 = 1_764_000_000
V = b"\x01"
TAIL_ROOM = 128  # what a writer keeps free for the cut-off
LIST_OVERHEAD = 46  # a bound (<= 43) + the mode (1) + the id count (<= 2), reckoned per id-list range
INFINITY = None


def leb(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def fp(ids: list[bytes]) -> bytes:
    total = sum(int.from_bytes(i, "little") for i in ids) % 2**256
    return hashlib.sha256(total.to_bytes(32, "little") + leb(len(ids))).digest()[:16]


def between(prev: tuple[int, bytes], cur: tuple[int, bytes]) -> tuple[int, bytes]:
    if prev[0] != cur[0]:
        return (cur[0], b"")
    k = next(i for i in range(32) if prev[1][i] != cur[1][i])
    return (cur[0], cur[1][: k + 1])


class Msg:
    """A message written by the rules of 29.4: bounds delta-encoded within the message."""

    def __init__(self) -> None:
        self.buf, self.prev_ts = bytearray(V), 0

    def range(self, upper, mode: int, payload: bytes = b"") -> int:
        start = len(self.buf)
        if upper is INFINITY:
            self.buf += b"\x00\x00"
        else:
            ts, prefix = upper
            self.buf += leb(ts - self.prev_ts + 1) + leb(len(prefix)) + prefix
            self.prev_ts = ts
        self.buf += leb(mode) + payload
        return len(self.buf) - start


def list_ids(msg: Msg, items, lo: int, hi: int, upper, limit: int, written: int) -> int | None:
    """29.5, a responder listing its items [lo, hi): `written` = the message's length before
    this range, pending skip not counted. The index of the first item not listed, or None."""
    room = limit - TAIL_ROOM - written
    used, pos = 0, lo
    while pos < hi:
        take = min(1024, hi - pos, (room - used - LIST_OVERHEAD) // 32)
        if take < 1:
            return pos
        end = pos + take
        bound = upper if end == hi else between(items[end - 1], items[end])
        used += msg.range(bound, 2, leb(take) + b"".join(i for _, i in items[pos:end]))
        pos = end
    return None


def _items(n: int) -> list[tuple[int, bytes]]:
    """Three items a second; ids are hashes, so neighbours in one second share short prefixes."""
    return sorted((T0 + k // 3, hashlib.sha256(b"item %d" % k).digest()) for k in range(n))


ITEMS = _items(4000)
STORE = SortedItems(ITEMS)
IDS = [i for _, i in ITEMS]


def _below(ts: int) -> int:
    return sum(1 for t, _ in ITEMS if t < ts)


def _bound(upper) -> bytes:
    return b"\x00\x00" if upper is INFINITY else leb(upper[0] + 1) + leb(len(upper[1])) + upper[1]


def _expected(first: tuple | None, limit: int) -> bytes:
    """The responder's answer to [`first` range,] then an empty id list up to infinity."""
    msg = Msg()
    lo = 0
    if first is not None:
        upper, matches = first
        lo = _below(upper[0])
        if matches:
            msg.range(upper, 0)  # pending skip: written, but not counted in `written`
            written = 1
        else:  # < T items there: the responder's own id list of them
            msg.range(upper, 2, leb(lo) + b"".join(IDS[:lo]))
            written = len(msg.buf)
    else:
        written = 1
    resume = list_ids(msg, ITEMS, lo, len(ITEMS), INFINITY, limit, written)
    if resume is not None:
        msg.range(INFINITY, 1, fp(IDS[resume:]))
    return bytes(msg.buf)


def _ask(first: tuple | None) -> bytes:
    head = b""
    if first is not None:
        upper, matches = first
        head = _bound(upper) + b"\x01" + (fp(IDS[: _below(upper[0])]) if matches else b"\xee" * 16)
    return V + head + b"\x00\x00" + b"\x02" + leb(0)


@pytest.mark.parametrize("first", [None, ((T0 + 10, b""), True), ((T0 + 2, b""), False)],
                         ids=["alone", "after-a-pending-skip", "after-an-id-list"])
def test_a_responder_lists_its_ids_by_the_stated_arithmetic(first):
    """Every frame limit from 4096 to 4160 and 65 536 (the floor of the arithmetic lands on
    each remainder mod 32): the answer is the expected bytes, id counts included."""
    for limit in [*range(4096, 4161), 65536]:
        reply, _, _ = Reconciler(STORE, frame_size_limit=limit).reconcile(_ask(first))
        expected = _expected(first, limit)
        assert reply == expected, (limit, len(reply), len(expected))
        assert len(reply) <= limit


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        value |= (data[pos] & 0x7F) << shift
        shift, pos = shift + 7, pos + 1
        if not data[pos - 1] & 0x80:
            return value, pos


def test_the_first_lists_of_a_64_kib_answer_hold_1024_then_1018_ids():
    """The figures of the worked arithmetic in 29.5 (L = 65 536, the id list alone)."""
    reply, _, _ = Reconciler(STORE, frame_size_limit=65536).reconcile(_ask(None))
    counts, pos = [], 1
    while reply[pos : pos + 2] != b"\x00\x00":
        _code, pos = _varint(reply, pos)
        plen, pos = _varint(reply, pos)
        mode, pos = _varint(reply, pos + plen)
        count, pos = _varint(reply, pos)
        assert mode == 2
        counts.append(count)
        pos += 32 * count
    assert counts == [1024, 1018] and reply[pos:] == b"\x00\x00\x01" + fp(IDS[sum(counts):])


@pytest.mark.parametrize("first_upper", [b"\x01\x00", b"\x01\x01\x00", b"\x01\x02\x00\x00"],
                         ids=["ts0-no-prefix", "ts0-prefix-00", "ts0-prefix-0000"])
def test_a_first_range_ending_at_the_lowest_position_is_out_of_order(first_upper):
    """The first range starts at (0, 32 zero bytes): an upper bound equal to it (timestamp 0
    with no prefix or a prefix of zero bytes only) is not strictly above it."""
    with pytest.raises(ReconcileError) as e:
        Reconciler(SortedItems(ITEMS[:5])).reconcile(V + first_upper + b"\x00")
    assert e.value.reason == "ranges_out_of_order"


def test_a_range_empty_of_items_is_not_out_of_order():
    """Only empty position intervals are refused: (0, 00 01) is above the lowest position,
    and a range holding none of the receiver's items is an ordinary range."""
    res = Reconciler(SortedItems(ITEMS[:5]))
    # (0, 00 01) skip, then up to (T0 - 5) where it holds nothing: skip; then the rest: skip
    assert res.reconcile(V + b"\x01\x02\x00\x01\x00" + leb(T0 - 5 + 1) + b"\x00\x00" + b"\x00\x00\x00")[0] == V
    prefix_padded = V + leb(T0 + 1) + b"\x01\x05\x00" + b"\x01\x02\x05\x00\x00"  # (T0, 05) then (T0, 05 00)
    with pytest.raises(ReconcileError) as e:
        Reconciler(SortedItems(ITEMS[:5])).reconcile(prefix_padded)
    assert e.value.reason == "ranges_out_of_order"  # compared padded to 32 bytes: equal


# -- 31.3: index entries ----------------------------------------------------------------------------

ALICE = Identity(bytes([1]) * 32)
AT = datetime(2026, 11, 29, 10, 15, tzinfo=timezone.utc)
MINIMAL_DID = "did:hmp:container:QmXb27Ua3SBq43YYhnPE9pkM4PoQmGMxMQYCjX4uAADRFG"
#: the second example of 31.3: a note with no tags, subclass, meta, related or local blocks
MINIMAL = (
    '{"did:hmp:container:QmXb27Ua3SBq43YYhnPE9pkM4PoQmGMxMQYCjX4uAADRFG":{"head":{"class":"note",'
    '"payload_hash":"sha256:cbbbdcd27692344de5dbab3abcaba413fb0f45307267de7081401576df1cb176",'
    '"public_key":"AKnL4NNf3DGWZJS6cPknBuEGnVsV4A4m5tgebLHaRSZ9",'
    '"sender_did":"did:hmp:agent:jPUMBAvNeJo8USHNtJ81Wm7cqnk","sig_algo":"ed25519",'
    '"signature":"DP7j4M5kgvt2Y5NBxpelFhLCrXJI8OLnCjOdvlui9seti_kQBTYzQe6EJEJD7depo4PBuYdd595YfqSGY8CxBA",'
    '"timestamp":"2026-11-29T10:15:00Z"}}}'
)


def _note(**kw) -> dict:
    return build_container(ALICE, "note", {"text": "hello"}, now=AT, **kw)["hmp_container"]


def test_an_entry_of_a_container_that_lacks_the_optional_members_is_its_head_alone():
    hmp = _note()
    assert hmp["head"]["container_did"] == MINIMAL_DID
    assert canonical_json({MINIMAL_DID: IX.entry_of(hmp)}).decode() == MINIMAL
    assert "tags" not in IX.entry_of(_note(tags=[]))["head"]  # empty tags: omitted


def test_each_optional_member_is_there_only_when_it_has_something():
    assert set(IX.entry_of(_note(tags=["t"], subclass="s"))["head"]) == {
        "class", "sender_did", "public_key", "sig_algo", "signature", "payload_hash", "tags", "timestamp", "subclass"}
    # meta members that are not published, or publish nothing, leave no `meta`
    bare = _note(meta={"sources": ["x"], "interpretation": "y", "axes": {"label": 1}})
    assert "meta" not in IX.entry_of(bare)
    assert set(IX.entry_of(_note(related={}))) == {"head"}
    entry = IX.entry_of(_note(related={"previous_version": MINIMAL_DID}))
    assert entry["related"] == {"previous_version": MINIMAL_DID} and "meta" not in entry
    assert "referenced-by_hash" not in entry and "evaluations_hash" not in entry  # no local blocks
    assert IX.entry_of(_note(include_public_key=False)) is None  # a required head member missing: no entry


def test_an_abstraction_path_with_no_did_is_omitted_not_published_empty():
    """`abstraction.path` keeps only DID values; when none is left the member goes, as every
    other empty member of an entry (it was published as `{"path": {}}`)."""
    assert IX.published_meta({"created_by": "AGENT", "abstraction": {"path": {"L1": "a label"}}}) == {
        "created_by": "AGENT"}
    assert IX.published_meta({"abstraction": {"agents_class": "KG", "path": {"L1": 7}}}) == {
        "abstraction": {"agents_class": "KG"}}
    assert IX.published_meta({"abstraction": {"path": {"L1": "did:hmp:container:a", "L2": "x"}}}) == {
        "abstraction": {"path": {"L1": "did:hmp:container:a"}}}


# -- 19 / 28.3.4: what a peer that only dials announces -----------------------------------------------


def test_the_unspecified_address_passes_the_handshake_and_no_dial_rule_keeps_it():
    """`tcp://0.0.0.0:<port>` is a valid address record (the handshake's `no_valid_address`
    is satisfied) that the dial rule refuses whatever vouches for it and whatever the policy."""
    from hmpnode.container.verify import Verifier
    from hmpnode.net import dialing as D
    from hmpnode.net.announce import build_peer_announce, check_peer_announce

    now = datetime.now(timezone.utc).replace(microsecond=0)
    announce = build_peer_announce(ALICE, addresses=["tcp://0.0.0.0:7420"], now=now, protocols=["hmp-peer/2"])
    check = check_peer_announce(Verifier().verify(announce, now=now), min_difficulty=3, now=now)
    assert check.ok and check.addresses == ("tcp://0.0.0.0:7420",)
    lenient = D.DialPolicy(private=True, hostnames=True, allow=D.parse_cidrs(["0.0.0.0/0"]))
    origins = [D.peer_origin("127.0.0.1", []), D.peer_origin("203.0.113.5", []), D.dht_origin(True),
               D.lan_origin("192.168.1.7", []), D.table_origin([]), D.OPERATOR]
    for origin in origins:
        for policy in (D.DialPolicy(), lenient):
            assert D.check("tcp://0.0.0.0:7420", origin, policy) == "special", (origin, policy)
