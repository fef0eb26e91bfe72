"""The models a many-model server holds: each loaded model is a `pagoda serve` child
process on a port of 127.0.0.1 (a crash takes down that model alone, and an unload
gives all its memory back), started on the model's first request.

Loads go one at a time. Before one, room is made: past `max_loaded` models, or when
the model's estimated memory (its weights, its KV cache, the runtime) is more than
the machine has available, the least recently used idle models are unloaded; a load
that still would not fit is refused (503 naming the model and the memory). A model
idle for `keep_alive` seconds is unloaded; one whose process exits is marked
unloaded and loads again on its next request.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import subprocess
import sys
import threading
import time

import httpx

from pagoda.entrypoints.multi_model.metrics import HostMetrics
from pagoda.entrypoints.processes import free_port, pin_child, stop_processes
from pagoda.model_executor.model_catalog import ModelEntry

logger = logging.getLogger(__name__)

GiB = 1 << 30
# What a serving process holds besides weights and KV cache (Python, torch, the
# tokenizer, buffers): measured at about 0.6 GiB for SmolLM2 (RSS minus the two).
RUNTIME_BYTES = 768 << 20
DEFAULT_KV_CACHE_BYTES = 4 << 30  # the engine's default, at most (engine_args)


class LoadError(Exception):
    """A request for a model that cannot be served now, as an HTTP status and code."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class HostedModel:
    """One model of the catalog, and its server while loaded."""

    def __init__(self, entry: ModelEntry) -> None:
        self.entry = entry
        self.state = "unloaded"  # "loading", "loaded", "unloading"
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.card: dict | None = None  # its server's /v1/models card, once loaded
        self.loading: asyncio.Task | None = None
        self.last_used = 0.0
        self.log_tail: collections.deque[str] = collections.deque(maxlen=20)
        self._in_flight = 0

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @in_flight.setter
    def in_flight(self, n: int) -> None:
        # Counted from each request's start and end alike, so idleness runs from the
        # last request's end.
        self._in_flight = n
        self.last_used = time.monotonic()


