"""The agent's journal: an append-only, hash-linked chain of its own `diary_entry`
containers, with a novelty class per entry, selective load and daily anchors
(after the "Hippocampus" design; issue 5, "Journal").

Everything here is sans-IO and deterministic: no files, sockets or clock reads
(`now` is always an argument); the same inputs give byte-identical containers
(Ed25519 signatures are deterministic and no randomness is used).

Entry format
============

A journal entry is an ordinary signed `diary_entry` container (full form,
built by `hmpnode.container.build.build_container`, plain `json` payload, no
encryption, no compression) whose signed parts carry:

* `payload` -- `{"title": <title>, "content": <text>}` (the diary_entry schema
  requires both; `build_entry` uses the title `"journal #<seq>"` unless one is
  given). `content` is the text the novelty class is computed from.
* `head.tags` -- four reserved tags, in this order, then any caller tags:

  - `journal`                       marks the container as a journal entry
  - `journal_seq:<n>`               the entry's sequence number: 1 for the first
                                    entry, previous + 1 after that; decimal
                                    without sign or leading zeros
  - `novelty:<class>`               `routine`, `novel` or `prediction_error`
  - `novelty_words:<new>/<total>`   the word counts the class was computed from
                                    (decimal integers, see "Novelty")

  A reader takes the reserved tags from any position, but each must occur
  exactly once; caller tags may not be `journal` nor start with `journal_seq:`,
  `novelty:` or `novelty_words:`. Tags live in the head, so they are covered
  by `container_did` and by the signature, and can be read without opening
  the payload.
* `related` -- `{"journal_previous": <container_did of the previous entry>}`
  (`RELATION`), a single DID string (never an array); absent on the first
  entry (sequence 1). `journal_previous` is a custom relation name (HMP
  §3.15.4): `previous_version` would say the entry supersedes its predecessor,
  which a journal entry does not. Because the predecessor's DID is
  content-addressed, an entry commits to the whole chain before it. The
  node's backlink index records the relation like any other (`referenced-by`
  of an entry names its successor).
* `head.timestamp` -- when the entry was written (`now`); never earlier than
  the previous entry's timestamp (equal is allowed).

Novelty (word-novelty strategy)
===============================

`tokenize(text)`: normalise with Unicode NFKC, then `str.casefold()`; a word is a
maximal run of characters whose Unicode general category is a letter (L*), a
mark (M*), a number (N*) or connector punctuation (Pc, e.g. `_`); everything
else separates words. (Python's `unicodedata`; Python 3.11 ships Unicode 14.0.)

The *vocabulary* before entry n is the set of words of the `content` of entries
1..n-1 in chain order (titles are not counted). For entry n with the token list
T (repeats counted), `new` = the number of tokens of T not in the vocabulary
(a repeated new word counts each time), `total` = len(T). The class is

* `prediction_error` if new/total > 0.5   (computed exactly: 2*new > total)
* `novel`            if new/total > 0.2   (exactly: 5*new > total)
* `routine`          otherwise, and always when total = 0.

The first entry has an empty vocabulary, so any non-empty first entry is
`prediction_error`.

Chain verification (`verify_chain`)
===================================

Entries may be given in any order (as full-form dicts, bare `{head, payload}`
dicts, or wire bytes/str); identical copies (same DID, both valid) count once.
Each is first checked on its own; it is **broken** when it does not verify
(`Verifier.verify`: signature, payload hash, content-addressed DID, ...), its
`container_did` is not content-addressed, its sender is not the journal's
agent, it is not a `diary_entry` with a plain-JSON payload, or its reserved
tags or its `journal_previous` relation are malformed.

The chain is then reconstructed from the links among the valid entries and
walked from the root (the valid entry with no `journal_previous`), keeping the
expected position p (1, 2, ...), the previous entry and the vocabulary. At
each step, with the valid entries linking the current one (or having no link
at the root):

* more than one: **forked**. The main branch is the child with the longest
  descendant chain, ties broken by the earlier timestamp, then the smaller DID
  (code point order); every other child is reported as forked at p.
* for the main child m, first match wins: `journal_seq` < p -> **reordered**;
  m's timestamp earlier than its predecessor's -> **reordered**;
  `journal_seq` > p and m's own main child records a smaller `journal_seq`
  than m (two numbers swapped) -> **reordered**; `journal_seq` > p otherwise
  (the link is intact, so the recorded number is wrong) -> **altered**;
  recorded `novelty` or `novelty_words` differ from the recomputation
  -> **altered**. So a swap is reported at the first entry of the swapped
  pair whose number or timestamp is out of order.
* the walk stops at the first problem, or when nothing links the current entry.

Valid entries off the walk whose `journal_previous` names a DID found nowhere
in the input are **missing** (an entry was dropped) -- unless a valid entry R
with sequence number one less exists, in which case R is reported as
**altered** (R took the place of the entry its successor links: it was edited
and re-signed, so its DID no longer matches the link). Entries off the walk
for any other reason descend from an entry already reported.

Of all problems found, the report names the one with the smallest position
(the walk position, or the entry's own recorded `journal_seq`; unknown
positions sort last), then the smallest input index, then the kind in the
order broken, missing, reordered, altered, forked. Dropping the newest
entries cannot be seen from the chain alone; the daily anchor covers closed
days.

Selective load (`selective_load`)
=================================

Entries are put in chain order (by `journal_seq`, then timestamp, then DID);
routine entries are dropped unless `include_routine`. Walking back from the
newest, entries are taken while the running token sum stays <= `max_tokens`;
the walk stops at the first entry that does not fit, so the result is the
longest suffix of the eligible entries within the budget, returned oldest
first. Entries are never truncated. The default token count of an entry is
`len(tokenize(content))`. Selective load reads the recorded tags; it does not
verify (run `verify_chain` first).

Daily anchor (`day_anchor`, `build_anchor`, `check_anchor`)
===========================================================

The entries of UTC day D are the journal entries (class `diary_entry`, tag
`journal`) of the agent whose `head.timestamp` falls on D (UTC); duplicates by
DID count once, other agents' entries and other days are ignored. The anchor
payload is

    {"agent_did": <agent DID>,
     "date": "YYYY-MM-DD",
     "count": <number of entries>,
     "dna_hash": "sha256:" + hex SHA-256 of UTF-8("|".join(sorted DIDs)),
     "novelty_counts": {"novel": n, "prediction_error": n, "routine": n},
     "first_did": <DID of the day's first entry in chain order> or null,
     "last_did":  <DID of the day's last entry in chain order> or null}

(DIDs sorted by code point; chain order as in selective load; an empty day
has count 0, the hash of the empty string and null first/last.) The anchor
container has class `journal_anchor` (`ANCHOR_CLASS`; unknown to other nodes,
which store and forward it), tags `["journal_anchor", "journal_date:<D>"]`,
no `related`, and is signed by the agent; it is only built once the day is
over (`now` >= midnight UTC after D). `check_anchor` verifies the anchor's
signature, verifies every entry it counts, recomputes the payload from the
entries given and compares every field.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta, timezone
from typing import Any, NamedTuple

from hmpnode.container.build import build_container
from hmpnode.container.canonical import canonical_json
from hmpnode.container.did import is_content_addressed
from hmpnode.container.encoding import parse_time, sha256_tag
from hmpnode.container.payload import PayloadError, open_payload, parse_payload_type
from hmpnode.container.verify import Verifier
from hmpnode.identity.keys import Identity

__all__ = [
    "ENTRY_CLASS",
    "ANCHOR_CLASS",
    "RELATION",
    "JOURNAL_TAG",
    "ROUTINE",
    "NOVEL",
    "PREDICTION_ERROR",
    "NOVELTY_CLASSES",
    "BROKEN",
    "MISSING",
    "REORDERED",
    "ALTERED",
    "FORKED",
    "tokenize",
    "Vocabulary",
    "Novelty",
    "assess",
    "novelty",
    "JournalEntry",
    "read_entry",
    "build_entry",
    "Journal",
    "ChainProblem",
    "ChainReport",
    "verify_chain",
    "selective_load",
    "day_anchor",
    "build_anchor",
    "check_anchor",
]

ENTRY_CLASS = "diary_entry"
ANCHOR_CLASS = "journal_anchor"
RELATION = "journal_previous"
JOURNAL_TAG = "journal"
_SEQ_PREFIX = "journal_seq:"
_NOVELTY_PREFIX = "novelty:"
_WORDS_PREFIX = "novelty_words:"
_ANCHOR_TAG = "journal_anchor"
_DATE_PREFIX = "journal_date:"

ROUTINE = "routine"
NOVEL = "novel"
PREDICTION_ERROR = "prediction_error"
NOVELTY_CLASSES = (ROUTINE, NOVEL, PREDICTION_ERROR)

BROKEN = "broken"
MISSING = "missing"
REORDERED = "reordered"
ALTERED = "altered"
FORKED = "forked"
_KIND_RANK = {BROKEN: 0, MISSING: 1, REORDERED: 2, ALTERED: 3, FORKED: 4}

_DECIMAL = re.compile(r"0|[1-9][0-9]{0,17}", re.ASCII)


# -- words and novelty -------------------------------------------------------


def _is_word_char(ch: str) -> bool:
    cat = unicodedata.category(ch)
    return cat[0] in "LMN" or cat == "Pc"


def tokenize(text: str) -> list[str]:
    """The words of `text`: NFKC, casefold, maximal runs of L*/M*/N*/Pc characters."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    words: list[str] = []
    start = -1
    for i, ch in enumerate(folded):
        if ch.isascii():
            word = ch.isalnum() or ch == "_"
        else:
            word = _is_word_char(ch)
        if word:
            if start < 0:
                start = i
        elif start >= 0:
            words.append(folded[start:i])
            start = -1
    if start >= 0:
        words.append(folded[start:])
    return words


