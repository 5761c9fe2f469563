"""The agent journal (hmpnode.memory.journal): chain, novelty, selective load, daily anchor."""

from __future__ import annotations

import copy
import functools
import hashlib
import random
from datetime import date, datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hmpnode.container.backlinks import links_from_related
from hmpnode.container.build import build_container
from hmpnode.container.canonical import canonical_json
from hmpnode.container.encoding import sha256_tag
from hmpnode.container.verify import Verifier, encode_wire
from hmpnode.identity import Identity
from hmpnode.memory import journal as J

ALICE = Identity(bytes([1]) * 32)
BOB = Identity(bytes([2]) * 32)
START = datetime(2026, 11, 28, 8, 0, 0, tzinfo=timezone.utc)
STEP = timedelta(hours=2)  # 20 entries: 2026-11-28 08:00 .. 2026-11-29 22:00
LATER = datetime(2026, 12, 5, tzinfo=timezone.utc)

TEXTS = [
    "Started the node and joined the mesh with three peers.",
    "Status check: node running, mesh joined, three peers.",
    "Status check: node running, mesh joined, three peers.",
    "Unexpected: peer lambda advertised an impossible clock, skew forty minutes!",
    "Status check: node running, peers three, clock skew noted.",
    "Read the DHT records; bucket refresh found two stale contacts.",
    "Status check: node running, mesh joined, three peers.",
    "Decision: pin lambda's key and drop its relay offers until clocks agree.",
    "Status check: node running, mesh joined, three peers.",
    "Хранилище выросло до двух гигабайт, компакция не запускалась.",
    "Status check: node running, mesh joined, three peers.",
    "Status check: node running, mesh joined, two peers.",
    "Relay chain from gamma carried a revoked key; containers quarantined.",
    "Status check: node running, mesh joined, three peers.",
    "Компакция хранилища завершена, освобождено два гигабайта.",
    "Status check: node running, mesh joined, three peers.",
    "New goal received: map latency between all LAN peers by Friday.",
    "Status check: node running, mesh joined, three peers, goal pending.",
    "Status check: node running, mesh joined, three peers.",
    "Latency map done; median four milliseconds, gamma is an outlier.",
]


def when(i: int) -> datetime:
    return START + i * STEP


@functools.cache
def _chain() -> tuple[dict, ...]:
    journal = J.Journal(ALICE)
    for i, text in enumerate(TEXTS):
        journal.append(text, now=when(i))
    return tuple(journal.entries)


def chain() -> list[dict]:
    return copy.deepcopy(list(_chain()))


def did(c: dict) -> str:
    return c["hmp_container"]["head"]["container_did"]


def tags(c: dict) -> list[str]:
    return c["hmp_container"]["head"]["tags"]


def novelty_of(c: dict) -> str:
    return J.read_entry(c).novelty.cls


def raw_entry(identity, text, *, seq, previous_did, earlier_texts, at, novelty=None, seq_tag=None):
    """An entry built straight from the documented format (not through build_entry)."""
    scored = J.assess(text, J.Vocabulary(earlier_texts))
    cls, new, total = novelty or scored
    head_tags = ["journal", f"journal_seq:{seq_tag or seq}", f"novelty:{cls}", f"novelty_words:{new}/{total}"]
    related = {"journal_previous": previous_did} if previous_did else None
    return build_container(
        identity, "diary_entry", {"title": f"journal #{seq}", "content": text}, now=at, tags=head_tags, related=related
    )


def raw_chain(identity, texts, times, seq_tags=None):
    out = []
    for i, text in enumerate(texts):
        out.append(raw_entry(
            identity, text, seq=i + 1, previous_did=did(out[-1]) if out else None, earlier_texts=texts[:i],
            at=times[i], seq_tag=seq_tags[i] if seq_tags else None,
        ))
    return out


def verify(entries, identity_did=ALICE.did):
    return J.verify_chain(entries, identity_did=identity_did, verifier=Verifier(), now=LATER)


def problem(entries, identity_did=ALICE.did):
    report = verify(entries, identity_did)
    assert not report.ok and report.first_problem is not None
    return report.first_problem


# -- words and novelty -------------------------------------------------------


