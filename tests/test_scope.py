"""Propagation scope (profile section 12, spec 3.18): hmpnode.net.scope."""

from __future__ import annotations

import ipaddress
import itertools
from datetime import datetime, timedelta, timezone

import pytest

from hmpnode.net.scope import Channel, Decision, Scope, may_forward, parse_scope, recipients_of

NOW = datetime(2026, 11, 29, 10, 15, tzinfo=timezone.utc)
LATER = "2026-11-29T11:15:00Z"
EARLIER = "2026-11-29T09:15:00Z"
ALICE = "did:hmp:agent:alice"
BOB = "did:hmp:agent:bob"
CAROL = "did:hmp:agent:carol"

ABSENT = object()
NETWORKS = [ABSENT, "", "localhost", "lan:192.168.0.0/24", "lan:fd00::/64"]
CHANNELS = list(Channel)
IPS = [None, "127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1", "192.168.0.7", "::ffff:192.168.0.7",
       "192.168.1.7", "8.8.8.8", "fd00::5", "fd01::5", "not-an-ip"]

#: (network, channel, peer ip) triples in scope, spelled out; the global scope admits everything
_LOOPBACK_IPS = {"127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1"}
IN_SCOPE = {
    **{("localhost", "loopback", ip): True for ip in _LOOPBACK_IPS},
    ("lan:192.168.0.0/24", "lan", "192.168.0.7"): True,
    ("lan:192.168.0.0/24", "lan", "::ffff:192.168.0.7"): True,
    ("lan:fd00::/64", "lan", "fd00::5"): True,
}

# audience name -> (head members, peer_dids, peer_roles, addressed)
AUDIENCES = {
    "broadcast": ({"broadcast": True, "recipient": []}, (), (), True),
    "broadcast_to_others": ({"broadcast": True, "recipient": [BOB]}, (ALICE,), (), True),
    "recipient_served": ({"broadcast": False, "recipient": [BOB, ALICE]}, (ALICE,), (), True),
    "recipient_not_served": ({"broadcast": False, "recipient": [BOB]}, (ALICE,), (), False),
    "group_served": ({"group_recipient": [{"recipient": BOB, "key_recipient": "x"},
                                           {"recipient": CAROL, "key_recipient": "y"}]}, (CAROL,), (), True),
    "group_not_served": ({"group_recipient": [{"recipient": BOB, "key_recipient": "x"}]}, (ALICE,), (), False),
    "mailman_for_recipient": ({"recipient": [BOB]}, (ALICE,), ("mailman",), True),
    "relay_for_group": ({"group_recipient": [{"recipient": BOB, "key_recipient": "x"}]}, (), ("relay",), True),
    "other_role": ({"recipient": [BOB]}, (), ("dht",), False),
    "private": ({"broadcast": False, "recipient": []}, (ALICE, BOB), ("mailman", "relay"), False),
    "private_absent_fields": ({}, (ALICE,), ("relay",), False),
    "broadcast_string_is_not_true": ({"broadcast": "true"}, (), (), False),
}

CASES = list(itertools.product(NETWORKS, CHANNELS, IPS, AUDIENCES, (False, True)))


def _head(network, audience: str, expired: bool) -> dict:
    head = {"timestamp": "2026-11-29T09:00:00Z", "ttl": EARLIER if expired else LATER}
    if network is not ABSENT:
        head["network"] = network
    head.update(AUDIENCES[audience][0])
    return head


@pytest.mark.parametrize("network", NETWORKS, ids=lambda n: "absent" if n is ABSENT else repr(n))
def test_scope_table(network):
    """Every channel x peer ip x audience x expiry, for one network kind."""
    wrong, seen = [], set()
    for net, channel, ip, audience, expired in CASES:
        if net is not network:
            continue
        _, dids, roles, addressed = AUDIENCES[audience]
        head = _head(network, audience, expired)
        d = may_forward(head, peer_ip=ip, channel=channel.value, now=NOW, peer_dids=dids, peer_roles=roles)
        in_scope = network in (ABSENT, "") or IN_SCOPE.get((network, channel.value, ip), False)
        if expired:
            want = "expired"
        elif not in_scope:
            want = "out_of_scope"
        elif not addressed:
            want = "not_addressed"
        else:
            want = "ok"
        seen.add(want)
        if d.reason != want or d.ok is not (want == "ok"):
            wrong.append((channel.value, ip, audience, expired, d.reason, want))
    assert wrong == []
    scoped = network not in (ABSENT, "")
    assert seen == {"ok", "expired", "not_addressed"} | ({"out_of_scope"} if scoped else set())


def test_table_is_complete():
    assert len(CASES) == 5 * 4 * 12 * len(AUDIENCES) * 2


def test_ttl_boundary_and_absent_ttl():
    base = {"broadcast": True, "network": ""}
    kw = dict(peer_ip="8.8.8.8", channel="global", now=NOW)
    assert may_forward({**base, "ttl": "2026-11-29T10:15:00Z"}, **kw).reason == "expired"  # ttl == now
    assert may_forward({**base, "ttl": "2026-11-29T10:15:00.001Z"}, **kw).ok
    assert may_forward(base, **kw).ok  # no ttl: never expires
    assert may_forward({**base, "ttl": "tomorrow"}, **kw) == Decision(False, "malformed", "ttl is not an RFC 3339 UTC timestamp")
    assert may_forward({**base, "ttl": None}, **kw).reason == "malformed"
    # expiry wins over scope and audience
    assert may_forward({"network": "localhost", "ttl": EARLIER}, **kw).reason == "expired"


