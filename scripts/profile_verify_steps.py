"""Where a verify's time goes: the verification steps of hmpnode.container.verify
run one after another with a clock read between them, on the benchmark's plain
container. Also times a minimal orjson + PyNaCl pipeline (parse, canonicalise,
verify the signature: no schema, DID, key-binding or class checks) so the cost
of each check the profile requires is visible.

Usage: .venv/bin/python scripts/profile_verify_steps.py
"""

import base64
import hashlib
import os
import sys
import time

import orjson

import hmpnode.container.verify as V
from hmpnode.container.build import build_container
from hmpnode.container.canonical import dumps_prepared, loads_strict
from hmpnode.container.did import content_digest
from hmpnode.container.encoding import b64url_decode, sha256_tag
from hmpnode.container.structure import check_structure
from hmpnode.container.verify import Verifier, encode_wire
from hmpnode.identity import Identity

sys.path.insert(0, os.path.dirname(__file__))
from bench_container import NOW, PAYLOAD, paired, signed_parts, sodium  # noqa: E402

alice = Identity(bytes(range(32)))
plain = build_container(alice, "goal", PAYLOAD, now=NOW, tags=["bench"], confidence=0.9)
wire = encode_wire(plain)
v = Verifier()
if hasattr(os, 'sched_setaffinity'):
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
pc = time.perf_counter_ns
acc = [0]*16
names = ["loads_strict","parse-rest","structure","fields","future","payload_hash","signed_bytes","did","bind","b64sig","open","class","result"]
N = 20000
for _ in range(N):
    t0 = pc()
    doc, prepared = loads_strict(wire, max_depth=64)
    t1 = pc(); acc[0] += t1-t0
    container = doc; hmp = container["hmp_container"]; prepared = prepared["hmp_container"]
    t2 = pc(); acc[1] += t2-t1
    check_structure(hmp)
    t3 = pc(); acc[2] += t3-t2
    head = hmp["head"]
    form, timestamp, expired = v._check_fields(head, hmp["payload"], NOW)
    t4 = pc(); acc[3] += t4-t3
    _ = timestamp > NOW + v.limits.max_clock_skew
    t5 = pc(); acc[4] += t5-t4
    hashed = dumps_prepared(prepared["payload"]); ok = sha256_tag(hashed) == head["payload_hash"]
    t6 = pc(); acc[5] += t6-t5
    unsigned = dict(prepared); uh = dict(prepared["head"]); del uh["signature"]; unsigned["head"] = uh
    signed_bytes = dumps_prepared(unsigned)
    t7 = pc(); acc[6] += t7-t6
    digest = content_digest(head["container_did"])
    ok = hashlib.sha256(V._without_did(signed_bytes, head["container_did"], unsigned, uh)).digest() == digest
    t8 = pc(); acc[7] += t8-t7
    key, pin, rl = v._bind_key(head, timestamp)
    t9 = pc(); acc[8] += t9-t8
    sig = b64url_decode(head["signature"])
    t10 = pc(); acc[9] += t10-t9
    V.sodium.crypto_sign_open(sig + signed_bytes, key)
    t11 = pc(); acc[10] += t11-t10
    flags, opened = v._check_payload(hmp, form)
    t12 = pc(); acc[11] += t12-t11
    r = V.VerifyResult(True, None, "", head["container_did"], expired=expired, store_and_forward=flags, key_revoked_later=rl, pin_candidate=pin, container=container, payload=opened)
    t13 = pc(); acc[12] += t13-t12
tot = 0
for n, a in zip(names, acc):
    print(f"{n:15s} {a/N/1000:6.2f}"); tot += a
print("total", tot/N/1000, "non-open", (tot-acc[10])/N/1000)
t0=pc()
for _ in range(N): v.verify(wire, now=NOW)
print("real verify", (pc()-t0)/N/1000)

msg, sig = signed_parts(plain)


def minimal():
    doc = orjson.loads(wire)
    hmp = doc["hmp_container"]
    head = dict(hmp["head"])
    s = base64.urlsafe_b64decode(head.pop("signature") + "==")
    body = orjson.dumps(dict(hmp, head=head), option=orjson.OPT_SORT_KEYS)
    sodium.crypto_sign_open(s + body, alice.public_key)


print("minimal orjson+PyNaCl pipeline vs raw:", paired(lambda: sodium.crypto_sign_open(sig + msg, alice.public_key), minimal, 2000, 7))
print("hmpnode verify vs raw:               ", paired(lambda: sodium.crypto_sign_open(sig + msg, alice.public_key), lambda: v.verify(wire, now=NOW), 2000, 7))
