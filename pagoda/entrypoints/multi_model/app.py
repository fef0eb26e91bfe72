"""The many-model server's HTTP side: the OpenAI (and Anthropic) routes relayed to the
server of the model a request names, loading it first when it is not loaded.

A request for a model being loaded waits; a stream gets a keep-alive comment every
few seconds while it does, then the model's stream (or an error event if the load
failed). `/v1/models` lists every model with its `status` (loaded, loading, unloaded,
llama.cpp's router names); `GET /models`, `POST /models/load` and `POST
/models/unload` are llama.cpp's router-mode endpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from pagoda import envs
from pagoda.entrypoints.http_auth import APIKeyMiddleware
from pagoda.entrypoints.http_server import Server
from pagoda.entrypoints.multi_model.host import HostedModel, LoadError, ModelHost
from pagoda.entrypoints.processes import without_options
from pagoda.entrypoints.relay import (
    RelayedResponse,
    error,
    error_body,
    json_body,
    relay_body,
    release,
    request_headers,
    stream_error,
)
from pagoda.entrypoints.webui import add_chat_page
from pagoda.model_executor.model_catalog import catalog

logger = logging.getLogger(__name__)

_KEEP_ALIVE_S = 2.0  # between a waiting stream's comments
# Routes relayed by the model their body names.
_ROUTES = (
    "/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/responses", "/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score",
    "/score", "/tokenize", "/detokenize",
)  # fmt: skip
# This server's own flags, which its models' servers do not get.
_HOST_FLAGS = (
    "--models-dir", "--model", "--max-loaded-models", "--keep-alive", "--host", "--port",
    "--served-model-name",
)  # fmt: skip


def _kind(e: LoadError) -> str:
    return {400: "invalid_request_error", 404: "NotFoundError"}.get(
        e.status, "ServiceUnavailableError"
    )


def _load_error(e: LoadError) -> Response:
    return error(e.status, e.message, _kind(e), e.code)


def build_app(host: ModelHost, api_key: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        watcher = asyncio.create_task(host.watch())
        yield
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await host.close()

    app = FastAPI(title="pagoda (many models)", lifespan=lifespan)
    app.state.host = host
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, protected=("/v1", "/models"))
    app.add_exception_handler(LoadError, lambda _, e: _load_error(e))
    add_chat_page(app)

    def card(model: HostedModel) -> dict:
        base = {
            "id": model.name,
            "object": "model",
            "created": int(os.path.getmtime(model.entry.path)),
            "owned_by": "pagoda",
            "root": model.entry.path,
        }
        return {**base, **(model.card or {}), "status": {"value": model.state}}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        import prometheus_client as prom

        return Response(host.metrics.exposition(), media_type=prom.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    @app.get("/models")
    async def list_models():
        return {"object": "list", "data": [card(m) for m in host.models.values()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        return card(host.get(name))

    async def named(raw: Request) -> HostedModel:
        try:
            body = await raw.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            raise LoadError(400, 'expected a JSON body {"model": NAME}.', "model")
        return host.get(body["model"])

    @app.post("/models/load")
    async def load(raw: Request):
        model = await named(raw)
        host.check_fits(model)
        await host.ready(model)
        return {"success": True, "model": model.name, "status": {"value": model.state}}

    @app.post("/models/unload")
    async def unload(raw: Request):
        model = await named(raw)
        if not await host.unload(model, "request"):
            raise LoadError(400, f"The model `{model.name}` is not loaded.", "model_not_loaded")
        return {"success": True, "model": model.name, "status": {"value": model.state}}

    async def send(model: HostedModel, path: str, raw: Request, content: bytes):
        """The request to `model`'s server; (its response, streaming) or raises
        LoadError when the server does not answer (it died: the watcher will see)."""
        model.in_flight += 1
        host.metrics.requests.labels(model.name).inc()
        url = model.url + path + (f"?{raw.url.query}" if raw.url.query else "")
        request = host.client.build_request(
            raw.method, url, content=content, headers=request_headers(raw.headers)
        )
        try:
            return await host.client.send(request, stream=True)
        except BaseException as e:
            model.in_flight -= 1
            if isinstance(e, httpx.TransportError):
                raise LoadError(
                    503, f"The model `{model.name}`'s server is not answering; try again.",
                    "model_unavailable",
                ) from e  # fmt: skip
            raise

    async def loading_then_relay(model: HostedModel, path: str, raw: Request, content: bytes):
        """A stream for a model not loaded yet: comments while it loads, then its
        stream."""
        waiting = asyncio.ensure_future(host.ready(model))
        response = None
        try:
            while not waiting.done():  # a comment at once, then every few seconds
                yield f": loading {model.name}\n\n".encode()
                await asyncio.wait({waiting}, timeout=_KEEP_ALIVE_S)
            try:
                waiting.result()
                response = await send(model, path, raw, content)
            except LoadError as e:
                yield stream_error(path, error_body(e.message, _kind(e), e.code))
                return
            if response.status_code != 200:  # refused: its error, as an event
                body = await response.aread()
                try:
                    event = stream_error(path, json.loads(body))
                except (ValueError, KeyError, TypeError):  # not an error body
                    event = stream_error(path, error_body(body.decode(errors="replace"), "error"))
                yield event
                return
            async for chunk in relay_body(response, path, model.url):
                yield chunk
        finally:
            waiting.cancel()
            if response is not None:
                await release(response, model)

    async def relay(path: str, raw: Request):
        content = await raw.body()
        body = json_body(content) or {}
        model = host.get(body.get("model"))
        if model.state != "loaded":
            host.check_fits(model)
            if body.get("stream") is True:
                response = StreamingResponse(
                    loading_then_relay(model, path, raw, content), media_type="text/event-stream"
                )
                response.headers["Cache-Control"] = "no-cache"
                return response
            await host.ready(model)
        return RelayedResponse(await send(model, path, raw, content), model, path)

    def relay_to(path: str):
        async def route(raw: Request):
            return await relay(path, raw)

        return route

    for path in _ROUTES:
        app.post(path)(relay_to(path))
    return app


def run_model_host(ns: argparse.Namespace) -> int:
    """`pagoda serve --models-dir DIR` / `--model NAME=PATH ...` / `--stored-models`:
    serve until SIGTERM (exit status 0); every loaded model's server stops with it."""
    models = catalog(ns.model, ns.models_dir, ns.stored_models)
    argv = ns.argv[ns.argv.index("serve") + 1 :]
    args = [a for a in without_options(argv, _HOST_FLAGS) if a != "--stored-models"]
    api_key = ns.api_key or envs.api_key()
    host = ModelHost(
        models,
        args,
        max_loaded=ns.max_loaded_models,
        keep_alive=ns.keep_alive,
        kv_cache_bytes=ns.kv_cache_memory_bytes,
        api_key=api_key,
        shutdown_timeout=ns.shutdown_timeout,
    )
    logger.info(
        "pagoda serve: %d models (%s), at most %d loaded%s, on http://%s:%d",
        len(models), ", ".join(models), ns.max_loaded_models,
        f", unloaded after {ns.keep_alive:g} s idle" if ns.keep_alive is not None else "",
        ns.host, ns.port,
    )  # fmt: skip
    app = build_app(host, api_key)
    config = uvicorn.Config(
        app, host=ns.host, port=ns.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=int(ns.shutdown_timeout) + 5,
    )  # fmt: skip
    server = Server(config, shutdown_timeout=0)
    server.run()
    return server.exit_code