class Vocabulary:
    """The set of words seen in the contents of earlier entries."""

    __slots__ = ("_words",)

    def __init__(self, texts: Iterable[str] = ()):
        self._words: set[str] = set()
        for text in texts:
            self.add(text)

    def add(self, text: str) -> None:
        """Add the words of `text` (call it after each entry, in chain order)."""
        self._words.update(tokenize(text))

    def copy(self) -> Vocabulary:
        other = Vocabulary()
        other._words = set(self._words)
        return other

    def __contains__(self, word: object) -> bool:
        return word in self._words

    def __len__(self) -> int:
        return len(self._words)


class Novelty(NamedTuple):
    """A novelty class with the word counts it came from."""

    cls: str
    new: int
    total: int

    @property
    def fraction(self) -> float:
        return self.new / self.total if self.total else 0.0

    @property
    def words_tag(self) -> str:
        return f"{_WORDS_PREFIX}{self.new}/{self.total}"


def _classify(new: int, total: int) -> str:
    if 2 * new > total:
        return PREDICTION_ERROR
    if 5 * new > total:
        return NOVEL
    return ROUTINE


def assess(text: str, vocabulary: Vocabulary) -> Novelty:
    """Novelty of `text` against `vocabulary` (which is not changed)."""
    tokens = tokenize(text)
    new = sum(1 for word in tokens if word not in vocabulary)
    return Novelty(_classify(new, len(tokens)), new, len(tokens))


