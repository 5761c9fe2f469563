"""Observed addresses and dial-back between real nodes on 127.0.0.1 (docs/protocol.md 34.1,
34.2; hmpnode.net.dialback): each side of a connection hears where the other sees it; a node
that two peers see at one address asks them to dial it back and calls itself public when its
nonce arrives (on loopback only with 127.0.0.0/8 in [peer] dial_allow: by default loopback is
never "public"); a made-up peer cannot make a node dial any IP but its own, nor more often
than the limits say."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import orjson
import pytest

from hmpnode.identity import Identity
from hmpnode.net.transport import NAT_PROTOCOL, PROTOCOL
from tests.meshutil import MeshNode, mesh_env, start_nodes, wait_for
from tests.peerclient import PeerSocket, authenticate

NONCE = "0123456789abcdef" * 2


async def reach(node: MeshNode) -> dict:
    return (await node.client.status())["mesh"]["reachability"]


async def test_three_nodes_hear_where_they_are_seen_and_dial_each_other_back(nodes, tmp_path):
    # all three are one IP: each serves it one dial-back per interval, so the test makes that short
    env = mesh_env(HMPNODE_PEER_DHT="false", HMPNODE_PEER_DIAL_ALLOW="127.0.0.0/8",
                   HMPNODE_PEER_DIALBACK_PEER_INTERVAL_SECONDS="1", HMPNODE_PEER_DIALBACK_ASK_INTERVAL_SECONDS="1")
    mesh = start_nodes(nodes, tmp_path, 3, env=env)
    try:
        for node in mesh:
            async def public(node=node):
                r = await reach(node)
                return r if r["verdict"] == "public" else None

            r = await wait_for(public, 60, f"{node.did} to be confirmed public")
            port = node.info["peer"]["port"]
            assert r["public_addresses"] == ["127.0.0.1"] and r["port_preserving"] is True
            assert r["confirmed_addresses"] == [f"tcp://127.0.0.1:{port}"]
            seen = {e["peer"] for e in r["evidence"] if e["kind"] == "observed"}
            assert seen == {n.did for n in mesh} - {node.did}
            assert any(e["kind"] == "dialback" and e["outcome"] == "arrived" and e["source"] == "127.0.0.1"
                       for e in r["evidence"])
        text = await mesh[0].client.metrics()
        assert 'hmpnode_reachability{verdict="public"} 1' in text
        assert 'hmpnode_reachability{verdict="unknown"} 0' in text
        texts = [await n.client.metrics() for n in mesh]
        served = sum(int(line.split()[-1]) for text in texts for line in text.splitlines()
                     if line.startswith("hmpnode_dialback_served_total"))
        assert served >= 3
    finally:
        for node in mesh:
            await node.close()


async def test_loopback_is_not_public_by_default_but_each_side_hears_the_other(nodes, tmp_path):
    env = mesh_env(HMPNODE_PEER_DHT="false", HMPNODE_PEER_DIAL_PRIVATE="true")  # private ranges, not loopback
    mesh = start_nodes(nodes, tmp_path, 3, env=env)
    try:
        for node in mesh:
            others = {n.did for n in mesh} - {node.did}

            async def heard(node=node, others=others):
                r = await reach(node)
                return r if {e["peer"] for e in r["evidence"] if e["kind"] == "observed"} == others else None

            r = await wait_for(heard, 60, "both peers' observed reports")
            assert {e["addr"].rsplit(":", 1)[0] for e in r["evidence"]} == {"tcp://127.0.0.1"}
            assert not any(e["counted"] for e in r["evidence"] if e["kind"] == "observed")
            assert (r["verdict"], r["public_addresses"], r["port_preserving"]) == ("unknown", [], None)
        for n in mesh:
            assert (await n.client.status())["mesh"]["counters"].get("dialback_asked", 0) == 0
    finally:
        for node in mesh:
            await node.close()


class Recorder:
    """A plain TCP listener that records what each connection sends (up to its blank line)
    and answers 204: where a dial-back would land."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None

    async def start(self, host: str) -> int:
        self.server = await asyncio.start_server(self._serve, host, 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            self.requests.append(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5))
            writer.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
            await writer.drain()
        writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def next_nat(ws: PeerSocket, op: str, timeout: float = 10.0) -> dict:
    """The next `nat` frame with `op` the node sends (other frames skipped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = await ws.receive(timeout=max(0.01, deadline - time.monotonic()))
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        frame = orjson.loads(msg.data)
        if frame.get("type") == "nat" and frame.get("op") == op:
            return frame
    raise AssertionError(f"no nat {op} within {timeout} s")


@pytest.mark.parametrize("flood", [20])
async def test_a_peer_gets_dialled_back_only_at_its_own_ip_and_within_the_limits(nodes, tmp_path, flood):
    node = MeshNode(nodes(tmp_path / "n", env=mesh_env(HMPNODE_PEER_DHT="false", HMPNODE_PEER_LAN_DISCOVERY="false")))
    own, victim = Recorder(), Recorder()
    own_port, victim_port = await own.start("127.0.0.1"), await victim.start("127.0.0.2")
    port = node.info["peer"]["port"]
    try:
        async with aiohttp.ClientSession() as http:
            ws = await authenticate(http, port, Identity.generate(), versions=(PROTOCOL, NAT_PROTOCOL))
            assert isinstance(ws, PeerSocket)
            observed = await next_nat(ws, "observed")  # where the node sees our connection come from
            assert observed["addr"] == f"tcp://127.0.0.1:{ws.raw.get_extra_info('sockname')[1]}"

            # another IP (a victim's): refused, nothing dialled
            await ws.send_json({"type": "nat", "op": "dialback", "id": 1, "addr": f"tcp://127.0.0.2:{victim_port}",
                                "nonce": NONCE})
            assert await next_nat(ws, "dialback_result") == {"type": "nat", "op": "dialback_result", "id": 1,
                                                             "ok": False, "reason": "not_your_address"}
            # garbage members: refused malformed when the id is readable, never a traceback
            for bad in ({"addr": "x" * 5000}, {"nonce": "zz"}, {"addr": "tcp://localhost:80"}, {"id": "7"}, {"id": None}):
                await ws.send_json({"type": "nat", "op": "dialback", "id": 2, "addr": f"tcp://127.0.0.1:{own_port}",
                                    "nonce": NONCE, **bad})
            for _ in range(3):
                assert (await next_nat(ws, "dialback_result"))["reason"] == "malformed"

            # our own IP: dialled, a small GET with our nonce
            await ws.send_json({"type": "nat", "op": "dialback", "id": 3, "addr": f"tcp://127.0.0.1:{own_port}",
                                "nonce": NONCE})
            assert await next_nat(ws, "dialback_result") == {"type": "nat", "op": "dialback_result", "id": 3,
                                                             "ok": True, "reason": ""}
            assert len(own.requests) == 1 and own.requests[0].startswith(b"GET /hmp/v2/dialback?nonce=" + NONCE.encode())
            assert len(own.requests[0]) < 200, own.requests[0]

            # a flood from fresh DIDs on the same address: one dial-back a minute for it
            results = []
            for i in range(flood):
                peer = await authenticate(http, port, Identity.generate(), versions=(PROTOCOL, NAT_PROTOCOL))
                assert isinstance(peer, PeerSocket)
                await peer.send_json({"type": "nat", "op": "dialback", "id": 10 + i,
                                      "addr": f"tcp://127.0.0.1:{own_port}", "nonce": NONCE})
                results.append((await next_nat(peer, "dialback_result"))["reason"])
                await peer.close()
            assert results == ["rate_limited"] * flood
            assert len(own.requests) == 1 and victim.requests == []

        # a nonce nobody asked for: 204 like any other, counted
        async with aiohttp.ClientSession() as http:
            for nonce in (NONCE, "x" * 3000, ""):
                async with http.get(f"http://127.0.0.1:{port}/hmp/v2/dialback", params={"nonce": nonce}) as resp:
                    assert resp.status == 204 and await resp.read() == b""
        status = (await node.client.status())["mesh"]
        counters = status["counters"]
        assert counters["dialback_refused_not_your_address"] == 1 and counters["dialback_refused_malformed"] == 3
        assert counters["dialback_refused_rate_limited"] == flood and counters["dialback_served"] == 1
        assert counters["dialback_unasked"] == 3
        text = await node.client.metrics()
        assert f'hmpnode_dialback_refused_total{{reason="rate_limited"}} {flood}' in text
        assert "Traceback" not in node.proc.log()
    finally:
        await own.close()
        await victim.close()
        await node.close()
