"""Catch-up by reconciliation (docs/protocol.md 22.4): the sets (sans-IO) and two real nodes.

The node tests build signed broadcasts offline, import them into two nodes that cannot
see each other (LAN discovery on ports of their own, no DHT), then let them meet and
check what crossed: everything missing on either side, nothing else, in bytes (the
kernel's counters of the connection, `ss -ti`) and round trips bounded by the
difference, not by the 5 000 containers both hold. What a peer on another channel may
be listed and given is tested on the core (tests/test_core.py).
"""

from __future__ import annotations

import asyncio
import base64
import random
import re
import socket
import subprocess
from datetime import datetime, timedelta, timezone

import aiohttp
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from hmpnode.container.build import build_container
from hmpnode.identity import Identity
from hmpnode.net.reconcile import Reconciler, SortedItems, item_id
from hmpnode.net.syncset import MARGIN_US, Merged, Snapshot, SyncRow, build_state, extend_state, scope_key
from tests.meshutil import MeshNode, mesh_env, wait_for
from tests.peerclient import PeerSocket, authenticate

T0 = datetime(2026, 10, 1, tzinfo=timezone.utc)

# -- the sets, without sockets ----------------------------------------------------------------


def _entries(rng: random.Random, n: int, seq0: int = 1) -> list[tuple[int, bytes, int]]:
    return [(rng.randrange(1_700_000_000, 1_700_000_050), rng.randbytes(32), seq0 + i) for i in range(n)]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300), st.integers(0, 40), st.integers(0, 2**32))
def test_base_plus_overlay_is_the_same_set_as_one_snapshot(n_base, n_over, seed):
    """The merged view answers every storage call as a snapshot of the union would, so a
    reconciliation over it finds exactly the differences (property test, random sets)."""
    rng = random.Random(seed)
    base, over = _entries(rng, n_base), _entries(rng, n_over, 10_000)
    merged, whole = Merged(Snapshot(base), Snapshot(over)), Snapshot(base + over)
    m, w = merged.items, whole.items
    assert len(m) == len(w)
    for i in range(len(w)):
        assert m.item(i) == w.item(i)
    cuts = sorted(rng.randrange(0, len(w) + 1) for _ in range(2))
    assert m.id_sum(*cuts) == w.id_sum(*cuts) and m.ids(*cuts) == w.ids(*cuts)
    for ts, id_, _ in (base + over)[:20]:
        assert m.lower_bound(ts, id_, 0, len(w)) == w.lower_bound(ts, id_, 0, len(w))
    for _, id_, seq in base + over:
        assert merged.seq_of(id_) == seq
    assert merged.seq_of(b"\0" * 32) is None
    # a peer holding the union minus 3 and plus 2 of its own: the merged side learns exactly those
    theirs = [(ts, i) for ts, i, _ in (base + over)[3:]] + [(ts, i) for ts, i, _ in _entries(rng, 2, 99_000)]
    ini, res = Reconciler(m), Reconciler(SortedItems(theirs))
    msg = ini.initiate()
    for _ in range(50):
        msg = ini.reconcile(res.reconcile(msg)[0])[0]
        if msg is None:
            break
    assert msg is None
    assert ini.have_ids == {i for _, i, _ in (base + over)[:3]}
    assert ini.need_ids == {i for _, i in theirs} - {i for _, i, _ in base + over}


