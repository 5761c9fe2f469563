"""Selective sync on real nodes (docs/protocol.md 33): three `hmpnode run` processes on
127.0.0.1. A publishes, B wants only tag X ([interests] tags), R is a relay in
"everything" mode. B receives X and never Y, R both; B's interests changed through
the API take effect at once, and bring what it now wants from what its peers hold."""

from __future__ import annotations

import asyncio
import json

from tests.meshutil import MeshNode, dht_trio, mesh_env, wait_for
from tests.nodeproc import hmp


async def test_a_node_receives_only_what_it_declared_and_a_relay_everything(nodes, tmp_path):
    a = MeshNode(nodes(tmp_path / "a", env=mesh_env()))
    r = MeshNode(nodes(tmp_path / "r", env=mesh_env(HMPNODE_NODE_ROLES="relay", HMPNODE_INTERESTS_MODE="everything")))
    mesh = [a, r]
    try:
        async def hold_all(node, dids):
            return all([await node.holds(d) for d in dids])

        # held before B exists: B's catch-up (reconciliation) must bring X and not Y
        held_y = (await a.client.create("note", {"text": "y-held"}, broadcast=True, tags=["y"]))["did"]
        held_x = (await a.client.create("note", {"text": "x-held"}, broadcast=True, tags=["x"]))["did"]
        await wait_for(lambda: hold_all(r, [held_y, held_x]), 30, "the relay to hold what A published")
        b = MeshNode(nodes(tmp_path / "b", env=mesh_env(HMPNODE_INTERESTS_TAGS="x")))
        mesh.append(b)

        async def declared_to(node, peer, expected):
            return any(p["did"] == peer.did and p.get("connected") and p.get("interests") == expected
                       for p in await node.peers())

        b_wants = {"mode": "selective", "classes": [], "tags": ["x"], "senders": [], "topics": []}
        r_wants = {"mode": "everything", "classes": [], "tags": [], "senders": [], "topics": []}

        async def all_connected_and_declared():
            return (all([len(await n.connected()) >= 2 for n in mesh])
                    and await declared_to(a, b, b_wants) and await declared_to(r, b, b_wants)
                    and await declared_to(a, r, r_wants) and await declared_to(b, r, r_wants))

        await wait_for(all_connected_and_declared, 40, "the three nodes connected, each knowing B's and R's interests")
        assert (await b.client.interests())["interests"] == b_wants

        await wait_for(lambda: hold_all(b, [held_x]), 30, "B to catch up on the X held by its peers")
        ys = [held_y] + [(await a.client.create("note", {"text": f"y{i}"}, broadcast=True, tags=["y"]))["did"]
                         for i in range(3)]
        xs = [held_x] + [(await a.client.create("note", {"text": f"x{i}"}, broadcast=True, tags=["x"]))["did"]
                         for i in range(3)]

        await wait_for(lambda: hold_all(r, ys + xs), 30, "the relay to hold X and Y")
        await wait_for(lambda: hold_all(b, xs), 30, "B to hold the X containers")
        # R holds Y and is connected to B: only B's interests keep Y from it (from A and from R)
        assert not any([await b.holds(d) for d in ys])
        for peer in (a, r):
            assert (await peer.client.status())["mesh"]["counters"]["interests_filtered"] > 0
        assert (await b.client.list(tag="y"))["items"] == []
        # a change of a Y container (an evaluation: container_delta `modified`, 32.1) is not an
        # offer of it to B either: R gets the entry (and asks for the block), B gets nothing
        before = (await b.client.status())["mesh"]["counters"].get("delta_modified_received", 0)
        await a.client.evaluate(ys[1], "usefulness", 0.5)

        async def r_has_the_evaluation():
            return any(i["agent_did"] == a.did for i in (await r.client.evaluations(ys[1])).get("items") or [])

        await wait_for(r_has_the_evaluation, 30, "A's evaluation of a Y container at R")
        assert (await b.client.status())["mesh"]["counters"].get("delta_modified_received", 0) == before
        assert not await b.holds(ys[1])

        # B now wants Y too (CLI add): the new ones arrive, and so do the ones its peers held already
        added = await asyncio.to_thread(hmp, "interests", "add", "--tag", "y", "--data-dir", str(b.proc.data_dir),
                                        env=mesh_env())
        assert added.returncode == 0, added.stderr.decode()
        assert json.loads(added.stdout)["interests"]["tags"] == ["x", "y"]
        b_wants_more = {**b_wants, "tags": ["x", "y"]}
        await wait_for(lambda: declared_to(a, b, b_wants_more), 20, "A to learn B's new interests")
        later = (await a.client.create("note", {"text": "y-later"}, broadcast=True, tags=["y"]))["did"]
        await wait_for(lambda: hold_all(b, [later, *ys]), 30, "B to get Y, new and held, once it wants it")

        # and back to its configuration (API): new Y is kept from it again
        reset = await b.client.reset_interests()
        assert reset["source"] == "config" and reset["interests"] == b_wants
        await wait_for(lambda: declared_to(a, b, b_wants), 20, "A to learn B's interests are X again")
        await wait_for(lambda: declared_to(r, b, b_wants), 20, "R to learn B's interests are X again")
        y_after = (await a.client.create("note", {"text": "y-after"}, broadcast=True, tags=["y"]))["did"]
        x_after = (await a.client.create("note", {"text": "x-after"}, broadcast=True, tags=["x"]))["did"]
        await wait_for(lambda: hold_all(r, [y_after, x_after]), 30, "the relay to hold both")
        await wait_for(lambda: hold_all(b, [x_after]), 30, "B to get the new X")
        assert not await b.holds(y_after)
    finally:
        for n in mesh:
            await n.close()


