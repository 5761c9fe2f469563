"""The dial rule, the dial budget and the bounds of the peers table (hmpnode.net.dialing),
sans-IO: every address class from every source, with made-up interfaces and time."""

from __future__ import annotations

import ipaddress
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hmpnode.net.dialing import (
    REASONS,
    DialBudget,
    DialPolicy,
    Origin,
    PeerFacts,
    check,
    connections_wanted,
    dht_origin,
    lan_origin,
    parse_cidrs,
    peer_origin,
    peers_to_drop,
    table_origin,
    vet,
)
from hmpnode.net.interfaces import IFF_BROADCAST, IFF_MULTICAST, IFF_UP, Interface


def _iface(cidr: str, name: str = "eth9", index: int = 9, flags: int = IFF_UP | IFF_BROADCAST | IFF_MULTICAST):
    net = ipaddress.IPv4Interface(cidr)
    return Interface(name, index, net.ip, net.network, net.network.broadcast_address, flags)


LO = _iface("127.0.0.1/8", "lo", 1, 0x49)
ETH = _iface("10.77.1.1/24")
WLAN = _iface("10.77.2.1/24", "wlan0", 3)
HOST = [LO, ETH, WLAN]

# one address of each class
SOURCE = "tcp://10.77.1.2:7420"          # the LAN neighbour itself
SUBNET = "tcp://10.77.1.3:7420"          # another host of its subnet
OTHER_SUBNET = "tcp://10.77.2.9:7420"    # a subnet of ours, but not the one the datagram came by
OWN = "tcp://10.77.1.1:7420"             # our own address
NET_ADDR = "tcp://10.77.1.0:7420"
BCAST = "tcp://10.77.1.255:7420"
PRIVATE = "tcp://192.168.5.5:7420"
CGNAT = "tcp://100.64.0.9:7420"
DOC = "tcp://192.0.2.80:7420"            # TEST-NET-1: not globally routable
LINK_LOCAL = "tcp://169.254.1.1:7420"
LOOPBACK = "tcp://127.0.0.1:7420"
GLOBAL = "tcp://8.8.8.8:7420"
GLOBAL6 = "tcp://[2606:4700::1111]:7420"
ULA6 = "tcp://[fd00::5]:7420"
LOOPBACK6 = "tcp://[::1]:7420"
LINK_LOCAL6 = "tcp://[fe80::1]:7420"
NAME = "tcp://node.example:7420"
UNSPECIFIED = "tcp://0.0.0.0:7420"
MULTICAST = "tcp://239.255.74.77:7420"
LIMITED = "tcp://255.255.255.255:7420"
RESERVED = "tcp://240.0.0.1:7420"
PORT0 = "tcp://10.77.1.2:0"
HTTP = "http://10.77.1.2:7420"

ALWAYS_REFUSED = {NAME: "hostname", UNSPECIFIED: "special", MULTICAST: "special", LIMITED: "special",
                  RESERVED: "special", PORT0: "port", HTTP: "malformed", "tcp://10.77.1.2": "malformed",
                  "tcp://10.77.1.2:70000": "malformed", "": "malformed"}


def _reasons(origin: Origin, policy: DialPolicy = DialPolicy()) -> dict[str, str | None]:
    addrs = [SOURCE, SUBNET, OTHER_SUBNET, OWN, NET_ADDR, BCAST, PRIVATE, CGNAT, DOC, LINK_LOCAL, LOOPBACK, GLOBAL,
             GLOBAL6, ULA6, LOOPBACK6, LINK_LOCAL6, *ALWAYS_REFUSED]
    return {a: check(a, origin, policy) for a in addrs}


def test_lan_announce_only_its_source_and_subnet():
    """docs/protocol.md 20.6: from a LAN announce, the source IP and the subnet of the
    interface it came by; nothing else, whatever the policy."""
    got = _reasons(lan_origin("10.77.1.2", [ETH]))
    assert got == {
        SOURCE: None, SUBNET: None, OTHER_SUBNET: "off_subnet", OWN: "own", NET_ADDR: "special", BCAST: "special",
        PRIVATE: "off_subnet", CGNAT: "off_subnet", DOC: "off_subnet", LINK_LOCAL: "off_subnet",
        LOOPBACK: "off_subnet", GLOBAL: "off_subnet", GLOBAL6: "off_subnet", ULA6: "off_subnet",
        LOOPBACK6: "off_subnet", LINK_LOCAL6: "off_subnet", **ALWAYS_REFUSED,
    }
    everything = DialPolicy(private=True, hostnames=True, allow=parse_cidrs(["0.0.0.0/0", "::/0"]))
    assert _reasons(lan_origin("10.77.1.2", [ETH]), everything) == got


