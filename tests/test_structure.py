"""Differential test of the hand-written base schema (hmpnode.container.structure)
against the contract, schemas/container.schema.json, run by jsonschema.

`check_structure(hmp)` must return None exactly when the schema accepts `hmp`.
Inputs are valid hmp_container objects from `build_container`, mutated by
hypothesis: head fields replaced by random JSON values (strings that look like
DIDs, timestamps, base58, base64url, hashes, class tokens, CIDRs, payload
types, strings at every length bound, random text, each optionally followed by
"\\n" or other whitespace), fields added and removed, related values and
group_recipient entries changed, arrays and objects at their size bounds.

The `$` question: JSON Schema patterns are ECMA-262 regular expressions, where
`$` matches only at the end of the string. jsonschema runs them with Python's
`re.search`, whose `$` also matches just before a final "\\n"; structure.py uses
`fullmatch` and so has the ECMA meaning. The reference here is therefore
jsonschema's Draft7Validator *extended* (jsonschema.validators.extend) with a
`pattern` keyword that reads `$` as `\\Z` (a regex-engine override, not a skip);
it must agree with check_structure on every input. The stock Draft7Validator is
run too and may disagree only by accepting an input that holds a string ending
in "\\n", which check_structure rejects. (Once every pattern ends in the guard
`(?!\\n)$`, as schemas/classes/ do, the stock validator agrees as well; the
tests hold for the schema with or without the guard.)

Both sides still use Python's `re` for `\\S` and the other classes, so this
test does not check ECMA character-class semantics (Python's `\\s` includes
U+001C..U+001F and U+0085, ECMA's includes U+FEFF).
"""

from __future__ import annotations

import copy
import json
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hmpnode.container import structure
from hmpnode.container.build import Recipient, build_container
from hmpnode.container.encoding import format_time
from hmpnode.container.structure import check_structure
from hmpnode.identity import Identity

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "schemas" / "container.schema.json").read_text(encoding="utf-8"))
NOW = datetime(2026, 11, 29, 10, 15, tzinfo=timezone.utc)

ALICE = Identity(bytes([0xA1]) * 32)
BOB = Identity(bytes([0xB0]) * 32)
CAROL = Identity(bytes([0xC0]) * 32)

HYPOTHESIS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------- the reference


def _ecma_regex(pattern: str) -> re.Pattern[str]:
    # ECMA-262 `$` without the m flag matches only at the end of input: Python's \Z.
    return re.compile(re.sub(r"(?<!\\)\$", r"\\Z", pattern))


_ECMA_CACHE: dict[str, re.Pattern[str]] = {}


def _ecma_pattern(validator, pattern, instance, schema):
    if not validator.is_type(instance, "string"):
        return
    compiled = _ECMA_CACHE.get(pattern)
    if compiled is None:
        compiled = _ECMA_CACHE[pattern] = _ecma_regex(pattern)
    if compiled.search(instance) is None:
        yield jsonschema.ValidationError(f"{instance!r:.80} does not match {pattern!r} (ECMA-262)")


EcmaDraft7Validator = jsonschema.validators.extend(jsonschema.Draft7Validator, validators={"pattern": _ecma_pattern})
STOCK = jsonschema.Draft7Validator(SCHEMA)
ECMA = EcmaDraft7Validator(SCHEMA)


def _patterns(node: Any):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "pattern":
                yield value
            else:
                yield from _patterns(value)
    elif isinstance(node, list):
        for item in node:
            yield from _patterns(item)


def _strings(value: Any):
    if type(value) is str:
        yield value
    elif type(value) is dict:
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif type(value) is list:
        for item in value:
            yield from _strings(item)


