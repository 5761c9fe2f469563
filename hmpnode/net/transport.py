"""Peer transport v2: a Noise XX session bound to the node's identity, then AEAD records.

Sans-IO: bytes in, bytes out; no sockets, no clock, randomness injected. The wire
format is specified in docs/protocol.md ("Peer transport v2"); in short:

* Every unit on the wire is ``u16be length || body`` (1..65535 body bytes). A
  carrier that keeps message boundaries (WebSocket) may put one or more whole
  units in a message; receivers read the messages as one byte stream.
* The first three units are the messages of ``Noise_XX_25519_ChaChaPoly_SHA256``
  (hmpnode/net/noise.py) with prologue ``b"hmp-peer/2"``. Message 1 carries an
  empty payload; message 2 (responder) and 3 (initiator) carry the sender's
  identity payload::

      u8        n                 number of protocol versions, 1..16
      n times   u8 len, len bytes  a version string, ASCII 0x21..0x7e, 1..32 bytes
      64 bytes  identity_sig      Ed25519(identity key, b"hmp-noise-static-key:" || s)
      u16be     announce_len      1..65535
      bytes     announce          the signed peer_announce container, JSON (full form)
      bytes     extensions        zero or more bytes, ignored by v2 receivers

  where ``s`` is the 32-byte Noise static public key of the sender. The receiver
  checks the announce (a hook: `verify_announce`), then the signature with the
  announce's key: the identity is thereby bound to the static key, which Noise
  binds to this channel.
* Every later unit is a record: ``ChaChaPoly(k, n, ad=b"", flags || fragment)``,
  one nonce counter per direction. ``flags`` is 0x00 for the last fragment of a
  frame, 0x01 when more follow; other values are an error. A frame (any bytes,
  up to `max_frame`) is split into fragments of at most `MAX_FRAGMENT` bytes.

Every failure is a `TransportError` with a stable `reason` (see `REASONS`) and
leaves the object failed for good: the session must be closed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hmpnode.identity.keys import Identity, ed25519_verify
from hmpnode.net.noise import MAX_MESSAGE, TAGLEN, CipherState, HandshakeState, KeyPair, NoiseError, Rng

__all__ = [
    "PROTOCOL",
    "NAT_PROTOCOL",
    "HANDSHAKE_VERSIONS",
    "PROLOGUE",
    "NOISE_HASH",
    "STATIC_KEY_CONTEXT",
    "MAX_RECORD",
    "MAX_FRAGMENT",
    "DEFAULT_MAX_FRAME",
    "REASONS",
    "TransportError",
    "AnnounceRejected",
    "CheckedAnnounce",
    "PeerIdentity",
    "KeyPair",
    "static_key_message",
    "encode_payload",
    "decode_payload",
    "make_payload",
    "make_announce_checker",
    "UnitReader",
    "NoiseHandshake",
    "Transport",
]

#: Protocol name and version; the Noise prologue, so both sides must agree on it.
PROTOCOL = "hmp-peer/2"
#: peer protocols this node speaks (its announce lists them; it dials peers that list one)
PROTOCOLS = (PROTOCOL,)
#: the `nat` frames (docs/protocol.md 34): a peer that lists this in its handshake's versions
#: may be sent them; to any other peer they are never sent
NAT_PROTOCOL = "hmp-nat/1"
#: what our identity payload lists: the peer protocol, then the frame extensions we speak
HANDSHAKE_VERSIONS = (PROTOCOL, NAT_PROTOCOL)
PROLOGUE = PROTOCOL.encode("ascii")
NOISE_HASH = "SHA256"
#: Prefix of the bytes the identity key signs (followed by the 32-byte static key).
STATIC_KEY_CONTEXT = b"hmp-noise-static-key:"
#: Largest record ciphertext (a Noise message).
MAX_RECORD = MAX_MESSAGE
#: Largest fragment of a frame in one record: 65535 - 16 (tag) - 1 (flags).
MAX_FRAGMENT = MAX_RECORD - TAGLEN - 1
#: Default bound on a reassembled frame: the node's 4 MiB frame limit plus room.
DEFAULT_MAX_FRAME = 4 * 1024 * 1024 + 64 * 1024
MAX_VERSIONS = 16
MAX_VERSION_LEN = 32
SIG_LEN = 64
_MORE, _LAST = 0x01, 0x00

REASONS = {
    # handshake
    "malformed": "a handshake unit is empty, too long, or its length prefix disagrees",
    "handshake_failed": "a handshake message does not decrypt (tampered, foreign or out of order)",
    "bad_key": "the peer's ephemeral or static key is a low-order point",
    "bad_payload": "the identity payload does not have the v2 layout",
    "no_common_version": f"the peer does not list {PROTOCOL}",
    "bad_announce": "the announce hook refused the peer's announce",
    "bad_identity_sig": "the identity signature does not verify over the peer's Noise static key",
    "self_connection": "the peer is this node (same DID or same static key)",
    "unexpected_peer": "the peer's DID is not the one dialled",
    # records
    "truncated": "the stream ended inside a record or inside a frame",
    "record_too_short": "a record shorter than a tag and a flags byte",
    "bad_record": "a record does not decrypt: tampered, replayed, reordered, injected or from another session",
    "bad_flags": "a record's flags byte is not 0x00 or 0x01",
    "frame_too_large": "a frame is over the frame limit",
    "trailing_data": "decrypt() was given more than one frame",
    "nonce_exhausted": "2**64 - 1 records in one direction",
    "closed": "the transport failed earlier and must not be used",
}


class TransportError(Exception):
    """A stable `reason` (a key of `REASONS`) and a human-readable `detail` (not stable)."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class AnnounceRejected(Exception):
    """Raised by an announce hook to refuse the peer's announce (`detail` for logs)."""


