"""Node-wide decisions of the mesh core (hmpnode.net.core.MeshCore) without processes:
one core with real `PeerSession`s over in-memory links, the simulator's dict store
(hmpnode.sim.store.MemoryStore) and virtual time (hmpnode.sim.vtime), driven by the
node's own drive loops (hmpnode.net.drive). Each test is one that started real nodes
and waited on wall-clock retries before; the end-to-end checks that remain are in
tests/test_fault_delivery.py, test_delivery_mesh.py and test_once_per_connection.py.
Each test fails with its decision taken out (patched away here, or as its commit says)."""

from __future__ import annotations

import asyncio
import base64
import logging
import random
from datetime import datetime, timedelta
from types import SimpleNamespace

import orjson
import pytest

from hmpnode.identity import Identity
from hmpnode.net import core as C
from hmpnode.net import drive, ledger
from hmpnode.net import mce as M
from hmpnode.net import session as SE
from hmpnode.net import syncset as SY
from hmpnode.net.core import MeshCore
from hmpnode.net.settings import MeshLimits, MeshSettings
from hmpnode.net.reconcile import Reconciler, item_id
from hmpnode.net.relayquota import RelayLimits
from hmpnode.net.scope import Channel
from hmpnode.net.session import PeerSession, SessionLimits
from hmpnode.sim.store import MemoryStore
from hmpnode.sim.vtime import run
from hmpnode.store.records import to_us
from hmpnode.container.encoding import format_time
from tests.test_session import did_of, mce, note

#: virtual seconds a test may wait for anything (every loop below is bounded by it)
BOUND = 60.0


class Link:
    """One connection as the core sees it (the driver's link), keeping what was sent on it."""

    def __init__(self, session: PeerSession, roles: tuple[str, ...]) -> None:
        self.session, self._roles, self.closed, self.frames = session, roles, False, []

    @property
    def did(self) -> str:
        return self.session.peer_did

    @property
    def roles(self) -> tuple[str, ...]:
        return self._roles

    def sent(self) -> list[tuple[str, object]]:
        """What went out, in order: ("containers", [DIDs]) or (MCE class, payload)."""
        out = []
        for data in self.frames:
            message = orjson.loads(data) if data else {"type": "admitted"}
            if message["type"] == "containers":
                out.append(("containers", [did_of(i) for i in message["items"]]))
            elif message["type"] == "mce":
                container = message["container"]["hmp_container"]
                out.append((container["head"]["class"], container["payload"]))
        return out

    def carried(self) -> list[str]:
        return [d for kind, dids in self.sent() if kind == "containers" for d in dids]

    def asked(self) -> list[list[str]]:
        return [p["request_container"] for kind, p in self.sent()
                if kind == "container_request" and "request_container" in p]

    def offers(self) -> list[list[str]]:
        return [sorted(p["added"]) for kind, p in self.sent() if kind == "container_delta"]


