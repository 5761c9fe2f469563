"""Differential fuzzing: the canonical fast path (hmpnode/container/fastpath.py) against
the full verifier (`Verifier(fast_path=False)`).

For every input both verifiers must return the same verdict: ok, reason, detail,
container DID, expired, store-and-forward flags, key_revoked_later, pin candidate,
the parsed container and the opened payload. Inputs: every vector in tests/vectors
and ../shared/vectors, containers built here (plain, tagged, encrypted, compressed,
binary, with meta/related, with referenced-by / evaluations / relay_chain blocks,
unicode, escapes, big and small numbers, nesting at the depth limit) and mutations of
them (byte flips, key order, whitespace, escapes, number forms, duplicate keys,
truncation, NaN, surrogates). The corpus must send a good share through the fast
path, or the comparison would prove nothing; `test_a_planted_disagreement_is_caught`
shows the harness fails when the fast path is wrong.

Hypothesis runs derandomized with bounded examples (a few seconds).
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hmpnode.container import fastpath
from hmpnode.container.build import Recipient, build_container
from hmpnode.container.encoding import parse_time
from hmpnode.container.verify import Limits, Verifier, VerifyResult, encode_wire
from hmpnode.identity import Identity, MemoryKeyRegistry
from hmpnode.vectors import DeterministicRng

from .conftest import REPO

NOW = datetime(2026, 11, 29, 10, 15, tzinfo=UTC)
ALICE = Identity(bytes([0xD1]) * 32)
BOB = Identity(bytes([0xD2]) * 32)
REVOKED = Identity(bytes([0xD3]) * 32)
LIMITS = Limits(max_depth=16, max_container_bytes=64 * 1024)  # small, so the corpus reaches both edges
CI = settings(max_examples=150, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _registry() -> MemoryKeyRegistry:
    registry = MemoryKeyRegistry()
    registry.revoke(REVOKED.did, datetime(2026, 11, 28, tzinfo=UTC))
    return registry


def verdict(result: VerifyResult) -> tuple:
    return (result.ok, result.reason, result.detail, result.container_did, result.expired,
            sorted(result.store_and_forward), result.key_revoked_later, result.pin_candidate,
            result.container, result.payload)


class Pair:
    """Both verifiers over one registry and limits; counts inputs the fast path took."""

    def __init__(self, limits: Limits = LIMITS):
        self.limits = limits
        registry = _registry()
        self.fast = Verifier(registry=registry, limits=limits)
        self.full = Verifier(registry=registry, limits=limits, fast_path=False)
        self.seen = self.taken = self.bodies = self.inline = 0
        accept = self.fast._accept_canonical

        def counted(wire, now):
            verdict = accept(wire, now)
            self.inline += verdict is not None
            return verdict

        self.fast._accept_canonical = counted  # how many verdicts the straight-line acceptance gave

    def check(self, raw: bytes, now: datetime = NOW, from_peer: bool = False) -> str | None:
        """None when both agree, else a description of the disagreement. An accepted
        container's `body` (fast path only) must read back to its hmp_container."""
        self.seen += 1
        if fastpath.canonical_wire(raw, self.limits.max_container_bytes, self.limits.max_depth) is not None:
            self.taken += 1
        fast = self.fast.verify(raw, now=now, from_peer=from_peer)
        a = verdict(fast)
        b = verdict(self.full.verify(raw, now=now, from_peer=from_peer))
        if a != b:
            return f"{raw[:200]!r}...: fast {a[:4]} full {b[:4]}"
        if fast.body is not None:
            self.bodies += 1
            problem = body_problem(fast)
            if problem is not None:
                return f"{raw[:200]!r}...: {problem}"
        return None


def body_problem(result: VerifyResult) -> str | None:
    """Why `result.body` is not the stored text of its hmp_container, or None."""
    if not result.ok:
        return "a refused container has a body"
    hmp = result.container["hmp_container"]
    back = orjson.loads(result.body)
    if back != hmp or orjson.dumps(back, option=orjson.OPT_SORT_KEYS) != orjson.dumps(hmp, option=orjson.OPT_SORT_KEYS):
        return f"body {result.body[:120]!r} does not read back to hmp_container"
    return None


def assert_agree(pair: Pair, raw: bytes, **kw: Any) -> None:
    problem = pair.check(raw, **kw)
    assert problem is None, problem


# -- the corpus ------------------------------------------------------------------


def nest(depth: int) -> Any:
    value: Any = "leaf"
    for i in range(depth):
        value = {"n": value} if i % 2 else [value]
    return value


