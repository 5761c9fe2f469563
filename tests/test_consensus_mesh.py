"""CogConsensus on real nodes: three `hmpnode run` processes on 127.0.0.1; one
proposes (CLI), two vote (CLI and API), the proposer's node publishes the
consensus_result after the deadline, the others see `accepted` and recount it."""

from __future__ import annotations

import asyncio
import json

from tests.meshutil import mesh_env, start_nodes, wait_for
from tests.nodeproc import hmp

#: the voting window: long enough for the proposal to reach both voters on a loaded machine
TTL_SECONDS = 30


async def test_three_nodes_propose_vote_close_and_recount(nodes, tmp_path):
    env = mesh_env(HMPNODE_CONSENSUS_CHECK_SECONDS="1", HMPNODE_CONSENSUS_CLOSE_GRACE_SECONDS="3")
    mesh = start_nodes(nodes, tmp_path, 3, env=env)
    proposer, bob, carol = mesh
    try:
        async def all_connected():
            return all([len(await n.connected()) >= 2 for n in mesh])

        await wait_for(all_connected, 30, "the three nodes to connect to each other")
        made = await asyncio.to_thread(hmp, "propose", "raise the relay quota", "--ttl", f"{TTL_SECONDS}s",
                                       "--quorum", "2", "--data-dir", str(proposer.proc.data_dir), env=env)
        assert made.returncode == 0, made.stderr.decode()
        did = json.loads(made.stdout)["did"]

        await wait_for(lambda: _all_hold([bob, carol], did), 20, "the proposal on both voters")
        voted = await asyncio.to_thread(hmp, "vote", did, "yes", "--reason", "needed",
                                        "--data-dir", str(bob.proc.data_dir), env=env)
        assert voted.returncode == 0, voted.stderr.decode()
        await carol.client.request("POST", f"/v1/consensus/{did}/votes", body={"value": 0.5})

        async def open_with_two_votes():
            state = await proposer.client.consensus(did)
            return state["state"] == "open" and len(state["counted"]) == 2 and state

        state = await wait_for(open_with_two_votes, 20, "both votes counted (open) on the proposer's node")
        assert state["leading"] == "accepted"

        async def closed(node):
            state = await node.client.consensus(did)
            return state["closed_by"] is not None and state

        final = await wait_for(lambda: closed(proposer), TTL_SECONDS + 30, "the proposer's node to close")
        assert final["state"] == "accepted" and final["score"] == 0.75
        for node in (bob, carol):
            seen = await wait_for(lambda node=node: closed(node), 30, "the consensus_result on a voter's node")
            assert (seen["state"], seen["closed_by"]) == ("accepted", final["closed_by"])
            (result,) = seen["results"]
            assert result["authoritative"] and result["recount"]["status"] == "match", result
            assert result["sender"] == proposer.did
        # the voters never publish a result of their own; the CLI reads the same state
        shown = await asyncio.to_thread(hmp, "consensus", did, "--data-dir", str(carol.proc.data_dir), env=env)
        assert shown.returncode == 0 and json.loads(shown.stdout)["state"] == "accepted"
        late = await asyncio.to_thread(hmp, "vote", did, "no", "--data-dir", str(carol.proc.data_dir), env=env)
        assert late.returncode != 0 and b"voting_closed" in late.stderr
    finally:
        for n in mesh:
            await n.close()


async def _all_hold(nodes, did: str) -> bool:
    return all([await n.holds(did) for n in nodes])
