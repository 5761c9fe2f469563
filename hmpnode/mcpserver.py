"""`hmpnode mcp`: an MCP server (stdio) that gives an agent its node as tools.

It talks to the running node through the agent API (`hmpnode.client.Client`,
found through the data directory like every client command); it holds no
state of its own. Tools (arguments and results are JSON):

- `remember(text, tags=[])`: store a memory (a `note` container of this agent);
- `recall(query, max_tokens, max_bytes, include_contested=False, why=False)`: the
  budgeted envelope of `POST /v1/recall` (whole items, receipt, abstain reason);
- `search(query, limit=20, state="")`: full-text hits with lifecycle states;
- `send(class_name, payload, to=[], broadcast=False, network="")`: build, sign
  and store a container; `to` lists recipients' base58 public keys
  (encrypted for them); the mesh delivers it;
- `inbox(limit=20)`: the newest containers addressed to this agent, opened;
- `evaluate(did, type, value)`: sign an evaluation of a held container.

Node errors come back as tool errors carrying the API's reason code. stdout
is the protocol: nothing else is written there (logs go to stderr).
"""

from __future__ import annotations

import os
from typing import Any

from hmpnode.client import ApiError, Client, ClientError

__all__ = ["build_server", "run"]


def build_server(data_dir: str | os.PathLike[str] | None = None):
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    class NodeToolError(ToolError):
        """A refusal of the node, shown to the agent as `<reason>: <detail>`."""

    server = MCPServer("hmpnode", instructions=(
        "Your HMP node: remember and recall memories within a budget, search, send containers to other agents "
        "over the mesh, read your inbox, evaluate containers."))

    async def call(work):
        try:
            async with Client.from_data_dir(data_dir) as client:
                return await work(client)
        except ApiError as exc:
            raise NodeToolError(f"{exc.reason}: {exc.detail}") from None
        except ClientError as exc:  # no node running on that data dir, or it went away
            raise NodeToolError(f"node_unreachable: {exc}") from None

    @server.tool(description="Store a memory (a signed note container of this agent).")
    async def remember(text: str, tags: list[str] | None = None) -> dict[str, Any]:
        result = await call(lambda c: c.create("note", {"text": text}, **({"tags": tags} if tags else {})))
        return {k: result[k] for k in ("did", "seq", "status") if k in result}

    @server.tool(description="Recall memories relevant to a task, never exceeding max_tokens or max_bytes; "
                             "an empty answer says why (abstain: e.g. no_relevant_match when nothing stored "
                             "answers it); why=true adds full ids and ranking signals.")
    async def recall(query: str, max_tokens: int, max_bytes: int, include_contested: bool = False,
                     why: bool = False) -> dict[str, Any]:
        return await call(lambda c: c.recall(query, max_tokens=max_tokens, max_bytes=max_bytes,
                                             include_contested=include_contested or None, why=why or None))

    @server.tool(description="Full-text search (BM25) over the node's containers; each hit has its lifecycle state.")
    async def search(query: str, limit: int = 20, state: str = "") -> dict[str, Any]:
        return await call(lambda c: c.search(query, limit=limit, state=state or None))

    @server.tool(description="Build, sign and store a container; to: recipients' base58 public keys (encrypted "
                             "for them); broadcast: for every node in scope; network: '', 'localhost' or 'lan:<cidr>'.")
    async def send(class_name: str, payload: dict[str, Any], to: list[str] | None = None, broadcast: bool = False,
                   network: str = "") -> dict[str, Any]:
        options: dict[str, Any] = {}
        if to:
            options["encrypt_for"] = [{"public_key": key} for key in to]
        if broadcast:
            options["broadcast"] = True
        if network:
            options["network"] = network
        result = await call(lambda c: c.create(class_name, payload, **options))
        return {k: result[k] for k in ("did", "seq", "status") if k in result}

    @server.tool(description="The newest containers addressed to this agent, with their payload opened.")
    async def inbox(limit: int = 20) -> dict[str, Any]:
        async def work(client: Client) -> dict[str, Any]:
            own = client.node_info["did"]
            page = await client.list(recipient=own, order="desc", limit=max(1, min(limit, 200)))
            items = []
            for item in page.get("items") or ():
                opened = await client.get(item["did"], decrypt=True)
                head = opened["container"]["hmp_container"]["head"]
                items.append({"did": item["did"], "class": head["class"], "sender": head["sender_did"],
                              "timestamp": head["timestamp"], "payload": opened.get("payload"),
                              "payload_error": opened.get("payload_error")})
            return {"items": items}

        return await call(work)

    @server.tool(description="Sign this agent's evaluation (value in [-1, 1]) of a held container.")
    async def evaluate(did: str, type: str, value: float) -> dict[str, Any]:  # noqa: A002 - the spec's name
        return await call(lambda c: c.evaluate(did, type, value))

    return server


def run(data_dir: str | os.PathLike[str] | None = None) -> int:
    build_server(data_dir).run("stdio")
    return 0
