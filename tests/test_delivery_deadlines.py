"""Directed delivery through a relay keeps going when one step is lost on a live connection
(docs/protocol.md 22.2, 24.2), without sockets: relay and recipient sessions wired back to
back through a small in-memory adapter (the store a dict), a virtual clock that jumps to the
sessions' next timer, and a network that loses exactly one chosen frame.

Before the deadlines, each scenario below stalled for good: nothing re-offered, the recipient
never asked again, and only a reconnection (which these connections never have) moved the
mail. Now the relay offers again what a connected recipient did not acknowledge, and the
recipient forgets a request that was not answered, so the re-offer is asked for."""

from __future__ import annotations

from collections import Counter

import orjson

from hmpnode.identity import Identity
from hmpnode.net import mce as M
from hmpnode.net import session as SE
from hmpnode.net.ledger import Ledger
from hmpnode.net.scope import Channel
from hmpnode.net.session import PeerSession, SessionLimits
from tests.test_session import MONO, _result, ask, did_of, feed, note

LIMITS = SessionLimits(request_timeout_seconds=10.0, relay_reoffer_seconds=15.0)


class Node:
    """One node in memory: its store, what it holds for others (relay), its sessions."""

    def __init__(self, identity, now, *, relaying: bool = False):
        self.identity, self.now, self.relaying = identity, now, relaying
        self.ledger = Ledger()
        self.store: dict[str, dict] = {}
        self.held: dict[str, list[str]] = {}  # recipient -> DIDs held for it, oldest first
        self.sessions: dict[str, PeerSession] = {}
        self.full = 0  # containers frames still refused storage_full
        self.ignore: set[str] = set()  # MCE classes this node does not answer (a bug or a loss on its side)
        self.withhold: set[str] = set()  # held, but not given for now (left out of its answers)
        self.stored: Counter[str] = Counter()  # DID -> times stored (exactly once for the agent)

    def session_to(self, other: Node, roles: tuple[str, ...]) -> PeerSession:
        s = PeerSession(self.identity, other.identity.did, "127.0.0.1", Channel.LOOPBACK, peer_roles=roles,
                        limits=LIMITS, book=self.ledger.open(), counters=Counter(), relaying=self.relaying)
        self.sessions[other.identity.did] = s
        return s

    def hold(self, recipient: str, containers: list[dict]) -> None:
        for c in containers:
            self.store[did_of(c)] = c
            self.held.setdefault(recipient, []).append(did_of(c))

    def offer_held(self, peer: str, mono: float, *, again: bool = False) -> None:
        s = self.sessions[peer]
        dids = self.held.get(peer, [])
        s.offer_held({d: M.index_entry(self.store[d]["hmp_container"]) for d in dids}, self.now, mono,
                     read=list(range(len(dids))), again=again)

    def handle(self, s: PeerSession, event, mono: float) -> None:
        now = self.now
        if isinstance(event, SE.ContainersReceived):
            if self.full:
                self.full -= 1
                rejected = [{"container_did": d, "reason": "storage_full", "detail": "the node's disk is full"}
                            for d in event.dids]
                s.ingested(event, {}, rejected, mono, now)
                return
            outcomes = {}
            for i, d in enumerate(event.dids):
                outcomes[i] = _result("duplicate" if d in self.store else "stored", d, len(self.store) + 1)
                if d not in self.store:
                    self.stored[d] += 1
                self.store.setdefault(d, event.items[i])
            s.ingested(event, outcomes, [], mono, now)
        elif isinstance(event, SE.Offered):
            if "container_delta" not in self.ignore:
                ask(s, event.dids, {d for d in event.dids if d in self.store}, now, mono)
        elif isinstance(event, SE.Requested):
            if "container_request" in self.ignore:
                return
            rows = [d for d in event.dids if d in self.store and d not in self.withhold]
            s.answer_request([(d, self.store[d]["hmp_container"]["head"]["signature"]) for d in rows], now)
            chosen = s.select_push(rows, asked=True)
            s.send_containers([self.store[d] for d in chosen], mono)
        elif isinstance(event, SE.Acknowledged):
            held = self.held.get(s.peer_did, [])
            self.held[s.peer_did] = [d for d in held if d not in event.dids]
        elif isinstance(event, SE.ReofferHeld):
            self.offer_held(s.peer_did, mono, again=True)
        elif not isinstance(event, SE.PeerError):
            raise AssertionError(f"unexpected event {event!r}")