def built() -> list[dict[str, Any]]:
    """Containers of every form the builder makes."""
    rng = DeterministicRng("differential")
    out = [
        build_container(ALICE, "goal", {"title": "Map the mesh", "description": "d", "priority": 0.8},
                        now=NOW, tags=["a", "b"], confidence=0.9),
        build_container(ALICE, "note", {"text": "Grüße, 東京 🌍 \u2028 \\ \" \u0001 \u007f", "n": -0.5, "big": 2**53 - 1,
                                        "small": 1e-7, "huge": 1e21, "int_float": 3.0, "neg": -12345.678e-3},
                        now=NOW, ttl="2026-11-29T10:00:00Z"),
        build_container(ALICE, "note", {"text": "zstd " * 50}, now=NOW, compression="zstd"),
        build_container(ALICE, "note", {"text": "gzip " * 50}, now=NOW, compression="gzip"),
        build_container(ALICE, "note", b"\x00\x01binary", now=NOW, binary=True),
        build_container(ALICE, "note", {"text": "for bob"}, now=NOW, rng=rng,
                        encrypt_to=[Recipient(BOB.did, BOB.public_key)]),
        build_container(ALICE, "note", {"text": "for both"}, now=NOW, rng=rng, compression="zstd",
                        encrypt_to=[Recipient(BOB.did, BOB.public_key), Recipient(ALICE.did, ALICE.public_key)]),
        build_container(ALICE, "note", {"x": 1}, now=NOW, meta={"z": [1, 2.5, {"k": None}]},
                        related={"in_reply_to": "did:hmp:container:x", "see_also": ["did:hmp:a:b"]},
                        recipients=[BOB.did], broadcast=False, network="localhost", subclass="s"),
        build_container(ALICE, "note", {"payload": {"payload": 1}, "signature": "x"}, now=NOW,
                        head_extra={"x_extra": {"signature": "y", "container_did": "z"}}),
        build_container(REVOKED, "note", {"text": "after revocation"}, now=NOW),
        build_container(ALICE, "note", {"text": "from the future"}, now=NOW.replace(hour=12)),
        build_container(ALICE, "note", {"text": "no key"}, now=NOW, include_public_key=False),
        build_container(ALICE, "peer_query", {"wrong": True}, now=NOW, schemas=_NoClassCheck()),
        build_container(ALICE, "goal", {"title": 5}, now=NOW, schemas=_NoClassCheck()),
    ]
    # signed, canonical, and refused by the base schema (a stable head member out of range)
    out.append(build_container(ALICE, "note", {"x": 2}, now=NOW, confidence=5, schemas=_NoChecks()))
    for depth in (LIMITS.max_depth - 5, LIMITS.max_depth - 4, LIMITS.max_depth - 3, LIMITS.max_depth - 2):
        out.append(build_container(ALICE, "note", {"deep": nest(depth)}, now=NOW, schemas=_NoClassCheck()))
    # unsigned blocks beside hmp_container (sorted before and after it)
    base = out[0]
    out.append({**base, "evaluations": {"evaluations_hash": "sha256:" + "0" * 64, "items": [{"value": -0.4}]}})
    out.append({**base, "referenced-by": {"links": [{"type": "see_also", "target": "did:hmp:a:b"}]},
                "relay_chain": [{"relay_did": "did:hmp:agent:x", "timestamp": "2026-11-29T10:15:00Z"}]})
    return out


class _NoChecks:
    """Schemas that let the builder sign what the base schema refuses too."""

    def knows(self, class_name: str) -> bool:
        return False

    def check_class(self, class_name: str, payload: Any) -> None:
        return None

    def check_base(self, hmp: Any) -> None:
        return None


class _NoClassCheck:
    """Schemas that let the builder write what a class schema (or depth) would refuse."""

    def __init__(self):
        from hmpnode.container.schema import default_schemas

        self._real = default_schemas()

    def knows(self, class_name: str) -> bool:
        return False

    def check_class(self, class_name: str, payload: Any) -> None:
        return None

    def check_base(self, hmp: Any) -> str | None:
        return self._real.check_base(hmp)


def vector_inputs() -> list[tuple[bytes, datetime, dict[str, Any]]]:
    """(wire bytes, now, vector) of every container vector, in canonical form and as committed."""
    out = []
    for root in (REPO / "tests" / "vectors", REPO / ".." / "shared" / "vectors"):
        for path in sorted(Path(root).rglob("*.json")) if Path(root).is_dir() else ():
            vector = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(vector, dict) or "now" not in vector:
                continue
            now = parse_time(vector["now"])
            if "wire" in vector:
                out.append((vector["wire"].encode(), now, vector))
            if isinstance(vector.get("container"), dict):
                out.append((encode_wire(vector["container"]), now, vector))
                out.append((orjson.dumps(vector["container"]), now, vector))
    return out


