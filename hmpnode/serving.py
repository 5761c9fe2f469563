"""How the node's HTTP servers (the agent API and the peer port) are run by aiohttp.

`server_options(idle_seconds)` gives keyword arguments for `web.AppRunner(app, **options)`
(`SERVER_OPTIONS` with the default):

* `auto_decompress=False`: request bodies are not decompressed (the API refuses any
  Content-Encoding but identity with 415). With aiohttp's default, a broken
  gzip/deflate body can fail inside the HTTP parser, which answers text/plain and
  drops keep-alive connections before the application sees it.
* `keepalive_timeout`: a connection with no request in progress is closed after
  `idle_seconds` (setting `node.idle_connection_seconds`), from its first byte on
  (aiohttp's default is an hour:
  idle or half-sent connections, which anyone who can reach the peer port may open,
  would each hold a file descriptor that long). A WebSocket or an event stream in
  progress is a request in progress and is not cut. The default, 30 s, outlasts the
  15 s for which aiohttp's client keeps an idle pooled connection, so that a client
  never picks a connection the node is closing.
* `lingering_time=0`: a request whose body was not read (refused before it: 401, 404,
  405, 413, ...) ends its connection once the answer is sent; the rest of the body is
  never read. aiohttp's default reads and discards it for up to 10 s, so an
  unauthenticated client could push ~1 GB per request at the node.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_IDLE_CONNECTION_SECONDS", "SERVER_OPTIONS", "server_options", "raise_open_file_limit"]

DEFAULT_IDLE_CONNECTION_SECONDS = 30.0


def server_options(idle_seconds: float = DEFAULT_IDLE_CONNECTION_SECONDS) -> dict[str, Any]:
    return {"auto_decompress": False, "keepalive_timeout": idle_seconds, "lingering_time": 0}


SERVER_OPTIONS = server_options()


def raise_open_file_limit(ceiling: int = 65_536) -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit (at most
    `ceiling`), as network daemons do: every peer, API client and SQLite file is a
    descriptor, and a common soft limit of 1 024 is soon reached by connections
    alone. Returns (old soft limit, new soft limit)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft
