"""Reachability and the dial-back gate, sans-IO on a virtual clock (hmpnode.net.reach;
docs/protocol.md 34.1, 34.2)."""

from __future__ import annotations

import itertools

import pytest

from hmpnode.net.reach import (DEADLINE_SECONDS, MAX_REPORTS, REPORTS_PER_GROUP, RETRY_BUSY_SECONDS,
                               RETRY_REFUSED_SECONDS, DialbackGate, DialbackLimits, Reachability, parse_dialback)

PORT = 7000
PUB = "203.0.113.7"  # documentation range: the tests' routable predicate lets it count


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def routable(ip: str) -> bool:
    return not ip.startswith(("10.", "192.168.", "127."))


def make(**limits) -> tuple[Reachability, Clock]:
    clock = Clock()
    tokens = (f"{i:032x}" for i in itertools.count(1))
    return Reachability(PORT, limits=DialbackLimits(**limits), routable=routable, clock=clock,
                        token=lambda: next(tokens)), clock


def report(r: Reachability, did: str, peer_ip: str, addr: str = f"tcp://{PUB}:40001", local_port: int = 40001,
           channel: str = "global") -> bool:
    return r.observed(did, addr, local_port, peer_ip=peer_ip, channel=channel)


def test_one_peer_is_not_enough_and_two_groups_are():
    r, _ = make()
    report(r, "did:a", "198.51.100.1")
    assert r.asks({"did:a"}) == [] and r.verdict == "unknown"
    assert r.public_ips() == [PUB]  # what peers see, confirmed or not
    report(r, "did:b", "192.0.2.9")
    asks = r.asks({"did:a", "did:b"})
    assert [(a.peer, a.addr) for a in asks] == [("did:a", f"tcp://{PUB}:{PORT}"), ("did:b", f"tcp://{PUB}:{PORT}")]
    assert len({a.nonce for a in asks}) == 2 and r.asks({"did:a", "did:b"}) == []  # waiting: not asked twice


def test_many_dids_from_one_subnet_count_once():
    """Lying observed frames: 50 DIDs from one /24 claiming our address is X never get a
    dial-back asked for X (the /24-distinct rule), and hold at most REPORTS_PER_GROUP reports."""
    r, _ = make()
    dids = {f"did:liar{i}" for i in range(50)}
    for i, did in enumerate(sorted(dids)):
        report(r, did, f"198.51.100.{i + 1}", addr="tcp://192.0.2.66:80")
    assert r.asks(dids) == [] and r.verdict == "unknown"
    assert len(r.evidence()) == REPORTS_PER_GROUP and r.counters["observed_group_full"] == 50 - REPORTS_PER_GROUP
    # on loopback and LAN a peer's DID is its group (no subnet to tell hosts apart)
    report(r, "did:l1", "127.0.0.1", channel="loopback")
    report(r, "did:l2", "127.0.0.1", channel="loopback")
    assert [a.peer for a in r.asks({"did:l1", "did:l2"})] == ["did:l1", "did:l2"]


def test_reports_are_bounded_in_all():
    r, _ = make()
    for i in range(MAX_REPORTS + 40):
        report(r, f"did:{i}", f"10.{i // 256}.{i % 256}.1")
    assert len(r.evidence()) == MAX_REPORTS


def test_the_nonce_arriving_makes_public_and_confirms_the_address():
    r, clock = make()
    report(r, "did:a", "198.51.100.1")
    report(r, "did:b", "192.0.2.9")
    first, second = r.asks({"did:a", "did:b"})
    assert r.arrived("f" * 32) is False and r.counters["dialback_unasked"] == 1  # not ours
    clock.now += 1
    assert r.arrived(first.nonce, "198.51.100.1") is True
    assert r.arrived(first.nonce) is False  # once
    assert r.verdict == "public" and r.confirmed_addresses() == [f"tcp://{PUB}:{PORT}"]
    clock.now += DEADLINE_SECONDS
    assert r.verdict == "public"  # the other ask failing takes nothing away
    kinds = [(e["kind"], e.get("outcome")) for e in r.evidence()]
    assert ("dialback", "arrived") in kinds and ("dialback", "failed") in kinds


