"""Container core throughput against raw libsodium Ed25519 on the same bytes, one core.

Every figure runs over distinct containers (from 8 senders; no two alike, so no memo
cache answers twice for one container) against libsodium's raw crypto_sign_open (or
crypto_sign) on each container's own signed bytes and signature, in the same run.
Wall clock: interleaved rounds (raw, ours, raw, ours, ...), the ratio is the median of
the per-round ratios, so drift in machine speed during the run cancels out.
Instructions: valgrind cachegrind counts (Ir) per container verified against per raw
verify, on a small fixed workload (deterministic; a change can be judged on a loaded
machine). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import nacl.bindings as sodium

from hmpnode.container.build import Recipient, build_container
from hmpnode.container.canonical import canonical_json
from hmpnode.container.encoding import b64url_decode
from hmpnode.container.payload import open_payload
from hmpnode.container.verify import Verifier, encode_wire
from hmpnode.identity import Identity
from hmpnode.vectors import DeterministicRng

from _benchlib import ir_per_op, positive_int  # scripts/ is on sys.path: the script's own folder

NOW = datetime(2026, 11, 29, 10, 15, tzinfo=timezone.utc)
SENDERS = [Identity(bytes([10 + i]) * 32) for i in range(8)]
BOB = Identity(bytes(range(32, 64)))


def payload(i: int) -> dict:
    return {
        "title": f"Measure LAN discovery latency, run {i}",
        "description": f"Run {i}: start twenty nodes on one LAN and record when each has seen every other. " * 8,
        "priority": 0.8,
        "expected_outcome": "A latency table per node and a median for the mesh.",
    }


def build(i: int, *, encrypted: bool = False) -> dict:
    sender = SENDERS[i % len(SENDERS)]
    if encrypted:
        return build_container(sender, "goal", payload(i), now=NOW, rng=DeterministicRng(f"bench{i}"),
                               compression="zstd", encrypt_to=[Recipient(BOB.did, BOB.public_key)])
    return build_container(sender, "goal", payload(i), now=NOW, tags=["bench"], confidence=0.9)


def rate(fn, items) -> float:
    start = time.perf_counter()
    for item in items:
        fn(item)
    return len(items) / (time.perf_counter() - start)


def paired(raw, raw_items, ours, our_items, rounds: int) -> dict[str, float]:
    raw_rates, our_rates, ratios = [], [], []
    for _ in range(rounds):
        r = rate(raw, raw_items)
        o = rate(ours, our_items)
        raw_rates.append(r)
        our_rates.append(o)
        ratios.append(o / r)
    return {"raw_per_s": round(statistics.median(raw_rates)), "ours_per_s": round(statistics.median(our_rates)),
            "ratio": round(statistics.median(ratios), 3)}


def signed_parts(container):
    hmp = container["hmp_container"]
    unsigned = dict(hmp, head={k: v for k, v in hmp["head"].items() if k != "signature"})
    return canonical_json(unsigned), b64url_decode(hmp["head"]["signature"])


def raw_open(container) -> tuple[bytes, bytes]:
    """(signature + signed bytes, public key): what crypto_sign_open checks for `container`."""
    msg, sig = signed_parts(container)
    sender = next(s for s in SENDERS if s.did == container["hmp_container"]["head"]["sender_did"])
    return sig + msg, sender.public_key


def sodium_open(item) -> bytes:
    return sodium.crypto_sign_open(*item)


def ir_work(mode: str, data: Path) -> int:
    """One fixed workload under cachegrind (see _benchlib.ir_per_op); "none" does the
    setup (and the warm-up verify) only."""
    work = pickle.loads(data.read_bytes())
    verifier = Verifier()
    assert verifier.verify(work["warm"], now=NOW).ok  # first-use costs (schemas, key binding) outside the count
    if mode == "raw":
        for item in work["raw"]:
            sodium_open(item)
    elif mode == "verify":
        for wire in work["wires"]:
            verifier.verify(wire, now=NOW)
    return 0


def instruction_ratio(n: int) -> dict[str, object] | None:
    containers = [build(100_000 + i) for i in range(n)]
    work = {"warm": encode_wire(build(99_999)), "wires": [encode_wire(c) for c in containers],
            "raw": [raw_open(c) for c in containers]}
    ir = ir_per_op(__file__, pickle.dumps(work), ["raw", "verify"], n)
    if ir is None:
        return None
    return {"raw_verify_ir": ir["raw"], "plain_verify_ir": ir["verify"],
            "ratio": round(ir["raw"] / ir["verify"], 3), "containers": n,
            "command": "valgrind --tool=cachegrind --cache-sim=no (Ir per op, less a setup-only run)"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=positive_int, default=2000, help="distinct containers per round")
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--ir-n", type=int, default=200, help="containers in the instruction count (0: skip it)")
    parser.add_argument("--ir-work", help=argparse.SUPPRESS)
    parser.add_argument("--ir-data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ir_work:
        return ir_work(args.ir_work, args.ir_data)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    print(f"building {2 * args.n} distinct containers ...", file=sys.stderr)
    plain = [build(i) for i in range(args.n)]
    enc = [build(i, encrypted=True) for i in range(args.n)]
    verifier = Verifier()
    results: dict[str, object] = {}
    for name, containers in (("plain", plain), ("encrypted_zstd", enc)):
        wires = [encode_wire(c) for c in containers]
        assert all(verifier.verify(w, now=NOW).ok for w in wires[:50])
        results[f"{name}_verify"] = paired(sodium_open, [raw_open(c) for c in containers],
                                           lambda w: verifier.verify(w, now=NOW), wires, args.rounds)
        results[f"{name}_bytes"] = round(statistics.mean(len(w) for w in wires))
        results[f"{name}_signed_bytes"] = round(statistics.mean(len(signed_parts(c)[0]) for c in containers))

    def verify_and_decrypt(wire):
        result = verifier.verify(wire, now=NOW)
        return open_payload(result.container["hmp_container"], BOB)

    enc_wires = [encode_wire(c) for c in enc]
    assert verify_and_decrypt(enc_wires[3]) == payload(3)
    results["encrypted_zstd_verify_decrypt"] = paired(sodium_open, [raw_open(c) for c in enc],
                                                      verify_and_decrypt, enc_wires, args.rounds)

    secrets = {s.did: s._secret for s in SENDERS}  # raw signing of each container's own signed bytes
    to_sign = [(signed_parts(c)[0], secrets[c["hmp_container"]["head"]["sender_did"]]) for c in plain]
    results["plain_build_sign"] = paired(lambda item: sodium.crypto_sign(*item), to_sign,
                                         build, list(range(args.n)), args.rounds)

    targets = {"plain_verify": 0.85, "encrypted_zstd_verify": 0.85, "encrypted_zstd_verify_decrypt": 0.45,
               "plain_build_sign": 0.75}
    print(f"hmpnode container benchmark: Python {platform.python_version()}, {platform.machine()}, one core, "
          f"{args.rounds} rounds x {args.n} distinct containers, load average {os.getloadavg()[0]:.1f}")
    print(f"{'figure':34s} {'raw/s':>9s} {'ours/s':>9s} {'ratio':>6s} {'target':>6s}")
    met = True
    for key, target in targets.items():
        r = results[key]
        ok = r["ratio"] >= target
        met &= ok
        print(f"{key:34s} {r['raw_per_s']:9d} {r['ours_per_s']:9d} {r['ratio']:6.3f} {target:6.2f} {'ok' if ok else 'BELOW'}")
    if args.ir_n > 0:
        ir = instruction_ratio(args.ir_n)
        if ir is not None:
            results["plain_verify_instructions"] = ir
            print(f"{'plain_verify (instructions)':34s} {ir['raw_verify_ir']:>9d} {ir['plain_verify_ir']:>9d} "
                  f"{ir['ratio']:6.3f} {0.75:6.2f} {'ok' if ir['ratio'] >= 0.75 else 'BELOW'}  (Ir per op)")
    results["targets"] = targets
    results["targets_met"] = met
    results["python"] = platform.python_version()
    results["load_average_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(results, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
