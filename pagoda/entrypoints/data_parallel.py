"""`pagoda serve --data-parallel-size N`: N engine replicas behind one prefix router
(pagoda/entrypoints/router.py) on --host/--port. Each replica is a `pagoda serve`
process with the same arguments:

- `--distributed-executor-backend mp` (the default): on this machine, each on its
  share of the cores (pinned, and that many threads), on a free port of 127.0.0.1;
- `ray`: as Ray actors (`ReplicaActor`) wherever the cluster has room for their
  CPUs, each serving on its node's address; `RAY_ADDRESS` names the cluster (a local
  one starts otherwise). The actors are named, so `pagoda router --discover-ray` on
  any host of the cluster finds them too (`pagoda.ray_cluster.replica_urls`).

Either way the replicas end with this process, however it ends: SIGTERM first, and
the kernel's PR_SET_PDEATHSIG if it dies (a replica's process is its launcher's
child: this process's, or its actor's). A local replica that exits while this process
serves is started again on its port and cores, after a backoff that doubles with each
quick exit (`pagoda_router:replica_restarts` counts them); the router's next health
check takes it back.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time
import uuid

from pagoda.entrypoints.processes import (
    free_port,
    healthy,
    pin_child,
    stop_processes,
    without_options,
)
from pagoda.entrypoints.router import RouterConfig, run_router
from pagoda.ray_cluster import RAY_NAMESPACE, RAY_REPLICA_PREFIX, connect_ray

logger = logging.getLogger(__name__)

_REPLICA_STARTUP_S = 600  # a large model's load
# A replica that exits is started again after a backoff: 1 s, doubling while it keeps
# exiting within a minute of its start, at most 30 s.
_RESTART_BACKOFF_S = (1.0, 30.0)
_STABLE_S = 60.0


def run_data_parallel(ns: argparse.Namespace, argv: list[str]) -> int:
    """Start the replicas, wait until each is healthy, then run the router in front of
    them until SIGTERM (exit status 0) or a failure; the replicas stop with it."""
    n = ns.data_parallel_size
    args = without_options(argv, ("--data-parallel-size", "--port", "--host"))  # "serve" ...
    if ns.distributed_executor_backend == "ray":
        world = ns.tensor_parallel_size * ns.pipeline_parallel_size
        replicas = _RayReplicas(n, args, ns.num_threads, world)
    else:
        replicas = _LocalReplicas(n, args, ns.num_threads)
    try:
        urls = replicas.start()
        deadline = time.monotonic() + _REPLICA_STARTUP_S
        for i, url in enumerate(urls):
            while not healthy(url):
                if (code := replicas.exit_code(i)) is not None:
                    raise RuntimeError(f"replica {url} exited with {code}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replica {url} not ready in {_REPLICA_STARTUP_S} s")
                time.sleep(0.5)
        config = RouterConfig(
            backends=tuple(urls),
            model=ns.model,
            block_size=ns.block_size,
            kv_events=True,  # the replicas are pagoda's: follow their caches
            host=ns.host,
            port=ns.port,
            shutdown_timeout=ns.shutdown_timeout,
        )
        on_start = getattr(replicas, "supervise", None)  # local replicas come back
        return run_router(config, on_start=on_start)
    finally:
        replicas.stop(ns.shutdown_timeout + 15)


class _LocalReplicas:
    """Replicas as processes of this machine, each pinned to its share of the cores;
    one that exits is started again (`supervise`)."""

    def __init__(self, n: int, args: list[str], num_threads: int | None) -> None:
        cores = sorted(os.sched_getaffinity(0))
        if not 1 <= n <= len(cores):
            raise ValueError(f"data_parallel_size must be 1..{len(cores)} (the cores), got {n}.")
        self.n, self.args, self.num_threads, self.cores = n, args, num_threads, cores
        self.procs: list[subprocess.Popen] = []
        self.commands: list[list[str]] = []
        self.shares: list[list[int]] = []
        self.urls: list[str] = []
        self.started_at: list[float] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # the supervisor's restarts against stop()

    def start(self) -> list[str]:
        for i in range(self.n):
            share = self.cores[i * len(self.cores) // self.n : (i + 1) * len(self.cores) // self.n]
            port = free_port("127.0.0.1")
            cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", *self.args]
            cmd += ["--host", "127.0.0.1", "--port", str(port)]
            if self.num_threads is None:
                cmd += ["--num-threads", str(len(share))]
            self.commands.append(cmd)
            self.shares.append(share)
            self.urls.append(f"http://127.0.0.1:{port}")
            self.procs.append(self._launch(i))
            self.started_at.append(time.monotonic())
            logger.info(
                "replica %d: pid %d on cores %s, %s", i, self.procs[i].pid, share, self.urls[i]
            )
        return list(self.urls)

    def _launch(self, i: int) -> subprocess.Popen:
        return subprocess.Popen(self.commands[i], preexec_fn=lambda s=self.shares[i]: pin_child(s))

    def exit_code(self, i: int) -> int | None:
        return self.procs[i].poll()

    def supervise(self, router) -> None:
        """Watch the replicas while the router serves: one that exits is started again
        (on its port and cores) after its backoff; restarts count in the router's
        metrics."""
        thread = threading.Thread(
            target=self._watch, args=(router.metrics,), name="pagoda-replicas", daemon=True
        )
        thread.start()

    def _watch(self, metrics) -> None:
        backoff = [_RESTART_BACKOFF_S[0]] * self.n
        due: list[float | None] = [None] * self.n  # when an exited replica starts again
        while not self._stopping.wait(0.25):
            now = time.monotonic()
            for i, proc in enumerate(self.procs):
                code = proc.poll()
                if code is None:
                    continue
                if due[i] is None:
                    if now - self.started_at[i] > _STABLE_S:
                        backoff[i] = _RESTART_BACKOFF_S[0]
                    due[i] = now + backoff[i]
                    logger.warning(
                        "replica %d (pid %d, %s) exited with status %s; starting it again "
                        "in %.0f s", i, proc.pid, self.urls[i], code, backoff[i],
                    )  # fmt: skip
                    backoff[i] = min(2 * backoff[i], _RESTART_BACKOFF_S[1])
                elif now >= due[i]:
                    with self._lock:
                        if self._stopping.is_set():
                            return
                        self.procs[i] = self._launch(i)
                    self.started_at[i], due[i] = now, None
                    metrics.replica_restarts.labels(self.urls[i]).inc()
                    logger.info("replica %d: started again, pid %d", i, self.procs[i].pid)

    def stop(self, grace_s: float) -> None:
        with self._lock:
            self._stopping.set()
        stop_processes(self.procs, grace_s)


class ReplicaActor:
    """A replica as a Ray actor: a `pagoda serve` process on the actor's node, serving
    on the node's address. Its engine reaches the same cluster (a split model's
    workers, with `--distributed-executor-backend ray`)."""

    def __init__(self, args: list[str], num_threads: int) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        port = free_port(host)
        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", *args]
        cmd += ["--host", host, "--port", str(port), "--num-threads", str(num_threads)]
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=lambda: pin_child(None))
        self._url = f"http://{host}:{port}"

    def url(self) -> str:
        return self._url

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float) -> None:
        stop_processes([self.proc], grace_s)


class _RayReplicas:
    """Replicas as named Ray actors, each reserving its share of the cluster's CPUs."""

    def __init__(self, n: int, args: list[str], num_threads: int | None, world: int) -> None:
        """`world`: the workers each replica's model is split across (1: none); they
        reserve the CPUs (each its share), and the replica's own actor then none."""
        if n < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {n}.")
        ray = connect_ray()
        logger.info("Ray cluster at %s", ray.get_runtime_context().gcs_address)
        self.ray = ray
        cluster_cpus = int(ray.cluster_resources().get("CPU", 1))
        self.cpus = num_threads or max(1, cluster_cpus // (n * world))  # per process
        self.n, self.args, self.split = n, args, world > 1
        self.group = uuid.uuid4().hex[:8]
        self.actors: list = []

    def start(self) -> list[str]:
        ray = self.ray
        actor = ray.remote(ReplicaActor)
        for i in range(self.n):
            options = dict(
                name=f"{RAY_REPLICA_PREFIX}{self.group}-{i}",
                namespace=RAY_NAMESPACE,
                num_cpus=0 if self.split else self.cpus,
            )
            self.actors.append(actor.options(**options).remote(self.args, self.cpus))
        try:
            urls = ray.get([a.url.remote() for a in self.actors], timeout=_REPLICA_STARTUP_S)
        except ray.exceptions.GetTimeoutError as e:
            raise RuntimeError(
                f"the Ray cluster has no room for {self.n} replicas of {self.cpus} CPUs "
                f"each ({ray.cluster_resources()})."
            ) from e
        for i, url in enumerate(urls):
            logger.info(
                "replica %d: Ray actor %s%s-%d, %s", i, RAY_REPLICA_PREFIX, self.group, i, url
            )
        return urls

    def exit_code(self, i: int) -> int | None:
        return self.ray.get(self.actors[i].exit_code.remote())

    def stop(self, grace_s: float) -> None:
        ray = self.ray
        try:
            ray.get([a.stop.remote(grace_s) for a in self.actors], timeout=grace_s + 5)
        except Exception:  # an actor already gone: killing it below is enough
            logger.exception("stopping the Ray replicas")
        for a in self.actors:
            ray.kill(a)
        self.actors = []