@dataclass(frozen=True, slots=True)
class CheckedAnnounce:
    """What an announce hook returns: the announce's DID and the Ed25519 key bound
    to it; `info` is anything the node wants back (the checked announce)."""

    did: str
    public_key: bytes
    info: Any = None


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """The authenticated peer once the handshake is complete."""

    did: str
    public_key: bytes
    #: the peer's Noise static public key (bound to `did` by the identity signature)
    static_key: bytes
    #: protocol versions the peer listed, in its order
    versions: tuple[str, ...]
    #: the raw announce bytes and whatever the hook returned for them
    announce: bytes
    info: Any = None


def static_key_message(static_public: bytes) -> bytes:
    """The bytes the identity key signs: b"hmp-noise-static-key:" || 32-byte static key."""
    if len(static_public) != 32:
        raise ValueError("a Noise static public key is 32 bytes")
    return STATIC_KEY_CONTEXT + static_public


# -- identity payload ---------------------------------------------------------


def _check_version(v: Any) -> bytes:
    raw = v.encode("ascii") if isinstance(v, str) and v.isascii() else b""
    if not 1 <= len(raw) <= MAX_VERSION_LEN or not all(0x21 <= c <= 0x7E for c in raw):
        raise ValueError(f"a version is 1..{MAX_VERSION_LEN} printable ASCII characters without spaces")
    return raw


def encode_payload(versions: Sequence[str], identity_sig: bytes, announce: bytes, extensions: bytes = b"") -> bytes:
    """The identity payload's byte layout (module docstring)."""
    if isinstance(versions, str) or not 1 <= len(versions) <= MAX_VERSIONS:
        raise ValueError(f"1..{MAX_VERSIONS} versions")
    if len(identity_sig) != SIG_LEN:
        raise ValueError("an Ed25519 signature is 64 bytes")
    if not 1 <= len(announce) <= 0xFFFF:
        raise ValueError("the announce is 1..65535 bytes")
    out = bytearray([len(versions)])
    for v in versions:
        raw = _check_version(v)
        out += bytes([len(raw)]) + raw
    out += identity_sig + len(announce).to_bytes(2, "big") + announce + extensions
    return bytes(out)


def decode_payload(data: bytes) -> tuple[tuple[str, ...], bytes, bytes]:
    """(versions, identity_sig, announce); raises TransportError("bad_payload")."""
    try:
        pos = 1
        n = data[0]
        if not 1 <= n <= MAX_VERSIONS:
            raise ValueError(f"{n} versions")
        versions = []
        for _ in range(n):
            length = data[pos]
            raw = data[pos + 1 : pos + 1 + length]
            if len(raw) != length:
                raise ValueError("a version runs past the end")
            versions.append(_check_version(raw.decode("ascii")))
            pos += 1 + length
        sig = data[pos : pos + SIG_LEN]
        pos += SIG_LEN
        size = int.from_bytes(data[pos : pos + 2], "big")
        announce = data[pos + 2 : pos + 2 + size]
        if len(sig) != SIG_LEN or len(data) < pos + 2 or size == 0 or len(announce) != size:
            raise ValueError("the signature or the announce runs past the end")
    except (IndexError, ValueError, UnicodeDecodeError) as exc:
        raise TransportError("bad_payload", str(exc)) from None
    return tuple(v.decode("ascii") for v in versions), bytes(sig), bytes(announce)


