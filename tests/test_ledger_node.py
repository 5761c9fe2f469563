"""One hostile connection against a real node: whatever it offers, the node's
who-has-what ledger holds at most peer.ledger_session_entries on its behalf, and
nothing once it is gone (mesh status "ledger")."""

from __future__ import annotations

from datetime import datetime, timezone

from hmpnode.container.build import build_container
from hmpnode.net.mce import index_entry
from tests.meshutil import wait_for
from tests.test_mesh_hostile import _hostile_peer

CAP, ROOM, ROUNDS = 500, 200, 8


async def test_one_hostile_connection_holds_at_most_its_share_of_the_ledger(nodes, tmp_path):
    """It offers 1 600 made-up DIDs (rounds of peer.max_requested, each closed by an empty
    container_response so the node has room again) in 16+ fresh MCE messages: the node
    asks for every one (it took them up) but remembers at most CAP of them."""
    async with _hostile_peer(nodes, tmp_path, HMPNODE_PEER_MAX_REQUESTED=str(ROOM),
                             HMPNODE_PEER_LEDGER_SESSION_ENTRIES=str(CAP)) as peer:
        now = datetime.now(timezone.utc).replace(microsecond=0)
        entry = index_entry(build_container(peer.identity, "note", {"text": "x"}, now=now)["hmp_container"])
        asked: set[str] = set()
        for r in range(ROUNDS):
            offer = {f"did:hmp:container:{r:04x}{i:060x}": entry for i in range(ROOM)}
            await peer.send_mce("container_index", offer)
            replies = await peer.replies(lambda got: set(offer) <= asked | {
                d for kind, value in got if kind == "container_request" for d in value.get("request_container", [])})
            assert not [v for k, v in replies if k == "error"], replies
            asked |= {d for kind, value in replies if kind == "container_request"
                      for d in value.get("request_container", [])}
            await peer.send_mce("container_response", {"available": [], "round": r})  # nothing is coming
        assert len(asked) == ROUNDS * ROOM

        async def settled():
            st = (await peer.target.client.status())["mesh"]
            return st["connected"] == 1 and st["ledger"]["evicted_session"] > 0 and st["ledger"]

        ledger = await wait_for(settled, 20, "the ledger to drop the oldest entries")
        assert ledger["session_entries"] == CAP
        assert 0 < ledger["largest_book"] <= CAP and ledger["entries"] <= CAP, ledger
        # the requests in flight it made the node keep: a quarter of its cap, node-wide
        assert ledger["inflight"] <= CAP // 4 and ledger["inflight_evicted"] > 0, ledger
        await peer.ws.close()

        async def emptied():
            st = (await peer.target.client.status())["mesh"]
            return st["connected"] == 0 and st["ledger"]["entries"] == 0 and st["ledger"]

        ledger = await wait_for(emptied, 20, "the connection's entries to go with it")
        assert ledger["books"] == 0
