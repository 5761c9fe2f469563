"""Peer handshake: mutual authentication of two nodes (message layer, sans-IO).

A peer connection (WebSocket on the node's `tcp://` port) starts with this
handshake. Each side proves that it holds the private key of the DID it
claims, both exchange their signed `peer_announce` and the compression and
encryption algorithms they support (spec 3.8). `Handshake` is a state machine:
no sockets, no clock reads (`now` is given), randomness injected (`rng`).
The transport parses each frame as JSON (`canonical.loads_strict`) and passes
the value to `receive`; it sends every dict that `start` / `receive` return.

Messages (JSON objects; unknown members are ignored)::

    hello = {"type": "hello", "version": 1,
             "nonce": b64url(32 random bytes),        # unpadded, 43 characters
             "announce": <the sender's peer_announce, full form>,
             "compression": ["zstd", "gzip", ...],     # the sender's preference order
             "encryption": ["x25519-chacha20poly1305", ...]}
    proof = {"type": "proof", "did": <the sender's DID>,
             "public_key": base58btc(32-byte Ed25519 public key),
             "signature": b64url(Ed25519(canonical_json(transcript)))}
    transcript = {"context": "hmp-handshake-v1",
                  "initiator_nonce": <initiator's hello.nonce>,
                  "responder_nonce": <responder's hello.nonce>,
                  "initiator_did": <DID of the initiator's announce>,
                  "responder_did": <DID of the responder's announce>,
                  "role": "initiator" | "responder"}   # the role of the signer

`compression` and `encryption` hold at most 32 strings of 1..64 characters.

Order (I = initiator, the side that opened the connection; R = responder)::

    1. I -> R  hello(I)
    2. R -> I  hello(R), proof(R, role "responder")
    3. I -> R  proof(I, role "initiator")
    both sides are then `done`.

Each side checks the other's hello (shape, version 1, a nonce different from
its own, an announce that passes `Verifier.verify` and `check_peer_announce`
and is not a revocation, a DID other than its own) and proof (`did` = the
announce's DID, `public_key` = the key the announce was signed with and bound
to the DID by `bind_key`, the signature over the transcript with the
signer's role). The first deviation fails the handshake for good: `failed`,
`reason` (below) and `detail` are set, `peer` stays None, and no message is
sent any more. `receive` never raises on what the peer sends.

Reasons: `malformed` (not a message of the expected shape), `unexpected_message`
(a valid type at the wrong time, an unknown type, anything after completion),
`bad_announce`, `did_mismatch`, `key_mismatch`, `bad_signature`,
`self_connection` (the peer claims our DID or echoes our nonce), `clock_skew` (the
announce verifies, but only as of its own timestamp, which is beyond our clock's
window: the peer's clock is ahead of ours; or, given `max_age`, it is older than
that: the peer's clock is behind; `skew` says by how much).

What is authenticated: the signature binds both fresh nonces (so a proof
from another session, or a recorded one, does not verify: replay), both DIDs
(a proof made for a session with a third node does not transfer) and the
signer's role (a node's own proof sent back to it, or a proof made as
initiator presented as responder's, does not verify: reflection). The
announce is signed by the same key. Hence, at `done`, each side knows that
the peer held the DID's private key during this session.

What is not: this layer neither encrypts nor integrity-protects the
transport, and the proofs are not bound to the channel. The `version`,
`compression` and `encryption` members are not signed: an active
man-in-the-middle can relay the handshake, alter the algorithm lists
(downgrade) and then read or inject frames. Containers exchanged later stay
end-to-end signed (and, where encrypted, sealed), so such an attacker can
drop, delay or replay them but not forge them. Confidentiality and binding
of the connection itself need TLS (or a key exchange) on top.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from hmpnode.container.canonical import canonical_json
from hmpnode.container.encoding import EncodingError, b58decode, b64url_decode, b64url_encode, parse_time
from hmpnode.container.reasons import FUTURE_TIMESTAMP
from hmpnode.container.verify import Verifier, VerifyResult
from hmpnode.identity.keys import Identity, Rng, ed25519_verify
from hmpnode.identity.registry import bind_key
from hmpnode.net.announce import AnnounceCheck, check_peer_announce

__all__ = [
    "CONTEXT",
    "VERSION",
    "NONCE_BYTES",
    "REASONS",
    "PeerInfo",
    "Handshake",
    "transcript_bytes",
]

CONTEXT = "hmp-handshake-v1"
VERSION = 1
NONCE_BYTES = 32
MAX_ALGOS = 32
MAX_ALGO_LEN = 64
ROLES = ("initiator", "responder")
REASONS = (
    "malformed",
    "unexpected_message",
    "bad_announce",
    "did_mismatch",
    "key_mismatch",
    "bad_signature",
    "self_connection",
    "clock_skew",
)

_NEW, _AWAIT_HELLO, _AWAIT_PROOF, _DONE, _FAILED = "new", "await_hello", "await_proof", "done", "failed"


def _timestamp_of(container: dict[str, Any]) -> datetime | None:
    try:
        return parse_time(container["hmp_container"]["head"]["timestamp"])
    except (TypeError, KeyError, EncodingError, ValueError):
        return None


def transcript_bytes(
    *, initiator_nonce: str, responder_nonce: str, initiator_did: str, responder_did: str, role: str
) -> bytes:
    """The bytes a proof signs: canonical JSON of the transcript object."""
    return canonical_json({
        "context": CONTEXT,
        "initiator_nonce": initiator_nonce,
        "responder_nonce": responder_nonce,
        "initiator_did": initiator_did,
        "responder_did": responder_did,
        "role": role,
    })


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """The authenticated peer, available once the handshake is `done`."""

    did: str
    public_key: bytes
    #: the peer's checked `peer_announce` (addresses, roles, mailman, timestamp)
    announce: AnnounceCheck
    #: the Verifier's result for that announce (`.container`, `.pin_candidate`)
    verify_result: VerifyResult
    #: algorithms both support, in our preference order
    compression: tuple[str, ...]
    encryption: tuple[str, ...]


class _Fail(Exception):
    def __init__(self, reason: str, detail: str):
        self.reason = reason
        self.detail = detail


def _algos(value: Sequence[str], what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) and 1 <= len(v) <= MAX_ALGO_LEN for v in value):
        raise ValueError(f"{what} must be a sequence of strings of 1..{MAX_ALGO_LEN} characters")
    if len(value) > MAX_ALGOS:
        raise ValueError(f"{what}: at most {MAX_ALGOS} entries")
    return tuple(dict.fromkeys(value))


def _peer_algos(message: dict[str, Any], key: str) -> list[str]:
    value = message.get(key)
    if (
        not isinstance(value, list)
        or len(value) > MAX_ALGOS
        or not all(isinstance(v, str) and 1 <= len(v) <= MAX_ALGO_LEN for v in value)
    ):
        raise _Fail("malformed", f"{key} must be a list of at most {MAX_ALGOS} strings of 1..{MAX_ALGO_LEN} characters")
    return value


class Handshake:
    """One side of the peer handshake (see the module docstring)."""

    def __init__(
        self,
        identity: Identity,
        announce_full_form: dict[str, Any],
        *,
        role: str,
        rng: Rng,
        now: datetime,
        verifier: Verifier,
        min_difficulty: int,
        supported_compression: Sequence[str],
        supported_encryption: Sequence[str],
        max_age: timedelta | None = None,
    ):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        if isinstance(min_difficulty, bool) or not isinstance(min_difficulty, int) or not 0 <= min_difficulty <= 64:
            raise ValueError("min_difficulty must be an int in 0..64")
        try:
            own_did = announce_full_form["hmp_container"]["head"]["sender_did"]
        except (TypeError, KeyError):
            raise ValueError("announce_full_form must be a full-form container") from None
        if own_did != identity.did:
            raise ValueError("our announce is not signed by our identity")
        nonce = rng(NONCE_BYTES)
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise ValueError(f"rng must return {NONCE_BYTES} bytes")
        self._identity = identity
        self._announce = announce_full_form
        self._role = role
        self._now = now
        self._verifier = verifier
        self._min_difficulty = min_difficulty
        self._compression = _algos(supported_compression, "supported_compression")
        self._encryption = _algos(supported_encryption, "supported_encryption")
        self._nonce = b64url_encode(nonce)
        self._state = _NEW
        self._reason: str | None = None
        self._detail = ""
        self._peer_nonce: str | None = None
        self._pending: PeerInfo | None = None  # checked hello, proof not yet
        self._peer: PeerInfo | None = None
        self._skew: tuple[str, float] | None = None
        self._max_age = max_age

    # -- public state ---------------------------------------------------------

    @property
    def role(self) -> str:
        return self._role

    @property
    def done(self) -> bool:
        return self._state == _DONE

    @property
    def failed(self) -> bool:
        return self._state == _FAILED

    @property
    def reason(self) -> str | None:
        """One of `REASONS` once failed, else None."""
        return self._reason

    @property
    def detail(self) -> str:
        """Human-readable explanation of the failure (for logs; not stable)."""
        return self._detail

    @property
    def skew(self) -> tuple[str, float] | None:
        """(DID, seconds its clock is ahead of ours) from the peer's signed announce, once
        its hello was read, also when that failed as `clock_skew`; else None."""
        return self._skew

    @property
    def peer(self) -> PeerInfo | None:
        """The authenticated peer once `done`, else None."""
        return self._peer if self._state == _DONE else None

    # -- driving --------------------------------------------------------------

    def start(self) -> list[dict[str, Any]]:
        """Begin: the initiator's hello, nothing for the responder. Call once, first."""
        if self._state != _NEW:
            raise RuntimeError("start() was called already")
        self._state = _AWAIT_HELLO
        return [self._hello()] if self._role == "initiator" else []

    def receive(self, message: Any) -> list[dict[str, Any]]:
        """Take one message from the peer; return the messages to send in reply.

        Never raises on `message`; a failure is recorded in `failed`/`reason`."""
        if self._state == _NEW:
            raise RuntimeError("call start() before receive()")
        if self._state == _FAILED:
            return []
        try:
            return self._receive(message)
        except _Fail as fail:
            return self._fail(fail.reason, fail.detail)
        except Exception as exc:  # noqa: BLE001 - the contract is: never raise on input
            return self._fail("malformed", f"unexpected {type(exc).__name__}")

    # -- internals ------------------------------------------------------------

    def _fail(self, reason: str, detail: str) -> list[dict[str, Any]]:
        self._state = _FAILED
        self._reason = reason
        self._detail = detail
        self._pending = self._peer = None
        return []

    def _hello(self) -> dict[str, Any]:
        return {
            "type": "hello",
            "version": VERSION,
            "nonce": self._nonce,
            "announce": self._announce,
            "compression": list(self._compression),
            "encryption": list(self._encryption),
        }

    def _transcript(self, role: str) -> bytes:
        assert self._pending is not None and self._peer_nonce is not None
        mine, theirs = (self._identity.did, self._nonce), (self._pending.did, self._peer_nonce)
        (i_did, i_nonce), (r_did, r_nonce) = (mine, theirs) if self._role == "initiator" else (theirs, mine)
        return transcript_bytes(
            initiator_nonce=i_nonce, responder_nonce=r_nonce, initiator_did=i_did, responder_did=r_did, role=role
        )

    def _proof(self) -> dict[str, Any]:
        return {
            "type": "proof",
            "did": self._identity.did,
            "public_key": self._identity.public_key_b58,
            "signature": b64url_encode(self._identity.sign(self._transcript(self._role))),
        }

    def _receive(self, message: Any) -> list[dict[str, Any]]:
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise _Fail("malformed", "a message is a JSON object with a string `type`")
        kind = message["type"]
        if self._state == _DONE:
            raise _Fail("unexpected_message", f"{kind!r:.40} after the handshake completed")
        expected = "hello" if self._state == _AWAIT_HELLO else "proof"
        if kind != expected:
            raise _Fail("unexpected_message", f"expected {expected}, got {kind!r:.40}")
        if kind == "hello":
            self._check_hello(message)
            self._state = _AWAIT_PROOF
            return [self._hello(), self._proof()] if self._role == "responder" else []
        self._check_proof(message)
        self._peer = self._pending
        self._state = _DONE
        return [self._proof()] if self._role == "initiator" else []

    def _check_hello(self, message: dict[str, Any]) -> None:
        version = message.get("version")
        if isinstance(version, bool) or version != VERSION or not isinstance(version, int):
            raise _Fail("malformed", f"version must be {VERSION}")
        nonce = message.get("nonce")
        try:
            raw = b64url_decode(nonce)
        except EncodingError:
            raise _Fail("malformed", "nonce is not base64url") from None
        if len(raw) != NONCE_BYTES or b64url_encode(raw) != nonce:
            raise _Fail("malformed", f"nonce must be {NONCE_BYTES} bytes, unpadded base64url")
        theirs_c = _peer_algos(message, "compression")
        theirs_e = _peer_algos(message, "encryption")
        announce = message.get("announce")
        if not isinstance(announce, dict):
            raise _Fail("malformed", "announce must be a container object")
        if nonce == self._nonce:
            raise _Fail("self_connection", "the peer's nonce is ours (a connection to ourselves or a reflection)")
        result = self._verifier.verify(announce, now=self._now)
        if result.reason == FUTURE_TIMESTAMP:
            self._check_ahead(announce)
        check = check_peer_announce(result, min_difficulty=self._min_difficulty, now=self._now)
        if not check.ok or check.did is None:
            raise _Fail("bad_announce", f"{check.reason}: {check.detail}")
        if check.revoked:
            raise _Fail("bad_announce", "the announce revokes its DID (key_is_falsified)")
        if check.did == self._identity.did:
            raise _Fail("self_connection", "the peer claims our DID")
        self._skew = (check.did, (check.timestamp - self._now).total_seconds()) if check.timestamp else None
        if self._max_age is not None and check.timestamp is not None and check.timestamp < self._now - self._max_age:
            # a peer signs its announce just before its hello: this one's clock is behind ours
            # (or the announce is replayed: the proof would fail then anyway)
            offset = self._skew[1] if self._skew else 0.0
            raise _Fail("clock_skew", f"the peer's announce is dated {-offset:.0f} s behind our clock (window "
                                      f"{self._max_age.total_seconds():.0f} s): one of the two clocks is off "
                                      f"(offset_seconds={offset:+.3f})")
        head = result.container["hmp_container"]["head"]  # type: ignore[index]
        key = b58decode(head["public_key"]) if "public_key" in head else self._verifier.registry.pinned_key(check.did)
        self._peer_nonce = nonce
        self._pending = PeerInfo(
            did=check.did,
            public_key=bytes(key) if key is not None else b"",
            announce=check,
            verify_result=result,
            compression=tuple(a for a in self._compression if a in theirs_c),
            encryption=tuple(a for a in self._encryption if a in theirs_e),
        )

    def _check_ahead(self, announce: dict[str, Any]) -> None:
        """An announce refused as from the future: if it is a valid one as of its own time,
        the peer's clock is ahead of ours (clock_skew, not bad_announce)."""
        ahead = check_peer_announce(self._verifier.verify(announce, now=_timestamp_of(announce) or self._now),
                                    min_difficulty=self._min_difficulty, now=self._now)
        if ahead.ok and ahead.did is not None and ahead.timestamp is not None:
            offset = (ahead.timestamp - self._now).total_seconds()
            self._skew = (ahead.did, offset)
            window = self._verifier.limits.max_clock_skew.total_seconds()
            raise _Fail("clock_skew", f"the peer's announce is dated {offset:.0f} s ahead of our clock (window "
                                      f"{window:.0f} s): one of the two clocks is off (offset_seconds={offset:+.3f})")

    def _check_proof(self, message: dict[str, Any]) -> None:
        assert self._pending is not None
        did, key_text, sig_text = message.get("did"), message.get("public_key"), message.get("signature")
        if not isinstance(did, str) or not isinstance(key_text, str) or not isinstance(sig_text, str):
            raise _Fail("malformed", "a proof has string did, public_key and signature")
        if did != self._pending.did:
            raise _Fail("did_mismatch", f"proof for {did!r:.80}, announce of {self._pending.did}")
        try:
            key = b58decode(key_text)
        except EncodingError:
            raise _Fail("malformed", "public_key is not base58btc") from None
        if len(key) != 32:
            raise _Fail("malformed", "public_key must be a 32-byte Ed25519 key")
        if key != self._pending.public_key:
            raise _Fail("key_mismatch", "the proof's key is not the key that signed the announce")
        binding = bind_key(did, key, self._verifier.registry, self._now)
        if binding.reason is not None:
            raise _Fail("key_mismatch", f"{binding.reason}: {binding.detail}")
        try:
            signature = b64url_decode(sig_text)
        except EncodingError:
            raise _Fail("malformed", "signature is not base64url") from None
        peer_role = "responder" if self._role == "initiator" else "initiator"
        if not ed25519_verify(key, self._transcript(peer_role), signature):
            raise _Fail("bad_signature", "the proof's signature does not verify over this session's transcript")
