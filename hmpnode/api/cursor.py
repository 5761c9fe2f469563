"""Opaque, tamper-evident paging cursors.

A cursor is base64url (no padding) of 21 bytes:

    direction (1 byte: b"a" ascending, b"d" descending)
    || seq (8 bytes, big-endian: the last store sequence number the client has seen)
    || tag (12 bytes: HMAC-SHA256(key, b"hmpnode-api-cursor-v1" || the 9 bytes above), truncated)

The key is derived from the node's identity (a deterministic Ed25519 signature
over a fixed label), so cursors survive a restart of the same node and are
worthless on another node. The event stream's `id:` values are ascending
cursors: `Last-Event-ID` and `GET /v1/containers?cursor=` accept the same text.
"""

from __future__ import annotations

import hashlib
import hmac

from hmpnode.api.errors import ApiError
from hmpnode.container.encoding import EncodingError, b64url_decode, b64url_encode
from hmpnode.identity import Identity

__all__ = ["CursorCodec"]

_LABEL = b"hmpnode-api-cursor-v1"
_TAG = 12
_SIZE = 1 + 8 + _TAG
_MAX_TEXT = 64


class CursorCodec:
    def __init__(self, key: bytes):
        self._key = bytes(key)

    @classmethod
    def for_identity(cls, identity: Identity) -> CursorCodec:
        return cls(identity.local_key(_LABEL))

    def _tag(self, raw: bytes) -> bytes:
        return hmac.new(self._key, _LABEL + raw, hashlib.sha256).digest()[:_TAG]

    def encode(self, seq: int, *, descending: bool = False) -> str:
        raw = (b"d" if descending else b"a") + int(seq).to_bytes(8, "big")
        return b64url_encode(raw + self._tag(raw))

    def decode(self, text: str, *, descending: bool = False, field: str = "cursor") -> int:
        """The seq in `text`; ApiError bad_cursor when it is not one of ours for this order."""
        if not isinstance(text, str) or not text or len(text) > _MAX_TEXT:
            raise ApiError(400, "bad_cursor", f"{field}: not a cursor")
        try:
            data = b64url_decode(text)
        except EncodingError:
            raise ApiError(400, "bad_cursor", f"{field}: not a cursor") from None
        if len(data) != _SIZE:
            raise ApiError(400, "bad_cursor", f"{field}: not a cursor")
        raw, tag = data[:9], data[9:]
        if not hmac.compare_digest(tag, self._tag(raw)):
            raise ApiError(400, "bad_cursor", f"{field}: not a cursor issued by this node")
        if raw[:1] != (b"d" if descending else b"a"):
            order = "desc" if raw[:1] == b"d" else "asc"
            raise ApiError(400, "bad_cursor", f"{field}: this cursor belongs to order={order}")
        return int.from_bytes(raw[1:], "big")
