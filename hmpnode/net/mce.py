"""Mesh Container Exchange messages and peer frames (spec 5.2, 5.6), sans-IO.

After the handshake, two nodes exchange frames, each one JSON object with a
`type`, carried as the AEAD records of their v2 session (hmpnode.net.transport;
one binary WebSocket message per frame):

    {"type": "mce", "container": <MCE container, full form>}
    {"type": "containers", "items": [<container, full form>, ...]}
    {"type": "error", "reason": <code>, "detail": <text>}
    {"type": "reconcile", "set": "global"|"scoped", "start"?: true,
     "msg"|"reply"|"want": <base64>}      catch-up by set reconciliation (syncset)

MCE containers (classes in `MCE_CLASSES`) are ordinary signed containers built
by the sending node: `sender_did` is the node's DID established by the
handshake, `recipient` is the receiving node's DID (so a message made for one
peer is refused by another), plain JSON payload, no `broadcast`. A receiver
refuses one that does not verify, whose sender or recipient is wrong, whose
class is not an MCE class, that is older than `max_age` (replay window) or
that was seen before on this connection. Containers themselves travel in
`containers` frames, never inside indexes (spec 5.3).

Extensions of the spec's payloads (documented in docs/protocol.md):

- `container_request.after` (string, v1 catch-up; hmpnode answers it but no
  longer asks it: catch-up is by reconciliation): "send me a `container_delta`
  of what you hold for me after this cursor" ("" = from the beginning). The
  cursor is opaque to the requester; hmpnode uses its ingest sequence number.
- `container_delta.cursor` (string) and `container_delta.complete` (bool) in
  such an answer: the cursor to ask from next time, and whether the delta
  reached the end of what the responder holds.
- `container_ack.rejected`: `[{"container_did", "reason", "detail"}]`, the
  containers of a `containers` frame that were refused, with reason codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import orjson

from hmpnode.container import reasons as R
from hmpnode.container.build import build_container
from hmpnode.container.encoding import EncodingError, parse_time
from hmpnode.container.inflight import REASONS as INFLIGHT_REASONS
from hmpnode.container.payload import PayloadError, open_payload
from hmpnode.container.verify import Verifier
from hmpnode.identity.keys import Identity
from hmpnode.net.transport import REASONS as TRANSPORT_REASONS

__all__ = [
    "MCE_CLASSES",
    "FRAME_TYPES",
    "FrameError",
    "SkewError",
    "Mce",
    "build_mce",
    "check_mce",
    "index_entry",
    "parse_frame",
    "frame",
    "error_frame",
    "DID_KEYED",
]

MCE_CLASSES = frozenset({
    "container_index", "container_delta", "container_request", "container_response", "container_ack",
    "referenced-by_exchange", "evaluations_exchange",
    "peer_query",  # interests (docs/protocol.md 33)
})
#: MCE classes whose payload is a map keyed by container DID (plus, for a delta, its `added`/`modified`)
DID_KEYED = frozenset({"container_index", "referenced-by_exchange", "evaluations_exchange"})
FRAME_TYPES = frozenset({"mce", "containers", "error", "reconcile", "nat"})
#: a `nat` frame's `op` (docs/protocol.md 34: reachability, circuits, hole punching): at most this long
NAT_OP_MAX = 32
#: a `reconcile` frame (docs/protocol.md 22.4): its set, and one of msg/reply/want (base64);
#: 65 536 bytes of reconciliation message or 1 024 ids of 32 bytes at most, in base64
RECONCILE_SETS = ("global", "scoped")
RECONCILE_MAX_B64 = 4 * (65536 + 2) // 3
#: reasons a `container_ack` gives for refused containers (docs/protocol.md 25.1)
REJECT_REASONS = frozenset({*R.ALL, "expired", "out_of_scope", "not_addressed", "relay_quota_exceeded",
                            "relay_full", "relay_sender_quota", "relay_unknown_recipient", "rate_limited",
                            "storage_full", "forgotten", *INFLIGHT_REASONS})
#: reasons hmpnode sends in `error` frames (docs/protocol.md 25.2, and the handshake's);
#: a peer's other reasons are counted together, so that a peer cannot grow the counters
ERROR_REASONS = frozenset({"malformed_frame", "too_many_items", "bad_mce", "bad_reconcile", "rate_limited", "banned",
                           "handshake_failed", "clock_skew", *TRANSPORT_REASONS, "duplicate_connection",
                           # peer slots (section 21.4): refused after the handshake, or evicted
                           "per_address", "per_subnet", "loopback_full", "full", "evicted", "fresh_did"})


class FrameError(Exception):
    """A frame that breaks the peer protocol: `reason` is a stable code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class SkewError(FrameError):
    """A signed MCE message of the peer dated outside our window: its clock and ours
    disagree by `offset_seconds` (theirs minus ours). Not an offence (docs/protocol.md 25.4)."""

    def __init__(self, offset_seconds: float, window_seconds: float):
        direction = "ahead of" if offset_seconds > 0 else "behind"
        super().__init__("clock_skew", f"your clock is {abs(offset_seconds):.0f} s {direction} ours; messages more "
                                       f"than {window_seconds:.0f} s off are refused (offset_seconds={offset_seconds:+.3f})")
        self.offset_seconds = offset_seconds


