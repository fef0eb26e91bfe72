"""Where each request goes: the prompt's chained block hashes (the engines' prefix
cache keys, `kv_cache_manager.hash_block`, same block size), scored against what each
healthy replica holds or was sent, each block weighed by where it is: its KV cache,
or a KV tier it would read (`PrefixTable`), under the configured policy:

- `prefix` (default): the replica holding the longest prefix; the least loaded one
  when none holds any, or when in-flight counts differ by more than
  `balance_threshold` (load first, then cache);
- `round-robin`, `least-loaded` (fewest requests in flight): for comparison;
- `pd`: each generation request through a prefill replica, then a decode replica
  (router/prefill.py); each pool chosen as `prefix` chooses.
"""

from __future__ import annotations

import itertools

from pagoda.core.kv_cache_manager import hash_block
from pagoda.entrypoints.router.config import RouterConfig
from pagoda.entrypoints.router.metrics import RouterMetrics
from pagoda.entrypoints.router.prefix_table import PrefixTable
from pagoda.entrypoints.router.replicas import Replica, ReplicaSet
from pagoda.entrypoints.router.tokens import PromptTokenizer


class Router:
    def __init__(
        self,
        config: RouterConfig,
        tokenizer: PromptTokenizer | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        """`metrics`: shared with another Router (policy pd's prefill pool), else new."""
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics or RouterMetrics()
        self.table = PrefixTable(config.prefix_table_size)
        self.replica_set = ReplicaSet(
            list(config.backends),
            self.metrics,
            on_down=lambda r: self.table.forget(r.index),
            discover=config.discover,
        )
        self._round_robin = itertools.count()

    @property
    def replicas(self) -> list[Replica]:
        return self.replica_set.replicas

    def set_health(self, replica: Replica, healthy: bool) -> None:
        self.replica_set.set_health(replica, healthy)

    def block_hashes(self, body: dict) -> list[bytes]:
        """The chained hashes of the prompt's full blocks ([] when it has no tokens the
        router can see: no tokenizer, or a prompt it cannot render)."""
        tokens = self._prompt_tokens(body)
        if not all(isinstance(t, int) and 0 <= t < 1 << 62 for t in tokens):
            return []  # ids no vocabulary has: the replica will refuse them
        size = self.config.block_size
        hashes, parent = [], None
        for start in range(0, len(tokens) - size + 1, size):
            parent = hash_block(parent, tokens[start : start + size])
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
                return self.tokenizer.chat([_text_only(m) for m in messages])
        except Exception:  # a prompt the engine will refuse, or a template that fails
            return []
        return []

    def choose(self, hashes: list[bytes], exclude: set[Replica] = frozenset()) -> Replica | None:
        candidates = [r for r in self.replicas if r.healthy and r not in exclude]
        if not candidates:
            return None
        turn = next(self._round_robin)
        if self.config.policy == "round-robin":  # (pd: as prefix, in each pool)
            return candidates[turn % len(candidates)]
        # Ties in load go round, so new prefixes spread out even when all are idle.
        n = len(candidates)
        order = {r: (pos - turn) % n for pos, r in enumerate(candidates)}
        least = min(candidates, key=lambda r: (r.in_flight, order[r]))
        if self.config.policy == "least-loaded" or not hashes:
            return least
        if max(r.in_flight for r in candidates) - least.in_flight > self.config.balance_threshold:
            return least
        matched = {r: self.table.score(hashes, r.index) for r in candidates}
        best = max(candidates, key=lambda r: (matched[r], -r.in_flight, -r.index))
        return best if matched[best] > 0 else least

    def record(self, hashes: list[bytes], replica: Replica) -> None:
        """The request of `hashes` went to `replica` (recorded when sent, so the same
        prefix arriving meanwhile finds where it went)."""
        if replica.removed:
            return
        self.metrics.requests_total.labels(replica.url).inc()
        if hashes:
            self.metrics.prompt_blocks.labels(replica.url).inc(len(hashes))
            self.metrics.matched_blocks.labels(replica.url).inc(
                self.table.matched_blocks(hashes, replica.index)
            )
            self.table.record(hashes, replica.index)

    def apply_kv_events(self, replica: Replica, times_down: int, batch) -> None:
        """A replica's KV events, from a follower started after it had gone down
        `times_down` times (a later follower, from a new snapshot, replaces it)."""
        if replica.removed or not replica.healthy or times_down != replica.times_down:
            return
        self.table.apply(batch, replica.index)
        self.metrics.kv_event_batches.labels(replica.url).inc()


def _text_only(message: dict) -> dict:
    """A chat message with its content parts' text joined (what prefix hashing needs)."""
    content = message.get("content")
    if isinstance(content, list):
        text = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return {**message, "content": text}
    return message
