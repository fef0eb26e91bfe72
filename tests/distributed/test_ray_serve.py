"""`pagoda serve --data-parallel-size N --distributed-executor-backend ray`: replicas as
Ray actors of a cluster started apart (`ray start --head`, as on a real cluster's head
node), behind the server's own router; `pagoda router --discover-ray` finds the same
replicas from another process; SIGTERM leaves no replica behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers import RemoteRouter, RemoteServer, free_port, reachable

pytest.importorskip("ray")


@pytest.fixture
def ray_head():
    """A Ray head node on this machine (two CPUs); its address."""
    port = free_port()
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
         "--node-ip-address=127.0.0.1",
         "--include-dashboard=false", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},  # no token for a local test cluster
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert head.poll() is None and time.monotonic() < deadline, "ray start failed"
        time.sleep(0.2)
    yield f"127.0.0.1:{port}"
    head.terminate()  # --block: stops the node's processes as it exits
    head.wait(60)


def _replica_urls(metrics_text: str) -> list[str]:
    return sorted(
        line.split('replica="')[1].split('"')[0]
        for line in metrics_text.splitlines()
        if line.startswith("pagoda_router:replica_healthy{")
    )


def test_replicas_as_ray_actors_and_found_by_a_router(ray_head, tiny_llama):
    # The head's auth mode, for every process of the cluster (a ray.init() earlier in
    # this process sets RAY_AUTH_MODE=token in its environment, which children inherit).
    env = {"RAY_ADDRESS": ray_head, "RAY_AUTH_MODE": "disabled"}
    server = RemoteServer(
        tiny_llama, "--data-parallel-size", "2", "--distributed-executor-backend", "ray", env=env
    )
    router = None
    try:
        client = server.client()
        for i in range(4):
            r = client.completions.create(model=tiny_llama, prompt=f"say {i}", max_tokens=3)
            assert r.choices[0].text is not None
        urls = _replica_urls(httpx.get(server.url + "/metrics").text)
        assert len(urls) == 2 and all(reachable(u) for u in urls)
        # Another router, anywhere on the cluster, finds the same replicas.
        router = RemoteRouter([], tiny_llama, "--discover-ray", env=env)
        r = router.client().completions.create(model=tiny_llama, prompt="hello", max_tokens=3)
        assert r.choices[0].text is not None
        assert _replica_urls(httpx.get(router.url + "/metrics").text) == urls
        assert server.terminate() == 0
        deadline = time.monotonic() + 30
        while any(reachable(u) for u in urls):  # no replica outlives its server
            assert time.monotonic() < deadline
            time.sleep(0.5)
    finally:
        if router is not None:
            router.stop()
        server.stop()
