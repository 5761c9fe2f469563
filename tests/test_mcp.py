"""`hmpnode mcp` driven by the MCP SDK's own client over stdio, against a real node."""

from __future__ import annotations

import json
import sys

import pytest

from tests.meshutil import MeshNode, mesh_env

mcp_client = pytest.importorskip("mcp.client.stdio")
from mcp.client.session import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

TOOLS = {"remember", "recall", "search", "send", "inbox", "evaluate"}


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
                    await session.initialize()
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

                    refused = await session.call_tool("evaluate", {"did": "did:hmp:container:nope", "type": "x",
                                                                   "value": 0.1})
                    assert refused.is_error and "not_found" in refused.content[0].text
    finally:
        await me.close()
        await other.close()