def novelty(text: str, vocabulary: Vocabulary) -> tuple[str, float]:
    """(class, fraction of new words) of `text` against `vocabulary`."""
    result = assess(text, vocabulary)
    return result.cls, result.fraction


# -- reading entries ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """What a journal entry records, read from its (unverified) container."""

    container_did: str
    sender_did: str
    seq: int
    previous: str | None
    novelty: Novelty
    timestamp: datetime
    title: str
    content: str
    container: dict[str, Any] = field(repr=False, compare=False)


def _full_form(container: Any) -> dict[str, Any]:
    if isinstance(container, Mapping):
        if "hmp_container" in container:
            if not isinstance(container["hmp_container"], Mapping):
                raise ValueError("hmp_container must be an object")
            return dict(container)
        if "head" in container and "payload" in container:
            return {"hmp_container": dict(container)}
    raise ValueError("not a container (neither {hmp_container} nor {head, payload})")


def _read_tags(tags: Any) -> tuple[int, Novelty]:
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError("head.tags must be a list of strings")
    if tags.count(JOURNAL_TAG) != 1:
        raise ValueError(f"needs exactly one {JOURNAL_TAG!r} tag")

    def one(prefix: str) -> str:
        values = [t[len(prefix):] for t in tags if t.startswith(prefix)]
        if len(values) != 1:
            raise ValueError(f"needs exactly one {prefix}<value> tag")
        return values[0]

    seq_text = one(_SEQ_PREFIX)
    if _DECIMAL.fullmatch(seq_text) is None or seq_text == "0":
        raise ValueError(f"{_SEQ_PREFIX}{seq_text[:40]!r} is not a positive decimal")
    cls = one(_NOVELTY_PREFIX)
    if cls not in NOVELTY_CLASSES:
        raise ValueError(f"{_NOVELTY_PREFIX}{cls[:40]!r} is not a novelty class")
    new_text, slash, total_text = one(_WORDS_PREFIX).partition("/")
    if not slash or _DECIMAL.fullmatch(new_text) is None or _DECIMAL.fullmatch(total_text) is None:
        raise ValueError(f"{_WORDS_PREFIX} must be <new>/<total>")
    new, total = int(new_text), int(total_text)
    if new > total:
        raise ValueError(f"{_WORDS_PREFIX}{new}/{total}: more new words than words")
    return int(seq_text), Novelty(cls, new, total)