def test_tokenize_is_unicode_aware_and_lowercase():
    assert J.tokenize("Hello, WORLD! hello-world") == ["hello", "world", "hello", "world"]
    assert J.tokenize("Привет, МИР…") == ["привет", "мир"]
    assert J.tokenize("ＦＵＬＬ width") == ["full", "width"]  # NFKC
    assert J.tokenize("Straße") == ["strasse"]  # casefold
    assert J.tokenize("नमस्ते दुनिया") == ["नमस्ते", "दुनिया"]  # combining marks stay inside the word
    assert J.tokenize("snake_case 3.14 don't") == ["snake_case", "3", "14", "don", "t"]
    assert J.tokenize("Cafe\u0301") == ["café"]  # NFKC composes
    assert J.tokenize("") == [] and J.tokenize(" ,.;!? ") == []


def test_vocabulary_accumulates_words():
    vocab = J.Vocabulary(["Alpha beta", "GAMMA"])
    assert "alpha" in vocab and "gamma" in vocab and "delta" not in vocab and len(vocab) == 3
    copy_ = vocab.copy()
    copy_.add("delta")
    assert "delta" in copy_ and "delta" not in vocab


KNOWN = " ".join(f"w{i}" for i in range(10))


@pytest.mark.parametrize(
    ("new", "total", "expected"),
    [
        (0, 10, "routine"),
        (2, 10, "routine"),  # exactly 0.2 is not > 0.2
        (1, 5, "routine"),  # 1/5 == 0.2 exactly, no float surprise
        (3, 10, "novel"),
        (5, 10, "novel"),  # exactly 0.5 is not > 0.5
        (1, 2, "novel"),
        (6, 10, "prediction_error"),
        (10, 10, "prediction_error"),
        (2, 3, "prediction_error"),
    ],
)
def test_novelty_thresholds(new, total, expected):
    vocab = J.Vocabulary([KNOWN])
    text = " ".join([f"n{i}" for i in range(new)] + [f"w{i}" for i in range(total - new)])
    cls, fraction = J.novelty(text, vocab)
    assert cls == expected
    assert fraction == pytest.approx(new / total)
    assert J.assess(text, vocab) == (expected, new, total)


def test_novelty_counts_repeated_new_words_and_edge_cases():
    vocab = J.Vocabulary(["a b c d e f g h"])
    # "zz" is new and counts twice: 2 new of 6 -> 0.33 -> novel
    assert J.assess("zz zz a b c d", vocab) == ("novel", 2, 6)
    assert J.assess("", vocab) == ("routine", 0, 0)
    assert J.assess("...", vocab).fraction == 0.0
    assert J.assess("anything at all", J.Vocabulary()) == ("prediction_error", 3, 3)
    # case and width do not make a word new
    assert J.assess("A B Ｃ", vocab) == ("routine", 0, 3)


def test_chain_has_every_novelty_class():
    classes = [novelty_of(c) for c in chain()]
    assert classes[0] == "prediction_error"
    assert {"routine", "novel", "prediction_error"} <= set(classes)
    assert classes[2] == "routine"  # a repeat of entry 2


# -- entry format ------------------------------------------------------------


def test_entry_format():
    entries = chain()
    first, second = entries[0]["hmp_container"], entries[1]["hmp_container"]
    assert first["head"]["class"] == "diary_entry"
    assert first["payload"] == {"title": "journal #1", "content": TEXTS[0]}
    assert "related" not in first
    assert tags(entries[0]) == ["journal", "journal_seq:1", "novelty:prediction_error", "novelty_words:10/10"]
    assert second["related"] == {J.RELATION: did(entries[0])}
    assert J.RELATION == "journal_previous"
    assert tags(entries[1])[:2] == ["journal", "journal_seq:2"]
    # the node's backlink index sees the link like any other relation
    assert links_from_related(did(entries[1]), second["related"]) == [("journal_previous", did(entries[0]))]
    for c in entries:
        result = Verifier().verify(c, now=LATER)
        assert result.ok and not result.store_and_forward


def test_documented_format_rebuilds_byte_identical_entries():
    """An implementation following only the docstring produces the same containers."""
    assert [encode_wire(c) for c in raw_chain(ALICE, TEXTS, [when(i) for i in range(20)])] == [
        encode_wire(c) for c in chain()
    ]


def test_build_entry_is_deterministic():
    a = J.build_entry(ALICE, "same text", previous=None, vocabulary=J.Vocabulary(), now=START)
    b = J.build_entry(ALICE, "same text", previous=None, vocabulary=J.Vocabulary(), now=START)
    assert encode_wire(a) == encode_wire(b)
    again = J.Journal(ALICE)
    for i, text in enumerate(TEXTS):
        again.append(text, now=when(i))
    assert [encode_wire(c) for c in again.entries] == [encode_wire(c) for c in _chain()]