class Net:
    """Sessions wired back to back on a virtual clock; `lose` names frames to lose once each
    (a predicate on (sender, parsed frame))."""

    def __init__(self, *nodes: Node):
        self.nodes = nodes
        self.mono = MONO
        self.links: list[tuple[Node, PeerSession, Node, PeerSession]] = []
        self.lost: list[str] = []
        self.lose: list = []

    def connect(self, a: Node, b: Node) -> None:
        sa = a.session_to(b, ("relay",) if b.relaying else ())
        sb = b.session_to(a, ("relay",) if a.relaying else ())
        self.links.append((a, sa, b, sb))

    def _deliver(self, src: Node, frames: list[bytes], dst: Node, session: PeerSession) -> int:
        for data in frames:
            message = orjson.loads(data) if data else {}
            kind = message.get("type")
            if kind == "mce":
                kind = message["container"]["hmp_container"]["head"]["class"]
            for i, rule in enumerate(self.lose):
                if rule(src, kind, message):
                    del self.lose[i]
                    self.lost.append(kind)
                    break
            else:
                for event in feed(session, data, dst.now, self.mono):
                    dst.handle(session, event, self.mono)
        return len(frames)

    def pump(self) -> None:
        for _ in range(1000):
            moved = 0
            for a, sa, b, sb in self.links:
                moved += self._deliver(a, sa.data_to_send(), b, sb)
                moved += self._deliver(b, sb.data_to_send(), a, sa)
            if not moved:
                return
        raise AssertionError("the sessions did not settle")

    def run(self, seconds: float) -> None:
        """Move frames, then jump to the next timer, until `seconds` of virtual time passed."""
        end = self.mono + seconds
        for _ in range(10_000):
            self.pump()
            timers = [(t, n, s) for n in self.nodes for s in n.sessions.values()
                      if (t := s.next_timer()) is not None]
            if not timers or min(t for t, _, _ in timers) > end:
                self.mono = end
                return
            self.mono = max(self.mono, min(t for t, _, _ in timers))
            for t, node, s in timers:
                if t <= self.mono:
                    for event in s.handle_timer(self.mono):
                        node.handle(s, event, self.mono)
        raise AssertionError("the timers did not settle")


def setup(alice, bob, carol, now, n=3):
    """A relay (bob) holding `n` containers from carol for the recipient (alice), connected."""
    relay, recipient = Node(bob, now, relaying=True), Node(alice, now)
    mail = [note(carol, now, f"m{i}", recipients=[alice.did]) for i in range(n)]
    relay.hold(alice.did, mail)
    net = Net(relay, recipient)
    net.connect(relay, recipient)
    return net, relay, recipient, [did_of(m) for m in mail]


def delivered(relay: Node, recipient: Node, dids: list[str]) -> bool:
    return all(recipient.stored[d] == 1 for d in dids) and not relay.held[recipient.identity.did]


def test_without_losses_delivery_needs_no_timer(alice, bob, carol, now):
    net, relay, recipient, dids = setup(alice, bob, carol, now)
    relay.offer_held(alice.did, net.mono)
    net.pump()
    assert delivered(relay, recipient, dids)
    assert relay.sessions[alice.did].counters["relay_reoffered"] == 0
    # nothing outstanding: the relay's re-offer finds nothing more to do than once
    net.run(60)
    assert relay.sessions[alice.did].counters["relay_reoffered"] == 0


def test_a_batch_refused_storage_full_is_offered_again(alice, bob, carol, now):
    """offer -> ask -> containers -> refused storage_full: before, neither side had anything
    outstanding and nothing acted again. The relay's re-offer now brings it once room is back."""
    net, relay, recipient, dids = setup(alice, bob, carol, now)
    recipient.full = 1
    relay.offer_held(alice.did, net.mono)
    net.pump()
    assert not recipient.stored and relay.held[alice.did] == dids
    assert not recipient.sessions[bob.did].requested  # nothing outstanding at the recipient
    net.run(LIMITS.relay_reoffer_seconds + 1)
    assert delivered(relay, recipient, dids)
    assert relay.sessions[alice.did].counters["relay_reoffered"] == len(dids)


def test_a_request_lost_on_a_live_connection_expires_and_the_reoffer_is_asked_for(alice, bob, carol, now):
    """Before: `requested` stayed non-empty for ever and asking again returned nothing."""
    net, relay, recipient, dids = setup(alice, bob, carol, now)
    net.lose.append(lambda src, kind, m: src is recipient and kind == "container_request")
    relay.offer_held(alice.did, net.mono)
    net.pump()
    session = recipient.sessions[bob.did]
    assert net.lost == ["container_request"] and len(session.requested) == len(dids)
    assert ask(session, dids, set(), now, net.mono) == []  # outstanding: not asked again yet
    net.run(LIMITS.request_timeout_seconds + 0.5)
    assert not session.requested and session.counters["requests_expired"] == len(dids)
    net.run(LIMITS.relay_reoffer_seconds)
    assert delivered(relay, recipient, dids)


def test_a_lost_offer_is_made_again(alice, bob, carol, now):
    net, relay, recipient, dids = setup(alice, bob, carol, now)
    net.lose.append(lambda src, kind, m: src is relay and kind == "container_delta")
    relay.offer_held(alice.did, net.mono)
    net.run(LIMITS.relay_reoffer_seconds + 1)
    assert net.lost == ["container_delta"] and delivered(relay, recipient, dids)


