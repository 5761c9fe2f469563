"""Wire encodings fixed by HMP profile section 1: base64url, base58btc, hashes, times."""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from datetime import datetime, timedelta, timezone

import based58

__all__ = [
    "EncodingError",
    "b64url_encode",
    "b64url_decode",
    "b58encode",
    "b58decode",
    "sha256_tag",
    "parse_time",
    "parse_moment",
    "format_time",
]


class EncodingError(ValueError):
    """A base64url, base58 or timestamp string is not in its profile form."""


_B64_INDEX = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")}


def b64url_encode(data: bytes) -> str:
    """base64url without padding (profile section 1)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    """Decode base64url; trailing `=` padding, however much, is ignored (spec A.4.3(5),
    profile sections 1 and 13). Other alphabets and non-canonical trailing bits are
    refused, so one byte string has one text form up to its padding (signatures are
    stored and compared without it: store.records.insert_containers)."""
    if not isinstance(text, str) or "+" in text or "/" in text or not text.isascii():
        raise EncodingError("not base64url")
    body = text.rstrip("=")
    rest = len(body) % 4
    if rest == 1 or (not body and text):  # padding pads data; "=" alone encodes nothing
        raise EncodingError("bad base64url length")
    try:
        # strict_mode refuses characters outside the (translated) alphabet and misplaced '='
        data = binascii.a2b_base64(body.replace("-", "+").replace("_", "/") + "=" * (-rest % 4), strict_mode=True)
    except (binascii.Error, ValueError):
        raise EncodingError("not base64url") from None
    # The last character of a partial quantum carries unused low bits; they must be zero.
    if rest and _B64_INDEX[body[-1]] & (0x0F if rest == 2 else 0x03):
        raise EncodingError("non-canonical base64url")
    return data



def b58encode(data: bytes) -> str:
    """base58btc (Bitcoin alphabet)."""
    return based58.b58encode(data).decode("ascii")


def b58decode(text: str) -> bytes:
    if not isinstance(text, str) or not text.isascii():
        raise EncodingError("not base58btc")
    try:
        return based58.b58decode(text.encode("ascii"))
    except ValueError:
        raise EncodingError("not base58btc") from None


def sha256_tag(data: bytes) -> str:
    """`sha256:` + 64 lowercase hex digits."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,6})?Z", re.ASCII)


def parse_time(text: str) -> datetime:
    """Parse an RFC 3339 UTC timestamp with `Z` and up to 6 fractional digits."""
    if not isinstance(text, str) or _TIME.fullmatch(text) is None:
        raise EncodingError(f"not an RFC 3339 UTC timestamp: {text!r:.60}")
    try:
        return datetime.fromisoformat(text)  # C parser; the form was checked above
    except ValueError:
        raise EncodingError(f"not a valid date/time: {text!r:.60}") from None


_DURATION = re.compile(r"([0-9]{1,9})([smhdw])", re.ASCII)
_DURATION_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
#: A duration further out than this is refused (and keeps datetime arithmetic in range).
MAX_DURATION = timedelta(days=100 * 366)


def parse_moment(text: str, now: datetime) -> datetime:
    """A moment as people write it (`--ttl`, the API's `ttl`): an RFC 3339 UTC time, or
    a positive duration from `now`, `<n>s|m|h|d|w` (30m, 12h, 7d), at most 100 years."""
    match = _DURATION.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        try:
            return parse_time(text)
        except EncodingError:
            raise EncodingError("must be an RFC 3339 UTC timestamp or a duration such as 30m, 12h, 7d") from None
    amount, unit = int(match.group(1)), match.group(2)
    if amount == 0:
        raise EncodingError("a duration must be positive")
    try:
        delta = timedelta(**{_DURATION_UNITS[unit]: amount})
    except OverflowError:
        delta = MAX_DURATION + MAX_DURATION
    if delta > MAX_DURATION:
        raise EncodingError("a duration may be at most 100 years")
    return now + delta


def format_time(moment: datetime) -> str:
    """Whole seconds, or milliseconds when the moment has a fraction (profile section 1)."""
    m = moment if moment.tzinfo is timezone.utc else moment.astimezone(timezone.utc)
    text = f"{m.year:04d}-{m.month:02d}-{m.day:02d}T{m.hour:02d}:{m.minute:02d}:{m.second:02d}"
    return text + "Z" if m.microsecond == 0 else f"{text}.{m.microsecond // 1000:03d}Z"