def test_build_entry_options_and_refusals():
    entries = chain()
    vocab = J.Vocabulary(TEXTS)
    c = J.build_entry(ALICE, "x", previous=entries[-1], vocabulary=vocab, now=LATER, title="T", tags=["ops", "lan"])
    assert c["hmp_container"]["payload"]["title"] == "T"
    assert tags(c)[1] == "journal_seq:21" and tags(c)[4:] == ["ops", "lan"]
    for reserved in ("journal", "journal_seq:9", "novelty:routine", "novelty_words:1/2"):
        with pytest.raises(ValueError, match="reserved"):
            J.build_entry(ALICE, "x", previous=None, vocabulary=vocab, now=LATER, tags=[reserved])
    with pytest.raises(ValueError, match="before"):
        J.build_entry(ALICE, "x", previous=entries[-1], vocabulary=vocab, now=START)
    with pytest.raises(ValueError, match="another agent"):
        J.build_entry(BOB, "x", previous=entries[-1], vocabulary=vocab, now=LATER)
    with pytest.raises(ValueError):
        J.build_entry(ALICE, "x", previous={"not": "a container"}, vocabulary=vocab, now=LATER)
    # the same timestamp as the previous entry is allowed
    J.build_entry(ALICE, "x", previous=entries[-1], vocabulary=vocab, now=when(19))


def test_journal_resumes_from_a_chain():
    entries = chain()
    resumed = J.Journal(ALICE, entries[:10])
    for i in range(10, 20):
        resumed.append(TEXTS[i], now=when(i))
    assert [encode_wire(c) for c in resumed.entries] == [encode_wire(c) for c in entries]


def test_read_entry_rejects_malformed_journal_tags():
    c = chain()[3]
    J.read_entry(c)
    for bad in (
        ["journal_seq:4", "novelty:novel", "novelty_words:1/2"],  # no journal tag
        ["journal", "journal", "journal_seq:4", "novelty:novel", "novelty_words:1/2"],
        ["journal", "journal_seq:04", "novelty:novel", "novelty_words:1/2"],
        ["journal", "journal_seq:0", "novelty:novel", "novelty_words:1/2"],
        ["journal", "journal_seq:4", "journal_seq:5", "novelty:novel", "novelty_words:1/2"],
        ["journal", "journal_seq:4", "novelty:weird", "novelty_words:1/2"],
        ["journal", "journal_seq:4", "novelty:novel", "novelty_words:3/2"],
        ["journal", "journal_seq:4", "novelty:novel", "novelty_words:12"],
    ):
        broken = copy.deepcopy(c)
        broken["hmp_container"]["head"]["tags"] = bad
        with pytest.raises(ValueError):
            J.read_entry(broken)


# -- chain verification ---------------------------------------------------------


def test_chain_of_twenty_verifies_in_any_order():
    entries = chain()
    report = verify(entries)
    assert report.ok and report.first_problem is None
    assert report.count == 20 and report.head_did == did(entries[-1])
    assert [did(c) for c in report.chain] == [did(c) for c in entries]
    shuffled = entries[:]
    random.Random(7).shuffle(shuffled)
    again = verify(shuffled)
    assert again.ok and again.count == 20 and [did(c) for c in again.chain] == [did(c) for c in entries]
    assert again.to_json() == {"ok": True, "count": 20, "head_did": did(entries[-1]), "first_problem": None}


def test_empty_journal_and_duplicates():
    assert verify([]).ok and verify([]).count == 0
    entries = chain()
    report = verify(entries + [copy.deepcopy(entries[5])])
    assert report.ok and report.count == 20


def test_wire_bytes_are_accepted():
    assert verify([encode_wire(c) for c in chain()]).ok


def test_dropped_entry_is_missing():
    entries = chain()
    dropped = entries.pop(7)  # sequence 8
    p = problem(entries)
    assert p.kind == "missing" and p.index == 7 and p.container_did == did(entries[7])
    assert p.other_did == did(dropped) and p.position == 9
    assert dropped["hmp_container"]["head"]["container_did"] in p.detail
    report = verify(entries)
    assert report.count == 7 and report.head_did == did(entries[6])