def test_lan_announce_edge_sources():
    # a node on this host sends from our own address: it may name it
    assert check(OWN, lan_origin("10.77.1.1", [ETH])) is None
    # a source outside the interface's subnet: its own address only
    origin = lan_origin("192.0.2.80", [ETH])
    assert check(DOC, origin) is None and check(SUBNET, origin) == "off_subnet"
    # an unusable source vouches for nothing
    for source in ("0.0.0.0", "239.255.74.77", "not an ip", "::1"):
        assert check(SOURCE, lan_origin(source, [ETH])) == "off_subnet"
    # a datagram on loopback: loopback addresses (this host's nodes), not our LAN addresses
    origin = lan_origin("127.0.0.1", [LO])
    assert check(LOOPBACK, origin) is None and check("tcp://127.0.0.2:1", origin) is None
    assert check(OWN, origin) == "off_subnet" and check(GLOBAL, origin) == "off_subnet"


def test_global_peer_and_dht_record_name_only_global_addresses():
    """A handshake from a peer outside our subnets, and a DHT record: globally routable
    addresses and the peer's own IP; no loopback, private, link-local or special ranges."""
    expected = {
        SOURCE: "private", SUBNET: "private", OTHER_SUBNET: "private", OWN: "private", NET_ADDR: "private",
        BCAST: "private", PRIVATE: "private", CGNAT: "private", DOC: "private", LINK_LOCAL: "link_local",
        LOOPBACK: "loopback", GLOBAL: None, GLOBAL6: None, ULA6: "private", LOOPBACK6: "loopback",
        LINK_LOCAL6: "link_local", **ALWAYS_REFUSED,
    }
    assert _reasons(dht_origin(local=False)) == expected
    assert _reasons(peer_origin("203.0.113.50", HOST)) == expected
    # its own IP is vouched for by the connection, even if not globally routable
    assert check("tcp://203.0.113.50:7420", peer_origin("203.0.113.50", HOST)) is None


def test_lan_peer_handshake_names_its_subnet_and_global_addresses():
    got = _reasons(peer_origin("10.77.1.2", HOST))
    assert got[SOURCE] is None and got[SUBNET] is None and got[GLOBAL] is None and got[GLOBAL6] is None
    assert got[OWN] == "own" and got[OTHER_SUBNET] == "private" and got[LOOPBACK] == "loopback"
    assert got[PRIVATE] == "private" and got[NAME] == "hostname"


def test_this_hosts_peers_may_name_loopback():
    """A peer over loopback, and a DHT bound to loopback, are this host: loopback and the
    host's own addresses are fine, other private addresses are not."""
    for origin in (peer_origin("127.0.0.1", HOST), peer_origin("10.77.1.1", HOST)):
        got = _reasons(origin)
        assert got[LOOPBACK] is None and got[LOOPBACK6] is None and got[OWN] is None and got[GLOBAL] is None
        assert got[PRIVATE] == "private" and got[SUBNET] == "private" and got[NAME] == "hostname"
    got = _reasons(dht_origin(local=True))
    assert got[LOOPBACK] is None and got[PRIVATE] == "private" and got[LINK_LOCAL] == "link_local"


def test_peers_table_is_judged_again():
    """A stored row may name the host's subnets (loopback included) and global addresses."""
    got = _reasons(table_origin(HOST))
    assert got[SOURCE] is None and got[OTHER_SUBNET] is None and got[LOOPBACK] is None and got[GLOBAL] is None
    assert got[PRIVATE] == "private" and got[LINK_LOCAL] == "link_local" and got[NAME] == "hostname"
    assert got[NET_ADDR] == "special" and got[UNSPECIFIED] == "special"
    # interfaces changed since (the node moved to another network): the old LAN address is off
    assert check(SUBNET, table_origin([LO, _iface("192.168.7.2/24")])) == "private"


def test_policy_widens_only_non_lan_sources():
    dht = dht_origin(local=False)
    assert check(PRIVATE, dht, DialPolicy(private=True)) is None
    assert check(LOOPBACK, dht, DialPolicy(private=True)) is None
    allow = DialPolicy(allow=parse_cidrs(["192.168.0.0/16", "fd00::/8"]))
    assert check(PRIVATE, dht, allow) is None and check(ULA6, dht, allow) is None
    assert check(CGNAT, dht, allow) == "private" and check(LOOPBACK, dht, allow) == "loopback"
    assert check(NAME, dht, DialPolicy(hostnames=True)) is None
    assert check(NAME, lan_origin("10.77.1.2", [ETH]), DialPolicy(hostnames=True)) == "hostname"
    # never, whatever the policy
    for addr in (UNSPECIFIED, MULTICAST, LIMITED, PORT0):
        assert check(addr, dht, DialPolicy(private=True, hostnames=True, allow=parse_cidrs(["0.0.0.0/0"]))) is not None
    with pytest.raises(ValueError, match="not a CIDR"):
        parse_cidrs(["10.0.0.0/33"])