class Node(drive.World):
    """One core, its dict store and the world that carries out its effects in virtual time.
    Ingest stores what it is given (verifying signatures is not what these tests are about)."""

    def __init__(self, identity, start: datetime, *, roles: tuple[str, ...] = (), session: SessionLimits = SessionLimits(),
                 relay: RelayLimits = RelayLimits()) -> None:
        settings = MeshSettings(roles=roles, mesh=MeshLimits(), session=session, relay=relay)
        self.core = MeshCore(identity, settings, random.Random(7))
        self.store, self.start, self.tasks = MemoryStore(), start, []
        self.wake = asyncio.Event()

    # -- the world ------------------------------------------------------------------------

    def clock(self):
        mono = asyncio.get_running_loop().time()
        return self.start + timedelta(seconds=mono), mono

    async def read(self, fn):
        return fn(self.store)

    async def write(self, fn):
        return fn(self.store)

    async def ingest(self, effect: C.Ingest):
        return self.store_items(effect.items, effect.source)

    async def offload(self, effect: C.Offload):
        return effect.fn()

    async def flush(self, link: Link) -> None:
        link.frames += link.session.data_to_send()

    async def reach(self, did: str, *, mail: bool = False):
        link = self.core.links.get(did)
        return None if link is None or link.closed else link  # nobody else can be dialled here

    async def sets(self):
        last, rows = self.store.sync_rows(0, 0)
        return SY.build_state(rows, now_us=to_us(self.clock()[0]), margin_us=SY.MARGIN_US, last_seq=last)

    def spawn(self, steps) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(drive.run(steps, self)))

    async def unhandled(self, link, event) -> None:
        pass

    # -- what the node's driver does around the core ---------------------------------------

    def store_items(self, items: list[dict], source: str) -> list:
        """Store (the agent's or a peer's containers) and run the store hook in the same step."""
        now_us = to_us(self.clock()[0])
        results, done = [], []
        for item in items:
            result = self.store.put(item, did_of(item), source, now_us)
            results.append(result)
            if result.status == "stored":
                done.append((SimpleNamespace(container=item), result))
        if done and self.core.store_hook(self.store, source, done, now_us):
            self.wake.set()
        if done:  # what was stored is offered onwards (the forward step)
            self.spawn(self.core.forward([self.store.by_did[r.did] for _, r in done]))
        return results

    def connect(self, peer, *, roles: tuple[str, ...] = ()) -> Link:
        """A peer connected: registered, and the outbox told (as the node's driver does)."""
        core = self.core
        session = PeerSession(core.identity, peer.did, "127.0.0.1", Channel.LOOPBACK, peer_roles=roles,
                              initiator=False, limits=core.settings.session, book=core.ledger.open(),
                              counters=core.counters, relaying=core.relaying)
        link = core.links[peer.did] = Link(session, roles)
        core.outbox_arrived.add(peer.did)
        self.wake.set()
        return link

    async def receive(self, link: Link, peer, class_: str, payload: dict) -> None:
        """The peer sends one MCE message."""
        await self.frame(link, mce(peer, self.core.identity, class_, payload, self.clock()[0]))

    async def frame(self, link: Link, data: bytes) -> None:
        """The peer sends one frame; what it set off on its own (transfers, announcements) ends too."""
        await drive.run(self.core.frame(link, data), self)
        await self.settle()

    async def settle(self) -> None:
        """What the core set off on its own (forward steps, transfers, announcements) ends."""
        while self.tasks:
            await self.tasks.pop()

    async def timers(self) -> None:
        """The session deadlines that came, as the node's timer loop runs them."""
        for link, events in self.core.due_timers(asyncio.get_running_loop().time()):
            await drive.run(self.core.session_events(link, events), self)

    async def maintain(self) -> None:
        """One round of the node's maintenance: session deadlines, then relay holdings."""
        await self.timers()
        if self.core.relaying:
            await drive.run(self.core.expire_holdings(), self)

    async def hand_over(self, peer, mail: list[dict]) -> Link:
        """`peer` connects and hands `mail` over in a `containers` frame (acknowledged)."""
        link = self.connect(peer)
        await self.frame(link, M.frame("containers", items=mail))
        [(kind, payload)] = link.sent()
        assert kind == "container_ack" and sorted(payload["acknowledged"]) == sorted(map(did_of, mail)), payload
        return link

    async def until(self, done, step: float = 0.25, *, every=None) -> float:
        """Virtual seconds until `done()`, running `every()` at each step; fails past BOUND."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not done():
            assert loop.time() - start < BOUND, "not within the bound"
            await asyncio.sleep(step)
            if every is not None:
                await every()
        return loop.time() - start


def _mail(author, recipient, start: datetime, n: int) -> list[dict]:
    return [note(author, start, f"m{i}", recipients=[recipient.did]) for i in range(n)]


# -- the outbox wakes when a path to the recipient connects ----------------------------------


@pytest.mark.parametrize("who", ["recipient", "relay"])
def test_waiting_mail_goes_when_a_path_connects_not_at_its_next_retry(who, alice, bob, carol, now):
    """While the recipient is away the outbox's entries back off (to 8 s and more); when the
    recipient connects, or a relay (which takes mail for anyone), they go at once, not at
    their next retry. Moved from test_once_per_connection.py (recipient) and
    test_fault_delivery.py's killed relay (relay): the decision is `MeshCore.served_by`."""

    async def main():
        node = Node(alice, now)
        mail = _mail(alice, carol, now, 5)
        node.store_items(mail, "agent")
        task = asyncio.get_running_loop().create_task(drive.outbox_loop(node.core, node, node.wake))
        try:
            def backed_off():
                now_us = to_us(node.clock()[0])
                return len(node.store.outbox) == 5 and all(e[1] - now_us >= 8e6 for e in node.store.outbox.values())

            await node.until(backed_off)
            next_try = min(e[1] for e in node.store.outbox.values())
            assert all(e[2] >= 3 for e in node.store.outbox.values())  # tried, nobody took it
            link = node.connect(carol) if who == "recipient" else node.connect(bob, roles=("relay",))
            await node.until(lambda: len(set(link.carried())) == 5)
            assert to_us(node.clock()[0]) < next_try, "delivered only at the entries' next retry"
            assert sorted(link.carried()) == sorted(map(did_of, mail))  # each once on this connection
            counter = "outbox_direct" if who == "recipient" else "outbox_via_relay"
            assert node.core.counters[counter] == 5
        finally:
            task.cancel()

    run(main())


