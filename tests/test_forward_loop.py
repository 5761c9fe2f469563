"""The gossip forward loop ends once its node stopped (net/gossip.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hmpnode.net.gossip import forward_loop


@pytest.mark.asyncio
async def test_forward_loop_without_peers_ends_when_the_node_stopped():
    """A node without peers and without a DHT reads nothing and waits for the next
    commit; once the node stopped its tick stays resolved, and the loop used to go
    round forever without giving way (the whole event loop frozen). Bounded here: a
    node whose `changed()` is asked more than 100 times fails the test."""
    stopped = asyncio.get_running_loop().create_future()
    stopped.set_result(None)
    asked = 0

    def changed():
        nonlocal asked
        asked += 1
        if asked > 100:
            raise AssertionError("the forward loop goes round a stopped node")
        return stopped

    mesh = SimpleNamespace(node=SimpleNamespace(last_seq=0, changed=changed), sessions={}, dht=None)
    await asyncio.wait_for(forward_loop(mesh, SimpleNamespace()), 5)  # no publisher needed: no DHT
    assert asked == 1
