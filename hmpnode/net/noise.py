"""The Noise Protocol Framework (revision 34), XX pattern, composed from libsodium.

Why this module and not the `noiseprotocol` package: that package (0.3.1, last
released November 2020) pulls in `cryptography`, which the daemon does not import
otherwise; measured with /proc/self/status, importing it and building one
`Noise_XX_25519_ChaChaPoly_SHA256` object costs +10.7 MB of RSS on top of PyNaCl,
which the node already loads (PyNaCl + hashlib + hmac: +7.0 MB from a bare
interpreter; noiseprotocol alone: +13.1 MB). The node has a memory target, and
PyNaCl already holds every primitive Noise needs.

No primitive is implemented here. Each comes from libsodium (through PyNaCl) or
from the standard library:

    DH        X25519                   nacl.bindings.crypto_scalarmult(_base)
    cipher    ChaCha20-Poly1305 IETF   nacl.bindings.crypto_aead_chacha20poly1305_ietf_*
    hash      SHA-256 or BLAKE2b       hashlib.sha256 / hashlib.blake2b
    HMAC      RFC 2104                 hmac (stdlib)

This module only composes them into the three objects of the Noise
specification, section 5 (CipherState, SymmetricState, HandshakeState), with
the XX pattern (section 7.5)::

    XX:
      -> e
      <- e, ee, s, es
      -> s, se

It is checked byte for byte against the published Noise test vectors
(cacophony and noise-c, tests/data/noise_xx_25519_chachapoly.json), for
SHA-256 and BLAKE2b. Rekeying (section 11.3) is not implemented: a session that
would reach nonce 2**64 - 1 fails with `NoiseError("nonce_exhausted")` instead.
Sans-IO: no sockets, no clock; the ephemeral key comes from an injected `rng`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass

import nacl.bindings as sodium

__all__ = [
    "DHLEN",
    "TAGLEN",
    "MAX_MESSAGE",
    "HASHES",
    "NoiseError",
    "KeyPair",
    "CipherState",
    "SymmetricState",
    "HandshakeState",
    "protocol_name",
]

DHLEN = 32
TAGLEN = 16
#: Largest Noise message (spec section 3).
MAX_MESSAGE = 65535
#: The largest nonce is reserved (spec section 5.1).
_MAX_NONCE = 2**64 - 1
#: hash name -> (constructor, HASHLEN)
HASHES: dict[str, tuple[Callable[..., "hashlib._Hash"], int]] = {
    "SHA256": (hashlib.sha256, 32),
    "BLAKE2b": (hashlib.blake2b, 64),
}
#: XX message patterns; True = written by the initiator.
_XX = (("e",), ("e", "ee", "s", "es"), ("s", "se"))

Rng = Callable[[int], bytes]


class NoiseError(Exception):
    """A Noise operation failed; `reason` is a short stable code.

    `decrypt_failed` (AEAD tag did not verify: tampered, replayed, reordered or
    foreign data), `short_message`, `message_too_large`, `bad_dh` (a public key
    gave an all-zero shared secret), `nonce_exhausted`, `wrong_turn`."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def protocol_name(hash_name: str = "SHA256") -> bytes:
    if hash_name not in HASHES:
        raise ValueError(f"hash must be one of {sorted(HASHES)}")
    return f"Noise_XX_25519_ChaChaPoly_{hash_name}".encode("ascii")


@dataclass(frozen=True, slots=True)
class KeyPair:
    """An X25519 key pair. `from_private` derives the public key (libsodium clamps)."""

    private: bytes
    public: bytes

    @classmethod
    def from_private(cls, private: bytes) -> KeyPair:
        if not isinstance(private, bytes) or len(private) != DHLEN:
            raise ValueError(f"an X25519 private key is {DHLEN} bytes")
        return cls(private, sodium.crypto_scalarmult_base(private))

    @classmethod
    def generate(cls, rng: Rng) -> KeyPair:
        return cls.from_private(rng(DHLEN))

    def __repr__(self) -> str:  # never print the private key
        return f"KeyPair(public={self.public.hex()})"