def test_a_push_and_a_request_crossing_it_carry_a_directed_container_once(alice, bob, now):
    """The recipient was away: when it comes back, the outbox pushes what waited while its
    catch-up (`after`) is answered with a delta offering the same containers, and it asks
    for them before the push arrived. Each crosses the connection once: the request crossing
    the push is not answered with a copy. Moved from test_once_per_connection.py (two real
    nodes)."""
    mail = _mail(alice, bob, now, 30)
    dids = sorted(map(did_of, mail))

    async def main():
        node = Node(alice, now)
        node.store_items(mail, "agent")
        task = asyncio.get_running_loop().create_task(drive.outbox_loop(node.core, node, node.wake))
        try:
            await node.until(lambda: all(e[2] >= 2 for e in node.store.outbox.values()))  # tried, deferred
            link = node.connect(bob)
            await node.receive(link, bob, "container_request", {"after": ""})  # its catch-up
            [offered] = link.offers()
            assert set(dids) <= set(offered)
            await node.until(lambda: len(link.carried()) >= 30)  # the outbox's push ...
            await node.receive(link, bob, "container_request", {"request_container": dids})  # ... crossing this
            await node.receive(link, bob, "container_ack", {"acknowledged": dids})
            await asyncio.sleep(2.0)  # what would be a second copy has gone by now
            assert sorted(link.carried()) == dids
            assert node.store.outbox == {}
            assert node.core.counters["sent_twice_on_connection"] == 0
        finally:
            task.cancel()

    run(main())


def test_waiting_mail_waits_for_its_retry_without_the_wake(monkeypatch, alice, carol, now):
    """The test above with `served_by` patched away: the mail goes only at its next retry
    (so the test above can fail)."""
    monkeypatch.setattr(C.MeshCore, "served_by", lambda self, arrived: set())

    async def main():
        node = Node(alice, now)
        node.store_items(_mail(alice, carol, now, 2), "agent")
        task = asyncio.get_running_loop().create_task(drive.outbox_loop(node.core, node, node.wake))
        try:
            await node.until(lambda: all(e[1] - to_us(node.clock()[0]) >= 8e6 for e in node.store.outbox.values()))
            next_try = min(e[1] for e in node.store.outbox.values())
            link = node.connect(carol)
            await node.until(lambda: len(link.carried()) == 2)
            assert to_us(node.clock()[0]) >= next_try
        finally:
            task.cancel()

    run(main())


# -- a recipient's requests on a live connection (docs/protocol.md 22.2) --------------------------

FAST = SessionLimits(request_timeout_seconds=0.8, relay_reoffer_seconds=1.0)


