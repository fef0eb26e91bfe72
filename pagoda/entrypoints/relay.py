"""Passing a request's response from an engine server (a replica, or one model's
server) back to the caller unchanged, for `pagoda router` and the many-model server;
torch-free, as both of those processes are.

A stream the server stops answering mid-way (it died) ends with an error event in
the stream's own API (OpenAI's error body, or Anthropic's `error` event), after the
last whole event, instead of a broken connection.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import httpx
from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse

logger = logging.getLogger(__name__)

# Headers that belong to one hop, not to the request or response being relayed.
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


class Upstream(Protocol):
    """Where a request went: a count of requests in flight there."""

    url: str
    in_flight: int


def error_body(message: str, type_: str, code: str | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def error(status: int, message: str, type_: str, code: str | None = None) -> JSONResponse:
    """OpenAI's error body, for what the relaying process itself answers."""
    return JSONResponse(error_body(message, type_, code), status_code=status)


def json_body(content: bytes) -> dict | None:
    """A request body as the JSON object it should be, or None."""
    try:
        body = json.loads(content)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def request_headers(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}


def relayed_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}


def error_code(body: bytes) -> str | None:
    """The `code` of an OpenAI error body, if it is one."""
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


async def release(response: httpx.Response | None, upstream: Upstream) -> None:
    upstream.in_flight -= 1
    if response is not None:
        await response.aclose()


def stream_error(path: str, body: dict) -> bytes:
    """An error event inside a stream that has already answered 200, in the route's API
    (Anthropic's `error` event on /v1/messages); `body` is an error body with
    `error.message` (OpenAI's, or Anthropic's)."""
    if path.startswith("/v1/messages"):
        anthropic = {
            "type": "error",
            "error": {"type": "api_error", "message": body["error"]["message"]},
        }
        return f"event: error\ndata: {json.dumps(anthropic)}\n\n".encode()
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def relay_body(response: httpx.Response, path: str, url: str) -> AsyncIterator[bytes]:
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        async for chunk in response.aiter_raw():
            yield chunk
        return
    # Whole events only: a cut must not leave half an event before the error event.
    pending = b""
    try:
        async for chunk in response.aiter_raw():
            pending += chunk
            end = pending.rfind(b"\n\n") + 2
            if end > 1:
                yield pending[:end]
                pending = pending[end:]
    except httpx.TransportError as e:
        logger.warning("relay: %s stopped mid-stream (%r); the stream ends with an error", url, e)
        message = "the server of this stream stopped before it ended; try again"
        yield stream_error(path, error_body(message, "ServiceUnavailableError", "upstream_lost"))


class RelayedResponse(StreamingResponse):
    """The server's response as it arrives. However it ends (the body done, the caller
    gone before or while it streams, an error), the server's connection is closed,
    which aborts the request there, and its in-flight count drops exactly once."""

    def __init__(self, response: httpx.Response, upstream: Upstream, path: str) -> None:
        super().__init__(
            relay_body(response, path, upstream.url),
            status_code=response.status_code,
            headers=relayed_headers(response),
        )
        self.upstream, self.target = response, upstream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await release(self.upstream, self.target)
