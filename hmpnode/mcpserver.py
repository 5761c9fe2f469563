"""`hmpnode mcp`: an MCP server (stdio) that gives an agent its node as tools.

It talks to the running node through the agent API (`hmpnode.client.Client`,
found through the data directory like every client command); it holds no
state of its own. Tools (arguments and results are JSON):

- `remember(text, tags=[], source="", scope="")`: store a memory (a `note`
  container of this agent), with a node-local source label and scope;
- `recall(query, max_tokens, max_bytes, include_contested=False, why=False,
  scope="", explain=False)`: the budgeted envelope of `POST /v1/recall` (whole
  items, abstain reason; why adds full ids and ranking signals); with explain
  only counts, reasons and budgets;
- `forget(did="", source="", scope="")`: erase one memory, everything from a
  source, or a scope (one of them); gone for good, peers cannot hand it back;
- `search(query, limit=20, state="")`: full-text hits with lifecycle states;
- `send(class_name, payload, to=[], broadcast=False, network="")`: build, sign
  and store a container; `to` lists recipients' base58 public keys
  (encrypted for them); the mesh delivers it;
- `inbox(limit=20)`: the newest containers addressed to this agent, opened;
- `evaluate(did, type, value)`: sign an evaluation of a held container.
- `propose(text, ttl, quorum, threshold)`, `vote(did, value, reason)`, `consensus(did)`:
  CogConsensus (docs/protocol.md "Consensus").
- `interests()`, `set_interests(tags, topics, classes, senders, mode)`: what the agent
  wants from the mesh; peers send it only matching broadcasts (docs/protocol.md 33).

It finds the node as every client command does, from its data dir: `--data-dir`,
else $HMPNODE_DATA_DIR, else the platform's user data dir. MCP clients start
servers with only a few variables of their environment (HOME, PATH, ...), so a
client's configuration names the data dir in the server's arguments (README).
It refuses to start (one line on stderr, exit 1) when no node answers there.

Node errors come back as tool errors carrying the API's reason code; arguments
that do not fit a tool come back as one short line naming each argument. stdout
is the protocol: nothing else is written there (logs go to stderr).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from hmpnode import __version__
from hmpnode.client import ApiError, Client, ClientError

__all__ = ["build_server", "run", "check_node", "argument_problems"]

#: seconds the start-up check gives the node to answer
CHECK_TIMEOUT = 10.0


def argument_problems(tool: str, error) -> str:
    """A pydantic ValidationError of a tool's arguments as one short line naming each
    argument (not pydantic's multi-line text with the input echoed and a URL)."""
    problems = []
    for item in error.errors():
        name = ".".join(str(part) for part in item.get("loc", ())) or "arguments"
        problems.append(f"{name}: {'required' if item.get('type') == 'missing' else item.get('msg', 'invalid')}")
    return f"invalid arguments for {tool}: {'; '.join(problems)}"


async def check_node(data_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """node.json of the node on `data_dir` once it answered; ClientError if none does."""
    async with Client.from_data_dir(data_dir, timeout=CHECK_TIMEOUT) as client:
        await client.status()
        return client.node_info


def build_server(data_dir: str | os.PathLike[str] | None = None):
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from pydantic import ValidationError

    class NodeToolError(ToolError):
        """A refusal of the node, shown to the agent as `<reason>: <detail>`."""

    class Server(MCPServer):
        async def call_tool(self, name: str, arguments: dict[str, Any], context=None):
            try:
                return await super().call_tool(name, arguments, context)
            except ToolError as exc:
                if isinstance(exc.__cause__, ValidationError):
                    raise ToolError(argument_problems(name, exc.__cause__)) from exc.__cause__
                raise

    server = Server("hmpnode", version=__version__, instructions=(
        "Your HMP node: remember and recall memories within a budget (optionally per scope), forget them, search, "
        "send containers to other agents over the mesh, read your inbox, evaluate containers."))

    async def call(work):
        try:
            async with Client.from_data_dir(data_dir) as client:
                return await work(client)
        except ApiError as exc:
            raise NodeToolError(f"{exc.reason}: {exc.detail}") from None
        except ClientError as exc:  # no node running on that data dir, or it went away
            raise NodeToolError(f"node_unreachable: {exc}") from None

    @server.tool(description="Store a memory (a signed note container of this agent). source: where it came from "
                             "(a document, a tool, a URL; forget can erase by it); scope: the task/user/thread it "
                             "belongs to (e.g. task:t1; recall with that scope returns only its members).")
    async def remember(text: str, tags: list[str] | None = None, source: str = "", scope: str = "") -> dict[str, Any]:
        result = await call(lambda c: c.create("note", {"text": text}, tags=tags or None, source=source or None,
                                               scope=scope or None))
        return {k: result[k] for k in ("did", "seq", "status") if k in result}

    @server.tool(description="Forget: erase one memory (did), everything remembered from a source, or a scope "
                             "(give exactly one). Final: it is deleted and never taken back from a peer.")
    async def forget(did: str = "", source: str = "", scope: str = "") -> dict[str, Any]:
        return await call(lambda c: c.forget(did=did or None, source=source or None, scope=scope or None))

    @server.tool(description="Recall memories relevant to a task, never exceeding max_tokens or max_bytes; "
                             "an empty answer says why (abstain: e.g. no_relevant_match when nothing stored "
                             "answers it); why=true adds full ids and ranking signals; scope: only that scope's "
                             "members; explain=true: only counts, reasons and budgets (no ids, no text).")
    async def recall(query: str, max_tokens: int, max_bytes: int, include_contested: bool = False,
                     why: bool = False, scope: str = "", explain: bool = False) -> dict[str, Any]:
        return await call(lambda c: c.recall(query, max_tokens=max_tokens, max_bytes=max_bytes,
                                             include_contested=include_contested or None, why=why or None,
                                             scope=scope or None, explain=explain or None))

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

    @server.tool(description="Sign this agent's evaluation (value in [-1, 1]) of a held container; type: one of "
                             "the spec's support, oppose, extend, replace, comment (or a type of your own).")
    async def evaluate(did: str, type: str, value: float) -> dict[str, Any]:  # noqa: A002 - the spec's name
        return await call(lambda c: c.evaluate(did, type, value))

    @server.tool(description="Publish a proposal other agents vote on until its deadline (ttl: 30m, 12h, 7d); "
                             "quorum: counted voters needed; threshold: score needed in (0, 1].")
    async def propose(text: str, ttl: str | None = None, quorum: int | None = None,
                      threshold: float | None = None) -> dict[str, Any]:
        out = await call(lambda c: c.propose(text, ttl=ttl, quorum=quorum, threshold=threshold))
        return {k: out[k] for k in ("did", "seq", "status")}

    @server.tool(description="Vote on a held proposal: value 1 (approve), -1 (reject), 0 (abstain) or between; "
                             "a later vote replaces this one until the deadline.")
    async def vote(did: str, value: float, reason: str | None = None) -> dict[str, Any]:
        out = await call(lambda c: c.vote(did, value, reason=reason))
        return {k: out[k] for k in ("did", "seq", "status")}

    @server.tool(description="A proposal's consensus state (open, accepted, rejected, expired), its counted "
                             "votes, and the published results with this node's recount.")
    async def consensus(did: str) -> dict[str, Any]:
        return await call(lambda c: c.consensus(did))

    @server.tool(description="What this agent wants from the mesh (its declared interests): peers send its node "
                             "only broadcasts that match; everything: true means it gets them all.")
    async def interests() -> dict[str, Any]:
        return await call(lambda c: c.interests())

    @server.tool(description="Declare what this agent wants (replaces the declaration): broadcasts whose tags "
                             "include a tag or topic, whose class or sender is listed; topics are also published "
                             "in the DHT. Nothing listed: everything. mode 'everything' gets all (relays).")
    async def set_interests(tags: list[str] | None = None, topics: list[str] | None = None,
                            classes: list[str] | None = None, senders: list[str] | None = None,
                            mode: str = "selective") -> dict[str, Any]:
        return await call(lambda c: c.set_interests(tags=tags, topics=topics, classes=classes, senders=senders,
                                                    mode=mode))

    return server


def run(data_dir: str | os.PathLike[str] | None = None) -> int:
    """Serve on stdio; ClientError, before anything is served, if no node answers on `data_dir`."""
    asyncio.run(check_node(data_dir))
    build_server(data_dir).run("stdio")
    return 0
