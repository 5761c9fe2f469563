"""The offline CLI, run as a real process: outputs, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hmpnode.container.encoding import b64url_decode, b64url_encode


def hmp(*args, stdin: bytes | None = None, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "hmpnode", *args], input=stdin, capture_output=True, cwd=cwd, timeout=60)
    assert b"Traceback" not in proc.stderr, proc.stderr.decode()
    return proc


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("alice", "bob", "carol", "dave"):
        proc = hmp("keygen", "--out", str(d / f"{name}.json"))
        assert proc.returncode == 0, proc.stderr
        info = json.loads(proc.stdout)
        assert info["did"].startswith("did:hmp:agent:") and info["public_key"]
        out[name] = {**info, "path": str(d / f"{name}.json")}
    return out


def test_keystore_mode_and_no_overwrite(keys):
    assert os.stat(keys["alice"]["path"]).st_mode & 0o777 == 0o600
    proc = hmp("keygen", "--out", keys["alice"]["path"])
    assert proc.returncode == 2 and b"exists" in proc.stderr and proc.stderr.count(b"\n") == 1


def test_sealed_keystore(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("correct horse\n")
    assert hmp("keygen", "--out", str(tmp_path / "k.json"), "--passphrase-file", str(pw)).returncode == 0
    proc = hmp("container", "build", "--key", str(tmp_path / "k.json"), "--class", "note")
    assert proc.returncode == 2 and b"passphrase" in proc.stderr
    (tmp_path / "bad").write_text("wrong")
    proc = hmp("container", "build", "--key", str(tmp_path / "k.json"), "--passphrase-file", str(tmp_path / "bad"), "--class", "note")
    assert proc.returncode == 2 and b"wrong passphrase" in proc.stderr
    proc = hmp("container", "build", "--key", str(tmp_path / "k.json"), "--passphrase-file", str(pw), "--class", "note")
    assert proc.returncode == 0, proc.stderr


def _build(keys, *extra, payload=b'{"text": "hello mesh"}'):
    proc = hmp("container", "build", "--key", keys["alice"]["path"], "--class", "note", "--payload", "-", *extra, stdin=payload)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_build_verify_inspect(keys, tmp_path):
    wire = _build(keys, "--tag", "demo", "--ttl", "1h", "--related", "in_reply_to=did:hmp:container:abc",
                  "--network", "localhost", "--broadcast", "--compress", "gzip")
    head = json.loads(wire)["hmp_container"]["head"]
    assert head["tags"] == ["demo"] and head["network"] == "localhost" and head["broadcast"] is True
    proc = hmp("container", "verify", "-", stdin=wire)
    verdict = json.loads(proc.stdout)
    assert proc.returncode == 0 and verdict["ok"] and verdict["container_did"] == head["container_did"]
    f = tmp_path / "c.json"
    f.write_bytes(wire)
    proc = hmp("container", "inspect", str(f))
    assert proc.returncode == 0
    text = proc.stdout.decode()
    assert "class      note" in text and "link       in_reply_to -> did:hmp:container:abc" in text and "valid      yes" in text


def test_inspect_counts_backlinks_in_every_link_form(keys, tmp_path):
    """The grouped and compact forms of spec 12.3 are read (the count was the number of
    array entries, and a compact map showed no line at all)."""
    full = json.loads(_build(keys))
    f = tmp_path / "c.json"
    for links, shown in (({"see_also": ["did:a:1", "did:a:2"], "depends_on": ["did:a:3"]}, "backlinks  3 "),
                         ([{"type": "see_also", "target": ["did:a:1", "did:a:2"]}], "backlinks  2 "),
                         ("nonsense", "backlinks  unreadable ")):
        full["referenced-by"] = {"links": links, "peer_did": "did:a:peer"}
        f.write_text(json.dumps(full))
        proc = hmp("container", "inspect", str(f))
        assert proc.returncode == 0 and shown in proc.stdout.decode(), proc.stdout


@pytest.mark.parametrize("n", [1, 3])
def test_encrypted_for_recipients_only(keys, tmp_path, n):
    recipients = ["bob", "carol", "dave"][:n]
    args = [a for r in recipients for a in ("--to", keys[r]["public_key"])]
    wire = _build(keys, *args, "--compress", "zstd")
    f = tmp_path / "enc.json"
    f.write_bytes(wire)
    assert hmp("container", "verify", str(f)).returncode == 0
    for name in ("alice", "bob", "carol", "dave"):
        proc = hmp("container", "decrypt", "--key", keys[name]["path"], str(f))
        if name in recipients:
            assert proc.returncode == 0 and json.loads(proc.stdout) == {"text": "hello mesh"}
        else:
            assert proc.returncode == 1 and b"not_recipient" in proc.stderr


def test_every_signed_byte_is_protected(keys):
    wire = _build(keys, "--tag", "x")
    doc = json.loads(wire)
    head = doc["hmp_container"]["head"]
    cases = {
        "payload_hash_mismatch": lambda d: d["hmp_container"]["payload"].update(text="hello mesH"),
        "container_did_mismatch": lambda d: d["hmp_container"]["head"].update(tags=["y"]),
        "bad_signature": lambda d: d["hmp_container"]["head"].update(
            signature=b64url_encode(bytes([b64url_decode(head["signature"])[0] ^ 1]) + b64url_decode(head["signature"])[1:])),
        # a swapped key changes the content hash first; key_mismatch proper is in the vectors
        "container_did_mismatch ": lambda d: d["hmp_container"]["head"].update(public_key=keys["bob"]["public_key"]),
        "schema": lambda d: d["hmp_container"]["head"].pop("sig_algo"),
        "future_timestamp": lambda d: d["hmp_container"]["head"].update(timestamp="2999-01-01T00:00:00Z"),
    }
    for reason, mutate in cases.items():
        d = json.loads(wire)
        mutate(d)
        proc = hmp("container", "verify", "-", stdin=json.dumps(d).encode())
        assert proc.returncode == 1 and json.loads(proc.stdout)["reason"] == reason.strip(), (reason, proc.stdout)


@pytest.mark.parametrize(
    "args, code",
    [
        (["container", "verify", "/nonexistent"], 2),
        (["container", "build", "--key", "/nonexistent", "--class", "note"], 2),
        (["container", "frobnicate"], 2),
        (["container", "build", "--class", "note"], 2),
        (["bogus"], 2),
    ],
)
def test_usage_errors_are_one_line(args, code):
    proc = hmp(*args)
    assert proc.returncode == code and proc.stderr.startswith(b"hmpnode: ") and proc.stderr.count(b"\n") == 1


def test_bad_inputs_to_build(keys):
    base = ["container", "build", "--key", keys["alice"]["path"], "--class", "note"]
    for extra, stdin in [
        (["--payload", "-"], b"not json"),
        (["--payload", "-"], b"[1,2]"),
        (["--to", "not-base58-0OIl"], None),
        (["--related", "nodid"], None),
        (["--ttl", "tomorrow"], None),
        (["--network", "wan"], None),
        (["--confidence", "2"], None),
    ]:
        proc = hmp(*base, *extra, stdin=stdin)
        assert proc.returncode in (1, 2) and proc.stderr.count(b"\n") == 1, (extra, proc.stderr)


def test_verify_garbage(tmp_path):
    for data in (b"", b"\xff\xfe", b"[]", b'{"a":1}', b"{" * 100000):
        proc = hmp("container", "verify", "-", stdin=data)
        assert proc.returncode == 1 and json.loads(proc.stdout)["ok"] is False


@pytest.mark.parametrize("ttl", ["99999999999999d", "0m", "1000000w", "soon"])
def test_ttl_out_of_range_is_a_clear_error(keys, ttl):
    proc = hmp("container", "build", "--key", keys["alice"]["path"], "--class", "note", "--ttl", ttl)
    assert proc.returncode == 2 and proc.stderr.startswith(b"hmpnode: --ttl ") and proc.stderr.count(b"\n") == 1