def jcs_inputs() -> list[bytes]:
    """The JCS test inputs (../shared/vectors/jcs, tests/data/jcs) as payloads: as a
    signed container (canonical), and spliced as written into its wire text."""
    out = []
    for root in (REPO / ".." / "shared" / "vectors" / "jcs" / "input", REPO / "tests" / "data" / "jcs" / "input"):
        for path in sorted(root.glob("*.json")) if root.is_dir() else ():
            text = path.read_bytes().strip()
            value = json.loads(text)
            c = build_container(ALICE, "note", {"v": value}, now=NOW, schemas=_NoClassCheck())
            raw = encode_wire(c)
            out.append(raw)
            inner = orjson.dumps(c["hmp_container"]["payload"]["v"], option=orjson.OPT_SORT_KEYS)
            out.append(raw.replace(inner, text, 1))  # same value, its text as the vector writes it
    return out


CORPUS = [encode_wire(c) for c in built()]


def test_vectors_agree():
    pair = Pair(Limits())
    vectors = vector_inputs()
    assert len(vectors) >= 17
    for raw, now, vector in vectors:
        registry = pair.fast.registry
        for did, when in vector.get("registry", {}).get("revocations", {}).items():
            registry.revoke(did, parse_time(when))
        assert_agree(pair, raw, now=now)
    assert pair.taken >= 10, "the vectors must exercise the fast path"


def test_jcs_vectors_agree():
    pair = Pair(Limits())
    inputs = jcs_inputs()
    assert len(inputs) >= 12
    for raw in inputs:
        assert_agree(pair, raw)
    assert pair.taken >= 6


def test_built_containers_agree_and_take_the_fast_path():
    pair = Pair()
    for raw in CORPUS:
        for from_peer in (False, True):
            assert_agree(pair, raw, from_peer=from_peer)
    # all are canonical; the fast path declines only the two deepest (its depth bound is
    # one level conservative)
    assert pair.taken == 2 * (len(CORPUS) - 2)
    assert pair.bodies >= len(CORPUS), "accepted fast-path containers come with their body"


def test_bytes_like_inputs_take_the_fast_path():
    """An item's own text cut from a body (msgspec.Raw), a memoryview or a bytearray is
    verified as the same bytes: same verdict, the fast path, the same body."""
    pair = Pair()
    raws = msgspec.json.decode(b'{"containers":[' + b",".join(CORPUS) + b"]}",
                               type=dict[str, list[msgspec.Raw]])["containers"]
    for raw, item in zip(CORPUS, raws, strict=True):
        want = pair.fast.verify(raw, now=NOW)
        for form in (item, memoryview(raw), bytearray(raw)):
            got = pair.fast.verify(form, now=NOW)
            assert verdict(got) == verdict(want)
            assert got.body == want.body
    assert sum(pair.fast.verify(item, now=NOW).body is not None for item in raws) >= 10


def test_the_depth_edge():
    """The fast path's depth bound is conservative: it never takes what the full parse
    refuses as too deep, on either side of the limit (and the bare form)."""
    pair = Pair()
    for depth in range(LIMITS.max_depth - 6, LIMITS.max_depth + 2):
        c = build_container(ALICE, "note", {"deep": nest(depth)}, now=NOW, schemas=_NoClassCheck())
        for extra in ({}, {"meta_block": nest(depth)}):
            raw = encode_wire({**c, **extra})
            assert_agree(pair, raw)
        assert_agree(pair, encode_wire(c["hmp_container"]))  # the bare form: full path only


def test_the_size_edge():
    """At the size limit and one byte over it (malformed), both paths agree."""
    for raw in CORPUS[:4]:
        for limit in (len(raw), len(raw) - 1):
            pair = Pair(Limits(max_depth=LIMITS.max_depth, max_container_bytes=limit))
            assert_agree(pair, raw)
            if limit < len(raw):
                assert pair.fast.verify(raw, now=NOW).reason == "malformed"


# -- mutations -------------------------------------------------------------------

