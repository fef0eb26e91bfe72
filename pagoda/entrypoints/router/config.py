"""The router's settings, checked once (`pagoda router`'s flags; the same fields for
`pagoda serve --data-parallel-size N`, which runs a router in front of its replicas)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

POLICIES = ("prefix", "round-robin", "least-loaded", "pd")


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[str, ...] = ()  # the replicas' base URLs (with policy "pd": decode's)
    # Policy "pd": each request is prefilled on one of these first (a one-token request),
    # its blocks passing to the decode replica through the disk tier they share; the
    # replicas of each pool are chosen as "prefix" chooses.
    prefill_backends: tuple[str, ...] = ()
    policy: str = "prefix"
    block_size: int = 16  # the engines' (prefix hashes are per block)
    # In-flight difference past which the least loaded replica wins (prefix policy).
    # 64: from benchmarks/sim_routing.py (100 simulated replicas, shared prefixes), where
    # 16 kept 0.57 of prompt tokens cached and 64 kept 0.70, TTFT p50 0.55x; 0 (always
    # the least loaded) kept 0.03.
    balance_threshold: int = 64
    prefix_table_size: int = 1 << 20  # blocks the router remembers
    # "HOST:PORT": the replicas are the addresses HOST resolves to (a headless Kubernetes
    # Service), looked up again at each health check; "ray": the Ray cluster's replica
    # actors (see data_parallel.py); None: `backends` only.
    discover: str | None = None
    kv_events: bool = False  # follow the replicas' prefix caches (GET /kv_events)
    health_check_interval: float = 2.0  # seconds
    model: str | None = None  # whose tokenizer hashes prompts (None: the default model)
    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_timeout: float = 30.0  # seconds streams in flight get on SIGTERM

    def __post_init__(self) -> None:
        if not self.backends and self.discover is None:
            raise ValueError(
                "router: name replicas with --backend, --discover-dns or --discover-ray."
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}.")
        if (self.policy == "pd") != bool(self.prefill_backends):
            raise ValueError(
                "router: --policy pd takes --prefill URL... (and --decode URL...), and "
                "--prefill only goes with --policy pd."
            )
        if self.block_size < 1 or self.prefix_table_size < 1:
            raise ValueError("block_size and prefix_table_size must be >= 1.")
        if self.balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0, got {self.balance_threshold}.")
        if not self.health_check_interval > 0:
            raise ValueError(
                f"health_check_interval must be > 0, got {self.health_check_interval}."
            )
        if self.discover not in (None, "ray"):
            host_port(self.discover)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> RouterConfig:
        """From `pagoda router`'s flags (cli.add_router_args)."""
        return cls(
            backends=tuple(ns.backend or ()),
            prefill_backends=tuple(getattr(ns, "prefill", None) or ()),
            policy=ns.policy,
            block_size=ns.block_size,
            balance_threshold=ns.balance_threshold,
            prefix_table_size=ns.prefix_table_size,
            discover="ray" if getattr(ns, "discover_ray", False) else ns.discover_dns,
            kv_events=getattr(ns, "kv_events", False),
            health_check_interval=ns.health_check_interval,
            model=ns.model,
            host=ns.host,
            port=ns.port,
            shutdown_timeout=float(getattr(ns, "shutdown_timeout", 30)),
        )


def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"discover_dns must be HOST:PORT, got {text!r}.")
    return host, int(port)
