"""A circuit relay (a real node with role circuit) against made-up peers: reservation and
circuit floods, a circuit pushing past its byte limit, a dialer that never sends. Each is
refused or cut at the limit the relay states (docs/protocol.md 34.3)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from hmpnode.identity import Identity
from hmpnode.net.circuit import parse_hello
from hmpnode.net.transport import HANDSHAKE_VERSIONS
from tests.meshutil import MeshNode, mesh_env, wait_for
from tests.peerclient import PeerSocket, authenticate

QUIET = {"HMPNODE_PEER_DHT": "false", "HMPNODE_PEER_LAN_DISCOVERY": "false", "HMPNODE_PEER_TARGET_PEERS": "0"}
#: small limits, so that the floods reach them quickly
LIMITS = {"HMPNODE_NODE_ROLES": "circuit", "HMPNODE_PEER_CIRCUIT_RESERVATIONS_PER_IP": "2",
          "HMPNODE_PEER_CIRCUIT_PER_RESERVATION": "2", "HMPNODE_PEER_CIRCUIT_BYTES": str(64 * 1024),
          "HMPNODE_PEER_CIRCUIT_ACCEPT_MS": "1000", "HMPNODE_PEER_CIRCUIT_SECONDS": "10"}


@pytest.fixture
async def relay(nodes, tmp_path):
    node = MeshNode(nodes(tmp_path / "r", env=mesh_env(**QUIET, **LIMITS)))
    async with aiohttp.ClientSession() as http:
        yield node, http
    await node.close()


async def _peer(http: aiohttp.ClientSession, relay: MeshNode, seed: int) -> PeerSocket:
    ps = await authenticate(http, relay.info["peer"]["port"], Identity(bytes([seed]) * 32), versions=HANDSHAKE_VERSIONS)
    assert isinstance(ps, PeerSocket), ps
    return ps


async def _nat(ps: PeerSocket, op: str, timeout: float = 5.0) -> dict:
    """The next `nat` frame with `op` the relay sends (other frames are skipped)."""
    import orjson

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        msg = await ps.receive(timeout=max(0.01, deadline - loop.time()))
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        frame = orjson.loads(msg.data)
        if frame.get("type") == "nat" and frame.get("op") == op:
            return frame


async def _reserve(ps: PeerSocket, rid: int) -> dict:
    await ps.send_json({"type": "nat", "op": "reserve", "id": rid})
    return await _nat(ps, "reserved")


def _circuit_url(relay: MeshNode, query: str) -> str:
    return f"http://127.0.0.1:{relay.info['peer']['port']}/hmp/v2/circuit{query}"


async def _circuits(relay: MeshNode) -> dict:
    return (await relay.client.status())["mesh"]["circuits"]["relay"]


async def test_a_reservation_flood_from_one_address_is_capped(relay):
    r, http = relay
    peers = [await _peer(http, r, 40 + i) for i in range(4)]
    answers = [await _reserve(ps, i) for i, ps in enumerate(peers)]
    assert [a["ok"] for a in answers] == [True, True, False, False]
    assert {a.get("reason") for a in answers[2:]} == {"address_limit"}
    assert answers[0]["addr"] == f"relay://127.0.0.1:{r.info['peer']['port']}/{r.did}"
    assert answers[0]["expires_s"] == 3600
    # renewing is not a new reservation
    assert (await _reserve(peers[0], 9))["ok"] is True
    assert (await _circuits(r))["reservations"] == 2
    # a reservation goes with its session: the room is back for another DID
    await peers[0].close()
    await wait_for(lambda: _reservations_are(r, 1), 10, "the closed session's reservation to go")
    assert (await _reserve(peers[2], 20))["ok"] is True
    for ps in peers:
        await ps.close()


async def _reservations_are(r: MeshNode, count: int) -> bool:
    return (await _circuits(r))["reservations"] == count


async def test_a_circuit_flood_through_one_reservation_is_capped_and_unaccepted_ones_expire(relay):
    r, http = relay
    n = await _peer(http, r, 50)
    assert (await _reserve(n, 1))["ok"]

    async def dial() -> int:
        async with http.get(_circuit_url(r, f"?to={Identity(bytes([50]) * 32).did}")) as resp:
            return resp.status

    dials = [asyncio.ensure_future(dial()) for _ in range(2)]
    tokens = {(await _nat(n, "connect"))["circuit"] for _ in range(2)}
    assert len(tokens) == 2 and all(len(t) == 32 for t in tokens)
    assert await dial() == 503  # the third while two are pending: circuit_limit
    assert sorted(await asyncio.gather(*dials)) == [404, 404]  # never accepted: expired
    status = await _circuits(r)
    assert status["refused"]["circuit_limit"] == 1 and status["refused"]["expired"] == 2
    assert status["pending"] == status["circuits"] == 0
    # an accept that comes after the expiry finds nothing
    async with http.get(_circuit_url(r, f"?accept={tokens.pop()}")) as resp:
        assert resp.status == 404 and (await resp.json())["error"] == "expired"
    await n.close()


async def _open_circuit(r: MeshNode, http: aiohttp.ClientSession, n: PeerSocket, n_did: str):
    """A spliced circuit: (the dialer's WebSocket, the accepting node's WebSocket)."""
    dialer = asyncio.ensure_future(http.ws_connect(_circuit_url(r, f"?to={n_did}")))
    token = (await _nat(n, "connect"))["circuit"]
    accepted = await http.ws_connect(_circuit_url(r, f"?accept={token}"))
    dialer = await dialer
    # the relay's hello first, on each end: the IP it sees the other end at (34.3)
    for ws in (dialer, accepted):
        msg = await ws.receive(timeout=10)
        assert msg.type == aiohttp.WSMsgType.TEXT and parse_hello(msg.data) == "127.0.0.1", msg
    return dialer, accepted


async def test_a_circuit_is_cut_at_its_byte_limit_and_both_ends_close(relay):
    r, http = relay
    n = await _peer(http, r, 60)
    assert (await _reserve(n, 1))["ok"]
    a, b = await _open_circuit(r, http, n, Identity(bytes([60]) * 32).did)
    chunk = bytes(16 * 1024)
    for _ in range(6):  # 96 KiB into a circuit of 64 KiB
        await a.send_bytes(chunk)
    got = 0
    while True:
        msg = await b.receive(timeout=10)
        if msg.type != aiohttp.WSMsgType.BINARY:
            break
        got += len(msg.data)
    assert got == 64 * 1024  # every message up to the limit, none beyond
    assert (await a.receive(timeout=10)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    status = await _circuits(r)
    assert status["cut_bytes"] >= 1 and status["circuits"] == 0
    # a text message is not carried either: it closes the circuit
    a, b = await _open_circuit(r, http, n, Identity(bytes([60]) * 32).did)
    await a.send_str("hello")
    assert (await b.receive(timeout=10)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    await n.close()


async def test_a_dialer_that_never_sends_holds_its_circuit_only_for_the_circuit_seconds(relay):
    r, http = relay
    n = await _peer(http, r, 70)
    assert (await _reserve(n, 1))["ok"]
    a, b = await _open_circuit(r, http, n, Identity(bytes([70]) * 32).did)
    assert (await _circuits(r))["circuits"] == 1
    msg = await b.receive(timeout=30)  # circuit_seconds is 10
    assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    assert (await a.receive(timeout=10)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    status = await _circuits(r)
    assert status["cut_seconds"] == 1 and status["circuits"] == 0
    await n.close()
