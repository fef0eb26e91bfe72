"""`pagoda router`: one OpenAI endpoint in front of several engine replicas, sending
each request where its prompt's prefix is most likely already in the KV cache.

The router tokenizes the prompt (the model's tokenizer and chat template, as the
engines do: `tokens.py`, without torch) and hashes it into the chained block hashes
the engines' prefix caches use. It remembers which replicas it sent each block to
(its own routing history, an LRU of `prefix_table_size` blocks) and, with
`kv_events`, follows each replica's prefix cache as it changes (`GET /kv_events`:
blocks stored and evicted; see prefix_table.py).

    config.py        RouterConfig: the flags, checked once
    policy.py        Router: block hashes, the choice of replica, what was sent where
    replicas.py      ReplicaSet: membership (named, DNS, Ray), health, in-flight counts
    prefix_table.py  PrefixTable, and the KV event followers that feed it
    tokens.py        PromptTokenizer: prompts as token ids, torch-free
    metrics.py       RouterMetrics: the router's /metrics
    app.py           the HTTP app: relaying, retries, health checks; run_router
"""

import importlib

from pagoda.entrypoints.router.config import POLICIES, RouterConfig

__all__ = ["POLICIES", "Router", "RouterConfig", "build_app", "run_router"]
# The HTTP app and the policy on first use: the CLI reads config.py's POLICIES for its
# flags, and every command would otherwise pay for FastAPI's import (0.8 s).
_LAZY = {"build_app": "app", "run_router": "app", "Router": "policy"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
