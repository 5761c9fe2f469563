"""Forget, enforced scopes and content-free plans (issue 12, part B), through the agent
API of a real Node (in process), and with real node processes for restarts, kill -9 and
a peer that hands a forgotten container back."""

from __future__ import annotations

import base64
import binascii
import itertools
import zlib

import orjson
import pytest

from hmpnode.container.build import build_container
from hmpnode.container.evaluations import build_evaluation
from hmpnode.identity import Identity
from hmpnode.node import Node
from tests.conftest import NOW, Clock
from tests.meshutil import MeshNode, mesh_env, wait_for
from tests.test_api import Api, make_api  # noqa: F401 - make_api is a fixture

PEER = Identity(bytes([44]) * 32)


@pytest.fixture
async def agent(make_api) -> Api:  # noqa: F811 - the fixture imported above
    """The agent API of a real Node (tests/test_api.py)."""
    return await make_api()
BUDGET = {"max_tokens": 100_000, "max_bytes": 1_000_000}


async def remember(agent: Api, text: str, **fields) -> str:
    return (await agent.create("note", {"text": text}, **fields))["did"]


async def recalled(agent: Api, query: str, **fields) -> list[str]:
    status, env = await agent.post("/v1/recall", {"query": query, **BUDGET, **fields, "why": True})
    assert status == 200, env
    return [w["did"] for w in env["why"]]  # the full DIDs of the items, in order (compact items carry short ids)


async def searched(agent: Api, q: str, **params) -> list[str]:
    status, found = await agent.get("/v1/search", params={"q": q, **params})
    assert status == 200, found
    return [i["did"] for i in found["items"]]


def gone(status: int, body) -> bool:
    """410 with the stable error body and nothing of the content."""
    return status == 410 and set(body) == {"reason", "detail"} and body["reason"] == "gone" \
        and "zebra" not in body["detail"] and "did:" not in body["detail"]


async def test_a_forgotten_memory_is_gone_from_every_read_path(agent, tmp_path):
    keep = await remember(agent, "the zebra gate code is 1111")
    secret = await remember(agent, "the zebra vault code is 4242")
    peer_copy = build_container(PEER, "note", {"text": "zebra vault is behind the third door"}, now=NOW)
    status, out = await agent.post("/v1/containers/import", peer_copy)
    assert status == 201, out
    await agent.node.evaluate(secret, type_="accuracy", value=0.5)
    plan_status, plan = await agent.post("/v1/recall/plan", {"query": "zebra vault code", **BUDGET, "why": True})
    assert plan_status == 200 and secret in str(plan["receipt"])

    status, counts = await agent.post("/v1/forget", {"did": secret})
    assert status == 200 and counts == {"forgotten": 1, "tombstoned": 1, "already_forgotten": 0}

    for path in ("", "/versions", "/referenced-by", "/evaluations"):
        assert gone(*await agent.get(f"/v1/containers/{secret}{path}")), path
    assert gone(*await agent.post(f"/v1/containers/{secret}/evaluations", {"type": "accuracy", "value": 1}))
    assert gone(*await agent.post("/v1/scopes/task:t1/accept", {"did": secret}))
    assert secret not in await searched(agent, "zebra vault code")
    assert secret not in await recalled(agent, "zebra vault code")
    assert secret not in await recalled(agent, "zebra vault code", include_contested=True)
    assert keep in await recalled(agent, "zebra gate code")  # the rest stays
    assert gone(*await agent.post("/v1/recall/resolve", {"plan": plan["plan"]}))
    status, page = await agent.get("/v1/containers", params={"limit": "100"})
    assert secret not in [i["did"] for i in page["items"]]
    # the store keeps no row, no index text, no evaluation of it
    conn_rows = await agent.node.db.read(lambda c: (
        c.execute("SELECT COUNT(*) FROM containers WHERE did = ?", (secret,)).fetchone()[0],
        c.execute("SELECT COUNT(*) FROM search WHERE search MATCH '\"4242\"'").fetchone()[0],
        c.execute("SELECT COUNT(*) FROM evaluations WHERE container = ?", (secret,)).fetchone()[0]))
    assert conn_rows == (0, 0, 0)
    assert (await agent.get("/v1/status"))[1]["store"]["tombstones"] == 1
    # idempotent; a DID never held is not tombstoned on a guess
    assert await agent.post("/v1/forget", {"did": secret}) == (200, {"forgotten": 0, "tombstoned": 0,
                                                                   "already_forgotten": 1})
    status, body = await agent.post("/v1/forget", {"did": "did:hmp:container:QmNeverHeldNeverHeldNeverHeldNeverHeld1"})
    assert status == 404 and body["reason"] == "not_found"


