"""The router's HTTP pieces shared by plain and disaggregated routing: error bodies, the headers not
passed on, and an instance's answer streamed through."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
               "proxy-connection", "accept-encoding"}


def error_response(status: int, message: str) -> JSONResponse:
    kind = {503: "service_unavailable", 502: "server_error", 504: "server_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status)


def passed_headers(headers: httpx.Headers | dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}


def whole_answer(content: bytes, status: int, headers: httpx.Headers, raw: bool = False) -> Response:
    """An instance's answer read whole: its `raw` bytes, or decoded by httpx (then its content-encoding
    no longer holds)."""
    kept = {k: v for k, v in passed_headers(headers).items() if raw or k.lower() != "content-encoding"}
    return Response(content, status_code=status, headers=kept)


class Proxied(StreamingResponse):
    """An instance's answer passed through as it arrives (`content`: its bytes, when some were read
    already); the upstream response is closed and `release` called however the stream ends (the
    client may go away mid-stream)."""

    def __init__(self, upstream: httpx.Response, release: Callable[[], None],
                 content: AsyncIterator[bytes] | None = None) -> None:
        super().__init__(content or upstream.aiter_raw(), status_code=upstream.status_code,
                         headers=passed_headers(upstream.headers))
        self._upstream, self._release = upstream, release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._upstream.aclose()
            self._release()