def assert_agree(hmp: Any, *, record: bool = False) -> bool:
    """check_structure and the ECMA reference agree on `hmp`; returns whether it is valid.
    `record` labels the outcome with hypothesis.event (only inside @given)."""
    mine = check_structure(hmp)
    ecma = ECMA.is_valid(hmp)
    if (mine is None) != ecma:
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in ECMA.iter_errors(hmp)]
        raise AssertionError(f"check_structure says {mine!r}, ECMA jsonschema says {errors or 'valid'}")
    stock = STOCK.is_valid(hmp)
    if stock != ecma:
        # the only allowed difference: Python's `$` before a final newline
        assert stock and not ecma
        assert any(s.endswith("\n") for s in _strings(hmp)), hmp
        if record:
            event("stock jsonschema accepts a trailing newline")
    if record:
        event("valid" if ecma else "invalid")
    return ecma


# --------------------------------------------------------------- the twin's shape


def test_reference_patterns_are_anchored_once():
    patterns = sorted(set(_patterns(SCHEMA)))
    assert patterns
    for pattern in patterns:
        assert pattern.startswith("^") and pattern.endswith("$") and pattern.count("$") == 1, pattern
    assert _ecma_regex("^a$").search("a\n") is None and re.search("^a$", "a\n") is not None


def test_same_fields_and_required_fields():
    head = SCHEMA["definitions"]["head"]
    assert set(structure._HEAD) == set(head["properties"])
    assert set(structure._REQUIRED_HEAD) == set(head["required"])
    assert set(SCHEMA["required"]) == {"head", "payload"}


# --------------------------------------------------------------- base containers


def _bases() -> dict[str, dict[str, Any]]:
    rng = iter(range(10**6))

    def rand(n: int) -> bytes:
        return bytes((next(rng) * 37) % 256 for _ in range(n))

    common = dict(now=NOW, meta={"m": [1, {"n": None}]}, related={"in_reply_to": "did:example:x",
                                                                   "see_also": ["did:a:b", BOB.did]})
    return {
        "full": build_container(
            ALICE, "note", {"x": 1}, subclass="s", tags=["a", "b"], ttl=NOW + timedelta(days=1),
            recipients=[BOB.did], broadcast=True, network="lan:10.0.0.0/8", confidence=0.5,
            magnet_uri="magnet:?xt=urn:btih:abc", **common,
        )["hmp_container"],
        "enc_single": build_container(
            ALICE, "note", {"x": 1}, rng=rand, compression="zstd", encrypt_to=[Recipient(BOB.did, BOB.public_key)],
            **common,
        )["hmp_container"],
        "enc_group": build_container(
            ALICE, "note", {"x": 1}, now=NOW, rng=rand,
            encrypt_to=[Recipient(BOB.did, BOB.public_key), Recipient(CAROL.did, CAROL.public_key)],
        )["hmp_container"],
        "minimal": build_container(ALICE, "peer_announce", {"addresses": []}, now=NOW,
                                   include_public_key=False)["hmp_container"],
    }


BASES = _bases()


@pytest.mark.parametrize("name", sorted(BASES))
def test_bases_are_valid(name):
    assert check_structure(BASES[name]) is None
    assert STOCK.is_valid(BASES[name]) and ECMA.is_valid(BASES[name])


# --------------------------------------------------------------- strategies

B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
HEX = "0123456789abcdef"
SUFFIXES = ["", "", "", "", "\n", "\n", "\r", " ", "\t", "\n\n", "\r\n", "\x0b", "\u2028", "\x1c", "\u00a0", "\ufeff"]
LENGTH_BOUNDS = [0, 1, 2, 31, 32, 33, 63, 64, 65, 70, 71, 72, 127, 128, 129, 255, 256, 257,
                 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049, 4095, 4096, 4097]