def test_sets_leave_out_directed_scoped_and_expiring_containers():
    """Only broadcasts are rows (store.sync_rows); expiring within the margin: in no set;
    scoped ones only in the scoped set of a class that may receive them."""
    now_us = 1_800_000_000 * 10**6
    rows = [SyncRow(1, "did:a", now_us, None, ""), SyncRow(2, "did:b", now_us, now_us + MARGIN_US // 2, ""),
            SyncRow(3, "did:c", now_us, now_us + 2 * MARGIN_US, ""), SyncRow(4, "did:d", now_us, None, "localhost"),
            SyncRow(5, "did:e", now_us, None, "lan:192.0.2.0/24")]
    state = build_state(rows, now_us=now_us, margin_us=MARGIN_US, last_seq=5)
    assert {state.global_set.seq_of(item_id(d)) for d in ("did:a", "did:b", "did:c")} == {1, None, 3}
    assert state.stale_at_us == now_us + MARGIN_US  # did:c comes within the margin then: rebuilt
    now = datetime.fromtimestamp(now_us / 1e6, timezone.utc)
    loop_key = scope_key(state.scoped_rows, peer_ip="127.0.0.1", channel="loopback", now=now)
    lan_key = scope_key(state.scoped_rows, peer_ip="192.0.2.7", channel="lan", now=now)
    other_lan = scope_key(state.scoped_rows, peer_ip="198.51.100.7", channel="lan", now=now)
    assert (loop_key, lan_key, other_lan) == ({"localhost"}, {"lan:192.0.2.0/24"}, frozenset())
    assert state.scoped(loop_key).seq_of(item_id("did:d")) == 4 and len(state.scoped(loop_key)) == 1
    assert state.scoped(lan_key).seq_of(item_id("did:e")) == 5 and len(state.scoped(other_lan)) == 0
    grown = extend_state(state, [SyncRow(6, "did:f", now_us, None, ""), SyncRow(7, "did:a", now_us, None, "")],
                         now_us=now_us, margin_us=MARGIN_US, last_seq=7)
    assert grown.base is state.base and len(grown.global_set) == 3  # did:f added, did:a not twice
    assert grown.global_set.seq_of(item_id("did:f")) == 6


# -- two real nodes ---------------------------------------------------------------------------


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(port: int, **extra: str) -> dict[str, str]:
    return mesh_env(HMPNODE_PEER_DHT="false", HMPNODE_PEER_DISCOVERY_PORT=str(port), **extra)


def _notes(identity: Identity, tag: str, count: int, **options) -> list[dict]:
    return [build_container(identity, "note", {"text": f"{tag} {i}"}, now=T0 + timedelta(seconds=i),
                            broadcast=True, **options) for i in range(count)]


def _wire_bytes(pid: int, ports: set[int]) -> int:
    """Bytes both ways over the process's TCP connections to or from these peer ports
    (kernel counters; the WebSocket upgrade and handshake included)."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True,
                         timeout=10).stdout.splitlines()
    total = 0
    for i, line in enumerate(out):
        m = re.search(r"\S+:(\d+)\s+\S+:(\d+)", line)
        if not m or f"pid={pid}," not in line or not {int(m.group(1)), int(m.group(2))} & ports:
            continue
        detail = line + " " + (out[i + 1] if i + 1 < len(out) else "")
        total += sum(int(v) for v in re.findall(r"bytes_(?:sent|received):(\d+)", detail))
    return total


async def _quiet_bytes(pid: int, ports: set[int]) -> int:
    """The connection's bytes once nothing moved for a second (the last acks and answers landed)."""
    last = -1
    for _ in range(30):
        await asyncio.sleep(1.0)
        now = _wire_bytes(pid, ports)
        if now == last and now > 0:
            return now
        last = now
    raise AssertionError(f"the connection never went quiet ({last} bytes)")


async def _import(node: MeshNode, containers: list[dict]) -> None:
    for i in range(0, len(containers), 1000):
        answer = await node.client.import_containers(containers[i:i + 1000])
        assert answer["rejected"] == 0, answer["results"][:2]


async def _count(node: MeshNode) -> int:
    return (await node.client.status())["store"]["containers"]


async def _meet(nodes, tmp_path, shared: list[dict], only_a: list[dict], only_b: list[dict]):
    """Fill two nodes apart, then let them meet; (a, b, wire bytes, counters of both)."""
    pa, pb = _free_udp_port(), _free_udp_port()
    a = MeshNode(nodes(tmp_path / "a", env=_env(pa)))
    b = MeshNode(nodes(tmp_path / "b", env=_env(pb)))
    try:
        await _import(a, shared + only_a)
        await _import(b, shared + only_b)
        assert not await a.connected() and not await b.connected()
        await a.close()
        assert a.proc.stop() == 0
        a = MeshNode(nodes(tmp_path / "a", env=_env(pb)))  # now on b's discovery port: they meet
        total = len(shared) + len(only_a) + len(only_b)

        async def synced():
            return await _count(a) == total and await _count(b) == total

        await wait_for(synced, 40, "both nodes to hold the union")
        ports = {(await n.client.status())["mesh"]["peer_port"] for n in (a, b)}
        wire = await _quiet_bytes(a.proc.pid, ports)
        counters = [(await n.client.status())["mesh"]["counters"] for n in (a, b)]
        return a, b, wire, counters
    except BaseException:
        await a.close()
        await b.close()
        raise


def _moved(counters) -> int:
    return sum(c.get("containers_sent", 0) for c in counters)


def _round_trips(counters) -> int:
    rounds = max(c.get(f"sync_round_trips_{s}", 0) for c in counters for s in ("global", "scoped"))
    return rounds + (1 if any(c.get("sync_wanted") or c.get("sync_pushed") for c in counters) else 0)


async def test_first_contact_moves_the_difference_not_the_shared_5000(nodes, tmp_path):
    """5 000 shared and 10 different (5 on each side): both end with the union, only the
    10 containers crossed, within 64 KB both ways and 6 round trips (the v1 catch-up sent
    an index entry of every held container: ~2 MB each way)."""
    ident = Identity.generate()
    shared = _notes(ident, "shared", 5000)
    a, b, wire, counters = await _meet(nodes, tmp_path, shared, _notes(ident, "a-only", 5), _notes(ident, "b-only", 5))
    try:
        assert wire <= 64 * 1024, wire
        assert _moved(counters) == 10, counters
        assert sum(c.get("containers_received", 0) for c in counters) == 10
        assert 1 <= _round_trips(counters) <= 6, counters
    finally:
        await a.close()
        await b.close()


async def test_nothing_different_costs_under_4_kb(nodes, tmp_path):
    ident = Identity.generate()
    a, b, wire, counters = await _meet(nodes, tmp_path, _notes(ident, "shared", 5000), [], [])
    try:
        assert wire < 4096, wire  # upgrade, handshake and one round trip of reconciliation
        assert _moved(counters) == 0 and _round_trips(counters) == 1, counters
    finally:
        await a.close()
        await b.close()


async def test_one_side_empty_gets_everything_once(nodes, tmp_path):
    """An empty node meeting one with 3 000: all arrive, each once, and the bytes stay near
    the containers' own size (ids cost 32 bytes each, not an index entry of ~450)."""
    ident = Identity.generate()
    held = _notes(ident, "held", 3000)
    a, b, wire, counters = await _meet(nodes, tmp_path, [], [], held)
    try:
        assert _moved(counters) == 3000, counters
        raw = sum(len(orjson.dumps(c)) for c in held)
        assert wire <= raw + 150 * len(held), (wire, raw)
    finally:
        await a.close()
        await b.close()


async def _frames(ws, until, limit: int = 40) -> list[dict]:
    """Frames the node sends until `until(frames)` holds (bounded)."""
    got: list[dict] = []
    for _ in range(limit):
        try:
            msg = await ws.receive(timeout=15)  # `until` ends the wait as soon as it holds
        except asyncio.TimeoutError:
            break
        if msg.type != aiohttp.WSMsgType.TEXT:
            break
        got.append(orjson.loads(msg.data))
        if until(got):
            break
    return got


def _reconcile(name: str, data: bytes, *, start: bool = False, key: str = "msg") -> str:
    frame = {"type": "reconcile", "set": name, key: base64.b64encode(data).decode()}
    if start:
        frame["start"] = True
    return orjson.dumps(frame).decode()


async def test_broken_reconciliation_messages_and_too_many_starts_are_refused(nodes, tmp_path):
    """A message that breaks the format ends that reconciliation with bad_reconcile (the
    reason code in the detail, counted as refused sync:<reason>); a reply to nothing is a
    malformed frame; starts beyond peer.sync_per_minute are rate_limited."""
    target = MeshNode(nodes(tmp_path / "target", env=_env(_free_udp_port(), HMPNODE_PEER_SYNC_PER_MINUTE="3")))
    try:
        async with aiohttp.ClientSession() as http:
            ws = await authenticate(http, target.info["peer"]["port"], Identity.generate())
            assert isinstance(ws, PeerSocket), ws
            await ws.send_str(_reconcile("global", b"\x61\x00", start=True))  # negentropy's version byte
            got = await _frames(ws, lambda f: any(x["type"] == "error" for x in f))
            assert [(x["reason"], x["detail"]) for x in got if x["type"] == "error"] == \
                [("bad_reconcile", "unsupported_version")]
            await ws.send_str(_reconcile("global", b"\x01", key="reply"))  # we started nothing
            got = await _frames(ws, lambda f: any(x["type"] == "error" for x in f))
            assert [x["reason"] for x in got if x["type"] == "error"] == ["malformed_frame"]
            await ws.send_str(_reconcile("global", b"\x01", key="msg"))  # the broken one was ended
            got = await _frames(ws, lambda f: any(x["type"] == "error" for x in f))
            assert [x["reason"] for x in got if x["type"] == "error"] == ["malformed_frame"]
            replies = 0
            for _ in range(2):  # 3 starts a minute: the first was the broken one
                await ws.send_str(_reconcile("global", Reconciler([]).initiate(), start=True))
                got = await _frames(ws, lambda f: any(x["type"] in ("reconcile", "error") for x in f))
                replies += sum(1 for x in got if x["type"] == "reconcile" and "reply" in x)
            assert replies == 2
            await ws.send_str(_reconcile("global", Reconciler([]).initiate(), start=True))
            got = await _frames(ws, lambda f: any(x["type"] in ("reconcile", "error") for x in f))
            assert [x["reason"] for x in got if x["type"] == "error"] == ["rate_limited"], got
            await ws.close()
        refused = (await target.client.status())["refused"]
        assert refused.get("sync:unsupported_version") == 1 and refused.get("sync:rate_limited") == 1, refused
    finally:
        await target.close()
