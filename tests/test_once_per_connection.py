"""A directed container is carried at most once per connection (docs/protocol.md 23.2):
the outbox alone delivers the agent's directed containers (the forward loop used to push
them too), and a request crossing a push is not answered with a second copy.
(Before: 2-3 copies on the recipient's connection within a second.) One real node here,
counting the copies on the wire; the decisions alone (the outbox's wake, a push and a
request crossing it) are tested without processes in tests/test_core.py."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp

from hmpnode.identity import Identity
from tests.meshutil import MeshNode, mesh_env
from tests.peerclient import authenticate
from tests.test_mesh_hostile import _Hostile, _incoming


async def test_the_recipient_sees_each_directed_container_once_on_the_wire(nodes, tmp_path):
    """An instrumented recipient behaves as a node does (catch-up, asks for what a delta
    offers, acknowledges) and counts the copies of each container on its connection."""
    sender = MeshNode(nodes(tmp_path / "sender", env=mesh_env()))
    me = Identity.generate()
    async with aiohttp.ClientSession() as http:
        try:
            ws = await authenticate(http, sender.info["peer"]["port"], me)
            assert not isinstance(ws, (int, str)), ws
            peer = _Hostile(sender, me, ws)
            copies: Counter[str] = Counter()
            dids = [(await sender.client.create("note", {"text": f"n{i}"}, recipients=[me.did]))["did"]
                    for i in range(10)]
            await peer.send_mce("container_request", {"after": ""})  # its catch-up, as a node asks on connecting
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 4.0  # bounded: every copy there is arrives well within
            while loop.time() < deadline:
                try:
                    msg = await ws.receive(timeout=max(0.05, deadline - loop.time()))
                except (TimeoutError, asyncio.TimeoutError):
                    break
                assert msg.type == aiohttp.WSMsgType.TEXT, msg
                kind, value = _incoming(msg.data)
                if kind == "containers":
                    got = [item["hmp_container"]["head"]["container_did"] for item in value["items"]]
                    copies.update(got)
                    await peer.send_mce("container_ack", {"acknowledged": got})
                elif kind == "container_request" and "after" in value:
                    await peer.send_mce("container_delta", {"since": "2026-01-01T00:00:00Z", "added": {},
                                                            "cursor": "", "complete": True})
                elif kind == "container_delta":  # offered: ask for what it does not hold, as a node does
                    wanted = [d for d in value.get("added", {}) if copies[d] == 0]
                    if wanted:
                        await peer.send_mce("container_request", {"request_container": wanted})
            await ws.close()
            assert set(copies) == set(dids) and set(copies.values()) == {1}, copies
            assert (await sender.client.status())["mesh"]["counters"].get("sent_twice_on_connection", 0) == 0
        finally:
            await sender.close()