def _offer(mail: list[dict], now: datetime) -> dict:
    """A relay's offer of `mail` (a container_delta of index entries, 24.2)."""
    return {"since": format_time(now), "added": {did_of(m): M.index_entry(m["hmp_container"]) for m in mail}}


def _lost_request_asked_again(alice, bob, carol, now) -> tuple[list[list[str]], int]:
    """A relay offers mail for us; our request is lost (never answered); the relay
    offers it again on the same connection after the request timeout: what we asked
    each time, and the count of requests expired."""
    mail = _mail(carol, alice, now, 4)

    async def main():
        node = Node(alice, now, session=FAST)
        relay = node.connect(bob, roles=("relay",))
        await node.receive(relay, bob, "container_delta", _offer(mail, node.clock()[0]))  # asked ... and lost
        for _ in range(6):  # 1.5 s: past the request timeout (0.8 s)
            await asyncio.sleep(0.25)
            await node.timers()
        await node.receive(relay, bob, "container_delta", _offer(mail, node.clock()[0]))
        return relay.asked(), node.core.counters["requests_expired"]

    return run(main())


def test_a_request_lost_on_a_live_connection_is_made_again_at_the_next_offer(alice, bob, carol, now):
    """Moved from test_delivery_mesh.py (a real recipient, a made-up relay): the decision
    is the request deadline the core runs for each session (`due_timers`) and the ledger's
    one request per container, which must let an expired request go."""
    asked, expired = _lost_request_asked_again(alice, bob, carol, now)
    dids = sorted(did_of(m) for m in _mail(carol, alice, now, 4))
    assert [sorted(a) for a in asked] == [dids, dids], "not asked again at the next offer"
    assert expired == 4


def test_a_request_that_never_expires_blocks_the_next_offer(monkeypatch, alice, bob, carol, now):
    """The test above with the expiry patched away: the offer is not taken up again."""
    monkeypatch.setattr(ledger.Requested, "expire", lambda self, cutoff: 0)
    asked, expired = _lost_request_asked_again(alice, bob, carol, now)
    assert len(asked) == 1 and expired == 0


def test_a_relay_that_never_answers_does_not_keep_another_from_delivering(alice, bob, carol, now):
    """Two relays hold the same mail. We asked the first, which never answers; the second
    offered meanwhile and was not asked (one request per container across connections).
    The request to the first expires and the second's re-offer is asked for. Moved from
    test_delivery_mesh.py (a real recipient, a made-up relay, a real relay restarted)."""
    mail = _mail(Identity.generate(), alice, now, 3)
    dids = sorted(map(did_of, mail))

    async def main():
        node = Node(alice, now, session=FAST)
        silent, other = node.connect(bob, roles=("relay",)), node.connect(carol, roles=("relay",))
        await node.receive(silent, bob, "container_delta", _offer(mail, node.clock()[0]))  # ... never answered
        await node.receive(other, carol, "container_delta", _offer(mail, node.clock()[0]))
        assert [sorted(a) for a in silent.asked()] == [dids] and other.asked() == []  # asked once, of one
        await node.until(lambda: node.core.counters["requests_expired"] == 3, every=node.timers)
        await node.receive(other, carol, "container_delta", _offer(mail, node.clock()[0]))  # its re-offer
        assert [sorted(a) for a in other.asked()] == [dids]
        await node.frame(other, M.frame("containers", items=mail))
        assert sorted(node.store.by_did) == dids

    run(main())


# -- a relay's holdings for a connected recipient (docs/protocol.md 24.2) -------------------------


