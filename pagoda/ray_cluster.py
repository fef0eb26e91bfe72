"""Ray, where pagoda uses it (torch-free): connecting to a cluster, and finding the
replica actors that `pagoda serve --data-parallel-size N --distributed-executor-backend
ray` placed there (named, in one namespace, so any host's router finds them)."""

from __future__ import annotations

import os

RAY_NAMESPACE = "pagoda"
RAY_REPLICA_PREFIX = "pagoda-replica-"


def connect_ray(address: str | None = None):
    """The `ray` module, connected to the cluster `address` names (default:
    `RAY_ADDRESS`; neither: a local instance starts). Raises ValueError without ray."""
    try:
        import ray
    except ImportError as e:
        raise ValueError(
            "distributed_executor_backend 'ray' needs the ray package (pip install 'pagoda[ray]')."
        ) from e
    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    return ray


def replica_urls() -> list[str]:
    """The URLs of every replica actor in the Ray cluster (`RAY_ADDRESS`, or the one on
    this host): what `pagoda router --discover-ray` routes over."""
    ray = connect_ray(os.environ.get("RAY_ADDRESS", "auto"))  # never a new local one
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == RAY_NAMESPACE and a["name"].startswith(RAY_REPLICA_PREFIX)
    ]
    calls = []
    for name in names:
        try:
            calls.append(ray.get_actor(name, namespace=RAY_NAMESPACE).url.remote())
        except ValueError:  # gone since it was listed
            continue
    urls = []
    for call in calls:
        try:
            urls.append(ray.get(call, timeout=10))
        except ray.exceptions.RayError:  # dead or stuck: not a replica now
            continue
    return sorted(urls)
