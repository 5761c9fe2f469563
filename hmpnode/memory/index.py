"""What the full-text index holds for a container, and how a query is written (sans-IO).

- Text: every string value of the payload (depth-first, in document order,
  keys excluded), one per line, at most `MAX_TEXT_CHARS`. Plain payloads are
  read as stored; an encrypted payload is indexed only when this node's agent
  is a recipient, from its decrypted text. That text stays in the local index
  and is never sent anywhere (search results show it only to this agent).
- Tags and class are indexed as their own columns.
- Index tokenizer: FTS5 `porter unicode61 remove_diacritics 2` (Unicode
  words, case and diacritics folded, English words stemmed: "listen" finds
  "listens").
- Queries: the words of the query text (Unicode letters and digits,
  lowercased, at most `MAX_QUERY_TERMS` distinct) minus common English and
  Russian function words (`STOPWORDS`; kept when nothing else is left), each
  quoted, joined by OR; FTS5 ranks with BM25. Quoting makes every user string
  a literal term: no FTS syntax from the user ever reaches SQLite.

Lifecycle (issue 5), derived from containers, never a stored flag, in this
order of precedence: `revoked` (the sender's key was revoked, profile 4),
`retracted` (a held container by the same sender `contradicts` it: the
author's own retraction, final: `include_contested` and evaluations never bring
it back), `superseded` (a held container by the same sender lists it in
`related.previous_version`), `expired` (its `ttl` passed), `contested` (a
held container `contradicts` it, or the sum of its active evaluations is
negative), else `active`.
"""

from __future__ import annotations

import functools
import gzip
import importlib.resources
import re
import string
import unicodedata
from dataclasses import dataclass
from typing import Any

from hmpnode.container.compression import DEFAULT_MAX_DECOMPRESSED
from hmpnode.container.payload import PayloadError, open_payload
from hmpnode.identity.keys import Identity

__all__ = ["MAX_TEXT_CHARS", "MAX_QUERY_TERMS", "STATES", "STOPWORDS", "payload_text", "searchable", "words_of", "query_terms",
           "fts_query", "FILLER", "FAMILIES", "QueryTerm", "recall_terms", "fts_any", "stem", "text_words",
           "unknown_name", "typos_of", "TYPO_MIN_LETTERS"]

MAX_TEXT_CHARS = 65_536
MAX_QUERY_TERMS = 32
STATES = ("active", "superseded", "expired", "contested", "revoked", "retracted")
_WORD = re.compile(r"[^\W_]+", re.UNICODE)


def payload_text(value: Any, limit: int = MAX_TEXT_CHARS) -> str:
    """Every string value of `value`, one per line, cut at `limit` characters."""
    out: list[str] = []
    size = 0
    stack = [value]
    while stack and size < limit:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
            size += len(item) + 1
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list):
            stack.extend(reversed(item))
    return "\n".join(out)[:limit]


def searchable(hmp: dict[str, Any], identity: Identity | None, opened: Any = None,
               max_bytes: int = DEFAULT_MAX_DECOMPRESSED) -> tuple[str, str, str]:
    """(text, tags, class) to index for a stored container; `opened` is its payload
    (or its `payload_text`) when verification already opened it (VerifyResult.payload).
    Otherwise (encrypted for this agent) it is opened here, expanding to at most `max_bytes`."""
    head = hmp["head"]
    text = ""
    payload = opened
    if payload is None:
        try:
            payload = open_payload(hmp, identity, max_bytes=max_bytes)
        except (PayloadError, ValueError, KeyError, TypeError):
            payload = None  # sealed for someone else, or an unknown compression
    if payload is not None and not isinstance(payload, (bytes, bytearray)):
        text = payload_text(payload)
    tags = " ".join(t for t in head.get("tags") or () if isinstance(t, str))
    return text, tags, str(head.get("class", ""))


def words_of(text: str) -> set[str]:
    """The lowercased words of a text (the query tokenizer, uncapped)."""
    return set(_WORD.findall(text.lower()))


