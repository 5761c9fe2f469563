"""What this node publishes in the DHT: its peer record and provider records.

Node-wide jobs next to the Dht (`dht`, `dhtrecords`), which keeps and answers
records but decides nothing about what to publish: our peer record (addresses,
roles, mailmen) once the DHT has neighbours and again as it grows
(`should_publish`), and provider records for the agent's unscoped broadcasts,
listed on disk by the forward loop (`queue_provider_records`) and signed at a
bounded rate by `provide_loop` (docs/protocol.md 26.7). `Publisher` owns what says
a provider record is due (`due`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from hmpnode.net.announce import OwnAnnounce, outward_first
from hmpnode.net.penalty import TokenBucket
from hmpnode.store import mesh as ms

if TYPE_CHECKING:
    from hmpnode.net.host import Host
    from hmpnode.net.ourinterests import OurInterests

__all__ = ["Publisher", "should_publish"]

log = logging.getLogger("hmpnode.mesh")


def should_publish(routing_size: int, published_with: int) -> bool:
    """Publish our records (again) now? Once the routing table has neighbours, and
    again each time it doubled while it was small (fewer than 8 when last
    published), so that more replicas hold them; a table that was emptied starts
    over (`published_with` 0)."""
    if routing_size == 0:
        return False
    return published_with == 0 or (published_with < 8 and routing_size >= 2 * published_with)


class Publisher:
    """Our DHT records: the peer record (addresses from `own`, topics from `wants`) and
    the provider records listed on disk."""

    def __init__(self, host: Host, own: OwnAnnounce, wants: OurInterests) -> None:
        self.host, self.own, self.wants = host, own, wants
        #: set when containers were given a provider record (the list is on disk: ms.provide_*)
        self.due = asyncio.Event()

    async def queue_provider_records(self, marks: list[ms.Stored]) -> None:
        """The agent's unscoped broadcasts get DHT provider records (never scoped ones):
        the newest `max_provided` of them, listed on disk with their next publish time;
        older ones lose theirs (docs/protocol.md 26.7)."""
        if self.host.dht is None:
            return
        rows = [(m.seq, m.did) for m in marks if m.source == "agent" and m.broadcast and not m.network]
        if not rows:
            return
        keep = self.host.dht.limits.max_provided
        try:
            gone = await self.host.node.db.write(lambda conn: ms.provide_add(conn, rows, keep))
        except Exception:  # never at the cost of forwarding the batch
            self.host.counters["dht_provide_list_failed"] += len(rows)
            log.exception("listing provider records failed")
            return
        for did in gone:
            self.host.dht.withdraw_provider(did)
        self.host.counters["dht_provide_listed"] += len(rows)
        self.host.counters["dht_provide_withdrawn"] += len(gone)
        self.due.set()

    async def dht_publish(self) -> None:
        records = [self.own.record(a) for a in outward_first(self.host.announced_addresses())]
        replicas = await self.host.dht.publish_peer(records, roles=list(self.host.settings.roles),
                                                    mailman=self.host.mailman())
        self.host.counters["dht_published"] += 1
        self.host.counters["dht_replicas_last"] = replicas
        # node.interests, [interests]
        for topic in dict.fromkeys((*self.host.settings.interests, *self.wants.current.topics)):
            await self.host.dht.announce_topic(topic)

    async def provide_loop(self) -> None:
        """Sign and store the provider records that are due (never published first, newest
        first; then each `republish_interval` after its last), one at a time, at most
        `provide_rate` per second: the list and the schedule are read from disk in
        batches, so memory does not grow with the number of containers, and a republish
        round is spread out instead of re-signing everything at once."""
        dht = self.host.dht
        limits = dht.limits
        bucket = TokenBucket(limits.provide_rate, limits.provide_burst)
        interval_us = int(limits.republish_interval * 1_000_000) if limits.republish_interval else None

        async def one_round() -> None:
            """Publish up to one batch of due provider records, or wait for one to be due."""
            self.due.clear()
            now_us = self.host.node.now_us()
            due, gone = await self.host.node.db.write(lambda conn: ms.provide_due(conn, now_us, 32))
            for did in gone:  # deleted since: no record
                dht.withdraw_provider(did)
            if not due:
                next_us = await self.host.node.db.read(ms.provide_next_us)
                wait = 60.0 if next_us is None else min(60.0, max(0.05, (next_us - now_us) / 1e6))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.due.wait(), wait)
                return
            done: list[int] = []
            for seq, did in due:
                while not bucket.take(time.monotonic()):
                    await asyncio.sleep(max(0.01, (1 - bucket.tokens) / limits.provide_rate))
                try:
                    replicas = await dht.publish_provider(did)
                    self.host.counters["dht_provided"] += 1
                    if not replicas:
                        self.host.counters["dht_provide_unreplicated"] += 1
                except ValueError:  # a DID no record can carry (stored DIDs are checked: not expected)
                    self.host.counters["dht_provide_invalid"] += 1
                except Exception:
                    log.exception("DHT provide failed")
                done.append(seq)
            next_us = self.host.node.now_us() + interval_us if interval_us else 2**62
            dropped = set(await self.host.node.db.write(lambda conn: ms.provide_done(conn, done, next_us)))
            for seq, did in due:  # withdrawn while we were publishing it
                if seq in dropped:
                    dht.withdraw_provider(did)

        while True:
            try:
                await one_round()
            except asyncio.CancelledError:
                raise
            except Exception:  # e.g. the database failing once: wait, then go on
                log.exception("DHT provide round failed")
                await asyncio.sleep(10)

    async def dht_loop(self) -> None:
        """Publish our records once the DHT has neighbours, again while it has
        few (so that more replicas hold them), and whenever the routing table
        was emptied and refilled. The Dht republishes them by itself later."""
        published_with = 0
        while True:
            size = self.host.dht.routing_size()
            if size == 0:
                published_with = 0
            elif should_publish(size, published_with):
                try:
                    await self.dht_publish()
                    if not published_with:  # the first time: look up who follows our declared topics
                        for topic in self.wants.current.topics:
                            self.host.spawn(self.wants.follow_topic(topic, announce=False))
                    published_with = size
                except Exception:
                    log.exception("DHT publish failed")
            await asyncio.sleep(1.0 if published_with < 8 else 10.0)
