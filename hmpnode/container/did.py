"""Content-addressed container DIDs (profile section 5).

`did:hmp:container:` + base58btc(0x12 0x20 || SHA-256(canonical hmp_container
without head.signature and head.container_did)): a sha2-256 multihash, so the
identifier always starts with `Qm`. Any other form is opaque.
"""

from __future__ import annotations

import hashlib

from hmpnode.container.encoding import EncodingError, b58decode, b58encode

__all__ = ["CONTAINER_DID_PREFIX", "container_did_for", "content_digest", "is_content_addressed"]

CONTAINER_DID_PREFIX = "did:hmp:container:"
_MULTIHASH_SHA256 = b"\x12\x20"
_PREFIX_QM = CONTAINER_DID_PREFIX + "Qm"


def container_did_for(unsigned_without_did: bytes) -> str:
    """The DID of a container whose canonical bytes (no signature, no DID) are given."""
    return CONTAINER_DID_PREFIX + b58encode(_MULTIHASH_SHA256 + hashlib.sha256(unsigned_without_did).digest())


def content_digest(did: str) -> bytes | None:
    """The SHA-256 digest a content-addressed DID names, or None for an opaque DID."""
    if not did.startswith(_PREFIX_QM):
        return None
    try:
        raw = b58decode(did[len(CONTAINER_DID_PREFIX):])
    except EncodingError:
        return None
    if len(raw) != 34 or not raw.startswith(_MULTIHASH_SHA256):
        return None
    return raw[2:]


def is_content_addressed(did: str) -> bool:
    """True for the form hmpnode mints; such a DID must match the content."""
    return content_digest(did) is not None
