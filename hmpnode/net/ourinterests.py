"""What our agent wants (docs/protocol.md 33): its declaration, announced to every peer in
a peer_query, saved by the API, and the DHT topics it follows.

A node feature on top of the sessions (`hmpnode.net.interests` holds the rules and the
parsing); the driver sends the declaration on each new connection (`send`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from hmpnode.net import drive
from hmpnode.net.interests import ChangedTooOften, InterestError, InterestLimits, Interests, topic_changes
from hmpnode.net.penalty import TokenBucket

if TYPE_CHECKING:
    from hmpnode.net.host import Host
    from hmpnode.net.link import Link

__all__ = ["OurInterests"]

log = logging.getLogger("hmpnode.mesh")


class OurInterests:
    """The agent's declaration (`current`) and where it comes from (`source`: "config",
    [interests], or "api", saved by PUT /v1/interests)."""

    def __init__(self, host: Host, reach: Callable[[str], Awaitable[Any]]) -> None:
        self.host, self._reach = host, reach
        s = host.settings
        self.limits = InterestLimits(max_entries=s.session.max_interest_entries)
        self.file: Path = host.node.data_dir / "interests.json"
        self.source = "config"
        self.current = self._load()
        self._lock = asyncio.Lock()
        #: changes the agent may make: at most half of a peer's default peer_query budget,
        #: so that announcing them never earns this node a strike (33.2)
        self.changes = TokenBucket(s.session.peer_queries_per_minute / 120.0,
                                   max(s.session.peer_queries_per_minute / 2, 1.0))

    def _load(self) -> Interests:
        """The declaration the API saved (it outlives a restart), else [interests]. A file
        that cannot be read is logged and [interests] used (never a node that cannot start)."""
        declared = self.host.settings.declared
        try:
            data = self.file.read_bytes()
        except FileNotFoundError:
            return declared
        try:
            saved = Interests.parse(orjson.loads(data), self.limits)
            self.source = "api"
            return saved
        except (orjson.JSONDecodeError, InterestError, OSError) as exc:
            log.error("%s: %s; using [interests]", self.file, exc)
            return declared

    def send(self, link: Link) -> None:
        """Our declaration to one peer (queued); nothing when we declare nothing, so that
        peers that predate peer_query never see one (33.2)."""
        if self.current.declared:
            link.session.send_interests(self.current, self.host.settings.roles, self.host.node.now())

    async def set(self, new: Interests | None) -> Interests:
        """The agent declares `new` (None: back to [interests]): saved, announced to every
        peer (then a reconciliation brings what it now wants and lacks), the DHT topic
        records follow the topics, and peers following a new topic are looked up and dialled.
        ChangedTooOften when changed faster than `changes` allows; OSError when
        it cannot be saved (nothing changed then)."""
        if not self.changes.take(time.monotonic()):
            raise ChangedTooOften("interests changed too often; at most "
                                  f"{self.host.settings.session.peer_queries_per_minute / 2:g} per minute")
        async with self._lock:  # one change at a time: each is announced after the one before
            return await self._set(new)

    async def _set(self, new: Interests | None) -> Interests:
        host, s = self.host, self.host.settings
        old = self.current
        if new is None:
            await asyncio.to_thread(self.file.unlink, missing_ok=True)
            new = s.declared
        else:
            from hmpnode.fsutil import write_private_file

            await asyncio.to_thread(write_private_file, self.file, new.to_json(), replace=True)
        self.current = new
        self.source = "config" if new is s.declared else "api"
        host.counters["interests_changed"] += 1
        for link in list(host.sessions.values()):
            if link.closed:
                continue
            if new.declared or old.declared:  # a peer told of a declaration is told it ended
                link.session.send_interests(new, s.roles, host.node.now())
            if link.session.recon_out:  # one in progress: it goes on; what it misses comes next connection
                await link.flush()
            else:
                await drive.run(host.core.start_sync(link), host.world)
        started, stopped = topic_changes(old, new, s.interests)
        if host.dht is not None:
            for topic in stopped:
                host.dht.leave_topic(topic)
            for topic in started:
                host.spawn(self.follow_topic(topic, announce=True))
        return new

    async def follow_topic(self, topic: str, *, announce: bool) -> None:
        """Announce that we follow `topic` (unless done already) and dial a few of the
        agents that follow it too (interests.topic_dials), so that they find each other."""
        host = self.host
        try:
            if announce:
                await host.dht.announce_topic(topic)
            found = [d for d in await host.dht.find_topic(topic) if d != host.identity.did and d not in host.sessions]
        except Exception:
            log.exception("DHT topic %r failed", topic)
            return
        host.counters["topic_peers_found"] += len(found)
        for did in found[:host.settings.dialing.topic_dials]:
            await self._reach(did)
