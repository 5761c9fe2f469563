"""tests/vectors/ is reproduced byte for byte, and every vector verifies as it says."""

from __future__ import annotations

import json

import pytest

from hmpnode import vectors
from hmpnode.container.backlinks import verify_referenced_by
from hmpnode.container.canonical import canonical_json
from hmpnode.container.encoding import parse_time
from hmpnode.container.evaluations import signed_string, verify_evaluation
from hmpnode.container.payload import PayloadError, open_payload
from hmpnode.container.verify import Verifier, encode_wire
from hmpnode.identity import Identity, MemoryKeyRegistry

from .conftest import REPO

VECTORS = REPO / "tests" / "vectors"
GENERATED = vectors.generate()
KEYS = {name: Identity(bytes.fromhex(k["seed_hex"])) for name, k in GENERATED["keys.json"].items()}


def _load(rel: str):
    return json.loads((VECTORS / rel).read_text(encoding="utf-8"))


def test_committed_files_are_exactly_the_generated_ones():
    # transport/: the peer transport's vectors, reproduced by tests/test_transport.py
    on_disk = sorted(str(p.relative_to(VECTORS)) for p in VECTORS.rglob("*.json")
                     if p.relative_to(VECTORS).parts[0] != "transport")
    assert on_disk == sorted(GENERATED)


@pytest.mark.parametrize("rel", sorted(GENERATED))
def test_vector_reproduced_byte_for_byte(rel):
    assert (VECTORS / rel).read_bytes() == vectors.render(GENERATED[rel])


POSITIVE = sorted(r for r in GENERATED if r.startswith("containers/"))
NEGATIVE = sorted(r for r in GENERATED if r.startswith("negative/"))


@pytest.mark.parametrize("rel", POSITIVE)
def test_positive_vectors_verify(rel):
    vector = _load(rel)
    now = parse_time(vector["now"])
    pretty = json.dumps(vector["container"], indent=1).encode()  # whitespace: the slow parse path
    for form in (vector["container"], pretty, encode_wire(vector["container"])):
        result = Verifier().verify(form, now=now)
        assert result.ok, (result.reason, result.detail)
        assert result.container_did == vector["expect"]["container_did"]


@pytest.mark.parametrize("rel", POSITIVE)
def test_intermediates(rel):
    vector = _load(rel)
    hmp = vector["container"]["hmp_container"]
    unsigned = dict(hmp, head={k: v for k, v in hmp["head"].items() if k != "signature"})
    assert canonical_json(unsigned).decode() == vector["intermediates"]["signing_input"]


@pytest.mark.parametrize("rel", [r for r in POSITIVE if "encrypted" in r])
def test_encrypted_vectors_open_for_recipients_only(rel):
    vector = _load(rel)
    hmp = vector["container"]["hmp_container"]
    for who in vector["recipients"]:
        assert open_payload(hmp, KEYS[who]) == vector["plaintext_payload"]
    for outsider in set(KEYS) - set(vector["recipients"]):
        with pytest.raises(PayloadError) as err:
            open_payload(hmp, KEYS[outsider])
        assert err.value.code == "not_recipient"


@pytest.mark.parametrize("rel", NEGATIVE)
def test_negative_vectors_fail_with_their_reason(rel):
    vector = _load(rel)
    registry = MemoryKeyRegistry()
    for did, when in vector.get("registry", {}).get("revocations", {}).items():
        registry.revoke(did, parse_time(when))
    raw = vector["wire"].encode() if "wire" in vector else vector["container"]
    result = Verifier(registry=registry).verify(raw, now=parse_time(vector["now"]))
    assert (result.ok, result.reason) == (False, vector["expect"]["reason"]), result.detail


def test_negative_vectors_cover_every_reason():
    from hmpnode.container import reasons

    assert {_load(r)["expect"]["reason"] for r in NEGATIVE} == set(reasons.ALL)


def test_evaluation_vector():
    vector = _load("evaluation.json")
    assert signed_string(vector["item"]).decode() == vector["signed_string"]
    check = verify_evaluation(vector["item"], vector["evaluated_container"])
    assert check.ok, check


def test_referenced_by_vector():
    vector = _load("referenced-by.json")
    assert canonical_json(vector["block"]["links"]).decode() == vector["links_canonical"]
    assert verify_referenced_by(vector["block"]).ok
