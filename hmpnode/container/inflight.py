"""Bounds on the decompression work a batch of containers may cause (issue 10), sans-IO.

The 16 MiB limit of section 7.3 holds per container; a 208 KB frame of 150 zstd
containers still asked a node to decompress (and, before, to keep) 2.25 GB. So,
before verification:

- `decompressed_cost` reads, without decompressing, how many bytes a container's
  payload will expand to: zstd declares its content size in the frame header, a
  gzip stream ends with its size (ISIZE; a stream whose ISIZE lies is corrupt and
  fails verification, which decompresses with the container's limit anyway). A plain
  JSON payload, an encrypted one (verification does not open it) or one of an
  unknown compression costs nothing beyond its wire form.
- `plan_batch` refuses, in order, the containers whose cost is over the per-container
  limit of their source (`decompressed_too_large`) or that would take the batch (an
  API import, a peer's frame) over its budget (`over_budget`); the others are verified.
- `ByteBudget` is the node-wide budget of decompressed bytes in flight, shared by the
  verify threads (API imports and every peer): a verification that would go over it
  waits for others to finish. Each verification holds its cost only while it runs:
  the opened payload is not kept afterwards (only its bounded index text is).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import zstandard

from hmpnode.container import compression as _compression
from hmpnode.container.encoding import EncodingError, b64url_decode
from hmpnode.container.payload import parse_payload_type

__all__ = ["OVER_BUDGET", "DECOMPRESSED_TOO_LARGE", "REASONS", "decompressed_cost", "plan_batch", "ByteBudget"]

#: a batch's (frame's, import's) budget of decompressed bytes is spent
OVER_BUDGET = "over_budget"
#: one container expands to more than its source may send (section 7.3, 25.1)
DECOMPRESSED_TOO_LARGE = "decompressed_too_large"
REASONS = (OVER_BUDGET, DECOMPRESSED_TOO_LARGE)


def _tail(text: str, n: int) -> bytes:
    """At least the last `n` bytes that base64url `text` decodes to (decoding only its tail)."""
    body = text.rstrip("=")
    start = max(0, (len(body) - (n * 4 // 3 + 8)) // 4 * 4)
    return b64url_decode(body[start:])


def decompressed_cost(raw: Any, limit: int) -> int:
    """Upper bound of the bytes verifying `raw` decompresses: the declared size of a
    zstd or gzip payload, `limit` when it declares none or cannot be read here (a
    container that is not a parsed object: its payload is read during verification,
    bounded by `limit`), 0 for payloads verification does not decompress.

    Cheap (a frame header or a stream's last bytes are decoded), so it runs on the
    event loop before anything is handed to the verify threads."""
    if isinstance(raw, (bytes, bytearray, str)):
        text = raw[:64].lstrip()
        return limit if text[:1] in (b"{", "{") else 0  # what is no object is refused unopened
    if not isinstance(raw, dict):
        return 0
    hmp = raw.get("hmp_container", raw)
    head = hmp.get("head") if isinstance(hmp, dict) else None
    if not isinstance(head, dict) or not isinstance(head.get("payload_type"), str):
        return 0  # refused by verification before any payload is opened
    try:
        form = parse_payload_type(head["payload_type"])
    except ValueError:
        return 0
    if form.encrypted or form.compression not in _compression.SUPPORTED:
        return 0
    payload = hmp.get("payload")
    if not isinstance(payload, str):
        return 0  # schema error
    try:
        if form.compression == "zstd":
            header = b64url_decode(payload[:24])  # 18 bytes: the longest zstd frame header
            size = zstandard.get_frame_parameters(header).content_size
            return limit if size == zstandard.CONTENTSIZE_UNKNOWN else size
        tail = _tail(payload, 4)
        return int.from_bytes(tail[-4:], "little") if len(tail) >= 4 else 0
    except (EncodingError, zstandard.ZstdError, ValueError):
        return 0  # not decodable: verification refuses it without decompressing


def plan_batch(costs: Sequence[int], *, item_limit: int, batch_budget: int) -> list[str | None]:
    """Per item, in order: None (verify it) or the reason it is refused. An item over
    `item_limit` is refused alone; the others take from `batch_budget` in order, and
    the first that does not fit and every later one with a cost are refused."""
    out: list[str | None] = []
    left = batch_budget
    spent = False
    for cost in costs:
        if cost > item_limit:
            out.append(DECOMPRESSED_TOO_LARGE)
        elif cost and (spent or cost > left):
            spent = True
            out.append(OVER_BUDGET)
        else:
            left -= cost
            out.append(None)
    return out


class ByteBudget:
    """Bytes held by verifications in progress, at most `capacity` (thread-safe).

    `hold(n)` blocks while taking `n` would exceed the capacity (a request larger
    than the capacity waits until nothing else is held, so it cannot starve);
    every holder is a running verification, so the wait always ends."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self.waits = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        if n <= 0:
            return
        with self._cond:
            if self.used and self.used + n > self.capacity:
                self.waits += 1
                while self.used and self.used + n > self.capacity:
                    self._cond.wait()
            self.used += n
            self.peak = max(self.peak, self.used)

    def release(self, n: int) -> None:
        if n <= 0:
            return
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def stats(self) -> dict[str, int]:
        return {"capacity": self.capacity, "used": self.used, "peak": self.peak, "waits": self.waits}