_FORMS = [
    (b"0.9", [b"0.90", b"9e-1", b"0.9e0", b"9E-1"]),
    (b"0.8", [b"8e-1", b"0.80"]),
    (b'"bench"', [b'"\\u0062ench"', b'"b\\u0065nch"']),
    (b'"a"', [b'"\\u0061"', b'"\\u0041"']),
    (b'-0.5', [b'-5e-1', b'-0.50']),
    (b'1e-7', [b'1e-07', b'0.0000001', b'1.0e-7']),
    (b'1e+21', [b'1e21', b'1000000000000000000000', b'1E+21']),
    (b'"int_float":3', [b'"int_float":3.0', b'"int_float":3e0', b'"int_float":-0', b'"int_float":-0.0',
                        b'"int_float":9007199254740992', b'"int_float":NaN', b'"int_float":1e400']),
    (b'"big":9007199254740991', [b'"big":9007199254740991.0', b'"big":9007199254740992',
                                 b'"big":90071992547409910']),
    (b'\\u0001', [b'\\u0001'.upper(), b'\\u0001'.replace(b"u", b"U")]),
    (b'"x":1', [b'"x":1,"x":1', b'"x":1.0', b'"x": 1', b'"x":"\\ud800"', b'"x":"\\udc00\\ud800"']),
    (b'"class":"goal"', [b'"class":"goal","class":"goal"', b'"class" :"goal"']),
    (b'"head":{', [b'"head": {', b'"head":{"a_first":1,']),
    (b'{"hmp_container":', [b'{"a":0,"hmp_container":', b' {"hmp_container":', b'{"hmp_container":{"head":{}},"hmp_container":']),
]


def mutations(raw: bytes, rnd: random.Random) -> list[bytes]:
    out = []
    for old, news in _FORMS:
        if old in raw:
            out.extend(raw.replace(old, new, 1) for new in news)
    doc = orjson.loads(raw)
    out.append(orjson.dumps(doc))  # insertion order as built: not sorted
    hmp = doc["hmp_container"]
    out.append(orjson.dumps({"hmp_container": {k: hmp[k] for k in reversed(list(hmp))}}))
    out.append(json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())
    out.append(json.dumps(doc, sort_keys=True).encode())  # whitespace
    out.append(raw + b"\n")
    # padding the signature (outside the signed bytes) keeps it valid, up to the schema's 4096 characters
    sig = orjson.loads(raw)["hmp_container"]["head"].get("signature")
    if isinstance(sig, str):
        for pad in (b"==", b"=" * (4097 - len(sig)), b"=" * (4096 - len(sig)), b"A", b"AA"):
            out.append(raw.replace(sig.encode(), sig.encode() + pad, 1))
        forged = ("B" if sig[:1] == "A" else "A") + sig[1:]  # still base64url, 64 bytes: does not verify
        out.append(raw.replace(sig.encode(), forged.encode(), 1))
    out.append(b"\xef\xbb\xbf" + raw)  # BOM
    for _ in range(6):
        at = rnd.randrange(len(raw))
        out.append(raw[:at] + bytes([raw[at] ^ (1 << rnd.randrange(8))]) + raw[at + 1:])
        out.append(raw[:at])  # truncated
    return out


