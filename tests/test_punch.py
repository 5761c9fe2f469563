"""Hole punching's coordination (hmpnode.net.punch, docs/protocol.md 34.4), sans-IO with a
virtual clock: both roles, the RTT and the sync timing, three attempts, refusals, limits."""

from __future__ import annotations

import pytest

from hmpnode.net import punch as P

LIM = P.PunchLimits()
N_ADDRS = ["tcp://198.51.100.7:40001"]
A_ADDRS = ["tcp://203.0.113.9:40002"]


def frame(effect: P.Send) -> P.PunchFrame:
    """What the peer parses of a Send (it went through the wire as a nat frame)."""
    parsed = P.parse_frame({"type": "nat", "op": effect.op, **effect.members}, LIM.max_addrs)
    assert isinstance(parsed, P.PunchFrame), parsed
    return parsed


def exchange(one_way_n_to_a: float, one_way_a_to_n: float, t0: float = 100.0):
    """One attempt over a relayed path with the given one-way delays: N's and A's Dial."""
    n, a = P.Punch("n", LIM), P.Punch("a", LIM)
    [offer] = n.attempt(t0, N_ADDRS)
    t = t0 + one_way_n_to_a
    [answer] = a.requested(t, frame(offer), N_ADDRS, A_ADDRS)
    assert answer == P.Send("punch", {"id": 1, "addrs": A_ADDRS})
    t += one_way_a_to_n
    sync, n_dial = n.answered(t, frame(answer), A_ADDRS)
    assert sync == P.Send("punch_sync", {"id": 1})
    [a_dial] = a.synced(t + one_way_n_to_a, frame(sync))
    return n, a, n_dial, a_dial


def test_both_dial_at_the_same_moment_on_a_symmetric_path() -> None:
    """N waits RTT/2 after the answer: the moment A receives the sync."""
    n, a, n_dial, a_dial = exchange(0.040, 0.040)
    assert n.rtt == pytest.approx(0.080)
    assert n_dial.at == pytest.approx(a_dial.at) == pytest.approx(100.120)
    assert n_dial.addrs == tuple(A_ADDRS) and a_dial.addrs == tuple(N_ADDRS)
    assert n_dial.until == pytest.approx(n_dial.at + LIM.dial_seconds)
    assert a_dial.until == pytest.approx(a_dial.at + LIM.dial_seconds)


def test_an_asymmetric_path_offsets_the_dials_by_half_the_difference() -> None:
    _n, _a, n_dial, a_dial = exchange(0.010, 0.050)
    assert a_dial.at - n_dial.at == pytest.approx((0.010 - 0.050) / 2)


def test_a_direct_stream_ends_both_sides_direct() -> None:
    n, a, n_dial, a_dial = exchange(0.02, 0.02)
    assert n.dialled(n_dial.at + 0.01, True) == [P.Done(True)]
    assert a.dialled(a_dial.at + 0.01, True) == [P.Done(True)]
    assert n.view() == {"state": "direct", "attempts": 1, "reason": None} == a.view()


def test_three_attempts_then_failed_with_the_last_reason() -> None:
    n, a = P.Punch("n", LIM), P.Punch("a", LIM)
    t = 0.0
    for attempt in (1, 2, 3):
        [offer] = n.attempt(t, N_ADDRS)
        assert frame(offer).id == attempt  # each attempt has its own id
        [answer] = a.requested(t + 0.01, frame(offer), N_ADDRS, A_ADDRS)
        _sync, dial = n.answered(t + 0.02, frame(answer), A_ADDRS)
        a.synced(t + 0.03, P.PunchFrame("punch_sync", attempt))
        out = n.dialled(dial.until, False, "refused")
        assert a.dialled(dial.until, False, "refused") == ([] if attempt < 3 else [P.Done(False, "refused")])
        if attempt < 3:
            assert out == [P.Retry(dial.until + LIM.pause_seconds)]
            t = dial.until + LIM.pause_seconds
        else:
            assert out == [P.Done(False, "refused")]
    assert n.view() == {"state": "failed", "attempts": 3, "reason": "refused"} == a.view()


def test_attempts_follow_the_limit() -> None:
    n = P.Punch("n", P.PunchLimits(attempts=1))
    [offer] = n.attempt(0.0, N_ADDRS)
    assert n.tick(LIM.answer_seconds) == [P.Done(False, "timeout")]