async def test_a_forgotten_container_handed_back_is_refused_and_not_stored(agent):
    container = build_container(PEER, "note", {"text": "walrus migration notes"}, now=NOW, broadcast=True)
    did = container["hmp_container"]["head"]["container_did"]
    assert (await agent.post("/v1/containers/import", container))[0] == 201
    assert (await agent.post("/v1/forget", {"did": did}))[0] == 200
    results = await agent.node.ingest([container], source=f"peer:{PEER.did}")
    assert (results[0].status, results[0].reason) == ("rejected", "forgotten")
    status, body = await agent.post("/v1/containers/import", container)
    assert status == 422 and body["reason"] == "forgotten"
    assert gone(*await agent.get(f"/v1/containers/{did}"))
    assert (await agent.get("/v1/status"))[1]["refused"] == {"peer:forgotten": 1, "import:forgotten": 1}


async def test_forget_by_source_and_by_scope(agent):
    a1 = await remember(agent, "okapi handbook says feed at noon", source="doc:okapi-handbook")
    a2 = await remember(agent, "okapi handbook says water at dusk", source="doc:okapi-handbook")
    other = await remember(agent, "okapi keeper says feed at one", source="tool:keeper")
    s1 = await remember(agent, "okapi task note one", scope="task:t9")
    s2 = await remember(agent, "okapi task note two", scope="task:t9", source="tool:keeper")
    assert set(await recalled(agent, "okapi")) == {a1, a2, other, s1, s2}

    assert await agent.post("/v1/forget", {"source": "doc:okapi-handbook"}) == \
        (200, {"forgotten": 2, "tombstoned": 2, "already_forgotten": 0})
    assert set(await recalled(agent, "okapi")) == {other, s1, s2}
    assert await agent.post("/v1/forget", {"scope": "task:t9"}) == \
        (200, {"forgotten": 2, "tombstoned": 2, "already_forgotten": 0})
    assert await recalled(agent, "okapi") == [other]
    for did in (a1, a2, s1, s2):
        assert gone(*await agent.get(f"/v1/containers/{did}"))
    # a source or scope with nothing in it is no error
    assert await agent.post("/v1/forget", {"source": "doc:okapi-handbook"}) == \
        (200, {"forgotten": 0, "tombstoned": 0, "already_forgotten": 0})


@pytest.mark.parametrize("body", [
    {}, {"did": "x"}, {"did": "did:hmp:container:Qm1", "source": "a"}, {"source": ""}, {"scope": 5},
    {"scope": "a\nb"}, {"source": "s" * 257}, {"what": "ever"}, {"scope": "task/t1"},
])
async def test_forget_refuses_bad_input_with_a_reason(agent, body):
    status, out = await agent.post("/v1/forget", body)
    assert 400 <= status < 500 and out["reason"] in ("bad_request", "bad_did", "unknown_field"), out


