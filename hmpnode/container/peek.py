"""What ingest reads of a container before verifying it, from its bytes, cheaply.

Before verification `Node.ingest` looks at a few fields of each (unverified) container:
the DID and signature (a copy it holds already is answered `duplicate` unverified),
the payload type and the payload's first or last bytes (the decompressed cost of the
batch), whether `evaluations` / `referenced-by` blocks ride along. For a parsed object
these are dict lookups. For bytes (the API's import items, wire text) `head_view`
decodes only those fields with a msgspec Struct (everything else is skipped, not
built: ~10 objects, none tracked by the cyclic GC, instead of ~40 for a full parse) and returns a small
dict of the same shape, so the one set of dict-reading functions serves both.

The view reads as `orjson.loads` would (the last of duplicate keys wins). Input the
Struct cannot type (a head that is no object, ...) is parsed in full instead, so the
view is always exactly what the parsed object would answer (tests/test_peek.py); None
for what is not a JSON object. Text msgspec skips over but orjson refuses (invalid
UTF-8 or a number beyond float range in a field not read here) still gets a view:
verification refuses it, and a held DID and signature it claims is answered
`duplicate` as a tampered copy is (protocol.md#rule-duplicate-before-verification).
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

__all__ = ["head_view"]


class _Head(msgspec.Struct, gc=False):
    container_did: Any = None
    signature: Any = None
    payload_type: Any = None


class _Hmp(msgspec.Struct, gc=False):  # gc=False: not tracked by the cyclic GC (no cycles here)
    head: _Head | None | msgspec.UnsetType = msgspec.UNSET
    payload: msgspec.Raw = msgspec.Raw()


class _Top(_Hmp, gc=False):
    """A full form (hmp_container) or a bare form (head and payload at the top)."""

    hmp_container: _Hmp | None | msgspec.UnsetType = msgspec.UNSET
    evaluations: msgspec.Raw = msgspec.Raw()
    referenced_by: msgspec.Raw = msgspec.field(name="referenced-by", default=msgspec.Raw())


_DECODER = msgspec.json.Decoder(_Top)
_STR = msgspec.json.Decoder(str)


def _hmp_view(hmp: _Hmp) -> dict[str, Any]:
    out: dict[str, Any] = {}
    head = hmp.head
    if head is not msgspec.UNSET:
        out["head"] = None if head is None else {
            "container_did": head.container_did, "signature": head.signature, "payload_type": head.payload_type}
    payload = hmp.payload
    if payload:  # present: the text of a JSON string is what decompressed_cost reads
        out["payload"] = _STR.decode(payload) if memoryview(payload)[0] == 0x22 else payload  # '"'
    return out


def head_view(raw: Any) -> dict[str, Any] | None:
    """A parsed container as it is; for bytes/str, a dict of the same shape holding
    the head's container_did, signature and payload_type, the payload (a string's
    text; anything else opaque) and the presence of the evaluations / referenced-by
    blocks. None when `raw` is no JSON object."""
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, (bytes, bytearray, str)):
        return None
    try:
        top = _DECODER.decode(raw)
        if top.hmp_container is msgspec.UNSET:
            out = _hmp_view(top)
        else:
            out = {"hmp_container": None if top.hmp_container is None else _hmp_view(top.hmp_container)}
    # odd types (ValidationError), not JSON msgspec reads, too deep, a str with lone surrogates
    except (msgspec.DecodeError, RecursionError, UnicodeError):
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        return value if isinstance(value, dict) else None
    if top.evaluations:
        out["evaluations"] = None
    if top.referenced_by:
        out["referenced-by"] = None
    return out
