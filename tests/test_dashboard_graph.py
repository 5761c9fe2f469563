"""The dashboard's pictures: the mesh as a graph (GET /v1/mesh/graph) and the charts of the
last hour (GET /v1/history, hmpnode.api.history), as pure functions, on real nodes, and in
the system's Chromium (the helpers of tests/test_dashboard.py).

Screenshots of the two panels at 1400 and 390 px go to $HMPNODE_TEST_ARTIFACTS/dashboard
(or <repo>/.artifacts/dashboard, git-ignored), kept for a person to look at.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hmpnode.api.history import MAX_POINTS, OTHER, History, Sample
from hmpnode.net.views import GRAPH_MAX_NODES, GraphPeer, build_graph
from tests.meshutil import mesh_env
from tests.test_dashboard import _browser_or_skip, _browser_page, _started, _until, artifacts_dir

REPO = Path(__file__).resolve().parent.parent
#: the history's interval in the real-node tests (api.history_interval_ms)
FAST = {"HMPNODE_API_HISTORY_INTERVAL_MS": "500"}


def _did(n: int) -> str:
    return f"did:hmp:agent:xxxxxxxxxxpeer{n:04d}"


# -- the history, sans-IO ---------------------------------------------------------------------


def _sample(inn=0, out=0, peers=0, refusals=None) -> Sample:
    return Sample({"containers_in": inn, "containers_out": out},
                  {"peers_connected": peers, "relay_held": 0, "outbox_held": 0, "loop_lag_seconds": 0.0},
                  refusals or {})


def test_history_rates_are_counter_deltas_over_the_time_between_samples():
    h = History(5.0)
    h.record(100.0, _sample(inn=7, out=3, peers=1))
    h.record(105.0, _sample(inn=57, out=13, peers=2))
    h.record(115.0, _sample(inn=57, out=33, peers=2))
    view = h.view(120.0)
    assert view["ago_seconds"] == [20.0, 15.0, 5.0]
    assert view["series"]["containers_in"] == [None, 10.0, 0.0]  # nothing to divide by at first
    assert view["series"]["containers_out"] == [None, 2.0, 2.0]
    assert view["series"]["peers_connected"] == [1.0, 2.0, 2.0]


def test_history_counts_a_counter_that_went_down_as_reset():
    h = History(5.0)
    h.record(0.0, _sample(inn=500, refusals={"peer/too_fast": 40}))
    h.record(5.0, _sample(inn=20, refusals={"peer/too_fast": 10}))  # a restarted source: 20 since
    view = h.view(5.0)
    assert view["series"]["containers_in"] == [None, 4.0]
    assert view["refusals_per_second"] == {"peer/too_fast": [0.0, 2.0]}


def test_history_without_time_passing_has_no_rate():
    h = History(5.0)
    h.record(10.0, _sample(inn=1))
    h.record(10.0, _sample(inn=9))
    h.record(9.0, _sample(inn=12))
    h.record(14.0, _sample(inn=32))
    assert h.view(14.0)["series"]["containers_in"] == [None, None, None, 4.0]


def test_history_is_bounded_in_points_and_in_reasons():
    h = History(5.0, top=3)
    for i in range(MAX_POINTS + 500):
        # 40 reasons, each growing at its own pace: far more than a point keeps
        h.record(i * 5.0, _sample(inn=i, refusals={f"peer/r{k:02d}": i * (k + 1) for k in range(40)}))
    assert len(h.points) == MAX_POINTS
    assert all(len(reasons) <= 3 + 1 for _, _, reasons in h.points)
    view = h.view((MAX_POINTS + 499) * 5.0)
    assert len(view["ago_seconds"]) == MAX_POINTS and view["ago_seconds"][-1] == 0.0
    assert view["window_seconds"] == MAX_POINTS * 5.0
    assert all(len(v) == MAX_POINTS for v in view["series"].values())
    # the busiest three by name, every other one in "other"
    assert list(view["refusals_per_second"]) == ["peer/r39", "peer/r38", "peer/r37", OTHER]
    assert view["refusals_per_second"]["peer/r39"][-1] == 40 / 5
    assert view["refusals_per_second"][OTHER][-1] == pytest.approx(sum(k + 1 for k in range(37)) / 5)


def test_history_refuses_a_useless_shape():
    for bad in ({"interval": 0}, {"interval": 1, "points": 0}, {"interval": 1, "top": -1}):
        with pytest.raises(ValueError):
            History(bad.pop("interval"), **bad)


# -- the graph, sans-IO -----------------------------------------------------------------------


def _links(graph) -> set[tuple[str, str, str]]:
    return {(link["from"], link["to"], link["state"]) for link in graph["links"]}


def test_graph_places_peers_by_closeness_and_colours_links_by_state():
    me, a, b, c, d, relay, mailman = (_did(i) for i in range(7))
    graph = build_graph(
        GraphPeer(me, mailman=[a]), ["relay"],
        connected=[GraphPeer(a, ["relay", "mailman"]), GraphPeer(b, (), mailman=[mailman], via=a)],
        table=[GraphPeer(a, ["relay"]), GraphPeer(d, (), addresses=[f"relay://127.0.0.1:9/{relay}", "tcp://1.2.3.4:5"],
                                                  last_seen_us=5)],
        dialling=[c, a, me], banned=["203.0.113.9", b, c])  # each peer once, in its closest state
    nodes = {n["id"]: n for n in graph["nodes"]}
    assert nodes[me]["self"] and nodes[me]["ring"] == 0 and nodes[me]["roles"] == ["relay"]
    assert {k: nodes[k]["ring"] for k in (a, b, c, "203.0.113.9", d, relay, mailman)} == {
        a: 1, b: 1, c: 1, "203.0.113.9": 1, d: 2, relay: 2, mailman: 2}
    assert nodes[a]["roles"] == ["mailman", "relay"] and nodes[a]["our_mailman"]  # the session's announce wins
    assert nodes["203.0.113.9"]["did"] is None and nodes[c]["label"] == "…peer0003"
    assert _links(graph) == {
        (me, a, "connected"), (me, b, "connected"), (me, c, "dialling"), (me, "203.0.113.9", "banned"),
        (me, d, "known"), (b, mailman, "reported"), (d, relay, "reported")}
    assert [link.get("via") for link in graph["links"] if link["to"] == b] == [a]
    assert not graph["truncated"] and graph["omitted"] == 0


def test_graph_is_bounded_closest_first():
    me = _did(9999)
    connected = [GraphPeer(_did(i), mailman=[_did(1000 + i)]) for i in range(30)]
    table = [GraphPeer(_did(2000 + i), last_seen_us=i) for i in range(300)]
    graph = build_graph(GraphPeer(me), [], connected=connected, table=table, dialling=[], banned=[], limit=50)
    ids = [n["id"] for n in graph["nodes"]]
    assert len(ids) == 50 and graph["truncated"] and graph["omitted"] == 30 + 30 + 300 - 49
    assert ids[:31] == [me, *sorted(p.did for p in connected)]  # the sessions before anything else
    assert all(link["from"] in ids and link["to"] in ids for link in graph["links"])
    # the table's most recently seen rows come before the older ones
    table_ids = [i for i in ids if i >= _did(2000)]
    assert table_ids == sorted(table_ids, reverse=True)
    assert len(build_graph(GraphPeer(me), [], connected=connected, table=table, dialling=[], banned=[])["nodes"]) \
        == GRAPH_MAX_NODES


# -- on real nodes ----------------------------------------------------------------------------


@pytest.fixture
def pair(nodes, tmp_path):
    """Two real nodes on loopback, a connected to b (and b's process); the history samples every 0.5 s."""
    a = _started(nodes(tmp_path / "a", env=mesh_env(**FAST)))
    b_proc = nodes(tmp_path / "b", env=mesh_env(**FAST))
    b = _started(b_proc)

    def graph():
        status, _, raw = a.call("GET", "/v1/mesh/graph")
        assert status == 200, raw
        found = json.loads(raw)
        return found if {"from": a.did, "to": b.did, "state": "connected"} in found["links"] else None

    return a, b, _until(graph, 30, "b connected in a's graph"), b_proc


def test_graph_and_history_endpoints_on_two_real_nodes(pair):
    a, b, graph, b_proc = pair
    nodes = {n["id"]: n for n in graph["nodes"]}
    assert nodes[a.did]["self"] and nodes[b.did]["ring"] == 1 and nodes[b.did]["did"] == b.did
    assert graph["truncated"] is False
    status, _, raw = a.call("GET", "/v1/mesh/graph?limit=1")
    assert status == 200 and [n["id"] for n in json.loads(raw)["nodes"]] == [a.did] and json.loads(raw)["truncated"]
    for bad, reason in (("limit=0", "bad_request"), (f"limit={GRAPH_MAX_NODES + 1}", "bad_request"),
                        ("nope=1", "unknown_field")):
        status, _, raw = a.call("GET", f"/v1/mesh/graph?{bad}")
        assert status == 400 and json.loads(raw)["reason"] == reason, (bad, raw)
    for path in ("/v1/mesh/graph", "/v1/history"):
        assert a.call("GET", path, auth=False)[0] == 401

    def history():
        status, _, raw = a.call("GET", "/v1/history")
        assert status == 200, raw
        found = json.loads(raw)
        return found if any(found["series"]["peers_connected"]) and len(found["ago_seconds"]) >= 3 else None

    view = _until(history, 30, "a few points with b connected")
    assert view["interval_seconds"] == 0.5 and view["max_points"] == MAX_POINTS
    assert set(view["series"]) == {"containers_in", "containers_out", "peers_connected", "relay_held",
                                   "outbox_held", "loop_lag_seconds"}
    assert all(len(v) == len(view["ago_seconds"]) for v in view["series"].values())
    assert view["ago_seconds"] == sorted(view["ago_seconds"], reverse=True)
    assert 1.0 in view["series"]["peers_connected"]
    assert any(view["series"]["loop_lag_seconds"])  # a 0.1 s timer is always a little late
    # sent once a's history has points: a container that came before the first point is in
    # its baseline (a rate needs two points), not in any rate
    sent = b.send({"text": "to be carried"}, broadcast=True)  # it crosses: a's "in" counter moves

    def carried():
        found = json.loads(a.call("GET", "/v1/history")[2])
        return any(v for v in found["series"]["containers_in"] if v)

    _until(lambda: a.call("GET", f"/v1/containers/{sent}")[0] == 200, 30, "b's container at a")
    _until(carried, 10, "b's container counted in a's containers_in")

    # a refusal (the interests changed faster than peers take them) shows under its reason
    answers = [a.call("PUT", "/v1/interests", {"tags": [f"t{i}"]})[0] for i in range(30)]
    assert 429 in answers, answers

    def refused():
        found = json.loads(a.call("GET", "/v1/history")[2])["refusals_per_second"]
        return any(found.get("api/interests_rate_limited", ()))

    _until(refused, 30, "the refusal in a's history")

    # b goes away: it stays in a's peers table, no longer connected
    assert b_proc.stop() == 0

    def gone():
        links = json.loads(a.call("GET", "/v1/mesh/graph")[2])["links"]
        return [link["state"] for link in links if link["to"] == b.did and link["state"] != "connected"]

    assert _until(gone, 30, "b not connected in a's graph")[0] in ("known", "dialling")


def test_history_interval_is_a_checked_setting(nodes, tmp_path):
    from tests.nodeproc import hmp, node_env

    proc = hmp("run", "--data-dir", str(tmp_path / "bad"), env=node_env(HMPNODE_API_HISTORY_INTERVAL_MS="5"))
    assert proc.returncode == 2, proc.stderr
    assert b"history_interval_ms" in proc.stderr and b"Traceback" not in proc.stderr


def test_graph_and_charts_panels_in_a_headless_browser(pair):
    _browser_or_skip()
    a, b, _, _ = pair
    shots = artifacts_dir()
    with _browser_page() as (page, errors):
        page.goto(f"{a.url}/#token={a.token}")
        page.wait_for_selector(f"#mesh-graph g.gnode.self[data-id='{a.did}']")
        page.wait_for_selector(f"#mesh-graph g.gnode[data-id='{b.did}']")
        line = page.locator(f"#mesh-graph line.link[data-to='{b.did}']")
        assert line.get_attribute("data-state") == "connected"
        assert b.did[-8:] in page.text_content(f"#mesh-graph g.gnode[data-id='{b.did}']")
        assert "connected" in page.text_content("#graph-panel .legend")
        page.wait_for_selector("#charts path.series[data-series='peers']", state="attached")  # 2 points: drawn
        assert page.locator("#charts figure.chart").count() == 5
        assert page.locator("#charts svg.chart-svg").count() >= 4  # refusals may say "nothing refused"
        box = page.locator("#mesh-graph").bounding_box()
        assert box is not None and box["width"] > 200 and box["height"] > 200
        for width in (1400, 390):
            page.set_viewport_size({"width": width, "height": 900})
            for panel in ("graph-panel", "charts-panel"):
                target = page.locator(f"#{panel}")
                target.scroll_into_view_if_needed()
                # what is drawn, legend included, fits its panel (no scrolling inside it)
                assert target.evaluate("(p) => p.scrollWidth <= p.clientWidth && p.scrollHeight <= p.clientHeight"), \
                    (panel, width)
                target.screenshot(path=str(shots / f"{panel}-{width}.png"))
                assert (shots / f"{panel}-{width}.png").stat().st_size > 1000
        assert not errors, errors


def test_graph_panel_says_nothing_yet_alone(nodes, tmp_path):
    """A node with no peer at all: the graph is this node and a note; the charts say nothing yet."""
    _browser_or_skip()
    alone = {"HMPNODE_PEER_LAN_DISCOVERY": "false", "HMPNODE_PEER_DHT": "false", "HMPNODE_PEER_TARGET_PEERS": "0",
             "HMPNODE_API_HISTORY_INTERVAL_MS": "60000"}  # no point while the page looks
    api = _started(nodes(tmp_path / "node", env=mesh_env(**alone)))
    with _browser_page() as (page, errors):
        page.goto(f"{api.url}/#token={api.token}")
        page.wait_for_selector("#graph-note:has-text('nothing yet')")
        assert page.locator("#mesh-graph g.gnode").count() == 1
        page.wait_for_selector("#charts figure.chart")
        assert page.locator("#charts p.empty:has-text('nothing yet')").count() == 5
        # ~50 nodes (the size the layout is meant for): every one drawn, no two overlapping
        connected = [GraphPeer(_did(i), ["relay"] if i % 4 == 0 else [], mailman=[_did(100 + i)] if i % 2 else [])
                     for i in range(14)]
        table = [GraphPeer(_did(200 + i), last_seen_us=i) for i in range(28)]
        big = build_graph(GraphPeer(_did(999)), [], connected=connected, table=table, dialling=[_did(300)],
                          banned=["198.51.100.7"])
        assert len(big["nodes"]) == 52  # this node, 14 + 2 in ring 1, 7 + 28 in ring 2
        page.evaluate("(g) => drawMeshGraph(g)", big)
        assert page.locator("#mesh-graph g.gnode").count() == 52
        overlaps = page.evaluate("""() => {
            const boxes = [...document.querySelectorAll('#mesh-graph g.gnode circle')].map((c) => c.getBoundingClientRect());
            let n = 0;
            boxes.forEach((a, i) => boxes.slice(i + 1).forEach((b) => {
                if (a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom) n += 1; }));
            return n; }""")
        assert overlaps == 0
        page.set_viewport_size({"width": 1400, "height": 900})
        page.locator("#graph-panel").screenshot(path=str(artifacts_dir() / "graph-panel-50-nodes-1400.png"))
        assert not errors, errors
