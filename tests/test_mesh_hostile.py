"""A hostile peer against a real node: it authenticates, then floods garbage and
invalid containers. The node answers with reason codes, cuts it off, refuses it
for a while, and keeps serving its agent and its honest peers."""

from __future__ import annotations

import contextlib
import copy
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

import aiohttp
import orjson

from hmpnode.container.build import build_container
from hmpnode.identity import Identity
from hmpnode.net.mce import build_mce, index_entry
from hmpnode.net.connections import PEER_PATH
from tests.meshutil import MeshNode, mesh_env, wait_for
from tests.peerclient import authenticate, closed_reason


def _incoming(data: str) -> tuple[str, Any]:
    """("error", reason) for an error frame, (MCE class, payload) for an MCE message."""
    value = orjson.loads(data)
    if value["type"] == "error":
        return "error", value["reason"]
    if value["type"] == "mce":
        body = value["container"]["hmp_container"]
        return body["head"]["class"], body["payload"]
    return value["type"], value


def _invalid_containers(identity: Identity, count: int) -> list[dict]:
    now = datetime.now(timezone.utc).replace(microsecond=0)
    out = []
    for i in range(count):
        good = build_container(identity, "note", {"i": i}, now=now, broadcast=True)
        bad = copy.deepcopy(good)
        bad["hmp_container"]["payload"] = {"i": -i - 1}  # payload_hash no longer matches
        out.append(bad)
    return out


async def test_flooding_peer_is_cut_off_while_the_node_serves_its_agent(nodes, tmp_path):
    env = mesh_env(HMPNODE_PEER_STRIKE_THRESHOLD="40", HMPNODE_PEER_BAN_SECONDS="300")
    target = MeshNode(nodes(tmp_path / "target", env=env))
    honest = MeshNode(nodes(tmp_path / "honest", env=env))
    port = target.info["peer"]["port"]
    attacker = Identity.generate()
    async with aiohttp.ClientSession() as http:
        try:
            await wait_for(lambda: _knows(target, honest.did), 30, "the honest peer")
            ws = await authenticate(http, port, attacker)
            assert not isinstance(ws, (int, str)), ws
            reasons: list[str] = []
            rejected: list[str] = []
            frames = [b"not json", orjson.dumps({"type": "nonsense"}), orjson.dumps({"type": "containers", "items": []})]
            closed = False
            for round_ in range(200):  # bounded: the node must cut us off long before
                payload = frames[round_ % len(frames)] if round_ % 2 else orjson.dumps(
                    {"type": "containers", "items": _invalid_containers(attacker, 5)})
                try:
                    await ws.send_str(payload.decode())
                except (ConnectionError, RuntimeError):
                    closed = True
                    break
                # read what came back so far (bounded wait)
                while True:
                    try:
                        msg = await ws.receive(timeout=0.5)
                    except TimeoutError:
                        break
                    if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
                        closed = True
                        break
                    kind, value = _incoming(msg.data)
                    if kind == "error":
                        reasons.append(value)
                    elif kind == "container_ack":
                        rejected += [r["reason"] for r in value.get("rejected", [])]
                if closed:
                    break
            assert closed, "the node never cut the flooding peer off"
            assert "malformed_frame" in reasons and "banned" in reasons
            assert rejected and set(rejected) == {"payload_hash_mismatch"}  # profile section 7 reason code
            await ws.close()

            # refused for a while, under the same DID
            again = await authenticate(http, port, attacker)
            assert again == "banned"

            # the agent is served all along, and honest peers still get its containers
            status = await target.client.status()
            assert status["mesh"]["counters"]["banned"] == 1
            did = (await target.client.create("note", {"text": "still here"}, broadcast=True))["did"]
            await wait_for(lambda: honest.holds(did), 30, "a broadcast at the honest peer after the flood")
            assert not await target.holds(_invalid_containers(attacker, 1)[0]["hmp_container"]["head"]["container_did"])

            # the ban outlives a restart (it is in the store)
            await target.close()
            target.proc.stop()
            target = MeshNode(nodes(tmp_path / "target", env=env))
            assert await authenticate(http, target.info["peer"]["port"], attacker) == "banned"
            fresh = await authenticate(http, target.info["peer"]["port"], Identity.generate())
            assert not isinstance(fresh, (int, str)), fresh  # only the banned DID is refused
            await fresh.close()
        finally:
            await target.close()
            await honest.close()


