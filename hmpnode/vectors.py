"""Interoperability test vectors, generated from fixed keys, fixed randomness and
fixed times. `python -m hmpnode.vectors --out tests/vectors` (scripts/gen_vectors)
writes them; tests/test_vectors.py regenerates them in memory and requires the
committed files to match byte for byte. docs/protocol.md explains the format.

Randomness: `DeterministicRng(label)` returns the stream
SHA-256(label || 0u64be) || SHA-256(label || 1u64be) || ... ; the encryption code
draws, in order, K (32 bytes), the payload nonce (12), then one ephemeral X25519
secret (32) per recipient. Each vector also lists those values explicitly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import nacl.bindings as sodium
import orjson

from hmpnode.container import reasons as R
from hmpnode.container.backlinks import build_referenced_by
from hmpnode.container.build import Recipient, build_container
from hmpnode.container.canonical import canonical_json
from hmpnode.container.did import container_did_for
from hmpnode.container.encoding import b64url_decode, b64url_encode, format_time
from hmpnode.container.evaluations import build_evaluation, signed_string
from hmpnode.container.payload import open_payload
from hmpnode.container.schema import SchemaSet, default_schemas
from hmpnode.container.verify import encode_wire
from hmpnode.identity.keys import Identity, agent_did_for_key

__all__ = ["DeterministicRng", "generate", "write", "resign", "NOW"]

NOW = datetime(2026, 11, 29, 10, 15, 0, tzinfo=timezone.utc)
SEEDS = {"alice": bytes(range(32)), "bob": bytes(range(32, 64)), "carol": bytes(range(64, 96)), "dave": bytes(range(96, 128))}


class DeterministicRng:
    """A reproducible byte stream that also records what it handed out."""

    def __init__(self, label: str):
        self.label = label.encode()
        self._buffer = b""
        self._counter = 0
        self.draws: list[bytes] = []

    def __call__(self, n: int) -> bytes:
        while len(self._buffer) < n:
            self._buffer += hashlib.sha256(self.label + self._counter.to_bytes(8, "big")).digest()
            self._counter += 1
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        self.draws.append(out)
        return out


def _identities() -> dict[str, Identity]:
    return {name: Identity(seed) for name, seed in SEEDS.items()}


def _keys_doc(ids: dict[str, Identity]) -> dict[str, Any]:
    return {
        name: {
            "seed_hex": ident.seed.hex(),
            "public_key": ident.public_key_b58,
            "public_key_hex": ident.public_key.hex(),
            "x25519_public_hex": sodium.crypto_scalarmult_base(ident.x25519_secret).hex(),
            "did": ident.did,
        }
        for name, ident in ids.items()
    }


def _intermediates(container: dict[str, Any]) -> dict[str, Any]:
    """The byte strings an implementation computes on the way, for debugging a mismatch."""
    hmp = container["hmp_container"]
    head = hmp["head"]
    unsigned = dict(hmp, head={k: v for k, v in head.items() if k != "signature"})
    no_did = dict(hmp, head={k: v for k, v in unsigned["head"].items() if k != "container_did"})
    if head["payload_type"] == "json":
        hashed = canonical_json(hmp["payload"])
    else:
        hashed = b64url_decode(hmp["payload"])
    did_input = canonical_json(no_did)
    assert container_did_for(did_input) == head["container_did"]
    return {
        "payload_hash_input_hex": hashed.hex(),
        "container_did_input": did_input.decode(),
        "signing_input": canonical_json(unsigned).decode(),
    }


def _positive(ids: dict[str, Identity]) -> dict[str, dict[str, Any]]:
    alice, bob, carol, dave = ids["alice"], ids["bob"], ids["carol"], ids["dave"]
    text = {"title": "Map the mesh", "description": "Measure discovery latency on a LAN of 20 nodes. " * 8,
            "priority": 0.8, "expected_outcome": "A latency table per node."}
    out: dict[str, dict[str, Any]] = {}

    def add(name: str, description: str, build: Callable[[DeterministicRng], dict[str, Any]],
            decrypt_with: list[str] = (), payload: Any = None) -> dict[str, Any]:
        rng = DeterministicRng(f"hmpnode-vector-{name}")
        container = build(rng)
        vector: dict[str, Any] = {"description": description, "now": format_time(NOW)}
        vector["rng_label"] = rng.label.decode()
        if rng.draws:
            vector["rng_draws_hex"] = [d.hex() for d in rng.draws]
        vector["container"] = container
        vector["intermediates"] = _intermediates(container)
        if decrypt_with:
            vector["recipients"] = decrypt_with
            vector["plaintext_payload"] = payload
        vector["expect"] = {"ok": True, "container_did": container["hmp_container"]["head"]["container_did"]}
        out[name] = vector
        return container

    base = add("plain", "Plain JSON payload, every head field the builder sets by default.",
               lambda rng: build_container(alice, "goal", text, now=NOW, tags=["research", "mesh"]))
    add("zstd", "zstd-compressed payload (one frame, content size set, level 3).",
        lambda rng: build_container(alice, "goal", text, now=NOW, compression="zstd"))
    add("gzip", "gzip-compressed payload (mtime 0, OS byte 255, level 6).",
        lambda rng: build_container(alice, "goal", text, now=NOW, compression="gzip"))
    add("encrypted_one", "Encrypted for one recipient (recipient + key_recipient), zstd inside.",
        lambda rng: build_container(alice, "diary_entry", {"title": "private", "content": "for bob only"}, now=NOW, rng=rng,
                                    compression="zstd", encrypt_to=[Recipient(bob.did, bob.public_key)]),
        decrypt_with=["bob"], payload={"title": "private", "content": "for bob only"})
    add("encrypted_group", "Encrypted for a group of three (group_recipient), no compression.",
        lambda rng: build_container(alice, "diary_entry", {"title": "team", "content": "for bob, carol and dave"}, now=NOW, rng=rng,
                                    encrypt_to=[Recipient(i.did, i.public_key) for i in (bob, carol, dave)]),
        decrypt_with=["bob", "carol", "dave"], payload={"title": "team", "content": "for bob, carol and dave"})
    add("meta_related", "meta, related (string and array values), ttl, network, broadcast, confidence, subclass, custom head field.",
        lambda rng: build_container(
            bob, "goal", {"title": "Reply", "description": "Agreed; 0.84 looks right.", "priority": 0.5,
                        "expected_outcome": "Both measurements agree."},
            now=NOW, subclass="goal.research_hypothesis", ttl=NOW + timedelta(days=30), network="lan:192.168.0.0/24",
            broadcast=True, confidence=0.84, tags=["reply"],
            meta={"created_by": "AGENT", "sources": [{"type": "container", "id": base["hmp_container"]["head"]["container_did"], "credibility": 0.87, "weight": 0.6}]},
            related={"in_reply_to": [base["hmp_container"]["head"]["container_did"]], "previous_version": "did:hmp:container:legacy-17"},
            head_extra={"x_trace": {"hops": 0}}))
    return out


def resign(hmp: dict[str, Any], identity: Identity, *, keep_did: bool = False) -> dict[str, Any]:
    """Recompute container_did (unless keep_did) and the signature of an hmp_container
    after a deliberate change (negative vectors, tests); returns the same dict."""
    head = hmp["head"]
    if not keep_did:
        no_did = dict(hmp, head={k: v for k, v in head.items() if k not in ("signature", "container_did")})
        head["container_did"] = container_did_for(canonical_json(no_did))
    unsigned = dict(hmp, head={k: v for k, v in head.items() if k != "signature"})
    head["signature"] = b64url_encode(identity.sign(canonical_json(unsigned)))
    return hmp


def _negative(ids: dict[str, Identity], plain: dict[str, Any]) -> dict[str, dict[str, Any]]:
    alice, bob = ids["alice"], ids["bob"]
    good = plain["container"]

    def copy() -> dict[str, Any]:
        return json.loads(json.dumps(good["hmp_container"]))

    cases: dict[str, tuple[str, str | dict[str, Any], dict[str, Any]]] = {}
    wire = encode_wire(good).decode()
    cases[R.MALFORMED] = ("Duplicate key in the head (the JSON text is otherwise the plain vector).",
                          wire.replace('"class":"goal"', '"class":"goal","class":"goal"', 1), {})
    h = copy()
    del h["head"]["payload_hash"]
    cases[R.SCHEMA] = ("head.payload_hash missing.", {"hmp_container": h}, {})
    h = copy()
    h["head"]["timestamp"] = format_time(NOW + timedelta(hours=1))
    cases[R.FUTURE_TIMESTAMP] = ("Timestamp one hour ahead of `now` (default skew 300 s), correctly re-signed.",
                                 {"hmp_container": resign(h, alice)}, {})
    h = copy()
    h["payload"]["title"] = "Map the mess"
    cases[R.PAYLOAD_HASH_MISMATCH] = ("One payload character changed; nothing re-signed.", {"hmp_container": h}, {})
    h = copy()
    h["head"]["container_did"] = ids_other_did = container_did_for(b"another container")
    resign(h, alice, keep_did=True)
    cases[R.CONTAINER_DID_MISMATCH] = ("A content-addressed container_did that is not the container's hash; signed.",
                                       {"hmp_container": h}, {"container_did": ids_other_did})
    h = copy()
    h["head"]["public_key"] = bob.public_key_b58
    resign(h, alice)
    cases[R.KEY_MISMATCH] = ("Self-certifying sender_did with another agent's public_key (DID recomputed, signed).",
                             {"hmp_container": h}, {})
    h = copy()
    del h["head"]["public_key"]
    resign(h, alice)
    cases[R.UNKNOWN_KEY] = ("No public_key in the head and none pinned for sender_did.", {"hmp_container": h}, {})
    cases[R.REVOKED] = ("Valid container signed after its sender revoked the key.", good,
                        {"revocations": {alice.did: format_time(NOW - timedelta(days=1))}})
    h = copy()
    h["head"]["sig_algo"] = "rsa-pss-sha256"
    resign(h, alice)
    cases[R.UNSUPPORTED_SIG_ALGO] = ("sig_algo other than ed25519.", {"hmp_container": h}, {})
    h = copy()
    sig = bytearray(b64url_decode(h["head"]["signature"]))
    sig[0] ^= 1
    h["head"]["signature"] = b64url_encode(bytes(sig))
    cases[R.BAD_SIGNATURE] = ("First signature byte flipped.", {"hmp_container": h}, {})
    no_class_checks = SchemaSet(default_schemas().base_schema, {})  # let the builder make a bad one
    bad = build_container(alice, "peer_announce", {"name": "x", "addresses": "tcp://not-a-list"}, now=NOW,
                          schemas=no_class_checks)
    cases[R.CLASS_SCHEMA] = ("Known class (peer_announce) whose payload breaks its schema (addresses is not an array).", bad, {})

    out = {}
    for reason, (description, container, extra) in cases.items():
        vector: dict[str, Any] = {"description": description, "now": format_time(NOW), "expect": {"ok": False, "reason": reason}}
        if isinstance(container, str):
            vector["wire"] = container
        else:
            vector["container"] = container
        if "revocations" in extra:
            vector["registry"] = {"revocations": extra["revocations"]}
        out[reason] = vector
    return out


def _evaluation(ids: dict[str, Identity], target_did: str) -> dict[str, Any]:
    item = build_evaluation(ids["bob"], value=-0.4, type="oppose", target=target_did, now=NOW)
    return {
        "description": "An evaluation item by bob of the plain vector's container, with no justification container (target = the evaluated container).",
        "evaluated_container": target_did,
        "signed_string": signed_string(item).decode(),
        "item": item,
        "expect": {"ok": True},
    }


def _referenced_by(ids: dict[str, Identity], positive: dict[str, dict[str, Any]]) -> dict[str, Any]:
    target = positive["plain"]["container"]["hmp_container"]["head"]["container_did"]
    reply = positive["meta_related"]["container"]["hmp_container"]["head"]["container_did"]
    block = build_referenced_by([{"type": "in_reply_to", "target": reply}], ids["carol"])
    return {
        "description": "carol's referenced-by block for the plain vector's container: the meta_related vector replies to it.",
        "container": target,
        "links_canonical": canonical_json(block["links"]).decode(),
        "block": block,
        "expect": {"ok": True},
    }


def generate() -> dict[str, Any]:
    """Every vector file: relative path -> JSON value."""
    ids = _identities()
    positive = _positive(ids)
    files: dict[str, Any] = {"keys.json": _keys_doc(ids)}
    for name, vector in positive.items():
        files[f"containers/{name}.json"] = vector
    for reason, vector in _negative(ids, positive["plain"]).items():
        files[f"negative/{reason}.json"] = vector
    target = positive["plain"]["container"]["hmp_container"]["head"]["container_did"]
    files["evaluation.json"] = _evaluation(ids, target)
    files["referenced-by.json"] = _referenced_by(ids, positive)
    # Self-check: what we publish must open as we say.
    for name, vector in positive.items():
        for who in vector.get("recipients", ()):
            assert open_payload(vector["container"]["hmp_container"], ids[who]) == vector["plaintext_payload"], name
    assert all(agent_did_for_key(ident.public_key) == ident.did for ident in ids.values())
    return files


def render(value: Any) -> bytes:
    """Vector files are pretty-printed JSON (2 spaces, keys sorted, UTF-8, final newline)."""
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


def write(out: Path) -> list[Path]:
    written = []
    for rel, value in generate().items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(render(value))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/vectors"))
    args = parser.parse_args(argv)
    for path in write(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
