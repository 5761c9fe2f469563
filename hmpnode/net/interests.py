"""What the agent wants to receive from the mesh: its declared interests (docs/protocol.md 33), sans-IO.

An agent declares classes, tags, senders and topics (config `[interests]`, the API,
the CLI). The node announces them to each peer in a `peer_query` MCE message (spec
4.8) and the peers push and announce broadcasts to it only when one matches
(`Interests.matches`): selective sync (spec 6.10.3), the mesh's answer to a flood.

Rules (docs/protocol.md#rule-interest-match and the other rules of section 33):

- a container matches when ANY declared entry does: its class is a declared class,
  its sender a declared sender, or one of its head `tags` a declared tag or topic
  (a topic is a tag that is also published in the DHT, so nodes find each other by it);
- `peer_announce` always matches (`ALWAYS`): the node itself acts on it (addresses,
  key revocations);
- nothing declared, or mode "everything" (relays, archives), matches everything: a
  node that declares nothing behaves as before, and sends no `peer_query` at all.

Only broadcasts are filtered (the session's `wants`); directed containers reach
their recipients (and relays carry them) whatever anyone declared.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = ["MODES", "FIELDS", "ALWAYS", "InterestLimits", "InterestError", "ChangedTooOften", "Interests",
           "topic_changes"]

MODES = ("selective", "everything")
#: the declared lists, in the order they are shown
FIELDS = ("classes", "tags", "senders", "topics")
#: classes every node receives whatever it declared: the node acts on them itself
ALWAYS = frozenset({"peer_announce"})
#: peer_query members -> our lists: the spec's `interests` (thematic domains) are our tags,
#: its `topics` ours; `classes`, `senders` and `mode` are hmpnode's extensions (33.1)
QUERY_MEMBERS = {"classes": "classes", "interests": "tags", "senders": "senders", "topics": "topics"}


@dataclass(frozen=True, slots=True)
class InterestLimits:
    """Bounds of one declaration, ours and a peer's ([interests] max_entries, max_chars)."""

    #: entries per list (classes, tags, senders, topics)
    max_entries: int = 64
    #: characters per entry (a topic is also a DHT key: at most 128 there)
    max_chars: int = 128


class InterestError(ValueError):
    """A declaration refused: `field` names the list (or `mode`), the message says why."""

    def __init__(self, field_: str, detail: str):
        super().__init__(f"{field_}: {detail}")
        self.field = field_
        self.detail = detail


def _entries(name: str, raw: Any, limits: InterestLimits) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)):
        raise InterestError(name, "must be a list of strings")
    items = tuple(dict.fromkeys(raw))  # repeats dropped, order kept
    if len(items) > limits.max_entries:
        raise InterestError(name, f"{len(items)} entries; at most {limits.max_entries} ([interests] max_entries)")
    for item in items:
        if not isinstance(item, str) or not 0 < len(item) <= limits.max_chars or not item.isprintable():
            raise InterestError(name, f"entries must be 1..{limits.max_chars} printable characters")
        if name == "senders" and not item.startswith("did:"):
            raise InterestError(name, f"{item[:64]!r} is not a DID")
    return items


class ChangedTooOften(Exception):
    """The agent changes its declaration faster than its peers take peer_query messages."""


@dataclass(frozen=True, slots=True)
class Interests:
    """One declaration: `mode` and the four lists (empty lists and "selective": everything)."""

    mode: str = "selective"
    classes: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    senders: tuple[str, ...] = ()
    topics: tuple[str, ...] = ()
    #: what `matches` looks up: sets, built once (a declaration is matched per container and peer)
    _classes: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)
    _senders: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)
    _tags: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)
    _all: bool = field(default=True, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InterestError("mode", f"must be one of {', '.join(MODES)}")
        object.__setattr__(self, "_classes", frozenset(self.classes) | ALWAYS)
        object.__setattr__(self, "_senders", frozenset(self.senders))
        object.__setattr__(self, "_tags", frozenset(self.tags) | frozenset(self.topics))
        object.__setattr__(self, "_all", self.mode == "everything" or not any(getattr(self, n) for n in FIELDS))

    @classmethod
    def parse(cls, obj: Mapping[str, Any], limits: InterestLimits = InterestLimits()) -> Interests:
        """A declaration from the API, the CLI or the config (unknown members refused)."""
        if not isinstance(obj, Mapping):
            raise InterestError("body", "must be an object")
        unknown = sorted(set(obj) - {"mode", *FIELDS})
        if unknown:
            raise InterestError(str(unknown[0])[:64], f"unknown member; allowed: mode, {', '.join(FIELDS)}")
        mode = obj.get("mode", "selective")
        if mode not in MODES:
            raise InterestError("mode", f"must be one of {', '.join(MODES)}")
        return cls(mode, *(_entries(name, obj.get(name), limits) for name in FIELDS))

    @classmethod
    def from_query(cls, payload: Mapping[str, Any], limits: InterestLimits = InterestLimits()) -> Interests:
        """A peer's declaration from its `peer_query` payload (33.1); `expertise` and
        `roles` are what it is, not what it wants: not filters."""
        mode = payload.get("mode", "selective")
        if mode not in MODES:
            raise InterestError("mode", f"must be one of {', '.join(MODES)}")
        lists = {ours: _entries(member, payload.get(member), limits) for member, ours in QUERY_MEMBERS.items()}
        return cls(mode, **lists)

    @property
    def declared(self) -> bool:
        """Anything to announce (else no `peer_query` is sent: peers give everything anyway)."""
        return self.mode == "everything" or any(getattr(self, name) for name in FIELDS)

    @property
    def everything(self) -> bool:
        return self._all

    def matches(self, head: Any) -> bool:
        """Does a container with this head (or index entry head) interest the agent?"""
        if self._all:
            return True
        if not isinstance(head, dict):
            return False
        class_, sender = head.get("class"), head.get("sender_did")
        if (isinstance(class_, str) and class_ in self._classes) or (isinstance(sender, str) and sender in self._senders):
            return True
        tags = head.get("tags")
        if not isinstance(tags, list):
            return False
        try:
            return not self._tags.isdisjoint(tags)
        except TypeError:  # an unhashable tag (a peer's junk): only the strings count
            return any(isinstance(t, str) and t in self._tags for t in tags)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, **{name: list(getattr(self, name)) for name in FIELDS}}

    def query_payload(self, roles: Iterable[str] = ()) -> dict[str, Any]:
        """The `peer_query` payload announcing this declaration (33.1)."""
        out: dict[str, Any] = {member: list(getattr(self, ours)) for member, ours in QUERY_MEMBERS.items()}
        out["roles"] = list(roles)
        out["mode"] = self.mode
        return out

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict(), option=orjson.OPT_INDENT_2)


def topic_changes(old: Interests, new: Interests, standing: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """The DHT topic records to start and to stop when the declaration changes from `old`
    to `new`; `standing` topics (node.interests) keep theirs whatever was declared."""
    keep = set(standing)
    before, after = set(old.topics) | keep, set(new.topics) | keep
    return [t for t in new.topics if t not in before], [t for t in old.topics if t not in after]
