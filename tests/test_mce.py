"""MCE messages and peer frames (hmpnode.net.mce): sans-IO, fixed identities and clock."""

from __future__ import annotations

import copy
from datetime import timedelta

import orjson
import pytest

from hmpnode.container.build import Recipient, build_container
from hmpnode.container.encoding import b64url_encode, sha256_tag
from hmpnode.container.schema import default_schemas
from hmpnode.container.verify import Verifier
from hmpnode.net.mce import (
    DID_KEYED,
    FRAME_TYPES,
    MCE_CLASSES,
    FrameError,
    Mce,
    SkewError,
    build_mce,
    check_mce,
    error_frame,
    frame,
    index_entry,
    parse_frame,
)
from hmpnode.vectors import DeterministicRng, resign

MAX_AGE = timedelta(minutes=10)
HASH = "sha256:" + "ab" * 32


def _reason(excinfo) -> str:
    return excinfo.value.reason


# -- parse_frame --------------------------------------------------------------------------


def test_frame_constants():
    assert FRAME_TYPES == {"mce", "containers", "error", "reconcile", "nat"}
    assert DID_KEYED <= MCE_CLASSES
    assert "note" not in MCE_CLASSES


def test_parse_valid_mce_frame():
    data = frame("mce", container={"hmp_container": {}})
    assert parse_frame(data, max_items=10) == {"type": "mce", "container": {"hmp_container": {}}}


def test_parse_accepts_str_and_bytes():
    text = '{"type": "containers", "items": [{}, {}]}'
    assert parse_frame(text, max_items=2)["items"] == [{}, {}]
    assert parse_frame(text.encode(), max_items=2)["items"] == [{}, {}]


def test_parse_valid_containers_frame_at_the_limit():
    message = parse_frame(frame("containers", items=[{"a": i} for i in range(5)]), max_items=5)
    assert message["type"] == "containers"
    assert len(message["items"]) == 5


def test_parse_valid_error_frame():
    message = parse_frame(error_frame("rate_limited", "slow down"), max_items=1)
    assert message == {"type": "error", "reason": "rate_limited", "detail": "slow down"}


def test_parse_error_frame_reason_of_64_chars_is_accepted():
    assert parse_frame(frame("error", reason="r" * 64), max_items=1)["reason"] == "r" * 64


def test_error_frame_truncates_detail():
    message = orjson.loads(error_frame("x", "d" * 2000))
    assert message["detail"] == "d" * 500


@pytest.mark.parametrize("data", [b"", b"not json", b"{", b"\xff\xfe", "{'type': 'mce'}"])
def test_parse_non_json(data):
    with pytest.raises(FrameError) as excinfo:
        parse_frame(data, max_items=10)
    assert _reason(excinfo) == "malformed_frame"
    assert excinfo.value.detail == "not a JSON text"


@pytest.mark.parametrize("data", [b"[]", b"[{\"type\": \"mce\"}]", b"1", b"\"mce\"", b"null", b"true"])
def test_parse_non_object(data):
    with pytest.raises(FrameError) as excinfo:
        parse_frame(data, max_items=10)
    assert _reason(excinfo) == "malformed_frame"


@pytest.mark.parametrize("message", [{}, {"type": "hello"}, {"type": "MCE", "container": {}},
                                     {"type": None}, {"type": 1}, {"kind": "mce", "container": {}}])
def test_parse_unknown_type(message):
    with pytest.raises(FrameError) as excinfo:
        parse_frame(orjson.dumps(message), max_items=10)
    assert _reason(excinfo) == "malformed_frame"
    assert "known type" in excinfo.value.detail


@pytest.mark.parametrize("type_", [["mce"], {"mce": 1}])
def test_parse_unhashable_type_is_a_frame_error(type_):
    with pytest.raises(FrameError) as excinfo:
        parse_frame(orjson.dumps({"type": type_, "container": {}}), max_items=10)
    assert _reason(excinfo) == "malformed_frame"


@pytest.mark.parametrize("message", [{"type": "mce"}, {"type": "mce", "container": None},
                                     {"type": "mce", "container": "{}"}, {"type": "mce", "container": []}])