def _dh(private: bytes, public: bytes) -> bytes:
    try:
        return sodium.crypto_scalarmult(private, public)
    except Exception as exc:  # libsodium refuses an all-zero result (low-order point)
        raise NoiseError("bad_dh", "the peer's public key is a low-order point") from exc


def _nonce(n: int) -> bytes:
    # ChaChaPoly nonce: 32 bits of zeros, then the 64-bit counter little-endian (spec 12.3).
    return b"\x00\x00\x00\x00" + n.to_bytes(8, "little")


class CipherState:
    """Spec section 5.1: a key (or none) and a 64-bit nonce counter."""

    __slots__ = ("_k", "n")

    def __init__(self, key: bytes | None = None):
        self._k = key
        self.n = 0

    def has_key(self) -> bool:
        return self._k is not None

    def encrypt_with_ad(self, ad: bytes, plaintext: bytes) -> bytes:
        if self._k is None:
            return bytes(plaintext)
        if self.n >= _MAX_NONCE:
            raise NoiseError("nonce_exhausted", "2**64 - 1 messages under one key")
        out = sodium.crypto_aead_chacha20poly1305_ietf_encrypt(bytes(plaintext), ad, _nonce(self.n), self._k)
        self.n += 1
        return out

    def decrypt_with_ad(self, ad: bytes, ciphertext: bytes) -> bytes:
        """On failure the nonce does not advance (spec 5.1) and NoiseError is raised."""
        if self._k is None:
            return bytes(ciphertext)
        if self.n >= _MAX_NONCE:
            raise NoiseError("nonce_exhausted", "2**64 - 1 messages under one key")
        try:
            out = sodium.crypto_aead_chacha20poly1305_ietf_decrypt(bytes(ciphertext), ad, _nonce(self.n), self._k)
        except Exception as exc:  # nacl.exceptions.CryptoError, or ValueError for a short input
            raise NoiseError("decrypt_failed", "authentication tag mismatch") from exc
        self.n += 1
        return out


