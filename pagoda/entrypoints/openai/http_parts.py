"""The HTTP parts every route shares: the body size middleware, the server-sent
events response, a request's trace headers, and cancelling work whose
client went away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagoda.engine.validation import TRACE_HEADERS
from pagoda.entrypoints.openai.errors import APIError


def error_response(status: int, message: str, type: str, param=None, code=None, headers=None):
    return JSONResponse(APIError(status, message, type, param, code).body(), status, headers)


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however it ends, even
    when the client left before the body started (the generator never ran)."""

    def __init__(self, content, on_close) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.headers["Cache-Control"] = "no-cache"
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class BodySizeLimitMiddleware:
    """413 for a request body over `max_bytes`, by its Content-Length or, when it
    is sent in chunks, as soon as the bytes read pass the limit."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            await self._too_large()(scope, receive, send)
            return
        received, too_large = 0, False

        async def limited_receive():
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True  # the app sees a client that left, and answers no one
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message) -> None:
            if not too_large:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)
        if too_large:
            await self._too_large()(scope, receive, send)

    def _message(self) -> str:
        return f"The request body is larger than this server takes ({self.max_bytes} bytes)."

    def _too_large(self) -> JSONResponse:
        return error_response(
            413, self._message(), "invalid_request_error", code="request_too_large"
        )


def trace_headers(raw_request: Request) -> dict[str, str] | None:
    """The request's W3C trace context (`traceparent`, `tracestate`), if it has one."""
    found = {
        name: raw_request.headers[name] for name in TRACE_HEADERS if name in raw_request.headers
    }
    return found or None


async def until_disconnected(raw_request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client disconnects first, cancel it (which aborts its
    requests) and answer 499."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)


async def respond(handler, req, raw_request: Request) -> Response:
    """Start the body's request with `handler` (a serving class: start, stream_response,
    full_response, abort_unfinished), then stream its events or answer it whole."""
    run = await handler.start(req, trace_headers(raw_request))
    if req.stream:
        body = handler.stream_response(run)
        return SSEResponse(body, lambda: handler.abort_unfinished(run.streams))
    return await until_disconnected(raw_request, handler.full_response(run))