def read_entry(container: Any) -> JournalEntry:
    """Read the journal fields of an entry; ValueError when it is not a well-formed
    journal entry. Does not verify the signature (see `verify_chain`)."""
    full = _full_form(container)
    hmp = full["hmp_container"]
    if not isinstance(hmp, Mapping) or not isinstance(hmp.get("head"), Mapping):
        raise ValueError("hmp_container.head must be an object")
    head = hmp["head"]
    if head.get("class") != ENTRY_CLASS:
        raise ValueError(f"class is {str(head.get('class'))[:60]!r}, not {ENTRY_CLASS}")
    did, sender = head.get("container_did"), head.get("sender_did")
    if not isinstance(did, str) or not isinstance(sender, str):
        raise ValueError("container_did and sender_did must be strings")
    timestamp = parse_time(head.get("timestamp"))  # EncodingError is a ValueError
    seq, recorded = _read_tags(head.get("tags"))
    related = hmp.get("related", {})
    if not isinstance(related, Mapping):
        raise ValueError("related must be an object")
    previous = related.get(RELATION)
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise ValueError(f"related.{RELATION} must be one DID string")
    try:
        if not isinstance(head.get("payload_type"), str) or not parse_payload_type(head["payload_type"]).is_plain_json:
            raise ValueError("a journal entry has a plain json payload")
        payload = open_payload(dict(hmp))
    except PayloadError as exc:
        raise ValueError(f"payload: {exc}") from None
    if not isinstance(payload, Mapping):
        raise ValueError("payload must be an object")
    title, content = payload.get("title"), payload.get("content")
    if not isinstance(title, str) or not isinstance(content, str):
        raise ValueError("payload.title and payload.content must be strings")
    return JournalEntry(did, sender, seq, previous, recorded, timestamp, title, content, full)


def _chain_key(entry: JournalEntry) -> tuple[int, datetime, str]:
    return entry.seq, entry.timestamp, entry.container_did


# -- writing entries ------------------------------------------------------------


def _check_caller_tags(tags: Sequence[str]) -> list[str]:
    out = []
    for tag in tags:
        if not isinstance(tag, str):
            raise ValueError("tags must be strings")
        if tag == JOURNAL_TAG or tag.startswith((_SEQ_PREFIX, _NOVELTY_PREFIX, _WORDS_PREFIX)):
            raise ValueError(f"tag {tag!r} is reserved for the journal")
        out.append(tag)
    return out


