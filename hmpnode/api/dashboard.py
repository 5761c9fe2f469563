"""The local web dashboard: static HTML/CSS/JS served by the API at `/`.

The page and its files are served without the token and hold no data: the
script reads the token from the URL fragment (`#token=...`, which browsers never
send to a server) or asks for it, keeps it in sessionStorage, and calls the API
with `Authorization: Bearer` like any other client (the event feed too: fetch()
streams it, since EventSource cannot send that header). The token is never put in
a query string, a cookie or a log line.

Every answer carries a Content-Security-Policy that allows only this origin's
scripts, styles and connections (no inline script), refuses framing, and sends
no Referer. The files are read once when the app is built (they are few and small),
and only names listed in `ASSET_DIR` are served: a name is a dictionary key, never
a path.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import hdrs, web

from hmpnode.api.errors import ApiError

__all__ = ["ASSET_DIR", "HEADERS", "PUBLIC_ROUTES", "add_routes"]

ASSET_DIR = Path(__file__).with_name("web")

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

#: security headers of every dashboard answer
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    hdrs.CACHE_CONTROL: "no-store",
}

_ASSETS = web.AppKey("hmpnode_dashboard_assets", dict)


def _load() -> dict[str, tuple[bytes, str]]:
    return {path.name: (path.read_bytes(), _TYPES[path.suffix])
            for path in sorted(ASSET_DIR.iterdir()) if path.suffix in _TYPES}


def _file(request: web.Request, name: str) -> web.Response:
    found = request.app[_ASSETS].get(name)
    if found is None:
        raise ApiError(404, "not_found", "no such dashboard file")
    body, content_type = found
    return web.Response(body=body, headers={hdrs.CONTENT_TYPE: content_type, **HEADERS})


async def index(request: web.Request) -> web.Response:
    return _file(request, "index.html")


async def asset(request: web.Request) -> web.Response:
    return _file(request, request.match_info.get("name", ""))


#: (method, path, handler): served without the token (static files, no data)
PUBLIC_ROUTES = (
    ("GET", "/", index),
    ("GET", "/dashboard/{name}", asset),
)


def add_routes(app: web.Application) -> None:
    app[_ASSETS] = _load()
    for method, path, handler in PUBLIC_ROUTES:
        app.router.add_route(method, path, handler)