async def _knows(node: MeshNode, did: str) -> bool:
    return did in await node.connected()


async def _ack(ws, timeout: float = 50) -> dict:
    """The next container_ack on the connection (other messages are skipped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = await ws.receive(timeout=deadline - time.monotonic())
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        kind, value = _incoming(msg.data)
        assert kind != "error", value
        if kind == "container_ack":
            return value
    raise AssertionError("no container_ack")


class _Hostile:
    """An authenticated connection of a made-up peer to `target`."""

    def __init__(self, target: MeshNode, identity: Identity, ws: aiohttp.ClientWebSocketResponse,
                 hash_: bytes = b""):
        self.target, self.identity, self.ws, self.hash = target, identity, ws, hash_
        self._stamp = datetime.min.replace(tzinfo=timezone.utc)

    async def send(self, value: dict[str, Any]) -> None:
        await self.ws.send_str(orjson.dumps(value).decode())

    async def send_mce(self, class_: str, payload: dict[str, Any]) -> None:
        # each message dated after the one before: two equal ones must not be the same container
        now = datetime.now(timezone.utc)
        self._stamp = max(now.replace(microsecond=now.microsecond // 1000 * 1000), self._stamp + timedelta(milliseconds=1))
        message = build_mce(self.identity, class_, payload, peer_did=self.target.did, now=self._stamp)
        await self.send({"type": "mce", "container": message})

    async def replies(self, until: Callable[[list[tuple[str, Any]]], bool], timeout: float = 20) -> list[tuple[str, Any]]:
        """What the node sends back, as `_incoming` reads it, until `until(replies)`."""
        out: list[tuple[str, Any]] = []
        deadline = time.monotonic() + timeout
        while not until(out) and time.monotonic() < deadline:
            msg = await self.ws.receive(timeout=timeout)
            assert msg.type == aiohttp.WSMsgType.TEXT, msg
            out.append(_incoming(msg.data))
        return out


@contextlib.asynccontextmanager
async def _hostile_peer(nodes, tmp_path, **env: str):
    target = MeshNode(nodes(tmp_path / "target", env=mesh_env(**env)))
    async with aiohttp.ClientSession() as http:
        try:
            identity = Identity.generate()
            ws = await authenticate(http, target.info["peer"]["port"], identity)
            assert not isinstance(ws, (int, str)), ws
            yield _Hostile(target, identity, ws)
            await ws.close()
        finally:
            await target.close()


def _errors(replies: list[tuple[str, Any]]) -> list[str]:
    return [value for kind, value in replies if kind == "error"]


async def test_error_frames_with_made_up_reasons_do_not_grow_the_counters(nodes, tmp_path):
    async with _hostile_peer(nodes, tmp_path) as peer:
        for i in range(40):
            await peer.send({"type": "error", "reason": f"made_up_{i}", "detail": "x\ny"})
        # the same through the rejected reasons of a (signed, valid) container_ack
        rejected = [{"container_did": f"did:hmp:container:x{i}", "reason": f"made_up_{i}"} for i in range(30)]
        rejected += [{"container_did": "did:hmp:container:y", "reason": [1, 2]}, {"reason": {"a": 1}}]
        made_up = [f"did:hmp:container:z{i}" for i in range(25)]
        await peer.send_mce("container_ack", {"acknowledged": made_up, "rejected": rejected})
        await peer.send({"type": "error", "reason": "rate_limited", "detail": ""})

        async def counted():
            counters = (await peer.target.client.status())["mesh"]["counters"]
            return counters.get("peer_error_rate_limited") == 1 and counters

        counters = await wait_for(counted, 20, "the error frames to be counted")
        assert counters["peer_error_other"] == 40 and counters["peer_rejected_other"] == 32
        assert counters["acks_not_given"] == 25  # acknowledgements of what it was never given
        assert not any("made_up" in key for key in counters)


async def test_offers_beyond_the_outstanding_request_limit_are_refused(nodes, tmp_path):
    """A peer offering made-up containers (index) gets at most peer.max_requested of
    them asked for; the rest is refused with too_many_items, not stored up."""
    async with _hostile_peer(nodes, tmp_path, HMPNODE_PEER_MAX_REQUESTED="100") as peer:
        now = datetime.now(timezone.utc).replace(microsecond=0)
        entry = index_entry(build_container(peer.identity, "note", {"text": "x"}, now=now)["hmp_container"])
        for count, tag in ((150, "a"), (10, "b")):
            await peer.send_mce("container_index", {f"did:hmp:container:{tag}{i}": entry for i in range(count)})
        replies = await peer.replies(lambda r: len(_errors(r)) >= 2)
        assert _errors(replies) == ["too_many_items", "too_many_items"]
        asked = {d for kind, value in replies if kind == "container_request" for d in value.get("request_container", [])}
        assert len(asked) == 100 and all(d.startswith("did:hmp:container:a") for d in asked)
        assert (await peer.target.client.status())["mesh"]["counters"]["offers_refused"] == 60


async def test_a_big_offer_is_taken_in_slices_and_its_requests_signed_off_the_loop(nodes, tmp_path):
    """An index of thousands of made-up DIDs (a zstd payload under the MCE limit carries
    ~4 800) used to be taken in one step of the event loop, its requests built and signed
    there too: ~30 ms each, /v1/health p99 ~75 ms under a stream of them (scripts/bench_hostile
    2b). The node takes it OFFER_SLICE DIDs at a time with other work between and signs the
    requests on a verify thread, at the peer's expense; counted, so no clock is read here."""
    from hmpnode.net.session import OFFER_SLICE, REQUEST_CHUNK

    count = 2 * REQUEST_CHUNK + 100
    async with _hostile_peer(nodes, tmp_path) as peer:
        now = datetime.now(timezone.utc).replace(microsecond=0)
        entry = index_entry(build_container(peer.identity, "note", {"text": "x"}, now=now)["hmp_container"])
        offered = [f"did:hmp:container:big{i:05d}" for i in range(count)]
        await peer.send({"type": "mce", "container": build_container(
            peer.identity, "container_index", {d: entry for d in offered}, now=now, recipients=[peer.target.did],
            compression="zstd")})

        def asked(replies):
            return [v["request_container"] for kind, v in replies if kind == "container_request"]

        replies = await peer.replies(lambda r: sum(map(len, asked(r))) >= count)
        assert [len(r) for r in asked(replies)] == [REQUEST_CHUNK, REQUEST_CHUNK, 100]
        assert [d for r in asked(replies) for d in r] == offered  # each once, in the order offered
        counters = (await peer.target.client.status())["mesh"]["counters"]
        assert counters["offer_slices"] == -(-count // OFFER_SLICE)  # 9 steps of the loop, not one
        assert counters["offer_messages_signed_off_loop"] == 3


async def test_requests_for_containers_are_rate_limited(nodes, tmp_path):
    """Asking for containers costs the asker what sending them would (peer.containers_per_second,
    bursts of ten seconds' worth): a request over the budget is refused with rate_limited."""
    async with _hostile_peer(nodes, tmp_path, HMPNODE_PEER_CONTAINERS_PER_SECOND="10") as peer:
        for round_ in range(2):  # the burst is 100: the second request of 60 is over it
            await peer.send_mce("container_request", {"request_container": [
                f"did:hmp:container:q{round_}x{i}" for i in range(60)]})
        replies = await peer.replies(lambda r: bool(_errors(r)))
        kinds = [kind for kind, _ in replies]
        assert kinds.count("container_response") == 1 and _errors(replies) == ["rate_limited"], replies


async def test_exchanged_blocks_are_rate_limited(nodes, tmp_path):
    """referenced-by and evaluations blocks cost the sender like containers do."""
    from hmpnode.container.evaluations import evaluations_block

    async with _hostile_peer(nodes, tmp_path, HMPNODE_PEER_CONTAINERS_PER_SECOND="10") as peer:
        for round_ in range(2):  # the burst is 100: the second exchange of 60 is over it
            await peer.send_mce("evaluations_exchange", {
                f"did:hmp:container:e{round_}x{i}": evaluations_block([]) for i in range(60)})
        replies = await peer.replies(lambda r: bool(_errors(r)))
        assert _errors(replies) == ["rate_limited"], replies
        assert (await peer.target.client.status())["mesh"]["counters"]["strike_rate_limited"] >= 1


async def test_catch_up_pages_are_rate_limited_and_any_cursor_is_answered(nodes, tmp_path):
    """A cursor that is not a seq (huge, non-ASCII digits) starts from the beginning
    instead of breaking the session; asking for pages faster than the budget is refused."""
    async with _hostile_peer(nodes, tmp_path, HMPNODE_PEER_CONTAINERS_PER_SECOND="10") as peer:
        # (the node itself catches up by reconciliation and asks no `after`; it still answers a v1 peer's)
        await peer.send_mce("container_request", {"after": "9" * 40})
        replies = await peer.replies(lambda r: any(kind == "container_delta" for kind, _ in r))
        delta = next(value for kind, value in replies if kind == "container_delta")
        assert delta["complete"] is True
        await peer.send_mce("container_request", {"after": "²"})  # the budget (100) is spent on the first page
        replies = await peer.replies(lambda r: bool(_errors(r)))
        assert _errors(replies) == ["rate_limited"], replies


async def test_connections_stuck_in_their_handshake_are_bounded(nodes, tmp_path):
    """Upgrades that never say hello hold a slot until the handshake timeout; at most
    peer.max_peers of them at once, the next one is refused busy (503)."""
    target = MeshNode(nodes(tmp_path / "target", env=mesh_env(HMPNODE_PEER_MAX_PEERS="3")))
    url = f"http://127.0.0.1:{target.info['peer']['port']}{PEER_PATH}"
    async with aiohttp.ClientSession() as http:
        try:
            silent = [await http.ws_connect(url) for _ in range(3)]
            try:
                await http.ws_connect(url)
                raise AssertionError("a fourth pending handshake was accepted")
            except aiohttp.WSServerHandshakeError as exc:
                assert exc.status == 503
            for ws in silent:
                await ws.close()

            async def accepted():
                try:
                    ws = await http.ws_connect(url)
                except aiohttp.WSServerHandshakeError:
                    return False
                await ws.close()
                return True

            await wait_for(accepted, 20, "a slot to free up")
            assert (await target.client.status())["mesh"]["counters"]["refused_pending"] >= 1
        finally:
            await target.close()


# -- peer slots (hmpnode.net.slots; docs/protocol.md section 21.4) -------------------------------


def _slot_env(**env: str) -> dict[str, str]:
    return mesh_env(HMPNODE_PEER_DHT="false", **env)


async def _send_broadcasts(ws, identity: Identity, count: int) -> None:
    """Send `count` new, valid broadcasts of `identity` and wait for their container_ack."""
    now = datetime.now(timezone.utc).replace(microsecond=0)
    items = [build_container(identity, "note", {"useful": i}, now=now, broadcast=True) for i in range(count)]
    await ws.send_str(orjson.dumps({"type": "containers", "items": items}).decode())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        kind, value = _incoming((await ws.receive(timeout=20)).data)
        if kind == "container_ack":
            assert len(value["acknowledged"]) == count, value
            return
    raise AssertionError("no container_ack")


async def test_eviction_takes_the_lowest_score_peer_and_never_a_pinned_one(nodes, tmp_path):
    """Inbound slots full: a newcomer gets in by evicting the peer with the lowest score (an
    offender before a harmless one), never the pinned peer, never the one that delivered."""
    pinned = Identity.generate()
    env = _slot_env(HMPNODE_PEER_MAX_PEERS="6", HMPNODE_PEER_TARGET_PEERS="1", HMPNODE_PEER_PINNED=pinned.did)
    target = MeshNode(nodes(tmp_path / "target", env=env))
    port = target.info["peer"]["port"]
    async with aiohttp.ClientSession() as http:
        try:
            useful, offender = Identity.generate(), Identity.generate()
            ws: dict[str, Any] = {}
            for name, identity in [("pinned", pinned), ("offender", offender), ("useful", useful),
                                   *((f"x{i}", Identity.generate()) for i in range(3))]:
                ws[name] = await authenticate(http, port, identity)
                assert not isinstance(ws[name], (int, str)), (name, ws[name])
                if name == "useful":
                    await _send_broadcasts(ws["useful"], useful, 3)
            # 5 inbound slots (6 - 1 kept for dialling out) are taken; the pinned peer is not counted
            await ws["offender"].send_str("not json")  # 5 strikes: a negative score
            reasons = []
            while "malformed_frame" not in reasons:
                kind, value = _incoming((await ws["offender"].receive(timeout=10)).data)
                if kind == "error":
                    reasons.append(value)

            newcomer = await authenticate(http, port, Identity.generate())
            assert not isinstance(newcomer, (int, str)), newcomer  # old code: 503, all slots taken
            slots = (await target.client.status())["mesh"]["slots"]
            assert (slots["inbound"], slots["pinned"]) == (5, 1), slots
            assert await closed_reason(ws["offender"], wait=5) == "evicted"
            # more newcomers: each evicts someone, never the pinned or the useful peer
            more = [newcomer]  # kept: a collected WebSocket would close and free its slot
            for _ in range(4):
                more.append(await authenticate(http, port, Identity.generate()))
                assert not isinstance(more[-1], (int, str)), more[-1]
            for name in ("pinned", "useful"):
                assert await closed_reason(ws[name]) is None, f"the {name} peer was evicted"
            status = await target.client.status()
            assert status["refused"]["peer:evicted"] == 5, status["mesh"]["counters"]
            assert status["mesh"]["slots"]["inbound"] == 5
        finally:
            await target.close()


async def test_the_node_dials_out_while_its_inbound_slots_are_full(nodes, tmp_path):
    """Peers that dialled in hold every slot they may: the node still opens connections of
    its own (peer.min_outbound), to a node that never dials it."""
    env = _slot_env(HMPNODE_PEER_MAX_PEERS="4", HMPNODE_PEER_TARGET_PEERS="2")
    target = MeshNode(nodes(tmp_path / "target", env=env))
    port = target.info["peer"]["port"]
    async with aiohttp.ClientSession() as http:
        honest = None
        try:
            held = []
            for _ in range(4):
                ws = await authenticate(http, port, Identity.generate())
                if not isinstance(ws, (int, str)):
                    held.append(ws)
            assert sum([await closed_reason(ws) is None for ws in held]) == 2  # 4 slots - 2 for dialling out
            # a node that never dials by itself, found by LAN discovery (loopback)
            honest = MeshNode(nodes(tmp_path / "honest", env=_slot_env(HMPNODE_PEER_TARGET_PEERS="0",
                                                                        HMPNODE_PEER_MIN_OUTBOUND="0")))

            async def dialled():
                return any(p["did"] == honest.did and p["connected"] and p.get("initiator")
                           for p in await target.peers())

            await wait_for(dialled, 30, "the node to dial the honest one")
            slots = (await target.client.status())["mesh"]["slots"]
            assert slots["inbound"] == 2 and slots["outbound"] >= 1
        finally:
            await target.close()
            if honest is not None:
                await honest.close()


async def test_a_banned_did_from_this_host_cannot_come_back_as_a_fresh_one(nodes, tmp_path):
    """On loopback only the DID is banned (every node of the host shares 127.0.0.1), but for
    the ban length no fresh DID from this host gets in either; a DID that had a connection
    before still does. Both end with the ban."""
    env = _slot_env(HMPNODE_PEER_STRIKE_THRESHOLD="10", HMPNODE_PEER_BAN_SECONDS="3")
    target = MeshNode(nodes(tmp_path / "target", env=env))
    port = target.info["peer"]["port"]
    async with aiohttp.ClientSession() as http:
        try:
            known, attacker = Identity.generate(), Identity.generate()
            ws = await authenticate(http, port, known)
            assert not isinstance(ws, (int, str)), ws
            await ws.close()
            ws = await authenticate(http, port, attacker)
            assert not isinstance(ws, (int, str)), ws
            for _ in range(3):
                await ws.send_str("not json")  # 5 strikes each (decaying): banned at 10
            assert await closed_reason(ws, wait=5) == "banned"
            assert await authenticate(http, port, attacker) == "banned"
            fresh = await authenticate(http, port, Identity.generate())
            assert fresh == "fresh_did", fresh  # old code: let in
            again = await authenticate(http, port, known)
            assert not isinstance(again, (int, str)), again
            await again.close()

            async def fresh_let_in():
                result = await authenticate(http, port, Identity.generate())
                if isinstance(result, (int, str)):
                    assert result == "fresh_did", result
                    return False
                await result.close()
                return True

            await wait_for(fresh_let_in, 20, "fresh DIDs to be let in once the ban ended", every=0.5)
            back = await authenticate(http, port, attacker)  # the DID ban ended too
            assert not isinstance(back, (int, str)), back
            await back.close()
            assert (await target.client.status())["refused"]["peer:fresh_did"] >= 1
        finally:
            await target.close()


async def test_one_local_process_with_fresh_dids_holds_at_most_the_host_cap(nodes, tmp_path):
    """This host is one address (every node on it shares 127.0.0.1): one local process
    minting DIDs holds at most peer.max_loopback_peers slots, the rest are refused before
    the upgrade (503 loopback_full), so peers from elsewhere keep the other slots."""
    target = MeshNode(nodes(tmp_path / "target", env=_slot_env(HMPNODE_PEER_MAX_LOOPBACK_PEERS="12")))
    port = target.info["peer"]["port"]
    async with aiohttp.ClientSession() as http:
        held: list[Any] = []  # kept: a collected WebSocket would close and free its slot
        try:
            results = []
            for _ in range(20):
                result = await authenticate(http, port, Identity.generate())
                if isinstance(result, (int, str)):
                    results.append(result)
                else:
                    held.append(result)
            assert len(held) == 12 and results == [503] * 8, results  # old code: 20 held
            assert sum([await closed_reason(ws) is None for ws in held]) == 12
            status = await target.client.status()
            assert status["refused"]["peer:loopback_full"] == 8
            assert status["mesh"]["slots"]["top_addresses"] == [{"address": "loopback", "connections": 12}]
        finally:
            for ws in held:
                await ws.close()
            await target.close()


async def test_a_pinned_peer_is_dialled_beyond_target_peers(nodes, tmp_path):
    """peer.pinned: the node keeps a connection to a pinned peer even when it dials no one else."""
    quiet = _slot_env(HMPNODE_PEER_TARGET_PEERS="0", HMPNODE_PEER_MIN_OUTBOUND="0")
    honest = MeshNode(nodes(tmp_path / "honest", env=quiet))  # never dials by itself
    target = None
    try:
        target = MeshNode(nodes(tmp_path / "target", env={**quiet, "HMPNODE_PEER_PINNED": honest.did}))

        async def dialled():
            return any(p["did"] == honest.did and p["connected"] and p.get("initiator") for p in await target.peers())

        await wait_for(dialled, 30, "the node to dial its pinned peer")
        assert (await target.client.status())["mesh"]["slots"]["pinned"] == 1
    finally:
        if target is not None:
            await target.close()
        await honest.close()
