"""Container core throughput against raw PyNaCl Ed25519 on the same bytes, one core.

Each figure is measured in interleaved rounds (raw, ours, raw, ours, ...) and the
reported ratio is the median of the per-round ratios, so that drift in machine
speed during the run cancels out. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import nacl.bindings as sodium

from hmpnode.container.build import Recipient, build_container
from hmpnode.container.canonical import canonical_json
from hmpnode.container.encoding import b64url_decode
from hmpnode.container.payload import open_payload
from hmpnode.container.verify import Verifier, encode_wire
from hmpnode.identity import Identity
from hmpnode.vectors import DeterministicRng

from _benchlib import positive_int  # scripts/ is on sys.path: the script's own folder

NOW = datetime(2026, 11, 29, 10, 15, tzinfo=timezone.utc)
PAYLOAD = {
    "title": "Measure LAN discovery latency",
    "description": "Start twenty nodes on one LAN and record when each has seen every other. " * 8,
    "priority": 0.8,
    "expected_outcome": "A latency table per node and a median for the mesh.",
}


def rate(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return n / (time.perf_counter() - start)


def paired(raw, ours, n: int, rounds: int) -> dict[str, float]:
    raw_rates, our_rates, ratios = [], [], []
    for _ in range(rounds):
        r = rate(raw, n)
        o = rate(ours, n)
        raw_rates.append(r)
        our_rates.append(o)
        ratios.append(o / r)
    return {"raw_per_s": round(statistics.median(raw_rates)), "ours_per_s": round(statistics.median(our_rates)),
            "ratio": round(statistics.median(ratios), 3)}


def signed_parts(container):
    hmp = container["hmp_container"]
    unsigned = dict(hmp, head={k: v for k, v in hmp["head"].items() if k != "signature"})
    return canonical_json(unsigned), b64url_decode(hmp["head"]["signature"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=positive_int, default=2000, help="operations per round")
    parser.add_argument("--rounds", type=positive_int, default=7)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    alice, bob = Identity(bytes(range(32))), Identity(bytes(range(32, 64)))
    rng = DeterministicRng("bench")
    plain = build_container(alice, "goal", PAYLOAD, now=NOW, tags=["bench"], confidence=0.9)
    enc = build_container(alice, "goal", PAYLOAD, now=NOW, rng=rng, compression="zstd",
                          encrypt_to=[Recipient(bob.did, bob.public_key)])
    plain_wire, enc_wire = encode_wire(plain), encode_wire(enc)
    verifier = Verifier()
    for wire in (plain_wire, enc_wire):
        result = verifier.verify(wire, now=NOW)
        assert result.ok, result.detail

    results: dict[str, object] = {}
    for name, container, wire in (("plain", plain, plain_wire), ("encrypted_zstd", enc, enc_wire)):
        msg, sig = signed_parts(container)
        pk = alice.public_key
        raw_verify = lambda: sodium.crypto_sign_open(sig + msg, pk)  # noqa: E731
        ours_verify = lambda: verifier.verify(wire, now=NOW)  # noqa: E731
        results[f"{name}_verify"] = paired(raw_verify, ours_verify, args.n, args.rounds)
        results[f"{name}_bytes"] = len(wire)
        results[f"{name}_signed_bytes"] = len(msg)

    msg, sig = signed_parts(enc)

    def verify_and_decrypt():
        result = verifier.verify(enc_wire, now=NOW)
        return open_payload(result.container["hmp_container"], bob)

    assert verify_and_decrypt() == PAYLOAD
    results["encrypted_zstd_verify_decrypt"] = paired(
        lambda: sodium.crypto_sign_open(sig + msg, alice.public_key), verify_and_decrypt, args.n, args.rounds)

    msg, _ = signed_parts(plain)
    secret = alice._secret  # raw signing on the same bytes
    results["plain_build_sign"] = paired(
        lambda: sodium.crypto_sign(msg, secret),
        lambda: build_container(alice, "goal", PAYLOAD, now=NOW, tags=["bench"], confidence=0.9),
        args.n, args.rounds)

    targets = {"plain_verify": 0.85, "encrypted_zstd_verify": 0.85, "encrypted_zstd_verify_decrypt": 0.45,
               "plain_build_sign": 0.75}
    print(f"hmpnode container benchmark: Python {platform.python_version()}, {platform.machine()}, one core, "
          f"{args.rounds} rounds x {args.n} ops")
    print(f"{'figure':34s} {'raw/s':>9s} {'ours/s':>9s} {'ratio':>6s} {'target':>6s}")
    met = True
    for key, target in targets.items():
        r = results[key]
        ok = r["ratio"] >= target
        met &= ok
        print(f"{key:34s} {r['raw_per_s']:9d} {r['ours_per_s']:9d} {r['ratio']:6.3f} {target:6.2f} {'ok' if ok else 'BELOW'}")
    results["targets"] = targets
    results["targets_met"] = met
    results["python"] = platform.python_version()
    print(json.dumps(results, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