def test_bad_network_fails_closed():
    """A network form the node does not know is stored but never forwarded, on any
    channel, to any peer, even a relay (profile section 13); a non-string is malformed."""
    for network in ("lan:garbage", "lan:192.168.0.7", "LAN:192.168.0.0/24", "global", "localhost ", "wan:eu"):
        for channel, ip in (("lan", "192.168.0.7"), ("loopback", "127.0.0.1"), ("global", "203.0.113.5"), ("dht", None)):
            decision = may_forward({"broadcast": True, "network": network}, peer_ip=ip, channel=channel, now=NOW,
                                   peer_roles=("relay", "mailman"))
            assert (decision.ok, decision.reason) == (False, "unknown_scope"), (network, channel)
            assert "never forwarded" in decision.detail
    kw = dict(peer_ip="192.168.0.7", channel="lan", now=NOW)
    for network in (5, []):
        assert may_forward({"broadcast": True, "network": network}, **kw).reason == "malformed", network
    assert may_forward({"broadcast": True, "network": None}, **kw).ok  # null reads as ""
    assert may_forward(["not", "a", "head"], **kw).reason == "malformed"  # type: ignore[arg-type]


def test_lan_host_bits_and_ipv6():
    head = {"broadcast": True, "network": "lan:10.1.2.3/16"}
    assert may_forward(head, peer_ip="10.1.200.9", channel="lan", now=NOW).ok
    assert may_forward(head, peer_ip="10.2.0.1", channel="lan", now=NOW).reason == "out_of_scope"
    assert may_forward(head, peer_ip="10.1.200.9", channel="dht", now=NOW).reason == "out_of_scope"
    assert may_forward(head, peer_ip="10.1.200.9", channel="global", now=NOW).reason == "out_of_scope"
    assert may_forward(head, peer_ip="fe80::1%eth0", channel="lan", now=NOW).reason == "out_of_scope"


def test_channel_and_clock_are_checked():
    with pytest.raises(ValueError):
        may_forward({"broadcast": True}, peer_ip=None, channel="udp", now=NOW)
    with pytest.raises(ValueError):
        may_forward({"broadcast": True}, peer_ip=None, channel="global", now=NOW.replace(tzinfo=None))
    # a non-UTC aware clock compares correctly
    east = NOW.astimezone(timezone(timedelta(hours=3)))
    assert may_forward({"broadcast": True, "ttl": "2026-11-29T10:15:00Z"}, peer_ip=None, channel="dht", now=east).reason == "expired"


def test_recipients_of_ignores_junk():
    assert recipients_of({"recipient": ALICE}) == [ALICE]
    assert recipients_of({"recipient": [ALICE, 3, None, ""], "group_recipient": [{"recipient": BOB}, "x", {"recipient": 1}, {}]}) == [ALICE, BOB]
    assert recipients_of({"recipient": {"a": 1}, "group_recipient": "x"}) == []


def test_parse_scope():
    assert parse_scope("") == Scope("global", None)
    assert parse_scope("localhost") == Scope("localhost", None)
    assert parse_scope("lan:192.168.0.0/24") == Scope("lan", ipaddress.ip_network("192.168.0.0/24"))
    assert parse_scope("lan:192.168.0.9/24").subnet == ipaddress.ip_network("192.168.0.0/24")
    assert parse_scope("lan:fd00::1/64").subnet == ipaddress.ip_network("fd00::/64")


@pytest.mark.parametrize("bad", [
    "lan:", "lan:192.168.0.0", "lan:192.168.0.0/33", "lan:192.168.0.0/x", "lan:garbage/24", "lan: 10.0.0.0/8",
    "lan:10.0.0.0/8 ", "lan:１０.0.0.0/8", "Localhost", "localhost ", "global", "lan", "wan:10.0.0.0/8", "*",
])
def test_parse_scope_errors(bad):
    with pytest.raises(ValueError):
        parse_scope(bad)


@pytest.mark.parametrize("bad", [None, 0, b"localhost", ["localhost"]])
def test_parse_scope_rejects_non_strings(bad):
    with pytest.raises(ValueError):
        parse_scope(bad)  # type: ignore[arg-type]


def test_network_of_and_host_key_are_what_limits_per_subnet_and_per_host_count_under():
    from hmpnode.net.scope import host_key, network_of, parse_ip

    v4, v6 = parse_ip("203.0.113.77"), parse_ip("2001:db8:1:2:aaaa::1")
    assert network_of(v4) == "203.0.113.0/24" and network_of(v6) == "2001:db8:1:2::/64"
    assert network_of(v4, v4_prefix=16) == "203.0.0.0/16"
    assert host_key(v4) == "203.0.113.77" and host_key(v6) == "2001:db8:1:2::/64"
    assert host_key(parse_ip("::ffff:203.0.113.77")) == "203.0.113.77"  # an IPv4-mapped peer is that IPv4 host