def test_no_answer_times_out_each_attempt() -> None:
    n = P.Punch("n", LIM)
    t = 0.0
    for attempt in (1, 2, 3):
        n.attempt(t, N_ADDRS)
        assert n.tick(t + LIM.answer_seconds - 0.001) == []
        out = n.tick(t + LIM.answer_seconds)
        t += LIM.answer_seconds + LIM.pause_seconds
        assert out == ([P.Retry(t)] if attempt < 3 else [P.Done(False, "timeout")])
    assert n.done and n.reason == "timeout"


def test_a_without_sync_waits_for_the_next_attempt_then_gives_up() -> None:
    a = P.Punch("a", LIM)
    a.requested(0.0, P.PunchFrame("punch", 1, tuple(N_ADDRS)), N_ADDRS, A_ADDRS)
    assert a.tick(LIM.answer_seconds - 0.01) == []
    assert a.tick(LIM.answer_seconds) == []  # attempt 1 failed: N may start attempt 2
    assert not a.done
    [answer] = a.requested(6.0, P.PunchFrame("punch", 2, tuple(N_ADDRS)), N_ADDRS, A_ADDRS)
    assert answer.members["id"] == 2 and a.attempts == 2
    a.tick(6.0 + LIM.answer_seconds)
    assert a.tick(6.0 + 2 * LIM.answer_seconds + LIM.pause_seconds) == [P.Done(False, "timeout")]


@pytest.mark.parametrize("reason", ["not_port_preserving", "no_public_address"])
def test_a_side_that_cannot_says_so_and_nobody_dials(reason: str) -> None:
    # N cannot: it tells A and ends; A ends too, neither dials
    n, a = P.Punch("n", LIM), P.Punch("a", LIM)
    offer, done = n.attempt(0.0, [], reason)
    assert offer == P.Send("punch", {"id": 1, "addrs": [], "reason": reason}) and done == P.Done(False, reason)
    assert a.requested(0.01, frame(offer), [], A_ADDRS) == [P.Done(False, reason)]
    # A cannot: it answers with its reason; N ends without a sync
    n, a = P.Punch("n", LIM), P.Punch("a", LIM)
    [offer] = n.attempt(0.0, N_ADDRS)
    answer, done = a.requested(0.01, frame(offer), N_ADDRS, [], reason)
    assert answer == P.Send("punch", {"id": 1, "addrs": [], "reason": reason})
    assert n.answered(0.02, frame(answer), []) == [P.Done(False, reason)]
    assert n.view() == {"state": "failed", "attempts": 1, "reason": reason}


def test_addresses_that_vet_to_nothing_are_refused_by_both_roles() -> None:
    a = P.Punch("a", LIM)
    answer, done = a.requested(0.0, P.PunchFrame("punch", 1, ("tcp://192.0.2.1:1",)), [], A_ADDRS)
    assert answer.members == {"id": 1, "addrs": [], "reason": "refused"} and done == P.Done(False, "refused")
    n = P.Punch("n", LIM)
    n.attempt(0.0, N_ADDRS)
    assert n.answered(0.1, P.PunchFrame("punch", 1, ("tcp://192.0.2.1:1",)), []) == [P.Done(False, "refused")]


def test_stale_and_foreign_frames_are_ignored() -> None:
    n = P.Punch("n", LIM)
    n.attempt(0.0, N_ADDRS)
    assert n.answered(0.1, P.PunchFrame("punch", 7, tuple(A_ADDRS)), A_ADDRS) == []  # not this attempt's id
    n.tick(LIM.answer_seconds)  # attempt 1 timed out
    assert n.answered(LIM.answer_seconds + 0.1, P.PunchFrame("punch", 1, tuple(A_ADDRS)), A_ADDRS) == []  # late
    a = P.Punch("a", LIM)
    assert a.synced(0.0, P.PunchFrame("punch_sync", 1)) == []  # a sync before any punch
    a.requested(0.0, P.PunchFrame("punch", 1, tuple(N_ADDRS)), N_ADDRS, A_ADDRS)
    assert a.synced(0.1, P.PunchFrame("punch_sync", 2)) == []
    assert a.requested(0.1, P.PunchFrame("punch", 1, tuple(N_ADDRS)), N_ADDRS, A_ADDRS) == []  # a duplicate
    assert a.dialled(0.2, True) == []  # not dialling