def test_parse_mce_without_container_object(message):
    with pytest.raises(FrameError) as excinfo:
        parse_frame(orjson.dumps(message), max_items=10)
    assert _reason(excinfo) == "malformed_frame"
    assert "container" in excinfo.value.detail


@pytest.mark.parametrize("message", [
    {"type": "reconcile", "set": "global", "start": True, "msg": "AQAAAgA="},
    {"type": "reconcile", "set": "scoped", "msg": "AQ=="},
    {"type": "reconcile", "set": "global", "reply": "AQ==", "extra": 1},
    {"type": "reconcile", "set": "scoped", "want": "A" * 87384},
])
def test_parse_valid_reconcile_frames(message):
    assert parse_frame(orjson.dumps(message), max_items=10) == message


@pytest.mark.parametrize("message", [
    {"type": "reconcile", "msg": "AQ=="},  # no set
    {"type": "reconcile", "set": "other", "msg": "AQ=="},
    {"type": "reconcile", "set": ["global"], "msg": "AQ=="},
    {"type": "reconcile", "set": "global"},  # none of msg/reply/want
    {"type": "reconcile", "set": "global", "msg": "AQ==", "reply": "AQ=="},  # two
    {"type": "reconcile", "set": "global", "msg": 1},
    {"type": "reconcile", "set": "global", "want": "A" * 87385},  # over 1 024 ids / 64 KB in base64
    {"type": "reconcile", "set": "global", "start": 1, "msg": "AQ=="},
    {"type": "reconcile", "set": "global", "start": True, "reply": "AQ=="},
])
def test_parse_malformed_reconcile_frames(message):
    with pytest.raises(FrameError) as excinfo:
        parse_frame(orjson.dumps(message), max_items=10)
    assert _reason(excinfo) == "malformed_frame"


@pytest.mark.parametrize("message", [{"type": "containers"}, {"type": "containers", "items": []},
                                     {"type": "containers", "items": {}},
                                     {"type": "containers", "items": {"a": {}}},
                                     {"type": "containers", "items": "x"},
                                     {"type": "containers", "items": None}])
def test_parse_containers_empty_or_not_a_list(message):
    with pytest.raises(FrameError) as excinfo:
        parse_frame(orjson.dumps(message), max_items=10)
    assert _reason(excinfo) == "malformed_frame"
    assert "items" in excinfo.value.detail


def test_parse_too_many_items():
    with pytest.raises(FrameError) as excinfo:
        parse_frame(frame("containers", items=[{}] * 6), max_items=5)
    assert _reason(excinfo) == "too_many_items"
    assert "6" in excinfo.value.detail and "5" in excinfo.value.detail


@pytest.mark.parametrize("message", [{"type": "error"}, {"type": "error", "reason": None},
                                     {"type": "error", "reason": 42}, {"type": "error", "reason": ["x"]},
                                     {"type": "error", "reason": "r" * 65}])
def test_parse_error_frame_without_valid_reason(message):
    with pytest.raises(FrameError) as excinfo:
        parse_frame(orjson.dumps(message), max_items=10)
    assert _reason(excinfo) == "malformed_frame"
    assert "reason" in excinfo.value.detail


def test_frame_error_carries_reason_and_detail():
    err = FrameError("bad_mce", "why")
    assert (err.reason, err.detail, str(err)) == ("bad_mce", "why", "bad_mce: why")


# -- build_mce ----------------------------------------------------------------------------


def test_build_mce_refuses_non_mce_class(alice, bob, now):
    for class_ in ("note", "peer_announce", "goal", "container-index"):
        with pytest.raises(ValueError, match="not an MCE class"):
            build_mce(alice, class_, {}, peer_did=bob.did, now=now)


def test_build_mce_verifies_and_is_addressed_to_the_peer(alice, bob, now):
    message = build_mce(alice, "container_ack", {"acknowledged": []}, peer_did=bob.did, now=now)
    result = Verifier().verify(message, now=now)
    assert result.ok, result.detail
    assert not result.store_and_forward
    head = message["hmp_container"]["head"]
    assert head["recipient"] == [bob.did]
    assert head["sender_did"] == alice.did
    assert head["class"] == "container_ack"
    assert "broadcast" not in head
    assert head["payload_type"] == "json"
    assert message["hmp_container"]["payload"] == {"acknowledged": []}