def test_a_relay_offers_again_what_a_connected_recipient_lost(alice, bob, carol, now):
    """The recipient loses the relay's offer, then the containers it asked for; it never
    reconnects. The relay offers again each time (the session's re-offer deadline, run by
    the core), sends again what it carried when asked again, and lets go once acknowledged.
    Moved from test_delivery_mesh.py (a real relay, a made-up recipient)."""
    mail = _mail(carol, bob, now, 3)
    dids = sorted(map(did_of, mail))

    async def main():
        node = Node(alice, now, roles=("relay",), session=FAST)
        await node.hand_over(carol, mail)
        assert len(node.store.holds) == 3
        link = node.connect(bob)
        await drive.run(node.core.offer_held(link), node)  # ... lost
        assert link.offers() == [dids]
        await node.until(lambda: len(link.offers()) == 2, every=node.maintain)  # on the same connection
        await node.receive(link, bob, "container_request", {"request_container": dids})
        assert sorted(link.carried()) == dids  # ... lost: no ack
        await node.until(lambda: len(link.offers()) == 3, every=node.maintain)
        await node.receive(link, bob, "container_request", {"request_container": dids})
        assert sorted(link.carried()) == sorted(dids * 2), "not sent again"
        await node.receive(link, bob, "container_ack", {"acknowledged": dids})
        assert node.store.holds == {}
        assert node.core.counters["relay_reoffered"] >= 6

    run(main())


async def _exchange(a: Node, a_link: Link, b: Node, b_link: Link) -> None:
    """Carry the frames each side queued to the other until both are quiet (bounded)."""
    sent = {id(a_link): 0, id(b_link): 0}
    for _ in range(50):
        moved = False
        for node, link, other, other_link in ((a, a_link, b, b_link), (b, b_link, a, a_link)):
            fresh, sent[id(link)] = link.frames[sent[id(link)]:], len(link.frames)
            for data in fresh:
                if data:
                    moved = True
                    await other.frame(other_link, data)
        if not moved:
            return
    raise AssertionError("still talking after 50 rounds")


def test_a_relay_lets_go_of_what_the_recipient_got_elsewhere(alice, bob, carol, now):
    """The relay offers what it holds; a recipient that has it already (its agent got it by
    other means) acknowledges the offer (protocol.md 22.3) and the relay drops its copy
    without sending it. Moved from test_mesh.py (three real nodes, two restarted): the
    decisions are the recipient's answer to an offer of what it holds and the relay's
    release on that acknowledgement (`MeshCore.acknowledged`)."""
    mail = _mail(carol, bob, now, 1)

    async def main():
        relay = Node(alice, now, roles=("relay",))
        await relay.hand_over(carol, mail)
        assert len(relay.store.holds) == 1
        recipient = Node(bob, now)
        recipient.store_items(mail, "import")
        to_recipient, to_relay = relay.connect(bob), recipient.connect(alice, roles=("relay",))
        await drive.run(relay.core.offer_held(to_recipient), relay)
        await _exchange(relay, to_recipient, recipient, to_relay)
        assert relay.store.holds == {} and relay.core.counters["relay_released"] == 1
        assert to_recipient.carried() == [] and to_relay.asked() == []  # offered, not sent, not asked

    run(main())


def test_without_the_reoffer_a_lost_offer_is_never_made_again(monkeypatch, alice, bob, carol, now):
    """The re-offer deadline patched away: the connected recipient is offered its mail once."""
    monkeypatch.setattr(SE.PeerSession, "_arm_reoffer", lambda self, mono: None)

    async def main():
        node = Node(alice, now, roles=("relay",), session=FAST)
        await node.hand_over(carol, _mail(carol, bob, now, 2))
        link = node.connect(bob)
        await drive.run(node.core.offer_held(link), node)
        for _ in range(40):  # 10 s: ten re-offer intervals
            await asyncio.sleep(0.25)
            await node.maintain()
        assert len(link.offers()) == 1

    run(main())


def test_a_holding_that_ends_while_its_recipient_is_connected_is_an_error_in_the_log(alice, bob, carol, now, caplog):
    """Mail that reaches the end of its hold although its recipient is connected should have
    been delivered: never a silent delete. The relay says so before (offering it once more)
    and when it goes, and counts it. Moved from test_delivery_mesh.py (a real relay, a
    made-up recipient); the decision is `MeshCore.expire_holdings`."""
    mail = _mail(carol, bob, now, 2)

    async def main():
        node = Node(alice, now, roles=("relay",), session=SessionLimits(relay_reoffer_seconds=1.0),
                    relay=RelayLimits(max_hold_seconds=4))
        await node.hand_over(carol, mail)
        link = node.connect(bob)  # connected, but never asks nor acknowledges
        await drive.run(node.core.offer_held(link), node)
        with caplog.at_level(logging.ERROR, logger="hmpnode.mesh"):
            await node.until(lambda: node.core.counters["relay_expired_connected"] == 2, every=node.maintain)
        assert node.store.holds == {}
        return node.core.counters

    counters = run(main())
    assert counters["relay_expired"] == 2
    log = caplog.text
    assert f"relay: 2 held for {bob.did} end within" in log and "offered again" in log
    assert f"relay: 2 held for {bob.did} expired undelivered although it is connected" in log


