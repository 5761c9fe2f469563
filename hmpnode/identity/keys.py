"""Agent identity (HMP profile section 4): one Ed25519 key pair, self-certifying DID.

The same key encrypts: its X25519 form is libsodium's standard Ed25519 to
Curve25519 conversion. Randomness is injected (`rng`), never read implicitly
except by `Identity.generate()` when no rng is given.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable

import nacl.bindings as sodium
import nacl.utils

from hmpnode.container.encoding import EncodingError, b58decode, b58encode

__all__ = [
    "AGENT_DID_PREFIX",
    "Rng",
    "Identity",
    "agent_did_for_key",
    "is_self_certifying_did",
    "did_matches_key",
    "public_key_from_b58",
    "ed25519_pk_to_x25519",
    "ed25519_verify",
]

Rng = Callable[[int], bytes]
AGENT_DID_PREFIX = "did:hmp:agent:"


def agent_did_for_key(public_key: bytes) -> str:
    """`did:hmp:agent:` + base58btc(first 20 bytes of SHA-256(public key))."""
    return AGENT_DID_PREFIX + b58encode(hashlib.sha256(public_key).digest()[:20])


@functools.lru_cache(maxsize=8192)
def is_self_certifying_did(did: str) -> bool:
    """True when `did` has the form hmpnode mints (it then must hash to its key)."""
    if not did.startswith(AGENT_DID_PREFIX):
        return False
    try:
        return len(b58decode(did[len(AGENT_DID_PREFIX):])) == 20
    except EncodingError:
        return False


def did_matches_key(did: str, public_key: bytes) -> bool:
    return did == agent_did_for_key(public_key)


def public_key_from_b58(text: str) -> bytes:
    """Decode a base58btc Ed25519 public key; raises EncodingError if not 32 bytes."""
    key = b58decode(text)
    if len(key) != 32:
        raise EncodingError("public key must be 32 bytes")
    return key


def ed25519_verify(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """Detached Ed25519 check; False for a bad signature, key or length (never raises)."""
    if len(signature) != 64 or len(public_key) != 32:
        return False
    try:
        sodium.crypto_sign_open(signature + message, public_key)
    except Exception:  # BadSignatureError, or ValueError/RuntimeError for a bad point
        return False
    return True


def ed25519_pk_to_x25519(public_key: bytes) -> bytes:
    """X25519 form of an Ed25519 public key; raises ValueError for an invalid point."""
    try:
        return sodium.crypto_sign_ed25519_pk_to_curve25519(public_key)
    except Exception as exc:  # nacl raises RuntimeError for bad points
        raise ValueError("not a valid Ed25519 public key") from exc


class Identity:
    """An agent's (or node's) Ed25519 key pair and the values derived from it."""

    __slots__ = ("seed", "public_key", "_secret", "did", "public_key_b58", "_x25519_secret", "_x25519_public")

    def __init__(self, seed: bytes):
        if len(seed) != 32:
            raise ValueError("Ed25519 seed must be 32 bytes")
        self.seed = bytes(seed)
        self.public_key, self._secret = sodium.crypto_sign_seed_keypair(self.seed)
        self.did = agent_did_for_key(self.public_key)
        self.public_key_b58 = b58encode(self.public_key)
        self._x25519_secret: bytes | None = None
        self._x25519_public: bytes | None = None

    @classmethod
    def generate(cls, rng: Rng | None = None) -> Identity:
        return cls((rng or nacl.utils.random)(32))

    def sign(self, message: bytes) -> bytes:
        """Detached 64-byte Ed25519 signature."""
        return sodium.crypto_sign(message, self._secret)[:64]

    def local_key(self, label: bytes) -> bytes:
        """A 32-byte secret of this identity for one purpose (`label`):
        SHA-256(label || Ed25519(label)). Deterministic, so what it seals (API
        cursors, recall plans) survives a restart; worthless without the key."""
        return hashlib.sha256(label + self.sign(label)).digest()

    @property
    def x25519_secret(self) -> bytes:
        if self._x25519_secret is None:
            self._x25519_secret = sodium.crypto_sign_ed25519_sk_to_curve25519(self._secret)
        return self._x25519_secret

    @property
    def x25519_public(self) -> bytes:
        if self._x25519_public is None:
            self._x25519_public = sodium.crypto_sign_ed25519_pk_to_curve25519(self.public_key)
        return self._x25519_public

    def __repr__(self) -> str:
        return f"Identity({self.did})"
