"""Keystore files: an Identity's Ed25519 seed on disk, optionally passphrase-sealed.

File format (JSON object, UTF-8, written with a trailing newline)::

    plain:   {"format": "hmpnode-keystore", "version": 1,
              "did": "did:hmp:agent:...", "public_key": "<base58btc>",
              "sealed": false, "seed": "<base64url, 32 bytes>"}

    sealed:  {"format": "hmpnode-keystore", "version": 1,
              "did": "did:hmp:agent:...", "public_key": "<base58btc>",
              "sealed": true,
              "kdf": {"name": "argon2id", "opslimit": <int>, "memlimit": <int bytes>,
                      "salt": "<base64url, 16 bytes>"},
              "cipher": "xsalsa20poly1305",
              "nonce": "<base64url, 24 bytes>",
              "ciphertext": "<base64url, 48 bytes = 32-byte seed + 16-byte tag>"}

The sealed form is libsodium's secretbox (XSalsa20-Poly1305) over the raw seed,
keyed with Argon2id(passphrase, salt, opslimit, memlimit). `did` and
`public_key` are kept in the clear so a node can tell which identity a file
holds without the passphrase; they are not covered by the secretbox tag, so
`load_keystore` re-derives them from the decrypted seed and rejects a file
whose stated values differ. Tampering with the KDF parameters, salt or nonce
changes the derived key or keystream and so fails the Poly1305 tag.

Permissions: files are created 0600 from the first byte (never widened, then
narrowed). `load_keystore` does not refuse a file because of its mode — the
caller decides policy — but `keystore_permissions_ok` reports whether the mode
grants anything to group or others. The daemon's policy (refuse symlinks, other
owners, group/other write) lives in `hmpnode.fsutil.read_secret`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import nacl.exceptions
import nacl.pwhash.argon2id as argon2id
import nacl.secret
import nacl.utils

from hmpnode.container.encoding import EncodingError, b64url_decode, b64url_encode
from hmpnode.fsutil import write_private_file
from hmpnode.identity.keys import Identity

__all__ = [
    "KEYSTORE_FORMAT",
    "KEYSTORE_VERSION",
    "KDF_MAX_MEMLIMIT",
    "KDF_MAX_OPSLIMIT",
    "KeystoreError",
    "save_keystore",
    "load_keystore",
    "loads_keystore",
    "keystore_permissions_ok",
    "read_passphrase_file",
    "passphrase_from_bytes",
]

KEYSTORE_FORMAT = "hmpnode-keystore"
KEYSTORE_VERSION = 1
KDF_NAME = "argon2id"
CIPHER_NAME = "xsalsa20poly1305"

SEED_BYTES = 32
SALT_BYTES = argon2id.SALTBYTES  # 16
NONCE_BYTES = nacl.secret.SecretBox.NONCE_SIZE  # 24
KEY_BYTES = nacl.secret.SecretBox.KEY_SIZE  # 32
CIPHERTEXT_BYTES = SEED_BYTES + nacl.secret.SecretBox.MACBYTES  # 48

# Ceilings on KDF parameters read from a file. libsodium accepts memlimit up to
# 4 TiB and opslimit up to 2**32-1; a tampered (or hostile) file could ask for
# either and make load_keystore exhaust memory or spin for hours, so values
# above these are rejected before any allocation. libsodium's own "sensitive"
# preset is 4 passes / 1 GiB, well inside both.
KDF_MAX_MEMLIMIT = 4 * 1024**3
KDF_MAX_OPSLIMIT = 256

# A keystore is a few hundred bytes; refuse to slurp anything much bigger.
_MAX_FILE_BYTES = 64 * 1024

_PLAIN_FIELDS = ("format", "version", "did", "public_key", "sealed", "seed")
_SEALED_FIELDS = (
    "format", "version", "did", "public_key", "sealed", "kdf", "cipher", "nonce", "ciphertext",
)
_KDF_FIELDS = ("name", "opslimit", "memlimit", "salt")

_MSG_NEED_PASSPHRASE = "keystore is sealed; a passphrase is required"
_MSG_BAD_PASSPHRASE = "wrong passphrase or corrupted keystore"
_MSG_MISMATCH = "keystore did/public_key do not match its key"


class KeystoreError(ValueError):
    """A keystore file cannot be read, parsed, unsealed or trusted.

    Every failure of `load_keystore` caused by the file's content (or absence)
    is reported as this one type with a human-readable message, so a CLI can
    print it as-is."""


# ---------------------------------------------------------------------------
# saving


def save_keystore(
    path: str | os.PathLike[str],
    identity: Identity,
    *,
    passphrase: bytes | None = None,
    rng: Callable[[int], bytes] | None = None,
    opslimit: int = argon2id.OPSLIMIT_INTERACTIVE,
    memlimit: int = argon2id.MEMLIMIT_INTERACTIVE,
    overwrite: bool = False,
) -> None:
    """Write `identity` to `path` as a keystore file, sealed if `passphrase` is given.

    `rng(n) -> bytes` supplies the salt and nonce (default: nacl.utils.random),
    so output is byte-for-byte reproducible under a fixed rng. `opslimit` and
    `memlimit` are the Argon2id cost; the defaults are libsodium's
    "interactive" preset, tests may pass OPSLIMIT_MIN/MEMLIMIT_MIN.

    The file is written to a fresh 0600 temp file in the same directory,
    fsynced, and moved into place atomically; the directory is then fsynced.
    An existing `path` raises FileExistsError unless `overwrite=True` (without
    it, the final step is a hard link, which cannot clobber a file that
    appeared meanwhile).
    """
    path = os.fspath(path)
    if not overwrite and os.path.lexists(path):
        # Early check so the caller is not made to wait for Argon2id first.
        raise FileExistsError(f"keystore already exists: {path} (pass overwrite=True to replace it)")
    document = _build_document(identity, passphrase, rng, opslimit, memlimit)
    data = (json.dumps(document, indent=2) + "\n").encode("utf-8")
    try:
        write_private_file(path, data, replace=overwrite)
    except FileExistsError:
        raise FileExistsError(f"keystore already exists: {path} (pass overwrite=True to replace it)") from None


def _build_document(
    identity: Identity,
    passphrase: bytes | None,
    rng: Callable[[int], bytes] | None,
    opslimit: int,
    memlimit: int,
) -> dict[str, Any]:
    document: dict[str, Any] = {
        "format": KEYSTORE_FORMAT,
        "version": KEYSTORE_VERSION,
        "did": identity.did,
        "public_key": identity.public_key_b58,
    }
    if passphrase is None:
        document["sealed"] = False
        document["seed"] = b64url_encode(identity.seed)
        return document

    passphrase = _passphrase_bytes(passphrase)
    if not passphrase:
        raise ValueError("an empty passphrase does not seal anything; pass passphrase=None for a plain keystore")
    problem = _kdf_limits_problem(opslimit, memlimit)
    if problem:
        raise ValueError(problem)
    rng = rng or nacl.utils.random
    salt = _rng_bytes(rng, SALT_BYTES, "salt")
    nonce = _rng_bytes(rng, NONCE_BYTES, "nonce")
    key = argon2id.kdf(KEY_BYTES, passphrase, salt, opslimit=opslimit, memlimit=memlimit)
    # encrypt() returns nonce || ciphertext; the nonce is stored separately.
    ciphertext = nacl.secret.SecretBox(key).encrypt(identity.seed, nonce).ciphertext
    document["sealed"] = True
    document["kdf"] = {
        "name": KDF_NAME,
        "opslimit": opslimit,
        "memlimit": memlimit,
        "salt": b64url_encode(salt),
    }
    document["cipher"] = CIPHER_NAME
    document["nonce"] = b64url_encode(nonce)
    document["ciphertext"] = b64url_encode(ciphertext)
    return document


def _rng_bytes(rng: Callable[[int], bytes], n: int, what: str) -> bytes:
    value = rng(n)
    if not isinstance(value, (bytes, bytearray)) or len(value) != n:
        raise ValueError(f"rng must return {n} bytes for the {what}")
    return bytes(value)


def _passphrase_bytes(passphrase: object) -> bytes:
    # A str is rejected rather than guessed at: the encoding is part of the
    # secret, and silently picking one would make a file unopenable elsewhere.
    if isinstance(passphrase, (bytes, bytearray, memoryview)):
        return bytes(passphrase)
    raise TypeError("passphrase must be bytes (encode a text passphrase, e.g. as UTF-8)")


# ---------------------------------------------------------------------------
# loading


def load_keystore(path: str | os.PathLike[str], *, passphrase: bytes | None = None) -> Identity:
    """Read a keystore file and return its Identity.

    Raises KeystoreError for every problem with the file: missing/unreadable,
    not JSON, wrong format or version, missing or mistyped fields, bad
    base64url, sealed without a passphrase, wrong passphrase or tampering,
    a seed that is not 32 bytes, did/public_key not matching the seed, and
    KDF parameters outside libsodium's range or above KDF_MAX_MEMLIMIT /
    KDF_MAX_OPSLIMIT (checked before any memory is allocated).

    A passphrase given for a plain keystore is ignored. File permissions are
    not checked here; see `keystore_permissions_ok`. The daemon reads its own
    keystore with `hmpnode.fsutil.read_secret` (no symlinks, owner and mode
    checked on the open file) and hands the bytes to `loads_keystore`.
    """
    return _identity_from(_read_document(os.fspath(path)), passphrase)


def loads_keystore(raw: bytes, *, passphrase: bytes | None = None) -> Identity:
    """`load_keystore` for the bytes of a keystore file already read by the caller."""
    if len(raw) > _MAX_FILE_BYTES:
        raise KeystoreError(f"keystore file is too large (over {_MAX_FILE_BYTES} bytes)")
    return _identity_from(_parse_document(raw), passphrase)


def _identity_from(document: dict[str, Any], passphrase: bytes | None) -> Identity:
    _require_fields(document, ("format", "version", "sealed"))
    if document["format"] != KEYSTORE_FORMAT:
        raise KeystoreError(f"not an hmpnode keystore (format is {document['format']!r:.60})")
    version = document["version"]
    if type(version) is not int or version != KEYSTORE_VERSION:
        raise KeystoreError(f"unsupported keystore version {version!r:.40} (expected {KEYSTORE_VERSION})")
    sealed = document["sealed"]
    if not isinstance(sealed, bool):
        raise KeystoreError("keystore field 'sealed' must be true or false")

    if sealed:
        _require_fields(document, _SEALED_FIELDS)
        seed = _unseal(document, passphrase)
    else:
        _require_fields(document, _PLAIN_FIELDS)
        seed = _decode_b64(document, "seed")
    if len(seed) != SEED_BYTES:
        raise KeystoreError(f"keystore seed must be {SEED_BYTES} bytes, not {len(seed)}")

    identity = Identity(seed)
    if document["did"] != identity.did or document["public_key"] != identity.public_key_b58:
        raise KeystoreError(_MSG_MISMATCH)
    return identity


MAX_PASSPHRASE_FILE = 64 * 1024


def read_passphrase_file(path: str | os.PathLike[str]) -> bytes:
    """The passphrase in a file (one line; the final newline is not part of it).
    KeystoreError when it cannot be read, is empty or is over 64 KiB."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_PASSPHRASE_FILE + 1)
    except OSError as exc:
        raise KeystoreError(f"passphrase file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_PASSPHRASE_FILE:
        raise KeystoreError(f"passphrase file {path} is larger than {MAX_PASSPHRASE_FILE} bytes")
    return passphrase_from_bytes(data, path)


def passphrase_from_bytes(data: bytes, path: str | os.PathLike[str]) -> bytes:
    """The passphrase in the bytes of a passphrase file (`path` only names it in errors)."""
    passphrase = data.rstrip(b"\r\n")
    if not passphrase:
        raise KeystoreError(f"passphrase file {path} is empty")
    return passphrase


def keystore_permissions_ok(path: str | os.PathLike[str]) -> bool:
    """True when the keystore grants no access at all to group or others.

    Kept separate from `load_keystore` so the caller chooses the policy (warn,
    refuse, or fix with chmod). Always True on Windows, where POSIX mode bits
    do not describe access. Raises OSError if the file cannot be stat'ed.
    """
    if os.name == "nt":
        return True
    return os.stat(path).st_mode & 0o077 == 0


def _read_document(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise KeystoreError(f"keystore file not found: {path}") from None
    except OSError as exc:
        raise KeystoreError(f"cannot read keystore {path}: {exc.strerror or exc}") from None
    if len(raw) > _MAX_FILE_BYTES:
        raise KeystoreError(f"keystore file is too large (over {_MAX_FILE_BYTES} bytes)")
    return _parse_document(raw)


def _parse_document(raw: bytes) -> dict[str, Any]:
    try:
        document = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise KeystoreError(f"keystore is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise KeystoreError("keystore is not a JSON object")
    return document


def _require_fields(obj: dict[str, Any], fields: tuple[str, ...], where: str = "keystore") -> None:
    missing = [name for name in fields if name not in obj]
    if missing:
        raise KeystoreError(f"{where} is missing field(s): {', '.join(missing)}")


def _decode_b64(obj: dict[str, Any], name: str, where: str = "keystore") -> bytes:
    try:
        return b64url_decode(obj[name])
    except EncodingError as exc:
        raise KeystoreError(f"{where} field {name!r} is not valid base64url ({exc})") from None


def _kdf_limits_problem(opslimit: object, memlimit: object) -> str | None:
    """Why these Argon2id limits are unacceptable, or None if they are fine."""
    if type(opslimit) is not int or type(memlimit) is not int:
        return "kdf opslimit and memlimit must be integers"
    ops_max = min(argon2id.OPSLIMIT_MAX, KDF_MAX_OPSLIMIT)
    if not argon2id.OPSLIMIT_MIN <= opslimit <= ops_max:
        return f"kdf opslimit {opslimit} is outside the allowed range {argon2id.OPSLIMIT_MIN}..{ops_max}"
    mem_max = min(argon2id.MEMLIMIT_MAX, KDF_MAX_MEMLIMIT)
    if not argon2id.MEMLIMIT_MIN <= memlimit <= mem_max:
        return f"kdf memlimit {memlimit} is outside the allowed range {argon2id.MEMLIMIT_MIN}..{mem_max}"
    if memlimit % 1024:
        # libsodium uses memlimit // 1024 (KiB); requiring whole KiB keeps the
        # stored value exactly the one in effect, so it cannot be edited
        # without changing the derived key.
        return f"kdf memlimit {memlimit} must be a multiple of 1024"
    return None


def _unseal(document: dict[str, Any], passphrase: bytes | None) -> bytes:
    kdf = document["kdf"]
    if not isinstance(kdf, dict):
        raise KeystoreError("keystore field 'kdf' must be an object")
    _require_fields(kdf, _KDF_FIELDS, "keystore kdf")
    if kdf["name"] != KDF_NAME:
        raise KeystoreError(f"unsupported keystore kdf {kdf['name']!r:.40} (expected {KDF_NAME!r})")
    if document["cipher"] != CIPHER_NAME:
        raise KeystoreError(f"unsupported keystore cipher {document['cipher']!r:.40} (expected {CIPHER_NAME!r})")
    problem = _kdf_limits_problem(kdf["opslimit"], kdf["memlimit"])
    if problem:
        raise KeystoreError(problem)
    salt = _decode_b64(kdf, "salt", "keystore kdf")
    nonce = _decode_b64(document, "nonce")
    ciphertext = _decode_b64(document, "ciphertext")
    if len(salt) != SALT_BYTES:
        raise KeystoreError(f"keystore kdf salt must be {SALT_BYTES} bytes, not {len(salt)}")
    if len(nonce) != NONCE_BYTES:
        raise KeystoreError(f"keystore nonce must be {NONCE_BYTES} bytes, not {len(nonce)}")
    if len(ciphertext) != CIPHERTEXT_BYTES:
        # A sealed 32-byte seed plus its 16-byte tag; anything else is damage.
        raise KeystoreError(
            f"keystore ciphertext must be {CIPHERTEXT_BYTES} bytes, not {len(ciphertext)}"
        )

    if passphrase is None:
        raise KeystoreError(_MSG_NEED_PASSPHRASE)
    passphrase = _passphrase_bytes(passphrase)
    try:
        key = argon2id.kdf(
            KEY_BYTES, passphrase, salt, opslimit=kdf["opslimit"], memlimit=kdf["memlimit"]
        )
    except MemoryError:
        raise KeystoreError(
            f"not enough memory for the keystore kdf (memlimit {kdf['memlimit']} bytes)"
        ) from None
    except (nacl.exceptions.CryptoError, ValueError, TypeError) as exc:
        raise KeystoreError(f"keystore key derivation failed: {exc}") from None
    try:
        return nacl.secret.SecretBox(key).decrypt(ciphertext, nonce)
    except (nacl.exceptions.CryptoError, TypeError):  # bad tag (TypeError: too short)
        raise KeystoreError(_MSG_BAD_PASSPHRASE) from None