def signed_at(verifier: Verifier, container: Any, *, signer: str) -> datetime | None:
    """The timestamp of a container refused as `future_timestamp`, when it verifies as of
    that time and `signer` signed it: a genuine message from a clock ahead of ours, not a
    forgery (only then is its offset believed and the refusal not an offence)."""
    try:
        head = container["hmp_container"]["head"]
        timestamp = parse_time(head["timestamp"])
    except (TypeError, KeyError, EncodingError, ValueError):
        return None
    again = verifier.verify(container, now=timestamp)
    if not again.ok or again.container["hmp_container"]["head"].get("sender_did") != signer:
        return None
    return timestamp


def frame(type_: str, **members: Any) -> bytes:
    return orjson.dumps({"type": type_, **members})


def error_frame(reason: str, detail: str) -> bytes:
    return frame("error", reason=reason, detail=detail[:500])


def parse_frame(data: str | bytes, *, max_items: int) -> dict[str, Any]:
    """A received frame as a dict with a known `type` (FrameError otherwise).

    Only the envelope is checked here; containers and MCE messages inside are
    checked by the Verifier (which reads them strictly) and `check_mce`."""
    try:
        message = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise FrameError("malformed_frame", "not a JSON text") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str) or message["type"] not in FRAME_TYPES:
        raise FrameError("malformed_frame", "not an object with a known type")
    kind = message["type"]
    if kind == "mce" and not isinstance(message.get("container"), dict):
        raise FrameError("malformed_frame", "mce frame without a container object")
    if kind == "containers":
        items = message.get("items")
        if not isinstance(items, list) or not items:
            raise FrameError("malformed_frame", "containers frame without items")
        if len(items) > max_items:
            raise FrameError("too_many_items", f"{len(items)} items; at most {max_items} per frame")
    if kind == "reconcile":
        parts = [k for k in ("msg", "reply", "want") if k in message]
        if (message.get("set") not in RECONCILE_SETS or len(parts) != 1 or not isinstance(message[parts[0]], str)
                or len(message[parts[0]]) > RECONCILE_MAX_B64
                or ("start" in message and (message["start"] is not True or parts[0] != "msg"))):
            raise FrameError("malformed_frame", "reconcile frame: a set and one of msg, reply, want (base64)")
    if kind == "nat" and not (isinstance(message.get("op"), str) and 0 < len(message["op"]) <= NAT_OP_MAX):
        raise FrameError("malformed_frame", "nat frame without an op")
    if kind == "error" and not (isinstance(message.get("reason"), str) and len(message["reason"]) <= 64):
        raise FrameError("malformed_frame", "error frame without a reason")
    return message


