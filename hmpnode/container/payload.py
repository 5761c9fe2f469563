"""Payload forms (profile section 6): what `payload_type` means, what `payload_hash`
covers, and how a payload is encoded for sending and opened by a reader."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hmpnode.container import compression as _compression
from hmpnode.container import crypto
from hmpnode.container.canonical import (
    DEFAULT_MAX_DEPTH,
    CanonicalError,
    canonical_json,
    dumps_prepared,
    loads_strict,
    prepare,
)
from hmpnode.container.encoding import EncodingError, b64url_decode, b64url_encode
from hmpnode.identity.keys import Identity, Rng

__all__ = [
    "PayloadError",
    "PayloadForm",
    "parse_payload_type",
    "payload_type_for",
    "hashed_bytes",
    "EncodedPayload",
    "encode_payload",
    "open_payload",
    "recipients_of",
]


class PayloadError(ValueError):
    """The payload cannot be opened. `code` is stable: not_recipient, decrypt_failed,
    decompress_failed, unsupported_compression, unsupported_encryption, not_json, bad_encoding."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class PayloadForm:
    encrypted: bool
    compression: str | None
    base: str  # "json", "binary" or what another implementation uses

    @property
    def is_plain_json(self) -> bool:
        return self.base == "json" and not self.encrypted and self.compression is None


def parse_payload_type(payload_type: str) -> PayloadForm:
    """`encrypted+zstd+json` -> PayloadForm(True, "zstd", "json")."""
    parts = payload_type.split("+")
    encrypted = parts[0] == "encrypted" and len(parts) > 1
    if encrypted:
        parts = parts[1:]
    if len(parts) > 2:
        raise ValueError(f"payload_type {payload_type!r} has more than one compression")
    return PayloadForm(encrypted, parts[0] if len(parts) == 2 else None, parts[-1])


def payload_type_for(compression: str | None, encrypted: bool, base: str = "json") -> str:
    return ("encrypted+" if encrypted else "") + (f"{compression}+" if compression else "") + base


def hashed_bytes(payload_type: str, payload: Any) -> bytes:
    """The bytes `payload_hash` covers: canonical JSON of a plain JSON payload,
    else the base64url-decoded transmitted bytes."""
    if payload_type == "json" or not isinstance(payload, str):
        return canonical_json(payload)
    return b64url_decode(payload)


@dataclass(frozen=True, slots=True)
class EncodedPayload:
    value: Any  # what goes into hmp_container.payload
    prepared: Any  # `value` after canonical.prepare, for serialising the container
    payload_type: str
    hashed: bytes  # what payload_hash covers
    envelopes: list[bytes]  # one per recipient key, in the order given


def encode_payload(
    payload: Any,
    *,
    compression: str | None = None,
    encrypt_to: Sequence[bytes] = (),
    rng: Rng | None = None,
    binary: bool = False,
    max_depth: int = DEFAULT_MAX_DEPTH - 2,
) -> EncodedPayload:
    """Canonicalise (or take raw bytes when `binary`), compress, encrypt.
    `max_depth` bounds the payload's own nesting (it sits two levels down in the full form)."""
    if binary:
        if not isinstance(payload, bytes | bytearray):
            raise TypeError("a binary payload must be bytes")
        data, base = bytes(payload), "binary"
    else:
        prepared = prepare(payload, max_depth=max_depth)
        data, base = dumps_prepared(prepared), "json"
        if not compression and not encrypt_to:
            return EncodedPayload(payload, prepared, "json", data, [])
    if compression:
        data = _compression.compress(data, compression)
    envelopes: list[bytes] = []
    if encrypt_to:
        if rng is None:
            raise ValueError("encryption needs an rng")
        data, envelopes = crypto.encrypt(data, encrypt_to, rng)
    text = b64url_encode(data)
    return EncodedPayload(text, text, payload_type_for(compression, bool(encrypt_to), base), data, envelopes)


def recipients_of(head: dict[str, Any]) -> list[str]:
    """The recipient DIDs named by `recipient` and `group_recipient` (non-strings skipped)."""
    out: list[str] = []
    single = head.get("recipient")
    if isinstance(single, str):
        single = [single]
    if isinstance(single, list):
        out.extend(r for r in single if isinstance(r, str) and r)
    group = head.get("group_recipient")
    if isinstance(group, list):
        out.extend(
            g["recipient"] for g in group if isinstance(g, dict) and isinstance(g.get("recipient"), str) and g["recipient"]
        )
    return out


def _envelope_for(head: dict[str, Any], did: str) -> str | None:
    if did in (head.get("recipient") or ()) and isinstance(head.get("key_recipient"), str):
        return head["key_recipient"]
    for entry in head.get("group_recipient") or ():
        if isinstance(entry, dict) and entry.get("recipient") == did:
            return entry.get("key_recipient")
    return None


def open_payload(
    hmp_container: dict[str, Any],
    identity: Identity | None = None,
    *,
    max_bytes: int = _compression.DEFAULT_MAX_DECOMPRESSED,
    max_depth: int = DEFAULT_MAX_DEPTH - 2,
) -> Any:
    """The payload as the sender wrote it: decrypted (as `identity`), decompressed, parsed.
    A binary payload comes back as bytes. `max_depth` bounds the payload's own
    nesting (it sits two levels down in the full form)."""
    head = hmp_container["head"]
    form = parse_payload_type(head["payload_type"])
    payload = hmp_container["payload"]
    if form.is_plain_json:
        return payload
    try:
        data = b64url_decode(payload)
    except EncodingError as exc:
        raise PayloadError("bad_encoding", f"payload: {exc}") from None
    if form.encrypted:
        if head.get("encryption_algo") != crypto.ENCRYPTION_ALGO:
            raise PayloadError("unsupported_encryption", f"unsupported encryption {head.get('encryption_algo')!r}")
        if identity is None:
            raise PayloadError("not_recipient", "payload is encrypted; a recipient key is needed")
        envelope = _envelope_for(head, identity.did)
        if envelope is None:
            raise PayloadError("not_recipient", f"{identity.did} is not a recipient of this container")
        try:
            data = crypto.decrypt(data, crypto.open_key(b64url_decode(envelope), identity))
        except (crypto.DecryptError, EncodingError) as exc:
            raise PayloadError("decrypt_failed", str(exc)) from None
    if form.compression:
        if form.compression not in _compression.SUPPORTED:
            raise PayloadError("unsupported_compression", f"unsupported compression {form.compression!r}")
        try:
            data = _compression.decompress(data, form.compression, limit=max_bytes)
        except _compression.CompressionError as exc:
            raise PayloadError("decompress_failed", str(exc)) from None
    if form.base != "json":
        return data
    try:
        value, _ = loads_strict(data, max_depth=max_depth)
    except CanonicalError as exc:
        raise PayloadError("not_json", f"payload is not valid JSON: {exc}") from None
    return value
