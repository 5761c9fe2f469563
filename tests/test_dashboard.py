"""The web dashboard (hmpnode/api/web, served at `/`) on a real node, in a real headless browser.

The browser is the system's Chromium (Debian package `chromium`), driven by
Playwright's Python API through `executable_path`: nothing is downloaded at test
time. Without Chromium or Playwright the browser tests skip with the reason, unless
HMPNODE_REQUIRE_BROWSER=1 (as in .ci/run), where that is a failure. HMPNODE_TEST_CHROMIUM
names another binary.

Every wait is bounded (Playwright's timeouts); the feed is given 2 s, the bound the
dashboard promises for a new container to show.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest

from hmpnode.container.build import build_container
from hmpnode.identity import Identity
from tests.meshutil import mesh_env
from tests.nodeproc import hmp, node_env

#: how long a container sent through the API may take to show in the live feed (ms)
FEED_BOUND_MS = 2000
#: any other wait for the page (ms): loading, API answers (a loaded machine is slow)
PAGE_BOUND_MS = 20_000


def _chromium() -> str | None:
    explicit = os.environ.get("HMPNODE_TEST_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _no_chromium() -> str:
    explicit = os.environ.get("HMPNODE_TEST_CHROMIUM")
    if explicit:
        return f"HMPNODE_TEST_CHROMIUM={explicit} is not an executable file"
    return "no chromium on PATH (apt-get install chromium; or set HMPNODE_TEST_CHROMIUM)"


def _browser_or_skip() -> tuple[Any, str]:
    """(playwright.sync_api module, chromium path), or skip (fail under HMPNODE_REQUIRE_BROWSER=1)."""
    problem = None
    try:
        from playwright import sync_api
    except ImportError as exc:
        sync_api, problem = None, f"playwright is not installed ({exc}); it is in the test extra"
    path = _chromium()
    if path is None and problem is None:
        problem = _no_chromium()
    if problem is not None:
        if os.environ.get("HMPNODE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"HMPNODE_REQUIRE_BROWSER=1 but {problem}")
        pytest.skip(problem)
    return sync_api, path


@contextlib.contextmanager
def _browser_page() -> Iterator[tuple[Any, list[str]]]:
    """(a page of the system's Chromium, the list its console errors and page errors go
    to). Headless, without Chromium's sandbox: it cannot start as root (CI) nor in many
    containers, and the only page loaded is the node's own."""
    sync_api, chromium = _browser_or_skip()
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, chromium_sandbox=False)
        try:
            page = browser.new_page()
            page.set_default_timeout(PAGE_BOUND_MS)
            page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
            yield page, errors
        finally:
            browser.close()


class NodeApi:
    """The real node's API over HTTP (urllib: this test has no event loop)."""

    def __init__(self, info: dict[str, Any], token: str):
        self.url = info["api"]["url"].rstrip("/")
        self.did = info["did"]
        self.token = token

    def call(self, method: str, path: str, body: Any = None, *, auth: bool = True) -> tuple[int, dict[str, str], bytes]:
        headers = {"Authorization": f"Bearer {self.token}"} if auth else {}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def send(self, payload: dict[str, Any], **fields: Any) -> str:
        status, _, raw = self.call("POST", "/v1/containers", {"class": "note", "payload": payload, **fields})
        assert status in (200, 201), raw
        return json.loads(raw)["did"]


def _started(proc) -> NodeApi:
    info = proc.wait_ready()
    return NodeApi(info, (proc.data_dir / "api.token").read_text().strip())


@pytest.fixture
def node(nodes, tmp_path) -> tuple[NodeApi, Any]:
    # debug: the access log is on, so the check that the token is in no log line means something
    proc = nodes(tmp_path / "node", "--log-level", "debug")
    return _started(proc), proc


