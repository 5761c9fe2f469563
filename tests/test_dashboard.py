"""The web dashboard (hmpnode/api/web, served at `/`) on a real node, in a real headless browser.

The browser is the system's Chromium (Debian package `chromium`), driven by
Playwright's Python API through `executable_path`: nothing is downloaded at test
time. Without Chromium or Playwright the browser tests skip with the reason, unless
HMPNODE_REQUIRE_BROWSER=1 (as in .ci/run), where that is a failure. HMPNODE_TEST_CHROMIUM
names another binary.

Every wait is bounded (Playwright's timeouts); the feed is given 2 s, the bound the
dashboard promises for a new container to show.

`_check_panels` screenshots every `section.panel` of `main#app` (those added later too) at
a desk and a phone width into `$HMPNODE_TEST_ARTIFACTS/dashboard/` (default:
`<repo>/.artifacts/dashboard/`, ignored by git), and checks the layout at each width.
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
from pathlib import Path
from typing import Any

import pytest

from hmpnode.container.build import build_container
from hmpnode.identity import Identity
from tests.meshutil import mesh_env
from tests.nodeproc import REPO, hmp, node_env

#: how long a container sent through the API may take to show in the live feed (ms)
FEED_BOUND_MS = 2000
#: any other wait for the page (ms): loading, API answers (a loaded machine is slow)
PAGE_BOUND_MS = 20_000
#: the widths the dashboard is checked at (px): a desk screen and a phone
WIDTHS = (1400, 390)


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


def artifacts_dir() -> Path:
    """Where the screenshots go (kept by CI as test artifacts)."""
    root = os.environ.get("HMPNODE_TEST_ARTIFACTS")
    out = (Path(root) if root else REPO / ".artifacts") / "dashboard"
    out.mkdir(parents=True, exist_ok=True)
    return out


#: what is wrong with the page's layout at the current width, in words (an empty list: nothing)
_LAYOUT_PROBLEMS = r"""() => {
  const shown = (e) => e.getClientRects().length > 0;
  const problems = [];
  const page = document.scrollingElement;
  if (page.scrollWidth > innerWidth + 1) problems.push(`the page is ${page.scrollWidth} px wide in a ${innerWidth} px window`);
  for (const th of document.querySelectorAll('main#app th')) {
    if (!shown(th)) continue;
    if (th.scrollWidth > th.clientWidth + 1) problems.push(`header "${th.textContent}" is cut`);
    const texts = document.createTreeWalker(th, NodeFilter.SHOW_TEXT);
    for (let t = texts.nextNode(); t; t = texts.nextNode()) {
      for (const word of t.data.matchAll(/\S+/g)) {
        const range = document.createRange();
        range.setStart(t, word.index);
        range.setEnd(t, word.index + word[0].length);
        const lines = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
        if (lines.size > 1) problems.push(`header "${th.textContent}" breaks inside "${word[0]}"`);
      }
    }
  }
  for (const panel of document.querySelectorAll('main#app section.panel')) {
    if (!shown(panel)) { problems.push(`panel ${panel.id} is not shown`); continue; }
    // every table body, list or fact list shown has something in it, if only "nothing yet"
    for (const box of panel.querySelectorAll('tbody, table:not(:has(tbody)), ol, ul, dl')) {
      if (shown(box) && !box.textContent.trim()) problems.push(`panel ${panel.id}: an empty ${box.tagName.toLowerCase()}#${box.id}`);
    }
    const heading = panel.querySelector('h2');
    const text = panel.innerText.replace(heading ? heading.innerText : '', '').trim();
    const drawn = [...panel.querySelectorAll('svg, canvas, img')].some((e) => shown(e) && e.getBoundingClientRect().width > 0);
    if (!text && !drawn) problems.push(`panel ${panel.id} shows nothing, not even "nothing yet"`);
  }
  return problems;
}"""


def _check_panels(page, stage: str) -> list[Path]:
    """At each of WIDTHS: a screenshot of every panel (`<stage>-<width>px-<panel id>.png`)
    and of the page, and no layout problem (`_LAYOUT_PROBLEMS`). The panels' screenshots."""
    out, shots = artifacts_dir(), []
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        problems = page.evaluate(_LAYOUT_PROBLEMS)
        page.screenshot(path=str(out / f"{stage}-{width}px-page.png"), full_page=True)  # the whole, for a look
        panels = page.locator("main#app section.panel")
        for i in range(panels.count()):
            panel = panels.nth(i)
            path = out / f"{stage}-{width}px-{panel.get_attribute('id') or i}.png"
            panel.screenshot(path=str(path))
            shots.append(path)
        assert not problems, (width, problems)
    return shots