def test_dropped_first_entry_is_missing():
    entries = chain()[1:]
    p = problem(entries)
    assert p.kind == "missing" and p.index == 0 and p.position == 2


def test_dropped_entry_found_in_shuffled_list():
    entries = chain()
    del entries[12]
    order = list(range(len(entries)))
    random.Random(3).shuffle(order)
    shuffled = [entries[i] for i in order]
    p = problem(shuffled)
    assert p.kind == "missing" and shuffled[p.index] is entries[12]


def test_backwards_timestamp_is_reordered():
    times = [when(i) for i in range(20)]
    times[9] = times[8] - timedelta(minutes=1)
    entries = raw_chain(ALICE, TEXTS, times)
    p = problem(entries)
    assert p.kind == "reordered" and p.index == 9 and p.other_did == did(entries[8])


def test_swapped_timestamps_are_reordered():
    times = [when(i) for i in range(20)]
    times[4], times[5] = times[5], times[4]
    p = problem(raw_chain(ALICE, TEXTS, times))
    assert p.kind == "reordered" and p.index == 5


def test_swapped_sequence_numbers_are_reordered():
    seqs = list(range(1, 21))
    seqs[10], seqs[11] = seqs[11], seqs[10]  # entry 11 records 12, entry 12 records 11
    p = problem(raw_chain(ALICE, TEXTS, [when(i) for i in range(20)], seq_tags=seqs))
    # position 11 records 12 and its successor records 11: a swap, named at the first of the pair
    assert p.kind == "reordered" and p.index == 10 and p.position == 11 and "followed by 11" in p.detail
    seqs = list(range(1, 21))
    seqs[10] = 10  # entry 11 repeats sequence 10
    p = problem(raw_chain(ALICE, TEXTS, [when(i) for i in range(20)], seq_tags=seqs))
    assert p.kind == "reordered" and p.index == 10 and p.position == 11


def test_skipped_sequence_number_with_intact_link_is_altered():
    seqs = [*range(1, 6), *range(7, 22)]  # 1..5, 7..21: the link is intact, the number lies
    p = problem(raw_chain(ALICE, TEXTS, [when(i) for i in range(20)], seq_tags=seqs))
    assert p.kind == "altered" and p.index == 5


def test_edited_text_without_resigning_is_broken():
    entries = chain()
    entries[6]["hmp_container"]["payload"]["content"] = "Nothing happened today."
    p = problem(entries)
    assert p.kind == "broken" and p.index == 6 and p.container_did == did(entries[6]) and p.position == 7
    assert "payload_hash_mismatch" in p.detail
    # fixing up payload_hash is not enough either
    entries = chain()
    payload = {"title": "journal #7", "content": "Nothing happened today."}
    entries[6]["hmp_container"]["payload"] = payload
    entries[6]["hmp_container"]["head"]["payload_hash"] = sha256_tag(canonical_json(payload))
    p = problem(entries)
    assert p.kind == "broken" and p.index == 6 and "container_did_mismatch" in p.detail


def test_edited_tags_or_link_without_resigning_is_broken():
    entries = chain()
    entries[4]["hmp_container"]["head"]["tags"][2] = "novelty:novel"
    assert (problem(entries).kind, problem(entries).index) == ("broken", 4)
    entries = chain()
    entries[4]["hmp_container"]["related"]["journal_previous"] = did(entries[1])
    assert (problem(entries).kind, problem(entries).index) == ("broken", 4)


def _resigned(entries, i, text, novelty=None):
    """Entry i with new content, signed again by alice, same links and sequence."""
    old = J.read_entry(entries[i])
    return raw_entry(
        ALICE, text, seq=old.seq, previous_did=old.previous, earlier_texts=TEXTS[:i], at=old.timestamp,
        novelty=novelty,
    )


def test_resigned_edit_with_wrong_novelty_is_altered():
    entries = chain()
    assert novelty_of(entries[8]) == "routine"
    text = "Completely rewritten: the vault was breached by unknown intruders overnight."
    entries[8] = _resigned(entries, 8, text, novelty=("routine", 0, 11))
    p = problem(entries)
    assert p.kind == "altered" and p.index == 8 and p.container_did == did(entries[8])
    assert "routine" in p.detail and "prediction_error" in p.detail


