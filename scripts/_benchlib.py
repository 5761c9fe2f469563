"""What the benchmark scripts share."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a usage error otherwise, not a traceback later)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1."""
    return [positive_int(part) for part in text.split(",")]