@pytest.mark.parametrize("message, error", [
    ({"op": "punch", "addrs": N_ADDRS}, "id"),
    ({"op": "punch", "id": True, "addrs": N_ADDRS}, "id"),
    ({"op": "punch", "id": -1, "addrs": N_ADDRS}, "id"),
    ({"op": "punch_sync", "id": "1"}, "id"),
    ({"op": "punch", "id": 1, "addrs": "tcp://198.51.100.7:1"}, "list"),
    ({"op": "punch", "id": 1, "addrs": N_ADDRS * 5}, "at most 4"),
    ({"op": "punch", "id": 1, "addrs": [7]}, "strings"),
    ({"op": "punch", "id": 1, "addrs": ["tcp://" + "1" * 80 + ":1"]}, "64"),
    ({"op": "punch", "id": 1, "addrs": []}, "not both nor neither"),
    ({"op": "punch", "id": 1, "addrs": N_ADDRS, "reason": "timeout"}, "reason must be"),
    ({"op": "punch", "id": 1, "addrs": N_ADDRS, "reason": "refused"}, "not both"),
])
def test_malformed_frames_get_a_stable_error(message: dict, error: str) -> None:
    out = P.parse_frame(message, LIM.max_addrs)
    assert isinstance(out, str) and error in out


def test_only_vouched_ips_within_the_policy_are_dialled() -> None:
    vouched = {"198.51.100.7", "10.0.0.5", "2001:db8::1"}
    allowed = lambda addr: "10.0.0.5" not in addr  # noqa: E731 (the dial policy refuses private IPs)
    addrs = ["tcp://198.51.100.7:4000", "tcp://192.0.2.66:4000",  # not vouched: a victim's
             "tcp://10.0.0.5:4000",  # vouched, but off the dial policy
             "udp://198.51.100.7:4000", "tcp://peer.example:4000", "tcp://198.51.100.7:4000",
             "tcp://[2001:db8::1]:4001", "not an address", "tcp://198.51.100.7:0"]
    assert P.vet_addrs(addrs, vouched, allowed) == ["tcp://198.51.100.7:4000", "tcp://[2001:db8::1]:4001"]
    assert P.vet_addrs(addrs, set(), lambda a: True) == []


def test_the_gate_limits_per_peer_node_wide_and_at_once() -> None:
    lim = P.PunchLimits(peer_punches=2, peer_window_seconds=100.0, per_minute=5, concurrent=2)
    gate = P.PunchGate(lim)
    assert gate.start("did:a", 0.0) is None
    assert gate.start("did:a", 0.0) == "busy"  # one punch per peer at a time
    assert gate.start("did:b", 0.0) is None
    assert gate.start("did:c", 0.0) == "busy"  # two at once in all
    gate.ended("did:a"), gate.ended("did:b")
    assert gate.start("did:a", 1.0) is None
    gate.ended("did:a")
    assert gate.start("did:a", 2.0) == "rate_limited"  # its 2 per 100 s are used
    assert gate.start("did:a", 52.0) is None  # one came back after 50 s
    gate.ended("did:a")
    # node-wide: 3 attempts a minute, whoever the peers
    gate = P.PunchGate(P.PunchLimits(per_minute=3))
    for did in ("did:1", "did:2", "did:3"):
        assert gate.start(did, 0.0) is None
        gate.ended(did)
    assert gate.start("did:4", 0.0) == "rate_limited"
    assert not gate.attempt(19.0)
    assert gate.attempt(20.0)  # 3 a minute: one every 20 s
    assert gate.start("did:4", 40.0) is None  # its own bucket was not charged by the refusal
    assert gate.start("did:5", 40.0) == "rate_limited"


def test_the_gate_forgets_the_oldest_peer_beyond_its_bound() -> None:
    gate = P.PunchGate(P.PunchLimits(peer_punches=1, per_minute=1000, concurrent=1000), max_peers=3)
    for did in ("did:1", "did:2", "did:3", "did:4"):
        assert gate.start(did, 0.0) is None
        gate.ended(did)
    assert len(gate._peers) == 3 and "did:1" not in gate._peers
    assert gate.start("did:4", 0.0) == "rate_limited"