def test_page_is_served_without_the_token_with_no_data_and_strict_headers(node):
    api, _ = node
    status, headers, body = api.call("GET", "/", auth=False)
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    csp = headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp
    assert headers["X-Frame-Options"] == "DENY" and headers["Referrer-Policy"] == "no-referrer"
    page = body.decode()
    assert api.did not in page and api.token not in page
    assert not re.search(r"<script(?![^>]*\bsrc=)", page), "inline script"
    assert not re.search(r"<[^>]*\son[a-z]+\s*=", page), "inline event handler"
    status, headers, body = api.call("GET", "/dashboard/dashboard.js", auth=False)
    assert status == 200 and headers["Content-Type"].startswith("text/javascript")
    assert headers["Content-Security-Policy"] == csp
    # only the shipped files, by name; the API itself still needs the token
    assert api.call("GET", "/dashboard/nope.js", auth=False)[0] == 404
    for path in ("/dashboard/..%2Fapi.token", "/dashboard/%2e%2e%2fnode.json", "/dashboard/../v1/status"):
        status, _, raw = api.call("GET", path, auth=False)
        assert status in (401, 404) and api.token.encode() not in raw and api.did.encode() not in raw, path
    for method, path in (("GET", "/v1/status"), ("GET", "/v1/mesh/queues"), ("POST", "/"), ("GET", "/nowhere")):
        status, _, raw = api.call(method, path, auth=False)
        assert status == 401 and json.loads(raw)["reason"] == "unauthorized", (method, path)


def test_dashboard_off_leaves_no_route_without_the_token(nodes, tmp_path):
    """api.dashboard = false: / and /dashboard/* are gone, and answer 401 like any unknown path."""
    api = _started(nodes(tmp_path / "node", env=node_env(HMPNODE_API_DASHBOARD="false")))
    for path in ("/", "/dashboard/dashboard.js"):
        status, _, raw = api.call("GET", path, auth=False)
        assert status == 401 and json.loads(raw)["reason"] == "unauthorized", path
        status, _, raw = api.call("GET", path)
        assert status == 404 and json.loads(raw)["reason"] == "not_found", path