def make_payload(
    identity: Identity, announce: bytes, static_public: bytes, versions: Sequence[str] = (PROTOCOL,)
) -> bytes:
    """Our identity payload: the versions we speak, our signature over our static
    key, and our signed announce (its JSON bytes, as the Verifier accepts them)."""
    return encode_payload(versions, identity.sign(static_key_message(static_public)), announce)


def make_announce_checker(verifier: Any, *, min_difficulty: int, now: datetime) -> Callable[[bytes], CheckedAnnounce]:
    """The node's announce hook: `Verifier.verify`, then `check_peer_announce`
    (not a revocation), then the key bound to the DID (`bind_key`). `info` is
    (AnnounceCheck, VerifyResult). Imported lazily: the transport itself does not
    depend on the container layer."""
    from hmpnode.container.encoding import b58decode
    from hmpnode.identity.registry import bind_key
    from hmpnode.net.announce import check_peer_announce

    def check(raw: bytes) -> CheckedAnnounce:
        result = verifier.verify(raw, now=now)
        checked = check_peer_announce(result, min_difficulty=min_difficulty, now=now)
        if not checked.ok or checked.did is None:
            raise AnnounceRejected(f"{checked.reason}: {checked.detail}")
        if checked.revoked:
            raise AnnounceRejected("the announce revokes its DID (key_is_falsified)")
        head = result.container["hmp_container"]["head"]
        key = b58decode(head["public_key"]) if "public_key" in head else verifier.registry.pinned_key(checked.did)
        binding = bind_key(checked.did, bytes(key) if key is not None else None, verifier.registry, now)
        if binding.reason is not None or key is None:
            raise AnnounceRejected(f"{binding.reason}: {binding.detail}")
        return CheckedAnnounce(checked.did, bytes(key), (checked, result))

    return check