def test_lost_containers_are_sent_again_when_asked_again(alice, bob, carol, now):
    """The relay carried them on this connection; asked again after the re-offer, it sends
    them again (before, a connection never carried a container twice)."""
    net, relay, recipient, dids = setup(alice, bob, carol, now)
    net.lose.append(lambda src, kind, m: src is relay and kind == "containers")
    relay.offer_held(alice.did, net.mono)
    net.run(LIMITS.request_timeout_seconds + LIMITS.relay_reoffer_seconds + 1)
    assert net.lost == ["containers"] and delivered(relay, recipient, dids)


def test_a_lost_ack_is_made_good_by_the_reoffer(alice, bob, carol, now):
    net, relay, recipient, dids = setup(alice, bob, carol, now)
    net.lose.append(lambda src, kind, m: src is recipient and kind == "container_ack")
    relay.offer_held(alice.did, net.mono)
    net.pump()
    assert all(recipient.stored[d] == 1 for d in dids) and relay.held[alice.did] == dids
    net.run(LIMITS.relay_reoffer_seconds + 1)
    assert delivered(relay, recipient, dids)  # offered again; held: acknowledged, not sent again
    assert relay.sessions[alice.did].counters["containers_sent"] == len(dids)


def test_a_response_that_omits_some_lets_them_be_asked_for_at_the_next_offer(alice, bob, carol, now):
    """Before: the omitted ones left `requested`, their in-flight mark stayed 10 s, and the
    relay never offered them again."""
    net, relay, recipient, dids = setup(alice, bob, carol, now)
    relay.withhold.add(dids[0])  # omitted from the answer for now
    relay.offer_held(alice.did, net.mono)
    net.pump()
    session = recipient.sessions[bob.did]
    assert session.counters["requests_omitted"] == 1 and dids[0] not in session.requested
    assert recipient.ledger.inflight.get(dids[0]) == 0  # not in flight: the next offer is taken up
    relay.withhold.clear()
    net.run(LIMITS.relay_reoffer_seconds + 1)
    assert delivered(relay, recipient, dids)


def test_with_two_relays_the_one_that_never_answers_does_not_block_the_other(alice, bob, carol, now):
    """Both relays hold the mail. The recipient asked the first, which never delivers; the
    second's offer came meanwhile and was not taken up (one request per container node-wide).
    Before: nobody asked the second again. Now the first request expires and the second
    relay's re-offer is asked for."""
    dave = Identity(bytes([44]) * 32)
    recipient = Node(alice, now)
    silent, good = Node(bob, now, relaying=True), Node(dave, now, relaying=True)
    mail = [note(carol, now, f"m{i}", recipients=[alice.did]) for i in range(3)]
    dids = [did_of(m) for m in mail]
    silent.hold(alice.did, mail)
    good.hold(alice.did, mail)
    silent.ignore.add("container_request")
    net = Net(silent, good, recipient)
    net.connect(silent, recipient)
    net.connect(good, recipient)
    silent.offer_held(alice.did, net.mono)
    net.pump()
    good.offer_held(alice.did, net.mono)
    net.pump()
    assert not recipient.stored and len(recipient.sessions[bob.did].requested) == 3
    assert not recipient.sessions[dave.did].requested  # in flight to the silent one
    net.run(LIMITS.request_timeout_seconds + LIMITS.relay_reoffer_seconds + 1)
    assert all(recipient.stored[d] == 1 for d in dids) and not good.held[alice.did]
    # the silent relay is told the recipient has them (its next re-offer is acknowledged)
    net.run(4 * LIMITS.relay_reoffer_seconds)
    assert not silent.held[alice.did]


def test_reoffers_back_off_while_they_bring_nothing(alice, bob, carol, now):
    """A recipient that never answers costs the relay one small offer per interval,
    doubling up to 8 intervals: not a stream of re-sends."""
    net, relay, recipient, dids = setup(alice, bob, carol, now)
    recipient.ignore.add("container_delta")
    relay.offer_held(alice.did, net.mono)
    net.run(3600)
    reoffers = relay.sessions[alice.did].counters["relay_reoffered"] // len(dids)
    assert 3600 / (8 * LIMITS.relay_reoffer_seconds) <= reoffers <= 3600 / (8 * LIMITS.relay_reoffer_seconds) + 4
    assert relay.sessions[alice.did].counters["containers_sent"] == 0


def test_requests_wait_longer_while_the_peer_keeps_answering(alice, bob, carol, now):
    """A peer still delivering what it was asked (a long answer) is not given up on at the
    first deadline; at three timeouts at most."""
    s = PeerSession(alice, bob.did, "127.0.0.1", Channel.LOOPBACK, limits=LIMITS, book=Ledger().open(),
                    counters=Counter())
    s.requested.claim(["did:hmp:container:a"], MONO, MONO + 10)
    s.answered_at = MONO + 9
    assert s.next_timer() == MONO + 19
    s.handle_timer(MONO + 12)
    assert "did:hmp:container:a" in s.requested
    s.answered_at = MONO + 29.5  # still answering: kept until the hard deadline
    assert s.next_timer() == MONO + 30
    s.handle_timer(MONO + 30)
    assert not s.requested and s.counters["requests_expired"] == 1 and s.next_timer() is None