def test_no_nonce_by_the_deadline_is_private():
    r, clock = make()
    report(r, "did:a", "198.51.100.1")
    report(r, "did:b", "192.0.2.9")
    asks = r.asks({"did:a", "did:b"})
    clock.now += DEADLINE_SECONDS - 1
    assert r.verdict == "unknown"
    clock.now += 1
    assert r.verdict == "private" and r.confirmed_addresses() == []
    assert r.arrived(asks[0].nonce) is False  # too late: nothing changes
    assert r.verdict == "private"


def test_unreachable_is_no_refusal_the_deadline_makes_it_private():
    """The server dialled and nothing answered (a masquerading NAT's reset, a filter's
    silence): the ask stays waiting, and fails at its deadline (the old code took it for a
    refusal: every home in the NAT lab stayed `unknown`)."""
    r, clock = make()
    report(r, "did:a", "198.51.100.1")
    report(r, "did:b", "192.0.2.9")
    a, b = r.asks({"did:a", "did:b"})
    r.result("did:a", a.id, False, "unreachable")
    r.result("did:b", b.id, False, "unreachable")
    assert r.verdict == "unknown" and r.counters["dialback_peer_refused"] == 0
    clock.now += DEADLINE_SECONDS
    assert r.verdict == "private"


def test_peers_are_asked_once_per_interval():
    r, clock = make(ask_interval_seconds=600)
    report(r, "did:a", "198.51.100.1")
    report(r, "did:b", "192.0.2.9")
    assert len(r.asks({"did:a", "did:b"})) == 2
    clock.now += DEADLINE_SECONDS
    assert r.verdict == "private" and r.asks({"did:a", "did:b"}) == []
    clock.now += 600 - DEADLINE_SECONDS - 1
    assert r.asks({"did:a", "did:b"}) == []
    clock.now += 901  # the per-peer interval and half the recheck are over
    assert len(r.asks({"did:a", "did:b"})) == 2


def test_a_refusal_is_no_evidence_and_is_asked_again_after_a_minute():
    r, clock = make(ask_interval_seconds=600)
    report(r, "did:a", "198.51.100.1")
    report(r, "did:b", "192.0.2.9")
    a, b = r.asks({"did:a", "did:b"})
    r.result("did:a", a.id, False, "not_your_address")
    r.result("did:b", b.id, False, "rate_limited")
    r.result("did:b", b.id, True, "")  # no longer waiting: nothing changes
    r.result("did:b", 99, False, "busy")  # never asked
    assert r.counters["dialback_result_unknown"] == 1 and r.counters["dialback_peer_refused"] == 2
    assert r.verdict == "unknown" and r.asks({"did:a", "did:b"}) == []
    clock.now += RETRY_REFUSED_SECONDS - 1
    assert r.asks({"did:a", "did:b"}) == []
    clock.now += 1
    assert len(r.asks({"did:a", "did:b"})) == 2


def test_result_ok_is_only_noted():
    r, clock = make()
    report(r, "did:a", "198.51.100.1")
    report(r, "did:b", "192.0.2.9")
    a, b = r.asks({"did:a", "did:b"})
    r.result("did:a", a.id, True, "")
    r.result("did:b", a.id, False, "busy")  # another peer's ask id
    assert r.verdict == "unknown" and r.counters["dialback_result_unknown"] == 1
    clock.now += DEADLINE_SECONDS
    assert r.verdict == "private"  # a peer's "ok" is not believed


def test_unroutable_addresses_never_count():
    """A LAN or loopback address peers see (unless routable says so) is not asked for."""
    r, _ = make()
    for did, ip in (("did:a", "198.51.100.1"), ("did:b", "192.0.2.9")):
        report(r, did, ip, addr="tcp://192.168.1.5:40001")
    assert r.asks({"did:a", "did:b"}) == [] and r.public_ips() == [] and r.port_preserving() is None


def test_verdicts_expire_and_are_rechecked():
    r, clock = make(recheck_seconds=1800, ask_interval_seconds=600)
    report(r, "did:a", "198.51.100.1")
    report(r, "did:b", "192.0.2.9")
    for ask in r.asks({"did:a", "did:b"}):
        r.arrived(ask.nonce)
    clock.now += 899
    assert r.asks({"did:a", "did:b"}) == []
    clock.now += 1  # half the recheck: asked again
    assert len(r.asks({"did:a", "did:b"})) == 2
    clock.now += DEADLINE_SECONDS
    assert r.verdict == "public"  # the confirmation still holds
    clock.now += 1800
    assert r.verdict == "private"  # only the failed re-check is recent
    r.asks(set())  # both peers gone
    clock.now += 1801
    assert r.verdict == "unknown" and r.evidence()[0]["kind"] == "dialback"  # their reports lapsed


