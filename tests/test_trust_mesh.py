"""Trust (docs/protocol.md 30.5) on real nodes: the figure a node gives an agent comes
from evaluations made on other nodes, which reach it through the mesh (32.1); one
evaluator counts once however many evaluations it spreads over the agent's work."""

from __future__ import annotations

from tests.meshutil import start_nodes, wait_for

DAMPING = 3  # consensus.trust_damping, the default


async def test_trust_of_an_agent_is_built_from_evaluations_made_on_other_nodes(nodes, tmp_path):
    mesh = start_nodes(nodes, tmp_path, 3)
    author, fan, critic = mesh
    try:
        async def all_connected():
            return all([len(await n.connected()) >= 2 for n in mesh])

        await wait_for(all_connected, 30, "the three nodes to connect to each other")
        dids = [(await author.client.create("note", {"text": f"work {i}"}, broadcast=True))["did"] for i in range(3)]

        async def all_hold():
            return all([await n.holds(d) for n in (fan, critic) for d in dids])

        await wait_for(all_hold, 30, "the author's work on the other two nodes")
        before = await author.client.trust(author.did)
        assert (before["trust"], before["evaluators"]) == (0.5, 0), before
        for did in dids:  # a flood of approval from one agent: counts as one evaluator
            await fan.client.evaluate(did, "usefulness", 1.0)
        await critic.client.evaluate(dids[0], "usefulness", -0.5)
        expected = round(0.5 + 0.5 * (1.0 - 0.5) / (2 + DAMPING), 6)

        async def settled(node):
            figure = await node.client.trust(author.did)
            return figure["evaluations"] == 4 and figure

        for node in mesh:  # the author's own node and each evaluator's, from the other's evaluations
            figure = await wait_for(lambda node=node: settled(node), 30, "all four evaluations at a node")
            assert (figure["trust"], figure["evaluators"]) == (expected, 2), figure
        # an agent's evaluations of its own work do not count
        await author.client.evaluate(dids[1], "usefulness", 1.0)
        mine = await author.client.trust(author.did)
        assert (mine["trust"], mine["evaluators"]) == (expected, 2), mine
    finally:
        for n in mesh:
            await n.close()