# -- reconciliation lists and gives only what the peer may receive (docs/protocol.md 22.4) ---------


def test_a_peer_on_another_channel_never_learns_a_scoped_container(alice, bob, now):
    """The node holds an unscoped, a localhost-scoped and a lan:-scoped broadcast. A peer on
    loopback that reconciles from an empty set (so the node lists every item of its sets)
    is shown the first two and never the lan: one: not its id in any message, and asking
    for that id by `want` brings nothing (asking for the localhost one brings it). Moved
    from test_sync.py (a real node, a made-up peer): the decision is the set the core
    reconciles with this link (`set_for`) and what it gives (`_rows_of`)."""
    plain = note(alice, now, "plain", broadcast=True)
    local = note(alice, now, "local", broadcast=True, network="localhost")
    lan = note(alice, now, "lan", broadcast=True, network="lan:192.0.2.0/24")
    ids = {name: item_id(did_of(c)) for name, c in (("plain", plain), ("local", local), ("lan", lan))}

    async def main():
        node = Node(alice, now)
        node.store_items([plain, local, lan], "agent")
        await node.settle()  # forwarded to nobody: no peer yet
        link = node.connect(bob)
        for name in SY.SET_NAMES:
            empty = base64.b64encode(Reconciler([]).initiate()).decode()
            await node.frame(link, orjson.dumps({"type": "reconcile", "set": name, "start": True, "msg": empty}))
        want = base64.b64encode(ids["lan"] + ids["plain"] + ids["local"]).decode()
        await node.frame(link, orjson.dumps({"type": "reconcile", "set": "scoped", "want": want}))
        return link

    link = run(main())
    seen, replies = b"", 0
    for data in link.frames:
        seen += data
        frame = orjson.loads(data) if data else {}
        if frame.get("type") == "reconcile" and "reply" in frame:
            replies += 1
            seen += base64.b64decode(frame["reply"])
    assert replies == 2
    assert ids["plain"] in seen and ids["local"] in seen  # listed: the peer may receive them
    assert ids["lan"] not in seen and did_of(lan).encode() not in seen
    # of the scoped set: the localhost one only (the lan: one is not in it, the plain one is global)
    assert link.carried() == [did_of(local)]


# -- mailmen: where directed mail and its recipient meet ------------------------------------------


def test_mail_for_a_recipient_with_no_known_mailman_goes_to_the_relay_it_ranks_best():
    """With no mailman named for the recipient (unknown to us and to the DHT), the mail goes
    to the connected relay the recipient itself ranks best: the one it keeps connected when
    it can (MeshCore.relays_to_dial), not whichever relay happens to be first."""
    me, recipient = Identity(b"\x01" * 32), Identity(b"\x02" * 32)
    relays = [Identity(bytes([10 + i]) * 32) for i in range(4)]
    for order in (relays, relays[::-1]):
        core = MeshCore(me, MeshSettings(), random.Random(1))
        for r in order:
            core.links[r.did] = SimpleNamespace(did=r.did, roles=("relay",), closed=False)

        class World(drive.World):
            async def find_peer(self, did):
                return None

        chosen = run(drive.run(core.relay_for(recipient.did), World()))
        assert chosen.did == core.rank([r.did for r in relays], of=recipient.did)[0]
        # which is what the recipient computes for itself
        assert chosen.did == MeshCore(recipient, MeshSettings(), random.Random(1)).rank(
            [r.did for r in relays])[0]