def build_entry(
    identity: Identity,
    text: str,
    *,
    previous: Mapping[str, Any] | None,
    vocabulary: Vocabulary,
    now: datetime,
    title: str | None = None,
    tags: Sequence[str] = (),
) -> dict[str, Any]:
    """A signed full-form diary_entry appended after `previous` (None: the first entry).

    `vocabulary` holds the words of every earlier entry's content (it is not
    changed: add `text` to it afterwards, or use `Journal`). ValueError when
    `previous` is not this agent's journal entry or `now` is before it."""
    if not isinstance(text, str):
        raise ValueError("text must be a string")
    related = None
    seq = 1
    if previous is not None:
        prev = read_entry(previous)
        if prev.sender_did != identity.did:
            raise ValueError("previous entry is another agent's")
        if now < prev.timestamp:
            raise ValueError("now is before the previous entry's timestamp")
        seq = prev.seq + 1
        related = {RELATION: prev.container_did}
    scored = assess(text, vocabulary)
    head_tags = [JOURNAL_TAG, f"{_SEQ_PREFIX}{seq}", f"{_NOVELTY_PREFIX}{scored.cls}", scored.words_tag]
    head_tags += _check_caller_tags(tags)
    payload = {"title": title if title is not None else f"journal #{seq}", "content": text}
    return build_container(identity, ENTRY_CLASS, payload, now=now, tags=head_tags, related=related)


class Journal:
    """In-memory helper that appends entries and keeps the vocabulary in step.

    `chain` is an existing journal in chain order (e.g. `ChainReport.chain`);
    it is read, not verified."""

    def __init__(self, identity: Identity, chain: Iterable[Mapping[str, Any]] = ()):
        self.identity = identity
        self.entries: list[dict[str, Any]] = []
        self.vocabulary = Vocabulary()
        for container in chain:
            entry = read_entry(container)
            self.entries.append(entry.container)
            self.vocabulary.add(entry.content)

    @property
    def head(self) -> dict[str, Any] | None:
        return self.entries[-1] if self.entries else None

    def append(self, text: str, *, now: datetime, title: str | None = None, tags: Sequence[str] = ()) -> dict[str, Any]:
        container = build_entry(
            self.identity, text, previous=self.head, vocabulary=self.vocabulary, now=now, title=title, tags=tags
        )
        self.extend(read_entry(container))
        return container

    def extend(self, entry: JournalEntry) -> None:
        """Take an entry built on the current head (by `build_entry`) as the new head."""
        self.entries.append(entry.container)
        self.vocabulary.add(entry.content)


# -- verifying the chain -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChainProblem:
    """The first problem of a chain.

    index         -- position of the offending entry in the list given
    container_did -- its DID (None when unreadable)
    kind          -- broken | missing | reordered | altered | forked
    position      -- its place in the chain (walk position or recorded seq; None if unknown)
    detail        -- one line for people
    other_did     -- the other DID involved: the absent predecessor (missing),
                     the predecessor (reordered), the main-branch sibling (forked)
    """

    index: int
    container_did: str | None
    kind: str
    position: int | None
    detail: str
    other_did: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "container_did": self.container_did,
            "kind": self.kind,
            "position": self.position,
            "detail": self.detail,
            "other_did": self.other_did,
        }


@dataclass(frozen=True, slots=True)
class ChainReport:
    """ok -- no problem; count -- entries on the verified chain (all of them when
    ok, else those before the first problem the walk met); chain -- those entries
    in chain order; head_did -- the last of them."""

    ok: bool
    count: int
    first_problem: ChainProblem | None
    chain: list[dict[str, Any]] = field(repr=False)
    head_did: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "count": self.count,
            "head_did": self.head_did,
            "first_problem": self.first_problem.to_json() if self.first_problem else None,
        }


def _claimed(raw: Any) -> tuple[str | None, int | None]:
    """(container_did, journal_seq) as claimed by a possibly hostile entry; never raises."""
    try:
        head = _full_form(raw)["hmp_container"]["head"]
        did = head.get("container_did")
        did = did if isinstance(did, str) else None
        seq = None
        tags = head.get("tags")
        if isinstance(tags, list):
            seqs = [t[len(_SEQ_PREFIX):] for t in tags if isinstance(t, str) and t.startswith(_SEQ_PREFIX)]
            if len(seqs) == 1 and _DECIMAL.fullmatch(seqs[0]):
                seq = int(seqs[0])
        return did, seq
    except Exception:  # noqa: BLE001 - anything unreadable has no claims
        return None, None


