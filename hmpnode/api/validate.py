"""Input checks of the API: every malformed input becomes a 4xx `ApiError` naming the field.

The node and the container core are given only values of the types they expect;
what they refuse beyond that (a payload that misses its class schema, a bad
network string) comes back from them as `invalid_container` and the like.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from aiohttp import web

from hmpnode.api.errors import ApiError
from hmpnode.container.encoding import EncodingError, parse_moment, parse_time
from hmpnode.container.structure import DID_RE

__all__ = [
    "DID_MAX",
    "is_did",
    "bad_request",
    "path_did",
    "query_params",
    "query_bool",
    "query_time",
    "query_int",
    "query_did",
    "query_text",
    "obj",
    "no_unknown",
    "text",
    "did",
    "did_list",
    "text_list",
    "boolean",
    "number",
    "ttl",
]

DID_MAX = 512
#: Query strings and body strings that end up in SQL parameters or headers.
MAX_TEXT = 4096


def is_did(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= DID_MAX and DID_RE.fullmatch(value) is not None


def bad_request(field: str, problem: str) -> ApiError:
    return ApiError(400, "bad_request", f"{field}: {problem}")


def _encodable(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def path_did(request: web.Request, name: str = "did") -> str:
    value = request.match_info.get(name, "")
    if not is_did(value):
        raise ApiError(400, "bad_did", f"{name}: not a DID (did:<method>:<id>, printable ASCII, <= {DID_MAX} chars)")
    return value


# -- query strings ---------------------------------------------------------------


def query_params(request: web.Request, allowed: Iterable[str]) -> dict[str, str]:
    """The query parameters as single values; unknown or repeated names are refused."""
    allowed = frozenset(allowed)
    out: dict[str, str] = {}
    for name, value in request.query.items():
        if name not in allowed:
            shown = name if len(name) <= 64 else name[:64] + "..."
            raise ApiError(400, "unknown_field", f"unknown query parameter {shown!r}; allowed: {', '.join(sorted(allowed)) or 'none'}")
        if name in out:
            raise bad_request(name, "given more than once")
        if len(value) > MAX_TEXT or not _encodable(value):
            raise bad_request(name, f"must be text of at most {MAX_TEXT} characters")
        out[name] = value
    return out


def query_bool(params: Mapping[str, str], name: str, default: bool = False, *, digits: bool = False) -> bool:
    """`true`/`false`; with `digits` (a parameter documented so) also `1`/`0`."""
    value = params.get(name)
    if value is None:
        return default
    if value == "true" or (digits and value == "1"):
        return True
    if value == "false" or (digits and value == "0"):
        return False
    raise bad_request(name, "must be true or false" + (" (or 1 or 0)" if digits else ""))


def query_time(params: Mapping[str, str], name: str) -> datetime | None:
    value = params.get(name)
    if value is None:
        return None
    try:
        return parse_time(value)
    except EncodingError:
        raise bad_request(name, "must be an RFC 3339 UTC timestamp such as 2026-11-29T10:15:00Z") from None


def query_int(params: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    value = params.get(name)
    if value is None:
        return default
    if not value.isascii() or not value.isdigit() or len(value) > 12:
        raise bad_request(name, f"must be an integer in {low}..{high}")
    number = int(value)
    if not low <= number <= high:
        raise bad_request(name, f"must be an integer in {low}..{high}")
    return number


def query_did(params: Mapping[str, str], name: str) -> str | None:
    value = params.get(name)
    if value is None:
        return None
    if not is_did(value):
        raise ApiError(400, "bad_did", f"{name}: not a DID")
    return value


def query_text(params: Mapping[str, str], name: str, max_len: int = 256) -> str | None:
    value = params.get(name)
    if value is None:
        return None
    if not value or len(value) > max_len:
        raise bad_request(name, f"must be 1..{max_len} characters")
    return value


# -- JSON bodies -------------------------------------------------------------------


def obj(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(field, "must be a JSON object")
    return value


def require(value: Mapping[str, Any], *names: str, prefix: str = "") -> None:
    """400 naming the first of `names` missing from `value` (a body, or query parameters)."""
    for name in names:
        if name not in value:
            raise bad_request(prefix + name, "is required")


def no_unknown(value: Mapping[str, Any], allowed: Iterable[str], field: str = "body") -> None:
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        names = ", ".join(repr(n if len(n) <= 64 else n[:64] + "...") for n in unknown[:5])
        where = "" if field == "body" else f" in {field}"
        raise ApiError(400, "unknown_field", f"unknown field(s){where}: {names}; allowed: {', '.join(sorted(allowed))}")


def text(value: Any, field: str, *, max_len: int = MAX_TEXT, min_len: int = 1) -> str:
    if not isinstance(value, str):
        raise bad_request(field, "must be a string")
    if not min_len <= len(value) <= max_len:
        raise bad_request(field, f"must be {min_len}..{max_len} characters")
    return value


#: longest source label or scope name (node-local names the agent picks)
MAX_LABEL = 256


def label(value: Any, field: str) -> str:
    """A source label (a URL, a path: anything printable) or a scope name (the same
    without "/", so that every scope can be named in a path): 1..MAX_LABEL characters."""
    value = text(value, field, max_len=MAX_LABEL)
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise bad_request(field, "must not contain control characters")
    if field == "scope" and "/" in value:
        raise bad_request(field, 'must not contain "/" (e.g. task:t1, user:alice, thread:42)')
    return value


def did(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise bad_request(field, "must be a DID string")
    if not is_did(value):
        raise ApiError(400, "bad_did", f"{field}: not a DID")
    return value


def did_list(value: Any, field: str, *, max_items: int = 1024, min_items: int = 1) -> list[str]:
    if not isinstance(value, list):
        raise bad_request(field, "must be an array of DIDs")
    if not min_items <= len(value) <= max_items:
        raise bad_request(field, f"must have {min_items}..{max_items} items")
    return [did(v, f"{field}[{i}]") for i, v in enumerate(value)]


def text_list(value: Any, field: str, *, max_items: int = 256, max_len: int = 256) -> list[str]:
    if not isinstance(value, list):
        raise bad_request(field, "must be an array of strings")
    if len(value) > max_items:
        raise bad_request(field, f"must have at most {max_items} items")
    return [text(v, f"{field}[{i}]", max_len=max_len, min_len=0) for i, v in enumerate(value)]


def boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise bad_request(field, "must be true or false")
    return value


def number(value: Any, field: str, low: float | None = None, high: float | None = None) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(field, "must be a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_request(field, "must be a finite number")
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad_request(field, f"must be within {low}..{high}")
    return value


def ttl(value: Any, now: datetime, field: str = "ttl") -> datetime:
    """An RFC 3339 UTC instant, or a duration from now: `<n>s|m|h|d|w` (`30m`, `12h`, `7d`)."""
    if not isinstance(value, str):
        raise bad_request(field, "must be an RFC 3339 UTC timestamp or a duration such as 30m, 12h, 7d")
    try:
        return parse_moment(value, now)
    except EncodingError as exc:
        raise bad_request(field, str(exc)) from None
