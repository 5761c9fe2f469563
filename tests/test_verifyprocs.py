"""Verification in worker processes (hmpnode.verifyprocs, issue 15): the verdicts of
in-process verification, in input order, within the node's budgets, with the key
registry's changes; a dead worker's chunk is verified on threads; no worker
outlives its node (stopped, or SIGKILLed)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from datetime import datetime, timedelta
from pathlib import Path

import aiohttp
import msgspec
import orjson
import pytest

from hmpnode import vectors
from hmpnode.container import reasons as R
from hmpnode.container.build import build_container
from hmpnode.container.inflight import ByteBudget
from hmpnode.container.verify import Limits, Verifier, encode_wire
from hmpnode.identity import Identity
from hmpnode.verifyprocs import (MAX_RESTARTS, LoggedKeyRegistry, VerifyProcesses, index_payload, resolve_count,
                                 thread_count)

from .conftest import NOW, Clock, running_node
from .nodeproc import node_env

ME, ALICE, BOB = (Identity(bytes([i]) * 32) for i in (50, 51, 52))
DEADLINE = 30.0


def note(identity: Identity, text: str, *, now: datetime = NOW, **options) -> dict:
    return build_container(identity, "note", {"text": text}, now=now, **options)


def shape(verdict) -> tuple:
    """Everything of a VerifyResult the node uses (the container is compared apart)."""
    return (verdict.ok, verdict.reason, verdict.detail, verdict.container_did, verdict.expired,
            sorted(verdict.store_and_forward), verdict.key_revoked_later, verdict.pin_candidate, verdict.payload)


async def no_fallback(raws, costs):
    raise AssertionError("a chunk went to the threads")


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def workers_of(pid: int) -> list[int]:
    """The verify worker processes whose parent is `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if ppid == pid and b"hmpnode.verifyprocs" in cmdline:
            out.append(int(entry))
    return out


async def wait_for(condition, what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


# -- units ----------------------------------------------------------------------------


def test_resolve_count():
    assert resolve_count("auto", cpus=1) == 0  # a process only adds copying
    assert resolve_count("auto", cpus=2) == 2  # measured: +35-45 % ingest over threads, no more CPU
    assert resolve_count("auto", cpus=3) == 2
    assert resolve_count("auto", cpus=4) == 3
    assert resolve_count("auto", cpus=64) == 8
    assert resolve_count(0) == 0 and resolve_count(3, cpus=1) == 3


def test_registry_log_gives_each_reader_what_it_has_not_seen():
    reg = LoggedKeyRegistry()
    assert reg.delta(0) == (0, {})
    reg.pin("did:other:a", b"k" * 32)
    reg.pin("did:other:a", b"k" * 32)  # pinned already: no change
    at = NOW - timedelta(days=1)
    reg.revoke("did:other:b", at)
    seen, delta = reg.delta(0)
    assert seen == 2 and delta == {"did:other:a": (b"k" * 32, None), "did:other:b": (None, at)}
    assert reg.delta(seen) == (2, {})
    reg.revoke("did:other:a", at)
    assert reg.delta(seen) == (3, {"did:other:a": (b"k" * 32, at)})


def test_auto_counts_the_cpus_this_process_may_use():
    """A node pinned to one core (taskset, a container's cpuset) is a one-core node,
    whatever os.cpu_count() says of the machine."""
    from hmpnode.verifyprocs import usable_cpus

    mask = os.sched_getaffinity(0)
    assert usable_cpus() == len(mask) and resolve_count("auto") == resolve_count("auto", cpus=len(mask))
    os.sched_setaffinity(0, {min(mask)})
    try:
        assert usable_cpus() == 1 and resolve_count("auto") == 0 and thread_count("auto") == 1
    finally:
        os.sched_setaffinity(0, mask)


def test_thread_count():
    assert thread_count("auto", cpus=1) == 1
    assert thread_count("auto", cpus=2) == 1  # measured: a second thread only adds GIL hand-offs
    assert thread_count("auto", cpus=8) == 2
    assert thread_count(3, cpus=2) == 3


def test_config_verify_threads(tmp_path):
    from hmpnode.config import ConfigError, load_settings

    def load(**env):
        return load_settings(data_dir=tmp_path, config_file=None, env=env, overrides={}).node

    assert load().verify_threads == "auto"
    assert load(HMPNODE_NODE_VERIFY_THREADS="2").verify_threads == 2
    for bad in ("0", "65", "some"):
        with pytest.raises(ConfigError, match='verify_threads = .*must be "auto" or an integer 1..64'):
            load(HMPNODE_NODE_VERIFY_THREADS=bad)


def test_config_verify_processes(tmp_path):
    from hmpnode.config import ConfigError, load_settings

    def load(**env):
        return load_settings(data_dir=tmp_path, config_file=None, env=env, overrides={}).node

    assert load().verify_processes == "auto" and load().verify_process_min_batch == 64
    assert load(HMPNODE_NODE_VERIFY_PROCESSES="0").verify_processes == 0
    assert load(HMPNODE_NODE_VERIFY_PROCESSES=" Auto ").verify_processes == "auto"
    conf = tmp_path / "hmpnode.toml"
    conf.write_text("[node]\nverify_processes = 3\n")
    assert load_settings(data_dir=tmp_path, config_file=conf, env={}, overrides={}).node.verify_processes == 3
    for bad in ("many", "-1", "65"):
        with pytest.raises(ConfigError, match='verify_processes = .*must be "auto" or an integer 0..64'):
            load(HMPNODE_NODE_VERIFY_PROCESSES=bad)


# -- the worker pool on its own -------------------------------------------------------


@pytest.fixture
async def procs():
    registry = LoggedKeyRegistry()
    pool = VerifyProcesses(2, min_batch=1, registry=registry)
    assert await pool.start() == 2
    try:
        yield pool
    finally:
        await pool.close()


def _vector_inputs() -> list[tuple[str, object, datetime, dict]]:
    """(name, input, now, registry) for every published vector, positive and negative."""
    out = []
    for path, vector in sorted(vectors.generate().items()):
        if not (path.startswith("containers/") or path.startswith("negative/")):
            continue
        raw = vector["wire"].encode() if "wire" in vector else vector["container"]
        out.append((path, raw, datetime.fromisoformat(vector["now"]), vector.get("registry", {})))
    return out


def _extra_inputs() -> list[tuple[str, object, bool, Limits]]:
    """(name, input, from_peer, limits): forms and refusals the vectors do not cover."""
    good = note(ALICE, "extra")
    wire = encode_wire(good)
    deep: dict = {}
    cursor = deep
    for _ in range(80):
        cursor["x"] = {}
        cursor = cursor["x"]
    bad_schema = build_container(ALICE, "goal", {"title": "t", "description": "d", "priority": 0.5,
                                                 "expected_outcome": "x"}, now=NOW)
    bad_schema["hmp_container"]["payload"]["priority"] = "high"  # breaks the goal schema (and the hash)
    return [
        ("bytes", wire, False, Limits()),
        ("text", wire.decode(), False, Limits()),
        ("bare form", good["hmp_container"], False, Limits()),
        ("spaced bytes", json.dumps(orjson.loads(wire), indent=1).encode(), False, Limits()),
        ("not an object", b"[1, 2]", False, Limits()),
        ("not utf-8", b'{"hmp_container": "\xff"}', False, Limits()),
        ("empty object", b"{}", False, Limits()),
        ("too deep", {"hmp_container": deep}, False, Limits()),
        ("huge integer", {"hmp_container": dict(good["hmp_container"], extra=2 ** 70)}, False, Limits()),
        ("over the size limit", good, False, Limits(max_container_bytes=200)),
        ("over the size limit, bytes", wire, False, Limits(max_container_bytes=200)),
        ("zstd", note(ALICE, "z" * 300, compression="zstd"), False, Limits()),
        ("zstd over the decompressed limit", note(ALICE, "z" * 3000, compression="zstd"), False,
         Limits(max_decompressed_bytes=100)),
        ("expired", note(ALICE, "old", now=NOW - timedelta(days=3), ttl=NOW - timedelta(days=1)), False, Limits()),
        ("future", note(ALICE, "soon", now=NOW + timedelta(hours=2)), False, Limits()),
        ("class schema from the agent", bad_schema, False, Limits()),
        ("class schema from a peer", bad_schema, True, Limits()),
    ]


async def test_workers_give_in_process_verdicts_for_every_vector(procs):
    """Differential: every published vector (each reject reason) and the extra forms,
    through the workers and through an in-process Verifier with the same registry:
    the same verdict (reason code and detail included), in input order."""
    budget = ByteBudget(64 * 1024 * 1024)
    cases = [(name, raw, now) for name, raw, now, registry in _vector_inputs() if not registry]
    now = cases[0][2]
    assert all(c[2] == now for c in cases)
    raws = [raw for _, raw, _ in cases]
    got, cpu = await procs.verify(raws, [0] * len(raws), now, Limits(), False, budget, no_fallback)
    local = Verifier(registry=procs.registry)
    want = [local.verify(raw, now=now) for raw in raws]
    for verdict in want:
        index_payload(verdict)
    assert [shape(v) for v in got] == [shape(v) for v in want]
    assert [v.container for v in got if v.ok] == [v.container for v in want if v.ok]
    reasons = {v.reason for v in got}
    assert {R.MALFORMED, R.SCHEMA, R.FUTURE_TIMESTAMP, R.PAYLOAD_HASH_MISMATCH, R.CONTAINER_DID_MISMATCH,
            R.KEY_MISMATCH, R.UNKNOWN_KEY, R.UNSUPPORTED_SIG_ALGO, R.BAD_SIGNATURE, R.CLASS_SCHEMA, None} <= reasons
    assert cpu > 0

    # the vector that needs a revocation: sent to the workers as a registry change
    ((name, raw, vnow, registry),) = [c for c in _vector_inputs() if c[3]]
    for did, at in registry["revocations"].items():
        procs.registry.revoke(did, datetime.fromisoformat(at))
    got, _ = await procs.verify([raw, raw], [0, 0], vnow, Limits(), False, budget, no_fallback)
    want = local.verify(raw, now=vnow)
    assert want.reason == R.REVOKED and [shape(v) for v in got] == [shape(want)] * 2, name

    for name, raw, from_peer, limits in _extra_inputs():
        cost = 10_000 if "zstd" in name else 0
        got, _ = await procs.verify([raw], [cost], NOW, limits, from_peer, budget, no_fallback)
        want = Verifier(registry=procs.registry, limits=limits).verify(raw, now=NOW, from_peer=from_peer)
        index_payload(want)
        assert shape(got[0]) == shape(want), name
        assert got[0].container == (want.container if want.ok else None), name
        assert got[0].body == want.body, name  # the stored text the fast path cut, for canonical bytes
        if name == "bytes":
            assert got[0].body is not None and orjson.loads(got[0].body) == want.container["hmp_container"]
    assert budget.used == 0 and 0 < budget.peak <= budget.capacity

    # each item's own text cut from an import body (msgspec.Raw): as its bytes
    wires = [encode_wire(note(ALICE, f"raw {i}")) for i in range(3)] + [b'{"hmp_container": 1}']
    items = msgspec.json.decode(b"[" + b",".join(wires) + b"]", type=list[msgspec.Raw])
    got, _ = await procs.verify(items, [0] * len(items), NOW, Limits(), False, budget, no_fallback)
    want, _ = await procs.verify(wires, [0] * len(wires), NOW, Limits(), False, budget, no_fallback)
    assert [shape(v) for v in got] == [shape(v) for v in want] and [v.ok for v in got] == [True] * 3 + [False]
    assert [v.container for v in got] == [v.container for v in want] and [v.body for v in got] == [v.body for v in want]


def test_a_worker_sends_the_stored_text_back_as_its_place_in_the_bytes_sent():
    """The fast path cuts `body` out of canonical wire bytes: the worker answers with
    (offset, length) in what it was sent, and the node cuts the same bytes out again;
    text that is not such a slice (a parsed container's body is joined) travels as is."""
    from hmpnode.verifyprocs import _Worker, _verdict

    wire = encode_wire(note(ALICE, "slice"))
    spaced = json.dumps(orjson.loads(wire), indent=1).encode()
    out, _ = _Worker().run(({}, NOW, Limits(), False, [0, 0], [wire, spaced]))
    want = Verifier().verify(wire, now=NOW).body
    assert want is not None and type(out[0][-1]) is tuple and out[0][-1][1] == len(want)
    assert _verdict(out[0], wire, wire).body == want
    assert out[1][-1] is None and _verdict(out[1], spaced, spaced).body is None  # not canonical: no body


async def test_workers_run_with_the_nodes_gc_threshold():
    """The daemon sets [node] gc_young_threshold in its own process; the workers it
    starts are told the same threshold (and freeze what start-up left)."""
    import gc

    before = gc.get_threshold()
    gc.set_threshold(12_345, *before[1:])
    pool = VerifyProcesses(1, min_batch=1, registry=LoggedKeyRegistry())
    try:
        assert await pool.start() == 1
        (pid,) = pool.pids()
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-2] == b"12345"
        got, _ = await pool.verify([encode_wire(note(ALICE, "gc"))], [0], NOW, Limits(), False, ByteBudget(1 << 20),
                                   no_fallback)
        assert got[0].ok
    finally:
        gc.set_threshold(*before)
        await pool.close()


async def test_a_dead_worker_is_replaced_and_its_chunk_verified_on_threads(procs):
    victim = procs.pids()[0]
    os.kill(victim, signal.SIGKILL)
    await wait_for(lambda: not alive(victim), "the worker to die")
    raws = [note(ALICE, f"n{i}") for i in range(10)]
    used = []

    async def threads(part, costs):
        used.append(len(part))
        verifier = Verifier(registry=procs.registry)
        return [verifier.verify(raw, now=NOW) for raw in part], 0.0

    got, _ = await procs.verify(raws, [0] * 10, NOW, Limits(), False, ByteBudget(1 << 20), threads)
    assert [v.ok for v in got] == [True] * 10
    assert [v.container_did for v in got] == [r["hmp_container"]["head"]["container_did"] for r in raws]
    assert used == [5] and procs.counters["fallback_chunks"] == 1 and procs.lost == 1
    assert await procs.start() == 2 and victim not in procs.pids()
    got, _ = await procs.verify(raws, [0] * 10, NOW, Limits(), False, ByteBudget(1 << 20), no_fallback)
    assert [v.ok for v in got] == [True] * 10


async def test_workers_that_cannot_start_leave_the_threads_to_it(monkeypatch):
    pool = VerifyProcesses(1, min_batch=1, registry=LoggedKeyRegistry())
    monkeypatch.setattr("hmpnode.verifyprocs.sys.executable", "/nonexistent/python")
    try:
        for _ in range(MAX_RESTARTS + 2):
            assert await pool.start() == 0
        assert pool.lost == MAX_RESTARTS + 1  # then it stops trying
        assert await pool.verify([b"{}"], [0], NOW, Limits(), False, ByteBudget(1), no_fallback) is None
    finally:
        await pool.close()


# -- in the node ----------------------------------------------------------------------


def _mixed_batch() -> list:
    """Valid containers (dicts and bytes), a duplicate, a tampered one, junk: in an order."""
    out: list = []
    for i in range(30):
        c = note(ALICE if i % 2 else BOB, f"item {i}", compression="zstd" if i % 5 == 0 else None)
        out.append(encode_wire(c) if i % 3 == 0 else c)
    out.insert(7, out[4])
    tampered = note(ALICE, "tampered")
    tampered["hmp_container"]["payload"]["text"] = "changed"
    out.insert(11, tampered)
    out.insert(20, b"{}")
    out.insert(25, b"not json")
    return out


def _outcome(results) -> list[tuple]:
    return [(r.status, r.did, r.reason, r.detail) for r in results]


async def test_node_results_in_order_with_budget_and_cpu_accounting(tmp_path):
    batch = _mixed_batch()
    clock = Clock()
    async with running_node(ME, tmp_path / "threads", clock=clock, verify_processes=0) as plain:
        want = _outcome(await plain.ingest(batch))
    spent: list[float] = []
    async with running_node(ME, tmp_path / "procs", clock=clock, verify_processes=2, verify_process_min_batch=8,
                            inflight_bytes=4096) as node:
        assert await node.verify_procs.start() == 2
        got = _outcome(await node.ingest(batch, on_cpu=spent.append))
        assert node.verify_procs.counters["containers"] == len(batch)  # a duplicate within the batch too
        small = await node.ingest([note(ALICE, "small")], on_cpu=spent.append)  # under min_batch: threads
        assert node.verify_procs.counters["containers"] == len(batch)
        assert node.inflight.used == 0 and 0 < node.inflight.peak <= 4096
        status = await node.status()
    assert got == want
    assert [s for s, *_ in got].count("stored") == 30 and small[0].status == "stored"
    assert len(spent) == 2 and spent[0] > 0
    assert status["verify_processes"]["ready"] == 2


async def test_registry_changes_reach_the_workers(tmp_path):
    """A revocation stored by one batch refuses the next batch's later containers in
    the workers (only verification checks revocations; the writer does not)."""
    clock = Clock()
    async with running_node(ME, tmp_path, clock=clock, verify_processes=2, verify_process_min_batch=2) as node:
        assert await node.verify_procs.start() == 2
        revoke = build_container(ALICE, "peer_announce", {"addresses": [], "key_is_falsified": True}, now=NOW)
        first = await node.ingest([revoke, note(BOB, "first")])
        assert [r.status for r in first] == ["stored", "stored"]
        clock.now = NOW + timedelta(seconds=5)
        later = [note(ALICE, f"after {i}", now=NOW + timedelta(seconds=1)) for i in range(4)]
        results = await node.ingest(later)
        assert [(r.status, r.reason) for r in results] == [("rejected", R.REVOKED)] * 4
        assert node.verify_procs.counters["containers"] == 6


async def test_node_stop_ends_its_workers(tmp_path):
    async with running_node(ME, tmp_path, verify_processes=2) as node:
        assert await node.verify_procs.start() == 2
        pids = node.verify_procs.pids()
        assert len(pids) == 2 and all(alive(p) for p in pids)
    assert not any(alive(p) for p in pids)  # stop() waited for them


# -- under the daemon -----------------------------------------------------------------


async def _import_until_workers(info: dict, token: str, pid: int) -> list[int]:
    """Import batches over the threshold until the daemon's workers run; their pids."""
    url = info["api"]["url"].rstrip("/")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
        deadline = time.monotonic() + DEADLINE
        n = 0
        while True:
            batch = [encode_wire(note(ALICE, f"daemon {n + i}", now=datetime.now(NOW.tzinfo))) for i in range(8)]
            n += 8
            body = b'{"containers":[' + b",".join(batch) + b"]}"
            async with session.post(url + "/v1/containers/import", data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
                out = await resp.json()
                assert resp.status == 200 and out["stored"] == 8, out
            async with session.get(url + "/v1/status") as resp:
                ready = (await resp.json())["verify_processes"]["ready"]
            if ready == 2 and len(pids := workers_of(pid)) == 2:
                return pids
            assert time.monotonic() < deadline, "the workers did not start"
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_daemon_workers_end_with_the_node(nodes, tmp_path, how):
    env = node_env(HMPNODE_NODE_VERIFY_PROCESSES="2", HMPNODE_NODE_VERIFY_PROCESS_MIN_BATCH="8")
    node = nodes(tmp_path / "node", env=env)
    info = node.wait_ready()
    token = (tmp_path / "node" / "api.token").read_text().strip()
    pids = asyncio.run(_import_until_workers(info, token, node.pid))
    if how == "sigterm":
        assert node.stop() == 0, node.log()
    else:
        os.kill(node.pid, signal.SIGKILL)  # the node alone, not its process group
        node.wait()
    asyncio.run(wait_for(lambda: not any(alive(p) for p in pids), "the workers to exit"))


async def test_a_peers_containers_verified_in_the_workers(nodes, tmp_path):
    """Catch-up between two daemons: the receiver verifies the peer's frames in its
    worker processes (peer limits, CPU charged to the peer) and ends with them all."""
    import socket

    from .meshutil import MeshNode, mesh_env
    from .meshutil import wait_for as wait_until

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = mesh_env(HMPNODE_PEER_DHT="false", HMPNODE_PEER_DISCOVERY_PORT=port)
    sent = [build_container(ALICE, "note", {"text": f"peer {i}"}, now=datetime.now(NOW.tzinfo), broadcast=True)
            for i in range(600)]
    receiver = MeshNode(nodes(tmp_path / "receiver", env={**env, "HMPNODE_NODE_VERIFY_PROCESSES": "2",
                                                          "HMPNODE_NODE_VERIFY_PROCESS_MIN_BATCH": "2"}))
    sender = None
    try:
        warm = [note(BOB, f"warm {i}", now=datetime.now(NOW.tzinfo)) for i in range(2)]
        await receiver.client.import_containers(warm)  # starts the workers

        async def ready():
            return (await receiver.client.status())["verify_processes"]["ready"] == 2

        await wait_until(ready, DEADLINE, "the receiver's workers")
        sender = MeshNode(nodes(tmp_path / "sender", env=env))
        answer = await sender.client.import_containers(sent)
        assert answer["stored"] == 600, answer["results"][:2]

        async def caught_up():
            return (await receiver.client.status())["store"]["containers"] == 602

        await wait_until(caught_up, 60, "the receiver to hold the sender's 600 containers")
        stats = (await receiver.client.status())["verify_processes"]
        assert stats["containers"] >= 600 and stats.get("fallback_chunks", 0) == 0, stats
        assert await receiver.holds(sent[-1]["hmp_container"]["head"]["container_did"])
    finally:
        await receiver.close()
        if sender is not None:
            await sender.close()
