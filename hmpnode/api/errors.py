"""Error answers of the API: always a JSON body `{"reason": <stable code>, "detail": <text>}`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

__all__ = ["ApiError", "json_response", "error_response", "HTTP_REASONS"]

#: Reasons for the HTTP-level refusals aiohttp itself raises (routing, body size).
HTTP_REASONS = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}


class ApiError(Exception):
    """A refused request: HTTP status, stable reason code, human detail."""

    def __init__(self, status: int, reason: str, detail: str, *, extra: Mapping[str, Any] | None = None,
                 headers: Mapping[str, str] | None = None, close_connection: bool = False):
        super().__init__(detail)
        self.status = status
        self.reason = reason
        self.detail = detail
        self.extra = dict(extra or {})
        self.headers = dict(headers or {})
        #: answer with `Connection: close` (the rest of the request cannot be read)
        self.close_connection = close_connection

    def response(self) -> web.Response:
        response = error_response(self.status, self.reason, self.detail, extra=self.extra, headers=self.headers)
        if self.close_connection:
            response.force_close()
        return response


def json_response(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers=headers)


def error_response(status: int, reason: str, detail: str, *, extra: Mapping[str, Any] | None = None,
                   headers: Mapping[str, str] | None = None) -> web.Response:
    body = {"reason": reason, "detail": detail}
    if extra:
        body.update(extra)
    return json_response(body, status, headers)