def test_mutations_agree():
    pair = Pair()
    rnd = random.Random(15)
    for raw in CORPUS:
        for bad in mutations(raw, rnd):
            for from_peer in (False, True):
                assert_agree(pair, bad, from_peer=from_peer)
    assert pair.seen > 500


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.text(max_size=12)
    | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([0.0, -0.0, 1.0, 1e21, 1e-7, 2.0**53, 0.1]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


@CI
@given(payload=st.dictionaries(st.text(max_size=8), json_values, max_size=5), tags=st.lists(st.text(max_size=5), max_size=3),
       flip=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_generated_containers_agree(payload, tags, flip, bit):
    """Random payloads (unicode, escapes, big and small numbers, nesting) built and
    signed, then sent as built, as a byte flip and as numbers/escapes rewritten."""
    pair = Pair()
    try:
        c = build_container(ALICE, "note", payload, now=NOW, tags=tags, schemas=_NoClassCheck())
        raw = encode_wire(c)
    except (ValueError, TypeError):  # what canonical JSON cannot carry (2**53 and beyond ...)
        raw = orjson.dumps({"hmp_container": {"head": {}, "payload": payload}}, option=orjson.OPT_SORT_KEYS)
    assert_agree(pair, raw)
    at = flip % len(raw)
    assert_agree(pair, raw[:at] + bytes([raw[at] ^ (1 << bit)]) + raw[at + 1:])
    assert_agree(pair, raw.replace(b".0", b".00", 1).replace(b"e+", b"e", 1))
    assert_agree(pair, raw.replace(b"\\u00", b"\\u00".upper(), 1).replace(b"\\n", b"\\u000a", 1))


@CI
@given(data=st.binary(max_size=300), prefix=st.sampled_from([b"", b'{"hmp_container":{"head":{"class":']))
def test_random_bytes_agree(data, prefix):
    assert_agree(Pair(), prefix + data)


def test_the_straight_line_acceptance_agrees():
    """Second sight of each corpus container and its mutations (memos and key cache warm):
    `Verifier._accept_canonical` gives most accepted verdicts, and they agree."""
    pair = Pair()
    rnd = random.Random(16)
    inputs = [bad for raw in CORPUS for bad in [raw, *mutations(raw, rnd)]]
    for _ in range(2):
        for raw in inputs:
            for from_peer in (False, True):
                assert_agree(pair, raw, from_peer=from_peer)
    assert pair.inline >= 40
    forged = [raw for raw in inputs if pair.fast.verify(raw, now=NOW).reason == "bad_signature"]
    assert len(forged) >= 10  # answered by the straight-line code too (a forged signature is checked once)


def test_a_planted_acceptance_gap_is_caught(monkeypatch):
    """The straight-line acceptance trusts the base-schema memo: were it to trust every
    head, the signed container with a bad member would be accepted and the harness says so."""
    import hmpnode.container.verify as verify_module

    monkeypatch.setattr(verify_module, "passed_before", lambda hmp: True)
    pair = Pair()
    problems = [p for raw in CORPUS for p in (pair.check(raw), pair.check(raw)) if p]
    assert problems and pair.inline, "a planted bug went unnoticed"


def test_a_planted_disagreement_is_caught(monkeypatch):
    """The harness is not blind: a fast path that skips one of its proofs (here: that
    float literals are already canonical) is caught by the mutations above."""
    monkeypatch.setattr(fastpath, "_DECODER", fastpath.msgspec.json.Decoder())
    pair = Pair()
    problems = [p for raw in CORPUS for bad in mutations(raw, random.Random(15)) if (p := pair.check(bad))]
    assert problems, "a planted bug went unnoticed"


@pytest.mark.parametrize("planted", ["depth", "duplicates"])
def test_other_planted_disagreements_are_caught(monkeypatch, planted):
    real_dumps = fastpath.orjson.dumps

    class Lenient:
        OPT_SORT_KEYS, OPT_STRICT_INTEGER, OPT_INDENT_2 = (fastpath.orjson.OPT_SORT_KEYS,
                                                           fastpath.orjson.OPT_STRICT_INTEGER,
                                                           fastpath.orjson.OPT_INDENT_2)
        JSONEncodeError = fastpath.orjson.JSONEncodeError

        @staticmethod
        def dumps(value, option=None):
            if planted == "depth" and option == fastpath.orjson.OPT_INDENT_2:
                return b"{}"  # no depth bound
            return real_dumps(value, option=option)

    monkeypatch.setattr(fastpath, "orjson", Lenient)
    if planted == "duplicates":  # compare the text without its duplicates: the proof is gone
        real_wire = fastpath.canonical_wire

        def no_dup_proof(data, max_bytes, max_depth):
            doc = fastpath._DECODER.decode(data) if data[:1] == b"{" else None
            try:
                again = real_dumps(doc, option=fastpath._SORTED) if isinstance(doc, dict) else data
            except Exception:  # noqa: BLE001
                again = data
            return real_wire(again, max_bytes, max_depth)

        monkeypatch.setattr("hmpnode.container.verify.canonical_wire", no_dup_proof)
    pair = Pair()
    inputs = list(CORPUS)
    for depth in range(LIMITS.max_depth - 3, LIMITS.max_depth + 2):
        inputs.append(encode_wire(build_container(ALICE, "note", {"deep": nest(depth)}, now=NOW,
                                                  schemas=_NoClassCheck())))
    problems = [p for raw in inputs for bad in [raw, *mutations(raw, random.Random(15))] if (p := pair.check(bad))]
    assert problems, f"planted bug ({planted}) went unnoticed"


def test_a_forged_signature_is_checked_once(monkeypatch):
    """A canonical container from a known sender with a forged signature costs one
    signature check (the straight-line code answers `bad_signature` itself), with the
    verdict of the full verifier."""
    import hmpnode.container.verify as verify_module

    good = encode_wire(build_container(ALICE, "goal", {"title": "once"}, now=NOW, tags=["a", "b"], confidence=0.9))
    sig = orjson.loads(good)["hmp_container"]["head"]["signature"]
    forged = good.replace(sig.encode(), (("B" if sig[0] == "A" else "A") + sig[1:]).encode())
    pair = Pair()
    assert_agree(pair, good)  # the sender's key and the head are known from here on
    real, calls = verify_module.sodium.crypto_sign_open, []

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(verify_module.sodium, "crypto_sign_open", counted)
    result = pair.fast.verify(forged, now=NOW)
    assert (result.reason, result.detail, len(calls)) == ("bad_signature", "signature does not verify", 1)
    assert_agree(pair, forged)