def test_build_mce_checks_the_class_schema(alice, bob, now):
    with pytest.raises(ValueError, match="schema"):
        build_mce(alice, "container_ack", {"acknowledged": ["not-a-did"]}, peer_did=bob.did, now=now)


# -- check_mce ----------------------------------------------------------------------------


def _check(container, *, peer, own, now, max_age=MAX_AGE, verifier=None):
    return check_mce(verifier or Verifier(), container, peer_did=peer.did, own_did=own.did, now=now,
                     max_age=max_age)


def _refused(container, *, peer, own, now, max_age=MAX_AGE) -> FrameError:
    with pytest.raises(FrameError) as excinfo:
        _check(container, peer=peer, own=own, now=now, max_age=max_age)
    assert excinfo.value.reason == "bad_mce"
    return excinfo.value


def _entry(identity):
    return {"head": {"class": "note", "sender_did": identity.did, "public_key": identity.public_key_b58,
                     "sig_algo": "ed25519", "signature": "c2ln", "payload_hash": HASH}}


def test_check_mce_accepts_a_message_for_us(alice, bob, now):
    payload = {"acknowledged": ["did:hmp:container:x"]}
    message = build_mce(bob, "container_ack", payload, peer_did=alice.did, now=now)
    mce = _check(message, peer=bob, own=alice, now=now)
    assert isinstance(mce, Mce)
    assert mce.class_ == "container_ack"
    assert mce.payload == payload
    assert mce.did == message["hmp_container"]["head"]["container_did"]
    assert mce.timestamp == now


def test_check_mce_accepts_from_wire_bytes(alice, bob, now):
    message = build_mce(bob, "container_request", {"after": ""}, peer_did=alice.did, now=now)
    mce = _check(orjson.dumps(message), peer=bob, own=alice, now=now)
    assert mce.payload == {"after": ""}


@pytest.mark.parametrize("class_,payload", [
    ("container_index", {}),
    ("container_request", {"request_container": ["did:hmp:container:a"]}),
    ("container_response", {"available": []}),
    ("container_ack", {"acknowledged": []}),
    ("container_delta", {"since": "2026-11-29T10:00:00Z", "added": {}, "modified": {}, "removed": []}),
    ("referenced-by_exchange", {"did:hmp:container:a": {"links": []}}),
    ("evaluations_exchange", {"did:hmp:container:a": {"evaluations_hash": HASH, "items": []}}),
])
def test_check_mce_accepts_every_mce_class(alice, bob, now, class_, payload):
    message = build_mce(bob, class_, payload, peer_did=alice.did, now=now)
    assert _check(message, peer=bob, own=alice, now=now).class_ == class_


def test_check_mce_accepts_a_did_keyed_index(alice, bob, carol, now):
    payload = {"did:hmp:container:a": _entry(carol), "did:other:b": _entry(bob)}
    message = build_mce(bob, "container_index", payload, peer_did=alice.did, now=now)
    assert _check(message, peer=bob, own=alice, now=now).payload == payload


def test_check_mce_accepts_slightly_old_and_slightly_future(alice, bob, now):
    old = build_mce(bob, "container_ack", {"acknowledged": []}, peer_did=alice.did, now=now - MAX_AGE)
    assert _check(old, peer=bob, own=alice, now=now).timestamp == now - MAX_AGE  # at the edge: kept
    ahead = build_mce(bob, "container_ack", {"acknowledged": []}, peer_did=alice.did,
                      now=now + timedelta(seconds=60))
    assert _check(ahead, peer=bob, own=alice, now=now).class_ == "container_ack"


def test_check_mce_refuses_tampered_payload(alice, bob, now):
    message = build_mce(bob, "container_ack", {"acknowledged": ["did:hmp:container:a"]}, peer_did=alice.did,
                        now=now)
    tampered = copy.deepcopy(message)
    tampered["hmp_container"]["payload"]["acknowledged"] = ["did:hmp:container:b"]
    err = _refused(tampered, peer=bob, own=alice, now=now)
    assert "payload_hash" in err.detail