class SymmetricState:
    """Spec section 5.2: chaining key `ck`, handshake hash `h`, and a CipherState."""

    __slots__ = ("_hash", "hashlen", "ck", "h", "cipher")

    def __init__(self, name: bytes, hash_name: str):
        self._hash, self.hashlen = HASHES[hash_name]
        if len(name) <= self.hashlen:
            self.h = name + b"\x00" * (self.hashlen - len(name))
        else:
            self.h = self._hash(name).digest()
        self.ck = self.h
        self.cipher = CipherState()

    def _hmac(self, key: bytes, data: bytes) -> bytes:
        return hmac.new(key, data, self._hash).digest()

    def hkdf(self, ikm: bytes, outputs: int) -> tuple[bytes, ...]:
        """Spec section 4.3: HKDF(chaining_key, input_key_material, num_outputs)."""
        temp = self._hmac(self.ck, ikm)
        out1 = self._hmac(temp, b"\x01")
        out2 = self._hmac(temp, out1 + b"\x02")
        if outputs == 2:
            return out1, out2
        return out1, out2, self._hmac(temp, out2 + b"\x03")

    def mix_key(self, ikm: bytes) -> None:
        self.ck, temp_k = self.hkdf(ikm, 2)
        self.cipher = CipherState(temp_k[:32])

    def mix_hash(self, data: bytes) -> None:
        self.h = self._hash(self.h + data).digest()

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ct = self.cipher.encrypt_with_ad(self.h, plaintext)
        self.mix_hash(ct)
        return ct

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        pt = self.cipher.decrypt_with_ad(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return pt

    def split(self) -> tuple[CipherState, CipherState]:
        k1, k2 = self.hkdf(b"", 2)
        return CipherState(k1[:32]), CipherState(k2[:32])


class HandshakeState:
    """Spec section 5.3 for the XX pattern (no pre-messages, no PSK).

    Call `write_message(payload)` / `read_message(message)` in turn (the
    initiator writes first); after the third message `complete` is true and
    `split()` gives (send, receive) CipherStates for this side, `handshake_hash`
    the channel-binding value `h`. The remote static key is `rs` once read.
    Any NoiseError leaves the object unusable (`failed`)."""

    def __init__(
        self,
        *,
        initiator: bool,
        static: KeyPair,
        prologue: bytes = b"",
        rng: Rng,
        hash_name: str = "SHA256",
    ):
        self.initiator = initiator
        self.s = static
        self.e: KeyPair | None = None
        self.rs: bytes | None = None
        self.re: bytes | None = None
        self._rng = rng
        self._ss = SymmetricState(protocol_name(hash_name), hash_name)
        self._ss.mix_hash(prologue)
        self._step = 0
        self._result: tuple[CipherState, CipherState] | None = None
        self.failed = False

    @property
    def complete(self) -> bool:
        return self._result is not None

    @property
    def handshake_hash(self) -> bytes:
        return self._ss.h

    def my_turn(self) -> bool:
        """True when this side writes the next message."""
        return self._step < len(_XX) and (self._step % 2 == 0) == self.initiator

    def split(self) -> tuple[CipherState, CipherState]:
        """(send, receive) for this side; only once complete."""
        if self._result is None:
            raise RuntimeError("the handshake is not complete")
        c1, c2 = self._result
        return (c1, c2) if self.initiator else (c2, c1)

    def _check_turn(self, writing: bool) -> None:
        if self.failed:
            raise NoiseError("wrong_turn", "the handshake failed earlier")
        if self._step >= len(_XX) or self.my_turn() != writing:
            raise NoiseError("wrong_turn", f"not this side's turn to {'write' if writing else 'read'}")

    def _mix_dh(self, token: str) -> None:
        e, s, re, rs = self.e, self.s, self.re, self.rs
        assert e is not None and re is not None
        if token == "ee":
            shared = _dh(e.private, re)
        elif (token == "es") == self.initiator:  # es as initiator, se as responder
            assert rs is not None
            shared = _dh(e.private, rs)
        else:  # se as initiator, es as responder
            shared = _dh(s.private, re)
        self._ss.mix_key(shared)

    def _finish(self) -> None:
        self._step += 1
        if self._step == len(_XX):
            self._result = self._ss.split()

    def write_message(self, payload: bytes = b"") -> bytes:
        self._check_turn(writing=True)
        try:
            out = bytearray()
            for token in _XX[self._step]:
                if token == "e":
                    self.e = KeyPair.generate(self._rng)
                    out += self.e.public
                    self._ss.mix_hash(self.e.public)
                elif token == "s":
                    out += self._ss.encrypt_and_hash(self.s.public)
                else:
                    self._mix_dh(token)
            out += self._ss.encrypt_and_hash(payload)
            if len(out) > MAX_MESSAGE:
                raise NoiseError("message_too_large", f"{len(out)} > {MAX_MESSAGE} bytes")
        except NoiseError:
            self.failed = True
            raise
        self._finish()
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        """Returns the payload; raises NoiseError (and fails for good) on bad input."""
        self._check_turn(writing=False)
        try:
            if len(message) > MAX_MESSAGE:
                raise NoiseError("message_too_large", f"{len(message)} > {MAX_MESSAGE} bytes")
            view = memoryview(message)
            for token in _XX[self._step]:
                if token == "e":
                    if len(view) < DHLEN:
                        raise NoiseError("short_message", "no room for an ephemeral key")
                    self.re = bytes(view[:DHLEN])
                    view = view[DHLEN:]
                    self._ss.mix_hash(self.re)
                elif token == "s":
                    n = DHLEN + (TAGLEN if self._ss.cipher.has_key() else 0)
                    if len(view) < n:
                        raise NoiseError("short_message", "no room for a static key")
                    self.rs = self._ss.decrypt_and_hash(bytes(view[:n]))
                    view = view[n:]
                else:
                    self._mix_dh(token)
            if self._ss.cipher.has_key() and len(view) < TAGLEN:
                raise NoiseError("short_message", "no room for the payload's tag")
            payload = self._ss.decrypt_and_hash(bytes(view))
        except NoiseError:
            self.failed = True
            raise
        self._finish()
        return payload
