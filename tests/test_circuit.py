"""A circuit relay's bookkeeping (hmpnode.net.circuit, sans-IO), relay:// addresses
(announce, dialing) and the one-connection rule between direct and relayed connections."""

from __future__ import annotations

import random
import tracemalloc
from collections import Counter
from datetime import datetime, timedelta, timezone

import pytest

from hmpnode.identity import Identity
from hmpnode.net import dialing as D
from hmpnode.net.announce import (build_peer_announce, check_address_record, make_address_record, parse_addr,
                                  parse_relay_addr, relay_addr)
from hmpnode.net.circuit import REFUSALS, TOKEN_HEX, CircuitLimits, CircuitRelay
from hmpnode.net.dhtrecords import build_peer_record, verify_record
from hmpnode.net.session import keeps_new_connection

RELAY = "did:hmp:agent:" + "r" * 20
LIMITS = CircuitLimits(max_reservations=8, max_reservations_per_ip=2, reservation_seconds=100.0, max_circuits=5,
                       max_circuits_per_reservation=2, circuit_seconds=50.0, circuit_bytes=1000, accept_seconds=3.0)


def relay(limits: CircuitLimits = LIMITS) -> CircuitRelay:
    return CircuitRelay(limits, random.Random(7), Counter())


def did(i: int) -> str:
    return f"did:hmp:agent:n{i:04d}"


# -- reservations ---------------------------------------------------------------------------


def test_a_reservation_flood_from_one_address_stops_at_its_cap() -> None:
    r = relay()
    answers = [r.reserve(did(i), "198.51.100.7", 0.0) for i in range(10)]
    assert answers[:2] == [(100.0, None)] * 2
    assert answers[2:] == [(None, "address_limit")] * 8
    assert len(r.reservations) == 2 and r.counters["circuit_refused_address_limit"] == 8


def test_a_reservation_flood_from_many_addresses_stops_at_the_relay_cap() -> None:
    r = relay()
    answers = [r.reserve(did(i), f"198.51.100.{i}", 0.0)[1] for i in range(20)]
    assert answers == [None] * 8 + ["reservation_limit"] * 12
    assert len(r.reservations) == 8


def test_a_reservation_lasts_its_seconds_and_a_new_reserve_renews_it() -> None:
    r = relay()
    r.reserve(did(1), "198.51.100.1", 0.0)
    assert r.reserve(did(1), "198.51.100.1", 90.0) == (100.0, None)  # renewed: counts once
    assert len(r.reservations) == 1 and r.counters["circuit_reservations_renewed"] == 1
    r.expire(189.0)
    assert did(1) in r.reservations
    r.expire(190.0)
    assert did(1) not in r.reservations
    assert r.open(did(1), 190.0) == (None, "no_reservation")


def test_reservations_of_nodes_without_a_session_go() -> None:
    r = relay()
    for i in range(3):
        r.reserve(did(i), f"198.51.100.{i}", 0.0)
    r.keep_only({did(1)})
    assert set(r.reservations) == {did(1)}


# -- circuits -------------------------------------------------------------------------------


def test_a_circuit_flood_through_one_reservation_stops_at_its_cap_and_the_relay_cap() -> None:
    r = relay()
    for i in range(4):
        r.reserve(did(i), f"198.51.100.{i}", 0.0)
    to_one = [r.open(did(0), 0.0)[1] for _ in range(5)]
    assert to_one == [None, None, "circuit_limit", "circuit_limit", "circuit_limit"]
    others = [r.open(did(1 + i % 3), 0.0)[1] for i in range(6)]
    assert others == [None, None, None, "relay_busy", "relay_busy", "relay_busy"]
    assert len(r.circuits) == LIMITS.max_circuits


def test_tokens_are_32_hex_from_the_rng_and_are_taken_once() -> None:
    r = relay()
    r.reserve(did(0), "198.51.100.1", 0.0)
    circuit, _ = r.open(did(0), 0.0)
    assert len(circuit.token) == TOKEN_HEX and int(circuit.token, 16) >= 0
    assert circuit.token == f"{random.Random(7).getrandbits(128):032x}"
    assert r.accept(circuit.token, 1.0)[0] is circuit and not circuit.pending
    assert circuit.deadline == 1.0 + LIMITS.circuit_seconds
    assert r.accept(circuit.token, 1.0) == (None, "expired")  # taken
    assert r.accept("0" * 32, 1.0) == (None, "expired")  # unknown
    assert r.accept(None, 1.0) == (None, "expired")  # type: ignore[arg-type]