async def test_another_scope_never_leaks(agent):
    mine = await remember(agent, "ibex trail opens at dawn", scope="task:a")
    theirs = await remember(agent, "ibex trail closes at dusk", scope="task:b")
    loose = await remember(agent, "ibex trail is steep")
    assert set(await recalled(agent, "ibex trail")) == {mine, theirs, loose}  # without a scope: as before
    assert await recalled(agent, "ibex trail", scope="task:a") == [mine]
    assert await searched(agent, "ibex trail", scope="task:b") == [theirs]
    assert await recalled(agent, "ibex trail", scope="task:none") == []
    status, plan = await agent.post("/v1/recall/plan", {"query": "ibex trail", "scope": "task:a", **BUDGET,
                                                         "why": True})
    assert status == 200 and [w["did"] for w in plan["receipt"]["why"]] == [mine]
    status, env = await agent.post("/v1/recall/resolve", {"plan": plan["plan"]})
    assert status == 200 and [w["did"] for w in env["why"]] == [mine]
    # the planned item leaves the scope (its scope is forgotten): the plan is not served
    assert (await agent.post("/v1/forget", {"scope": "task:a"}))[0] == 200
    status, body = await agent.post("/v1/recall/resolve", {"plan": plan["plan"]})
    assert status == 410 and body["reason"] == "gone"


async def answers(agent: Api, scope: str) -> list[bytes]:
    """The raw bytes of scoped recall (one step, "why", a plan and its resolution, explain)
    and search answers for a few queries."""
    out = []
    for query in ("vault zebra", "vault code", "where is the blue ledger kept", "ledger"):
        for body in ({"why": True}, {}, {"explain": True}):
            out.append(await agent.raw("POST", "/v1/recall", {"query": query, "scope": scope, **BUDGET, **body}))
        plan = await agent.raw("POST", "/v1/recall/plan", {"query": query, "scope": scope, **BUDGET, "why": True})
        out += [plan, await agent.raw("POST", "/v1/recall/resolve", {"plan": orjson.loads(plan)["plan"]})]
        out.append(await agent.raw("GET", "/v1/search", params={"q": query, "scope": scope}))
    return out


async def test_a_scoped_answer_does_not_depend_on_what_other_scopes_hold(agent):
    """Word weights and BM25 statistics come from the scope alone: 40 notes about zebras in
    another scope (and a few in none), stored and then forgotten, change no byte of the
    answers in `s:a` (before, "vault zebra" abstained in s:a until s:b had zebras, and search
    scores moved with every memory stored anywhere: another scope's words could be probed)."""
    for text in ("the vault code is kept in the blue ledger", "the blue ledger sits on the third shelf",
                 "the vault door opens at nine", "ledger audit every friday"):
        await remember(agent, text, scope="s:a")
    before = await answers(agent, "s:a")
    assert orjson.loads(before[0])["abstain"] == "no_relevant_match"  # "vault zebra": zebra weighs the most
    for i in range(40):
        await remember(agent, f"zebra {i} grazes by the vault near the ledger", scope="s:b")
    for i in range(8):
        await remember(agent, f"the code of zebra crossing {i} is kept in a ledger", source="doc:zoo")
    assert await answers(agent, "s:a") == before
    assert await recalled(agent, "vault zebra", scope="s:b")  # the zebras are there, in s:b
    assert (await agent.post("/v1/forget", {"scope": "s:b"}))[0] == 200
    assert (await agent.post("/v1/forget", {"source": "doc:zoo"}))[0] == 200
    assert await answers(agent, "s:a") == before


async def test_a_foreign_container_enters_a_scope_only_when_accepted(agent):
    tagged = build_container(PEER, "note", {"text": "gnu herd moves north"}, now=NOW, tags=["task:a", "scope:task:a"])
    did = tagged["hmp_container"]["head"]["container_did"]
    await agent.node.ingest([tagged], source=f"peer:{PEER.did}")
    own = await remember(agent, "gnu herd counted", scope="task:a")
    assert await recalled(agent, "gnu herd", scope="task:a") == [own]  # a peer's tags place nothing
    assert await searched(agent, "gnu herd", scope="task:a") == [own]
    status, out = await agent.post("/v1/scopes/task:a/accept", {"did": did})
    assert status == 200 and out["status"] == "accepted"
    assert set(await recalled(agent, "gnu herd", scope="task:a")) == {own, did}
    assert await recalled(agent, "gnu herd", scope="task:b") == []
    status, body = await agent.post("/v1/scopes/task:a/accept", {"did": "did:hmp:container:QmNope"})
    assert status == 404 and body["reason"] == "not_found"


