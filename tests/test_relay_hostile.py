"""A hostile peer against a real relay (docs/protocol.md 24.1): it authenticates and
hands the relay directed containers for made-up recipients. What the relay holds stays
within its quotas (per sending peer, a node-wide pool for recipients it never heard
of), the rest is refused in the `container_ack` with a reason, refusals of a limit
cost no strikes, and nothing is held longer than relay.max_hold_seconds."""

from __future__ import annotations

import contextlib
from datetime import datetime, timezone
from typing import Any

import aiohttp
import orjson

from hmpnode.container.build import build_container
from hmpnode.identity import Identity
from tests.meshutil import MeshNode, mesh_env, wait_for
from tests.peerclient import authenticate
from tests.test_mesh_hostile import _Hostile


def _for_strangers(sender: Identity, count: int, text_bytes: int = 400) -> list[dict[str, Any]]:
    """Directed containers, each for a fresh random recipient DID nobody ever announced."""
    now = datetime.now(timezone.utc).replace(microsecond=0)
    return [build_container(sender, "note", {"text": f"{i:05d}" + "x" * text_bytes}, now=now,
                            recipients=[Identity.generate().did]) for i in range(count)]


async def _hand_over(peer: _Hostile, items: list[dict[str, Any]], per_frame: int = 20) -> tuple[list[str], list[dict]]:
    """Send `items` in `containers` frames; (acknowledged DIDs, rejected entries) from the acks."""
    acked: list[str] = []
    rejected: list[dict] = []
    for start in range(0, len(items), per_frame):
        chunk = items[start:start + per_frame]
        await peer.send({"type": "containers", "items": chunk})
        replies = await peer.replies(lambda r: any(kind in ("container_ack", "error") for kind, _ in r))
        for kind, value in replies:
            assert kind != "error", value
            if kind == "container_ack":
                acked += value.get("acknowledged", [])
                rejected += value.get("rejected", [])
    return acked, rejected


@contextlib.asynccontextmanager
async def _relay_and_attacker(nodes, tmp_path, **env: str):
    relay = MeshNode(nodes(tmp_path / "relay", "--roles", "relay,mailman", env=mesh_env(**env)))
    async with aiohttp.ClientSession() as http:
        try:
            identity = Identity.generate()
            ws = await authenticate(http, relay.info["peer"]["port"], identity)
            assert not isinstance(ws, (int, str)), ws
            yield relay, _Hostile(relay, identity, ws), http
            await ws.close()
        finally:
            await relay.close()


async def _relay_status(relay: MeshNode) -> dict[str, Any]:
    return await relay.client.status()


async def test_mail_for_never_seen_recipients_is_held_only_within_its_pool(nodes, tmp_path):
    pool = 20_000
    async with _relay_and_attacker(nodes, tmp_path, HMPNODE_RELAY_MAX_UNKNOWN_BYTES=str(pool)) as (relay, peer, _):
        items = _for_strangers(peer.identity, 60)
        size = len(orjson.dumps(items[0]))
        acked, rejected = await _hand_over(peer, items)
        fits = pool // size
        assert len(acked) == fits and len(rejected) == 60 - fits, (len(acked), len(rejected), size)
        assert {r["reason"] for r in rejected} == {"relay_unknown_recipient"}
        status = await _relay_status(relay)
        held = status["mesh"]["relay"]
        assert held["held"] == fits and held["unknown_recipients_held"] == fits
        assert held["unknown_recipients_bytes"] <= pool
        assert status["refused"]["relay:relay_unknown_recipient"] == 60 - fits
        # a limit of the relay is no offence: the peer is still connected and not struck
        assert "strike_rejected_container" not in status["mesh"]["counters"]
        assert peer.identity.did in await relay.connected()
        assert status["store"]["containers"] == fits


async def test_what_one_sending_peer_may_make_a_relay_hold_is_bounded(nodes, tmp_path):
    async with _relay_and_attacker(nodes, tmp_path, HMPNODE_RELAY_MAX_PER_SENDER="10") as (relay, peer, http):
        acked, rejected = await _hand_over(peer, _for_strangers(peer.identity, 30))
        assert len(acked) == 10 and len(rejected) == 20
        assert {r["reason"] for r in rejected} == {"relay_sender_quota"}
        # another sending peer has its own quota
        other = Identity.generate()
        ws = await authenticate(http, relay.info["peer"]["port"], other)
        assert not isinstance(ws, (int, str)), ws
        try:
            acked2, rejected2 = await _hand_over(_Hostile(relay, other, ws), _for_strangers(other, 12))
            assert len(acked2) == 10 and {r["reason"] for r in rejected2} == {"relay_sender_quota"}
        finally:
            await ws.close()
        status = await _relay_status(relay)
        assert status["mesh"]["relay"]["held"] == 20 and status["mesh"]["relay"]["senders"] == 2
        assert status["refused"]["relay:relay_sender_quota"] == 22


async def test_nothing_is_held_longer_than_the_longest_hold(nodes, tmp_path):
    """No ttl: held relay.max_hold_seconds at most, then dropped, container and all."""
    async with _relay_and_attacker(nodes, tmp_path, HMPNODE_RELAY_MAX_HOLD_SECONDS="2") as (relay, peer, _):
        items = _for_strangers(peer.identity, 3)
        acked, rejected = await _hand_over(peer, items)
        assert len(acked) == 3 and not rejected

        async def dropped():
            status = await _relay_status(relay)
            return status["mesh"]["relay"]["held"] == 0 and status["store"]["containers"] == 0 and status

        status = await wait_for(dropped, 20, "the relay to drop what it held past max_hold_seconds")
        assert status["mesh"]["counters"]["relay_expired"] == 3
        assert not await relay.holds(items[0]["hmp_container"]["head"]["container_did"])
