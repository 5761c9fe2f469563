"""Peer transport v2 throughput: encrypt + decrypt of frames through `Transport`,
against plain copying of the same bytes and raw libsodium ChaCha20-Poly1305, one core.

Frame sizes: one full record (65 518 bytes, the largest fragment) and 4 MiB (65
records). Each figure is measured in interleaved rounds (copy, raw AEAD, ours,
copy, ...) and the reported ratios are medians of per-round ratios, so that drift
in machine speed cancels out. MB/s counts frame bytes (each byte is encrypted
once and decrypted once). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import nacl.bindings as sodium

from hmpnode.net.noise import CipherState
from hmpnode.net.transport import MAX_FRAGMENT, Transport

from _benchlib import positive_int  # scripts/ is on sys.path: the script's own folder

MB = 1_000_000


def _pair() -> tuple[Transport, Transport]:
    k1, k2 = bytes(range(32)), bytes(range(1, 33))
    a = Transport(CipherState(k1), CipherState(k2), max_frame=1 << 23, handshake_hash=b"")
    b = Transport(CipherState(k2), CipherState(k1), max_frame=1 << 23, handshake_hash=b"")
    return a, b


def _timed(fn, frame: bytes, n: int) -> float:
    """MB/s of frame bytes through fn, n times, in CPU time of this process (the
    machine is shared: wall-clock time would count other processes)."""
    start = time.process_time()
    for _ in range(n):
        fn(frame)
    return len(frame) * n / max(time.process_time() - start, 1e-9) / MB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=positive_int, default=7)
    ap.add_argument("--megabytes", type=positive_int, default=64, help="frame bytes per measurement")
    args = ap.parse_args()
    a, b = _pair()
    key = bytes(32)
    nonce = bytes(12)

    def ours(frame: bytes) -> None:
        assert len(b.decrypt(a.encrypt(frame))) == len(frame)

    def copy(frame: bytes) -> None:  # what a cleartext path does at least: copy out, copy in
        bytes(bytearray(frame))

    def raw(frame: bytes) -> None:  # libsodium alone, one AEAD call each way, no framing
        sodium.crypto_aead_chacha20poly1305_ietf_decrypt(
            sodium.crypto_aead_chacha20poly1305_ietf_encrypt(frame, b"", nonce, key), b"", nonce, key)

    results = {}
    for label, size in (("record_64k", MAX_FRAGMENT), ("frame_4mib", 4 * 1024 * 1024)):
        frame = bytes(range(256)) * (size // 256) + bytes(size % 256)
        n = max(1, args.megabytes * MB // size)
        rows = []
        for _ in range(args.rounds):
            rows.append((_timed(copy, frame, n), _timed(raw, frame, n), _timed(ours, frame, n)))
        copy_mbs = statistics.median(r[0] for r in rows)
        raw_mbs = statistics.median(r[1] for r in rows)
        ours_mbs = statistics.median(r[2] for r in rows)
        results[label] = {
            "frame_bytes": size,
            "copy_MBps": round(copy_mbs),
            "raw_aead_MBps": round(raw_mbs),
            "transport_MBps": round(ours_mbs),
            "transport_over_copy": round(statistics.median(r[2] / r[0] for r in rows), 4),
            "transport_over_raw_aead": round(statistics.median(r[2] / r[1] for r in rows), 3),
        }
        print(f"{label:11s} copy {copy_mbs:8.0f} MB/s   raw AEAD enc+dec {raw_mbs:6.0f} MB/s   "
              f"transport enc+dec {ours_mbs:6.0f} MB/s   ratio transport/copy "
              f"{results[label]['transport_over_copy']:.4f}  transport/raw {results[label]['transport_over_raw_aead']:.3f}")
    print(json.dumps({"bench": "transport", "python": platform.python_version(), "rounds": args.rounds, **results}))


if __name__ == "__main__":
    main()