def test_vet_orders_the_source_first_and_filters_schemes():
    origin = lan_origin("10.77.1.2", [ETH])
    allowed, refused = vet([SUBNET, PRIVATE, "udp://10.77.1.2:7421", SOURCE, NAME], origin)
    assert allowed == ["udp://10.77.1.2:7421", SOURCE, SUBNET]  # the source's own first, in announce order
    assert sorted(refused) == ["hostname", "off_subnet"]
    allowed, refused = vet([SUBNET, "udp://10.77.1.2:7421"], origin, schemes=("tcp",))
    assert allowed == [SUBNET] and refused == ["scheme"]


@given(st.one_of(st.text(max_size=80), st.none(), st.integers(), st.binary(max_size=20)),
       st.sampled_from([lan_origin("10.77.1.2", [ETH]), peer_origin("203.0.113.5", HOST), dht_origin(False),
                        table_origin(HOST)]))
def test_check_never_raises(addr, origin):
    assert check(addr, origin) in REASONS | {None}


# -- the dial budget -----------------------------------------------------------------


def test_dial_budget_bounds_attempts_node_wide():
    budget = DialBudget(2.0, 16.0)
    now, taken = 1000.0, 0
    for _ in range(10_000):  # 100 s, a try every 10 ms
        now += 0.01
        taken += budget.take(now)
    assert taken <= 16 + 2 * 100 and taken >= 2 * 100


def test_backoff_doubles_with_jitter_up_to_the_cap_and_resets():
    budget = DialBudget(100.0, 100.0, base=5.0, cap=60.0, rng=random.Random(7))
    now = 0.0
    waits = []
    for expected in (5, 10, 20, 40, 60, 60):
        assert budget.failed("p", now) == len(waits) + 1
        until = budget._state["p"][1]
        waits.append(until - now)
        assert expected * 0.75 <= until - now <= min(60.0, expected * 1.25)
        assert not budget.due("p", now) and not budget.due("p", until - 0.001) and budget.due("p", until)
        now = until
    budget.succeeded("p")
    assert budget.due("p", now) and budget.failures("p") == 0
    budget.failed("p", now)
    budget.reset("p")
    assert budget.due("p", now)
    budget.defer("q", now + 3)
    assert not budget.due("q", now + 2) and budget.failures("q") == 0


def test_backoff_state_is_bounded():
    budget = DialBudget(1.0, 1.0, max_tracked=100)
    for i in range(1000):
        budget.failed(f"p{i}", 0.0)
    assert len(budget) == 100 and budget.due("p0", 0.0) and not budget.due("p999", 0.0)


# -- the peers table -----------------------------------------------------------------

DAY = 86_400_000_000


def test_peers_table_evicts_never_contacted_then_oldest_contact():
    now = 100 * DAY
    rows = [PeerFacts(f"new{i}", now - i, None) for i in range(5)]
    rows += [PeerFacts(f"old{i}", now, now - DAY * (i + 1)) for i in range(5)]
    expired, evicted = peers_to_drop(rows, cap=4, now_us=now, max_unanswered_age_us=DAY, give_up_after=5,
                                     failures=lambda d: 0, keep={"old4"})
    assert expired == []
    # 10 rows, cap 4, old4 kept: 6 go, the never-contacted first (oldest seen first), then the oldest contact
    assert evicted == ["new4", "new3", "new2", "new1", "new0", "old3"]


def test_peers_that_never_answered_expire():
    now = 100 * DAY
    rows = [PeerFacts("failing", now, None), PeerFacts("silent", now - DAY - 1, None),
            PeerFacts("answered_once", now - 50 * DAY, now - 50 * DAY), PeerFacts("fresh", now, None),
            PeerFacts("kept", now - 2 * DAY, None)]
    failures = {"failing": 5, "answered_once": 50, "fresh": 4}.get
    expired, evicted = peers_to_drop(rows, cap=100, now_us=now, max_unanswered_age_us=DAY, give_up_after=5,
                                     failures=lambda d: failures(d, 0), keep={"kept"})
    assert sorted(expired) == ["failing", "silent"] and evicted == []


def test_connections_wanted_fills_target_and_keeps_outbound_share():
    # below target: the gap
    assert connections_wanted(target=8, min_outbound=2, live=3, outbound=3) == 5
    # at target, but all inbound: still dials its own min_outbound
    assert connections_wanted(target=8, min_outbound=2, live=8, outbound=0) == 2
    assert connections_wanted(target=8, min_outbound=2, live=10, outbound=1) == 1
    # at target with enough of its own: nothing (never negative work)
    assert connections_wanted(target=8, min_outbound=2, live=8, outbound=2) <= 0
    # min_outbound above target is capped by target; target 0 dials nothing
    assert connections_wanted(target=3, min_outbound=5, live=3, outbound=0) == 3
    assert connections_wanted(target=0, min_outbound=2, live=0, outbound=0) <= 0
