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
child: this process's, or its actor's).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import httpx

from pagoda.entrypoints.router import RouterConfig, run_router
from pagoda.ray_cluster import RAY_NAMESPACE, RAY_REPLICA_PREFIX, connect_ray

logger = logging.getLogger(__name__)

_REPLICA_STARTUP_S = 600  # a large model's load


def run_data_parallel(ns: argparse.Namespace, argv: list[str]) -> int:
    """Start the replicas, wait until each is healthy, then run the router in front of
    them until SIGTERM (exit status 0) or a failure; the replicas stop with it."""
    n = ns.data_parallel_size
    args = _without_options(argv, ("--data-parallel-size", "--port", "--host"))  # "serve" ...
    if ns.distributed_executor_backend == "ray":
        world = ns.tensor_parallel_size * ns.pipeline_parallel_size
        replicas = _RayReplicas(n, args, ns.num_threads, world)
    else:
        replicas = _LocalReplicas(n, args, ns.num_threads)
    try:
        urls = replicas.start()
        deadline = time.monotonic() + _REPLICA_STARTUP_S
        for i, url in enumerate(urls):
            while not _healthy(url):
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
        return run_router(config)
    finally:
        replicas.stop(ns.shutdown_timeout + 15)


class _LocalReplicas:
    """Replicas as processes of this machine, each pinned to its share of the cores."""

    def __init__(self, n: int, args: list[str], num_threads: int | None) -> None:
        cores = sorted(os.sched_getaffinity(0))
        if not 1 <= n <= len(cores):
            raise ValueError(f"data_parallel_size must be 1..{len(cores)} (the cores), got {n}.")
        self.n, self.args, self.num_threads, self.cores = n, args, num_threads, cores
        self.procs: list[subprocess.Popen] = []

    def start(self) -> list[str]:
        urls = []
        for i in range(self.n):
            share = self.cores[i * len(self.cores) // self.n : (i + 1) * len(self.cores) // self.n]
            port = _free_port("127.0.0.1")
            cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", *self.args]
            cmd += ["--host", "127.0.0.1", "--port", str(port)]
            if self.num_threads is None:
                cmd += ["--num-threads", str(len(share))]
            proc = subprocess.Popen(cmd, preexec_fn=lambda share=share: _pin_child(share))
            self.procs.append(proc)
            urls.append(f"http://127.0.0.1:{port}")
            logger.info("replica %d: pid %d on cores %s, %s", i, proc.pid, share, urls[-1])
        return urls

    def exit_code(self, i: int) -> int | None:
        return self.procs[i].poll()

    def stop(self, grace_s: float) -> None:
        _stop_processes(self.procs, grace_s)


class ReplicaActor:
    """A replica as a Ray actor: a `pagoda serve` process on the actor's node, serving
    on the node's address. Its engine reaches the same cluster (a split model's
    workers, with `--distributed-executor-backend ray`)."""

    def __init__(self, args: list[str], num_threads: int) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        port = _free_port(host)
        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", *args]
        cmd += ["--host", host, "--port", str(port), "--num-threads", str(num_threads)]
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=lambda: _pin_child(None))
        self._url = f"http://{host}:{port}"

    def url(self) -> str:
        return self._url

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float) -> None:
        _stop_processes([self.proc], grace_s)


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


def _stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _pin_child(cores: list[int] | None) -> None:
    """In the replica's process before it runs: its cores, and SIGTERM when its
    parent dies."""
    import ctypes

    if cores is not None:
        os.sched_setaffinity(0, cores)
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv without the options `names` (as `--name value` or `--name=value`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(name + "=") for name in names):
            out.append(arg)
    return out
