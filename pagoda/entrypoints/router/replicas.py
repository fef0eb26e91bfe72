"""The replicas behind the router: who they are (named, or discovered through DNS
or the Ray cluster), whether each is up, and how many requests each has in flight."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from pagoda import ray_cluster
from pagoda.entrypoints.router.config import host_port
from pagoda.entrypoints.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Replica:
    url: str
    index: int
    healthy: bool = True
    in_flight: int = 0
    removed: bool = False  # no longer among the router's replicas (discovery)
    times_down: int = 0  # how often it went down (its KV events start again after each)


class ReplicaSet:
    def __init__(
        self,
        urls: list[str],
        metrics: RouterMetrics,
        on_down: Callable[[Replica], None],
        discover: str | None = None,
    ) -> None:
        """`on_down(replica)`: called when a replica goes down or is removed (what the
        router knew of its cache is gone with it). `discover`: see RouterConfig."""
        self.replicas: list[Replica] = []
        self.metrics = metrics
        self.on_down = on_down
        self.discover = discover
        self._next_index = 0
        self.set_urls(urls)

    def set_urls(self, urls: list[str]) -> None:
        """Replicas for `urls`: those already known keep their state, new ones start
        healthy with an empty table, and ones no longer named are dropped."""
        urls = [u.rstrip("/") for u in urls]
        known = {r.url: r for r in self.replicas}
        for r in self.replicas:
            if r.url not in urls:
                logger.info("router: replica %s removed", r.url)
                r.removed = True  # a relay still holding it must not bring it back
                self.on_down(r)
                self.metrics.forget(r.url)
        self.replicas = []
        for url in dict.fromkeys(urls):
            replica = known.get(url)
            if replica is None:
                replica = Replica(url, self._next_index)
                self._next_index += 1
                self.metrics.healthy.labels(url).set(1)
                self.metrics.in_flight.labels(url).set_function(lambda r=replica: r.in_flight)
                if known:
                    logger.info("router: replica %s added", url)
            self.replicas.append(replica)

    async def rediscover(self) -> None:
        """With `discover`: the replicas are what its host resolves to now, or the Ray
        cluster's replica actors (kept as they are when the lookup fails)."""
        if self.discover == "ray":
            try:
                self.set_urls(await asyncio.to_thread(ray_cluster.replica_urls))
            except Exception as e:  # the cluster is unreachable for now
                logger.warning("router: cannot list the Ray cluster's replicas (%r)", e)
            return
        host, port = host_port(self.discover)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
        except OSError as e:
            logger.warning("router: cannot resolve %s (%s)", host, e)
            return
        addresses = sorted({info[4][0] for info in infos})
        self.set_urls(
            [f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in addresses]
        )

    def set_health(self, replica: Replica, healthy: bool) -> None:
        if replica.removed:
            return
        if replica.healthy and not healthy:
            logger.warning("router: replica %s is down", replica.url)
            self.on_down(replica)
            replica.times_down += 1
        elif healthy and not replica.healthy:
            logger.info("router: replica %s is back", replica.url)
        replica.healthy = healthy
        self.metrics.healthy.labels(replica.url).set(int(healthy))