def _heights(valid: dict[str, tuple[int, JournalEntry]], children: dict[str | None, list[str]]) -> dict[str, int]:
    """Length of the longest chain of descendants below each valid entry (iterative)."""
    height: dict[str, int] = {}
    for start in valid:
        if start in height:
            continue
        stack = [(start, False)]
        on_stack = {start}
        while stack:
            did, done = stack.pop()
            if done:
                kids = [k for k in children.get(did, ()) if k in height]
                height[did] = 1 + max((height[k] for k in kids), default=-1)
                on_stack.discard(did)
                continue
            stack.append((did, True))
            for kid in children.get(did, ()):
                if kid not in height and kid not in on_stack:  # on_stack: a cycle (opaque DIDs only)
                    on_stack.add(kid)
                    stack.append((kid, False))
    return height


def verify_chain(
    entries: Sequence[Any],
    *,
    identity_did: str,
    verifier: Verifier | None = None,
    now: datetime,
) -> ChainReport:
    """Check a whole journal (see the module docstring). Never raises on bad entries."""
    verifier = verifier if verifier is not None else Verifier()
    problems: list[ChainProblem] = []
    valid: dict[str, tuple[int, JournalEntry]] = {}
    seen: set[str] = set()  # every DID claimed in the input, valid or not

    for index, raw in enumerate(entries):
        result = verifier.verify(raw, now=now)
        claimed_did, claimed_seq = _claimed(result.container if result.container is not None else raw)
        if claimed_did is not None:
            seen.add(claimed_did)
        if not result.ok:
            why = f"does not verify: {result.reason}: {result.detail}"
            problems.append(ChainProblem(index, claimed_did, BROKEN, claimed_seq, why))
            continue
        did = result.container_did
        assert did is not None and result.container is not None
        if not is_content_addressed(did):
            problems.append(ChainProblem(index, did, BROKEN, claimed_seq, "container_did is not content-addressed"))
            continue
        try:
            entry = read_entry(result.container)
        except Exception as exc:  # noqa: BLE001 - ValueError expected; be safe on hostile input
            problems.append(ChainProblem(index, did, BROKEN, claimed_seq, f"not a journal entry: {exc}"))
            continue
        if entry.sender_did != identity_did:
            why = f"signed by {entry.sender_did}, not {identity_did}"
            problems.append(ChainProblem(index, did, BROKEN, entry.seq, why))
            continue
        if did not in valid:
            valid[did] = (index, entry)

    children: dict[str | None, list[str]] = {}
    for did, (_, entry) in valid.items():
        children.setdefault(entry.previous, []).append(did)
    height = _heights(valid, children)

    # Walk from the root along the main branch.
    chain: list[dict[str, Any]] = []
    walked: set[str] = set()
    vocabulary = Vocabulary()
    current: JournalEntry | None = None

    def ordered_children(parent: str | None) -> list[str]:
        kids = [k for k in children.get(parent, ()) if k not in walked]
        return sorted(kids, key=lambda k: (-height.get(k, 0), valid[k][1].timestamp, k))

    while True:
        kids = ordered_children(current.container_did if current else None)
        if not kids:
            break
        position = len(chain) + 1
        main_index, main = valid[kids[0]]
        for other in kids[1:]:
            problems.append(ChainProblem(
                valid[other][0], other, FORKED, position,
                f"a second entry at position {position} on the same previous entry", kids[0],
            ))
        step: ChainProblem | None = None
        prev_did = current.container_did if current else None
        if main.seq < position:
            step = ChainProblem(main_index, main.container_did, REORDERED, position,
                                f"journal_seq {main.seq} at chain position {position}", prev_did)
        elif current is not None and main.timestamp < current.timestamp:
            step = ChainProblem(main_index, main.container_did, REORDERED, position,
                                "timestamp is earlier than the previous entry's", prev_did)
        elif main.seq > position:
            after = ordered_children(main.container_did)
            swapped = bool(after) and valid[after[0]][1].seq < main.seq
            step = ChainProblem(main_index, main.container_did, REORDERED if swapped else ALTERED, position,
                                f"journal_seq {main.seq} at chain position {position}"
                                + (f", followed by {valid[after[0]][1].seq}" if swapped else ""), prev_did)
        else:
            expected = assess(main.content, vocabulary)
            if expected != main.novelty:
                step = ChainProblem(
                    main_index, main.container_did, ALTERED, position,
                    f"records {main.novelty.cls} {main.novelty.new}/{main.novelty.total}, "
                    f"recomputed {expected.cls} {expected.new}/{expected.total}",
                )
        if step is not None:
            problems.append(step)
            break
        if len(kids) > 1:
            break
        chain.append(main.container)
        walked.add(main.container_did)
        vocabulary.add(main.content)
        current = main

    # Entries whose predecessor is nowhere in the input.
    by_seq: dict[int, list[tuple[int, JournalEntry]]] = {}
    for index, entry in valid.values():
        by_seq.setdefault(entry.seq, []).append((index, entry))
    for did, (index, entry) in valid.items():
        if did in walked or entry.previous is None or entry.previous in seen:
            continue
        stand_ins = [(i, e) for i, e in by_seq.get(entry.seq - 1, ()) if e.container_did != entry.previous]
        if stand_ins:
            i, e = min(stand_ins, key=lambda ie: ie[0])
            problems.append(ChainProblem(
                i, e.container_did, ALTERED, e.seq,
                f"the next entry links {entry.previous}: this entry was changed and re-signed", entry.container_did,
            ))
        else:
            problems.append(ChainProblem(
                index, did, MISSING, entry.seq, f"links {entry.previous}, which is not in the journal", entry.previous,
            ))

    if not problems and len(walked) != len(valid):  # cannot happen; never report ok with unplaced entries
        did = min(set(valid) - walked)
        why = "not reachable from the first entry"
        problems.append(ChainProblem(valid[did][0], did, MISSING, valid[did][1].seq, why))

    first = None
    if problems:
        first = min(problems, key=lambda p: (
            p.position if p.position is not None else float("inf"), p.index, _KIND_RANK[p.kind]))
    head_did = current.container_did if current else None
    return ChainReport(first is None, len(chain), first, chain, head_did)


