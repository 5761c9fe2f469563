"""`hmpnode mcp` driven by the MCP SDK's own client over stdio, against a real node."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hmpnode import __version__
from tests.meshutil import MeshNode, mesh_env

mcp_client = pytest.importorskip("mcp.client.stdio")
from mcp.client.session import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, get_default_environment, stdio_client  # noqa: E402

TOOLS = {"remember", "recall", "search", "send", "inbox", "evaluate", "forget", "propose", "vote", "consensus",
         "interests", "set_interests"}
#: the placeholders of the README's client configuration
README_COMMAND = "/path/to/hmpnode/.venv/bin/hmpnode"
README_DATA_DIR = "/tmp/alice"


def _json(result) -> dict:
    assert not result.is_error, result.content
    if result.structured_content is not None:
        value = result.structured_content
        return value.get("result", value) if isinstance(value, dict) and set(value) == {"result"} else value
    return json.loads(result.content[0].text)


async def test_mcp_tools_over_stdio(nodes, tmp_path):
    env = mesh_env(HMPNODE_PEER_LAN_DISCOVERY="false", HMPNODE_PEER_DHT="false")
    me = MeshNode(nodes(tmp_path / "me", env=env))
    other = MeshNode(nodes(tmp_path / "other", env=env))
    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "hmpnode", "mcp", "--data-dir", str(me.proc.data_dir)], env=env)
    try:
        with open(tmp_path / "mcp.stderr", "w") as errlog:
            async with stdio_client(params, errlog=errlog) as (read, write):
                async with ClientSession(read, write) as session:
                    started = await session.initialize()
                    assert (started.server_info.name, started.server_info.version) == ("hmpnode", __version__)
                    names = {t.name for t in (await session.list_tools()).tools}
                    assert TOOLS <= names

                    stored = _json(await session.call_tool("remember", {"text": "the lab printer is on floor 3",
                                                                         "tags": ["office"]}))
                    assert stored["status"] == "stored"
                    hits = _json(await session.call_tool("search", {"query": "printer floor"}))
                    assert hits["items"][0]["did"] == stored["did"]
                    envelope = _json(await session.call_tool("recall", {"query": "where is the printer",
                                                                        "max_tokens": 2000, "max_bytes": 4000}))
                    assert envelope["items"][0]["p"] == {"text": "the lab printer is on floor 3"}
                    assert envelope["used"][1] <= 4000

                    evaluated = _json(await session.call_tool("evaluate", {"did": stored["did"], "type": "usefulness",
                                                                           "value": 0.5}))
                    assert evaluated["status"] == "active"

                    # sent encrypted to another agent (these nodes have no mesh here: it stays queued)
                    sent = _json(await session.call_tool("send", {"class_name": "note",
                                                                  "payload": {"text": "to the other agent"},
                                                                  "to": [other.public_key]}))
                    assert sent["status"] == "stored"
                    # the inbox lists what is addressed to this agent, opened
                    await me.client.create("note", {"text": "a note to self"},
                                           encrypt_for=[{"public_key": me.public_key, "did": me.did}])
                    inbox = _json(await session.call_tool("inbox", {"limit": 5}))
                    assert inbox["items"][0]["payload"] == {"text": "a note to self"}

                    # scoped memories, then forgotten by their source: gone from recall, 410 on read
                    scoped = _json(await session.call_tool("remember", {"text": "the lab kettle is in room 9",
                                                                        "source": "doc:tour", "scope": "task:tour"}))
                    only = _json(await session.call_tool("recall", {"query": "lab", "max_tokens": 2000,
                                                                    "max_bytes": 4000, "scope": "task:tour",
                                                                    "why": True}))
                    assert [w["did"] for w in only["why"]] == [scoped["did"]]
                    told = _json(await session.call_tool("recall", {"query": "lab kettle", "max_tokens": 2000,
                                                                    "max_bytes": 4000, "explain": True}))
                    assert told["explain"]["selected_count"] >= 1 and scoped["did"] not in json.dumps(told)
                    forgot = _json(await session.call_tool("forget", {"source": "doc:tour"}))
                    assert forgot["forgotten"] == 1
                    again = await session.call_tool("forget", {"did": scoped["did"], "scope": "task:tour"})
                    assert again.is_error and "bad_request" in again.content[0].text
                    after = _json(await session.call_tool("recall", {"query": "lab kettle", "max_tokens": 2000,
                                                                     "max_bytes": 4000, "why": True}))
                    assert scoped["did"] not in [w["did"] for w in after.get("why", [])]

                    refused = await session.call_tool("evaluate", {"did": "did:hmp:container:nope", "type": "x",
                                                                   "value": 0.1})
                    assert refused.is_error and "not_found" in refused.content[0].text

                    # CogConsensus: propose, vote, read the state (open until the ttl)
                    proposed = _json(await session.call_tool("propose", {"text": "move the printer", "ttl": "1h",
                                                                         "quorum": 1}))
                    assert proposed["status"] == "stored"
                    voted = _json(await session.call_tool("vote", {"did": proposed["did"], "value": 1,
                                                                   "reason": "closer"}))
                    assert voted["status"] == "stored"
                    state = _json(await session.call_tool("consensus", {"did": proposed["did"]}))
                    assert (state["state"], state["leading"], len(state["counted"])) == ("open", "accepted", 1)
                    bad = await session.call_tool("vote", {"did": proposed["did"], "value": 3})
                    assert bad.is_error and "bad_request" in bad.content[0].text

                    # interests (docs/protocol.md 33): declared, shown, refused when bad
                    assert _json(await session.call_tool("interests", {}))["everything"] is True
                    declared = _json(await session.call_tool("set_interests", {"tags": ["office"]}))
                    assert declared["interests"]["tags"] == ["office"] and declared["everything"] is False
                    bad = await session.call_tool("set_interests", {"senders": ["bob"]})
                    assert bad.is_error and "bad_interests" in bad.content[0].text
    finally:
        await me.close()
        await other.close()


def _readme_mcp_config() -> dict:
    """The generic `mcpServers` block the README shows."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```", text, re.S)
    configs = [json.loads(b) for b in blocks if '"mcpServers"' in b]
    assert len(configs) == 1, "the README shows one mcpServers configuration"
    return configs[0]["mcpServers"]["hmpnode"]