dids = st.one_of(
    st.builds(
        lambda method, rest: f"did:{method}:{rest}",
        st.sampled_from(["hmp", "example", "web", "x1", "0", "HMP", "", "a-b", "\u00e9", "a b"]),
        st.text(alphabet=B58 + ":._-%\u00e9 \t\n", max_size=30),
    ),
    st.sampled_from([
        ALICE.did, BOB.did, "did:hmp:container:QmYwAPJzv5CZsnA625s3Xf2nemtYgPpHdWEz79ojWnPbdG",
        "did:a:b", "did::b", "did:a:", "did:a: b", "DID:a:b", "did:a:b c", "did:a:\ufeff", "did:a:\x1c",
        "did:a:\u00a0", "did:a:\u2028", "did:a:b\n", "did:a:b\n\n", "did:a\n:b", "did:a:b:c", "did:a",
    ]),
    st.builds(lambda n: "did:hmp:" + "a" * (n - 8), st.sampled_from([9, 511, 512, 513])),
)


def _time(fraction: int, zone: str, digits: str) -> str:
    text = NOW.strftime("%Y-%m-%dT%H:%M:%S") + ("." + "1" * fraction if fraction else "") + zone
    return text.translate(str.maketrans("0123456789", digits)) if digits != "0123456789" else text


timestamps = st.one_of(
    st.builds(_time, st.integers(0, 8), st.sampled_from(["Z", "Z", "z", "+00:00", "", "ZZ"]),
              st.sampled_from(["0123456789", "0123456789", "\uff10\uff11\uff12\uff13\uff14\uff15\uff16\uff17\uff18\uff19",
                               "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669"])),
    st.sampled_from([format_time(NOW), "2026-11-29T10:15Z", "2026-11-29 10:15:00Z", "26-11-29T10:15:00Z",
                     "2026-13-45T99:99:99Z", "20261-11-29T10:15:00Z", "2026-11-29T10:15:00.Z"]),
)
base58s = st.text(alphabet=B58 + "0OIl+", min_size=28, max_size=68)
base64urls = st.builds(lambda body, pad: body + pad, st.text(alphabet=B64 + "+/.", max_size=40),
                       st.sampled_from(["", "", "=", "==", "===", "=a", "= "]))
hashes = st.builds(lambda prefix, digits: prefix + digits,
                   st.sampled_from(["sha256:", "sha256:", "sha256:", "SHA256:", "sha512:", "", "sha256"]),
                   st.text(alphabet=HEX + "ABCg", min_size=62, max_size=66))
class_tokens = st.text(alphabet="Aa09_.:-/ \u00e9", max_size=130)
networks = st.one_of(
    st.sampled_from(["", "localhost", "LOCALHOST", "localhost ", "lan:", "lan:10.0.0.0/8", "lan:::1/128",
                     "lan:10.0.0.0/1234", "lan:10.0.0.0", "lan:/8", "wan:10.0.0.0/8", "localhostlan:1/1"]),
    st.builds(lambda body, bits: f"lan:{body}/{bits}", st.text(alphabet="0123456789abcdefABCDEF:.g ", max_size=16),
              st.text(alphabet="0123456789", max_size=4)),
)
payload_types = st.builds(
    lambda parts, sep: sep.join(parts),
    st.lists(st.sampled_from(["json", "zstd", "gzip", "encrypted", "binary", "", "Json", "a1", "-", "\u00e9"]),
             min_size=1, max_size=4),
    st.sampled_from(["+", "+", "++", "-", " "]),
)
bounded_strings = st.builds(lambda n, c: c * n, st.sampled_from(LENGTH_BOUNDS),
                            st.sampled_from(["a", "A", "z", "1", "0", "-", "=", "\u00e9", "\U0001d11e"]))
plain_strings = st.one_of(
    dids, timestamps, base58s, base64urls, hashes, class_tokens, networks, payload_types, bounded_strings,
    st.text(max_size=40),
)
STRINGS = st.builds(lambda s, suffix: s + suffix, plain_strings, st.sampled_from(SUFFIXES))
NUMBERS = st.one_of(
    st.sampled_from([0, 1, -1, 2, 0.0, -0.0, 1.0, 0.5, 1.0000000000000002, 0.9999999999999999, -5e-324,
                     5e-324, 1e308, -1e308, 2**53, 10**30]),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),  # NaN never comes out of a JSON parser
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, STRINGS)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(STRINGS, inner, max_size=4),
    max_leaves=6,
)


