"""Speculative method "draft": a cheaper model with the target's vocabulary proposes
each request's next k tokens, greedily, just before the target verifies them in the
same step.

The draft keeps its K/V in a pool of its own with the target's block count, read and
written through the same block tables and slots, so the scheduler's one block table
serves both models (as in vLLM). The scheduler counts the draft's current positions
(`Request.num_draft_computed`) and hands over the known tokens past them; a request
new to the draft (admitted, forked, preempted and back) starts from position 0, so
blocks that came from the prefix cache or a swap never need the draft's K/V.

Greedy drafts are point masses: the target keeps a draft exactly when it samples it
(`model_runner._num_accepted`), which is rejection sampling for such a draft, so
outputs keep the target's distribution and greedy ones its exact tokens.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from pagoda.attention.context import forward_context
from pagoda.attention.kv_cache import PagedKVCache
from pagoda.config import MAX_SPECULATIVE_TOKENS, ModelConfig
from pagoda.core.sched_output import ScheduledRequest
from pagoda.ops import Ops
from pagoda.worker.inputs import is_decode, prepare_inputs
from pagoda.worker.model_setup import attach_kv_cache, kv_cache_shape, load_model

logger = logging.getLogger(__name__)

# The most tokens of one request the draft computes in one forward while catching up
# (the engine's default max_num_batched_tokens).
DRAFT_CHUNK_TOKENS = 2048


class DraftModel:
    def __init__(self, model_config: ModelConfig, ops: Ops, block_size: int) -> None:
        self.model_config = model_config
        self.block_size = block_size
        self.model = load_model(model_config, ops)
        self.kv_shape = kv_cache_shape(self.model)
        self.kv_cache: PagedKVCache | None = None  # allocate_kv_cache

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        return PagedKVCache.bytes_per_block_of(self.kv_shape, self.block_size, dtype)

    def allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        self.kv_cache = PagedKVCache.of(self.kv_shape, num_blocks, self.block_size, dtype)
        attach_kv_cache(self.model, self.kv_cache)
        if not self.model_config.enforce_eager:  # the loop holds the layers' caches
            self.model.build_decode_loop()
        logger.info(
            "draft model %s (%s): its own KV pool of %d blocks (%.1f MiB), on the target's "
            "block tables",
            self.model_config.model,
            self.model_config.quantization,
            num_blocks,
            num_blocks * self.bytes_per_block(dtype) / 2**20,
        )

    def propose(self, reqs: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """`reqs` with each one's placeholder drafts replaced by the draft model's."""
        drafting = [r for r in reqs if r.draft_input_ids]
        if not drafting:
            return reqs
        # First the known tokens it has not computed (one, or two after a full
        # acceptance; the whole sequence when new, in chunks), then one token at a
        # time: draft j goes in at the position after the last known token + j - 1.
        drafting = self._catch_up(drafting)
        first = [
            replace(
                r,
                token_ids=r.draft_input_ids,
                num_computed_tokens=r.draft_input_start,
                # A short catch-up runs as decode rows (the C++ loop's), a long one as
                # a prefill chunk.
                num_draft_tokens=len(r.draft_input_ids) - 1
                if len(r.draft_input_ids) <= MAX_SPECULATIVE_TOKENS + 1
                else 0,
            )
            for r in drafting
        ]
        drafts = [[t] for t in self._greedy_step(first)]
        for j in range(1, max(r.num_draft_tokens for r in drafting)):
            live = [i for i, r in enumerate(drafting) if r.num_draft_tokens > j]
            views = [
                replace(
                    drafting[i],
                    token_ids=[drafts[i][-1]],
                    num_computed_tokens=_last_known_position(drafting[i]) + j,
                    num_draft_tokens=0,
                )
                for i in live
            ]
            for i, token in zip(live, self._greedy_step(views), strict=True):
                drafts[i].append(token)
        by_id = {
            r.request_id: replace(r, token_ids=r.token_ids[: -r.num_draft_tokens] + d)
            for r, d in zip(drafting, drafts, strict=True)
        }
        return [by_id.get(r.request_id, r) for r in reqs]

    def _catch_up(self, drafting: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """Run the catch-ups longer than a chunk up to their last chunk, a chunk per
        forward as the target's prefills go, so a long sequence new to the draft (or
        one it fell behind on while speculation was off) never runs in one forward;
        returns the requests with what is left to catch up."""
        while any(len(r.draft_input_ids) > DRAFT_CHUNK_TOKENS for r in drafting):
            long = [r for r in drafting if len(r.draft_input_ids) > DRAFT_CHUNK_TOKENS]
            views = [
                replace(
                    r,
                    token_ids=r.draft_input_ids[:DRAFT_CHUNK_TOKENS],
                    num_computed_tokens=r.draft_input_start,
                    num_draft_tokens=0,
                )
                for r in long
            ]
            input_ids, positions, meta, _ = prepare_inputs(views, self.block_size)
            with forward_context(meta, None):
                self.model(input_ids, positions)
            advanced = {
                r.request_id: replace(
                    r,
                    draft_input_ids=r.draft_input_ids[DRAFT_CHUNK_TOKENS:],
                    draft_input_start=r.draft_input_start + DRAFT_CHUNK_TOKENS,
                )
                for r in long
            }
            drafting = [advanced.get(r.request_id, r) for r in drafting]
        return drafting

    def _greedy_step(self, views: list[ScheduledRequest]) -> list[int]:
        """One draft forward over `views` (each a run of tokens at its positions):
        the argmax after each view's last token, in the order given."""
        order = sorted(range(len(views)), key=lambda i: not is_decode(views[i]))
        batch = [views[i] for i in order]
        input_ids, positions, meta, cu_q = prepare_inputs(batch, self.block_size)
        with forward_context(meta, None):
            hidden = self.model(input_ids, positions)
        logits = self.model.compute_logits(hidden[cu_q[1:] - 1])
        tokens = logits.argmax(-1).tolist()
        out = [0] * len(views)
        for slot, i in enumerate(order):
            out[i] = tokens[slot]
        return out


def _last_known_position(r: ScheduledRequest) -> int:
    return r.num_computed_tokens + len(r.token_ids) - r.num_draft_tokens - 1
