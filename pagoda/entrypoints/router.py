"""`pagoda router`: one OpenAI endpoint in front of several engine replicas, sending
each request where its prompt's prefix is most likely already in the KV cache.

The router tokenizes the prompt (the model's tokenizer and chat template, as the
engines do) and hashes it into the chained block hashes the engines' prefix caches
use (`kv_cache_manager.hash_block`, same block size). It remembers which replicas
it sent each block to (its own routing history, an LRU of `--prefix-table-size`
blocks) and, with `--kv-events`, follows each replica's prefix cache as it changes
(`GET /kv_events`: blocks stored and evicted; see prefix_table.py). It scores each
healthy replica by how many leading blocks of the prompt it holds:

- `prefix` (default): the replica holding the longest prefix; the least loaded one
  when none holds any, or when in-flight counts differ by more than
  `--balance-threshold` (load first, then cache);
- `round-robin`, `least-loaded` (fewest requests in flight): for comparison.

Requests and responses pass through unchanged (streams chunk by chunk, errors with
their status and body). A replica that cannot be reached, or that answers 503
(draining, dead, or its queue full), has started nothing: the request goes to
another, and the replica is marked down unless only its queue was full; health checks (`GET /health`) take
replicas out and put them back. `/v1/models` is the union of the replicas'; `/metrics`
is the router's own (per-replica routing counts, prefix blocks matched, retries).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
import prometheus_client as prom
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagoda import envs
from pagoda.core.kv_cache_manager import hash_block
from pagoda.entrypoints.prefix_table import PrefixTable, follow_kv_events

logger = logging.getLogger(__name__)

POLICIES = ("prefix", "round-robin", "least-loaded")
# Headers that belong to one hop, not to the request or response being relayed.
_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


@dataclass(eq=False)
class Replica:
    url: str
    index: int
    healthy: bool = True
    in_flight: int = 0
    removed: bool = False  # no longer among the router's replicas (DNS discovery)
    times_down: int = 0  # how often it went down (its KV events start again after each)


class Router:
    def __init__(
        self,
        backends: list[str],
        policy: str = "prefix",
        block_size: int = 16,
        balance_threshold: int = 16,
        prefix_table_size: int = 1 << 20,
        tokenizer=None,
        discover: str | None = None,
        kv_events: bool = False,
    ) -> None:
        if not backends and discover is None:
            raise ValueError(
                "router: name replicas with --backend, --discover-dns or --discover-ray."
            )
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
        if block_size < 1 or balance_threshold < 0 or prefix_table_size < 1:
            raise ValueError(
                "block_size and prefix_table_size must be >= 1, balance_threshold >= 0."
            )
        self.replicas: list[Replica] = []
        self._next_index = 0
        # "HOST:PORT": the replicas are the addresses HOST resolves to (a headless
        # Kubernetes Service), looked up again before every health check.
        # "ray": the replica actors of the Ray cluster (see data_parallel.py).
        self.discover = discover if discover in (None, "ray") else _host_port(discover)
        self.policy = policy
        self.block_size = block_size
        self.balance_threshold = balance_threshold
        self.table = PrefixTable(prefix_table_size)
        self.kv_events = kv_events  # follow the replicas' prefix caches (GET /kv_events)
        self.tokenizer = tokenizer
        self._round_robin = itertools.count()
        self.registry = prom.CollectorRegistry()
        labels = ["replica"]
        self.requests_total = prom.Counter(
            "pagoda_router:requests", "Requests routed (a retry counts again)", labels,
            registry=self.registry,
        )  # fmt: skip
        self.prompt_blocks = prom.Counter(
            "pagoda_router:prompt_blocks", "Full prompt blocks routed", labels,
            registry=self.registry,
        )  # fmt: skip
        self.matched_blocks = prom.Counter(
            "pagoda_router:matched_blocks",
            "Prompt blocks routed to a replica already sent them (prefix hits, as the "
            "router sees them)",
            labels,
            registry=self.registry,
        )
        self.retries = prom.Counter(
            "pagoda_router:retries", "Requests sent again after a replica could not be reached",
            registry=self.registry,
        )  # fmt: skip
        self.healthy_gauge = prom.Gauge(
            "pagoda_router:replica_healthy", "1 while the replica takes requests", labels,
            registry=self.registry,
        )  # fmt: skip
        self.kv_event_batches = prom.Counter(
            "pagoda_router:kv_event_batches", "KV event batches applied (--kv-events)", labels,
            registry=self.registry,
        )  # fmt: skip
        self.in_flight_gauge = prom.Gauge(
            "pagoda_router:replica_in_flight", "Requests in flight", labels, registry=self.registry
        )
        self._per_replica = (
            self.requests_total,
            self.prompt_blocks,
            self.matched_blocks,
            self.healthy_gauge,
            self.in_flight_gauge,
            self.kv_event_batches,
        )
        self.set_replicas(backends)

    def set_replicas(self, urls: list[str]) -> None:
        """Replicas for `urls`: those already known keep their state, new ones start
        healthy with an empty table, and ones no longer named are dropped."""
        urls = [u.rstrip("/") for u in urls]
        known = {r.url: r for r in self.replicas}
        for r in self.replicas:
            if r.url not in urls:
                logger.info("router: replica %s removed", r.url)
                r.removed = True  # a relay still holding it must not bring it back
                self.table.forget(r.index)
                for metric in self._per_replica:
                    with contextlib.suppress(KeyError):  # never routed to: no child
                        metric.remove(r.url)
        self.replicas = []
        for url in dict.fromkeys(urls):
            replica = known.get(url)
            if replica is None:
                replica = Replica(url, self._next_index)
                self._next_index += 1
                self.healthy_gauge.labels(url).set(1)
                self.in_flight_gauge.labels(url).set_function(lambda r=replica: r.in_flight)
                if known:
                    logger.info("router: replica %s added", url)
            self.replicas.append(replica)

    async def discover_replicas(self) -> None:
        """With `discover`: the replicas are what its host resolves to now, or the Ray
        cluster's replica actors (kept as they are when the lookup fails)."""
        import socket

        if self.discover == "ray":
            from pagoda.entrypoints.data_parallel import ray_replica_urls

            try:
                self.set_replicas(await asyncio.to_thread(ray_replica_urls))
            except Exception as e:  # the cluster is unreachable for now
                logger.warning("router: cannot list the Ray cluster's replicas (%r)", e)
            return
        host, port = self.discover
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
        except OSError as e:
            logger.warning("router: cannot resolve %s (%s)", host, e)
            return
        addresses = sorted({info[4][0] for info in infos})
        self.set_replicas(
            [f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in addresses]
        )

    # ---- routing ---------------------------------------------------------------------

    def block_hashes(self, body: dict) -> list[bytes]:
        """The chained hashes of the prompt's full blocks ([] when it has no tokens the
        router can see: no tokenizer, or a prompt it cannot render)."""
        tokens = self._prompt_tokens(body)
        if not all(isinstance(t, int) and 0 <= t < 1 << 62 for t in tokens):
            return []  # ids no vocabulary has: the replica will refuse them
        hashes, parent = [], None
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = hash_block(parent, tokens[start : start + self.block_size])
            hashes.append(parent)
        return hashes

    def _prompt_tokens(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch goes where its first prompt's prefix is
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if self.tokenizer is None:
            return []
        try:
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
            messages = body.get("messages")
            if isinstance(messages, list):
                ids = self.tokenizer.apply_chat_template(
                    [_text_only(m) for m in messages], add_generation_prompt=True, tokenize=True
                )
                return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        except Exception:  # a prompt the engine will refuse, or a template that fails
            return []
        return []

    def choose(self, hashes: list[bytes], exclude: set[Replica] = frozenset()) -> Replica | None:
        candidates = [r for r in self.replicas if r.healthy and r not in exclude]
        if not candidates:
            return None
        turn = next(self._round_robin)
        if self.policy == "round-robin":
            return candidates[turn % len(candidates)]
        # Ties in load go round, so new prefixes spread out even when all are idle.
        n = len(candidates)
        order = {r: (pos - turn) % n for pos, r in enumerate(candidates)}
        least = min(candidates, key=lambda r: (r.in_flight, order[r]))
        if self.policy == "least-loaded" or not hashes:
            return least
        if max(r.in_flight for r in candidates) - least.in_flight > self.balance_threshold:
            return least
        matched = {r: self.table.matched_blocks(hashes, r.index) for r in candidates}
        best = max(candidates, key=lambda r: (matched[r], -r.in_flight, -r.index))
        return best if matched[best] > 0 else least

    def record(self, hashes: list[bytes], replica: Replica) -> None:
        if replica.removed:
            return
        self.requests_total.labels(replica.url).inc()
        if hashes:
            self.prompt_blocks.labels(replica.url).inc(len(hashes))
            self.matched_blocks.labels(replica.url).inc(
                self.table.matched_blocks(hashes, replica.index)
            )
            self.table.record(hashes, replica.index)

    def apply_kv_events(self, replica: Replica, times_down: int, batch) -> None:
        """A replica's KV events, from a follower started after it had gone down
        `times_down` times (a later follower, from a new snapshot, replaces it)."""
        if replica.removed or not replica.healthy or times_down != replica.times_down:
            return
        self.table.apply(batch, replica.index)
        self.kv_event_batches.labels(replica.url).inc()

    def set_health(self, replica: Replica, healthy: bool) -> None:
        if replica.removed:
            return
        if replica.healthy and not healthy:
            logger.warning("router: replica %s is down", replica.url)
            self.table.forget(replica.index)
            replica.times_down += 1
        elif healthy and not replica.healthy:
            logger.info("router: replica %s is back", replica.url)
        replica.healthy = healthy
        self.healthy_gauge.labels(replica.url).set(int(healthy))


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"discover_dns must be HOST:PORT, got {text!r}.")
    return host, int(port)