def _sized_list(item, sizes):
    return st.builds(lambda n, value, tail: [value] * n + tail, st.sampled_from(sizes), item,
                     st.lists(item, max_size=2))


group_entries = st.one_of(
    st.fixed_dictionaries({"recipient": dids, "key_recipient": st.one_of(base64urls, bounded_strings, STRINGS)}),
    st.fixed_dictionaries({"recipient": dids}),
    st.fixed_dictionaries({"key_recipient": base64urls}),
    st.fixed_dictionaries({"recipient": JSON_VALUES, "key_recipient": JSON_VALUES, "x": JSON_VALUES}),
    JSON_VALUES,
)
string_lists = st.one_of(st.lists(STRINGS, max_size=4), _sized_list(STRINGS, [0, 1, 255, 256, 257]),
                         st.lists(bounded_strings, min_size=1, max_size=2))
did_lists = st.one_of(st.lists(st.one_of(dids, STRINGS), max_size=4), _sized_list(dids, [0, 1, 1023, 1024, 1025]))

FIELD_VALUES = {
    "version": bounded_strings,
    "class": st.one_of(class_tokens, bounded_strings),
    "subclass": bounded_strings,
    "class_version": bounded_strings,
    "class_id": bounded_strings,
    "schema": bounded_strings,
    "timestamp": timestamps,
    "ttl": timestamps,
    "tags": string_lists,
    "container_did": dids,
    "sender_did": dids,
    "public_key": st.one_of(base58s, bounded_strings),
    "recipient": did_lists,
    "key_recipient": st.one_of(base64urls, bounded_strings),
    "group_recipient": st.one_of(st.lists(group_entries, max_size=3), _sized_list(group_entries, [0, 1, 1024, 1025])),
    "broadcast": st.one_of(st.booleans(), st.sampled_from([0, 1, "true", None])),
    "network": networks,
    "encryption_algo": bounded_strings,
    "sig_algo": bounded_strings,
    "signature": st.one_of(base64urls, bounded_strings),
    "compression": bounded_strings,
    "payload_type": st.one_of(payload_types, bounded_strings),
    "payload_hash": hashes,
    "confidence": st.one_of(NUMBERS, st.booleans()),
    "magnet_uri": bounded_strings,
}
HEAD_NAMES = sorted(FIELD_VALUES) + ["x-unknown", "Class", "payload", "head", ""]

# Valid values of every string-typed pattern field, to be followed by "\n" and the
# like: where the two `$` semantics part ways.
VALID_STRINGS = {
    "class": ["note", "a", "A.b:c-d_0"],
    "timestamp": [format_time(NOW), "2026-11-29T10:15:00.123456Z"],
    "ttl": [format_time(NOW)],
    "container_did": [BASES["full"]["head"]["container_did"], "did:a:b"],
    "sender_did": [ALICE.did, "did:example:x"],
    "public_key": [ALICE.public_key_b58, "1" * 32, "z" * 64],
    "key_recipient": ["AAAA", "", "AA==", "-_"],
    "signature": [BASES["full"]["head"]["signature"], "", "AA=="],
    "payload_type": ["json", "encrypted+zstd+json", "a"],
    "payload_hash": [BASES["full"]["head"]["payload_hash"]],
}
NEWLINE_SUFFIXES = st.sampled_from(["\n", "\n", "\n\n", "\r\n", "\r", "", " "])
valid_dids_plus = st.builds(lambda v, suffix: v + suffix, st.sampled_from(VALID_STRINGS["sender_did"]), NEWLINE_SUFFIXES)
FIELD_VALUES["recipient"] = st.one_of(FIELD_VALUES["recipient"], st.lists(valid_dids_plus, min_size=1, max_size=3))
FIELD_VALUES["group_recipient"] = st.one_of(
    FIELD_VALUES["group_recipient"],
    st.lists(st.fixed_dictionaries({
        "recipient": valid_dids_plus,
        "key_recipient": st.builds(lambda v, suffix: v + suffix, st.sampled_from(VALID_STRINGS["key_recipient"]),
                                   NEWLINE_SUFFIXES),
    }), min_size=1, max_size=3),
)