def test_cli_prints_the_dashboard_url_with_the_token_in_the_fragment(node, tmp_path):
    api, _ = node
    proc = hmp("dashboard", "--data-dir", str(tmp_path / "node"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().strip() == f"{api.url}/#token={api.token}"
    missing = hmp("dashboard", "--data-dir", str(tmp_path / "nothing-here"))
    assert missing.returncode == 1 and b"no node is running" in missing.stderr and not missing.stdout


def test_cli_open_hands_the_browser_a_private_file_not_the_token(node, tmp_path):
    """`dashboard --open`: the browser's command line (readable by any local user) has no token."""
    api, _ = node
    seen = tmp_path / "browser-argv"
    browser = tmp_path / "fake-browser"
    browser.write_text(f'#!/bin/sh\nprintf "%s" "$*" > {seen}\n')
    browser.chmod(0o700)
    proc = hmp("dashboard", "--open", "--data-dir", str(tmp_path / "node"),
               env=node_env(BROWSER=f"{browser} %s"))
    assert proc.returncode == 0, proc.stderr
    opener = tmp_path / "node" / "dashboard-open.html"
    assert seen.read_text() == opener.as_uri()
    assert api.token not in seen.read_text()
    assert opener.stat().st_mode & 0o777 == 0o600
    assert f"url={api.url}/#token={api.token}" in opener.read_text()


def test_queues_endpoint_lists_the_outbox(node):
    api, _ = node
    # a directed container for an agent that is nowhere: it waits in the outbox
    status, _, raw = api.call("POST", "/v1/containers", {
        "class": "note", "payload": {"text": "for someone offline"},
        "encrypt_for": [{"public_key": Identity(bytes([9]) * 32).public_key_b58}]})
    assert status == 201, raw
    did = json.loads(raw)["did"]
    status, _, raw = api.call("GET", "/v1/mesh/queues?limit=5")
    assert status == 200, raw
    queues = json.loads(raw)
    assert [entry["did"] for entry in queues["outbox"]] == [did]
    assert queues["outbox"][0]["tries"] >= 0 and queues["relay"] == []
    assert api.call("GET", "/v1/mesh/queues?limit=0")[0] == 400


def test_dashboard_in_a_headless_browser(node):
    api, proc = node
    requests: list[tuple[str, dict[str, str]]] = []
    with _browser_page() as (page, errors):
        page.on("request", lambda r: requests.append((r.url, r.headers)))

        # 1. without the token: the page asks for it and fetches no data
        page.goto(api.url + "/")
        page.wait_for_selector("#login", state="visible")
        assert page.is_hidden("#app")
        assert api.did not in page.content()
        assert not [u for u, _ in requests if "/v1/" in u], requests

        # 2. with #token=: signed in, the token leaves the address bar, the feed goes live
        page.goto(f"{api.url}/#token={api.token}")
        page.reload()  # a fragment change alone does not reload the page
        page.wait_for_selector("#app", state="visible")
        page.wait_for_selector("#node-did:not(:empty)")
        assert page.text_content("#node-did") == api.did
        assert "token" not in page.url
        assert page.evaluate("sessionStorage.getItem('hmpnode.token')") == api.token
        page.wait_for_selector("#feed-state[data-state='live']")

        # 3. a container sent through the API shows in the live feed within the bound
        first = api.send({"text": "hello dashboard"}, tags=["dash"])
        page.wait_for_selector(f"#feed li[data-did='{first}']", timeout=FEED_BOUND_MS)
        reply = api.send({"text": "a reply"}, related={"in_reply_to": first})
        page.wait_for_selector(f"#feed li[data-did='{reply}']", timeout=FEED_BOUND_MS)
        assert page.text_content(f"#feed li[data-did='{reply}'] .dir") == "out"
        # one from another agent (imported; from a peer it is the same): "in"
        foreign = build_container(Identity(bytes([5]) * 32), "note", {"text": "from elsewhere"},
                                  now=datetime.now(timezone.utc).replace(microsecond=0))
        status, _, raw = api.call("POST", "/v1/containers/import", {"containers": [foreign]})
        assert status == 200 and json.loads(raw)["stored"] == 1, raw
        foreign_did = foreign["hmp_container"]["head"]["container_did"]
        page.wait_for_selector(f"#feed li[data-did='{foreign_did}']", timeout=FEED_BOUND_MS)
        assert page.text_content(f"#feed li[data-did='{foreign_did}'] .dir") == "in"

        # 4. the container view: payload, referenced-by, evaluations, the graph as SVG
        status, _, raw = api.call("POST", f"/v1/containers/{first}/evaluations", {"type": "support", "value": 0.5})
        assert status == 201, raw
        page.click(f"#feed li[data-did='{first}'] a")
        page.wait_for_selector("#container", state="visible")
        assert json.loads(page.text_content("#container-payload")) == {"text": "hello dashboard"}
        assert page.get_attribute("#container-backlinks a", "data-did") == reply
        assert "support" in page.text_content("#container-evaluations")
        page.wait_for_selector("#graph g.node.incoming")
        assert page.locator("#graph g.node").count() == 2
        assert page.locator("#graph line.edge").count() == 1
        assert page.get_attribute("#graph line.edge", "data-type") == "in_reply_to"
        box = page.locator("#graph").bounding_box()
        assert box is not None and box["width"] > 100 and box["height"] > 50  # drawn, not collapsed
        page.click("#graph g.node.incoming")  # follow the link: the reply, linking out
        page.wait_for_selector("#graph g.node.outgoing")
        assert page.get_attribute("#graph g.node.center", "data-did") == reply

        # 5. journal with its state, recall, the outbox
        status, _, raw = api.call("POST", "/v1/journal", {"text": "opened the dashboard"})
        assert status == 201, raw
        page.click("#refresh")
        page.wait_for_selector("#journal li:has-text('opened the dashboard')")
        assert page.get_attribute("#journal-state", "data-state") == "ok"
        assert page.text_content("#journal-state") == "verified: 1 entries"
        page.fill("#recall-query", "hello dashboard")
        page.click("#recall-form button")
        page.wait_for_selector(f"#recall-items a[data-did='{first}']")
        assert not errors, errors

        # the token went only in the Authorization header: no URL, no log line
        api_requests = [(u, h) for u, h in requests if "/v1/" in u]
        assert api_requests
        assert all(h.get("authorization") == f"Bearer {api.token}" for _, h in api_requests)
        assert not [u for u, _ in requests if api.token in u.split("#", 1)[0]]
        assert page.context.cookies() == []

        # 6. a wrong token: back to the sign-in form, with the reason
        page.evaluate("sessionStorage.setItem('hmpnode.token', 'wrong')")
        page.reload()
        page.wait_for_selector("#login", state="visible")
        assert "refused" in page.text_content("#login-error")
        assert page.is_hidden("#app")
        # ... where the right one signs in
        page.fill("#login-token", api.token)
        page.click("#login-form button")
        page.wait_for_selector("#node-did:not(:empty)")
        assert page.is_visible("#app") and page.text_content("#node-did") == api.did
    assert "/v1/status" in proc.log()  # the access log is on ...
    assert api.token not in proc.log()  # ... and never saw the token


def _until(check, timeout: float, what: str):
    """Poll `check` (no event loop here) until it returns something true; bounded."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r:.300})")


def test_dashboard_shows_a_peer_and_what_it_sent_decrypted(nodes, tmp_path):
    """Two real nodes on loopback: a's dashboard lists b (connected, addresses, score) and
    shows b's container for a's agent as incoming, with its payload decrypted."""
    _browser_or_skip()  # before starting two nodes for nothing
    a = _started(nodes(tmp_path / "a", env=mesh_env()))
    b = _started(nodes(tmp_path / "b", env=mesh_env()))

    def connected():
        status, _, raw = a.call("GET", "/v1/peers")
        assert status == 200, raw
        return [p for p in json.loads(raw)["peers"] if p["did"] == b.did and p["connected"]]

    (peer,) = _until(connected, 30, "a connection from a to b")
    assert isinstance(peer["score"], (int, float))
    a_key = json.loads((tmp_path / "a" / "node.json").read_text())["public_key"]
    status, _, raw = b.call("POST", "/v1/containers", {
        "class": "note", "payload": {"text": "for a only"}, "encrypt_for": [{"public_key": a_key}]})
    assert status == 201, raw
    secret = json.loads(raw)["did"]

    with _browser_page() as (page, errors):
        page.goto(f"{a.url}/#token={a.token}")
        row = page.locator("#peers tbody tr", has_text=b.did[-6:])
        row.wait_for()
        cells = [c.strip() for c in row.locator("td").all_text_contents()]
        assert cells[1] == "yes" and cells[2] == "direct" and "127.0.0.1" in cells[3]
        float(cells[5])  # the score is a number
        assert cells[6] not in ("", "–")  # last contact
        # b's container reaches a by the mesh (sent before or after the page opened: the
        # recent list or the live feed), marked incoming, its payload opened with a's key
        item = page.locator(f"#feed li[data-did='{secret}']")
        item.wait_for()
        assert item.locator(".dir").text_content() == "in"
        item.locator("a").click()
        page.wait_for_selector("#container", state="visible")
        page.wait_for_selector(f"#container-facts dd:has-text('{b.did}')")
        assert json.loads(page.text_content("#container-payload")) == {"text": "for a only"}
        assert not errors, errors


def test_dashboard_adds_and_removes_a_static_peer(nodes, tmp_path):
    """With no discovery and no dialling of their own, a's dashboard adds b as a static peer:
    a connects to it (the peers table marks it static); a bad entry shows the node's reason;
    Remove takes it out of the list and of the file that outlives a restart."""
    _browser_or_skip()
    alone = {"HMPNODE_PEER_LAN_DISCOVERY": "false", "HMPNODE_PEER_DHT": "false", "HMPNODE_PEER_TARGET_PEERS": "0"}
    a = _started(nodes(tmp_path / "a", env=mesh_env(**alone)))
    b_info = nodes(tmp_path / "b", env=mesh_env(**alone)).wait_ready()
    spec = f"{b_info['did']}@tcp://127.0.0.1:{b_info['peer']['port']}"
    with _browser_page() as (page, errors):
        page.goto(f"{a.url}/#token={a.token}")
        page.wait_for_selector("#static-peers tbody tr.empty")
        page.fill("#static-spec", "tcp://no-port")
        page.click("#static-form button")
        page.wait_for_selector("#static-error:has-text('bad_static')")
        page.fill("#static-spec", spec)
        page.click("#static-form button")
        row = page.locator("#static-peers tbody tr", has_text=spec)
        row.wait_for()
        assert page.text_content("#static-error") == ""
        page.wait_for_function("""(spec) => [...document.querySelectorAll('#static-peers tbody tr')].some(
            (tr) => tr.textContent.includes(spec) && tr.cells[2].textContent === 'yes')""", arg=spec)
        peer = page.locator("#peers tbody tr", has_text=b_info["did"][-6:])
        peer.wait_for()
        page.wait_for_function("""(did) => [...document.querySelectorAll('#peers tbody tr')].some(
            (tr) => tr.textContent.includes(did) && tr.cells[7].textContent === 'yes')""", arg=b_info["did"][-6:])
        assert json.loads((tmp_path / "a" / "static-peers.json").read_text()) == [spec]
        row.locator("button").click()
        page.wait_for_selector("#static-peers tbody tr.empty")
        assert json.loads((tmp_path / "a" / "static-peers.json").read_text()) == []
        # the browser reports the bad entry's answer; nothing else went wrong
        assert errors == ["console: Failed to load resource: the server responded with a status of 400 (Bad Request)"]


def test_feed_resumes_after_the_node_restarts_and_misses_nothing(nodes, tmp_path):
    """The feed's stream ends with the node; the page reconnects (back-off) with
    Last-Event-ID and gets what was stored meanwhile, once each."""
    _browser_or_skip()
    first = nodes(tmp_path / "node")
    api = _started(first)
    port = api.url.rsplit(":", 1)[1]
    with _browser_page() as (page, errors):
        streams: list[dict[str, str]] = []
        page.on("request", lambda r: streams.append(r.headers) if r.url.endswith("/v1/events") else None)
        page.goto(f"{api.url}/#token={api.token}")
        page.wait_for_selector("#feed-state[data-state='live']")
        before = api.send({"text": "before the restart"})
        page.wait_for_selector(f"#feed li[data-did='{before}']", timeout=FEED_BOUND_MS)
        assert first.stop() == 0
        page.wait_for_selector("#feed-state[data-state='error']")
        # the same data dir, token and port (the page is still open on it)
        again = _started(nodes(tmp_path / "node", api_port=port))
        assert (again.url, again.token) == (api.url, api.token)
        meanwhile = [again.send({"text": f"while the page was away {i}"}) for i in range(3)]
        page.wait_for_selector("#feed-state[data-state='live']")
        for did in meanwhile:
            page.wait_for_selector(f"#feed li[data-did='{did}']")
        assert page.locator("#feed li").count() == 4  # nothing twice
        assert "last-event-id" not in streams[0]  # the first stream starts from now ...
        assert streams[-1]["last-event-id"]  # ... a reconnection resumes after the last event seen
        errors = [e for e in errors if "Failed to load resource" not in e]  # the node was away
        assert not errors, errors