def test_check_mce_refuses_tampered_head(alice, bob, now):
    message = build_mce(bob, "container_ack", {"acknowledged": []}, peer_did=alice.did, now=now)
    tampered = copy.deepcopy(message)
    tampered["hmp_container"]["head"]["class_version"] = "2.0"
    _refused(tampered, peer=bob, own=alice, now=now)


def test_check_mce_refuses_garbage(alice, bob, now):
    _refused({"hmp_container": {}}, peer=bob, own=alice, now=now)
    _refused(b"not json", peer=bob, own=alice, now=now)


def test_check_mce_refuses_another_sender_than_the_session_peer(alice, bob, carol, now):
    # carol signs a perfectly valid message for alice, but the connection is with bob
    message = build_mce(carol, "container_ack", {"acknowledged": []}, peer_did=alice.did, now=now)
    err = _refused(message, peer=bob, own=alice, now=now)
    assert "sender_did" in err.detail
    # from carol's own connection it is fine
    assert _check(message, peer=carol, own=alice, now=now).class_ == "container_ack"


def test_check_mce_refuses_cross_peer_replay(alice, bob, carol, now):
    # bob made this for carol; carol (or anybody) replays it to alice over bob's identity
    message = build_mce(bob, "container_ack", {"acknowledged": []}, peer_did=carol.did, now=now)
    err = _refused(message, peer=bob, own=alice, now=now)
    assert "recipient" in err.detail
    assert _check(message, peer=bob, own=carol, now=now).class_ == "container_ack"


def test_check_mce_refuses_several_recipients(alice, bob, carol, now):
    message = build_container(bob, "container_ack", {"acknowledged": []}, now=now,
                              recipients=[alice.did, carol.did])
    err = _refused(message, peer=bob, own=alice, now=now)
    assert "recipient" in err.detail


def test_check_mce_refuses_an_unaddressed_message(alice, bob, now):
    message = build_container(bob, "container_ack", {"acknowledged": []}, now=now)
    err = _refused(message, peer=bob, own=alice, now=now)
    assert "recipient" in err.detail


def test_check_mce_refuses_non_mce_class(alice, bob, now):
    message = build_container(bob, "note", {"text": "hi"}, now=now, recipients=[alice.did])
    assert Verifier().verify(message, now=now).ok  # a valid container, just not an MCE message
    err = _refused(message, peer=bob, own=alice, now=now)
    assert "not an MCE class" in err.detail


def test_check_mce_refuses_known_non_mce_class(alice, bob, now):
    # goal has a schema (so the Verifier raises no store-and-forward flag) but is no MCE class
    # (peer_query was the example until it became one: docs/protocol.md 33)
    message = build_container(bob, "goal", {"title": "x"}, now=now, recipients=[alice.did])
    result = Verifier().verify(message, now=now)
    assert result.ok and not result.store_and_forward
    err = _refused(message, peer=bob, own=alice, now=now)
    assert "not an MCE class" in err.detail


def _skewed(container, *, peer, own, now, max_age=MAX_AGE) -> SkewError:
    with pytest.raises(SkewError) as excinfo:
        _check(container, peer=peer, own=own, now=now, max_age=max_age)
    assert excinfo.value.reason == "clock_skew"
    return excinfo.value


def test_check_mce_refuses_older_than_max_age_as_clock_skew(alice, bob, now):
    message = build_mce(bob, "container_ack", {"acknowledged": []}, peer_did=alice.did,
                        now=now - timedelta(hours=1))
    err = _skewed(message, peer=bob, own=alice, now=now)
    assert err.offset_seconds == -3600 and "3600 s behind" in err.detail
    # with a wider window the same message passes: only its age was wrong
    assert _check(message, peer=bob, own=alice, now=now, max_age=timedelta(hours=2)).class_ == "container_ack"


def test_check_mce_refuses_one_just_past_the_window(alice, bob, now):
    message = build_mce(bob, "container_ack", {"acknowledged": []}, peer_did=alice.did, now=now)
    _skewed(message, peer=bob, own=alice, now=now + MAX_AGE + timedelta(seconds=1))


