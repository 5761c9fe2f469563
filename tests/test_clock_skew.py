"""Two real nodes, and one's clock jumps an hour back while they are connected
(docs/protocol.md 25.4). Freshness failures are no offence: neither node bans the
other, each shows the other's offset in status and /metrics, and once the clock is
right again they connect and exchange as before. (Before: bad_mce x11 and a ban.)"""

from __future__ import annotations

import asyncio

from tests.meshutil import MeshNode, mesh_env, wait_for


async def _skew_of(node: MeshNode, did: str) -> float | None:
    return (await node.client.status())["mesh"]["clock_skew"]["peers"].get(did)


async def test_a_clock_an_hour_off_bans_nobody_is_shown_and_mends(nodes, tmp_path):
    clock = tmp_path / "b.clock"
    clock.write_text("0")
    a = MeshNode(nodes(tmp_path / "a", env=mesh_env()))
    b = MeshNode(nodes(tmp_path / "b", env=mesh_env(HMPNODE_TEST_CLOCK_OFFSET_FILE=str(clock))))
    try:
        async def linked():
            return b.did in await a.connected() and a.did in await b.connected()

        await wait_for(linked, 30, "the two nodes to connect")
        clock.write_text("-3600")  # b's clock jumps an hour back
        await asyncio.sleep(1.0)
        # traffic both ways: pushes, acknowledgements, announcements (bounded: 12 each)
        for i in range(12):
            await a.client.create("note", {"text": f"from a {i}"}, broadcast=True)
            await b.client.create("note", {"text": f"from b {i}"}, broadcast=True)
            await asyncio.sleep(0.2)

        async def measured():
            ahead, behind = await _skew_of(b, a.did), await _skew_of(a, b.did)
            return ahead is not None and behind is not None and abs(ahead - 3600) < 30 and abs(behind + 3600) < 30

        await wait_for(measured, 30, "each node to measure the other's clock offset")
        status_a, status_b = await a.client.status(), await b.client.status()
        for status in (status_a, status_b):
            counters = status["mesh"]["counters"]
            assert "banned" not in counters and not any(k.startswith("strike_bad_mce") for k in counters), counters
            assert status["mesh"]["clock_skew"]["max_abs_seconds"] > 3500
        refused = sum(s["refused"].get("peer:clock_skew", 0) for s in (status_a, status_b))
        assert refused >= 1
        gauge = [line for line in (await a.client.metrics()).splitlines()
                 if line.startswith("hmpnode_peer_clock_skew_max_seconds ")]
        assert len(gauge) == 1 and float(gauge[0].split()[1]) > 3500

        clock.write_text("0")  # the clock is fixed: they connect again and exchange
        await wait_for(linked, 40, "the nodes to connect again once the clock is right")
        did = (await a.client.create("note", {"text": "after the fix"}, broadcast=True))["did"]
        await wait_for(lambda: b.holds(did), 30, "a broadcast to arrive after the fix")
        for node in (a, b):
            assert "banned" not in (await node.client.status())["mesh"]["counters"]
    finally:
        await a.close()
        await b.close()


async def test_a_stored_ban_never_outlasts_a_ban_after_a_restart(nodes, tmp_path):
    """A ban written while the clock was an hour ahead ends within peer.ban_seconds of
    the restart with the right clock, not an hour later."""
    import sqlite3
    import time

    import aiohttp

    from hmpnode.identity import Identity
    from tests.peerclient import authenticate

    env = mesh_env(HMPNODE_PEER_BAN_SECONDS="3")
    node = MeshNode(nodes(tmp_path / "n", env=env))
    await node.close()
    node.proc.stop()
    peer = Identity.generate()
    db = sqlite3.connect(tmp_path / "n" / "hmpnode.sqlite3")
    with db:
        db.execute("INSERT INTO bans (key, until_us) VALUES (?, ?)", (peer.did, int((time.time() + 3600) * 1e6)))
    db.close()
    node = MeshNode(nodes(tmp_path / "n", env=env))
    try:
        async with aiohttp.ClientSession() as http:
            port = node.info["peer"]["port"]
            assert await authenticate(http, port, peer) == "banned"  # the ban was loaded

            async def accepted():
                ws = await authenticate(http, port, peer)
                if isinstance(ws, (int, str)):
                    return False
                await ws.close()
                return True

            await wait_for(accepted, 20, "the stored ban to end", every=0.5)
    finally:
        await node.close()
