"""`pagoda router`'s HTTP side: one OpenAI endpoint in front of the replicas.

Requests and responses pass through unchanged (streams chunk by chunk, errors with
their status and body). A replica that cannot be reached, or that answers 503
(draining, dead, or its queue full), has started nothing: the request goes to
another, and the replica is marked down unless only its queue was full; health
checks (`GET /health`) take replicas out and put them back, and with `kv_events`
a follower per healthy replica reads its prefix cache's changes. `/v1/models` is
the union of the replicas'; `/metrics` is the router's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import replace

import httpx
import prometheus_client as prom
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagoda import envs
from pagoda.entrypoints.http_server import Server
from pagoda.entrypoints.relay import (
    RelayedResponse,
    error,
    error_code,
    json_body,
    relayed_headers,
    release,
    request_headers,
)
from pagoda.entrypoints.router.config import RouterConfig
from pagoda.entrypoints.router.policy import Router
from pagoda.entrypoints.router.prefill import GENERATION_PATHS, prefill_first
from pagoda.entrypoints.router.prefix_table import follow_kv_events
from pagoda.entrypoints.router.replicas import Replica
from pagoda.entrypoints.router.tokens import PromptTokenizer
from pagoda.entrypoints.webui import add_chat_page

logger = logging.getLogger(__name__)


def build_app(router: Router, health_check_interval: float | None = None) -> FastAPI:
    """The router's app; `health_check_interval` (seconds) overrides the config's."""
    if health_check_interval is None:
        health_check_interval = router.config.health_check_interval
    prefill = None  # policy pd: the prefill replicas, a Router of their own
    if router.config.policy == "pd":
        pool = replace(router.config, backends=router.config.prefill_backends,
                       prefill_backends=(), policy="prefix")  # fmt: skip
        prefill = Router(pool, router.tokenizer, router.metrics)
    health_checked = [router] if prefill is None else [router, prefill]
    # No cap on connections: each one is a request in flight, which the replicas queue.
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0), limits=httpx.Limits(max_connections=None)
    )

    # --kv-events: a task per healthy replica following its prefix cache, and how
    # often the replica had gone down when it started.
    followers: dict[Replica, tuple[asyncio.Task, int]] = {}
    # The replicas' key (PAGODA_API_KEY, as `pagoda serve` reads it) guards their events.
    key = envs.api_key()
    events_client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0),
        headers={"Authorization": f"Bearer {key}"} if key else None,
    )

    def follow_replicas() -> None:
        """Follow the healthy replicas; one that went down since its follower started
        (its blocks were forgotten, and the events meanwhile dropped) starts again,
        from a snapshot."""
        for replica, (task, times_down) in list(followers.items()):
            stale = times_down != replica.times_down or not replica.healthy
            if stale or replica not in router.replicas:
                task.cancel()
                del followers[replica]
        for replica in router.replicas:
            if replica.healthy and replica not in followers:
                task = asyncio.create_task(
                    follow_kv_events(
                        events_client,
                        replica.url,
                        functools.partial(router.apply_kv_events, replica, replica.times_down),
                        health_check_interval,
                    )
                )
                followers[replica] = (task, replica.times_down)

    async def check_health() -> None:
        while True:  # never ends but by cancellation: an error skips one round
            try:
                if router.replica_set.discover is not None:
                    await router.replica_set.rediscover()
                for pool in health_checked:
                    for replica in list(pool.replicas):
                        try:
                            r = await client.get(replica.url + "/health", timeout=2.0)
                            pool.set_health(replica, r.status_code == 200)
                        except httpx.HTTPError:
                            pool.set_health(replica, False)
                if router.config.kv_events:
                    follow_replicas()
            except Exception:
                logger.exception("router: health check failed; next round in %.1f s",
                                 health_check_interval)  # fmt: skip
            await asyncio.sleep(health_check_interval)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(check_health())
        yield
        tasks = [task, *(t for t, _ in followers.values())]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await client.aclose()
        await events_client.aclose()

    app = FastAPI(title="pagoda router", lifespan=lifespan)
    app.state.router = router
    add_chat_page(app)

    @app.get("/health")
    async def health():
        if any(r.healthy for r in router.replicas):
            return Response(status_code=200)
        return error(503, "no replica is up", "ServiceUnavailableError")

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.exposition(), media_type=prom.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(raw: Request):
        cards: dict[str, dict] = {}
        auth = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        for replica in list(router.replicas):
            if not replica.healthy:
                continue
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                r = await client.get(replica.url + "/v1/models", headers=auth, timeout=5.0)
                if r.status_code == 401:  # the replicas' key: the caller's to give
                    return Response(r.content, 401, relayed_headers(r))
                for card in r.json()["data"]:
                    cards.setdefault(card["id"], card)
        return {"object": "list", "data": list(cards.values())}

    async def relay(path: str, raw: Request):
        content = await raw.body()
        body = json_body(content)
        hashes = await asyncio.to_thread(router.block_hashes, body) if body is not None else []
        headers = request_headers(raw.headers)
        if prefill is not None and body is not None and path in GENERATION_PATHS:
            refused = await prefill_first(client, prefill, path, body, hashes, headers)
            if refused is not None:
                return refused
        tried: set[Replica] = set()
        refused: Response | None = None  # the last replica's 503, if every one refused
        while True:
            replica = router.choose(hashes, tried)
            if replica is None:
                if refused is not None:
                    return refused
                return error(503, "no replica could take the request", "ServiceUnavailableError")
            tried.add(replica)
            replica.in_flight += 1
            # Recorded now, not once the replica answers: the same prefix arriving
            # meanwhile must find where it went.
            router.record(hashes, replica)
            url = replica.url + path + (f"?{raw.url.query}" if raw.url.query else "")
            response = None
            try:
                response = await client.send(
                    client.build_request("POST", url, content=content, headers=headers),
                    stream=True,
                )
                if response.status_code == 503:
                    # Nothing started there: the replica is draining (a rolling
                    # update), dead, or its queue is full. Another one may take it.
                    body = await response.aread()
                    refused = Response(body, 503, relayed_headers(response))
                    if error_code(body) != "queue_full":
                        router.set_health(replica, False)
                    router.metrics.retries.inc()
                    await release(response, replica)
                    continue
            except httpx.TransportError as e:  # nothing came back: try another
                await release(response, replica)
                logger.warning("router: %s unreachable (%r); trying another", replica.url, e)
                router.set_health(replica, False)
                router.metrics.retries.inc()
                continue
            except BaseException:  # cancelled (the caller left, or shutdown), or a bug
                await release(response, replica)
                raise
            return RelayedResponse(response, replica, path)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await relay("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await relay("/v1/chat/completions", raw)

    @app.post("/v1/messages")  # Anthropic's; a replica answers in Anthropic's shapes
    async def messages(raw: Request):
        return await relay("/v1/messages", raw)

    def relay_to(path: str):
        async def route(raw: Request):
            return await relay(path, raw)

        return route

    # Pooling (embeddings, rerank, scores): the replica's path as the client gave it.
    for path in ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score"):
        app.post(path)(relay_to(path))

    return app


def run_router(config: RouterConfig, on_start: Callable[[Router], None] | None = None) -> int:
    """Serve until SIGTERM (exit status 0). `on_start(router)`: called before serving
    (`pagoda serve --data-parallel-size` watches its replicas from there)."""
    router = Router(config, PromptTokenizer.load(config.model))
    if on_start is not None:
        on_start(router)
    if router.replica_set.discover is not None:
        asyncio.run(router.replica_set.rediscover())
    logger.info(
        "pagoda router: %d replicas (%s)%s, policy %s%s, on http://%s:%d",
        len(router.replicas),
        ", ".join(r.url for r in router.replicas),
        f" after prefill on {', '.join(config.prefill_backends)}"
        if config.prefill_backends
        else "",
        config.policy,
        " following their KV events" if config.kv_events else "",
        config.host,
        config.port,
    )
    app = build_app(router)
    # On SIGTERM, streams in flight get their replicas' shutdown time, then are cut.
    uvicorn_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=int(config.shutdown_timeout) + 5,
    )  # fmt: skip
    server = Server(uvicorn_config, shutdown_timeout=0)  # exits 0 on SIGTERM
    server.run()
    return server.exit_code