async def test_the_authors_own_retraction_is_final(agent):
    claim = await remember(agent, "the yak barn is red")
    status, out = await agent.post("/v1/containers", {"class": "note", "payload": {"text": "I was wrong"},
                                                    "related": {"contradicts": [claim]}})
    assert status == 201, out
    # another agent's positive evaluations and include_contested cannot bring it back
    for seed in (50, 51, 52):
        item = build_evaluation(Identity(bytes([seed]) * 32), value=1.0, type="accuracy", target=claim, now=NOW)
        assert (await agent.post(f"/v1/containers/{claim}/evaluations", {"item": item}))[0] == 201
    assert await recalled(agent, "yak barn red") == []
    assert await recalled(agent, "yak barn red", include_contested=True) == []
    status, env = await agent.post("/v1/recall", {"query": "yak barn red", **BUDGET, "include_contested": True})
    assert env["x"] == [0, 0, 0, 0, 1] and env["abstain"] == "all_excluded"  # x: ..., retracted
    status, found = await agent.get("/v1/search", params={"q": "yak barn", "state": "retracted"})
    assert [i["did"] for i in found["items"]] == [claim]


def _readings(token: str) -> list[bytes]:
    """The token's bytes read every way we can think of: as text, base64url/base64 (with
    and without padding), hex, and inflated when any of these happens to be zlib/gzip."""
    raw = token.encode()
    out = [raw, raw.lower()]
    for part in [token, *token.split(".")]:
        for decode in (lambda t: base64.urlsafe_b64decode(t + "=" * (-len(t) % 4)),
                       lambda t: base64.b64decode(t + "=" * (-len(t) % 4)), binascii.unhexlify):
            try:
                out.append(decode(part))
            except (ValueError, binascii.Error):
                pass
    for blob in list(out):
        for wbits in (15, -15, 31):
            try:
                out.append(zlib.decompress(blob, wbits))
            except zlib.error:
                pass
    return out


async def test_a_plan_token_read_as_bytes_holds_no_query_text_and_no_did(agent):
    did = await remember(agent, "the marmot den has exit seventeen")
    query = "marmot den exit"
    status, plan = await agent.post("/v1/recall/plan", {"query": query, **BUDGET, "why": True})
    assert status == 200 and len(plan["receipt"]["why"]) == 1
    token = plan["plan"]
    readings = _readings(token)
    assert len(readings) >= 3  # it did decode (base64url at least)
    secrets = [query, "marmot", did, did.rsplit(":", 1)[1], "seventeen", "payload_hash", "query"]
    for blob, secret in itertools.product(readings, secrets):
        assert secret.encode() not in blob and secret.encode().lower() not in blob.lower(), secret
    # still a working plan, and a tampered one is refused
    status, env = await agent.post("/v1/recall/resolve", {"plan": token})
    assert status == 200 and [w["did"] for w in env["why"]] == [did]
    status, body = await agent.post("/v1/recall/resolve", {"plan": token[:10] + ("A" if token[10] != "A" else "B")
                                                         + token[11:]})
    assert status == 400 and body["reason"] == "bad_plan"


async def test_explain_has_counts_and_budgets_without_ids_or_text(agent):
    dids = [await remember(agent, f"the heron nest {i} is by the reeds") for i in range(3)]
    old = await remember(agent, "the heron nest moved")
    await agent.create("note", {"text": "the heron nest moved again"}, related={"previous_version": old})
    # (every note has both words: all five are hits, the superseded one excluded)
    status, out = await agent.post("/v1/recall", {"query": "heron nest", "max_tokens": 600, "max_bytes": 2000,
                                                "explain": True})
    assert status == 200 and set(out) == {"explain"}
    explained = out["explain"]
    text = orjson.dumps(explained).decode()
    for secret in [*dids, old, "heron", "reeds", "nest"]:
        assert secret not in text
    assert explained["considered"] == 5 and explained["excluded"]["superseded"] == 1
    assert explained["max_tokens"] == 600 and explained["max_bytes"] == 2000
    assert explained["used_bytes"] <= 2000 and explained["selected_count"] + explained["skipped_for_budget"] == 4
    status, plan = await agent.post("/v1/recall/plan", {"query": "heron nest", **BUDGET, "explain": True})
    assert status == 200 and set(plan) == {"plan", "explain"}
    assert not any(d in orjson.dumps(plan["explain"]).decode() for d in dids)
    status, body = await agent.post("/v1/recall", {"query": "heron", **BUDGET, "explain": "yes"})
    assert status == 400 and body["reason"] == "bad_request"