class UnitReader:
    """Cuts a byte stream (TCP) into whole units for the handshake.

    `feed(data)` returns the complete units (length prefix included), keeping at
    most one partial unit (65 537 bytes). Once the handshake is complete, give
    the units that follow, and `rest()`, to `Transport.feed` in order."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        units = []
        while len(self._buf) >= 2:
            size = int.from_bytes(self._buf[:2], "big")
            if size == 0:
                raise TransportError("malformed", "an empty unit")
            if len(self._buf) < 2 + size:
                break
            units.append(bytes(self._buf[: 2 + size]))
            del self._buf[: 2 + size]
        return units

    def rest(self) -> bytes:
        """The bytes of a partial unit (for `Transport.feed` after the handshake)."""
        out, self._buf = bytes(self._buf), bytearray()
        return out


# -- handshake ----------------------------------------------------------------


def _unit(body: bytes) -> bytes:
    return len(body).to_bytes(2, "big") + body


class NoiseHandshake:
    """One side of the v2 handshake (three units; the initiator writes first).

    `payload` is this side's identity payload (`make_payload`); it goes in
    message 2 (responder) or 3 (initiator), never in the cleartext message 1.
    `verify_announce` is the announce hook (`make_announce_checker`); it
    returns a CheckedAnnounce or raises AnnounceRejected. `own_did` refuses a
    connection to ourselves; `expected_did` (a dial) refuses any other peer.

    Drive it with `write_message()` (returns one wire unit) when `my_turn()`,
    `read_message(unit)` otherwise; when `complete`, `peer`, `handshake_hash`
    and `transport()` are available. The responder learns and checks the
    peer's identity on message 3 only; the initiator on message 2.
    """

    def __init__(
        self,
        role: str,
        static_keypair: KeyPair,
        prologue: bytes,
        payload: bytes,
        rng: Rng,
        *,
        verify_announce: Callable[[bytes], CheckedAnnounce],
        own_did: str | None = None,
        expected_did: str | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
    ):
        if role not in ("initiator", "responder"):
            raise ValueError("role must be 'initiator' or 'responder'")
        self.role = role
        self._hs = HandshakeState(
            initiator=role == "initiator", static=static_keypair, prologue=prologue, rng=rng, hash_name=NOISE_HASH
        )
        self._payload = payload
        self._verify_announce = verify_announce
        self._own_did = own_did
        self._expected_did = expected_did
        self._max_frame = max_frame
        self._step = 0
        self._peer: PeerIdentity | None = None
        self.failed: TransportError | None = None

    @property
    def complete(self) -> bool:
        return self._hs.complete and self._peer is not None and self.failed is None

    @property
    def peer(self) -> PeerIdentity | None:
        return self._peer if self.complete else None

    @property
    def handshake_hash(self) -> bytes:
        """The Noise handshake hash `h`: a channel-binding value (32 bytes) once complete."""
        if not self.complete:
            raise RuntimeError("the handshake is not complete")
        return self._hs.handshake_hash

    def my_turn(self) -> bool:
        return self.failed is None and self._hs.my_turn()

    def _fail(self, reason: str, detail: str) -> TransportError:
        self.failed = TransportError(reason, detail)
        self._hs.failed = True
        return self.failed

    def write_message(self) -> bytes:
        if self.failed is not None:
            raise TransportError("closed", f"the handshake failed: {self.failed.reason}")
        if not self._hs.my_turn():
            raise RuntimeError("not this side's turn to write")
        payload = b"" if self._step == 0 else self._payload
        try:
            body = self._hs.write_message(payload)
        except NoiseError as exc:
            raise self._fail("bad_key" if exc.reason == "bad_dh" else "malformed", str(exc)) from None
        self._step += 1
        return _unit(body)

    def read_message(self, unit: bytes) -> None:
        """Take one whole wire unit (length prefix included); raises TransportError."""
        if self.failed is not None:
            raise TransportError("closed", f"the handshake failed: {self.failed.reason}")
        if self._hs.my_turn() or self._hs.complete:
            raise self._fail("malformed", "a handshake message when none was expected")
        if len(unit) < 3 or int.from_bytes(unit[:2], "big") != len(unit) - 2:
            raise self._fail("malformed", "a unit is u16be length || 1..65535 bytes")
        try:
            payload = self._hs.read_message(unit[2:])
        except NoiseError as exc:
            reason = {"bad_dh": "bad_key", "decrypt_failed": "handshake_failed"}.get(exc.reason, "malformed")
            raise self._fail(reason, str(exc)) from None
        self._step += 1
        if self._step == 1:
            if payload:
                raise self._fail("malformed", "message 1 carries no payload")
            return
        if self._step == 2 or self._step == 3:
            if self._hs.rs is not None and self._peer is None and payload:
                self._check_identity(payload)
                return
        raise self._fail("bad_payload", "the identity payload is missing")

    def _check_identity(self, payload: bytes) -> None:
        rs = self._hs.rs
        assert rs is not None
        try:
            versions, sig, announce = decode_payload(payload)
        except TransportError as exc:
            raise self._fail(exc.reason, exc.detail) from None
        if rs == self._hs.s.public:
            raise self._fail("self_connection", "the peer's static key is ours")
        if PROTOCOL not in versions:
            raise self._fail("no_common_version", f"the peer speaks {list(versions)!r:.120}")
        try:
            checked = self._verify_announce(announce)
        except AnnounceRejected as exc:
            raise self._fail("bad_announce", str(exc)) from None
        if not ed25519_verify(checked.public_key, static_key_message(rs), sig):
            raise self._fail("bad_identity_sig", "the signature is not over this session's static key")
        if self._own_did is not None and checked.did == self._own_did:
            raise self._fail("self_connection", "the peer claims our DID")
        if self._expected_did is not None and checked.did != self._expected_did:
            raise self._fail("unexpected_peer", f"dialled {self._expected_did}, reached {checked.did}")
        self._peer = PeerIdentity(checked.did, checked.public_key, rs, versions, announce, checked.info)

    def transport(self) -> Transport:
        """The record layer of this session (call once, when complete)."""
        if not self.complete:
            raise RuntimeError("the handshake is not complete")
        send, recv = self._hs.split()
        return Transport(send, recv, max_frame=self._max_frame, handshake_hash=self._hs.handshake_hash)


# -- records ------------------------------------------------------------------


class Transport:
    """AEAD records of one session (module docstring). Not thread-safe.

    `encrypt(frame)` returns the wire units of one frame. The receive side is
    either `feed(data)` (any chunking; returns the completed frames) or
    `decrypt(data)` (exactly the units of one frame, as one WebSocket message
    would carry them). Memory is bounded: at most one partial unit (65537
    bytes) plus one partial frame (`max_frame`)."""

    def __init__(self, send: CipherState, recv: CipherState, *, max_frame: int, handshake_hash: bytes):
        if max_frame < 0:
            raise ValueError("max_frame must be >= 0")
        self._send = send
        self._recv = recv
        self.max_frame = max_frame
        self.handshake_hash = handshake_hash
        self._buf = bytearray()
        self._frame = bytearray()
        self._in_frame = False
        self.failed: TransportError | None = None

    @property
    def records_sent(self) -> int:
        return self._send.n

    @property
    def records_received(self) -> int:
        return self._recv.n

    def _fail(self, reason: str, detail: str = "") -> TransportError:
        self.failed = TransportError(reason, detail)
        self._buf.clear()
        self._frame.clear()
        return self.failed

    def _check_open(self) -> None:
        if self.failed is not None:
            raise TransportError("closed", f"the transport failed: {self.failed.reason}")

    def encrypt(self, frame: bytes) -> bytes:
        self._check_open()
        if len(frame) > self.max_frame:
            raise TransportError("frame_too_large", f"{len(frame)} > {self.max_frame} bytes")
        view = memoryview(frame)
        out = bytearray()
        pos = 0
        while True:
            chunk = view[pos : pos + MAX_FRAGMENT]
            pos += len(chunk)
            flags = _MORE if pos < len(view) else _LAST
            try:
                record = self._send.encrypt_with_ad(b"", bytes([flags]) + chunk)
            except NoiseError as exc:
                raise self._fail("nonce_exhausted", str(exc)) from None
            out += _unit(record)
            if flags == _LAST:
                return bytes(out)

    def feed(self, data: bytes) -> list[bytes]:
        """Take received bytes (any chunking); return the frames they complete."""
        self._check_open()
        # one immutable buffer per call: the waiting partial unit (<= 65 537 bytes) + data
        buf = bytes(self._buf) + bytes(data) if self._buf else bytes(data)
        view = memoryview(buf)
        frames: list[bytes] = []
        pos = 0
        while len(buf) - pos >= 2:
            size = int.from_bytes(view[pos : pos + 2], "big")
            if size < TAGLEN + 1:
                raise self._fail("record_too_short", f"a {size}-byte record")
            if len(buf) - pos < 2 + size:
                break
            try:
                plain = self._recv.decrypt_with_ad(b"", view[pos + 2 : pos + 2 + size])
            except NoiseError as exc:
                reason = "nonce_exhausted" if exc.reason == "nonce_exhausted" else "bad_record"
                raise self._fail(reason, str(exc)) from None
            pos += 2 + size
            flags = plain[0]
            if flags not in (_MORE, _LAST):
                raise self._fail("bad_flags", f"flags 0x{flags:02x}")
            if len(self._frame) + len(plain) - 1 > self.max_frame:
                raise self._fail("frame_too_large", f"over {self.max_frame} bytes")
            if flags == _LAST and not self._frame:
                frames.append(plain[1:])  # a one-record frame: no reassembly buffer
                self._in_frame = False
                continue
            self._frame += memoryview(plain)[1:]
            self._in_frame = flags == _MORE
            if not self._in_frame:
                frames.append(bytes(self._frame))
                self._frame.clear()
        self._buf = bytearray(view[pos:])
        return frames

    @property
    def pending(self) -> bool:
        """True when received bytes wait for the rest of a record or frame."""
        return bool(self._buf) or self._in_frame

    def close(self) -> None:
        """The carrier ended: raise TransportError("truncated") if that cut a record or frame."""
        self._check_open()
        if self.pending:
            raise self._fail("truncated", f"{len(self._buf)} bytes of a record, {len(self._frame)} of a frame")

    def decrypt(self, data: bytes) -> bytes:
        """Exactly the units of one frame (one WebSocket message) -> the frame."""
        self._check_open()
        if self.pending:
            raise RuntimeError("decrypt() and feed() cannot be mixed mid-frame")
        frames = self.feed(data)
        if not frames:
            raise self._fail("truncated", "the data ends inside a record or a frame")
        if len(frames) > 1 or self.pending:
            raise self._fail("trailing_data", "more than one frame")
        return frames[0]
