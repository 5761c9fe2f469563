"""Canonical JSON (profile section 2) against the shared JCS vectors and the rfc8785 package."""

from __future__ import annotations

import math
import struct

import orjson
import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from hmpnode.container.canonical import CanonicalError, canonical_json, jcs_number

from .conftest import REPO, SHARED

#: the public JCS vectors of ../shared/vectors/jcs, copied here so that a clone alone runs them
JCS = REPO / "tests" / "data" / "jcs"
SHARED_JCS = SHARED / "vectors" / "jcs"
VECTOR_NAMES = sorted(p.name for p in (JCS / "input").glob("*.json"))


def test_jcs_vectors_present_and_as_shared():
    """The copy is complete; where ../shared is beside the clone (CI), it is the same bytes."""
    assert len(VECTOR_NAMES) >= 6
    if SHARED_JCS.is_dir():
        shared = sorted(str(p.relative_to(SHARED_JCS)) for p in SHARED_JCS.rglob("*.json"))
        ours = sorted(str(p.relative_to(JCS)) for p in JCS.rglob("*.json"))
        assert ours == shared
        assert all((JCS / rel).read_bytes() == (SHARED_JCS / rel).read_bytes() for rel in shared)


@pytest.mark.parametrize("name", VECTOR_NAMES)
def test_jcs_vectors_byte_for_byte(name):
    value = orjson.loads((JCS / "input" / name).read_bytes())
    assert canonical_json(value) == (JCS / "output" / name).read_bytes()


@settings(max_examples=3000, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_numbers_match_rfc8785(x):
    assert jcs_number(x).encode() == rfc8785.dumps(x)


def test_numbers_match_rfc8785_on_random_bit_patterns():
    import random

    rng = random.Random(8785)
    checked = 0
    while checked < 100_000:
        x = struct.unpack("<d", rng.randbytes(8))[0]
        if math.isfinite(x):
            assert jcs_number(x).encode() == rfc8785.dumps(x), x
            checked += 1


@pytest.mark.parametrize(
    "value, expected",
    [(1.0, b"1"), (-0.0, b"0"), (1e21, b"1e+21"), (1e-7, b"1e-7"), (0.84, b"0.84"),
     (0.000001, b"0.000001"), (123e-20, b"1.23e-18"), (2**53 - 1, b"9007199254740991"), (-(2**53 - 1), b"-9007199254740991")],
)
def test_number_forms(value, expected):
    assert canonical_json(value) == expected


def test_floats_that_would_read_back_as_unsafe_integers():
    # JCS writes 1e20 as an integer literal; a reader would get an integer beyond
    # 2**53, which the profile forbids, so canonical_json refuses such floats.
    assert jcs_number(1e20) == "100000000000000000000"
    assert canonical_json(1e21) == b"1e+21"


def test_code_point_key_order_differs_from_utf16():
    # U+E000 sorts before U+1F600 by code point; UTF-16 code units would put the emoji first.
    assert canonical_json({"\U0001f600": 1, "\ue000": 2}) == '{"\ue000":2,"\U0001f600":1}'.encode()


def test_strings_escape_only_what_jcs_escapes():
    assert canonical_json("\u2028\u2029\x7f\x00\x1f\b\t\n\f\r\"\\/é") == b'"\xe2\x80\xa8\xe2\x80\xa9\x7f\\u0000\\u001f\\b\\t\\n\\f\\r\\"\\\\/\xc3\xa9"'


@pytest.mark.parametrize(
    "bad",
    [math.nan, math.inf, -math.inf, 2**53, -(2**53), "\ud800", {"a": "\udfff"}, {1: "x"}, [math.nan],
     1e20, -2.0**53, 9.007199254740994e15],
)
def test_errors(bad):
    with pytest.raises(CanonicalError):
        canonical_json(bad)


def test_depth_limit():
    deep: list = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(CanonicalError):
        canonical_json(deep, max_depth=64)
    assert canonical_json(deep, max_depth=200).startswith(b"[[[")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not 2**53 <= abs(x) < 1e21) | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_matches_rfc8785_on_random_documents(value):
    # rfc8785 sorts keys by UTF-16 code units; the profile sorts by code point.
    # They agree unless a key mixes astral and U+E000..U+FFFF characters.
    ours = canonical_json(value)
    assert orjson.loads(ours) == orjson.loads(rfc8785.dumps(value)) or value != value
    keys_ok = all(not any(0xE000 <= ord(c) <= 0xFFFF for c in k) for k in _all_keys(value))
    if keys_ok:
        assert ours == rfc8785.dumps(value)


def _all_keys(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _all_keys(v)
    elif isinstance(value, list):
        for v in value:
            yield from _all_keys(v)