# -- the driver's decisions on a peer's frames (hmpnode.net.punching), with a fake link --------

import asyncio  # noqa: E402
from collections import Counter  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from hmpnode.net.punching import Punching  # noqa: E402
from hmpnode.net.session import keeps_new_connection  # noqa: E402
from hmpnode.net.settings import MeshSettings  # noqa: E402

PEER = "did:hmp:agent:peer"


class _Session:
    def __init__(self) -> None:
        self.nat, self.sent, self.refused = True, [], []

    def send_nat(self, op, **members):
        self.sent.append({"op": op, **members})
        return True

    def refuse(self, reason, detail, mono):
        self.refused.append((reason, detail))
        return []


def _driver(reach=None, *, initiator=True):
    """Punching on a fake host, and A's (we dialled through a relay) link to PEER, whose signed
    announce lists 1.2.3.4."""
    async def flush():
        return True

    async def drive(link, events):
        return None

    link = SimpleNamespace(did=PEER, via="did:hmp:agent:relay", initiator=initiator, closed=False, ip="5.6.7.8",
                           session=_Session(), flush=flush,
                           info=SimpleNamespace(announce=SimpleNamespace(addresses=("tcp://1.2.3.4:7420",))))
    tasks = []
    host = SimpleNamespace(settings=MeshSettings(host="127.0.0.1"), counters=Counter(), sessions={PEER: link},
                           dialer=SimpleNamespace(interfaces=lambda: []), drive=drive,
                           spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)))
    # mesh.reach: by default nothing known (no public address, port preservation unknown)
    host.reach = reach or SimpleNamespace(public_ips=lambda: [], port_preserving=lambda: None)
    limits = P.PunchLimits(answer_seconds=0.2, pause_seconds=0.05, attempts=1)
    return Punching(host, connections=None, limits=limits), host, link, tasks


async def _settle(tasks) -> None:
    await asyncio.wait_for(asyncio.gather(*tasks), 5)


async def test_a_punch_naming_an_ip_the_peer_is_not_at_is_refused_and_nothing_is_dialled() -> None:
    reach = SimpleNamespace(public_ips=lambda: ["127.0.0.1"], port_preserving=lambda: True)
    punching, host, link, tasks = _driver(reach)
    # 9.9.9.9 is globally routable, but neither its connection, its relay nor its announce puts the peer there
    await punching.on_frame(link, {"type": "nat", "op": "punch", "id": 1, "addrs": ["tcp://9.9.9.9:80"]})
    await _settle(tasks)
    assert link.session.sent == [{"op": "punch", "id": 1, "addrs": [], "reason": "refused"}]
    assert punching.view(PEER) == {"state": "failed", "attempts": 1, "reason": "refused"}
    assert host.counters["punch_addrs_refused"] == 1 and host.counters["punch_failed_refused"] == 1


async def test_a_vouched_address_gets_our_fresh_port_then_the_attempt_times_out_without_sync() -> None:
    reach = SimpleNamespace(public_ips=lambda: ["127.0.0.1"], port_preserving=lambda: True)
    punching, host, link, tasks = _driver(reach)
    await punching.on_frame(link, {"type": "nat", "op": "punch", "id": 1, "addrs": ["tcp://1.2.3.4:40001"]})
    await _settle(tasks)
    [answer] = link.session.sent
    assert answer["op"] == "punch" and answer["id"] == 1 and "reason" not in answer
    [addr] = answer["addrs"]
    assert addr.startswith("tcp://127.0.0.1:") and int(addr.rsplit(":", 1)[1]) > 0
    assert punching.view(PEER) == {"state": "failed", "attempts": 1, "reason": "timeout"}  # no sync came


async def test_the_ip_a_relay_reported_vouches_for_the_peer() -> None:
    reach = SimpleNamespace(public_ips=lambda: ["127.0.0.1"], port_preserving=lambda: True)
    punching, host, link, tasks = _driver(reach)
    punching.relay_reported(PEER, "9.9.9.9")
    await punching.on_frame(link, {"type": "nat", "op": "punch", "id": 1, "addrs": ["tcp://9.9.9.9:80"]})
    await _settle(tasks)
    [answer] = link.session.sent
    assert "reason" not in answer and answer["addrs"]  # answered with our port: it would dial 9.9.9.9:80