def test_resigned_edit_with_correct_novelty_is_altered():
    entries = chain()
    entries[8] = _resigned(entries, 8, "Status check: node running, mesh joined, four peers.")
    p = problem(entries)
    assert p.kind == "altered" and p.index == 8 and p.other_did == did(entries[9])


def test_wrong_novelty_from_the_start_is_altered():
    entries = raw_chain(ALICE, TEXTS[:5], [when(i) for i in range(5)])
    entries[0] = raw_entry(ALICE, TEXTS[0], seq=1, previous_did=None, earlier_texts=[], at=when(0),
                           novelty=("novel", 11, 11))
    entries[1:] = []
    p = problem(entries)
    assert p.kind == "altered" and p.index == 0


def test_two_entries_on_one_previous_are_forked():
    entries = chain()
    extra = raw_entry(ALICE, "A second thought at the same place.", seq=11, previous_did=did(entries[9]),
                      earlier_texts=TEXTS[:10], at=when(10) + timedelta(minutes=5))
    entries.append(extra)
    p = problem(entries)
    assert p.kind == "forked" and p.index == 20 and p.container_did == did(extra)
    assert p.other_did == did(entries[10]) and p.position == 11
    assert verify(entries).count == 10


def test_fork_at_the_tip_keeps_the_earlier_entry():
    entries = chain()
    later = raw_entry(ALICE, "tip b", seq=20, previous_did=did(entries[18]), earlier_texts=TEXTS[:19],
                      at=when(19) + timedelta(seconds=1))
    p = problem([later] + entries)
    assert p.kind == "forked" and p.index == 0


def test_two_first_entries_are_forked():
    entries = chain()
    other_root = raw_entry(ALICE, "another beginning", seq=1, previous_did=None, earlier_texts=[],
                           at=when(0) + timedelta(minutes=1))
    p = problem(entries + [other_root])
    assert p.kind == "forked" and p.index == 20 and p.position == 1


def test_entry_signed_by_another_agent_is_broken():
    entries = chain()
    entries[5] = raw_entry(BOB, TEXTS[5], seq=6, previous_did=did(entries[4]), earlier_texts=TEXTS[:5], at=when(5))
    p = problem(entries)
    assert p.kind == "broken" and p.index == 5 and BOB.did in p.detail
    # appended rather than substituted
    entries = chain()
    entries.insert(3, raw_entry(BOB, "bob was here", seq=4, previous_did=did(entries[2]), earlier_texts=TEXTS[:3],
                                at=when(3)))
    p = problem(entries)
    assert p.kind == "broken" and p.index == 3


def test_wrong_agent_breaks_everything_at_the_first_entry():
    p = problem(chain(), identity_did=BOB.did)
    assert p.kind == "broken" and p.index == 0 and p.position == 1


def test_other_class_or_untagged_entry_is_broken():
    entries = chain()
    entries.append(build_container(ALICE, "diary_entry", {"title": "t", "content": "no tags"}, now=LATER))
    p = problem(entries)
    assert p.kind == "broken" and p.index == 20 and p.position is None


def test_junk_items_are_broken_not_exceptions():
    entries = chain()
    for junk in (None, 5, "x", b"{}", {}, {"hmp_container": []}, [entries[0]]):
        p = problem(entries + [junk])
        assert p.kind == "broken" and p.index == 20 and p.container_did is None


def test_future_entry_is_broken():
    entries = chain()
    report = J.verify_chain(entries, identity_did=ALICE.did, now=when(10))
    assert not report.ok and report.first_problem.kind == "broken" and report.first_problem.index == 11
    assert "future_timestamp" in report.first_problem.detail
    assert report.count == 11


def test_first_problem_is_the_earliest_in_the_chain():
    entries = chain()
    del entries[15]  # missing at sequence 17
    entries[4]["hmp_container"]["payload"]["content"] = "edited"  # broken at sequence 5
    p = problem(entries)
    assert (p.kind, p.index) == ("broken", 4)
    problem_json = verify(entries).to_json()["first_problem"]
    assert problem_json["kind"] == "broken" and problem_json["index"] == 4


