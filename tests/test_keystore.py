"""Keystore files: round trips, 0600 creation, overwrite refusal, determinism,
and every kind of damage surfacing as KeystoreError (never another type)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import nacl.pwhash.argon2id as argon2id
import pytest

from hmpnode.container.encoding import b64url_decode, b64url_encode
from hmpnode.identity import Identity, KeystoreError, load_keystore, save_keystore
from hmpnode.identity.keystore import keystore_permissions_ok

POSIX = os.name == "posix"
FAST = {"opslimit": argon2id.OPSLIMIT_MIN, "memlimit": argon2id.MEMLIMIT_MIN}
PASS = b"correct horse battery staple"


def counter_rng(start: int = 0):
    """Deterministic rng: successive bytes of a counter."""
    state = [start]

    def rng(n: int) -> bytes:
        out = bytes((state[0] + i) % 256 for i in range(n))
        state[0] += n
        return out

    return rng


@pytest.fixture
def ident() -> Identity:
    return Identity(bytes(range(32)))


@pytest.fixture
def plain_path(tmp_path: Path, ident: Identity) -> Path:
    path = tmp_path / "plain.json"
    save_keystore(path, ident)
    return path


@pytest.fixture
def sealed_path(tmp_path: Path, ident: Identity) -> Path:
    path = tmp_path / "sealed.json"
    save_keystore(path, ident, passphrase=PASS, rng=counter_rng(), **FAST)
    return path


def rewrite(path: Path, mutate) -> None:
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc))


def flip_b64(value: str, index: int = 0) -> str:
    raw = bytearray(b64url_decode(value))
    raw[index] ^= 0x01
    return b64url_encode(bytes(raw))


# --------------------------------------------------------------------- round trips


def test_plain_round_trip(plain_path: Path, ident: Identity):
    doc = json.loads(plain_path.read_text())
    assert doc == {
        "format": "hmpnode-keystore",
        "version": 1,
        "did": ident.did,
        "public_key": ident.public_key_b58,
        "sealed": False,
        "seed": b64url_encode(ident.seed),
    }
    loaded = load_keystore(plain_path)
    assert loaded.seed == ident.seed and loaded.did == ident.did


def test_plain_ignores_passphrase(plain_path: Path, ident: Identity):
    assert load_keystore(plain_path, passphrase=b"anything").did == ident.did


def test_sealed_round_trip(sealed_path: Path, ident: Identity):
    text = sealed_path.read_text()
    doc = json.loads(text)
    assert set(doc) == {
        "format", "version", "did", "public_key", "sealed", "kdf", "cipher", "nonce", "ciphertext",
    }
    assert doc["sealed"] is True and doc["cipher"] == "xsalsa20poly1305"
    assert doc["kdf"] == {
        "name": "argon2id",
        "opslimit": argon2id.OPSLIMIT_MIN,
        "memlimit": argon2id.MEMLIMIT_MIN,
        "salt": b64url_encode(bytes(range(16))),
    }
    assert len(b64url_decode(doc["nonce"])) == 24
    assert len(b64url_decode(doc["ciphertext"])) == 48
    assert b64url_encode(ident.seed) not in text
    loaded = load_keystore(sealed_path, passphrase=PASS)
    assert loaded.seed == ident.seed and loaded.did == ident.did


def test_sealed_accepts_bytes_like_passphrase(sealed_path: Path, ident: Identity):
    assert load_keystore(sealed_path, passphrase=bytearray(PASS)).did == ident.did


def test_sealed_default_limits_are_interactive(tmp_path: Path, ident: Identity, monkeypatch):
    seen = {}
    real_kdf = argon2id.kdf

    def spy(size, password, salt, opslimit, memlimit):
        seen.update(opslimit=opslimit, memlimit=memlimit)
        return real_kdf(size, password, salt, opslimit=argon2id.OPSLIMIT_MIN, memlimit=argon2id.MEMLIMIT_MIN)

    monkeypatch.setattr(argon2id, "kdf", spy)
    save_keystore(tmp_path / "k.json", ident, passphrase=PASS)
    assert seen == {"opslimit": argon2id.OPSLIMIT_INTERACTIVE, "memlimit": argon2id.MEMLIMIT_INTERACTIVE}


def test_exports():
    assert issubclass(KeystoreError, ValueError)
    import hmpnode.identity as pkg

    for name in ("save_keystore", "load_keystore", "KeystoreError"):
        assert name in pkg.__all__


# --------------------------------------------------------------------- determinism


def test_deterministic_with_fixed_rng(tmp_path: Path, ident: Identity):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    save_keystore(a, ident, passphrase=PASS, rng=counter_rng(7), **FAST)
    save_keystore(b, ident, passphrase=PASS, rng=counter_rng(7), **FAST)
    save_keystore(c, ident, passphrase=PASS, rng=counter_rng(8), **FAST)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_plain_is_deterministic(tmp_path: Path, ident: Identity):
    save_keystore(tmp_path / "a", ident)
    save_keystore(tmp_path / "b", ident)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


# --------------------------------------------------------------------- permissions


@pytest.mark.skipif(not POSIX, reason="POSIX modes")
@pytest.mark.parametrize("sealed", [False, True])
def test_file_mode_is_0600_even_with_open_umask(tmp_path: Path, ident: Identity, sealed: bool):
    path = tmp_path / "k.json"
    old = os.umask(0)
    try:
        save_keystore(path, ident, passphrase=PASS if sealed else None, **FAST)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert keystore_permissions_ok(path)


@pytest.mark.skipif(not POSIX, reason="POSIX modes")
def test_created_0600_exclusively_from_the_start(tmp_path: Path, ident: Identity, monkeypatch):
    """The file is born 0600 with O_CREAT|O_EXCL: there is no chmod-after window."""
    calls = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *args, **kwargs):
        if flags & os.O_CREAT:
            calls.append((os.fspath(path), flags, mode))
        return real_open(path, flags, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    save_keystore(tmp_path / "k.json", ident)
    assert len(calls) == 1
    created, flags, mode = calls[0]
    assert mode == 0o600
    assert flags & os.O_EXCL and flags & os.O_WRONLY
    assert os.path.dirname(created) == str(tmp_path)
    assert created != str(tmp_path / "k.json")  # temp file, then rename


@pytest.mark.skipif(not POSIX, reason="POSIX modes")
def test_overwrite_replaces_loose_mode(tmp_path: Path, ident: Identity):
    path = tmp_path / "k.json"
    path.write_text("{}")
    path.chmod(0o644)
    save_keystore(path, ident, overwrite=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.skipif(not POSIX, reason="POSIX modes")
@pytest.mark.parametrize("mode,ok", [(0o600, True), (0o400, True), (0o640, False), (0o644, False), (0o620, False), (0o602, False)])
def test_permissions_check(plain_path: Path, ident: Identity, mode: int, ok: bool):
    plain_path.chmod(mode)
    assert keystore_permissions_ok(plain_path) is ok
    # load never refuses on permissions; the caller decides.
    assert load_keystore(plain_path).did == ident.did


def test_no_temp_files_left(tmp_path: Path, ident: Identity):
    save_keystore(tmp_path / "k.json", ident)
    with pytest.raises(FileExistsError):
        save_keystore(tmp_path / "k.json", ident)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.json"]


# --------------------------------------------------------------------- overwrite


def test_refuses_to_overwrite(plain_path: Path, ident: Identity):
    before = plain_path.read_bytes()
    other = Identity(bytes(32))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_keystore(plain_path, other)
    assert plain_path.read_bytes() == before
    save_keystore(plain_path, other, overwrite=True)
    assert load_keystore(plain_path).did == other.did


def test_refuses_to_overwrite_file_appearing_during_save(tmp_path: Path, ident: Identity, monkeypatch):
    """The final step cannot clobber a file created after the early existence check."""
    path = tmp_path / "k.json"
    real_lexists = os.path.lexists

    def racing_lexists(p):
        if os.fspath(p) == str(path) and not real_lexists(p):
            path.write_text("someone else's")
            return False
        return real_lexists(p)

    monkeypatch.setattr(os.path, "lexists", racing_lexists)
    with pytest.raises(FileExistsError):
        save_keystore(path, ident)
    assert path.read_text() == "someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.json"]


# --------------------------------------------------------------------- save argument errors


@pytest.mark.parametrize(
    "kwargs,exc",
    [
        ({"passphrase": b""}, ValueError),
        ({"passphrase": "text"}, TypeError),
        ({"passphrase": PASS, "opslimit": 0, "memlimit": argon2id.MEMLIMIT_MIN}, ValueError),
        ({"passphrase": PASS, "opslimit": 1, "memlimit": 1024}, ValueError),
        ({"passphrase": PASS, "opslimit": 1, "memlimit": 2**33}, ValueError),
        ({"passphrase": PASS, "opslimit": 1, "memlimit": 8193}, ValueError),
        ({"passphrase": PASS, "rng": lambda n: b"x", **FAST}, ValueError),
    ],
)
def test_save_rejects_bad_arguments(tmp_path: Path, ident: Identity, kwargs, exc):
    with pytest.raises(exc):
        save_keystore(tmp_path / "k.json", ident, **kwargs)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------- passphrase errors


def test_wrong_passphrase(sealed_path: Path):
    with pytest.raises(KeystoreError, match="^wrong passphrase or corrupted keystore$"):
        load_keystore(sealed_path, passphrase=b"wrong")


def test_sealed_without_passphrase(sealed_path: Path):
    with pytest.raises(KeystoreError, match="^keystore is sealed; a passphrase is required$"):
        load_keystore(sealed_path)


# --------------------------------------------------------------------- corruption


def _set_kdf(key, value):
    def mutate(doc):
        doc["kdf"][key] = value
    return mutate


def _set(key, value):
    def mutate(doc):
        doc[key] = value
    return mutate


def _delete(key, inner=False):
    def mutate(doc):
        del (doc["kdf"] if inner else doc)[key]
    return mutate


SEALED_CORRUPTIONS = {
    "flip ciphertext byte": (lambda d: d.update(ciphertext=flip_b64(d["ciphertext"], 5)), "wrong passphrase or corrupted"),
    "flip tag byte": (lambda d: d.update(ciphertext=flip_b64(d["ciphertext"], 47)), "wrong passphrase or corrupted"),
    "flip nonce byte": (lambda d: d.update(nonce=flip_b64(d["nonce"])), "wrong passphrase or corrupted"),
    "flip salt byte": (lambda d: d["kdf"].update(salt=flip_b64(d["kdf"]["salt"])), "wrong passphrase or corrupted"),
    "other opslimit": (_set_kdf("opslimit", 2), "wrong passphrase or corrupted"),
    "other memlimit": (_set_kdf("memlimit", argon2id.MEMLIMIT_MIN + 1024), "wrong passphrase or corrupted"),
    "change did": (_set("did", "did:hmp:agent:1111111111111111111111111111"), "do not match its key"),
    "change public_key": (_set("public_key", "11111111111111111111111111111111"), "do not match its key"),
    "did wrong type": (_set("did", 5), "do not match its key"),
    "huge memlimit": (_set_kdf("memlimit", 2**40), "memlimit"),
    "memlimit just over 4 GiB": (_set_kdf("memlimit", 4 * 2**30 + 1024), "memlimit"),
    "memlimit too small": (_set_kdf("memlimit", 1024), "memlimit"),
    "memlimit not whole KiB": (_set_kdf("memlimit", argon2id.MEMLIMIT_MIN + 1), "memlimit"),
    "memlimit negative": (_set_kdf("memlimit", -1), "memlimit"),
    "memlimit float": (_set_kdf("memlimit", 8192.0), "integers"),
    "memlimit string": (_set_kdf("memlimit", "8192"), "integers"),
    "opslimit zero": (_set_kdf("opslimit", 0), "opslimit"),
    "opslimit huge": (_set_kdf("opslimit", 2**32 - 1), "opslimit"),
    "opslimit beyond libsodium": (_set_kdf("opslimit", 2**64), "opslimit"),
    "opslimit bool": (_set_kdf("opslimit", True), "integers"),
    "kdf not object": (_set("kdf", "argon2id"), "'kdf' must be an object"),
    "kdf name": (_set_kdf("name", "scrypt"), "unsupported keystore kdf"),
    "cipher": (_set("cipher", "aes-256-gcm"), "unsupported keystore cipher"),
    "salt short": (_set_kdf("salt", b64url_encode(b"s" * 8)), "salt must be 16 bytes"),
    "salt bad base64": (_set_kdf("salt", "!!!!"), "'salt' is not valid base64url"),
    "salt not string": (_set_kdf("salt", 12), "'salt' is not valid base64url"),
    "nonce short": (_set("nonce", b64url_encode(b"n" * 12)), "nonce must be 24 bytes"),
    "nonce bad base64": (_set("nonce", "a+b/"), "'nonce' is not valid base64url"),
    "ciphertext bad base64": (_set("ciphertext", "abc$"), "'ciphertext' is not valid base64url"),
    "ciphertext empty": (_set("ciphertext", ""), "ciphertext must be 48 bytes"),
    "ciphertext short": (_set("ciphertext", b64url_encode(b"c" * 10)), "ciphertext must be 48 bytes"),
    "ciphertext long": (_set("ciphertext", b64url_encode(b"c" * 80)), "ciphertext must be 48 bytes"),
    "wrong version": (_set("version", 2), "unsupported keystore version"),
    "version as string": (_set("version", "1"), "unsupported keystore version"),
    "version as bool": (_set("version", True), "unsupported keystore version"),
    "wrong format": (_set("format", "ethereum-keystore"), "not an hmpnode keystore"),
    "sealed not bool": (_set("sealed", "yes"), "'sealed' must be true or false"),
    "sealed flag cleared": (_set("sealed", False), "missing field(s): seed"),
    "missing nonce": (_delete("nonce"), "missing field(s): nonce"),
    "missing ciphertext": (_delete("ciphertext"), "missing field(s): ciphertext"),
    "missing did": (_delete("did"), "missing field(s): did"),
    "missing version": (_delete("version"), "missing field(s): version"),
    "missing kdf salt": (_delete("salt", inner=True), "keystore kdf is missing field(s): salt"),
}


@pytest.mark.parametrize("name", sorted(SEALED_CORRUPTIONS))
def test_sealed_corruption(sealed_path: Path, name: str):
    mutate, message = SEALED_CORRUPTIONS[name]
    rewrite(sealed_path, mutate)
    with pytest.raises(KeystoreError) as info:
        load_keystore(sealed_path, passphrase=PASS)
    assert message in str(info.value)


PLAIN_CORRUPTIONS = {
    "seed short": (_set("seed", b64url_encode(b"s" * 31)), "seed must be 32 bytes, not 31"),
    "seed long": (_set("seed", b64url_encode(b"s" * 33)), "seed must be 32 bytes, not 33"),
    "seed bad base64": (_set("seed", "====="), "'seed' is not valid base64url"),
    "seed non-canonical base64": (_set("seed", "AB"), "'seed' is not valid base64url"),
    "seed null": (_set("seed", None), "'seed' is not valid base64url"),
    "other seed": (_set("seed", b64url_encode(bytes(32))), "do not match its key"),
    "change did": (_set("did", "did:hmp:agent:x"), "do not match its key"),
    "sealed flag set": (_set("sealed", True), "missing field(s)"),
    "missing seed": (_delete("seed"), "missing field(s): seed"),
    "missing public_key": (_delete("public_key"), "missing field(s): public_key"),
}


@pytest.mark.parametrize("name", sorted(PLAIN_CORRUPTIONS))
def test_plain_corruption(plain_path: Path, name: str):
    mutate, message = PLAIN_CORRUPTIONS[name]
    rewrite(plain_path, mutate)
    with pytest.raises(KeystoreError) as info:
        load_keystore(plain_path)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "content,message",
    [
        (b"", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"not json at all", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[" * 20_000, "not valid JSON"),  # RecursionError in the parser
        (b"[]", "not a JSON object"),
        (b'"hmpnode-keystore"', "not a JSON object"),
        (b"null", "not a JSON object"),
        (b"{}", "missing field(s): format, version, sealed"),
        (b" " * (64 * 1024 + 1), "too large"),
    ],
)
def test_unparseable_files(tmp_path: Path, content: bytes, message: str):
    path = tmp_path / "k.json"
    path.write_bytes(content)
    with pytest.raises(KeystoreError) as info:
        load_keystore(path, passphrase=PASS)
    assert message in str(info.value)


def test_missing_file(tmp_path: Path):
    with pytest.raises(KeystoreError, match="keystore file not found"):
        load_keystore(tmp_path / "nope.json")


def test_directory_instead_of_file(tmp_path: Path):
    with pytest.raises(KeystoreError, match="cannot read keystore"):
        load_keystore(tmp_path)


def test_huge_memlimit_rejected_before_kdf(sealed_path: Path, monkeypatch):
    rewrite(sealed_path, _set_kdf("memlimit", 2**42))

    def boom(*args, **kwargs):
        raise AssertionError("kdf must not be attempted")

    monkeypatch.setattr(argon2id, "kdf", boom)
    with pytest.raises(KeystoreError, match="memlimit"):
        load_keystore(sealed_path, passphrase=PASS)


def test_kdf_memory_error_becomes_keystore_error(sealed_path: Path, monkeypatch):
    def oom(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(argon2id, "kdf", oom)
    with pytest.raises(KeystoreError, match="not enough memory"):
        load_keystore(sealed_path, passphrase=PASS)


@pytest.mark.parametrize("which", ["plain", "sealed"])
def test_every_truncation(request, which: str):
    path: Path = request.getfixturevalue(f"{which}_path")
    data = path.read_bytes()
    # The trailing newline is insignificant; every shorter prefix is damage.
    for length in range(len(data.rstrip())):
        path.write_bytes(data[:length])
        with pytest.raises(KeystoreError):
            load_keystore(path, passphrase=PASS)


@pytest.mark.parametrize("which", ["plain", "sealed"])
def test_every_single_byte_flip(request, ident: Identity, which: str):
    """Any one-bit change anywhere in the file yields KeystoreError, never
    another exception and never a successful load.

    Whitespace is the exception: bit 0 of a space (0x20 -> '!') or newline
    (0x0a -> 0x0b) breaks the JSON, so it is included too."""
    path: Path = request.getfixturevalue(f"{which}_path")
    data = path.read_bytes()
    for i in range(len(data) - 1):  # the final newline is insignificant
        damaged = bytearray(data)
        damaged[i] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.raises(KeystoreError):
            load_keystore(path, passphrase=PASS)