@dataclass(frozen=True, slots=True)
class Mce:
    """A checked MCE message."""

    class_: str
    payload: dict[str, Any]
    did: str  # the message container's own DID (for replay detection)
    timestamp: datetime
    #: `related.in_reply_to` when it names one message (an answer to our index request, docs/protocol.md 31)
    reply_to: str | None = None


def build_mce(identity: Identity, class_: str, payload: dict[str, Any], *, peer_did: str, now: datetime,
              in_reply_to: str | None = None) -> dict[str, Any]:
    """An MCE message for one peer, signed by this node (full form); `in_reply_to`: the
    DID of the message it answers (`related.in_reply_to`)."""
    if class_ not in MCE_CLASSES:
        raise ValueError(f"{class_!r} is not an MCE class")
    related = {"in_reply_to": in_reply_to} if in_reply_to else None
    return build_container(identity, class_, payload, now=now, recipients=[peer_did], related=related)


def check_mce(
    verifier: Verifier,
    container: dict[str, Any],
    *,
    peer_did: str,
    own_did: str,
    now: datetime,
    max_age: timedelta,
) -> Mce:
    """Verify an MCE message from the authenticated peer `peer_did`; FrameError otherwise.

    CPU-bound (signature, schema, a compressed payload's decompression): the mesh runs
    it on a verify thread, with a verifier whose `max_decompressed_bytes` is the MCE
    bound (`peer.max_frame_bytes`: a message never expands beyond what one frame could
    carry plain)."""
    result = verifier.verify(container, now=now)
    if not result.ok:
        ahead = signed_at(verifier, container, signer=peer_did) if result.reason == R.FUTURE_TIMESTAMP else None
        if ahead is not None:
            raise SkewError((ahead - now).total_seconds(), verifier.limits.max_clock_skew.total_seconds())
        raise FrameError("bad_mce", f"{result.reason}: {result.detail}")
    head = result.container["hmp_container"]["head"]
    class_ = head["class"]
    if class_ not in MCE_CLASSES:
        raise FrameError("bad_mce", f"class {class_!r:.60} is not an MCE class")
    if head["sender_did"] != peer_did:
        raise FrameError("bad_mce", "sender_did is not the DID this connection authenticated")
    if head.get("recipient") != [own_did] and head.get("recipient") != own_did:
        raise FrameError("bad_mce", "recipient is not this node")
    if result.store_and_forward:
        raise FrameError("bad_mce", f"cannot read it: {', '.join(sorted(result.store_and_forward))}")
    try:
        timestamp = parse_time(head["timestamp"])
        # verification opened it already (bounded by the verifier's limits): not twice
        payload = result.payload if result.payload is not None else open_payload(
            result.container["hmp_container"], max_bytes=verifier.limits.max_decompressed_bytes)
    except (EncodingError, PayloadError, ValueError, KeyError, TypeError) as exc:
        raise FrameError("bad_mce", f"unreadable: {exc}") from None
    if timestamp < now - max_age:  # signed by the peer, so its clock is behind (or it replays its own)
        raise SkewError((timestamp - now).total_seconds(), max_age.total_seconds())
    if not isinstance(payload, dict):
        raise FrameError("bad_mce", "payload is not an object")
    maps = [payload] if class_ in DID_KEYED else [payload.get("added"), payload.get("modified")] \
        if class_ == "container_delta" else []
    for keyed in maps:
        if isinstance(keyed, dict) and not all(k.startswith("did:") and len(k) <= 512 for k in keyed):
            raise FrameError("bad_mce", "a key of the payload is not a DID")
    related = result.container["hmp_container"].get("related")
    reply_to = related.get("in_reply_to") if isinstance(related, dict) else None
    return Mce(class_, payload, head["container_did"], timestamp, reply_to if isinstance(reply_to, str) else None)


def index_entry(hmp: dict[str, Any]) -> dict[str, Any]:
    """The index/delta entry of a held container (spec 5.1: a lightweight head)."""
    head = hmp["head"]
    entry = {k: head[k] for k in ("class", "sender_did", "public_key", "sig_algo", "signature", "payload_hash")
             if k in head}
    if head.get("tags"):
        entry["tags"] = head["tags"]
    return {"head": entry}