STOPWORDS = frozenset("""
a an the of on in at to for is are was were be been being does do did doing which what who whom whose where
when how why it its this that these those and or not no nor with by from as about into than then there here
we you they he she i me my our your their his her them us can could will would shall should may might must
has have had having if so but also just only any some such very own same too
и в во не что он на я с со как а то все она так его но да ты к у же вы за бы по только ее мне было вот от
меня еще нет о из ему теперь когда даже ну ли если уже или ни быть был него до вас нибудь опять уж вам ведь
там потом себя ничего ей может они тут где есть надо ней для мы тебя их чем была сам без чего раз тоже себе
под будет ж тогда кто этот того потому этого какой ним здесь этом один мой тем чтобы нее куда зачем всех
можно при об хоть после над тот через эти нас про всего них какая эту моя свою этой перед им
""".split())


def query_terms(text: str) -> list[str]:
    """The distinct lowercased words of a query, in order, without stop words
    (unless nothing else is left), at most MAX_QUERY_TERMS."""
    words = list(dict.fromkeys(_WORD.findall(text.lower())))
    terms = [w for w in words if w not in STOPWORDS] or words
    return terms[:MAX_QUERY_TERMS]


def fts_query(terms: list[str]) -> str | None:
    """An FTS5 MATCH expression: every term a quoted literal, any of them (BM25 ranks)."""
    if not terms:
        return None
    return " OR ".join('"' + t.replace('"', '""') + '"' for t in terms)


# -- recall's query terms (issue 12) -------------------------------------------------------

#: words of a question that say nothing about what is asked: dropped from recall queries on
#: top of STOPWORDS (so "what is the current port" does not need a memory saying "current")
FILLER = frozenset("""
current currently now latest recent recently today please tell know remember recall exactly actually still
again ever value use uses used using have get got set s t d ll re ve m
""".split())

#: word families the index's Porter stemmer does not join ("decide" -> decid, "decision" ->
#: decis), and a few cheap synonyms; a query word in a family matches any member. Porter
#: joins inflections within a member already ("decided", "decisions"), so a family lists
#: one form per stem (every form is one more phrase for BM25 to score on every hit).
FAMILIES: tuple[tuple[str, ...], ...] = (
    ("decide", "decision"),
    ("choose", "chose", "chosen", "choice"),
    ("agree", "agreement"),
    ("database", "db"),
    ("configuration", "config", "setting"),
    ("address", "addr"),
    ("role", "job", "responsible"),
    ("owner", "owns", "maintainer"),
    ("password", "passwd"),
)
_FAMILY = {word: family for family in FAMILIES for word in family}


def _family(word: str) -> tuple[str, ...] | None:
    """The family of a query word, also when inflected ("decided", "decisions", "settings")."""
    for cut in ("", "s", "es", "d", "ed"):
        if not cut or word.endswith(cut):
            family = _FAMILY.get(word[: len(word) - len(cut)])
            if family is not None:
                return family
    return None


#: an identifier written as one: words joined by - _ . / : ("billing-v7", "retry_limit")
_COMPOUND = re.compile(r"[^\W_]+(?:[-_./:][^\W_]+)+", re.UNICODE)


@dataclass(frozen=True)
class QueryTerm:
    """One word of a recall query and the forms it matches (itself first). `identifying`:
    it holds a digit ("v7", "5432"), is part of a compound ("billing-v7", "retry_limit")
    or is capitalised past the query's first word (a name): a memory that does not
    match it is about something else."""
    word: str
    forms: tuple[str, ...]
    identifying: bool = False


