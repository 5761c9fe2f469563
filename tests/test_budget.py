"""Recall under a budget (issue 5): the token rule and the whole-item packer."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hmpnode.container.canonical import canonical_json
from hmpnode.memory.budget import (
    ABSTAIN_ENVELOPE, ABSTAIN_NO_CANDIDATES, ABSTAIN_SMALLEST, EXHAUSTED, TOO_LARGE, UNSTABLE,
    BudgetError, Skip, pack,
)
from hmpnode.memory.tokens import TOKENIZER_ID, TOKENIZER_VERSION, count_json_tokens, count_tokens

# ---------------------------------------------------------------- token rule


def reference_count(text: str) -> int:
    """The rule table of hmpnode.memory.tokens, written as a plain loop (no regex)."""
    def ascii_letter(c: str) -> bool:
        return "A" <= c <= "Z" or "a" <= c <= "z"

    def digit(c: str) -> bool:
        return "0" <= c <= "9"

    def small(c: str) -> bool:
        cp = ord(c)
        return (0xC0 <= cp <= 0x24F and cp not in (0xD7, 0xF7)) or 0x370 <= cp <= 0x52F

    n = i = 0
    while i < len(text):
        c = text[i]
        if c in " \t\n\r\f\v":
            i += 1
            continue
        for cls, chunk in ((ascii_letter, 4), (digit, 3), (small, 2)):
            if cls(c):
                j = i
                while j < len(text) and cls(text[j]):
                    j += 1
                n += -(-(j - i) // chunk)
                i = j
                break
        else:
            cp = ord(c)
            n += 1 if cp < 0x800 else 2 if cp < 0x10000 else 3
            i += 1
    return n


@pytest.mark.parametrize(("text", "tokens"), [
    ("", 0),
    ("  \n\t\r ", 0),
    ("abcd", 1),                 # one chunk of 4
    ("abcde", 2),                # abcd|e
    ("Hello, world!", 6),        # Hell|o , worl|d !
    ("Привет, мир", 6),          # Пр|ив|ет , ми|р
    ("ПРИВЕТ", 3),
    ("x = 12345", 4),            # x = 123|45
    ("1234567", 3),              # 123|456|7
    ("ab12cd", 3),               # ab 12 cd: runs of different classes never merge
    ("café", 2),                 # caf (ASCII) é (small alphabet)
    ("Größe", 3),                # Gr ö ße
    ("a_b", 3),
    ("×", 1),                    # U+00D7 is not a letter: catch-all, 2 UTF-8 bytes
    ("\u00a0", 1),               # no-break space is not free (only ASCII whitespace is)
    ("—", 2),                    # U+2014, 3 UTF-8 bytes
    ("日本語 👍", 9),             # 2+2+2, space free, 3
    ("😀😀", 6),
    ("def f(x): return x+1", 11),  # def f ( x ) : retu|rn x + 1
])
def test_hand_counted_tokens(text, tokens):
    assert count_tokens(text) == tokens
    assert reference_count(text) == tokens


def test_json_tokens_count_the_canonical_text():
    # {"a":[1,"b c"]}: 15 bytes, 14 one-character pieces (the space is free)
    assert canonical_json({"a": [1, "b c"]}) == b'{"a":[1,"b c"]}'
    assert count_json_tokens({"a": [1, "b c"]}) == 14
    assert count_json_tokens("Привет") == 5          # " Пр ив ет "
    assert count_json_tokens("\n") == 4              # " \ n "  (escaped newline)
    assert count_json_tokens({"b": 1, "a": 2}) == count_tokens('{"a":2,"b":1}')


def test_tokenizer_identity():
    assert TOKENIZER_ID == "hmpnode-approx-v1" and TOKENIZER_VERSION == 1
    with pytest.raises(TypeError):
        count_tokens(b"bytes")  # type: ignore[arg-type]


any_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(any_text)
def test_regex_rule_matches_reference_loop(text):
    assert count_tokens(text) == reference_count(text)


@settings(max_examples=200, deadline=None)
@given(any_text, any_text)
def test_whitespace_separates_pieces(a, b):
    assert count_tokens(a + " " + b) == count_tokens(a) + count_tokens(b)


@settings(max_examples=200, deadline=None)
@given(any_text)
def test_bounds(text):
    solid = "".join(c for c in text if c not in " \t\n\r\f\v")
    # never cheaper than one token per 4 characters, never dearer than one per UTF-8 byte
    assert -(-len(solid) // 4) <= count_tokens(text) <= len(solid.encode("utf-8"))


# ---------------------------------------------------------------- packing examples


def env_with_receipt(items, receipt):
    return {"type": "hmp.recall", "schema_version": 1, "items": items, "receipt": receipt}


def env_items_only(items, _receipt):
    return {"items": items}


def measure(value):
    data = canonical_json(value)
    return count_tokens(data.decode("utf-8")), len(data)


def check_result(result, candidates, max_tokens, max_bytes):
    """The invariants every result keeps, recounted independently."""
    assert len(set(result.selected_indices)) == len(result.selected_indices)
    assert list(result.selected_indices) == sorted(result.selected_indices)
    assert [s.index for s in result.skipped] == sorted(s.index for s in result.skipped)
    assert sorted(list(result.selected_indices) + [s.index for s in result.skipped]) == list(range(len(candidates)))
    for i, item in zip(result.selected_indices, result.selected):
        assert item is candidates[i]
    assert result.fits_any == bool(result.selected)
    if result.envelope is None:
        assert result.abstain_reason == ABSTAIN_ENVELOPE and result.envelope_json is None
        assert all(s.reason == EXHAUSTED for s in result.skipped)
        return
    data = canonical_json(result.envelope)
    assert data == result.envelope_json
    tokens = reference_count(data.decode("utf-8"))
    assert len(data) <= max_bytes and tokens <= max_tokens
    assert (tokens, len(data)) == (result.tokens_used, result.bytes_used)
    assert result.remaining_tokens == max_tokens - tokens >= 0
    assert result.remaining_bytes == max_bytes - len(data) >= 0
    r = result.receipt
    assert (r["used_tokens"], r["used_bytes"], r["max_tokens"], r["max_bytes"]) == (tokens, len(data), max_tokens, max_bytes)
    assert r["selected_count"] == len(result.selected)


def test_skips_a_big_item_and_takes_a_smaller_later_one():
    candidates = [{"text": "alpha"}, {"text": "x" * 400}, {"text": "gamma"}, {"text": "delta " * 3}]
    result = pack(candidates, max_tokens=1000, max_bytes=300, envelope=env_with_receipt)
    check_result(result, candidates, 1000, 300)
    assert result.selected == [candidates[0], candidates[2], candidates[3]]
    assert result.skipped == (Skip(1, TOO_LARGE),)
    assert result.envelope["items"] == [candidates[0], candidates[2], candidates[3]]
    assert result.receipt["tokenizer_id"] == TOKENIZER_ID and result.receipt["tokenizer_version"] == 1
    assert result.abstain_reason is None
    # the token budget alone can also force the skip (400 x = 100 tokens)
    by_tokens = pack(candidates, max_tokens=150, max_bytes=10_000, envelope=env_with_receipt)
    check_result(by_tokens, candidates, 150, 10_000)
    assert by_tokens.selected_indices == (0, 2, 3) and by_tokens.skipped == (Skip(1, TOO_LARGE),)


def test_nothing_fits_abstains_with_the_empty_envelope():
    candidates = [{"text": "y" * 500}, {"text": "z" * 300}]
    result = pack(candidates, max_tokens=10_000, max_bytes=250, envelope=env_with_receipt)
    check_result(result, candidates, 10_000, 250)
    assert result.selected == [] and not result.fits_any
    assert result.abstain_reason == ABSTAIN_SMALLEST
    assert result.skipped == (Skip(0, TOO_LARGE), Skip(1, TOO_LARGE))
    assert result.envelope["items"] == [] and result.receipt["selected_count"] == 0


def test_no_candidates():
    result = pack([], max_tokens=1000, max_bytes=1000, envelope=env_with_receipt)
    check_result(result, [], 1000, 1000)
    assert result.abstain_reason == ABSTAIN_NO_CANDIDATES and result.envelope["items"] == []


def test_budget_below_the_empty_envelope_returns_nothing():
    candidates = [{"a": 1}]
    result = pack(candidates, max_tokens=1000, max_bytes=20, envelope=env_with_receipt)
    check_result(result, candidates, 1000, 20)
    assert result.envelope is None and result.skipped == (Skip(0, EXHAUSTED),)
    zero = pack(candidates, max_tokens=0, max_bytes=0, envelope=env_items_only)
    assert zero.envelope is None and zero.abstain_reason == ABSTAIN_ENVELOPE


def test_exact_fit_without_receipt():
    item = {"content": "Восстановление checkpoint начинается с durable manifest.", "kind": "fact"}
    tokens, size = measure(env_items_only([item], None))
    exact = pack([item, {"k": 1}], max_tokens=tokens, max_bytes=size, envelope=env_items_only)
    check_result(exact, [item, {"k": 1}], tokens, size)
    assert exact.selected == [item] and (exact.tokens_used, exact.bytes_used) == (tokens, size)
    assert exact.remaining_tokens == exact.remaining_bytes == 0
    assert exact.skipped == (Skip(1, EXHAUSTED),)
    for max_tokens, max_bytes in ((tokens - 1, size), (tokens, size - 1)):
        short = pack([item], max_tokens=max_tokens, max_bytes=max_bytes, envelope=env_items_only)
        assert short.selected == [] and short.abstain_reason == ABSTAIN_SMALLEST


def test_exact_fit_with_the_receipt_inside():
    # Budgets of three digits both times, so the receipt's own width does not
    # change between the measuring run and the exact-fit run.
    item = {"content": "short note", "kind": "fact"}
    loose = pack([item], max_tokens=999, max_bytes=999, envelope=env_with_receipt)
    tokens, size = loose.tokens_used, loose.bytes_used
    assert 100 <= tokens < 999 and 100 <= size < 999
    exact = pack([item], max_tokens=tokens, max_bytes=size, envelope=env_with_receipt)
    check_result(exact, [item], tokens, size)
    assert exact.selected == [item] and (exact.tokens_used, exact.bytes_used) == (tokens, size)
    assert exact.envelope["receipt"]["used_bytes"] == size == len(exact.envelope_json)
    assert pack([item], max_tokens=tokens, max_bytes=size - 1, envelope=env_with_receipt).selected == []
    assert pack([item], max_tokens=tokens - 1, max_bytes=size, envelope=env_with_receipt).selected == []


def test_receipt_digits_are_part_of_the_measure():
    # An envelope that writes the receipt numbers several times: still exact.
    def loud(items, r):
        return {"items": items, "r": r, "again": [r["used_bytes"], r["used_tokens"]] * 5}

    candidates = [{"n": i, "t": "word " * i} for i in range(30)]
    result = pack(candidates, max_tokens=400, max_bytes=1000, envelope=loud)
    check_result(result, candidates, 400, 1000)
    assert result.envelope["again"][0] == result.bytes_used


def test_unstable_envelope_is_skipped_not_returned():
    # The pad makes the size depend on the parity of the stated size: with the
    # item the envelope is 24 bytes (even) without pad, so it cycles 24 <-> 25.
    def parity(items, r):
        return {"items": items, "pad": "x" if r["used_bytes"] % 2 == 0 else ""}

    assert len(canonical_json({"items": ["a"], "pad": ""})) == 24
    result = pack(["a"], max_tokens=1000, max_bytes=1000, envelope=parity)
    check_result(result, ["a"], 1000, 1000)
    assert result.skipped == (Skip(0, UNSTABLE),) and result.envelope == {"items": [], "pad": "x"}


def test_a_non_additive_envelope_fails_closed():
    # the frame grows with the square of the item count: additivity is a contract the
    # final measurement checks; a broken one raises instead of returning an unmeasured value
    def quadratic(items, _r):
        return {"items": items, "pad": "x" * len(items) ** 2}

    with pytest.raises(BudgetError):
        pack([{"a": 1}, {"b": 2}, {"c": 3}], max_tokens=1000, max_bytes=1000, envelope=quadratic)


def test_packing_is_linear_in_the_candidates():
    """Issue 12: the envelope was rebuilt per candidate (O(n^2) serialisation); now each
    candidate costs builds of at most two items plus the empty frame, and one full build."""
    sizes: list[int] = []

    def counted(items, r):
        sizes.append(len(items))
        return env_with_receipt(items, r)

    candidates = [{"text": f"note {i} " + "word " * 20} for i in range(400)]
    result = pack(candidates, max_tokens=10**7, max_bytes=10**7, envelope=counted)
    assert len(result.selected) == 400
    assert sum(sizes) <= 3 * 400 + 400  # before: about 3 builds of up to 400 items per candidate


@pytest.mark.parametrize("bad", [-1, 1.5, True, None, "10"])
def test_bad_budgets(bad):
    with pytest.raises(BudgetError):
        pack([], max_tokens=bad, max_bytes=10, envelope=env_items_only)
    with pytest.raises(BudgetError):
        pack([], max_tokens=10, max_bytes=bad, envelope=env_items_only)


# ---------------------------------------------------------------- properties

EMOJI = ["👍", "😀", "🧠", "👩‍💻", "🇷🇺", "日本", "Ж", "é", "\u0301", "\u00a0", "\u2028"]
words = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=30),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyzабвгдеёжзийклмнопрстуфхцчшщъыьэюя", min_size=20, max_size=120),
    st.lists(st.sampled_from(EMOJI + ["word", " ", "\n", '"', "\\"]), max_size=20).map("".join),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**53) + 1, 2**53 - 1),
    st.floats(min_value=-1e15, max_value=1e15, allow_nan=False), words,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(words, inner, max_size=4)),
    max_leaves=12,
)
items = st.dictionaries(st.text(max_size=10), json_values, max_size=4)
# tiny, around the size of a few items (the empty receipt envelope alone is
# 115 tokens and 211 bytes), and large
token_budgets = st.one_of(st.integers(0, 40), st.integers(110, 1500), st.integers(0, 20_000))
byte_budgets = st.one_of(st.integers(0, 60), st.integers(200, 4000), st.integers(0, 40_000))
envelopes = st.sampled_from([env_with_receipt, env_items_only])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(items, max_size=10), token_budgets, byte_budgets, envelopes)
def test_never_over_budget_whole_items_in_order(candidates, max_tokens, max_bytes, envelope):
    original = copy.deepcopy(candidates)
    result = pack(candidates, max_tokens=max_tokens, max_bytes=max_bytes, envelope=envelope)
    check_result(result, candidates, max_tokens, max_bytes)
    assert candidates == original  # nothing was rewritten or truncated
    if result.envelope is not None:
        assert result.envelope["items"] == [original[i] for i in result.selected_indices]
    # deterministic: equal input, byte-identical envelope and decisions
    again = pack(copy.deepcopy(original), max_tokens=max_tokens, max_bytes=max_bytes, envelope=envelope)
    assert again.envelope_json == result.envelope_json
    assert (again.selected_indices, again.skipped) == (result.selected_indices, result.skipped)
    # decisions never depend on later candidates
    if candidates:
        cut = len(candidates) // 2
        prefix = pack(candidates[:cut], max_tokens=max_tokens, max_bytes=max_bytes, envelope=envelope)
        assert prefix.selected_indices == tuple(i for i in result.selected_indices if i < cut)


@settings(max_examples=80, deadline=None)
@given(st.lists(items, min_size=1, max_size=10), st.integers(0, 1500), st.integers(0, 4000))
def test_receipt_envelope_just_above_its_own_size(candidates, extra_tokens, extra_bytes):
    # budgets that always admit the empty receipt envelope (115 tokens, 211
    # bytes at these widths), so the packing itself is what is exercised
    max_tokens, max_bytes = 115 + extra_tokens, 211 + extra_bytes
    result = pack(candidates, max_tokens=max_tokens, max_bytes=max_bytes, envelope=env_with_receipt)
    check_result(result, candidates, max_tokens, max_bytes)
    assert result.envelope is not None
    assert result.envelope["items"] == result.selected
    assert all(s.reason in (TOO_LARGE, EXHAUSTED) for s in result.skipped)


@settings(max_examples=50, deadline=None)
@given(st.lists(items, min_size=1, max_size=8), envelopes)
def test_generous_budget_takes_everything(candidates, envelope):
    tokens, size = measure(envelope(candidates, {"used_tokens": 10**6, "used_bytes": 10**6,
                                                 "max_tokens": 10**7, "max_bytes": 10**7,
                                                 "tokenizer_id": TOKENIZER_ID, "tokenizer_version": 1,
                                                 "selected_count": len(candidates)}))
    result = pack(candidates, max_tokens=10**7, max_bytes=10**7, envelope=envelope)
    check_result(result, candidates, 10**7, 10**7)
    assert result.selected_indices == tuple(range(len(candidates))) and result.skipped == ()
    assert result.tokens_used <= tokens and result.bytes_used <= size


# ---------------------------------------------------------------- the recall envelope (issue 12)

from hmpnode.memory.index import recall_terms  # noqa: E402
from hmpnode.memory.recall import OVERSIZE, Candidate, recall, short_id  # noqa: E402

STATES = ("active", "active", "active", "superseded", "expired", "contested", "revoked")


@st.composite
def recall_inputs(draw):
    n = draw(st.integers(0, 12))
    candidates = []
    for i in range(n):
        payload = draw(st.one_of(st.builds(lambda t: {"text": "kernel lantern " + t}, words), json_values))
        candidates.append(Candidate(
            did=f"did:hmp:container:Qm{i:04d}", seq=i + 1, class_=draw(st.sampled_from(["note", "diary_entry"])),
            sender=draw(st.sampled_from(["did:hmp:agent:me", "did:hmp:agent:other"])),
            timestamp=f"2026-11-{1 + i % 28:02d}T00:00:00Z", ts_us=i * 10**9, state=draw(st.sampled_from(STATES)),
            bm25=-draw(st.floats(0, 20, allow_nan=False)),
            matched=tuple(sorted(draw(st.sets(st.sampled_from(["kernel", "lantern"]))))),
            evaluations=draw(st.floats(-3, 3, allow_nan=False)),
            confidence=draw(st.one_of(st.none(), st.floats(0, 1))),
            payload_hash=f"sha256:{i}", payload=OVERSIZE if draw(st.integers(0, 20)) == 0 else payload,
            head=draw(st.booleans())))
    return candidates


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recall_inputs(), token_budgets, byte_budgets, st.booleans(), st.booleans())
def test_recall_packing_keeps_budgets_and_whole_items(candidates, max_tokens, max_bytes, why, contested):
    """The compact envelope, with and without the full receipt: never over either budget
    (recounted from scratch), whole payloads of non-excluded relevant candidates only, in
    ranking order, deterministic; below an empty answer, the fixed abstain."""
    terms = recall_terms("kernel lantern")
    original = [copy.deepcopy(c.payload) if c.payload is not OVERSIZE else OVERSIZE for c in candidates]
    kwargs = dict(terms=terms, weights={"kernel": 1.0, "lantern": 1.0}, now_us=40 * 10**9,
                  self_did="did:hmp:agent:me", max_tokens=max_tokens, max_bytes=max_bytes,
                  include_contested=contested, why=why)
    out = recall(candidates, **kwargs)
    assert [c.payload for c in candidates] == original
    assert recall(candidates, **kwargs).envelope_json == out.envelope_json  # deterministic
    env = out.envelope
    assert out.envelope_json == canonical_json(env)
    if out.packed is None:
        assert env["items"] == [] and env["abstain"] == "budget_too_small"
        return
    tokens = reference_count(out.envelope_json.decode("utf-8"))
    assert tokens <= max_tokens and len(out.envelope_json) <= max_bytes
    assert env["used"] == [tokens, len(out.envelope_json)]
    allowed = {"active", "contested"} if contested else {"active"}
    for item, c in zip(env["items"], out.selected, strict=True):
        assert c.state in allowed and c.payload is not OVERSIZE and c.matched  # relevant: half the weight or more
        assert item["id"] == short_id(c.did) and item["p"] == c.payload and item.get("s", "active") == c.state
        assert ("by" in item) == (c.sender != "did:hmp:agent:me")
    if why:
        assert [w["did"] for w in env["why"]] == [c.did for c in out.selected]
    assert env["n"][0] + sum(env["x"]) == len(candidates)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 12.0, allow_nan=False), st.booleans()), min_size=1, max_size=6),
       st.sampled_from([0.0, 0.3, 0.5, 0.8, 1.0]))
def test_the_index_query_never_leaves_out_a_relevant_memory(spec, min_coverage):
    """recall.required_clauses: every set of matched terms that recall would call relevant
    holds the identifying terms and one whole clause (so the index query, which requires
    them, loses nothing relevant)."""
    from hmpnode.memory.index import QueryTerm
    from hmpnode.memory.recall import relevant_terms, required_clauses

    terms = [QueryTerm(f"w{i}", (f"w{i}",), identifying) for i, (_, identifying) in enumerate(spec)]
    weights = {t.word: w for t, (w, _) in zip(terms, spec)}
    clauses = required_clauses(terms, weights, min_coverage)
    for mask in range(1 << len(terms)):
        matched = [t.word for i, t in enumerate(terms) if mask >> i & 1]
        if relevant_terms(matched, terms, weights, min_coverage):
            assert clauses is None or any(all(t.word in matched for t in c) for c in clauses), (matched, clauses)
