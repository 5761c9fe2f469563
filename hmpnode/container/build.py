"""Building and signing containers (spec 3.3-3.4, 3.19; profile sections 3, 5, 6).

`build_container` is pure: the clock (`now`) and randomness (`rng`, used only
for encryption) are arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hmpnode.container import compression as _compression
from hmpnode.container.canonical import DEFAULT_MAX_DEPTH, dumps_prepared, prepare
from hmpnode.container.crypto import ENCRYPTION_ALGO
from hmpnode.container.did import container_did_for
from hmpnode.container.encoding import b64url_encode, format_time, parse_time, sha256_tag
from hmpnode.container.payload import encode_payload
from hmpnode.container.schema import SchemaSet, default_schemas
from hmpnode.identity.keys import Identity, Rng
from hmpnode.net.scope import parse_scope

__all__ = [
    "SPEC_VERSION",
    "DEFAULT_SCHEMA_URI",
    "Recipient",
    "build_container",
    "head_without",
]

SPEC_VERSION = "1.2"
DEFAULT_SCHEMA_URI = "https://mesh.hypercortex.ai/schemas/container-v1.2.json"
SIG_ALGO = "ed25519"

#: Head members the builder owns; `head_extra` may not override them.
_BUILDER_FIELDS = frozenset({
    "version", "class", "class_version", "class_id", "container_did", "schema", "sender_did",
    "timestamp", "payload_hash", "sig_algo", "signature", "payload_type", "public_key",
    "recipient", "key_recipient", "group_recipient", "encryption_algo", "compression",
})


@dataclass(frozen=True, slots=True)
class Recipient:
    """An encryption recipient: its DID and Ed25519 public key."""

    did: str
    public_key: bytes


def head_without(head: Mapping[str, Any], *names: str) -> dict[str, Any]:
    """A copy of `head` without the named members (absent, not empty: profile section 3)."""
    return {k: v for k, v in head.items() if k not in names}


def _time(value: datetime | str) -> str:
    if isinstance(value, str):
        parse_time(value)  # raises EncodingError (a ValueError) when not RFC 3339 UTC
        return value
    return format_time(value)


def build_container(
    identity: Identity,
    class_: str,
    payload: Any,
    *,
    now: datetime,
    rng: Rng | None = None,
    subclass: str | None = None,
    class_version: str = "1.0",
    class_id: str | None = None,
    schema: str = DEFAULT_SCHEMA_URI,
    tags: Sequence[str] | None = None,
    ttl: datetime | str | None = None,
    recipients: Sequence[str] | None = None,
    encrypt_to: Sequence[Recipient] | None = None,
    compression: str | None = None,
    binary: bool = False,
    broadcast: bool | None = None,
    network: str | None = None,
    confidence: float | None = None,
    magnet_uri: str | None = None,
    meta: Mapping[str, Any] | None = None,
    related: Mapping[str, Any] | None = None,
    head_extra: Mapping[str, Any] | None = None,
    include_public_key: bool = True,
    schemas: SchemaSet | None = None,
) -> dict[str, Any]:
    """Build, hash, address and sign a container; return its full form.

    `recipients` addresses a plain container; `encrypt_to` encrypts the payload:
    one recipient uses `recipient` + `key_recipient`, several use `group_recipient`.
    """
    if compression is not None and compression not in _compression.SUPPORTED:
        raise ValueError(f"unsupported compression {compression!r}")
    if encrypt_to and recipients:
        raise ValueError("give either plain recipients or encryption recipients, not both")
    if head_extra and _BUILDER_FIELDS.intersection(head_extra):
        raise ValueError(f"head_extra may not set {sorted(_BUILDER_FIELDS.intersection(head_extra))}")
    schemas = schemas or default_schemas()
    if binary and schemas.knows(class_):
        raise ValueError(f"class {class_} carries a JSON payload, not binary")
    if not binary:
        # Check the plaintext: once encrypted, nobody else can.
        problem = schemas.check_class(class_, payload)
        if problem is not None:
            raise ValueError(f"{class_} payload does not match its schema: {problem}")
    if network is not None:
        # produce strictly: readers store a scope they do not know, but never forward it
        parse_scope(network)  # ValueError unless "", "localhost" or "lan:<cidr>"
    encoded = encode_payload(
        payload,
        compression=compression,
        encrypt_to=[r.public_key for r in encrypt_to or ()],
        rng=rng,
        binary=binary,
    )
    head: dict[str, Any] = dict(head_extra or {})
    head.update({
        "version": SPEC_VERSION,
        "class": class_,
        "class_version": class_version,
        "class_id": class_id or f"{class_}-v{class_version}",
        "schema": schema,
        "timestamp": _time(now),
        "sender_did": identity.did,
        "sig_algo": SIG_ALGO,
        "payload_type": encoded.payload_type,
        "payload_hash": sha256_tag(encoded.hashed),
    })
    if include_public_key:
        head["public_key"] = identity.public_key_b58
    optional = {
        "subclass": subclass,
        "tags": list(tags) if tags is not None else None,
        "ttl": _time(ttl) if ttl is not None else None,
        "broadcast": broadcast,
        "network": network,
        "confidence": confidence,
        "magnet_uri": magnet_uri,
        "compression": compression,
    }
    head.update({k: v for k, v in optional.items() if v is not None})
    if recipients:
        head["recipient"] = list(recipients)
    if encrypt_to:
        head["encryption_algo"] = ENCRYPTION_ALGO
        if len(encrypt_to) == 1:
            head["recipient"] = [encrypt_to[0].did]
            head["key_recipient"] = b64url_encode(encoded.envelopes[0])
        else:
            head["group_recipient"] = [
                {"recipient": r.did, "key_recipient": b64url_encode(env)}
                for r, env in zip(encrypt_to, encoded.envelopes, strict=True)
            ]
    hmp: dict[str, Any] = {"head": head, "payload": encoded.value}
    # Nesting is bounded on the full form {"hmp_container": {...}}: one level up.
    depth = DEFAULT_MAX_DEPTH - 2
    unsigned: dict[str, Any] = {"head": prepare(head, max_depth=depth), "payload": encoded.prepared}
    if meta is not None:
        hmp["meta"] = dict(meta)
        unsigned["meta"] = prepare(hmp["meta"], max_depth=depth)
    if related is not None:
        hmp["related"] = dict(related)
        unsigned["related"] = prepare(hmp["related"], max_depth=depth)

    # Each part is walked once; the two canonical forms differ only in the head.
    did = container_did_for(dumps_prepared(unsigned))
    unsigned["head"] = dict(unsigned["head"], container_did=did)
    signature = identity.sign(dumps_prepared(unsigned))
    head["container_did"] = did
    head["signature"] = b64url_encode(signature)
    problem = schemas.check_base(hmp)  # e.g. a bad network or confidence given by the caller
    if problem is not None:
        raise ValueError(f"container does not match the base schema: {problem}")
    return {"hmp_container": hmp}