def recall_terms(text: str) -> list[QueryTerm]:
    """The distinct content words of a recall query, in order (at most MAX_QUERY_TERMS),
    each with its family. Unlike `query_terms`, a query of only stop words and filler has
    no terms: recall abstains instead of matching filler."""
    out: list[QueryTerm] = []
    seen: set[str] = set()
    raw = _WORD.findall(text)
    named = {w.lower() for w in raw[1:] if w[:1].isupper()}
    named |= {w.lower() for compound in _COMPOUND.findall(text) for w in _WORD.findall(compound)}
    for word in dict.fromkeys(w.lower() for w in raw):
        if word in STOPWORDS or word in FILLER:
            continue
        forms = _family(word) or (word,)
        key = forms[0]
        if key in seen:
            continue
        seen.add(key)
        identifying = word in named or any(ch.isdigit() for ch in word)
        out.append(QueryTerm(word, (word, *[f for f in forms if f != word]), identifying))
        if len(out) == MAX_QUERY_TERMS:
            break
    return out


def fts_any(forms: tuple[str, ...] | list[str]) -> str:
    """An FTS5 expression matching any of `forms`, each a quoted literal."""
    return " OR ".join('"' + f.replace('"', '""') + '"' for f in forms)


_SUFFIXES = ("ations", "ation", "ings", "ing", "ions", "ion", "edly", "ed", "es", "ly", "s")


@functools.lru_cache(maxsize=65_536)
def stem(word: str) -> str:
    """A crude, deterministic stem for proximity in recall ranking (the index's Porter
    stemmer decides what matches; this only lines words up for the phrase bonus)."""
    family = _family(word)
    if family is not None:
        return family[0]
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)]
    return word


def text_words(text: str) -> list[str]:
    """The lowercased words of a text, in order (what proximity is measured on)."""
    return _WORD.findall(text.lower())


# -- names the memory never heard of (recall's rule 1) ---------------------------------------

#: a query word of at least this many letters that is one typo from an English word of one
#: more letter or longer is taken for that word (the 5-letter "bakup" for "backup"); shorter
#: words are too close to too many: of 3 000 made-up names (CV syllables) 5.8 % are one
#: edit from some English word, 1.3 % with these bounds
TYPO_MIN_LETTERS = 5


@functools.cache
def _english() -> frozenset[str]:
    """Common English words: SCOWL sizes 10-50, lowercase (english.txt.gz says how it was made
    and carries its licence); read on first use, 6-7 MB."""
    data = gzip.decompress(importlib.resources.files(__package__).joinpath("english.txt.gz").read_bytes())
    return frozenset(w for w in data.decode().split("\n") if w and not w.startswith("#"))


def _one_typo(word: str) -> set[str]:
    """The words one typo from `word`: a letter dropped, added or changed, two letters swapped."""
    cuts = [(word[:i], word[i:]) for i in range(len(word) + 1)]
    return ({a + b[1:] for a, b in cuts if b} | {a + b[1] + b[0] + b[2:] for a, b in cuts if len(b) > 1}
            | {a + c + b[1:] for a, b in cuts if b for c in string.ascii_lowercase}
            | {a + c + b for a, b in cuts for c in string.ascii_lowercase})


def _fold(word: str) -> str:
    """`word` lowercased, its diacritics removed (as the index folds them)."""
    return "".join(ch for ch in unicodedata.normalize("NFKD", word.lower()) if not unicodedata.combining(ch))


def typos_of(word: str) -> set[str]:
    """The words of more than `TYPO_MIN_LETTERS` letters that `word` (folded) is one typo from;
    none for a word shorter than `TYPO_MIN_LETTERS`."""
    folded = _fold(word)
    if len(folded) < TYPO_MIN_LETTERS:
        return set()
    return {w for w in _one_typo(folded) if len(w) > TYPO_MIN_LETTERS}


def unknown_name(word: str) -> bool:
    """Whether a query word that no memory searched holds may name something the memory
    never heard of (recall's rule 1): a word of Latin letters (diacritics removed, as the
    index does) that is neither a common English word nor one typo from one. An English
    word, a typo, an inflection ("clusters": the list has them) or a word in another
    script is not: the list says nothing about a script it does not cover."""
    folded = _fold(word)
    if not (folded.isascii() and folded.isalpha()):
        return False
    english = _english()
    return folded not in english and not typos_of(folded) & english
