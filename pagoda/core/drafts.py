"""Speculative decoding in the scheduler: how many draft tokens a request decoding
its last known token verifies this step, where they come from (n-gram lookup in its
own tokens, or placeholders a draft model on the runner fills), and what came back."""

from __future__ import annotations

from pagoda.config import SpeculativeConfig
from pagoda.core.ngram import propose_ngram
from pagoda.core.sched_output import ScheduledRequest
from pagoda.core.stats import SpecDecodingStats
from pagoda.request import Request


class Drafts:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        self.spec = spec
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats.empty(spec.num_speculative_tokens)
        self.num_drafts_next: dict[str, int] = {}  # request id -> drafts to propose next

    @property
    def from_draft_model(self) -> bool:
        return self.spec.method == "draft"

    def enabled(self, num_running: int) -> bool:
        return num_running < self.spec.disable_by_batch_size

    def propose(self, request: Request, token_limit: int, budget: int, slots: int) -> list[int]:
        """Draft tokens for a request about to compute its last token (`token_limit`:
        how far it may compute, all its tokens unless it leads a fork), within
        `budget` tokens and its `slots` (its blocks and the spare ones); [] if none fit."""
        params = request.sampling_params
        if token_limit != request.num_tokens or request.num_computed_tokens != token_limit - 1:
            return []
        if params.use_beam_search:  # a beam's next token is its group's choice
            return []
        # All drafts accepted means k + 1 new tokens: within max_tokens and max_model_len.
        room = self.max_model_len - request.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        k = min(
            self.spec.num_speculative_tokens,
            self.num_drafts_next.get(request.request_id, self.spec.num_speculative_tokens),
            budget - 1,
            room,
            slots - request.num_tokens,
        )
        if k < 1 or request.before_grammar:  # no drafts across the grammar's start
            return []
        if self.from_draft_model:
            # Placeholders: the runner's draft model writes them. Its drafts are not
            # known here, so not for requests whose grammar masks each draft's row.
            return [] if request.grammar is not None else [0] * k
        drafts = propose_ngram(
            request.all_token_ids, k, self.spec.prompt_lookup_min, self.spec.prompt_lookup_max
        )
        if drafts and request.grammar is not None:  # only drafts the grammar allows
            drafts = drafts[: request.grammar.num_valid(drafts)]
        return drafts

    def inputs(self, request: Request, end: int, drafts: list[int]) -> tuple[list[int], int]:
        """What the draft model computes before drafting (its known tokens up to `end`,
        from the first whose K/V it lacks) and where they start; nothing for n-grams."""
        start = min(request.num_draft_computed, request.num_computed_tokens)
        if not drafts or not self.from_draft_model:
            return [], start
        return request.all_token_ids[start:end], start

    def verified(self, request: Request, item: ScheduledRequest, num_sampled: int) -> None:
        """The step verified `item`'s drafts and sampled `num_sampled` tokens (the
        accepted drafts and one more)."""
        accepted = num_sampled - 1
        self.stats.record(item.num_draft_tokens, accepted)
        # Each draft row costs a row of every product: after a rejection draft one more
        # than was accepted, after a full acceptance two more.
        grow = 2 if accepted == item.num_draft_tokens else 1
        self.num_drafts_next[request.request_id] = accepted + grow
        if item.draft_input_ids:
            # The draft model computed the known tokens and its drafts but the last:
            # the accepted ones are current.
            request.num_draft_computed = (
                item.num_computed_tokens
                + len(item.token_ids)
                - item.num_draft_tokens
                + min(accepted, item.num_draft_tokens - 1)
            )

    def released(self, request: Request, finished: bool) -> None:
        request.num_draft_computed = 0  # the draft's K/V is neither swapped nor kept
        if finished:
            self.num_drafts_next.pop(request.request_id, None)