class ModelHost:
    def __init__(
        self,
        models: dict[str, ModelEntry],
        server_args: list[str],
        *,
        max_loaded: int = 4,
        keep_alive: float | None = None,
        kv_cache_bytes: int | None = None,
        api_key: str | None = None,
        shutdown_timeout: float = 30.0,
        load_timeout: float = 600.0,
    ) -> None:
        """`server_args`: `pagoda serve`'s flags for every model (the engine's, the
        API key's ...); `kv_cache_bytes`: theirs, if given (for the memory estimate)."""
        if not models:
            raise ValueError("no models to serve: --models-dir is empty and no --model named.")
        if max_loaded < 1:
            raise ValueError(f"max_loaded_models must be >= 1, got {max_loaded}.")
        if keep_alive is not None and keep_alive < 0:
            raise ValueError(f"keep_alive must be >= 0 seconds, got {keep_alive}.")
        self.models = {name: HostedModel(entry) for name, entry in models.items()}
        self.server_args = server_args
        self.max_loaded, self.keep_alive = max_loaded, keep_alive
        self.kv_cache_bytes = kv_cache_bytes
        self.shutdown_timeout, self.load_timeout = shutdown_timeout, load_timeout
        self.metrics = HostMetrics(self.models.values())
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(max_connections=None),
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        )
        self._loads = asyncio.Lock()  # one load at a time: each sees the memory the last took

    def get(self, name: object) -> HostedModel:
        if isinstance(name, str) and name in self.models:
            return self.models[name]
        if name is None and len(self.models) == 1:
            return next(iter(self.models.values()))
        served = ", ".join(self.models)
        if not isinstance(name, str):
            raise LoadError(400, f"model is required; this server serves: {served}.", "model")
        raise LoadError(
            404, f"The model `{name}` does not exist. This server serves: {served}.",
            "model_not_found",
        )  # fmt: skip

    def loaded(self) -> list[HostedModel]:
        return [m for m in self.models.values() if m.state in ("loading", "loaded")]

    # ---- loading ------------------------------------------------------------------------

    async def ready(self, model: HostedModel) -> HostedModel:
        """`model`, loaded: now, once its load in progress ends, or after loading it."""
        while True:
            if model.state == "loaded" and model.proc is not None and model.proc.poll() is None:
                return model
            if model.state == "unloading":
                await asyncio.sleep(0.1)
                continue
            if model.loading is None:
                model.loading = asyncio.create_task(self._load(model))
                model.loading.add_done_callback(lambda _, m=model: setattr(m, "loading", None))
            # Shielded: a caller that leaves does not stop the load others wait on.
            await asyncio.shield(model.loading)

    def check_fits(self, model: HostedModel) -> None:
        """Refuse now (503) a model that could not fit even with every idle model
        unloaded, before anything is started for it."""
        if model.state == "loaded":
            return
        reclaimable = sum(
            self.estimate(m) for m in self.loaded() if m.state == "loaded" and m.in_flight == 0
        )
        if self.estimate(model) > mem_available() + reclaimable:
            raise self._too_big(model)

    def estimate(self, model: HostedModel) -> int:
        kv = self.kv_cache_bytes
        if kv is None:  # the engine's default, from what is available when it starts
            kv = min(DEFAULT_KV_CACHE_BYTES, mem_available() // 4)
        return model.entry.size_bytes + kv + RUNTIME_BYTES

    def _too_big(self, model: HostedModel) -> LoadError:
        others = [m.name for m in self.loaded() if m is not model]
        return LoadError(
            503,
            f"The model `{model.name}` needs about {self.estimate(model) / GiB:.1f} GiB "
            f"(weights {model.entry.size_bytes / GiB:.2f} GiB, KV cache and runtime the "
            f"rest) and {mem_available() / GiB:.1f} GiB is available"
            + (f" with {', '.join(others)} loaded and busy." if others else "."),
            "insufficient_memory",
        )

    async def _load(self, model: HostedModel) -> None:
        async with self._loads:
            if model.state == "loaded":
                return
            started = time.monotonic()
            model.state = "loading"
            try:
                await self._make_room(model)
                port = free_port("127.0.0.1")
                model.url = f"http://127.0.0.1:{port}"
                model.proc = self._spawn(model, port)
                await self._wait_healthy(model)
                r = await self.client.get(model.url + "/v1/models", timeout=10.0)
                model.card = next(c for c in r.json()["data"] if c["id"] == model.name)
            except BaseException:
                if model.proc is not None:
                    await asyncio.to_thread(stop_processes, [model.proc], 5.0)
                model.state, model.proc, model.card = "unloaded", None, None
                raise
            model.state = "loaded"
            model.last_used = time.monotonic()
            elapsed = time.monotonic() - started
            self.metrics.loaded(model.name, elapsed)
            logger.info("model %s loaded in %.1f s (%s)", model.name, elapsed, model.url)

    async def _make_room(self, model: HostedModel) -> None:
        """Unload the least recently used idle models until `model` fits, in count and
        in memory; wait while the models to unload are all busy (count), refuse when
        memory cannot be found (503)."""
        deadline = time.monotonic() + self.load_timeout
        while True:
            others = [m for m in self.loaded() if m is not model]
            too_many = len(others) >= self.max_loaded
            too_big = self.estimate(model) > mem_available()
            if not too_many and not too_big:
                return
            idle = [m for m in others if m.state == "loaded" and m.in_flight == 0]
            if idle:
                await self.unload(min(idle, key=lambda m: m.last_used), "room")
                continue
            if too_big:
                raise self._too_big(model)
            if time.monotonic() > deadline:
                raise LoadError(
                    503, f"The model `{model.name}` waited {self.load_timeout:.0f} s for one "
                    f"of the {self.max_loaded} loaded models to be idle.", "too_many_models",
                )  # fmt: skip
            await asyncio.sleep(0.2)

    def _spawn(self, model: HostedModel, port: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", model.entry.path]
        cmd += ["--served-model-name", model.name, "--host", "127.0.0.1", "--port", str(port)]
        cmd += self.server_args
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            preexec_fn=lambda: pin_child(None),
        )
        threading.Thread(
            target=_copy_log, args=(proc, model), name=f"log-{model.name}", daemon=True
        ).start()
        logger.info("model %s: loading %s (pid %d)", model.name, model.entry.path, proc.pid)
        return proc

    async def _wait_healthy(self, model: HostedModel) -> None:
        deadline = time.monotonic() + self.load_timeout
        while True:
            if (code := model.proc.poll()) is not None:
                await asyncio.sleep(0.2)  # the log's last lines
                tail = " | ".join(line.strip() for line in list(model.log_tail)[-3:])
                raise LoadError(
                    503, f"The model `{model.name}` failed to load (exit status {code}): {tail}",
                    "model_load_failed",
                )  # fmt: skip
            if time.monotonic() > deadline:
                raise LoadError(
                    503, f"The model `{model.name}` did not load in {self.load_timeout:.0f} s.",
                    "model_load_failed",
                )  # fmt: skip
            try:
                r = await self.client.get(model.url + "/health", timeout=1.0)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)

    # ---- unloading ----------------------------------------------------------------------

    async def unload(self, model: HostedModel, reason: str) -> bool:
        """Stop `model`'s server (its requests in flight get the shutdown timeout to
        finish); False if it was not loaded."""
        if model.state != "loaded":
            return False
        model.state = "unloading"
        proc = model.proc
        await asyncio.to_thread(stop_processes, [proc], self.shutdown_timeout + 15)
        model.state, model.proc, model.card = "unloaded", None, None
        self.metrics.unloaded(model.name, reason)
        logger.info("model %s unloaded (%s)", model.name, reason)
        return True

    async def watch(self, interval: float = 0.5) -> None:
        """Forever: models whose server exited are marked unloaded; models idle past
        keep-alive are unloaded."""
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for model in list(self.models.values()):
                if model.state != "loaded":
                    continue
                if (code := model.proc.poll()) is not None:
                    logger.warning(
                        "model %s: its server exited with status %s; it loads again on its "
                        "next request", model.name, code,
                    )  # fmt: skip
                    model.state, model.proc, model.card = "unloaded", None, None
                    self.metrics.unloaded(model.name, "exited")
                elif (
                    self.keep_alive is not None
                    and model.in_flight == 0
                    and now - model.last_used >= self.keep_alive
                ):
                    await self.unload(model, "idle")

    async def close(self) -> None:
        procs = [m.proc for m in self.models.values() if m.proc is not None]
        await asyncio.to_thread(stop_processes, procs, self.shutdown_timeout + 15)
        for m in self.models.values():
            m.state, m.proc, m.card = "unloaded", None, None
        await self.client.aclose()


def _copy_log(proc: subprocess.Popen, model: HostedModel) -> None:
    """The model server's output, to ours line by line under its name; the last lines
    kept for a failed load's message."""
    for line in proc.stdout:
        model.log_tail.append(line)
        sys.stderr.write(f"[{model.name}] {line}")


def mem_available() -> int:
    """The kernel's estimate of memory available without swapping (MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")
