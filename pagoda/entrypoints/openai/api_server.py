"""The OpenAI-compatible HTTP server: FastAPI routes over an `AsyncEngine`, run by uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses with GET
and DELETE /v1/responses/{id} (OpenAI's Responses API), POST /v1/messages and
/v1/messages/count_tokens (Anthropic's Messages API), GET /v1/models,
GET /health, GET /version, POST /tokenize, POST /detokenize, GET /metrics,
GET /dashboard (the live dashboard) and GET /dashboard/events (its feed), GET
/kv_events (the prefix cache's block hashes as they change, for a router).

Every error is OpenAI's body `{"error": {"message", "type", "param", "code"}}`:
400 for bad input (malformed JSON, unknown or mistyped fields, values the
engine's front door refuses, a prompt too long), 401 without the API key on
/v1, /dashboard and /kv_events, 404 for an unknown model or route, 413 for a body over
`max_request_body_bytes`, 429 (with Retry-After) for a request that cannot meet its
latency targets (`--slo-ttft-ms`, `--slo-tpot-ms` or its own), 503 (with Retry-After)
when the queue is full or the server is stopping. A client that goes away aborts its requests. A request that
fails while running fails alone (400 if its input was the cause, else 500; in a
stream, an error event).

SIGTERM (or Ctrl-C): stop accepting, let in-flight requests finish for up to
`shutdown_timeout` seconds, abort the rest (their streams end with
finish_reason "abort"), exit 0. If the engine dies, /health answers 503,
in-flight requests end with an error and the process exits 1, so a supervisor
restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda import __version__, envs
from pagoda.engine.async_engine import AsyncEngine
from pagoda.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagoda.entrypoints.anthropic.serving import AnthropicErrors, ServingMessages
from pagoda.entrypoints.http_auth import DASHBOARD_COOKIE, APIKeyMiddleware
from pagoda.entrypoints.http_server import Server
from pagoda.entrypoints.openai.dashboard import DEFAULT_INTERVAL as DASHBOARD_INTERVAL
from pagoda.entrypoints.openai.dashboard import DashboardFeed, dashboard_html
from pagoda.entrypoints.openai.errors import APIError, bad_request, from_invalid, from_validation
from pagoda.entrypoints.openai.http_parts import (
    BodySizeLimitMiddleware,
    error_response,
    respond,
    trace_headers,
    until_disconnected,
)
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from pagoda.entrypoints.openai.responses_protocol import ResponsesRequest
from pagoda.entrypoints.openai.responses_store import ResponseStore
from pagoda.entrypoints.openai.serving_chat import OpenAIServingChat
from pagoda.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagoda.entrypoints.openai.serving_engine import OpenAIServing
from pagoda.entrypoints.openai.serving_models import LoRAModulePath, ServingModels
from pagoda.entrypoints.openai.serving_pooling import (
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    ServingPooling,
)
from pagoda.entrypoints.openai.serving_responses import ServingResponses
from pagoda.entrypoints.webui import add_chat_page
from pagoda.errors import (
    DeadlineUnmeetableError,
    EngineDeadError,
    EngineNotAcceptingError,
    InvalidRequestError,
    QueueFullError,
)
from pagoda.metrics import CONTENT_TYPE
from pagoda.tracing import RequestLogger, RequestTracer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), e.status_code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        error = from_validation(e.errors())
        return JSONResponse(error.body(), error.status_code)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, e: InvalidRequestError):
        error = from_invalid(e)
        return JSONResponse(error.body(), error.status_code)

    @app.exception_handler(QueueFullError)
    async def queue_full(_: Request, e: QueueFullError):
        headers = {"Retry-After": str(e.retry_after)}
        return error_response(503, str(e), "ServiceUnavailableError", None, "queue_full", headers)

    @app.exception_handler(DeadlineUnmeetableError)
    async def deadline_unmeetable(_: Request, e: DeadlineUnmeetableError):
        headers = {"Retry-After": str(e.retry_after)}
        return error_response(429, str(e), "RateLimitError", e.param, "slo_unmeetable", headers)

    @app.exception_handler(EngineNotAcceptingError)
    async def not_accepting(_: Request, e: EngineNotAcceptingError):
        headers = {"Retry-After": "5"}
        return error_response(503, str(e), "ServiceUnavailableError", None, "unavailable", headers)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError):
        headers = {"Retry-After": "5"}
        return error_response(503, str(e), "ServiceUnavailableError", None, "engine_dead", headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        kind = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind, None, None, e.headers)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):
        logger.exception("unhandled error in a request")
        return error_response(500, f"internal error: {e!r}", "InternalServerError")


def build_app(
    engine: AsyncEngine,
    served_model_names: Sequence[str] | None = None,
    api_key: str | None = None,
    owns_engine: bool = True,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    models: ServingModels | None = None,
    dashboard_interval: float = DASHBOARD_INTERVAL,
    response_store: ResponseStore | None = None,
    tool_call_parser: str = "hermes",
) -> FastAPI:
    """The FastAPI app for `engine`. With `owns_engine`, the app's shutdown stops it.
    `models`: the served names with their LoRA adapters (default: the base model's
    `served_model_names` alone). `dashboard_interval`: seconds between the
    dashboard's samples of the engine. `response_store`: where /v1/responses keeps
    stored responses (default: 1,000 for an hour). `tool_call_parser`: the format
    models write calls in (see pagoda.engine.tool_parsers)."""
    if models is None:
        models = ServingModels(engine, list(served_model_names or [engine.model_name]))
    completion = OpenAIServingCompletion(engine, models)
    chat = OpenAIServingChat(engine, models)
    chat.tool_call_parser = tool_call_parser
    messages = ServingMessages(chat)
    responses = ServingResponses(
        chat, response_store if response_store is not None else ResponseStore()
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if owns_engine:
            await asyncio.to_thread(engine.shutdown, True)

    app = FastAPI(title="pagoda", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    _install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(AnthropicErrors)  # outermost: it reshapes the others' errors too
    add_chat_page(app)

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return error_response(
                503, f"the engine has stopped: {engine.error!r}", "ServiceUnavailableError"
            )
        if not engine.accepting:  # draining: routers and readiness probes look elsewhere
            return error_response(503, "the server is shutting down.", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    feed = DashboardFeed(engine, dashboard_interval)

    @app.get("/dashboard")
    async def dashboard(raw_request: Request):
        response = HTMLResponse(dashboard_html())
        if "api_key" in raw_request.query_params:  # checked by APIKeyMiddleware
            response.set_cookie(
                DASHBOARD_COOKIE,
                raw_request.query_params["api_key"],
                path="/dashboard",
                httponly=True,
                samesite="strict",
            )
        return response

    @app.get("/dashboard/events")
    async def dashboard_events():
        response = StreamingResponse(feed.events(), media_type="text/event-stream")
        response.headers["Cache-Control"] = "no-cache"
        return response

    @app.get("/kv_events")
    async def kv_events():
        """The prefix cache's block hashes as they change, one JSON batch per line (see
        pagoda.core.kv_events): what `pagoda router --kv-events` follows."""
        stream = engine.listen_kv_events()

        async def lines():
            try:
                async for batch in stream:
                    yield batch.to_json() + "\n"
            finally:
                engine.stop_kv_events(stream)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=models.cards())

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        return models.card(models.resolve(model)[0])

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        if engine.engine.lora_config is None:
            raise bad_request("LoRA is off: start the server with --enable-lora.", "lora_name")
        await models.load_lora_adapter(LoRAModulePath(req.lora_name, req.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        models.unload_lora_adapter(req.lora_name, req.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw_request: Request):
        return await respond(completion, req, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request):
        return await respond(chat, req, raw_request)

    @app.post("/v1/messages")
    async def create_message(req: MessagesRequest, raw_request: Request):
        return await respond(messages, req, raw_request)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw_request: Request):
        return await respond(responses, req, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return responses.delete(response_id)

    pooling = ServingPooling(OpenAIServing(engine, models))

    @app.post("/v1/embeddings")
    async def create_embeddings(req: EmbeddingRequest, raw_request: Request):
        return await until_disconnected(
            raw_request, pooling.embeddings(req, trace_headers(raw_request))
        )

    async def rerank(req: RerankRequest, raw_request: Request):
        return await until_disconnected(
            raw_request, pooling.rerank(req, trace_headers(raw_request))
        )

    async def score(req: ScoreRequest, raw_request: Request):
        return await until_disconnected(raw_request, pooling.score(req, trace_headers(raw_request)))

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):  # Cohere's and Jina's clients' paths
        app.post(path)(rerank)
    for path in ("/v1/score", "/score"):
        app.post(path)(score)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(req: CountTokensRequest):
        return await messages.count_tokens(req)

    processor = engine.engine.processor  # its methods run on the processor thread

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        completion.check_model(req.model)
        if req.messages is not None:
            conversation = chat.conversation(req)
            await chat.fetch_images(conversation)
            _, tokens, _ = await engine.run_in_processor(
                processor.render_chat,
                conversation,
                req.add_generation_prompt,
                req.chat_template_kwargs,
            )
        elif req.prompt is not None:
            tokens = await engine.run_in_processor(
                processor.tokenize, req.prompt, req.add_special_tokens
            )
        else:
            raise bad_request("give either prompt or messages.", "prompt")
        return TokenizeResponse(
            count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens
        )

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        completion.check_model(req.model)
        text = await engine.run_in_processor(processor.detokenize, req.tokens)
        return DetokenizeResponse(prompt=text)

    return app


def run_server(ns: argparse.Namespace, engine_args) -> int:
    """`pagoda serve`: build the engine, serve until SIGTERM/SIGINT (exit status 0) or
    until the engine dies (1)."""
    names = ns.served_model_name or [engine_args.model or DEFAULT_MODEL_NAME]
    if ns.max_queue_len is not None and ns.max_queue_len < 0:
        raise ValueError(f"max_queue_len must be >= 0, got {ns.max_queue_len}.")
    if ns.max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be >= 1, got {ns.max_request_body_bytes}.")
    if not ns.dashboard_interval >= 0.05:
        raise ValueError(f"dashboard_interval must be >= 0.05 s, got {ns.dashboard_interval}.")
    response_store = ResponseStore(ns.max_stored_responses, ns.stored_response_ttl)
    lora_modules = [LoRAModulePath.parse(text) for text in ns.lora_modules or ()]
    if lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora.")
    server = Server(
        uvicorn.Config(
            None,
            host=ns.host,
            port=ns.port,
            log_config=None,
            access_log=not ns.disable_uvicorn_access_log,
            timeout_keep_alive=5,
            # After the in-flight requests' time is up and they were aborted, close
            # whatever connection is still open rather than wait for it.
            timeout_graceful_shutdown=max(1, int(ns.shutdown_timeout) + 5),
        ),
        ns.shutdown_timeout,
    )
    # Opened before the model loads, so a bad path or a missing package fails at once.
    tracers = []
    if ns.request_log:
        tracers.append(RequestLogger(ns.request_log, names[0]))
    if ns.otlp_traces_endpoint:
        tracers.append(RequestTracer(ns.otlp_traces_endpoint, names[0]))
    engine = AsyncEngine.from_engine_args(
        engine_args,
        model_name=names[0],
        max_queue_len=ns.max_queue_len,
        on_dead=server.engine_died,
    )
    server.engine = engine
    engine.engine.stat_loggers.extend(tracers)  # safe: no request yet
    models = ServingModels(engine, names)
    for module in lora_modules:
        try:
            asyncio.run(models.load_lora_adapter(module))
        except APIError as e:
            engine.shutdown(abort=True, timeout=10)
            raise ValueError(f"--lora-modules {module.name}={module.path}: {e.message}") from e
    stats = engine.get_stats()
    block_size = engine_args.block_size
    logger.info(
        "pagoda serve: model %s as %s; KV cache %d blocks x %d tokens = %d tokens; "
        "max_model_len %d; listening on http://%s:%d",
        engine.model_config.model,
        ", ".join(names),
        stats.kv_cache.num_blocks_total,
        block_size,
        stats.kv_cache.num_blocks_total * block_size,
        engine.max_model_len,
        ns.host,
        ns.port,
    )
    server.config.app = build_app(
        engine,
        api_key=ns.api_key or envs.api_key(),
        max_request_body_bytes=ns.max_request_body_bytes,
        models=models,
        dashboard_interval=ns.dashboard_interval,
        response_store=response_store,
        tool_call_parser=ns.tool_call_parser,
    )
    try:
        server.run()
    finally:
        engine.shutdown(abort=True, timeout=10)
        for tracer in tracers:
            tracer.close()
    return server.exit_code