async def test_a_side_whose_nat_changes_ports_still_offers_and_dials() -> None:
    """A symmetric NAT's side: its port guess is wrong outside, but its SYNs reach a 1:1 NAT
    (the NAT lab's c x e pair stayed relayed when it refused)."""
    reach = SimpleNamespace(public_ips=lambda: ["127.0.0.1"], port_preserving=lambda: False)
    punching, host, link, tasks = _driver(reach)
    punching.relay_reported(PEER, "9.9.9.9")
    await punching.on_frame(link, {"type": "nat", "op": "punch", "id": 4, "addrs": ["tcp://9.9.9.9:80"]})
    await _settle(tasks)
    [answer] = link.session.sent
    assert "reason" not in answer and answer["addrs"] and host.counters["punch_offer_unpreserved"] == 1


@pytest.mark.parametrize("reach, reason", [
    (SimpleNamespace(public_ips=lambda: [], port_preserving=lambda: True), "no_public_address"),
])
async def test_a_side_that_cannot_punch_says_why(reach, reason) -> None:
    punching, host, link, tasks = _driver(reach)
    await punching.on_frame(link, {"type": "nat", "op": "punch", "id": 4, "addrs": ["tcp://1.2.3.4:40001"]})
    await _settle(tasks)
    assert link.session.sent == [{"op": "punch", "id": 4, "addrs": [], "reason": reason}]
    assert host.counters[f"punch_failed_{reason}"] == 1


async def test_malformed_and_unexpected_punch_frames() -> None:
    punching, host, link, tasks = _driver()
    await punching.on_frame(link, {"type": "nat", "op": "punch", "id": "x", "addrs": []})
    assert link.session.refused and link.session.refused[0][0] == "malformed_frame"
    # we accepted this relayed connection (N): only N starts, so the peer's punch is ignored
    punching, host, link, tasks = _driver(initiator=False)
    await punching.on_frame(link, {"type": "nat", "op": "punch", "id": 1, "addrs": ["tcp://1.2.3.4:1"]})
    assert not tasks and not link.session.sent and host.counters["punch_unexpected"] == 1


def test_a_direct_connection_always_replaces_a_relayed_one_on_both_ends() -> None:
    small, big = "did:hmp:agent:1", "did:hmp:agent:2"
    for own, peer in ((small, big), (big, small)):
        for new_is_ours in (True, False):
            for old_is_ours in (True, False):
                facts = dict(new_is_ours=new_is_ours, old_is_ours=old_is_ours, new_hash=b"\xff", old_hash=b"\x00")
                assert keeps_new_connection(own, peer, **facts, new_relayed=False, old_relayed=True)
                assert not keeps_new_connection(own, peer, **facts, new_relayed=True, old_relayed=False)
    # two of a kind: the rule of 21.3 as before (the smaller hash of one side's two)
    assert not keeps_new_connection(small, big, new_is_ours=True, old_is_ours=True, new_hash=b"\xff",
                                    old_hash=b"\x00", new_relayed=True, old_relayed=True)


async def test_a_punch_over_a_replaced_connection_gives_way_to_one_over_the_kept_connection() -> None:
    """Both dialled through the relay at once: the punch started over the connection that was
    then replaced ends (closed), and N's punch over the kept one is answered there (before,
    it went to the old run, whose answers went out on the closed connection: the pair
    stayed relayed)."""
    reach = SimpleNamespace(public_ips=lambda: ["127.0.0.1"], port_preserving=lambda: True)
    punching, host, old, tasks = _driver(reach)
    await punching.on_frame(old, {"type": "nat", "op": "punch", "id": 1, "addrs": ["tcp://1.2.3.4:40001"]})
    await asyncio.sleep(0.01)
    assert [f["id"] for f in old.session.sent] == [1]
    first = punching.punches[PEER]
    kept = SimpleNamespace(**{**vars(old), "session": _Session()})
    host.sessions[PEER] = kept
    old.closed = True
    await punching.on_frame(kept, {"type": "nat", "op": "punch", "id": 7, "addrs": ["tcp://1.2.3.4:40002"]})
    await _settle(tasks)
    assert first.state == "failed" and first.reason == "closed" and host.counters["punch_superseded"] == 1
    assert [f["id"] for f in kept.session.sent] == [7] and punching.punches[PEER] is not first