# -- real node processes --------------------------------------------------------------------


async def _status(node: MeshNode) -> dict:
    return await node.client.status()


@pytest.mark.parametrize("scrub", ["false", "true"])
async def test_forget_survives_kill_9_right_after_the_acknowledgement(nodes, tmp_path, scrub):
    """The node acknowledges the forget only after its transaction committed: SIGKILL right
    after the answer, restart, and the memory stays gone (and a twin stays). Without the
    scrub the answer follows the commit at once (the forget lives in the WAL alone)."""
    env = mesh_env(HMPNODE_PEER_DHT="false", HMPNODE_STORE_FORGET_SCRUB=scrub)
    node = MeshNode(nodes(tmp_path / "n", env=env))
    try:
        made = [(await node.client.create("note", {"text": f"capybara fact {i}"}, source="doc:cap"))["did"]
                for i in range(20)]
        kept = (await node.client.create("note", {"text": "capybara keeper"}))["did"]
        answer = await node.client.forget(source="doc:cap")
        node.proc.kill()  # SIGKILL, no warning, right after the acknowledgement
        assert answer == {"forgotten": 20, "tombstoned": 20, "already_forgotten": 0}
        wal = tmp_path / "n" / "hmpnode.sqlite3-wal"
        if scrub == "false":  # the restart must replay the WAL to know of the forget
            assert wal.stat().st_size > 0
    finally:
        await node.close()
    node = MeshNode(nodes(tmp_path / "n", env=env))
    try:
        for did in made:
            with pytest.raises(Exception) as err:
                await node.client.get(did)
            assert getattr(err.value, "status", None) == 410 and err.value.reason == "gone"
        found = await node.client.search("capybara")
        assert [i["did"] for i in found["items"]] == [kept]
        assert (await _status(node))["store"]["containers"] == 1
    finally:
        await node.close()


async def test_a_peer_offering_a_forgotten_container_again_is_refused(nodes, tmp_path):
    """Two real nodes: a broadcast reaches B; B forgets it; B restarts and reconciles with
    A, which still holds it and hands it back: B refuses it (forgotten), stores nothing,
    and still answers 410; later broadcasts still arrive."""
    env = mesh_env(HMPNODE_PEER_DHT="false")
    a = MeshNode(nodes(tmp_path / "a", env=env))
    b = MeshNode(nodes(tmp_path / "b", env=env))
    try:
        did = (await a.client.create("note", {"text": "tapir crossing at mile nine"}, broadcast=True))["did"]
        await wait_for(lambda: b.holds(did), 30, "the broadcast at B")
        assert (await b.client.forget(did=did))["forgotten"] == 1
        await b.close()
        assert b.proc.stop() == 0
        b = MeshNode(nodes(tmp_path / "b", env=env))

        async def refused():
            return (await _status(b))["refused"].get("peer:forgotten", 0) >= 1

        await wait_for(refused, 40, "A to hand the forgotten container back and B to refuse it")
        marker = (await a.client.create("note", {"text": "tapir marker"}, broadcast=True))["did"]
        await wait_for(lambda: b.holds(marker), 30, "a later broadcast at B")
        with pytest.raises(Exception) as err:
            await b.client.get(did)
        assert getattr(err.value, "status", None) == 410
        assert did not in [i["did"] for i in (await b.client.search("tapir crossing"))["items"]]
        assert await a.holds(did)  # A's copy is A's business
        # handing back what B forgot is no offence of A's: no strike, still connected
        assert "strike_rejected_container" not in (await _status(b))["mesh"]["counters"]
        assert a.did in await b.connected()
    finally:
        await a.close()
        await b.close()


