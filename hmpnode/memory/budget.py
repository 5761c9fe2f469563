"""Pack whole recall items into a token budget and a byte budget (sans-IO).

``pack`` takes a ranked list of candidate items and returns the envelope the
node will send: a JSON value built by the caller's ``envelope`` function from
the selected items and a receipt. Guarantees, for the envelope it returns
(``PackResult.envelope``, serialised as ``PackResult.envelope_json``):

* ``len(canonical_json(envelope)) <= max_bytes`` and
  ``count_json_tokens(envelope) <= max_tokens`` -- measured on the complete
  envelope, receipt included, and re-verified from scratch before returning;
* items are whole: ``selected`` holds the caller's own objects, never a
  truncated or rewritten copy, in ranking order;
* greedy over the ranking: every candidate is tried in order; one that does
  not fit beside those already taken is skipped and later, smaller ones are
  still tried;
* deterministic: no clock, no randomness, no I/O; the same input gives a
  byte-identical ``envelope_json``.

The envelope function
---------------------
``envelope(selected: list, receipt: dict) -> JSON value``. It is called
a few times per candidate with a fresh list of at most two items, so it must
be a pure function of its two arguments, and it must be *item-additive*: the
size of ``envelope(S, r)`` is the size of ``envelope([], r)`` plus what each
item of ``S`` adds on its own (its rendering in one or more arrays), plus the
same separators for each item after the first, whatever else ``S`` holds. Arrays of per-item renderings in a
frame that depends on the receipt only (``selected_count`` included, never
``len(selected)``) are additive: canonical JSON has no whitespace, and the
token rule never joins a piece across ``[``, ``,`` or ``]``. ``receipt`` is ``receipt_fields(...)``::

    {"tokenizer_id": "hmpnode-approx-v1", "tokenizer_version": 1,
     "max_tokens": 600, "max_bytes": 32768,
     "used_tokens": 118, "used_bytes": 441, "selected_count": 2}

Put it (or any of its values, as JSON integers) anywhere in the envelope, or
ignore it. ``used_tokens``/``used_bytes`` are the exact counts of the
complete returned envelope, the receipt's own digits included.

Remaining budget is deliberately *not* a receipt field: it equals
``max - used`` (``PackResult.remaining_tokens``/``remaining_bytes``), and
writing it into the envelope can make an exact receipt impossible. Its width
shrinks as ``used`` grows, so the envelope's size stops being monotone in the
numbers it states. Example: max_bytes 1000 and 895 bytes of envelope besides
``used_bytes`` and ``remaining_bytes``. Stating used=900 (remaining 100, 3+3
digits) gives 901 bytes; stating 901 (remaining 99, 3+2 digits) gives 900.
No value describes itself. A reader derives remaining from max and used.

The fixed point
---------------
The receipt is inside the envelope it measures, so the numbers are a fixed
point: find (t, b) with ``measure(envelope(S, receipt(t, b))) == (t, b)``.
With only ``used_*`` (and constants) in the receipt, ``f(t, b) =
measure(envelope(S, receipt(t, b)))`` is monotone: a larger number has at
least as many digits, and under ``hmpnode-approx-v1`` at least as many
tokens. ``_settle`` therefore iterates ``x0 = (0, 0)``, ``x_{k+1} = f(x_k)``.
By Kleene/Tarski the iterates never decrease and never pass the least fixed
point. The sequence stops at that fixed point after a few rounds (sizes grow
with the logarithm of the numbers), typically three envelope builds. The
moment an iterate exceeds a budget, the least fixed point does too, so no
exact receipt for this selection fits: the candidate is skipped. An exact
fit (size == budget) is accepted.

The monotone argument needs an envelope that writes the numbers as JSON
integers and is otherwise independent of them. Safety does not need it.
Every accepted selection is a *verified* fixed point, measured on the exact
bytes. An envelope that never stabilises within ``MAX_ROUNDS`` makes the
candidate skipped with reason ``receipt_unstable``. The final envelope is
serialised and counted again from scratch before ``pack`` returns; a
mismatch raises ``BudgetError`` instead of returning an unmeasured value
(fail closed).

Cost: per candidate, one build holding that item alone (what it adds; the
separators an item adds after others are measured once, with ``[x, x]`` for
the first candidate) and a few builds of the empty frame for the fixed point; the whole envelope is built and
counted once, at the end. ``O(sum of item sizes + n * frame)``: the answer is
never re-serialised per candidate (it was, before issue 12: 0.4-0.85 s at p50
for a 20 000-token answer). A non-additive envelope is caught by the final
measurement (``BudgetError``), never returned.

Skip reasons and abstention
---------------------------
``skipped`` lists ``Skip(index, reason)`` in candidate order:

* ``too_large_for_remaining`` -- does not fit beside the items taken so far
  (with nothing taken yet: does not fit on its own);
* ``budget_exhausted`` -- tried while the remaining tokens or bytes were 0,
  or while even the empty envelope does not fit;
* ``receipt_unstable`` -- the envelope function gave no fixed point.

``fits_any`` is False when nothing was selected; ``abstain_reason`` then says
why: ``no_candidates``, ``budget_too_small_for_envelope`` (even the empty
envelope is over a budget; ``envelope`` and ``envelope_json`` are None and
the caller must send an error, not a reply), or
``budget_too_small_for_smallest`` (the empty envelope fits, no item does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from hmpnode.container.canonical import canonical_json

from .tokens import TOKENIZER_ID, TOKENIZER_VERSION, count_canonical_tokens

__all__ = [
    "BudgetError", "MAX_ROUNDS", "PackResult", "Skip", "pack", "receipt_fields",
    "TOO_LARGE", "EXHAUSTED", "UNSTABLE",
    "ABSTAIN_NO_CANDIDATES", "ABSTAIN_ENVELOPE", "ABSTAIN_SMALLEST",
]

MAX_ROUNDS = 16

TOO_LARGE = "too_large_for_remaining"
EXHAUSTED = "budget_exhausted"
UNSTABLE = "receipt_unstable"
ABSTAIN_NO_CANDIDATES = "no_candidates"
ABSTAIN_ENVELOPE = "budget_too_small_for_envelope"
ABSTAIN_SMALLEST = "budget_too_small_for_smallest"


class BudgetError(ValueError):
    """Bad budget arguments, or an envelope that changed between measurement and return."""


@dataclass(frozen=True)
class Skip:
    index: int
    reason: str


@dataclass(frozen=True)
class PackResult:
    selected: list[Any]
    """The chosen candidates themselves (not copies), in ranking order."""
    selected_indices: tuple[int, ...]
    skipped: tuple[Skip, ...]
    tokens_used: int
    """Exact tokens of `envelope_json` (0 when there is no envelope)."""
    bytes_used: int
    """Exact length of `envelope_json` (0 when there is no envelope)."""
    max_tokens: int
    max_bytes: int
    envelope: Any
    """The final value, or None when even the empty envelope is over budget."""
    envelope_json: bytes | None
    """canonical_json(envelope): the bytes to send."""
    receipt: dict[str, Any] | None
    """The receipt the final envelope was built with."""
    fits_any: bool
    abstain_reason: str | None = field(default=None)

    @property
    def remaining_tokens(self) -> int:
        return self.max_tokens - self.tokens_used

    @property
    def remaining_bytes(self) -> int:
        return self.max_bytes - self.bytes_used


def receipt_fields(*, max_tokens: int, max_bytes: int, used_tokens: int, used_bytes: int,
                   selected_count: int) -> dict[str, Any]:
    """The receipt handed to the envelope function (see the module docstring)."""
    return {
        "tokenizer_id": TOKENIZER_ID,
        "tokenizer_version": TOKENIZER_VERSION,
        "max_tokens": max_tokens,
        "max_bytes": max_bytes,
        "used_tokens": used_tokens,
        "used_bytes": used_bytes,
        "selected_count": selected_count,
    }


def _measure(value: Any) -> tuple[int, int]:
    data = canonical_json(value)
    return count_canonical_tokens(data), len(data)


_OVER = "over"


def _settle(frame: Callable[[dict[str, Any]], Any], items_size: tuple[int, int], count: int,
            max_tokens: int, max_bytes: int) -> tuple[int, int] | str:
    """The (tokens, bytes) that a receipt of `count` items must state so that the
    envelope (its frame, measured without items, plus `items_size`) has exactly that
    size; or `_OVER`/`UNSTABLE` (see "The fixed point" in the module docstring)."""
    used_tokens = used_bytes = 0
    for _ in range(MAX_ROUNDS):
        receipt = receipt_fields(max_tokens=max_tokens, max_bytes=max_bytes, used_tokens=used_tokens,
                                 used_bytes=used_bytes, selected_count=count)
        tokens, size = _measure(frame(receipt))
        tokens, size = tokens + items_size[0], size + items_size[1]
        if size > max_bytes or tokens > max_tokens:
            return _OVER
        if tokens == used_tokens and size == used_bytes:
            return tokens, size
        used_tokens, used_bytes = tokens, size
    return UNSTABLE


def _budget(name: str, value: Any) -> int:
    if type(value) is not int or value < 0:
        raise BudgetError(f"{name} must be a non-negative int, not {value!r:.40}")
    return value


def pack(candidates: Sequence[Any], *, max_tokens: int, max_bytes: int,
         envelope: Callable[[list[Any], dict[str, Any]], Any]) -> PackResult:
    """Greedily pack whole `candidates` (ranked, best first) into both budgets.

    `envelope(selected, receipt)` builds the complete JSON value to return; it
    must be item-additive (see "Cost" in the module docstring). Raises
    BudgetError for bad budgets or if the final envelope does not measure as
    predicted; CanonicalError if an envelope is not JSON.
    """
    max_tokens = _budget("max_tokens", max_tokens)
    max_bytes = _budget("max_bytes", max_bytes)
    candidates = list(candidates)
    probe = receipt_fields(max_tokens=max_tokens, max_bytes=max_bytes, used_tokens=0, used_bytes=0,
                           selected_count=0)

    def frame(receipt: dict[str, Any]) -> Any:
        return envelope([], receipt)

    current = _settle(frame, (0, 0), 0, max_tokens, max_bytes)
    if not isinstance(current, tuple):
        return PackResult(
            selected=[], selected_indices=(),
            skipped=tuple(Skip(i, EXHAUSTED) for i in range(len(candidates))),
            tokens_used=0, bytes_used=0, max_tokens=max_tokens, max_bytes=max_bytes,
            envelope=None, envelope_json=None, receipt=None,
            fits_any=False, abstain_reason=ABSTAIN_ENVELOPE,
        )

    empty = _measure(envelope([], probe))
    selected: list[Any] = []
    indices: list[int] = []
    skipped: list[Skip] = []
    items_size = (0, 0)  # what the selected items add to the frame
    sep: tuple[int, int] | None = None  # what an item adds after others beyond what it adds alone
    for index, item in enumerate(candidates):
        # what `item` adds: as the first item, and after others (plus the separators, the
        # same for every item of an additive envelope: measured once, on the first one)
        one = _measure(envelope([item], probe))
        delta = (one[0] - empty[0], one[1] - empty[1])
        if sep is None:
            two = _measure(envelope([item, item], probe))
            sep = (two[0] - one[0] - delta[0], two[1] - one[1] - delta[1])
        if selected:
            delta = (delta[0] + sep[0], delta[1] + sep[1])
        trial = (items_size[0] + delta[0], items_size[1] + delta[1])
        settled = _settle(frame, trial, len(selected) + 1, max_tokens, max_bytes)
        if isinstance(settled, tuple):
            selected.append(item)
            indices.append(index)
            items_size, current = trial, settled
            continue
        if settled == UNSTABLE:
            reason = UNSTABLE
        elif current[0] >= max_tokens or current[1] >= max_bytes:
            reason = EXHAUSTED
        else:
            reason = TOO_LARGE
        skipped.append(Skip(index, reason))

    # One build of exactly what is returned, measured from scratch: fail closed.
    receipt = receipt_fields(max_tokens=max_tokens, max_bytes=max_bytes, used_tokens=current[0],
                             used_bytes=current[1], selected_count=len(selected))
    value = envelope(list(selected), receipt)
    data = canonical_json(value)
    tokens = count_canonical_tokens(data)
    if (tokens, len(data)) != current or len(data) > max_bytes or tokens > max_tokens:
        raise BudgetError("the envelope does not measure as predicted (not item-additive, or changed);"
                          " nothing is returned")

    abstain = None
    if not selected:
        abstain = ABSTAIN_NO_CANDIDATES if not candidates else ABSTAIN_SMALLEST
    return PackResult(
        selected=selected, selected_indices=tuple(indices), skipped=tuple(skipped),
        tokens_used=tokens, bytes_used=len(data), max_tokens=max_tokens, max_bytes=max_bytes,
        envelope=value, envelope_json=data, receipt=receipt,
        fits_any=bool(selected), abstain_reason=abstain,
    )
