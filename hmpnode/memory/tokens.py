"""A deterministic, local token counter for recall budgets (sans-IO).

Recall under a budget must measure what it returns without a model file, a
network call or a clock, and two nodes given the same text must agree on the
count. This module approximates the tokenizers of current language models
(byte-level BPE such as cl100k/o200k) by a fixed rule that is meant to count
*more* tokens than they do, never fewer, for ordinary text and code.

Rule ``hmpnode-approx-v1`` (``TOKENIZER_ID``; ``TOKENIZER_VERSION`` = 1). The
text is cut, left to right, into pieces; each piece costs what the table
says, and the count is the sum:

====================================================  ==============================
piece                                                  tokens
====================================================  ==============================
ASCII whitespace (space, ``\\t \\n \\r \\f \\v``)          0 (free)
run of ASCII letters ``A-Z a-z``                        1 per started chunk of 4
run of "small-alphabet" letters: Latin-1/Latin          1 per started chunk of 2
  Extended (U+00C0-U+024F, without × and ÷),
  Greek (U+0370-U+03FF), Cyrillic (U+0400-U+052F)
run of ASCII digits ``0-9``                             1 per started group of 3
any other character below U+0800 (ASCII punctuation,    1
  symbols, Hebrew, Arabic, combining marks, ...)
any other character U+0800-U+FFFF (CJK, Hangul, Thai,   2
  Devanagari, typographic quotes and dashes, ...)
any character above U+FFFF (emoji, rare CJK)            3
====================================================  ==============================

A run is maximal: ``"hello"`` is one run of five ASCII letters (2 tokens),
``"café"`` is an ASCII run ``caf`` (1) then a small-alphabet run ``é`` (1).
Worked examples (the tests check them):

* ``"Hello, world!"`` -> Hell|o , worl|d !  = 2+1+2+1 = 6 (cl100k: 4)
* ``"Привет, мир"``  -> Пр|ив|ет , ми|р   = 3+1+2   = 6
* ``"x = 12345"``    -> x = 123|45        = 1+1+2   = 4
* ``"日本語 👍"``     -> 2+2+2 (space free) + 3      = 9
* ``{"a":[1,"b c"]}`` (canonical JSON)  -> 14 single-character pieces = 14

Why it over-estimates. BPE vocabularies hold most English words and common
code identifiers as one or two tokens of 4+ characters, usually with the
leading space merged in; this rule charges a word one token per 4 letters
and never merges a space, punctuation mark or JSON quote into a neighbour.
Digits are split into groups of at most 3, as cl100k/o200k do. Cyrillic and
accented Latin are charged one token per 2 letters, which is at or above
what byte-level BPE spends on Russian, German or French text. Characters of
3 and 4 UTF-8 bytes get 2 and 3 tokens: a byte-level BPE needs at most one
token per byte and common CJK characters take one or two. JSON text is the
worst case for BPE-vs-rule agreement and the rule pays a full token for
every brace, quote, colon and comma, where BPE merges many of them (``":"``,
``"},{"``). Expect roughly 1.2-2x the BPE count for English prose and
code, more for JSON. (This claim is a design argument; no BPE vocabulary is
shipped or consulted here.)

What it does not promise. It is not an upper bound for adversarial text:
strings built to defeat BPE merges (random mixed-case base58, long runs of
rare letters, unusual Unicode) can cost a real tokenizer more than this
rule says. A deployment that must never exceed a model's context should
keep a margin or count with that model's tokenizer instead. The budget
guarantee of ``hmpnode.memory.budget`` is exact with respect to *this*
counter, which is what the receipt names.

Changing any weight or class changes the counts, so it needs a new
``TOKENIZER_ID``: receipts name the rule they were measured with.
"""

from __future__ import annotations

import re
from typing import Any

from hmpnode.container.canonical import canonical_json

__all__ = ["TOKENIZER_ID", "TOKENIZER_VERSION", "count_tokens", "count_json_tokens", "count_canonical_tokens"]

TOKENIZER_ID = "hmpnode-approx-v1"
TOKENIZER_VERSION = 1

# Small-alphabet letters: Latin-1 letters without × (U+00D7) and ÷ (U+00F7),
# Latin Extended-A/B, Greek and Coptic, Cyrillic and Cyrillic Supplement.
_SMALL = "\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u024f\u0370-\u03ff\u0400-\u052f"

# One match per token of weight one; the alternatives are tried in order, so
# the catch-all only sees characters no run class takes. Quantified classes
# split a run into chunks exactly as "one per started chunk" says: a greedy
# {1,4} over a run of n letters matches ceil(n/4) times.
_PIECES = re.compile(rf"[A-Za-z]{{1,4}}|[0-9]{{1,3}}|[{_SMALL}]{{1,2}}|[^ \t\n\r\f\v]")
# Characters of three or four UTF-8 bytes: one extra token each, and one more
# for those of four bytes. None of them is whitespace or in a run class.
_WIDE = re.compile("[\u0800-\U0010ffff]")
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def count_tokens(text: str) -> int:
    """Tokens of `text` under rule ``hmpnode-approx-v1`` (see the module docstring)."""
    if not isinstance(text, str):
        raise TypeError(f"count_tokens wants str, not {type(text).__name__}")
    if text.isascii():
        return len(_PIECES.findall(text))
    return len(_PIECES.findall(text)) + len(_WIDE.findall(text)) + len(_ASTRAL.findall(text))


def count_canonical_tokens(data: bytes) -> int:
    """Tokens of canonical JSON bytes (UTF-8 text)."""
    return count_tokens(data.decode("utf-8"))


def count_json_tokens(value: Any) -> int:
    """Tokens of the canonical JSON text of `value` (what a node sends)."""
    return count_canonical_tokens(canonical_json(value))
