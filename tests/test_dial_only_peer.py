"""A peer that only dials (docs/protocol.md 19, 28.3.4): its handshake announce must still
hold one valid address record. What a real node does with it: `tcp://0.0.0.0:<port>` is
kept by no dial rule, so the node never dials it back; a dialable address nobody listens
on is dialled whenever the node wants connections, backed off, never forgotten for it (the
peer was connected once) and never held against the peer."""

from __future__ import annotations

import asyncio
import socket

import aiohttp

from hmpnode.identity import Identity
from tests.meshutil import MeshNode, mesh_env, wait_for
from tests.peerclient import PeerSocket, authenticate


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _row(node: MeshNode, did: str) -> dict | None:
    return next((p for p in await node.peers() if p["did"] == did), None)


async def _dials(node: MeshNode) -> dict:
    return (await node.client.status())["mesh"]["dials"]


async def test_what_the_node_dials_of_a_peer_that_only_dials(nodes, tmp_path):
    env = mesh_env(HMPNODE_PEER_DHT="false", HMPNODE_PEER_LAN_DISCOVERY="false",
                   HMPNODE_PEER_DIAL_BACKOFF_MAX_SECONDS="1", HMPNODE_PEER_DIAL_GIVE_UP_AFTER="1")
    node = MeshNode(nodes(tmp_path / "n", env=env))
    port = (await node.client.status())["mesh"]["peer_port"]
    quiet, deaf = Identity.generate(), Identity.generate()
    try:
        async with aiohttp.ClientSession() as http:
            # the announce of a peer that listens nowhere: the unspecified address
            ws = await authenticate(http, port, quiet, addresses=["tcp://0.0.0.0:7420"])
            assert isinstance(ws, PeerSocket), ws
            row = await wait_for(lambda: _row(node, quiet.did), 10, "the node to keep the dialler's row")
            assert row["connected"] and row["addresses"] == []  # admitted; nothing it could dial
            assert (await _dials(node))["refused"].get("special") == 1
            await ws.close()
            # the connect loop (every second, and at once when a connection ends) finds nothing to dial
            await asyncio.sleep(3.0)  # the deaf peer below is dialled within ~1 s of leaving
            dials = await _dials(node)
            assert dials["attempts"] == 0 and dials["off_rule"] == 0, dials
            row = await _row(node, quiet.did)
            assert row is not None and not row["connected"] and row["last_contact"] is not None

            # the announce of a peer that names an address it does not listen on (here loopback:
            # the dial rule allows it from a peer on this host)
            dead = f"tcp://127.0.0.1:{_closed_port()}"
            ws = await authenticate(http, port, deaf, addresses=[dead])
            assert isinstance(ws, PeerSocket), ws
            row = await wait_for(lambda: _row(node, deaf.did), 10, "the node to keep the dialler's row")
            assert row["addresses"] == [dead]
            await ws.close()

            async def failed_rounds():
                return (await _dials(node))["failed_rounds"] >= 3 or None

            await wait_for(failed_rounds, 60, "the node to dial the address back and fail three rounds")
            row = await _row(node, deaf.did)
            # more failed rounds than dial_give_up_after, yet kept: it was connected once
            assert row is not None and row["addresses"] == [dead] and row["last_contact"] is not None
            ws = await authenticate(http, port, deaf, addresses=[dead])
            assert isinstance(ws, PeerSocket), ws  # no ban, no penalty for the failed dials
            await ws.close()
    finally:
        await node.close()
