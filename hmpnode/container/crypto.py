"""Payload encryption `x25519-chacha20poly1305` exactly as profile section 6 fixes it.

Composed from libsodium primitives (PyNaCl bindings); nothing here implements
a primitive. All randomness comes from the `rng` argument.

    encrypted bytes = n(12) || ChaCha20-Poly1305-IETF(K, n, plaintext, aad="")
    envelope        = E(32) || ChaCha20-Poly1305-IETF(KEK, 0^12, K, aad=E)     (80 bytes)
    KEK             = BLAKE2b-256(S || E || X, person="hmp-key-recip-v1"),  S = X25519(e, X)
"""

from __future__ import annotations

from collections.abc import Sequence

import nacl.bindings as sodium
import nacl.exceptions

from hmpnode.identity.keys import Identity, Rng, ed25519_pk_to_x25519

__all__ = [
    "ENCRYPTION_ALGO",
    "DecryptError",
    "encrypt",
    "seal_key",
    "open_key",
    "decrypt",
]

ENCRYPTION_ALGO = "x25519-chacha20poly1305"
KEY_BYTES = 32
NONCE_BYTES = 12
ENVELOPE_BYTES = 32 + KEY_BYTES + 16
_KEK_PERSON = b"hmp-key-recip-v1"
_ZERO_NONCE = bytes(NONCE_BYTES)


class DecryptError(ValueError):
    """Not a recipient, tampered envelope, or tampered ciphertext."""


def _kek(shared: bytes, ephemeral_pk: bytes, recipient_x: bytes) -> bytes:
    return sodium.crypto_generichash_blake2b_salt_personal(
        shared + ephemeral_pk + recipient_x, digest_size=32, person=_KEK_PERSON
    )


def seal_key(key: bytes, recipient_ed25519_pk: bytes, rng: Rng) -> bytes:
    """The 80-byte key envelope of `key` for one recipient."""
    x = ed25519_pk_to_x25519(recipient_ed25519_pk)
    eph_sk = rng(32)
    eph_pk = sodium.crypto_scalarmult_base(eph_sk)
    try:
        shared = sodium.crypto_scalarmult(eph_sk, x)
    except nacl.exceptions.RuntimeError:
        raise ValueError("recipient key yields a degenerate shared secret") from None
    kek = _kek(shared, eph_pk, x)
    return eph_pk + sodium.crypto_aead_chacha20poly1305_ietf_encrypt(key, eph_pk, _ZERO_NONCE, kek)


def open_key(envelope: bytes, identity: Identity) -> bytes:
    """Recover the payload key from an envelope addressed to `identity`."""
    if len(envelope) != ENVELOPE_BYTES:
        raise DecryptError(f"key envelope must be {ENVELOPE_BYTES} bytes")
    eph_pk, sealed = envelope[:32], envelope[32:]
    x = identity.x25519_public
    try:
        shared = sodium.crypto_scalarmult(identity.x25519_secret, eph_pk)
        return sodium.crypto_aead_chacha20poly1305_ietf_decrypt(sealed, eph_pk, _ZERO_NONCE, _kek(shared, eph_pk, x))
    except (nacl.exceptions.CryptoError, nacl.exceptions.RuntimeError):
        raise DecryptError("key envelope does not open with this key") from None


def encrypt(plaintext: bytes, recipient_keys: Sequence[bytes], rng: Rng) -> tuple[bytes, list[bytes]]:
    """Encrypt once under a fresh key; return (encrypted bytes, one envelope per recipient)."""
    if not recipient_keys:
        raise ValueError("encryption needs at least one recipient")
    key = rng(KEY_BYTES)
    nonce = rng(NONCE_BYTES)
    body = nonce + sodium.crypto_aead_chacha20poly1305_ietf_encrypt(plaintext, b"", nonce, key)
    return body, [seal_key(key, pk, rng) for pk in recipient_keys]


def decrypt(encrypted: bytes, key: bytes) -> bytes:
    if len(encrypted) < NONCE_BYTES + 16:
        raise DecryptError("encrypted payload too short")
    try:
        return sodium.crypto_aead_chacha20poly1305_ietf_decrypt(
            encrypted[NONCE_BYTES:], b"", encrypted[:NONCE_BYTES], key
        )
    except nacl.exceptions.CryptoError:
        raise DecryptError("payload ciphertext fails authentication") from None