# -- selective load -------------------------------------------------------------------


def _default_tokens(entry: Mapping[str, Any]) -> int:
    return len(tokenize(read_entry(entry).content))


def selective_load(
    entries: Iterable[Mapping[str, Any]],
    *,
    max_tokens: int,
    count_tokens: Callable[[dict[str, Any]], int] | None = None,
    include_routine: bool = False,
) -> list[dict[str, Any]]:
    """The newest entries (non-routine unless `include_routine`) whose token counts
    sum to at most `max_tokens`, oldest first; see the module docstring."""
    if max_tokens < 0:
        raise ValueError("max_tokens must be >= 0")
    count = count_tokens or _default_tokens
    read = sorted((read_entry(e) for e in entries), key=_chain_key)
    eligible = [e for e in read if include_routine or e.novelty.cls != ROUTINE]
    picked: list[dict[str, Any]] = []
    used = 0
    for entry in reversed(eligible):
        cost = count(entry.container)
        if not isinstance(cost, int) or cost < 0:
            raise ValueError("count_tokens must return a non-negative int")
        if used + cost > max_tokens:
            break
        used += cost
        picked.append(entry.container)
    picked.reverse()
    return picked


# -- daily anchor -------------------------------------------------------------------------


def _day_entries(entries: Iterable[Any], day: date, agent_did: str) -> list[JournalEntry]:
    out: dict[str, JournalEntry] = {}
    for container in entries:
        head = _full_form(container)["hmp_container"].get("head")
        if not isinstance(head, Mapping):
            raise ValueError("hmp_container.head must be an object")
        if head.get("class") != ENTRY_CLASS or head.get("sender_did") != agent_did:
            continue
        tags = head.get("tags")
        if not isinstance(tags, list) or JOURNAL_TAG not in tags:
            continue
        if parse_time(head.get("timestamp")).date() != day:
            continue
        entry = read_entry(container)
        out.setdefault(entry.container_did, entry)
    return sorted(out.values(), key=_chain_key)