# hypothesis: verify_chain never raises ---------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_PATHS = [
    ("hmp_container",),
    ("hmp_container", "head"),
    ("hmp_container", "payload"),
    ("hmp_container", "payload", "content"),
    ("hmp_container", "related"),
    ("hmp_container", "related", "journal_previous"),
    ("hmp_container", "head", "tags"),
    ("hmp_container", "head", "timestamp"),
    ("hmp_container", "head", "container_did"),
    ("hmp_container", "head", "sender_did"),
    ("hmp_container", "head", "class"),
]
_ops = st.one_of(
    st.tuples(st.just("drop"), st.integers(0, 100)),
    st.tuples(st.just("dup"), st.integers(0, 100)),
    st.tuples(st.just("set"), st.integers(0, 100), st.sampled_from(_PATHS), _json),
    st.tuples(st.just("junk"), st.integers(0, 100), _json),
    st.tuples(st.just("tag"), st.integers(0, 100), st.integers(0, 3), st.text(max_size=20)),
)


def _apply(entries, op):
    if not entries:
        return
    i = op[1] % len(entries)
    if op[0] == "drop":
        del entries[i]
    elif op[0] == "dup":
        entries.append(copy.deepcopy(entries[i]))
    elif op[0] == "junk":
        entries[i] = op[2]
    elif op[0] == "tag":
        try:
            entries[i]["hmp_container"]["head"]["tags"][op[2]] = op[3]
        except (TypeError, KeyError, IndexError):
            pass
    else:
        target = entries[i]
        *parents, last = op[2]
        for name in parents:
            target = target.get(name) if isinstance(target, dict) else None
        if isinstance(target, dict):
            target[last] = copy.deepcopy(op[3])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_ops, max_size=4), seed=st.integers(0, 2**32))
def test_verify_chain_never_raises(ops, seed):
    entries = chain()[:8]
    for op in ops:
        _apply(entries, op)
    random.Random(seed).shuffle(entries)
    report = verify(entries)
    assert report.ok == (report.first_problem is None)
    assert 0 <= report.count <= 8
    if report.first_problem is not None:
        assert 0 <= report.first_problem.index < len(entries)
        assert report.first_problem.kind in {"broken", "missing", "reordered", "altered", "forked"}
    if not ops:
        assert report.ok and report.count == 8
    report.to_json()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32), dups=st.lists(st.integers(0, 7), max_size=3))
def test_permutations_with_copies_verify(seed, dups):
    entries = chain()[:8]
    entries += [copy.deepcopy(entries[i]) for i in dups]
    random.Random(seed).shuffle(entries)
    report = verify(entries)
    assert report.ok and report.count == 8 and report.head_did == did(_chain()[7])


# -- selective load ---------------------------------------------------------------


def _tokens(c):
    return len(J.tokenize(c["hmp_container"]["payload"]["content"]))


def test_selective_load_takes_newest_non_routine_in_order():
    entries = chain()
    non_routine = [c for c in entries if novelty_of(c) != "routine"]
    assert 3 <= len(non_routine) < 20
    everything = sum(_tokens(c) for c in non_routine)
    assert J.selective_load(entries, max_tokens=everything) == non_routine
    budget = _tokens(non_routine[-1]) + _tokens(non_routine[-2])
    assert J.selective_load(entries, max_tokens=budget) == non_routine[-2:]
    assert J.selective_load(entries, max_tokens=budget + _tokens(non_routine[-3]) - 1) == non_routine[-2:]
    assert J.selective_load(entries, max_tokens=0) == []
    shuffled = entries[::-1]
    assert J.selective_load(shuffled, max_tokens=everything) == non_routine


