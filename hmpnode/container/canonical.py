"""Canonical JSON (HMP profile section 2): RFC 8785 with code-point key order.

orjson does the heavy lifting: it sorts keys by UTF-8 bytes (which is code
point order), writes strings exactly as JCS does and refuses lone surrogates
and non-string keys. It formats floats differently from ECMAScript
(`1.0`, `1e21`, `-0.0`), so one walk over the value replaces every float by a
pre-formatted fragment. The walk also enforces the nesting limit.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

__all__ = [
    "CanonicalError", "canonical_json", "prepare", "dumps_prepared", "loads_strict", "jcs_number", "DEFAULT_MAX_DEPTH",
]

DEFAULT_MAX_DEPTH = 64
MAX_SAFE_INTEGER = 2**53 - 1
_OPTS = orjson.OPT_SORT_KEYS | orjson.OPT_STRICT_INTEGER


class CanonicalError(ValueError):
    """The value cannot be written as canonical JSON (profile section 2 errors)."""


def jcs_number(x: float) -> str:
    """Format a float as ECMAScript's Number.prototype.toString does (RFC 8785 3.2.2.3)."""
    if x != x or x in (math.inf, -math.inf):
        raise CanonicalError("NaN and Infinity have no JSON form")
    if x == 0:
        return "0"
    if x.is_integer() and -MAX_SAFE_INTEGER <= x <= MAX_SAFE_INTEGER:
        return str(int(x))
    sign = "-" if x < 0 else ""
    # repr() gives the shortest round-tripping digits, the same digit string
    # ECMAScript chooses; only the layout differs.
    mantissa, _, exp = repr(abs(x)).partition("e")
    whole, _, frac = mantissa.partition(".")
    exponent = int(exp) if exp else 0
    if whole != "0":
        digits = whole + frac
        n = len(whole) + exponent
    else:
        stripped = frac.lstrip("0")
        n = exponent - (len(frac) - len(stripped))
        digits = stripped
    digits = digits.rstrip("0") or "0"
    k = len(digits)
    if k <= n <= 21:
        body = digits + "0" * (n - k)
    elif 0 < n <= 21:
        body = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        body = "0." + "0" * (-n) + digits
    else:
        e = n - 1
        esign = "+" if e >= 0 else "-"
        head = digits if k == 1 else digits[0] + "." + digits[1:]
        body = f"{head}e{esign}{abs(e)}"
    return sign + body


_FRAGMENTS: dict[float, orjson.Fragment] = {}
_FRAGMENT_CACHE_SIZE = 4096


def _fragment(x: float) -> orjson.Fragment:
    # Containers repeat a few floats (confidence, weights, evaluation values):
    # formatting each once pays for the dictionary many times over.
    frag = _FRAGMENTS.get(x)
    if frag is None:
        if MAX_SAFE_INTEGER < abs(x) < 1e21:
            # ECMAScript writes these as integer literals, which a reader then parses
            # as integers beyond the range the profile allows: refuse them at the source.
            raise CanonicalError(f"{x!r} would be written as an integer beyond ±(2**53-1)")
        frag = orjson.Fragment(jcs_number(x).encode())
        if len(_FRAGMENTS) < _FRAGMENT_CACHE_SIZE:
            _FRAGMENTS[x] = frag
    return frag


def _prepare(value: Any, depth: int, max_depth: int) -> Any:
    """Return `value` with floats replaced by fragments; copies only what changes."""
    t = type(value)
    if t is dict:
        if depth >= max_depth:
            raise CanonicalError(f"nesting deeper than {max_depth}")
        out = None
        for key, item in value.items():
            ti = type(item)
            if ti is dict or ti is list:
                new = _prepare(item, depth + 1, max_depth)
            elif ti is float:
                new = _fragment(item)
            else:
                continue
            if new is not item:
                if out is None:
                    out = dict(value)
                out[key] = new
        return value if out is None else out
    if t is list or t is tuple:
        if depth >= max_depth:
            raise CanonicalError(f"nesting deeper than {max_depth}")
        out_list = None
        for i, item in enumerate(value):
            ti = type(item)
            if ti is dict or ti is list or ti is tuple:
                new = _prepare(item, depth + 1, max_depth)
            elif ti is float:
                new = _fragment(item)
            else:
                continue
            if new is not item:
                if out_list is None:
                    out_list = list(value)
                out_list[i] = new
        return value if out_list is None else out_list
    if t is float:
        return _fragment(value)
    return value


def prepare(value: Any, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Check nesting and pre-format floats once, so that several canonical forms of
    one value (with and without `signature`, `container_did`) cost one walk."""
    return _prepare(value, 0, max_depth)


def dumps_prepared(prepared: Any) -> bytes:
    """Canonical bytes of a value returned by `prepare` (or a dict built from its parts)."""
    try:
        return orjson.dumps(prepared, option=_OPTS)
    except orjson.JSONEncodeError as exc:
        raise CanonicalError(str(exc)) from None


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CanonicalError(f"duplicate key {key!r:.60}")
        out[key] = value
    return out


def _safe_int(text: str) -> int:
    value = int(text)
    if not -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
        raise CanonicalError(f"integer {text:.30} is beyond ±(2**53-1)")
    return value


def _no_constant(name: str) -> Any:
    raise CanonicalError(f"{name} is not JSON")


def loads_strict(data: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH) -> tuple[Any, Any]:
    """Parse untrusted JSON text the way the profile wants it read.

    Rejects (CanonicalError) invalid UTF-8 or JSON, duplicate keys, integers
    beyond ±(2**53-1), NaN/Infinity and nesting deeper than `max_depth`.
    Returns `(value, prepared)`, `prepared` being ready for `dumps_prepared`.

    When orjson re-serialises the value to exactly `data` (the compact text
    nodes send), the text has no duplicate keys: orjson would have dropped
    one. Anything else is re-read by the stdlib parser with checking hooks.
    (Scanning the text for float forms to skip the `prepare` walk was
    measured: six substring searches cost three times the walk.)
    """
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise CanonicalError(f"not JSON: {exc}") from None
    try:
        compact = orjson.dumps(value, option=orjson.OPT_STRICT_INTEGER)
    except orjson.JSONEncodeError:
        compact = None  # an integer beyond 53 bits; the slow path names it
    if compact != data:
        try:
            json.loads(data, object_pairs_hook=_no_duplicate_keys, parse_int=_safe_int, parse_constant=_no_constant)
        except RecursionError:
            raise CanonicalError("nesting too deep") from None
        except ValueError as exc:  # CanonicalError included
            raise CanonicalError(str(exc) if isinstance(exc, CanonicalError) else f"not JSON: {exc}") from None
    return value, _prepare(value, 0, max_depth)


def canonical_json(value: Any, *, max_depth: int = DEFAULT_MAX_DEPTH) -> bytes:
    """Serialise `value` (dict/list/str/int/float/bool/None) as canonical JSON bytes."""
    return dumps_prepared(_prepare(value, 0, max_depth))