async def test_interests_api_refuses_bad_declarations(nodes, tmp_path):
    from hmpnode.client import ApiError

    node = MeshNode(nodes(tmp_path / "n", env=mesh_env(HMPNODE_INTERESTS_MAX_ENTRIES="2")))
    try:
        for body, field in (({"tags": ["a", "b", "c"]}, "tags"), ({"senders": ["x"]}, "senders"),
                            ({"mode": "all"}, "mode"), ({"colour": []}, "colour")):
            try:
                await node.client.request("PUT", "/v1/interests", body=body)
            except ApiError as exc:
                assert exc.status == 400 and exc.reason == "bad_interests" and exc.detail.startswith(field), exc
            else:
                raise AssertionError(f"{body} was taken")
        shown = await node.client.interests()
        assert shown == {"interests": {"mode": "selective", "classes": [], "tags": [], "senders": [], "topics": []},
                         "everything": True, "source": "config"}
        set_ = await node.client.set_interests(topics=["ethics"], classes=["goal"])
        assert set_["source"] == "api" and set_["interests"]["topics"] == ["ethics"] and not set_["everything"]
        bad = await asyncio.to_thread(hmp, "interests", "set", "--sender", "bob", "--data-dir", str(node.proc.data_dir),
                                      env=mesh_env())
        assert bad.returncode == 2 and b"bad_interests" in bad.stderr  # a value the node calls malformed
        cleared = await asyncio.to_thread(hmp, "interests", "clear", "--tag", "x", "--data-dir",
                                          str(node.proc.data_dir), env=mesh_env())
        assert cleared.returncode != 0 and b"go with set or add" in cleared.stderr

        # the API's declaration outlives a restart; an unreadable file falls back to [interests]
        env = mesh_env(HMPNODE_INTERESTS_MAX_ENTRIES="2", HMPNODE_INTERESTS_TAGS="cfg")
        for saved, expected in ((None, (set_["interests"], "api")), (b"{not json", (None, "config"))):
            await node.close()
            assert node.proc.stop() == 0
            if saved is not None:
                (node.proc.data_dir / "interests.json").write_bytes(saved)
            node = MeshNode(nodes(node.proc.data_dir, env=env))
            shown = await node.client.interests()
            assert shown["source"] == expected[1]
            assert shown["interests"] == (expected[0] or {**set_["interests"], "topics": [], "classes": [],
                                                          "tags": ["cfg"]})
        # reset: back to the configuration, the file is gone
        (node.proc.data_dir / "interests.json").unlink()
        await node.client.set_interests(tags=["x"])
        assert (await node.client.reset_interests())["interests"]["tags"] == ["cfg"]
        assert not (node.proc.data_dir / "interests.json").exists()
        # changes are budgeted (half of interests.queries_per_minute: burst 3), so peers never strike us
        await node.client.set_interests(tags=["y"])
        try:
            await node.client.set_interests(tags=["z"])
        except ApiError as exc:
            assert exc.status == 429 and exc.reason == "rate_limited"
        else:
            raise AssertionError("a fourth change in a row was taken")
        assert (await node.client.interests())["interests"]["tags"] == ["y"]
        assert 'hmpnode_refused_total{area="api",reason="interests_rate_limited"} 1' in await node.client.metrics()
    finally:
        await node.close()