def test_selective_load_include_routine_and_custom_counter():
    entries = chain()
    assert J.selective_load(entries, max_tokens=10**6, include_routine=True) == entries
    by_chars = J.selective_load(entries, max_tokens=200, count_tokens=lambda c: len(J.read_entry(c).content) // 4)
    assert by_chars and sum(len(J.read_entry(c).content) // 4 for c in by_chars) <= 200
    with pytest.raises(ValueError):
        J.selective_load(entries, max_tokens=-1)
    with pytest.raises(ValueError):
        J.selective_load(entries, max_tokens=5, count_tokens=lambda c: -1)


def test_selective_load_stops_at_the_first_entry_that_does_not_fit():
    # newest first: a big newest entry blocks older small ones (no holes in "the newest")
    entries = raw_chain(ALICE, ["alpha", "beta gamma delta", "epsilon zeta"], [when(i) for i in range(3)])
    assert [novelty_of(c) for c in entries] == ["prediction_error"] * 3
    assert J.selective_load(entries, max_tokens=1) == []
    assert J.selective_load(entries, max_tokens=2) == entries[2:]
    assert J.selective_load(entries, max_tokens=3) == entries[2:]  # "alpha" would fit, but "beta..." is newer
    assert J.selective_load(entries, max_tokens=4) == entries[2:]
    assert J.selective_load(entries, max_tokens=5) == entries[1:]
    assert J.selective_load(entries, max_tokens=6) == entries


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(0, 200), include=st.booleans(), seed=st.integers(0, 1000))
def test_selective_load_never_exceeds_budget(budget, include, seed):
    entries = chain()
    random.Random(seed).shuffle(entries)
    loaded = J.selective_load(entries, max_tokens=budget, include_routine=include)
    assert sum(_tokens(c) for c in loaded) <= budget
    seqs = [J.read_entry(c).seq for c in loaded]
    assert seqs == sorted(seqs)
    if not include:
        assert all(novelty_of(c) != "routine" for c in loaded)
    # it is a suffix of the eligible entries: nothing newer was skipped
    eligible = [J.read_entry(c).seq for c in chain() if include or novelty_of(c) != "routine"]
    assert seqs == eligible[len(eligible) - len(seqs):]
    for c in loaded:  # never truncated
        assert c["hmp_container"]["payload"]["content"] in TEXTS


# -- daily anchor ------------------------------------------------------------------


DAY1, DAY2 = date(2026, 11, 28), date(2026, 11, 29)


def _day_entries(day):
    return [c for c in chain() if c["hmp_container"]["head"]["timestamp"].startswith(day.isoformat())]


def test_day_anchor_payload():
    entries = chain()
    day2 = _day_entries(DAY2)
    assert len(day2) == 12 and len(_day_entries(DAY1)) == 8
    payload = J.day_anchor(entries, DAY2, agent_did=ALICE.did)
    joined = "|".join(sorted(did(c) for c in day2))
    counts = {"novel": 0, "prediction_error": 0, "routine": 0}
    for c in day2:
        counts[novelty_of(c)] += 1
    assert payload == {
        "agent_did": ALICE.did,
        "date": "2026-11-29",
        "count": 12,
        "dna_hash": "sha256:" + hashlib.sha256(joined.encode()).hexdigest(),
        "novelty_counts": counts,
        "first_did": did(day2[0]),
        "last_did": did(day2[-1]),
    }
    # order of the input and other days do not matter
    assert J.day_anchor(day2[::-1], DAY2, agent_did=ALICE.did) == payload
    assert J.day_anchor(day2 + _day_entries(DAY1) + [day2[3]], DAY2, agent_did=ALICE.did) == payload
    # other agents' entries are ignored
    bob_entry = J.build_entry(BOB, "bob's day", previous=None, vocabulary=J.Vocabulary(), now=when(12))
    assert J.day_anchor(entries + [bob_entry], DAY2, agent_did=ALICE.did) == payload


def test_empty_day_anchor():
    payload = J.day_anchor(chain(), date(2026, 11, 30), agent_did=ALICE.did)
    assert payload["count"] == 0 and payload["first_did"] is None and payload["last_did"] is None
    assert payload["dna_hash"] == sha256_tag(b"")
    assert payload["novelty_counts"] == {"novel": 0, "prediction_error": 0, "routine": 0}


def test_anchor_is_signed_and_checks():
    entries = chain()
    anchor = J.build_anchor(ALICE, entries, DAY1, now=datetime(2026, 11, 29, 0, 0, tzinfo=timezone.utc))
    head = anchor["hmp_container"]["head"]
    assert head["class"] == "journal_anchor" and head["sender_did"] == ALICE.did
    assert head["tags"] == ["journal_anchor", "journal_date:2026-11-28"]
    result = Verifier().verify(anchor, now=LATER)
    assert result.ok and result.store_and_forward == frozenset({"class"})
    assert anchor["hmp_container"]["payload"] == J.day_anchor(entries, DAY1, agent_did=ALICE.did)
    assert J.check_anchor(anchor, entries) == (True, "")
    assert J.check_anchor(anchor, _day_entries(DAY1)) == (True, "")
    assert J.check_anchor(anchor, _day_entries(DAY1), verifier=Verifier(), now=LATER) == (True, "")
    # deterministic
    again = J.build_anchor(ALICE, entries[::-1], DAY1, now=datetime(2026, 11, 29, 0, 0, tzinfo=timezone.utc))
    assert encode_wire(again) == encode_wire(anchor)


def test_anchor_detects_added_removed_and_edited_entries():
    entries = chain()
    anchor = J.build_anchor(ALICE, entries, DAY2, now=LATER)
    # an entry removed from the day
    ok, detail = J.check_anchor(anchor, [c for c in entries if did(c) != did(entries[15])])
    assert not ok and "dna_hash" in detail and "count" in detail
    # an entry added to the day (the chain continues on the same day)
    extra = J.build_entry(ALICE, "late night note about gamma", previous=entries[-1],
                          vocabulary=J.Vocabulary(TEXTS), now=datetime(2026, 11, 29, 23, 30, tzinfo=timezone.utc))
    ok, detail = J.check_anchor(anchor, entries + [extra])
    assert not ok and "dna_hash" in detail and "last_did" in detail
    assert J.day_anchor(entries + [extra], DAY2, agent_did=ALICE.did)["dna_hash"] != (
        anchor["hmp_container"]["payload"]["dna_hash"])
    # an entry of another day added or removed changes nothing
    assert J.check_anchor(anchor, entries[1:]) == (True, "")
    nextday = J.build_entry(ALICE, "next day", previous=extra, vocabulary=J.Vocabulary(TEXTS),
                            now=datetime(2026, 11, 30, 0, 0, 1, tzinfo=timezone.utc))
    assert J.check_anchor(anchor, entries + [nextday]) == (True, "")
    # an entry of the day edited without re-signing
    edited = chain()
    edited[14]["hmp_container"]["payload"]["content"] = "changed"
    ok, detail = J.check_anchor(anchor, edited)
    assert not ok and did(edited[14]) in detail and "does not verify" in detail


def test_tampered_anchor_fails():
    entries = chain()
    anchor = J.build_anchor(ALICE, entries, DAY2, now=LATER)
    forged = copy.deepcopy(anchor)
    forged["hmp_container"]["payload"]["count"] = 11
    ok, detail = J.check_anchor(forged, entries)
    assert not ok and "does not verify" in detail
    # re-signed by alice but with a wrong count
    payload = dict(anchor["hmp_container"]["payload"], count=11)
    wrong = build_container(ALICE, "journal_anchor", payload, now=LATER)
    ok, detail = J.check_anchor(wrong, entries)
    assert not ok and detail.endswith("count")
    # bob anchoring alice's entries
    ok, detail = J.check_anchor(build_container(BOB, "journal_anchor", anchor["hmp_container"]["payload"], now=LATER),
                                entries)
    assert not ok and "signer" in detail
    # bob's anchor over his own (empty) journal does not match alice's entries
    bob_anchor = J.build_anchor(BOB, entries, DAY2, now=LATER)
    assert bob_anchor["hmp_container"]["payload"]["count"] == 0
    assert J.check_anchor(bob_anchor, entries) == (True, "")  # bob wrote nothing that day: true
    # not an anchor at all, junk
    assert J.check_anchor(entries[0], entries)[0] is False
    assert J.check_anchor(None, entries)[0] is False
    assert J.check_anchor({"hmp_container": {"head": 5}}, entries)[0] is False
    junk_date = build_container(ALICE, "journal_anchor", dict(payload, count=12, date="2026-11-29x"), now=LATER)
    assert J.check_anchor(junk_date, entries) == (False, "anchor date is not YYYY-MM-DD")


def test_anchor_waits_for_the_day_to_end():
    with pytest.raises(ValueError, match="not over"):
        J.build_anchor(ALICE, chain(), DAY2, now=datetime(2026, 11, 29, 23, 59, 59, tzinfo=timezone.utc))
    J.build_anchor(ALICE, chain(), DAY2, now=datetime(2026, 11, 30, 0, 0, 0, tzinfo=timezone.utc))


def test_anchor_and_load_refuse_junk_with_value_error():
    entries = chain()
    for junk in (None, 5, {"hmp_container": None}, {"hmp_container": {"head": "x"}}):
        with pytest.raises(ValueError):
            J.day_anchor(entries + [junk], DAY2, agent_did=ALICE.did)
        with pytest.raises(ValueError):
            J.selective_load(entries + [junk], max_tokens=100)
        anchor = J.build_anchor(ALICE, entries, DAY2, now=LATER)
        ok, detail = J.check_anchor(anchor, entries + [junk])
        assert not ok and detail.startswith("cannot check")