def _signed_in(page, api: NodeApi) -> None:
    """The page open on `api`'s node, signed in, with every panel loaded once."""
    page.goto(f"{api.url}/#token={api.token}")
    for loaded in ("#node-did:not(:empty)", "#peers tbody tr", "#static-count:not(:empty)", "#outbox tbody tr",
                   "#journal-state:not(:empty)"):
        page.wait_for_selector(loaded)
    page.wait_for_function("() => !document.getElementById('interests') || document.querySelector('#interests tbody tr')")


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


def test_empty_panels_say_nothing_yet_at_both_widths(node):
    """A fresh node: each empty table and list says "nothing yet" (one helper, one wording),
    headers stay whole, and the page never scrolls sideways, at a desk and a phone width."""
    api, _ = node
    with _browser_page() as (page, errors):
        _signed_in(page, api)
        shots = _check_panels(page, "empty")
        for empty in ("#feed li.empty", "#outbox tbody tr.empty", "#relay tbody tr.empty", "#journal li.empty",
                      "#recall-items li.empty", "#interests tbody tr.empty", "#static-peers tbody tr.empty"):
            assert page.text_content(empty) == "nothing yet", empty
        assert page.is_visible("#container-none") and page.is_hidden("#recall-raw")
        assert {p.name for p in shots} >= {f"empty-{w}px-{panel}-panel.png" for w in WIDTHS
                                           for panel in ("status", "peers", "recall", "interests")}
        assert all(p.stat().st_size > 0 for p in shots)
        # the feed's "nothing yet" goes with its first container
        first = api.send({"text": "the first one"})
        page.wait_for_selector(f"#feed li[data-did='{first}']", timeout=FEED_BOUND_MS)
        assert page.locator("#feed li").count() == 1
        assert not errors, errors


def _import_foreign(api: NodeApi, text: str) -> tuple[str, str]:
    """A note by another agent, imported (from a peer it is the same): (its DID, its sender)."""
    other = Identity(bytes([5]) * 32)
    foreign = build_container(other, "note", {"text": text}, now=datetime.now(timezone.utc).replace(microsecond=0))
    status, _, raw = api.call("POST", "/v1/containers/import", {"containers": [foreign]})
    assert status == 200 and json.loads(raw)["stored"] == 1, raw
    return foreign["hmp_container"]["head"]["container_did"], other.did


def _recall(page, query: str, tokens: int = 800, size: int = 4000) -> dict[str, Any]:
    """Ask the page; the answer as the node sent it (the raw envelope the page keeps)."""
    before = page.text_content("#recall-receipt")
    page.fill("#recall-query", query)
    page.fill("#recall-tokens", str(tokens))
    page.fill("#recall-bytes", str(size))
    page.click("#recall-form button")
    page.wait_for_function("(before) => document.getElementById('recall-receipt').textContent !== before", arg=before)
    return json.loads(page.text_content("#recall-receipt"))