def _text_only(message: dict) -> dict:
    """A chat message with its content parts' text joined (what prefix hashing needs)."""
    content = message.get("content")
    if isinstance(content, list):
        text = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return {**message, "content": text}
    return message


def _error(status: int, message: str, type_: str) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": None, "code": None}}
    return JSONResponse(body, status_code=status)


def build_app(router: Router, health_check_interval: float = 2.0) -> FastAPI:
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
                if router.discover is not None:
                    await router.discover_replicas()
                for replica in list(router.replicas):
                    try:
                        r = await client.get(replica.url + "/health", timeout=2.0)
                        router.set_health(replica, r.status_code == 200)
                    except httpx.HTTPError:
                        router.set_health(replica, False)
                if router.kv_events:
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

    @app.get("/health")
    async def health():
        if any(r.healthy for r in router.replicas):
            return Response(status_code=200)
        return _error(503, "no replica is up", "ServiceUnavailableError")

    @app.get("/metrics")
    async def metrics():
        return Response(prom.generate_latest(router.registry), media_type=prom.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(raw: Request):
        cards: dict[str, dict] = {}
        auth = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        for replica in list(router.replicas):
            if not replica.healthy:
                continue
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                r = await client.get(replica.url + "/v1/models", headers=auth, timeout=5.0)
                for card in r.json()["data"]:
                    cards.setdefault(card["id"], card)
        return {"object": "list", "data": list(cards.values())}

    async def relay(path: str, raw: Request):
        content = await raw.body()
        try:
            body = json.loads(content)
        except ValueError:
            body = None
        hashes = (
            await asyncio.to_thread(router.block_hashes, body) if isinstance(body, dict) else []
        )
        headers = {k: v for k, v in raw.headers.items() if k.lower() not in _HOP_HEADERS}
        tried: set[Replica] = set()
        refused: Response | None = None  # the last replica's 503, if every one refused
        while True:
            replica = router.choose(hashes, tried)
            if replica is None:
                if refused is not None:
                    return refused
                return _error(503, "no replica could take the request", "ServiceUnavailableError")
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
                    refused = Response(body, 503, _relayed_headers(response))
                    if _error_code(body) != "queue_full":
                        router.set_health(replica, False)
                    router.retries.inc()
                    await _release(response, replica)
                    continue
            except httpx.TransportError as e:  # nothing came back: try another
                await _release(response, replica)
                logger.warning("router: %s unreachable (%r); trying another", replica.url, e)
                router.set_health(replica, False)
                router.retries.inc()
                continue
            except BaseException:  # cancelled (the caller left, or shutdown), or a bug
                await _release(response, replica)
                raise
            return RelayedResponse(response, replica)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await relay("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await relay("/v1/chat/completions", raw)

    return app


def _relayed_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}


def _error_code(body: bytes) -> str | None:
    """The `code` of an OpenAI error body, if it is one."""
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


async def _release(response: httpx.Response | None, replica: Replica) -> None:
    replica.in_flight -= 1
    if response is not None:
        await response.aclose()


class RelayedResponse(StreamingResponse):
    """The replica's response as it arrives. However it ends (the body done, the
    caller gone before or while it streams, an error), the replica's connection is
    closed, which aborts the request there, and the replica's in-flight count drops
    exactly once."""

    def __init__(self, response: httpx.Response, replica: Replica) -> None:
        super().__init__(
            response.aiter_raw(),
            status_code=response.status_code,
            headers=_relayed_headers(response),
        )
        self.upstream, self.replica = response, replica

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await _release(self.upstream, self.replica)


def run_router(ns: argparse.Namespace) -> int:
    from pagoda.model_executor.model_loader import load_tokenizer, resolve_model

    if not ns.health_check_interval > 0:
        raise ValueError(f"health_check_interval must be > 0, got {ns.health_check_interval}.")
    path, is_gguf = resolve_model(ns.model)
    router = Router(
        ns.backend or [],
        ns.policy,
        ns.block_size,
        ns.balance_threshold,
        ns.prefix_table_size,
        tokenizer=load_tokenizer(path, is_gguf),
        discover="ray" if getattr(ns, "discover_ray", False) else ns.discover_dns,
        kv_events=getattr(ns, "kv_events", False),
    )
    if router.discover is not None:
        asyncio.run(router.discover_replicas())
    logger.info(
        "pagoda router: %d replicas (%s), policy %s%s, on http://%s:%d",
        len(router.replicas),
        ", ".join(r.url for r in router.replicas),
        ns.policy,
        " following their KV events" if router.kv_events else "",
        ns.host,
        ns.port,
    )
    from pagoda.entrypoints.openai.api_server import Server  # exits 0 on SIGTERM

    app = build_app(router, ns.health_check_interval)
    # On SIGTERM, streams in flight get their replicas' shutdown time, then are cut.
    config = uvicorn.Config(
        app, host=ns.host, port=ns.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=int(getattr(ns, "shutdown_timeout", 30)) + 5,
    )  # fmt: skip
    server = Server(config, shutdown_timeout=0)
    server.run()
    return server.exit_code