def test_check_mce_a_genuine_message_from_the_future_is_clock_skew_a_forged_one_bad_mce(alice, bob, carol, now):
    ahead = build_mce(bob, "container_ack", {"acknowledged": []}, peer_did=alice.did, now=now + timedelta(hours=1))
    err = _skewed(ahead, peer=bob, own=alice, now=now)
    assert err.offset_seconds == 3600 and "ahead of" in err.detail
    forged = copy.deepcopy(ahead)
    forged["hmp_container"]["payload"]["acknowledged"] = ["did:hmp:container:x"]
    assert "future_timestamp" in _refused(forged, peer=bob, own=alice, now=now).detail
    # signed by someone else than the connection's peer: not its clock
    assert "future_timestamp" in _refused(ahead, peer=carol, own=alice, now=now).detail


@pytest.mark.parametrize("class_,payload", [
    ("container_index", {"not-a-did": "ENTRY"}),
    ("evaluations_exchange", {"x": {"evaluations_hash": HASH, "items": []}}),
    ("referenced-by_exchange", {"container-1": {"links": []}}),
    ("container_delta", {"since": "2026-11-29T10:00:00Z", "added": {"nope": "ENTRY"}}),
    ("container_index", {"did-hmp-container-a": "ENTRY"}),
    ("container_index", {"DID:hmp:container:a": "ENTRY"}),
    ("container_index", {"": "ENTRY"}),
])
def test_check_mce_refuses_non_did_keys(alice, bob, now, class_, payload):
    payload = orjson.loads(orjson.dumps(payload).replace(b'"ENTRY"', orjson.dumps(_entry(bob))))
    message = build_mce(bob, class_, payload, peer_did=alice.did, now=now)
    assert Verifier().verify(message, now=now).ok  # the schemas cannot check keys
    err = _refused(message, peer=bob, own=alice, now=now)
    assert "not a DID" in err.detail


def test_check_mce_refuses_one_bad_key_among_good_ones(alice, bob, now):
    payload = {"did:hmp:container:a": _entry(bob), "did:hmp:container:b": _entry(bob), "zzz": _entry(bob)}
    message = build_mce(bob, "container_index", payload, peer_did=alice.did, now=now)
    _refused(message, peer=bob, own=alice, now=now)


def test_check_mce_does_not_key_check_non_keyed_classes(alice, bob, now):
    # container_request's members are not DIDs; only DID-keyed payloads are checked
    message = build_mce(bob, "container_request", {"after": "17", "request_container": []},
                        peer_did=alice.did, now=now)
    assert _check(message, peer=bob, own=alice, now=now).payload["after"] == "17"


def test_check_mce_refuses_non_did_key_in_delta_modified(alice, bob, now):
    payload = {"since": "2026-11-29T10:00:00Z", "modified": {"nope": {"evaluations_hash": HASH}}}
    message = build_mce(bob, "container_delta", payload, peer_did=alice.did, now=now)
    assert Verifier().verify(message, now=now).ok
    _refused(message, peer=bob, own=alice, now=now)


def test_check_mce_refuses_an_encrypted_message(alice, bob, now):
    message = build_container(bob, "container_ack", {"acknowledged": []}, now=now,
                              encrypt_to=[Recipient(alice.did, alice.public_key)], rng=DeterministicRng("mce"))
    head = message["hmp_container"]["head"]
    assert head["recipient"] == [alice.did] and head["payload_type"].startswith("encrypted+")
    assert Verifier().verify(message, now=now).ok
    err = _refused(message, peer=bob, own=alice, now=now)
    assert "unreadable" in err.detail or "cannot read" in err.detail