# Each field's own length bounds, filled with characters its pattern allows.
FIELD_BOUNDS = {
    "version": ([0, 1, 32, 33], "a\u00e9"),
    "class": ([0, 1, 128, 129], "a.:-_"),
    "subclass": ([256, 257], "a\U0001d11e"),
    "class_version": ([64, 65], "a"),
    "class_id": ([256, 257], "a"),
    "schema": ([2048, 2049], "a"),
    "tags": ([256, 257], "a\u00e9"),
    "public_key": ([31, 32, 33, 63, 64, 65], "a1z"),
    "key_recipient": ([1023, 1024, 1025], "A-_"),
    "encryption_algo": ([0, 1, 128, 129], "a"),
    "sig_algo": ([0, 1, 128, 129], "a"),
    "compression": ([0, 1, 128, 129], "a"),
    "signature": ([4095, 4096, 4097], "A_"),
    "payload_type": ([128, 129], "a"),
    "magnet_uri": ([4096, 4097], "a"),
    "container_did": ([512, 513], "a"),
    "sender_did": ([512, 513], "a"),
}


def at_bounds(name: str):
    lengths, chars = FIELD_BOUNDS[name]
    if name.endswith("_did"):
        return st.builds(lambda n, c: "did:a:" + c * (n - 6), st.sampled_from(lengths), st.sampled_from(chars))
    value = st.builds(lambda n, c: c * n, st.sampled_from(lengths), st.sampled_from(chars))
    return st.lists(value, min_size=1, max_size=2) if name == "tags" else value


def head_value(name: str):
    specific = FIELD_VALUES.get(name)
    generic = st.one_of(JSON_VALUES, STRINGS)
    if specific is None:
        return generic
    # mostly well-typed, near-valid values, so that both outcomes are common
    choices = [st.builds(lambda s, suffix: s + suffix if isinstance(s, str) else s, specific,
                         st.sampled_from(SUFFIXES)), specific, generic]
    if name in VALID_STRINGS:
        choices.append(st.builds(lambda v, suffix: v + suffix, st.sampled_from(VALID_STRINGS[name]), NEWLINE_SUFFIXES))
    if name in FIELD_BOUNDS:
        choices[:0] = [at_bounds(name)]
    return st.one_of(choices)


related_values = st.one_of(dids, STRINGS, did_lists, _sized_list(dids, [4095, 4096, 4097]), JSON_VALUES,
                           valid_dids_plus, st.lists(valid_dids_plus, max_size=3))
related_objects = st.one_of(
    st.dictionaries(STRINGS, related_values, max_size=4),
    st.builds(lambda n, value: {f"r{i}": value for i in range(n)}, st.sampled_from([255, 256, 257]),
              st.one_of(dids, st.just(["did:a:b"]), st.just("x"))),
    JSON_VALUES,
)

OPS = ["set_head", "set_head", "set_head", "set_head", "del_head", "set_top", "del_top", "set_related",
       "del_related", "set_related_all", "group_entry", "replace_root"]