async def test_forget_is_durable_across_a_clean_restart_in_process(tmp_path):
    clock = Clock(NOW)
    node = Node(PEER, tmp_path / "n", clock=clock)
    await node.start()
    try:
        result, container = await node.create("note", {"text": "quokka island ferry"})
        await node.forget(did=result.did)
    finally:
        await node.stop()
    node = Node(PEER, tmp_path / "n", clock=clock)
    await node.start()
    try:
        assert (await node.ingest([container]))[0].reason == "forgotten"
        assert (await node.search("quokka ferry"))["items"] == []
    finally:
        await node.stop()


async def test_a_journal_entry_is_not_forgotten_and_nothing_of_the_selection_is(agent):
    """The journal is a signed chain: forgetting one entry (alone or in a scope) is refused
    with a reason, nothing of the selection is erased, and the journal still appends."""
    status, entry = await agent.post("/v1/journal", {"text": "a pangolin entry"})
    assert status == 201, entry
    note = await remember(agent, "a pangolin note", scope="task:p")
    assert (await agent.post("/v1/scopes/task:p/accept", {"did": entry["did"]}))[0] == 200
    for body in ({"did": entry["did"]}, {"scope": "task:p"}):
        status, out = await agent.post("/v1/forget", body)
        assert status == 409 and out["reason"] == "journal_entry", out
    assert (await agent.get(f"/v1/containers/{note}"))[0] == 200
    assert (await agent.post("/v1/journal", {"text": "the next entry"}))[0] == 201
    assert (await agent.get("/v1/journal/verify"))[1]["ok"] is True


def _files_hold(data_dir, word: bytes) -> int:
    return sum(f.read_bytes().count(word) for f in data_dir.iterdir() if f.name.startswith("hmpnode.sqlite3"))


@pytest.mark.parametrize("scrub", [True, False])
async def test_forget_scrub_leaves_no_word_in_the_database_files(tmp_path, scrub):
    """With store.forget_scrub (the default) no word of the forgotten text is left in the
    database file or its WAL once the forget is acknowledged, the node still running;
    without it the words linger in dead index segments (what the scrub is for)."""
    from tests.conftest import running_node

    word = b"qxzvbnmsecret"
    async with running_node(PEER, tmp_path, forget_scrub=scrub) as node:
        for i in range(30):
            await node.create("note", {"text": f"filler note {i} about the weather"})
        result, _ = await node.create("note", {"text": f"the {word.decode()} is under the mat"})
        assert _files_hold(tmp_path, word) > 0
        await node.forget(did=result.did)
        left = _files_hold(tmp_path, word)
        assert (left == 0) if scrub else (left > 0), left
        assert (await node.search("filler weather"))["items"]  # the index still works


async def test_forget_drops_relay_holdings_outbox_and_provider_entries(tmp_path):
    """What the mesh would still send or announce for a forgotten container goes with it:
    its relay holdings, its outbox rows and its DHT provider entry (one transaction)."""
    from hmpnode.store import mesh as ms
    from tests.conftest import running_node

    async with running_node(PEER, tmp_path) as node:
        result, _ = await node.create("note", {"text": "held for others"}, broadcast=True)
        kept, _ = await node.create("note", {"text": "kept"}, broadcast=True)

        def hold(conn):
            for r in (result, kept):
                ms.relay_hold(conn, [("did:hmp:someone", r.seq, r.did, 100)])
                ms.outbox_add(conn, [(r.did, "did:hmp:someone", r.seq, 0)])
            ms.provide_add(conn, [(result.seq, result.did), (kept.seq, kept.did)], keep=10)

        await node.db.write(hold)
        await node.forget(did=result.did)

        def left(conn):
            return [conn.execute(f"SELECT did FROM {table} ORDER BY did").fetchall()
                    for table in ("relay_queue", "outbox", "dht_provide")]

        assert await node.db.read(left) == [[(kept.did,)]] * 3