def test_a_new_address_is_asked_at_once_and_the_old_one_lapses():
    r, clock = make()
    report(r, "did:a", "198.51.100.1")
    report(r, "did:b", "192.0.2.9")
    for ask in r.asks({"did:a", "did:b"}):
        r.arrived(ask.nonce)
    assert r.confirmed_addresses() == [f"tcp://{PUB}:{PORT}"]
    clock.now += 700  # past the per-peer ask interval
    report(r, "did:a", "198.51.100.1", addr="tcp://203.0.113.99:5000")
    assert r.confirmed_addresses() == [f"tcp://{PUB}:{PORT}"]  # one peer moving proves nothing
    report(r, "did:b", "192.0.2.9", addr="tcp://203.0.113.99:5001")
    assert r.confirmed_addresses() == []  # nobody sees us at PUB any more
    asks = r.asks({"did:a", "did:b"})
    assert {a.addr for a in asks} == {f"tcp://203.0.113.99:{PORT}"}


def test_port_preservation():
    r, _ = make()
    assert r.port_preserving() is None
    report(r, "did:a", "198.51.100.1", addr=f"tcp://{PUB}:40001", local_port=40001)
    assert r.port_preserving() is True
    report(r, "did:b", "192.0.2.9", addr=f"tcp://{PUB}:51234", local_port=40002)
    assert r.port_preserving() is False


@pytest.mark.parametrize("addr, local_port", [
    ("x" * 10_000, 1), (None, 1), (["tcp://1.2.3.4:5"], 1), ("udp://203.0.113.1:5", 1), ("tcp://host.example:5", 1),
    ("tcp://203.0.113.1:0", 1), ("tcp://203.0.113.1:70000", 1), ("tcp://203.0.113.1:5", 0), ("tcp://203.0.113.1:5", "5"),
    ("tcp://[fe80::1%eth0]:5", 1),
])
def test_garbage_reports_are_counted_and_ignored(addr, local_port):
    r, _ = make()
    assert r.observed("did:a", addr, local_port, peer_ip="198.51.100.1") is False
    assert r.counters["observed_malformed"] == 1 and r.evidence() == []
    assert r.arrived(None) is False and r.arrived(["x"]) is False
    r.result("did:a", "1", "yes", None)
    assert r.counters["dialback_result_unknown"] == 1


def test_no_asks_before_the_port_is_known():
    r, _ = make()
    r.port = 0
    report(r, "did:a", "198.51.100.1")
    report(r, "did:b", "192.0.2.9")
    assert r.asks({"did:a", "did:b"}) == []


def test_parse_dialback():
    nonce = "0123456789abcdef" * 2
    assert parse_dialback({"id": 3, "addr": "tcp://203.0.113.7:7000", "nonce": nonce}) == (3, PUB, 7000, nonce)
    assert parse_dialback({"id": 3, "addr": "tcp://[2001:db8::1]:7000", "nonce": nonce})[1] == "2001:db8::1"
    for bad in ({"id": "3"}, {"id": True}, {"id": -1}, {"id": 2**60}, {"addr": "tcp://h.example:1"},
                {"nonce": nonce.upper()}, {"nonce": nonce[:-1]}, {"nonce": 5}, {"addr": "tcp://203.0.113.7:0"}):
        assert parse_dialback({"id": 3, "addr": "tcp://203.0.113.7:7000", "nonce": nonce, **bad}) is None, bad


def test_gate_dials_only_the_askers_own_address():
    gate = DialbackGate(DialbackLimits(), Clock())
    assert gate.admit("did:a", "198.51.100.1", True, "192.0.2.50") == "not_your_address"
    assert gate.admit("did:a", None, True, "192.0.2.50") == "not_your_address"
    assert gate.admit("did:a", "198.51.100.1", False, "198.51.100.1") == "relayed"
    assert gate.admit("did:a", "::ffff:198.51.100.1", True, "198.51.100.1") is None  # the same address
    assert gate.running == 1