def apply_op(hmp: Any, op: str, data) -> Any:
    """Apply one mutation; returns the (possibly new) root."""
    if type(hmp) is not dict:
        return data.draw(JSON_VALUES, label="root")
    head = hmp.get("head")
    if op == "set_head" and type(head) is dict:
        name = data.draw(st.sampled_from(HEAD_NAMES), label="head field")
        head[name] = data.draw(head_value(name), label=f"head.{name}")
    elif op == "del_head" and type(head) is dict and head:
        del head[data.draw(st.sampled_from(sorted(head)), label="drop head field")]
    elif op == "set_top":
        name = data.draw(st.sampled_from(["head", "payload", "meta", "related", "x"]), label="member")
        hmp[name] = data.draw(related_objects if name == "related" else JSON_VALUES, label=f"set {name}")
    elif op == "del_top" and hmp:
        del hmp[data.draw(st.sampled_from(sorted(hmp)), label="drop member")]
    elif op == "set_related":
        related = hmp.setdefault("related", {})
        if type(related) is dict:
            name = data.draw(st.sampled_from(sorted(related) + ["new", "see_also"]), label="relation")
            related[name] = data.draw(related_values, label=f"related.{name}")
    elif op == "del_related" and type(hmp.get("related")) is dict and hmp["related"]:
        del hmp["related"][data.draw(st.sampled_from(sorted(hmp["related"])), label="drop relation")]
    elif op == "set_related_all":
        hmp["related"] = data.draw(related_objects, label="related")
    elif op == "group_entry" and type(head) is dict and type(head.get("group_recipient")) is list \
            and head["group_recipient"]:
        entries = head["group_recipient"]
        i = data.draw(st.integers(0, len(entries) - 1), label="entry")
        if type(entries[i]) is dict and data.draw(st.booleans(), label="member change"):
            member = data.draw(st.sampled_from(["recipient", "key_recipient", "x"]), label="entry member")
            if member in entries[i] and data.draw(st.booleans(), label="drop entry member"):
                del entries[i][member]
            else:
                entries[i][member] = data.draw(
                    st.one_of(dids if member == "recipient" else base64urls, STRINGS, JSON_VALUES), label=member)
        else:
            entries[i] = data.draw(group_entries, label="entry value")
    elif op == "replace_root":
        if data.draw(st.integers(0, 9), label="replace root?") == 0:
            return data.draw(JSON_VALUES, label="root")
    return hmp


# --------------------------------------------------------------- the properties


@pytest.mark.slow  # 600 examples against the JSON Schema validator: ~10-25 s
@settings(max_examples=600, **HYPOTHESIS)
@given(name=st.sampled_from(sorted(BASES)), data=st.data())
def test_check_structure_matches_the_schema(name, data):
    hmp = copy.deepcopy(BASES[name])
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        hmp = apply_op(hmp, data.draw(st.sampled_from(OPS), label="op"), data)
    assert_agree(hmp, record=True)


@pytest.mark.parametrize("field", sorted(FIELD_VALUES))
@settings(max_examples=80, **HYPOTHESIS)
@given(name=st.sampled_from(sorted(BASES)), data=st.data())
def test_each_head_field_near_its_bounds(field, name, data):
    """One head field at a time, with values of its own kind (mostly well-typed)."""
    hmp = copy.deepcopy(BASES[name])
    hmp["head"][field] = data.draw(head_value(field), label=field)
    assert_agree(hmp, record=True)


@settings(max_examples=300, **HYPOTHESIS)
@given(hmp=st.one_of(
    JSON_VALUES,
    st.fixed_dictionaries({"head": JSON_VALUES, "payload": JSON_VALUES}),
    st.fixed_dictionaries({"head": st.dictionaries(st.sampled_from(HEAD_NAMES), JSON_VALUES), "payload": st.none()}),
))
def test_arbitrary_json(hmp):
    assert_agree(hmp, record=True)


# --------------------------------------------------------------- explicit cases