def test_recall_is_answered_for_a_human(node):
    """Each item with its date (local, and how long ago), its sender ("you" for this agent),
    its state and confidence and its text, not JSON; the budget used as bars; an abstention
    in words; the raw envelope only behind a <details>."""
    api, _ = node
    mine = api.send({"text": "the backup window of the felbur cluster is 02:00"}, tags=["ops"])
    theirs, other = _import_foreign(api, "the felbur cluster backup window moved to 03:00")
    with _browser_page() as (page, errors):
        page.clock.install()  # the page's clock, moved forward below (it runs on meanwhile)
        _signed_in(page, api)
        # nothing any memory holds: the memory abstains, and says why
        answer = _recall(page, "zarnik quorum")
        assert answer["items"] == [] and answer["abstain"] in ("no_match", "no_relevant_match")
        assert page.text_content("#recall-abstain").startswith(f"No answer ({answer['abstain']}): ")
        assert page.is_hidden("#recall-items")
        # a budget below an empty answer: the smallest that would do, in words
        answer = _recall(page, "felbur cluster backup window", tokens=5)
        assert answer["abstain"] == "budget_too_small" and answer["need"]
        assert f"needs {answer['need'][0]} tokens and {answer['need'][1]} bytes" in page.text_content("#recall-abstain")
        assert page.is_hidden("#recall-budget")

        answer = _recall(page, "felbur cluster backup window")
        assert page.is_hidden("#recall-abstain") and answer["abstain"] is None
        items = page.locator("#recall-items > li")
        assert items.count() == len(answer["items"]) == 2
        assert {w["did"] for w in answer["why"]} == {mine, theirs}
        for i, (item, why) in enumerate(zip(answer["items"], answer["why"])):
            li = items.nth(i)
            assert li.locator(".recall-text").text_content() == item["p"]["text"]  # the text, not JSON
            time_ = li.locator("time")
            assert time_.get_attribute("datetime") == why["timestamp"]
            assert re.search(r"\((just now|\d+ (min|h|d|months) ago)\)$", time_.text_content()), time_.text_content()
            assert li.locator(".badge").text_content() == why["state"] == "active"
            assert f"confidence {why['score']['confidence']}" in li.locator(".recall-meta").text_content()
            assert li.locator(f"a[data-did='{why['did']}']").count() == 1
            if why["did"] == mine:
                assert li.locator(".recall-meta .you").text_content() == "you"
            else:
                who = li.locator(".recall-meta .did")
                assert who.get_attribute("title") == other and who.text_content() != other  # short, full on hover
        # the budget: used of asked, tokens and bytes, as the envelope says
        meters = page.locator("#recall-budget meter")
        assert [float(meters.nth(i).get_attribute("value")) for i in (0, 1)] == answer["used"]
        assert [float(meters.nth(i).get_attribute("max")) for i in (0, 1)] == answer["max"] == [800, 4000]
        assert f"{answer['used'][0]} of 800" in page.text_content("#recall-budget")
        # the raw envelope is there, folded
        assert page.get_attribute("#recall-raw", "open") is None and page.is_hidden("#recall-receipt")
        page.click("#recall-raw summary")
        assert page.is_visible("#recall-receipt")
        _check_panels(page, "filled")
        # the page stays open two hours: "just now" has become "2 h ago" (the next refresh)
        page.clock.fast_forward("02:00:00")
        page.wait_for_function("""() => [...document.querySelectorAll('#recall-items time')].every(
            (t) => t.textContent.endsWith('(2 h ago)'))""")
        assert not errors, errors


def test_interests_are_edited_from_the_page(nodes, tmp_path):
    """Add and remove entries at a phone and a desk width: each change goes through
    PUT /v1/interests (checked by the node as the CLI's are) and shows what is in force;
    a refusal and the rate limit show the node's one-line reason."""
    api = _started(nodes(tmp_path / "node", env=node_env(HMPNODE_INTERESTS_QUERIES_PER_MINUTE="10")))

    def declared() -> dict[str, Any]:
        status, _, raw = api.call("GET", "/v1/interests")
        assert status == 200, raw
        return json.loads(raw)

    def add(page, kind: str, entry: str) -> None:
        page.select_option("#interests-kind", kind)
        page.fill("#interests-entry", entry)
        page.click("#interests-form button")

    with _browser_page() as (page, errors):
        page.set_viewport_size({"width": 390, "height": 900})
        _signed_in(page, api)
        assert page.text_content("#interests-source") == "from the configuration"
        add(page, "tags", "weather")
        page.wait_for_selector("#interests tbody tr:has-text('weather')")
        assert declared()["interests"]["tags"] == ["weather"] and declared()["source"] == "api"
        assert page.text_content("#interests-source") == "set here or by the CLI"
        assert page.input_value("#interests-entry") == ""
        # refused by the node: its reason, one line; nothing changed; the entry kept to correct
        add(page, "senders", "nobody")
        page.wait_for_selector("#interests-error:not(:empty)")
        assert page.text_content("#interests-error") == "bad_interests: senders: 'nobody' is not a DID"
        assert declared()["interests"]["senders"] == [] and page.input_value("#interests-entry") == "nobody"
        add(page, "senders", api.did)
        page.wait_for_selector(f"#interests tbody tr:has-text('{api.did}')")
        assert page.text_content("#interests-error") == ""

        page.set_viewport_size({"width": 1400, "height": 900})
        page.locator("#interests tbody tr", has_text="weather").locator("button").click()
        page.wait_for_selector("#interests tbody tr:has-text('weather')", state="detached")
        assert declared()["interests"] == {"mode": "selective", "classes": [], "tags": [], "senders": [api.did],
                                           "topics": []}
        page.click("#interests-reset")
        page.wait_for_selector("#interests tbody tr.empty")
        assert declared()["source"] == "config"
        # faster than peers take peer_query messages (10 a minute: 5 changes at once): refused
        for i in range(12):
            add(page, "topics", f"topic-{i}")
            page.wait_for_function("""(t) => document.getElementById('interests-error').textContent
                || document.getElementById('interests').textContent.includes(t)""", arg=f"topic-{i}")
            if page.text_content("#interests-error"):
                break
        assert page.text_content("#interests-error") == ("rate_limited: interests changed too often; "
                                                         "at most 5 per minute (try again in 20 s)")
        assert f"topic-{i}" not in json.dumps(declared())
        _check_panels(page, "interests")
        # the browser reports the refused answers; nothing else went wrong
        assert errors == ["console: Failed to load resource: the server responded with a status of 400 (Bad Request)",
                          "console: Failed to load resource: the server responded with a status of 429 (Too Many Requests)"]