def test_check_mce_refuses_what_it_can_only_store_and_forward(alice, bob, now):
    # a valid, signed MCE message encrypted with an algorithm this node does not implement
    hmp = build_mce(bob, "container_ack", {"acknowledged": []}, peer_did=alice.did, now=now)["hmp_container"]
    sealed = b"\x01" * 48
    hmp["payload"] = b64url_encode(sealed)
    hmp["head"].update(payload_type="encrypted+json", encryption_algo="x-future-aead",
                       payload_hash=sha256_tag(sealed))
    message = {"hmp_container": resign(hmp, bob)}
    result = Verifier().verify(message, now=now)
    assert result.ok and result.store_and_forward == {"encryption"}
    err = _refused(message, peer=bob, own=alice, now=now)
    assert err.detail == "cannot read it: encryption"


@pytest.mark.parametrize("compression", ["zstd", "gzip"])
def test_check_mce_opens_a_compressed_message(alice, bob, now, compression):
    payload = {"acknowledged": ["did:hmp:container:a"]}
    message = build_container(bob, "container_ack", payload, now=now, recipients=[alice.did],
                              compression=compression)
    assert isinstance(message["hmp_container"]["payload"], str)
    assert _check(message, peer=bob, own=alice, now=now).payload == payload


def test_check_mce_refuses_a_compressed_message_with_a_non_did_key(alice, bob, now):
    message = build_container(bob, "container_index", {"x": _entry(bob)}, now=now, recipients=[alice.did],
                              compression="gzip")
    assert "not a DID" in _refused(message, peer=bob, own=alice, now=now).detail


# -- index_entry ----------------------------------------------------------------------------


INDEX_KEYS = {"class", "sender_did", "public_key", "sig_algo", "signature", "payload_hash"}


def test_index_entry_is_a_light_head(alice, bob, now):
    container = build_container(alice, "note", {"text": "secret body"}, now=now, recipients=[bob.did],
                                tags=["t1", "t2"], subclass="memo")
    hmp = container["hmp_container"]
    entry = index_entry(hmp)
    assert set(entry) == {"head"}
    head = hmp["head"]
    assert entry["head"] == {k: head[k] for k in INDEX_KEYS} | {"tags": ["t1", "t2"]}
    assert "payload" not in entry and "secret body" not in orjson.dumps(entry).decode()
    for absent in ("recipient", "timestamp", "container_did", "subclass", "payload_type"):
        assert absent not in entry["head"]
    did = head["container_did"]
    assert default_schemas().check_class("container_index", {did: entry}) is None


def test_index_entry_without_tags(alice, now):
    container = build_container(alice, "note", {"text": "x"}, now=now)
    entry = index_entry(container["hmp_container"])
    assert set(entry["head"]) == INDEX_KEYS
    assert default_schemas().check_class(
        "container_index", {container["hmp_container"]["head"]["container_did"]: entry}) is None


def test_index_entry_with_empty_tags_leaves_them_out(alice, now):
    container = build_container(alice, "note", {"text": "x"}, now=now, tags=[])
    assert container["hmp_container"]["head"]["tags"] == []
    assert "tags" not in index_entry(container["hmp_container"])["head"]


def test_index_entry_without_public_key_omits_it(alice, now):
    container = build_container(alice, "note", {"text": "x"}, now=now, include_public_key=False)
    entry = index_entry(container["hmp_container"])
    assert set(entry["head"]) == INDEX_KEYS - {"public_key"}


def test_index_entry_of_an_encrypted_container(alice, bob, now):
    container = build_container(alice, "note", {"text": "x"}, now=now,
                                encrypt_to=[Recipient(bob.did, bob.public_key)], rng=DeterministicRng("index"))
    hmp = container["hmp_container"]
    entry = index_entry(hmp)
    assert entry["head"]["payload_hash"] == hmp["head"]["payload_hash"]
    assert "key_recipient" not in entry["head"]
    assert default_schemas().check_class("container_index", {hmp["head"]["container_did"]: entry}) is None


def test_index_entries_make_an_mce_index_a_peer_accepts(alice, bob, now):
    held = [build_container(alice, "note", {"n": i}, now=now, tags=[f"t{i}"] if i % 2 else None)
            for i in range(3)]
    payload = {c["hmp_container"]["head"]["container_did"]: index_entry(c["hmp_container"]) for c in held}
    message = build_mce(alice, "container_index", payload, peer_did=bob.did, now=now)
    mce = _check(message, peer=alice, own=bob, now=now)
    assert mce.payload == payload