EDGE_CASES = [
    ("timestamp", format_time(NOW) + "\n"),
    ("container_did", "did:a:b\n"),
    ("public_key", BOB.public_key_b58 + "\n"),
    ("signature", "AAAA\n"),
    ("payload_hash", "sha256:" + "0" * 64 + "\n"),
    ("class", "note\n"),
    ("payload_type", "json\n"),
    ("network", "\n"),
    ("network", "localhost\n"),
    ("key_recipient", "=\n"),
    ("class", "a" * 128),
    ("class", "a" * 129),
    ("public_key", "a" * 31),
    ("public_key", "a" * 64),
    ("public_key", "a" * 65),
    ("confidence", True),
    ("confidence", 1),
    ("confidence", 1.0000000000000002),
    ("confidence", -0.0),
    ("confidence", 10**400),
    ("broadcast", 1),
    ("tags", ["a"] * 256),
    ("tags", ["a"] * 257),
    ("tags", ["a" * 257]),
    ("group_recipient", []),
    ("group_recipient", [{"recipient": "did:a:b", "key_recipient": ""}]),
    ("group_recipient", [{"recipient": "did:a:b", "key_recipient": "A" * 1025}]),
    ("recipient", ["did:a:b"] * 1025),
    ("sender_did", "did:a:" + "b" * 506),
    ("sender_did", "did:a:" + "b" * 507),
    ("sender_did", "did:a:\ufeff"),
    ("sender_did", "did:a:\x1c"),
]


@pytest.mark.parametrize(("field", "value"), EDGE_CASES, ids=lambda v: repr(v)[:40])
def test_edge_cases(field, value):
    hmp = copy.deepcopy(BASES["full"])
    hmp["head"][field] = value
    valid = assert_agree(hmp)
    if isinstance(value, str) and value.endswith("\n") and field != "network":
        assert not valid and check_structure(hmp) is not None
    if field == "network":  # any string: a form the node does not know is stored, never forwarded
        assert valid is isinstance(value, str) and len(value) <= 256


@pytest.mark.parametrize("suffix", ["\n", "\n\n", "\r\n", "\r", " "], ids=repr)
@pytest.mark.parametrize(("field", "value"), [(f, v) for f, vs in sorted(VALID_STRINGS.items()) for v in vs],
                         ids=lambda v: repr(v)[:24])
def test_valid_pattern_value_with_trailing_whitespace(field, value, suffix):
    """Every pattern field, valid value + suffix: only a single final "\n" splits the
    two `$` semantics; check_structure always rejects."""
    hmp = copy.deepcopy(BASES["full"])
    hmp["head"][field] = value + suffix
    assert assert_agree(hmp) is False
    assert check_structure(hmp) is not None
    if suffix != "\n":
        assert not STOCK.is_valid(hmp)  # Python's `$` skips one final "\n" only


def test_related_size_bounds():
    for n, valid in ((256, True), (257, False)):
        hmp = copy.deepcopy(BASES["full"])
        hmp["related"] = {f"r{i}": "did:a:b" for i in range(n)}
        assert assert_agree(hmp) is valid
    for n, valid in ((4096, True), (4097, False)):
        hmp = copy.deepcopy(BASES["full"])
        hmp["related"] = {"see_also": ["did:a:b"] * n}
        assert assert_agree(hmp) is valid


def test_known_good_cache_does_not_leak_across_fields():
    """A string found valid for one field must not pass as another field."""
    hmp = copy.deepcopy(BASES["full"])
    check_structure(hmp)  # caches ("class", "note"), ("version", "1.2"), ...
    mixed = copy.deepcopy(hmp)
    mixed["head"]["timestamp"] = hmp["head"]["class"]
    mixed["head"]["public_key"] = hmp["head"]["sender_did"]
    assert check_structure(mixed) is not None
    assert_agree(mixed)


def test_nan_confidence_is_rejected_by_structure_only():
    """Outside the domain (no JSON parser yields NaN; verify rejects it as malformed
    before the schema step): jsonschema's minimum/maximum let NaN through, the
    hand-written check does not. Documented, not compared."""
    hmp = copy.deepcopy(BASES["full"])
    hmp["head"]["confidence"] = float("nan")
    assert check_structure(hmp) is not None
    assert STOCK.is_valid(hmp)


@pytest.mark.parametrize("length", [255, 256, 257, 1 << 20])
def test_network_length_limit_agrees(length):
    hmp = copy.deepcopy(BASES["full"])
    hmp["head"]["network"] = "lan:" + "0" * (length - 6) + "/8"
    assert_agree(hmp)
