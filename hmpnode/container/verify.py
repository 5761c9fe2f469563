"""Container verification in the order and with the reason codes of profile section 7.

`Verifier` is sans-IO: the caller hands it `now`, a key registry and limits;
it returns a `VerifyResult` and never raises on bad input. The node's ingest
path (agent API and peers alike) and the offline CLI share it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import msgspec
import nacl.bindings as sodium
import nacl.exceptions
import orjson

from hmpnode.container import compression as _compression
from hmpnode.container import reasons as R
from hmpnode.container.canonical import DEFAULT_MAX_DEPTH, CanonicalError, dumps_prepared, loads_strict, prepare
from hmpnode.container.crypto import ENCRYPTION_ALGO, ENVELOPE_BYTES
from hmpnode.container.did import content_digest
from hmpnode.container.encoding import EncodingError, b58decode, b64url_decode, sha256_tag
from hmpnode.container.fastpath import CanonicalWire, canonical_wire, cut_member
from hmpnode.container.payload import PayloadError, PayloadForm, hashed_bytes, open_payload, parse_payload_type
from hmpnode.container.schema import SchemaSet, default_schemas
from hmpnode.container.structure import passed_before
from hmpnode.identity.keys import is_self_certifying_did
from hmpnode.identity.registry import KeyRegistry, MemoryKeyRegistry, bind_key

__all__ = ["ACTED_ON_CLASSES", "Limits", "VerifyResult", "Verifier", "parse_container", "encode_wire"]

#: bytes-like inputs verified as the bytes they hold (and sent so to the verify workers)
BYTES_LIKE = (bytearray, memoryview, msgspec.Raw)

#: Members of the full form outside the signed `hmp_container`.
UNSIGNED_BLOCKS = ("referenced-by", "evaluations", "relay_chain")


@dataclass(frozen=True, slots=True)
class Limits:
    """Explicit, configurable bounds for untrusted containers (profile sections 6-7)."""

    max_container_bytes: int = 1024 * 1024
    max_depth: int = DEFAULT_MAX_DEPTH
    max_clock_skew: timedelta = timedelta(seconds=300)
    max_decompressed_bytes: int = _compression.DEFAULT_MAX_DECOMPRESSED


@dataclass(slots=True)
class VerifyResult:
    ok: bool
    reason: str | None = None
    detail: str = ""
    container_did: str | None = None
    #: past its ttl: stored as expired, never forwarded or offered as current
    expired: bool = False
    #: what this node cannot interpret and so stores and forwards as-is:
    #: any of "class", "compression", "encryption", "payload_type", and "class_schema"
    #: (a peer's payload that breaks the schema of a class the node does not act on)
    store_and_forward: frozenset[str] = frozenset()
    #: signed before its key was revoked: kept, flagged (profile section 4)
    key_revoked_later: bool = False
    #: opaque sender DID seen without a pinned key: the caller may pin it (TOFU)
    pin_candidate: tuple[str, bytes] | None = None
    #: the parsed full form ({"hmp_container": ..., unsigned blocks}) when parsing succeeded
    container: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    #: the payload as `open_payload` returns it, when verification opened it (a plain or
    #: a compressed one; never an encrypted one), so that callers need not open it again
    payload: Any = field(default=None, repr=False, compare=False)
    #: when set, the JSON text of hmp_container to store (it reads back to the same values
    #: as container["hmp_container"]): cut from canonical wire text on the fast path, so
    #: the store need not serialise the container again; None: serialise it
    body: bytes | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "reason": self.reason,
            "detail": self.detail,
            "container_did": self.container_did,
            "expired": self.expired,
            "store_and_forward": sorted(self.store_and_forward),
            "key_revoked_later": self.key_revoked_later,
        }


_FORMS: dict[str, PayloadForm] = {}


def _payload_form(payload_type: str) -> PayloadForm:
    """parse_payload_type, memoised: a node sees a handful of payload types."""
    form = _FORMS.get(payload_type)
    if form is None:
        try:
            form = parse_payload_type(payload_type)
        except ValueError as exc:
            raise _Reject(R.SCHEMA, str(exc)) from None
        if len(_FORMS) < 256:
            _FORMS[payload_type] = form
    return form


class _Reject(Exception):
    def __init__(self, reason: str, detail: str):
        self.reason = reason
        self.detail = detail


def _without_did(signed_bytes: bytes, did: str, prepared: Any, hmp: dict[str, Any]) -> bytes:
    """Canonical bytes of the container without signature and container_did.

    Cut out of the signed bytes when the member text occurs exactly once (then it
    can only be head.container_did); otherwise serialise `prepared` (the prepared
    hmp_container; None on the fast path, whose input passed its depth check) again."""
    cut = cut_member(signed_bytes, b'"container_did":', orjson.dumps(did))
    if cut is not None:
        return cut
    if prepared is None:
        prepared = prepare(hmp)
    head = {k: v for k, v in prepared["head"].items() if k not in ("signature", "container_did")}
    return dumps_prepared(dict(prepared, head=head))


def _parse(raw: bytes | str | dict[str, Any], limits: Limits) -> tuple[dict[str, Any], Any]:
    """Parse into (full form, prepared full form); raises _Reject.

    `limits.max_depth` bounds the nesting of the whole document as received."""
    try:
        if isinstance(raw, dict):
            doc = raw
            prepared = prepare(doc, max_depth=limits.max_depth)
            size = len(orjson.dumps(prepared, option=orjson.OPT_STRICT_INTEGER))  # the limit holds for parsed input too
            if size > limits.max_container_bytes:
                raise _Reject(R.MALFORMED, f"container is {size} bytes, over the {limits.max_container_bytes}-byte limit")
        else:
            data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
            if len(data) > limits.max_container_bytes:
                raise _Reject(R.MALFORMED, f"container is {len(data)} bytes, over the {limits.max_container_bytes}-byte limit")
            doc, prepared = loads_strict(data, max_depth=limits.max_depth)
    except (CanonicalError, orjson.JSONEncodeError) as exc:
        raise _Reject(R.MALFORMED, str(exc)) from None
    if not isinstance(doc, dict):
        raise _Reject(R.MALFORMED, "a container is a JSON object")
    if "hmp_container" in doc:
        if not isinstance(doc["hmp_container"], dict):
            raise _Reject(R.SCHEMA, "hmp_container must be an object")
        return doc, prepared
    if "head" in doc and "payload" in doc:
        # The bare form is one level shallower than the full form it stands for.
        try:
            prepare(doc, max_depth=limits.max_depth - 1)
        except CanonicalError as exc:
            raise _Reject(R.MALFORMED, str(exc)) from None
        return {"hmp_container": doc}, {"hmp_container": prepared}
    raise _Reject(R.SCHEMA, "neither a full form (hmp_container) nor a bare form (head, payload)")


def parse_container(raw: bytes | str | dict[str, Any], limits: Limits = Limits()) -> dict[str, Any]:
    """Parse wire bytes into the full form (accepts the bare form too).
    Raises ValueError with a one-line reason for what is not a container."""
    try:
        return _parse(raw, limits)[0]
    except _Reject as rej:
        raise ValueError(f"{rej.reason}: {rej.detail}") from None


def encode_wire(container: dict[str, Any]) -> bytes:
    """Wire bytes of a full-form container: its canonical JSON (profile section 2), which
    a receiving verifier checks without serialising it again (fastpath.py)."""
    return dumps_prepared(prepare(container))  # CanonicalError for what JSON cannot carry


class Verifier:
    """Verifies containers against a key registry, schemas and limits."""

    def __init__(
        self,
        *,
        registry: KeyRegistry | None = None,
        schemas: SchemaSet | None = None,
        limits: Limits = Limits(),
        key_cache_size: int = 4096,
        fast_path: bool = True,
    ):
        """`fast_path`: take the canonical fast path (fastpath.py) for bytes input;
        off only to compare the two paths (tests/test_verify_differential.py)."""
        self.registry: KeyRegistry = registry if registry is not None else MemoryKeyRegistry()
        self.schemas = schemas or default_schemas()
        self.limits = limits
        # (sender_did, public_key text) -> (raw key, the DID is self-certifying), for keys
        # whose binding was checked; LRU-bounded by key_cache_size (a node hears from a
        # bounded set of senders; an entry is about 200 bytes)
        self._keys: OrderedDict[tuple[str, str], tuple[bytes, bool]] = OrderedDict()
        self._key_cache_size = key_cache_size
        self.fast_path = fast_path
        # the straight-line acceptance of common canonical containers knows SchemaSet's checks
        self._inline = fast_path and type(self.schemas) is SchemaSet

    def verify(self, raw: bytes | str | dict[str, Any], *, now: datetime, from_peer: bool = False) -> VerifyResult:
        """Run every step of profile section 7; the first failure decides the reason.
        `raw`: wire bytes (or any bytes-like object: msgspec.Raw, memoryview), text, or a
        parsed container; canonical wire bytes take the fast path and come back with `body`.

        `from_peer`: a class-schema mismatch on a class outside `ACTED_ON_CLASSES`
        does not refuse the container; it is accepted with the store-and-forward
        flag `class_schema` (the node relays what it cannot read as its author wrote it)."""
        container = None
        did = None
        try:
            limits = self.limits
            if type(raw) is not bytes and isinstance(raw, BYTES_LIKE):
                raw = bytes(raw)  # an item's own text cut from a body (msgspec.Raw) is wire bytes too
            # bytes that are exactly canonical JSON skip the re-serialisations (fastpath.py)
            wire = None
            if self.fast_path and type(raw) is bytes:
                try:
                    wire = canonical_wire(raw, limits.max_container_bytes, limits.max_depth)
                except Exception:  # noqa: BLE001 - never a verdict of its own: the full parse decides
                    wire = None
            if wire is not None:
                if self._inline:
                    done = self._accept_canonical(wire, now)
                    if done is not None:
                        return done
                container, prepared = wire.container, None
            else:
                container, full = _parse(raw, limits)
                prepared = full["hmp_container"]
            hmp = container["hmp_container"]
            head = hmp.get("head")
            if isinstance(head, dict) and isinstance(head.get("container_did"), str):
                did = head["container_did"]
            return self._verify(container, prepared, now, from_peer, wire)
        except _Reject as rej:
            return VerifyResult(False, rej.reason, rej.detail, did, container=container)
        except Exception as exc:  # noqa: BLE001 - the contract is: never raise on input
            return VerifyResult(False, R.MALFORMED, f"unexpected {type(exc).__name__}", did, container=container)

    def _accept_canonical(self, wire: CanonicalWire, now: datetime) -> VerifyResult | None:
        """The verdict for a common canonical container that passes every step (or
        fails only the signature check, the last before the class schema), in
        straight-line code; None for anything else (then `_verify` runs the steps and
        decides, reason and order included). Common: a plain JSON payload, no
        encryption fields, a content-addressed container DID, a self-certifying sender
        whose key was bound before (nothing pinned or revoked), a head whose stable
        members passed before (structure.passed_before), a payload its class schema
        accepts. The checks left out here are implied by the ones made: a payload_hash
        equal to the computed tag has the schema's form, a content-addressed DID equal to
        the computed one is a DID, a signature that decodes to 64 bytes is base64url.
        It only reads the memos (base schema, keys) that `_verify` fills; never raises."""
        try:
            container = wire.container
            hmp = container["hmp_container"]
            head = hmp["head"]
            payload = hmp["payload"]
            if (head["payload_type"] != "json" or type(payload) is not dict or not passed_before(hmp)
                    or not _PLAIN_HEAD.isdisjoint(head)):
                return None
            timestamp = datetime.fromisoformat(head["timestamp"])
            expired = "ttl" in head and datetime.fromisoformat(head["ttl"]) <= now
            if timestamp > now + self.limits.max_clock_skew or wire.did_input is None:
                return None
            if sha256_tag(wire.payload) != head["payload_hash"]:
                return None
            did = head["container_did"]
            digest = content_digest(did)
            if digest is None or len(did) > 512 or hashlib.sha256(wire.did_input).digest() != digest:
                return None
            sender = head["sender_did"]
            known = self._keys.get((sender, head.get("public_key")))
            registry = self.registry
            if (known is None or not known[1] or head["sig_algo"] != "ed25519"
                    or registry.pinned_key(sender) is not None or registry.revoked_at(sender) is not None):
                return None
            self._keys.move_to_end((sender, head["public_key"]))
            signature = b64url_decode(head["signature"])
            if len(signature) != 64:
                return None
            try:
                sodium.crypto_sign_open(signature + wire.signed, known[0])
            except nacl.exceptions.BadSignatureError:
                # every step before the signature passed as in `_verify`, so its verdict is
                # this one: said here, a forged signature costs one check, not two
                return VerifyResult(False, R.BAD_SIGNATURE, "signature does not verify", did, container=container)
            class_name = head["class"]
            if self.schemas.knows(class_name):
                if self.schemas.check_class(class_name, payload) is not None:
                    return None
                flags = _NO_FLAGS
            else:
                flags = _UNKNOWN_CLASS
        except Exception:  # noqa: BLE001 - a refusal (or any doubt) is for the steps to decide
            return None
        return VerifyResult(True, None, "", did, expired=expired, store_and_forward=flags,
                            container=container, payload=payload, body=wire.hmp)

    # -- the steps ---------------------------------------------------------

    def _verify(self, container: dict[str, Any], prepared: Any, now: datetime, from_peer: bool,
                wire: CanonicalWire | None = None) -> VerifyResult:
        """`prepared` is the prepared hmp_container, or None when `wire` (canonical
        input) holds the signed bytes and the payload's text instead."""
        limits = self.limits
        hmp = container["hmp_container"]

        # 2. base schema + the cross-field rules a schema cannot say
        problem = self.schemas.check_base(hmp)
        if problem is not None:
            raise _Reject(R.SCHEMA, problem)
        head = hmp["head"]
        form, timestamp, expired = self._check_fields(head, hmp["payload"], now)

        # 3. timestamp
        if timestamp > now + limits.max_clock_skew:
            raise _Reject(R.FUTURE_TIMESTAMP, f"timestamp {head['timestamp']} is ahead of now by more than {limits.max_clock_skew}")

        # 4. payload_hash
        payload_type = head["payload_type"]
        try:
            if payload_type == "json":
                hashed = wire.payload if wire is not None else dumps_prepared(prepared["payload"])
            else:
                hashed = hashed_bytes(payload_type, hmp["payload"])
        except EncodingError as exc:
            raise _Reject(R.SCHEMA, f"payload: {exc}") from None
        except CanonicalError as exc:
            raise _Reject(R.MALFORMED, str(exc)) from None
        if sha256_tag(hashed) != head["payload_hash"]:
            raise _Reject(R.PAYLOAD_HASH_MISMATCH, "payload_hash does not match the payload as transmitted")

        # 5. content-addressed container DID
        if wire is not None:
            signed_bytes = wire.signed
        else:
            unsigned_head = dict(prepared["head"])
            del unsigned_head["signature"]
            try:
                signed_bytes = dumps_prepared(dict(prepared, head=unsigned_head))
            except CanonicalError as exc:
                raise _Reject(R.MALFORMED, str(exc)) from None
        did = head["container_did"]
        digest = content_digest(did)
        if digest is not None:
            if wire is not None and wire.did_input is not None:
                did_input = wire.did_input
            else:
                did_input = _without_did(signed_bytes, did, prepared, hmp)
            if hashlib.sha256(did_input).digest() != digest:
                raise _Reject(R.CONTAINER_DID_MISMATCH, "container_did is not the hash of the container")

        # 6. key binding
        public_key, pin, revoked_later = self._bind_key(head, timestamp)

        # 7. signature
        if head["sig_algo"] != "ed25519":
            raise _Reject(R.UNSUPPORTED_SIG_ALGO, f"sig_algo {head['sig_algo']!r} is not supported")
        try:
            signature = b64url_decode(head["signature"])
        except EncodingError as exc:
            raise _Reject(R.BAD_SIGNATURE, f"signature: {exc}") from None
        if len(signature) != 64:
            raise _Reject(R.BAD_SIGNATURE, "an Ed25519 signature is 64 bytes")
        try:
            sodium.crypto_sign_open(signature + signed_bytes, public_key)
        except nacl.exceptions.BadSignatureError:
            raise _Reject(R.BAD_SIGNATURE, "signature does not verify") from None
        except (nacl.exceptions.CryptoError, ValueError, TypeError):
            raise _Reject(R.BAD_SIGNATURE, "signature does not verify") from None

        # 8. class schema (and the payload must open, where we can open it)
        try:
            flags, payload = self._check_payload(hmp, form)
        except _Reject as rej:
            if not (from_peer and rej.reason == R.CLASS_SCHEMA and head["class"] not in ACTED_ON_CLASSES):
                raise
            flags, payload = _CLASS_SCHEMA_FLAG, hmp["payload"] if form.is_plain_json else None

        return VerifyResult(
            True,
            None,
            "",
            did,
            expired=expired,
            store_and_forward=flags,
            key_revoked_later=revoked_later,
            pin_candidate=pin,
            container=container,
            payload=payload,
            body=wire.hmp if wire is not None else None,
        )

    def _check_fields(self, head: dict[str, Any], payload: Any, now: datetime):
        """Cross-field consistency (step 2): payload form, encryption envelopes, scope."""
        # The structure check has validated the RFC 3339 form; only the calendar is left.
        try:
            timestamp = datetime.fromisoformat(head["timestamp"])
            expired = "ttl" in head and datetime.fromisoformat(head["ttl"]) <= now
        except ValueError as exc:
            raise _Reject(R.SCHEMA, f"timestamp/ttl: {exc}") from None
        form = _payload_form(head["payload_type"])
        if form.is_plain_json:
            if not isinstance(payload, dict):
                raise _Reject(R.SCHEMA, "a json payload must be an object")
        elif head["payload_type"] != "json" and not isinstance(payload, str):
            raise _Reject(R.SCHEMA, f"a {head['payload_type']} payload must be a base64url string")
        if form.compression != head.get("compression"):
            raise _Reject(R.SCHEMA, "payload_type and compression disagree")
        has_single = "key_recipient" in head
        has_group = "group_recipient" in head
        if has_group and ("recipient" in head or has_single):
            raise _Reject(R.SCHEMA, "group_recipient excludes recipient and key_recipient (spec 3.19)")
        if form.encrypted:
            if "encryption_algo" not in head:
                raise _Reject(R.SCHEMA, "an encrypted payload needs encryption_algo")
            if head["encryption_algo"] == ENCRYPTION_ALGO:
                if has_single:
                    if len(head.get("recipient") or ()) != 1:
                        raise _Reject(R.SCHEMA, "key_recipient goes with exactly one recipient (spec 3.9)")
                    envelopes = [head["key_recipient"]]
                elif has_group:
                    envelopes = [g["key_recipient"] for g in head["group_recipient"]]
                else:
                    raise _Reject(R.SCHEMA, "an encrypted payload needs key_recipient or group_recipient")
                for env in envelopes:
                    try:
                        if len(b64url_decode(env)) != ENVELOPE_BYTES:
                            raise _Reject(R.SCHEMA, f"a key envelope is {ENVELOPE_BYTES} bytes")
                    except EncodingError as exc:
                        raise _Reject(R.SCHEMA, f"key envelope: {exc}") from None
        elif has_single or has_group or "encryption_algo" in head:
            raise _Reject(R.SCHEMA, "key envelopes and encryption_algo need an encrypted payload_type")
        # A `network` of a form this node does not know is accepted (profile section 13):
        # scope.may_forward refuses to forward it, so it stays on this node.
        return form, timestamp, expired

    def _bind_key(self, head: dict[str, Any], timestamp: datetime):
        sender = head["sender_did"]
        key_text = head.get("public_key")
        offered = None
        certified = False
        if key_text is not None:
            # Decoding the key and hashing it against a self-certifying DID is a pure
            # function of (sender_did, public_key text): remember keys whose binding was
            # checked (the registry, whose pins and revocations change, is asked every time).
            known = self._keys.get((sender, key_text))
            if known is not None:
                offered, certifying = known
                certified = True
                self._keys.move_to_end((sender, key_text))
                # the common case, with bind_key's outcome spelled out: a self-certifying
                # DID that hashes to the offered key, nothing pinned, nothing revoked
                registry = self.registry
                if certifying and registry.pinned_key(sender) is None and registry.revoked_at(sender) is None:
                    return offered, None, False
            else:
                try:
                    offered = b58decode(key_text)
                except EncodingError:
                    offered = b""
                if len(offered) != 32:
                    raise _Reject(R.SCHEMA, "public_key must be a base58btc 32-byte Ed25519 key")
        binding = bind_key(sender, offered, self.registry, timestamp, self_certified=certified)
        if binding.reason is not None:
            raise _Reject(binding.reason, f"sender_did: {binding.detail}")
        if offered is not None and not certified:
            self._keys[(sender, key_text)] = (offered, is_self_certifying_did(sender))
            if len(self._keys) > self._key_cache_size:
                self._keys.popitem(last=False)
        pin = (sender, binding.key) if binding.pin and offered is not None else None
        return binding.key, pin, binding.revoked_later

    def _check_payload(self, hmp: dict[str, Any], form: PayloadForm) -> tuple[frozenset[str], Any]:
        """Step 8; returns the store-and-forward flags and the payload if it was opened."""
        head = hmp["head"]
        class_name = head["class"]
        known = self.schemas.knows(class_name)
        if form.is_plain_json:
            if known:
                self._check_class(class_name, hmp["payload"])
                return _NO_FLAGS, hmp["payload"]
            return _UNKNOWN_CLASS, hmp["payload"]
        flags = set() if known else {"class"}
        if form.encrypted and head["encryption_algo"] != ENCRYPTION_ALGO:
            flags.add("encryption")
        if form.compression and form.compression not in _compression.SUPPORTED:
            flags.add("compression")
        if form.base not in ("json", "binary"):
            flags.add("payload_type")
        if known and form.base != "json":
            raise _Reject(R.CLASS_SCHEMA, f"class {class_name} carries a JSON payload, not {form.base}")
        if not form.encrypted and not flags - {"class"}:
            # We can open it: a payload that does not decompress (or, for JSON,
            # does not parse) is malformed even though it was signed.
            try:
                payload = open_payload(  # the payload sits two levels down in the full form
                    hmp, max_bytes=self.limits.max_decompressed_bytes, max_depth=self.limits.max_depth - 2
                )
            except PayloadError as exc:
                raise _Reject(R.MALFORMED, f"payload: {exc}") from None
            if known:
                if not isinstance(payload, dict):
                    raise _Reject(R.CLASS_SCHEMA, "payload must be a JSON object")
                self._check_class(class_name, payload)
            return frozenset(flags), payload
        return frozenset(flags), None

    def _check_class(self, class_name: str, payload: Any) -> None:
        problem = self.schemas.check_class(class_name, payload)
        if problem is not None:
            raise _Reject(R.CLASS_SCHEMA, f"{class_name} payload: {problem}")


_NO_FLAGS: frozenset[str] = frozenset()
#: head members of an encrypted or compressed payload (their checks are left to `_verify`)
_PLAIN_HEAD = frozenset({"compression", "key_recipient", "group_recipient", "encryption_algo"})
_CLASS_SCHEMA_FLAG = frozenset({"class_schema"})

#: Known classes the node itself acts on (discovery, exchange, consensus): a payload
#: that breaks its schema is refused (`class_schema`) from anyone, because acting on
#: a misread payload would be wrong. Every other known class (goal, task,
#: workflow_entry, diary_entry, semantic_node, event) is content for agents: from a
#: peer, a mismatch is stored and relayed unchanged, flagged `class_schema`
#: (docs/protocol.md#rule-class-schema-mismatch-from-peer).
ACTED_ON_CLASSES = frozenset({
    "peer_announce", "peer_query",
    "container_index", "container_request", "container_response", "container_delta", "container_ack",
    "referenced-by_exchange", "evaluations_exchange",
    "vote", "consensus_result",
})
_UNKNOWN_CLASS = frozenset({"class"})