def test_settings_are_shown_read_only_with_their_sources(nodes, tmp_path):
    """The settings panel: GET /v1/config as folds per section, each setting's value and a
    badge for where it came from (default, file, env, flag); sections with a setting not
    default are open; nothing on it changes a setting but the log level, which it shows and
    sets (PUT /v1/log-level) until SIGHUP or a restart."""
    data = tmp_path / "node"
    data.mkdir(mode=0o700)
    (data / "hmpnode.toml").write_text("[peer]\nfanout = 3\n")
    api = _started(nodes(data, "--log-level", "debug", env=node_env(HMPNODE_API_MAX_BATCH="10")))
    status, _, raw = api.call("GET", "/v1/config")
    assert status == 200, raw
    config = json.loads(raw)
    with _browser_page() as (page, errors):
        _signed_in(page, api)
        page.wait_for_selector("#settings details")
        assert page.text_content("#settings-data-dir") == f"data dir: {data}"
        assert page.eval_on_selector_all("#settings details", "(ds) => ds.map((d) => d.dataset.section)") \
            == list(config["settings"])
        for setting, kind, source in (("peer.fanout", "file", str(data / "hmpnode.toml")),
                                      ("api.max_batch", "env", "HMPNODE_API_MAX_BATCH"),
                                      ("node.log_level", "flag", "--log-level"),
                                      ("relay.max_per_recipient", "default", "default")):
            section, key = setting.split(".")
            row = page.locator(f"#settings tr[data-setting='{setting}']")
            cells = row.locator("td")
            assert cells.nth(0).text_content() == key
            value = config["settings"][section][key]["value"]
            assert cells.nth(1).text_content() == (value if isinstance(value, str) else json.dumps(value))
            badge = row.locator(".badge.source")
            assert (badge.text_content(), badge.get_attribute("title")) == (kind, source), setting
        assert page.locator("#settings tr[data-setting='peer.fanout'] td").nth(1).text_content() == "3"
        # folded: open where something is not a default, closed elsewhere, and opened by a click
        opened = {s: any(v["source"] != "default" for v in keys.values()) for s, keys in config["settings"].items()}
        assert page.eval_on_selector_all("#settings details", "(ds) => ds.map((d) => d.open)") == list(opened.values())
        closed = next(s for s, is_open in opened.items() if not is_open)
        assert page.is_hidden(f"#settings details[data-section='{closed}'] table")
        page.click(f"#settings details[data-section='{closed}'] summary")
        assert page.is_visible(f"#settings details[data-section='{closed}'] table")
        # read only, but for the log level: the select shows the level in force and sets it
        assert page.locator("#settings input").count() == 0
        assert page.input_value("#log-level") == "debug"
        page.select_option("#log-level", "warning")
        _until(lambda: json.loads(api.call("GET", "/v1/log-level")[2])["level"] == "warning", 10,
               "the level set from the page")
        assert page.input_value("#log-level") == "warning" and page.text_content("#log-level-error") == ""
        _check_panels(page, "settings")
        assert not errors, errors


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
        assert cells[8] == "everything"  # b declared no interests: nothing kept from it
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
    Remove takes it out of the list and of the file that outlives a restart. Added at a phone's
    width, removed at a desk's."""
    _browser_or_skip()
    alone = {"HMPNODE_PEER_LAN_DISCOVERY": "false", "HMPNODE_PEER_DHT": "false", "HMPNODE_PEER_TARGET_PEERS": "0"}
    a = _started(nodes(tmp_path / "a", env=mesh_env(**alone)))
    b_info = nodes(tmp_path / "b", env=mesh_env(**alone)).wait_ready()
    spec = f"{b_info['did']}@tcp://127.0.0.1:{b_info['peer']['port']}"
    with _browser_page() as (page, errors):
        page.set_viewport_size({"width": 390, "height": 900})  # added at a phone's width ...
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
        page.set_viewport_size({"width": 1400, "height": 900})  # ... removed at a desk's
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
