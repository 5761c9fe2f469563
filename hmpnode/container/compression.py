"""Payload compression (profile section 6): zstd (one frame, content size set) and gzip.

Decompression is always bounded: a result larger than the limit is an error,
and the bomb is never materialised beyond limit + 1 bytes.
"""

from __future__ import annotations

import threading
import zlib

import zstandard

__all__ = ["SUPPORTED", "CompressionError", "compress", "decompress", "DEFAULT_MAX_DECOMPRESSED"]

SUPPORTED = ("zstd", "gzip")
DEFAULT_MAX_DECOMPRESSED = 16 * 1024 * 1024

_ZSTD_LEVEL = 3
_GZIP_LEVEL = 6


class CompressionError(ValueError):
    """Unknown algorithm, corrupt data, or output over the limit."""


# zstd contexts are costly to create (tens of microseconds) and not safe to share
# between threads; keep one pair per thread.
_local = threading.local()


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    pair = getattr(_local, "zstd", None)
    if pair is None:
        pair = _local.zstd = (
            zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_content_size=True),
            zstandard.ZstdDecompressor(),
        )
    return pair


def compress(data: bytes, algo: str) -> bytes:
    if algo == "zstd":
        return _zstd()[0].compress(data)
    if algo == "gzip":
        # Deterministic gzip: mtime 0, no file name, OS byte 255 ("unknown").
        co = zlib.compressobj(_GZIP_LEVEL, zlib.DEFLATED, 31)
        out = bytearray(co.compress(data) + co.flush())
        out[4:8] = b"\0\0\0\0"
        out[9] = 255
        return bytes(out)
    raise CompressionError(f"unsupported compression {algo!r}")


def decompress(data: bytes, algo: str, *, limit: int = DEFAULT_MAX_DECOMPRESSED) -> bytes:
    if algo == "zstd":
        return _zstd_decompress(data, limit)
    if algo == "gzip":
        return _gzip_decompress(data, limit)
    raise CompressionError(f"unsupported compression {algo!r}")


def _zstd_decompress(data: bytes, limit: int) -> bytes:
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError:
        raise CompressionError("not a zstd frame") from None
    declared = params.content_size
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > limit:
        raise CompressionError(f"zstd frame declares {declared} bytes, over the {limit}-byte limit")
    try:
        # Bounded: allocates at most `limit` (or the declared size, already checked).
        out = _zstd()[1].decompress(data, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise CompressionError(f"corrupt or oversized zstd data: {exc}") from None
    # decompress() silently ignores what follows the first frame; the profile
    # says one frame, so look for trailing bytes (the output size is known safe now).
    dobj = _zstd()[1].decompressobj()
    try:
        dobj.decompress(data)
    except zstandard.ZstdError as exc:
        raise CompressionError(f"corrupt zstd data: {exc}") from None
    if dobj.unused_data:
        raise CompressionError("data after the zstd frame")
    return out


def _gzip_decompress(data: bytes, limit: int) -> bytes:
    d = zlib.decompressobj(31)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as exc:
        raise CompressionError(f"corrupt gzip data: {exc}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise CompressionError(f"gzip payload exceeds the {limit}-byte limit")
    if not d.eof:
        raise CompressionError("truncated gzip stream")
    if d.unused_data:
        raise CompressionError("data after the gzip stream")
    return out