async def test_mcp_as_configured_in_the_readme_with_the_sdk_default_environment(nodes, tmp_path):
    """What a client does with the README's configuration: the SDK's default environment
    (HOME, PATH, ...; no HMPNODE_DATA_DIR), the data dir in the server's arguments."""
    me = MeshNode(nodes(tmp_path / "me", env=mesh_env(HMPNODE_PEER_LAN_DISCOVERY="false", HMPNODE_PEER_DHT="false")))
    config = _readme_mcp_config()
    assert config["command"] == README_COMMAND and README_DATA_DIR in config["args"]
    command = str(Path(sys.executable).parent / "hmpnode")  # the README's .venv/bin/hmpnode, in this venv
    args = [str(me.proc.data_dir) if a == README_DATA_DIR else a for a in config["args"]]
    params = StdioServerParameters(command=command, args=args)  # env None: get_default_environment()
    assert not any(k.startswith("HMPNODE_") for k in get_default_environment())
    try:
        with open(tmp_path / "mcp.stderr", "w") as errlog:
            async with stdio_client(params, errlog=errlog) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    assert TOOLS <= {t.name for t in (await session.list_tools()).tools}
                    stored = _json(await session.call_tool("remember", {"text": "reached through the README"}))
                    assert (await me.client.get(stored["did"]))["container"]["hmp_container"]["head"]["sender_did"] \
                        == me.did
                    # arguments that do not fit: one short line naming them, not pydantic's text
                    bad = await session.call_tool("recall", {"query": "x", "max_tokens": "many"})
                    text = bad.content[0].text
                    assert bad.is_error and "max_tokens" in text and "max_bytes: required" in text, text
                    assert "pydantic" not in text and "validation error" not in text and "\n" not in text, text
    finally:
        await me.close()


def test_mcp_refuses_to_start_without_a_node(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hmpnode", "mcp", "--data-dir", str(tmp_path / "nothing")],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=60, env=get_default_environment())
    assert proc.returncode == 1 and proc.stdout == b"", proc
    line = proc.stderr.decode()
    assert line.startswith("hmpnode: mcp: not started: no node is running on data dir") and line.count("\n") == 1, line