def day_anchor(entries: Iterable[Any], day: date, *, agent_did: str) -> dict[str, Any]:
    """The anchor payload committing to `agent_did`'s journal entries of UTC `day`.
    ValueError when an item is not a container or an entry of that day is not a
    well-formed journal entry. Does not verify signatures (`check_anchor` does)."""
    todays = _day_entries(entries, day, agent_did)
    dids = sorted(e.container_did for e in todays)
    counts = {cls: 0 for cls in sorted(NOVELTY_CLASSES)}
    for e in todays:
        counts[e.novelty.cls] += 1
    return {
        "agent_did": agent_did,
        "date": day.isoformat(),
        "count": len(todays),
        "dna_hash": sha256_tag("|".join(dids).encode("utf-8")),
        "novelty_counts": counts,
        "first_did": todays[0].container_did if todays else None,
        "last_did": todays[-1].container_did if todays else None,
    }


def build_anchor(identity: Identity, entries: Iterable[Any], day: date, *, now: datetime) -> dict[str, Any]:
    """The signed `journal_anchor` container for `day`; ValueError before the day is over."""
    day_end = datetime.combine(day, time(), tzinfo=timezone.utc) + timedelta(days=1)
    if now < day_end:
        raise ValueError(f"{day.isoformat()} is not over yet (UTC)")
    payload = day_anchor(entries, day, agent_did=identity.did)
    return build_container(
        identity, ANCHOR_CLASS, payload, now=now, tags=[_ANCHOR_TAG, f"{_DATE_PREFIX}{day.isoformat()}"]
    )


def check_anchor(
    anchor: Any,
    entries: Iterable[Any],
    *,
    verifier: Verifier | None = None,
    now: datetime | None = None,
) -> tuple[bool, str]:
    """Verify `anchor` and recompute it from `entries`: (True, "") or (False, why).

    `now` is only used for the verifier's clock-skew check (default: the anchor's
    own timestamp, i.e. no clock check). Never raises."""
    try:
        return _check_anchor(anchor, list(entries), verifier or Verifier(), now)
    except Exception as exc:  # noqa: BLE001 - hostile anchors or entries must not crash the caller
        return False, f"cannot check: {type(exc).__name__}: {exc}"


def _check_anchor(anchor: Any, entries: list[Any], verifier: Verifier, now: datetime | None) -> tuple[bool, str]:
    full = _full_form(anchor)
    head = full["hmp_container"].get("head")
    if not isinstance(head, Mapping):
        return False, "anchor has no head"
    clock = now if now is not None else parse_time(head.get("timestamp"))
    result = verifier.verify(full, now=clock)
    if not result.ok:
        return False, f"anchor does not verify: {result.reason}: {result.detail}"
    if head.get("class") != ANCHOR_CLASS:
        return False, f"class is not {ANCHOR_CLASS}"
    payload = open_payload(full["hmp_container"])
    if not isinstance(payload, Mapping):
        return False, "anchor payload is not an object"
    if payload.get("agent_did") != head["sender_did"]:
        return False, "anchor agent_did is not its signer"
    day_text = payload.get("date")
    if not isinstance(day_text, str):
        return False, "anchor date is not a string"
    try:
        day = date.fromisoformat(day_text)
    except ValueError:
        return False, "anchor date is not YYYY-MM-DD"
    if day.isoformat() != day_text:
        return False, "anchor date is not YYYY-MM-DD"
    agent = head["sender_did"]
    for e in _day_entries(entries, day, agent):
        checked = verifier.verify(e.container, now=clock if now is not None else e.timestamp)
        if not checked.ok:
            return False, f"entry {e.container_did} does not verify: {checked.reason}"
    expected = day_anchor(entries, day, agent_did=agent)
    def same(key: str) -> bool:
        return key in payload and key in expected and canonical_json(payload[key]) == canonical_json(expected[key])

    wrong = sorted(k for k in set(expected) | set(payload) if not same(k))
    if wrong:
        return False, "anchor disagrees with the entries on " + ", ".join(wrong)
    return True, ""