def test_gate_limits_hold_under_a_flood():
    """A dial-back flood: one host with free DIDs gets one dial-back per interval; many hosts
    together get per_minute a minute, concurrent at once."""
    clock = Clock()
    gate = DialbackGate(DialbackLimits(peer_interval_seconds=60, per_minute=30, concurrent=4), clock)
    results = [gate.admit(f"did:{i}", "198.51.100.1", True, "198.51.100.1") for i in range(100)]
    assert results.count(None) == 1 and set(results[1:]) == {"rate_limited"}
    gate.done()
    served = 0
    for minute in range(3):
        results = []
        for i in range(200):
            results.append(gate.admit(f"did:m{minute}.{i}", f"192.0.{i}.{minute + 1}", True, f"192.0.{i}.{minute + 1}"))
            if results[-1] is None:
                gate.done()
        served += results.count(None)
        assert results.count(None) <= 30 and "busy" in results
        clock.now += 60
    assert served == 90 - 1  # the first minute also held the one-host dial-back
    for i in range(10):  # at once: `concurrent`, while none finishes
        gate.admit(f"did:c{i}", f"198.18.0.{i}", True, f"198.18.0.{i}")
    assert gate.running == 4
    clock.now += 30
    assert gate.admit("did:c0", "198.18.0.0", True, "198.18.0.0") == "rate_limited"
    clock.now += 30
    assert gate.admit("did:late", "198.18.0.0", True, "198.18.0.0") == "busy"  # its interval is over, slots are not


def test_the_mesh_counts_what_it_would_dial_and_announces_what_is_confirmed(tmp_path):
    """Mesh wiring: an observed IP counts when the dial rule (docs/protocol.md 20.6) would
    dial it on a peer's word, loopback only when dial_allow lists it; a confirmed address
    is announced beside the interfaces' addresses."""
    import ipaddress

    from hmpnode.net.dialing import DialLimits, DialPolicy
    from hmpnode.net.mesh import Mesh
    from hmpnode.net.settings import MeshSettings
    from tests.conftest import bare_node

    def mesh(**policy) -> Mesh:
        return Mesh(bare_node(tmp_path), MeshSettings(host="192.168.1.20", dht=False,
                                                     dialing=DialLimits(policy=DialPolicy(**policy))))

    default = mesh()
    assert [default._reach_routable(ip) for ip in ("8.8.8.8", "10.0.0.1", "127.0.0.1", "198.51.100.23")] == [
        True, False, False, False]
    assert mesh(private=True)._reach_routable("10.0.0.1") and not mesh(private=True)._reach_routable("127.0.0.1")
    lab = mesh(allow=(ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("198.51.100.0/24")))
    assert lab._reach_routable("127.0.0.1") and lab._reach_routable("198.51.100.23")
    lab.port = lab.reach.port = 7411
    assert lab._own_addresses() == ["tcp://192.168.1.20:7411"]
    for did, ip in (("did:a", "203.0.113.5"), ("did:b", "192.0.2.9")):
        lab.reach.observed(did, "tcp://198.51.100.23:40312", 40312, peer_ip=ip, channel="global")
    for ask in lab.reach.asks({"did:a", "did:b"}):
        lab.reach.arrived(ask.nonce)
    assert lab.reach.verdict == "public"
    assert lab._own_addresses() == ["tcp://198.51.100.23:7411", "tcp://192.168.1.20:7411"]  # confirmed first


def test_busy_is_asked_again_after_ten_seconds():
    """`busy`: the peer's dial-backs in progress were at their cap (a relay that every node
    behind it asks at once): asked again soon, not after a minute (in the NAT lab a node
    waited 80 s for its verdict)."""
    r, clock = make(ask_interval_seconds=600)
    report(r, "did:a", "198.51.100.1")
    report(r, "did:b", "192.0.2.9")
    a, b = r.asks({"did:a", "did:b"})
    r.result("did:a", a.id, False, "busy")
    r.result("did:b", b.id, False, "rate_limited")
    clock.now += RETRY_BUSY_SECONDS - 1
    assert r.asks({"did:a", "did:b"}) == []
    clock.now += 1
    assert [ask.peer for ask in r.asks({"did:a", "did:b"})] == ["did:a"]  # b: after a minute
