"""Peer slots (hmpnode.net.slots): admission, caps, reserves and eviction, sans-IO."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from hmpnode.net.scope import Channel
from hmpnode.net.slots import LOOPBACK, Slot, SlotLimits, address_keys, admit, ban_key, pick_victim, score, usage

from .conftest import bare_node

LIMITS = SlotLimits(max_peers=16, outbound_slots=4, max_per_address=3, max_per_subnet=5, max_loopback=6,
                    protect_useful=2)


def inbound(key, address, subnet=None, *, score=0.0, since=0.0, pinned=False) -> Slot:
    return Slot(key, False, address, subnet, pinned, score, since)


def outbound(key, address, subnet=None, **kw) -> Slot:
    return Slot(key, True, address, subnet, kw.get("pinned", False), kw.get("score", 0.0), kw.get("since", 0.0))


# -- address keys -----------------------------------------------------------------------


def test_address_keys():
    assert address_keys("127.0.0.1", Channel.LOOPBACK) == (LOOPBACK, None)
    assert address_keys("127.0.0.9", Channel.LOOPBACK) == (LOOPBACK, None)  # this host is one address
    assert address_keys("::1", Channel.LOOPBACK) == (LOOPBACK, None)
    assert address_keys("10.1.2.3", Channel.LAN) == ("10.1.2.3", None)  # no subnet cap on a local network
    assert address_keys("198.51.100.7", Channel.GLOBAL) == ("198.51.100.7", "198.51.100.0/24")
    assert address_keys("::ffff:198.51.100.7", Channel.GLOBAL) == ("198.51.100.7", "198.51.100.0/24")
    assert address_keys("2001:db8:1:2:3:4:5:6", Channel.GLOBAL) == ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64")
    assert address_keys("not an ip", Channel.GLOBAL) == ("not an ip", None)


def test_ban_key_is_the_address_or_an_ipv6_slash_64():
    assert ban_key(*address_keys("198.51.100.7", Channel.GLOBAL)) == "198.51.100.7"
    assert ban_key(*address_keys("10.1.2.3", Channel.LAN)) == "10.1.2.3"
    assert ban_key(*address_keys("2001:db8:1:2::9", Channel.GLOBAL)) == "2001:db8:1:2::/64"
    assert ban_key(*address_keys("2001:db8:1:2::77", Channel.GLOBAL)) == "2001:db8:1:2::/64"  # same host
    assert ban_key(*address_keys("fe80::1", Channel.LAN)) == "fe80::1"
    assert ban_key(*address_keys("::1", Channel.LOOPBACK)) == LOOPBACK


def test_score_counts_deliveries_capped_against_strikes():
    assert score(5, 0) == 5
    assert score(10**9, 0) == score(10**6, 0)  # capped
    assert score(20, 1) < score(20, 0) and score(0, 1) < 0


# -- admission -----------------------------------------------------------------------------


def test_per_address_cap():
    slots = [inbound(i, "192.0.2.1", since=i) for i in range(3)]
    verdict = admit(slots, inbound("x", "192.0.2.1"), LIMITS)
    assert not verdict.admit and verdict.reason == "per_address" and verdict.evict is None
    assert admit(slots + [outbound("o", "192.0.2.9")], inbound("x", "192.0.2.9"), LIMITS).admit
    assert admit(slots, inbound("x", "192.0.2.2"), LIMITS).admit


def test_per_subnet_cap_only_where_a_subnet_is_given():
    slots = [inbound(i, f"198.51.100.{i}", "198.51.100.0/24") for i in range(5)]
    assert admit(slots, inbound("x", "198.51.100.77", "198.51.100.0/24"), LIMITS).reason == "per_subnet"
    assert admit(slots, inbound("x", "198.51.101.1", "198.51.101.0/24"), LIMITS).admit
    lan = [inbound(i, f"10.0.0.{i}") for i in range(10)]
    assert admit(lan, inbound("x", "10.0.0.99"), LIMITS).admit


def test_loopback_has_its_own_cap():
    slots = [inbound(i, LOOPBACK) for i in range(6)]
    assert admit(slots[:5], inbound("x", LOOPBACK), LIMITS).admit  # more than max_per_address
    assert admit(slots, inbound("x", LOOPBACK), LIMITS).reason == "loopback_full"
    assert admit(slots, inbound("x", "192.0.2.1"), LIMITS).admit  # another address still gets in


def test_inbound_never_takes_the_outbound_slots():
    slots = [inbound(i, f"192.0.2.{i}", since=100 + i, score=5) for i in range(12)]  # 16 - 4 inbound: full
    for i in range(4):
        verdict = admit(slots, outbound(f"o{i}", "203.0.113.1"), LIMITS)
        assert verdict.admit and verdict.evict is None
        slots.append(outbound(f"o{i}", "203.0.113.1"))
    assert admit(slots, outbound("o9", "203.0.113.2"), LIMITS).reason == "full"  # 16 in all


def test_pinned_always_admitted_and_uncounted():
    slots = [inbound(i, "192.0.2.1", pinned=True) for i in range(40)]  # over every cap, all pinned
    assert admit(slots, inbound("x", "192.0.2.1"), LIMITS).admit
    full = [inbound(i, f"192.0.2.{i}", score=1, since=i) for i in range(16)]
    assert admit(full, inbound("p", "192.0.2.1", pinned=True), LIMITS).reason == "pinned"
    assert admit(full, outbound("p", "192.0.2.1", pinned=True), LIMITS).reason == "pinned"


# -- eviction -----------------------------------------------------------------------------------


def test_full_inbound_evicts_the_lowest_score_peer():
    slots = [inbound(i, f"192.0.2.{i}", score=10 + i, since=i) for i in range(11)]
    slots.append(inbound("low", "192.0.2.200", score=-5, since=0))  # old but offended: not protected
    verdict = admit(slots, inbound("new", "198.51.100.1"), LIMITS)
    assert verdict.admit and verdict.reason == "evict" and verdict.evict.key == "low"


def test_eviction_never_picks_a_pinned_or_outbound_peer():
    slots = [inbound(i, f"192.0.2.{i}", score=50, since=i) for i in range(10)]
    slots += [inbound("pinned", "192.0.2.99", score=-100, pinned=True), outbound("out", "203.0.113.5", score=-100)]
    slots += [inbound("a", "192.0.2.50", score=0, since=20), inbound("b", "192.0.2.51", score=0, since=21)]
    verdict = admit(slots, inbound("new", "198.51.100.1"), LIMITS)
    assert verdict.evict is not None and verdict.evict.key in ("a", "b")


def test_eviction_protects_the_useful_and_the_long_lived():
    # two very useful peers and old peers with a score of 0; the attacker's youngest go first
    honest = [inbound("u1", "192.0.2.1", score=500, since=50), inbound("u2", "192.0.2.2", score=400, since=60)]
    old = [inbound(f"old{i}", f"192.0.2.{10 + i}", since=i) for i in range(5)]
    attacker = [inbound(f"a{i}", "198.51.100.1", since=100 + i) for i in range(3)]
    attacker += [inbound(f"b{i}", "198.51.100.2", since=100 + i) for i in range(2)]
    slots = honest + old + attacker
    assert len(slots) == LIMITS.max_inbound
    victim = pick_victim(slots, LIMITS)
    # ties at score 0 go to the biggest address group, then to the youngest
    assert victim.key == "a2"
    # newcomers evicting again and again never reach the useful or the old ones
    evicted = []
    for k in range(50):
        victim = pick_victim(slots, LIMITS)
        evicted.append(victim.key)
        slots = [s for s in slots if s.key != victim.key] + [inbound(f"n{k}", f"203.0.113.{k % 3}", since=200 + k)]
    assert {"u1", "u2", "old0", "old1", "old2", "old3", "old4"}.isdisjoint(evicted)


def test_nothing_to_evict_is_a_refusal():
    slots = [inbound(i, f"192.0.2.{i}", pinned=True) for i in range(20)]
    slots += [inbound(f"u{i}", f"192.0.2.{50 + i}", score=100, since=i) for i in range(2)]
    limits = SlotLimits(max_peers=3, outbound_slots=1, max_per_address=8, protect_useful=4)
    assert admit(slots, inbound("new", "198.51.100.1"), limits).reason == "full"


def test_an_honest_newcomer_gets_in_while_one_address_holds_its_cap():
    limits = SlotLimits(max_peers=64, outbound_slots=8, max_per_address=8, max_per_subnet=16, max_loopback=32)
    slots: list[Slot] = []
    refused = Counter()
    for i in range(63):  # one address minting DIDs
        verdict = admit(slots, inbound(f"a{i}", "192.0.2.66", "192.0.2.0/24", since=i), limits)
        if verdict.admit:
            slots.append(inbound(f"a{i}", "192.0.2.66", "192.0.2.0/24", since=i))
        else:
            refused[verdict.reason] += 1
    assert len(slots) == 8 and refused == {"per_address": 55}
    assert admit(slots, inbound("honest", "198.51.100.1", "198.51.100.0/24"), limits).admit


# -- properties over random populations -----------------------------------------------------


def _random_slot(rng: random.Random, key: int, now: float) -> Slot:
    kind = rng.random()
    if kind < 0.2:
        address, subnet = LOOPBACK, None
    elif kind < 0.4:
        address, subnet = f"10.0.0.{rng.randrange(6)}", None
    else:
        net = rng.randrange(4)
        address, subnet = f"198.51.{net}.{rng.randrange(5)}", f"198.51.{net}.0/24"
    return Slot(key, rng.random() < 0.3, address, subnet, rng.random() < 0.05,
                rng.choice([0.0, 0.0, 1.0, 20.0, 500.0, -10.0]), now)


@pytest.mark.parametrize("seed", range(40))
def test_invariants_hold_for_random_arrivals(seed):
    rng = random.Random(seed)
    limits = SlotLimits(max_peers=rng.randrange(4, 40), outbound_slots=rng.randrange(0, 8),
                        max_per_address=rng.randrange(1, 6), max_per_subnet=rng.randrange(1, 12),
                        max_loopback=rng.randrange(1, 20), protect_useful=rng.randrange(0, 5))
    slots: list[Slot] = []
    for step in range(400):
        if slots and rng.random() < 0.15:  # someone leaves
            slots.pop(rng.randrange(len(slots)))
        new = _random_slot(rng, step, float(step))
        before = list(slots)
        verdict = admit(slots, new, limits)
        if verdict.evict is not None:
            victim = verdict.evict
            assert verdict.admit and victim in before
            assert not victim.pinned and not victim.outbound  # never a pinned or an outbound one
            assert not new.outbound and not new.pinned
            slots.remove(victim)
        if verdict.admit:
            slots.append(new)
        counted = [s for s in slots if not s.pinned]
        inbound_ = [s for s in counted if not s.outbound]
        # caps: an admission never takes the node past one (a newcomer that would is refused)
        assert len(counted) <= limits.max_peers
        assert len(inbound_) <= limits.max_inbound
        by_address = Counter(s.address for s in counted)
        if not new.outbound and not new.pinned and verdict.admit:
            assert by_address[new.address] <= limits.max_per_address or new.address == LOOPBACK
            if new.subnet is not None:
                assert sum(1 for s in counted if s.subnet == new.subnet) <= limits.max_per_subnet
            if new.address == LOOPBACK:
                assert sum(1 for s in counted if s.address == LOOPBACK) <= limits.max_loopback
        # the outbound reserve: inbound connections alone never leave the node unable to dial out
        if len(counted) < limits.max_peers:
            assert admit(slots, Slot("dial", True, "203.0.113.9", None), limits).admit
        elif limits.outbound_slots:
            assert sum(1 for s in counted if s.outbound) >= min(limits.outbound_slots, limits.max_peers)
        # the best `protect_useful` positive scores are never evicted
        victim = pick_victim(inbound_, limits)
        if victim is not None:
            best = sorted((s for s in inbound_ if s.score > 0), key=lambda s: (-s.score, s.since))
            assert victim not in best[: limits.protect_useful]


def test_usage_reports_directions_and_busiest_addresses():
    slots = [inbound(i, "192.0.2.1") for i in range(3)] + [outbound("o", "203.0.113.1"),
                                                         inbound("p", "192.0.2.1", pinned=True)]
    u = usage(slots, LIMITS)
    assert (u["inbound"], u["outbound"], u["pinned"], u["max_inbound"]) == (3, 1, 1, 12)
    assert u["top_addresses"][0] == {"address": "192.0.2.1", "connections": 3}


# -- settings ------------------------------------------------------------------------------------


def test_slot_settings_reach_the_mesh(tmp_path):
    from hmpnode.config import load_settings
    from hmpnode.daemon import mesh_settings
    from hmpnode.net.mesh import Mesh

    env = {"HMPNODE_PEER_ALLOW": "10.0.0.0/8, fd00::/8", "HMPNODE_PEER_PINNED": "did:hmp:agent:abc",
           "HMPNODE_PEER_MAX_PER_ADDRESS": "3", "HMPNODE_PEER_MIN_OUTBOUND": "2"}
    m = mesh_settings(load_settings(data_dir=tmp_path, config_file=None, env=env, overrides={}))
    assert m.allow == ("10.0.0.0/8", "fd00::/8") and m.pinned == ("did:hmp:agent:abc",)
    assert (m.slots.max_per_address, m.slots.max_per_subnet, m.slots.max_loopback) == (3, 16, 32)
    assert m.dialing.min_outbound == 2
    assert (m.mesh.max_dids_per_address, m.mesh.did_window_seconds) == (16, 600)

    mesh = Mesh(bare_node(tmp_path), m)
    assert mesh.admission.allowed("10.9.8.7") and mesh.admission.allowed("::ffff:10.1.1.1") and mesh.admission.allowed("fd00::5")
    assert not mesh.admission.allowed("192.0.2.1") and not mesh.admission.allowed("garbage")
    assert mesh.admission.limits == SlotLimits(max_peers=64, outbound_slots=8, max_per_address=3, max_per_subnet=16,
                                          max_loopback=32)


@pytest.mark.parametrize("value", ["10.0.0.0/33", "10.0.0.1", "not a net", "fd00::/129"])
def test_a_bad_allow_entry_is_a_config_error(tmp_path, value):
    from hmpnode.config import ConfigError, load_settings

    with pytest.raises(ConfigError, match="peer.allow"):
        load_settings(data_dir=tmp_path, config_file=None, env={"HMPNODE_PEER_ALLOW": value}, overrides={})