def test_a_circuit_the_reserving_node_does_not_accept_expires() -> None:
    r = relay()
    r.reserve(did(0), "198.51.100.1", 0.0)
    circuit, _ = r.open(did(0), 0.0)
    assert r.expire(2.9) == [] and circuit.token in r.circuits
    assert r.expire(3.0) == [] and circuit.token not in r.circuits  # pending: dropped here
    assert r.accept(circuit.token, 3.0) == (None, "expired")
    assert r.reservations[did(0)].circuits == 0 and r.counters["circuit_accept_expired"] == 1


def test_an_open_circuit_past_its_duration_is_handed_back_to_close() -> None:
    r = relay()
    r.reserve(did(0), "198.51.100.1", 0.0)
    circuit, _ = r.open(did(0), 0.0)
    r.accept(circuit.token, 0.0)
    r.reserve(did(0), "198.51.100.1", 49.0)  # the reservation outlives it
    assert r.expire(50.0) == [circuit]
    r.close(circuit)
    r.close(circuit)  # twice: counted once
    assert r.circuits == {} and r.reservations[did(0)].circuits == 0 and r.counters["circuit_closed"] == 1


def test_a_circuit_that_pushes_more_bytes_than_allowed_is_cut_at_the_limit() -> None:
    r = relay()
    r.reserve(did(0), "198.51.100.1", 0.0)
    circuit, _ = r.open(did(0), 0.0)
    r.accept(circuit.token, 0.0)
    carried = [r.carry(circuit, 300) for _ in range(5)]
    assert carried == [True, True, True, False, False]
    assert circuit.bytes == 900 and r.counters["circuit_cut_bytes"] == 2
    assert r.carry(circuit, 100) is True  # exactly to the limit
    assert circuit.bytes == LIMITS.circuit_bytes


def test_status_reports_the_numbers_and_the_refusals_by_code() -> None:
    r = relay()
    r.reserve(did(0), "198.51.100.1", 0.0)
    c, _ = r.open(did(0), 0.0)
    r.open(did(0), 0.0)
    r.accept(c.token, 0.0)
    r.open(did(9), 0.0)
    s = r.status()
    assert (s["reservations"], s["circuits"], s["pending"]) == (1, 1, 1)
    assert s["refused"] == {"no_reservation": 1}
    assert set(s["refused"]) <= set(REFUSALS)


def test_the_relay_bookkeeping_stays_small_at_its_caps() -> None:
    """Memory of the bookkeeping at the default caps (128 reservations, 64 circuits): what a
    flood can make the relay hold beyond the sockets (bench_circuit measures those)."""
    r = relay(CircuitLimits())
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1000):
            r.reserve(did(i), f"198.51.{i // 200}.{i % 200}", 0.0)
        for i in range(1000):
            r.open(did(i % 128), 0.0)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(r.reservations) == 128 and len(r.circuits) == 64
    assert held < 500 * (128 + 64)  # bytes: ~250 per entry measured (its DID and token strings included)


# -- relay:// addresses ---------------------------------------------------------------------


def test_relay_addresses_parse_and_are_made_alike() -> None:
    addr = relay_addr("93.184.216.5", 4100, RELAY)
    assert addr == f"relay://93.184.216.5:4100/{RELAY}"
    assert parse_relay_addr(addr) == ("93.184.216.5", 4100, RELAY)
    assert parse_addr(addr) == ("relay", "93.184.216.5", 4100)
    assert parse_relay_addr(relay_addr("2001:db8::1", 9, RELAY)) == ("2001:db8::1", 9, RELAY)
    for bad in ("relay://93.184.216.5:4100", "relay://93.184.216.5:4100/", "relay://93.184.216.5:4100/nodid",
                f"relay://93.184.216.5:0/{RELAY}", f"relay://93.184.216.5:4100/{RELAY}/x", f"tcp://1.2.3.4:5/{RELAY}"):
        with pytest.raises(ValueError):
            parse_addr(bad)