async def test_declared_topics_are_dht_records_and_their_followers_are_dialled(nodes, tmp_path):
    """No LAN, no dialling of its own: the reader meets the author only through the
    author's topic record (from [interests] topics), looked up when the reader declares it."""
    seed, author, reader = dht_trio(nodes, tmp_path, HMPNODE_INTERESTS_TOPICS="chess")
    try:
        async def members(node, topic):
            return (await node.client.request("GET", f"/v1/dht/topics/{topic}"))["members"]

        assert await wait_for(lambda: members(reader, "chess"), 30, "the author's topic record") == [author.did]
        assert author.did not in await reader.connected()
        await reader.client.set_interests(topics=["chess"])
        await wait_for(lambda: _has(reader.connected(), author.did), 30, "the reader to dial the topic's follower")
        await wait_for(lambda: _has(members(author, "chess"), reader.did), 30, "the reader's own topic record")
        assert (await reader.client.status())["mesh"]["counters"]["topic_peers_found"] >= 1
        # the author's broadcasts on the topic reach it, others do not
        off = (await author.client.create("note", {"text": "go"}, broadcast=True, tags=["go"]))["did"]
        on = (await author.client.create("note", {"text": "e4"}, broadcast=True, tags=["chess"]))["did"]
        await wait_for(lambda: reader.holds(on), 30, "the broadcast on the topic")
        assert not await reader.holds(off)
    finally:
        for n in (seed, author, reader):
            await n.close()


async def _has(members, did: str) -> bool:
    return did in await members


async def test_what_interests_kept_from_a_node_is_seen_at_its_peer_once_and_in_the_peer_index(nodes, tmp_path):
    """B declares tag x; A broadcasts an x and a y. B gets the x only. The y is not lost
    silently: A counts it against B (`interests_withheld` in /v1/peers, the metric),
    once however often a reconciliation finds B still lacks it, and B sees it listed in
    A's index (the index is not filtered by interests)."""
    a = MeshNode(nodes(tmp_path / "a", env=mesh_env()))
    b = MeshNode(nodes(tmp_path / "b", env=mesh_env()))
    try:
        await wait_for(lambda: _has(a.connected(), b.did), 40, "A and B connected")
        await b.client.set_interests(tags=["x"])

        async def b_at_a():
            return next((p for p in await a.peers() if p["did"] == b.did and p.get("connected")), None)

        async def declared():
            peer = await b_at_a()
            return peer is not None and (peer.get("interests") or {}).get("tags") == ["x"]

        await wait_for(declared, 20, "A to learn what B declared")
        y = (await a.client.create("note", {"text": "y"}, broadcast=True, tags=["y"]))["did"]
        x = (await a.client.create("note", {"text": "x"}, broadcast=True, tags=["x"]))["did"]
        await wait_for(lambda: b.holds(x), 30, "B to get the x")
        assert not await b.holds(y)
        assert (await b_at_a())["interests_withheld"] == 1

        # a new declaration (still not y) makes B reconcile with A, which finds y again
        done = (await b.client.status())["mesh"]["counters"].get("sync_done", 0)
        await b.client.set_interests(tags=["x", "z"])

        async def reconciled():
            return (await b.client.status())["mesh"]["counters"].get("sync_done", 0) > done

        await wait_for(reconciled, 30, "B's reconciliation with A after its new declaration")
        assert not await b.holds(y)
        peer = await b_at_a()
        assert peer["interests"]["tags"] == ["x", "z"] and peer["interests_withheld"] == 1
        counted = (await a.client.status())["mesh"]["counters"]["interests_filtered"]
        assert f"hmpnode_interests_withheld_total {counted}" in (await a.client.metrics()).splitlines()
        assert counted >= 1
        # the receiver's own view: its declaration, and what its peer holds that it was not sent
        assert (await b.client.interests())["everything"] is False
        assert y in (await b.client.peer_index(a.did, tag="y"))["entries"]
    finally:
        for n in (a, b):
            await n.close()