def test_a_relay_address_is_judged_by_its_relay_host() -> None:
    glob, private = relay_addr("93.184.216.5", 4100, RELAY), relay_addr("10.0.0.5", 4100, RELAY)
    origin = D.dht_origin(False)
    assert D.check(glob, origin) is None
    assert D.check(private, origin) == "private"
    assert D.check(glob, origin, schemes=("tcp",)) == "scheme"
    assert D.peer_addresses([glob, "udp://93.184.216.6:1", "tcp://93.184.216.6:2"]) == ["tcp://93.184.216.6:2", glob]


def test_a_relay_address_travels_in_announces_and_dht_records() -> None:
    """Our announce and DHT peer record carry it; a reader that does not know the scheme
    drops that record alone (the announce check keeps it: the dial rule refuses it)."""
    ident = Identity(bytes([3]) * 32)
    addr = relay_addr("93.184.216.5", 4100, RELAY)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    build_peer_announce(ident, addresses=["tcp://93.184.216.9:1", addr], now=now, difficulty=1)
    assert check_address_record(ident.did, make_address_record(ident.did, addr, difficulty=1), min_difficulty=1) is None
    records = [make_address_record(ident.did, a, difficulty=3) for a in ("tcp://93.184.216.9:1", addr)]
    record = verify_record(build_peer_record(ident, address_records=records, now=now, ttl=timedelta(hours=1)), now=now)
    assert record.addresses == ("tcp://93.184.216.9:1", addr)


# -- one connection between two nodes (21.3) ---------------------------------------------------


@pytest.mark.parametrize("ours", [(True, True), (True, False), (False, True), (False, False)])
def test_a_direct_connection_replaces_a_relayed_one_and_never_the_reverse(ours) -> None:
    new_is_ours, old_is_ours = ours
    for own, peer in (("did:a", "did:b"), ("did:b", "did:a")):
        for new_hash, old_hash in ((b"\x00", b"\xff"), (b"\xff", b"\x00")):
            common = dict(new_is_ours=new_is_ours, old_is_ours=old_is_ours, new_hash=new_hash, old_hash=old_hash)
            assert keeps_new_connection(own, peer, new_relayed=False, old_relayed=True, **common)
            assert not keeps_new_connection(own, peer, new_relayed=True, old_relayed=False, **common)
            # both alike: the rule of before
            assert keeps_new_connection(own, peer, new_relayed=True, old_relayed=True, **common) == \
                keeps_new_connection(own, peer, **common)


# -- admission of relayed connections (21.4) -----------------------------------------------------


def test_relayed_peers_are_keyed_by_their_relay_not_its_address() -> None:
    """Through a relay the connection's IP is the relay's: relayed peers get the key
    circuit:<relay DID> (their own cap), the global channel, and their DID churn bans that
    key, never the relay's address nor its direct connection."""
    from hmpnode.net.admission import Admission
    from hmpnode.net.scope import Channel
    from hmpnode.net.settings import MeshLimits, MeshSettings

    adm = Admission(MeshSettings(mesh=MeshLimits(max_dids_per_address=3)), lambda ip: Channel.LOOPBACK)
    assert adm.place("127.0.0.1", RELAY) == (Channel.GLOBAL, "circuit:" + RELAY, None)
    assert adm.place("127.0.0.1") == (Channel.LOOPBACK, "loopback", None)
    verdicts = [adm.claim_refusal(did(i), "responder", "127.0.0.1", [], 0.0, via=RELAY) for i in range(5)]
    assert verdicts[:3] == [(None, None)] * 3
    assert verdicts[3] == ("banned", "circuit:" + RELAY)
    assert not adm.address_banned("127.0.0.1", 0.0)


def test_the_relays_hello_names_one_ip_and_anything_else_is_none():
    from hmpnode.net.circuit import hello, parse_hello

    assert parse_hello(hello("203.0.113.9")) == "203.0.113.9"
    assert parse_hello(hello("2001:db8::1")) == "2001:db8::1"
    for bad in ('{"peer_ip": "example.org"}', '{"peer_ip": 5}', "[]", "{}", "not json", b"{}", None,
                '{"peer_ip": "' + "1" * 300 + '"}'):
        assert parse_hello(bad) is None, bad
