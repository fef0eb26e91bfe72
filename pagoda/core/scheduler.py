"""Continuous batching: which requests run each step, and how many tokens each.

Tokens, not phases: every request has `num_computed_tokens`; each step hands
out new tokens under one budget (`max_num_batched_tokens`). A prompt chunk, a
prefix-cache hit and a decode token are the same arithmetic.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterable

from pagoda.config import SchedulerConfig
from pagoda.core.encoder_cache import EncoderCacheManager
from pagoda.core.kv_cache_manager import KVCacheManager, cdiv
from pagoda.core.ngram import propose_ngram
from pagoda.core.request_queue import RequestQueue, create_request_queue
from pagoda.core.sched_output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from pagoda.core.stats import (
    LoRAStats,
    RequestProgress,
    SchedulerStats,
    SpecDecodingStats,
)
from pagoda.core.structured_output import GrammarCompiler
from pagoda.request import Request, RequestStatus

# Steps a waiting request may be passed over for its adapter before requests for the
# running adapters stop passing it (so that one of them drains and frees a slot).
LORA_MAX_PASSED_OVER = 32


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        grammar_compiler: GrammarCompiler | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.grammar_compiler = grammar_compiler
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(config.scheduling_policy)
        # Structured outputs: requests whose grammar is still compiling wait here, out
        # of the queue's way; those whose grammar failed to compile, with why (the
        # engine ends them).
        self.waiting_for_grammar: list[Request] = []
        self.grammar_failures: dict[str, str] = {}
        # The waiting queue's policy orders it; the request to preempt first is last.
        self.running: list[Request] = []
        # Parallel sampling: siblings wait here until their leader has computed
        # all but the last prompt token, then share its blocks (fork).
        self.fork_waiters: dict[str, list[Request]] = {}
        # Requests first scheduled in this step -> when; reported once by update_from_output.
        self.newly_scheduled: dict[str, float] = {}
        # Requests in a step whose output has not come back (pipeline parallel keeps
        # several steps outstanding): not scheduled again, never preempted, until it does.
        self.in_flight: set[str] = set()
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.num_prompt_tokens_computed = 0
        self.num_generation_tokens = 0
        self.spec_stats = (
            SpecDecodingStats.empty(config.speculative.num_speculative_tokens)
            if config.speculative is not None
            else None
        )
        self.num_drafts_next: dict[str, int] = {}  # request id -> drafts to propose next
        # With LoRA: steps in a row in which the queue's head waited for its adapter.
        self.num_steps_head_passed_over = 0
        # Images: which encoder outputs the runner holds, and the step's encoder budget
        # (image tokens to encode; both vLLM's default, max_num_batched_tokens).
        self.encoder_cache = EncoderCacheManager(config.max_num_batched_tokens)
        self.encoder_budget = 0

    # ---- queues -------------------------------------------------------------

    def add_request(self, request: Request, fork_siblings: Iterable[Request] = ()) -> None:
        """Queue a request. `fork_siblings` (same prompt and params) will share its
        prompt's blocks instead of computing the prompt again."""
        siblings = list(fork_siblings)
        for r in (request, *siblings):
            self.requests[r.request_id] = r
            if r.sampling_params.grammar is not None:
                if self.grammar_compiler is None:
                    raise ValueError("this scheduler has no grammar compiler")
                r.grammar = self.grammar_compiler.request_grammar(r.sampling_params.grammar)
        self._enqueue(request)
        if siblings:
            self.fork_waiters[request.request_id] = siblings

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) the given requests; unknown ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.finished:
                continue
            # Its step in flight, if any, stays so until its output comes back (and is
            # ignored): the id is not free for a new request until then.
            self.newly_scheduled.pop(request_id, None)
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            elif request in self.waiting_for_grammar:
                self.waiting_for_grammar.remove(request)
            else:  # a sibling still waiting to fork, or a grammar that failed
                for siblings in self.fork_waiters.values():
                    if request in siblings:
                        siblings.remove(request)
            self._free(request, status)
            finished.append(request)
        return finished

    def fail_requests(self, request_ids: Iterable[str]) -> set[int]:
        """Finish requests whose step failed (FINISHED_ERROR). Returns the blocks they had
        allocated for that step, which may hold nothing valid: a request of the same step
        that holds one must be recomputed (`recompute_requests`)."""
        suspect: set[int] = set()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            self.in_flight.discard(request_id)
            self.newly_scheduled.pop(request_id, None)  # it reports nothing
            if request is not None:
                suspect |= self.kv_cache_manager.forget_uncomputed(request)
        self.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
        return suspect

    def recompute_requests(self, request_ids: Iterable[str]) -> None:
        """Put running requests back in the waiting queue to compute all their tokens again
        (preemption by recompute, whatever the preemption mode). An id aborted while its
        step was in flight is only no longer in flight: that step is dropped."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                self.in_flight.discard(request_id)
            elif request.status == RequestStatus.RUNNING:
                self._preempt(request, recompute=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _enqueue(self, request: Request) -> None:
        """Into the waiting queue, or aside until its grammar has compiled."""
        if request.grammar is not None and not request.grammar.ready:
            self.waiting_for_grammar.append(request)
        else:
            self.waiting.add(request)

    def _admit_compiled(self) -> None:
        """Requests whose grammar has compiled join the waiting queue (in arrival
        order); those whose grammar failed go to `grammar_failures`."""
        still = []
        for request in self.waiting_for_grammar:
            if not request.grammar.ready:
                still.append(request)
            elif (error := request.grammar.compiled.exception()) is not None:
                self.grammar_failures[request.request_id] = str(error)
            else:
                self.waiting.add(request)
        self.waiting_for_grammar = still

    def wait_for_grammars(self, timeout: float) -> None:
        """With nothing to run but requests waiting for their grammar: block until one
        compiles (or `timeout`), instead of spinning."""
        if self.waiting_for_grammar:
            GrammarCompiler.wait_any([r.grammar for r in self.waiting_for_grammar], timeout)

    # ---- one step ------------------------------------------------------------

    def schedule(self, max_requests: int | None = None) -> SchedulerOutput:
        """The next step. `max_requests`: at most this many requests in it (pipeline
        parallel splits the requests over the steps it keeps in flight)."""
        kv = self.kv_cache_manager
        if max_requests is None:  # no cap: forks may run more than max_num_seqs
            max_requests = sys.maxsize
        budget = self.config.max_num_batched_tokens
        self.encoder_budget = budget
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        if self.waiting_for_grammar:
            self._admit_compiled()
        self.waiting.order_running(self.running)
        preempted += self._preempt_for_waiting(budget)
        num_preempted_for_waiting = len(preempted)

        # Running requests first, most important first; victims come from the tail,
        # so a request already scheduled this step is never preempted.
        spec = self.config.speculative
        speculate = spec is not None and len(self.running) < spec.disable_by_batch_size
        i = 0
        waited = False
        while i < len(self.running) and budget > 0 and len(scheduled) < max_requests:
            request = self.running[i]
            if request.request_id in self.in_flight:
                i += 1
                continue
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
            if self._waits_for_image(request, request.num_computed_tokens, num_new):
                i += 1
                continue
            # Drafts never take a block that a request after this one may need.
            spare_blocks = kv.block_pool.num_free_blocks - (len(self.running) - i - 1)
            drafts = self._propose(request, budget, spare_blocks) if speculate else []
            if (
                drafts
                and kv.allocate_slots(request, num_new, num_lookahead=len(drafts)) is not None
            ):
                scheduled.append(self._scheduled(request, num_new, drafts))
                budget -= num_new + len(drafts)
                i += 1
                continue
            while kv.allocate_slots(request, num_new) is None:
                victim = self._last_preemptable()  # at worst, `request` itself
                if victim is request and any(
                    r.request_id in self.in_flight for r in self.running[i + 1 :]
                ):
                    # The room would come from requests whose steps are in flight: wait
                    # for those to come back rather than throw this one's work away.
                    waited = True
                    i += 1
                    break
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1

        # Then waiting ones, unless running requests had to be preempted (or wait) to fit.
        running_short = waited or len(preempted) > num_preempted_for_waiting
        running_loras = self._running_loras()
        while (
            self.waiting
            and not running_short
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(scheduled) < max_requests
        ):
            request = self._next_waiting(running_loras)
            if request is None or request.request_id in preempted:
                break  # never readmit in the step that preempted it
            if kv.is_swapped(request):
                num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
                if self._waits_for_image(request, request.num_computed_tokens, num_new):
                    break
                if kv.swap_in(request, num_new) is None:
                    break
            else:
                hit_block_ids, num_hit_tokens = [], 0
                if request.sampling_params.prompt_logprobs is None:  # those need every position
                    hit_block_ids, num_hit_tokens = kv.get_computed_blocks(request)
                num_new = self._num_new_tokens(request, num_hit_tokens, budget)
                if self._waits_for_image(request, num_hit_tokens, num_new):
                    break
                if kv.allocate_slots(request, num_new, hit_block_ids) is None:
                    break
                if request.sampling_params.prompt_logprobs is None:
                    kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
                request.num_computed_tokens = num_hit_tokens
            self.waiting.remove(request)
            if running_loras is not None and request.lora_int_id:
                running_loras.add(request.lora_int_id)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.num_cached_tokens = request.num_computed_tokens
                request.first_scheduled_time = time.monotonic()
                self.newly_scheduled[request.request_id] = request.first_scheduled_time
            self.running.append(request)
            if num_new == 0:  # a leader whose fork point is already computed (or cached)
                for r in [request, *self._fork(request)]:
                    num = self._num_new_tokens(r, r.num_computed_tokens, budget)
                    if num == 0 or kv.allocate_slots(r, num) is None:
                        break
                    scheduled.append(self._scheduled(r, num))
                    budget -= num
                continue
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        if running_loras is not None:  # count the steps the head's adapter has waited
            blocked = self.waiting and not self._lora_fits(self.waiting.peek(), running_loras)
            self.num_steps_head_passed_over = self.num_steps_head_passed_over + 1 if blocked else 0
        copies, swap_out, swap_in = kv.take_block_ops()
        self.in_flight.update(item.request_id for item in scheduled)
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_request_ids=preempted,
            blocks_to_copy=copies,
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
            grammar_bitmask=self._grammar_bitmask(scheduled),
            encoder_cache_evicted=self.encoder_cache.take_evicted(),
        )

    def _grammar_bitmask(self, scheduled: list[ScheduledRequest]):
        """One bitmask for every row sampled under a grammar this step (a request's
        last token and each of its drafts); sets each item's `grammar_row`."""
        rows, num_rows = [], 0
        for item in scheduled:
            grammar = self.requests[item.request_id].grammar
            if grammar is not None and item.sampling_params is not None:
                item.grammar_row = num_rows
                rows.append((grammar, num_rows, item.draft_token_ids))
                num_rows += 1 + item.num_draft_tokens
        return self.grammar_compiler.bitmask(rows, num_rows) if rows else None

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance every scheduled request; append sampled tokens (with speculation, the
        accepted drafts and one more); finish the stopped."""
        sampled = dict(zip(runner_output.request_ids, runner_output.sampled_token_ids, strict=True))
        logprobs = dict(zip(runner_output.request_ids, runner_output.logprobs or (), strict=False))
        prompt_logprobs = runner_output.prompt_logprobs or {}
        outputs = []
        for item in scheduler_output.scheduled:
            self.in_flight.discard(item.request_id)
            request = self.requests.get(item.request_id)
            if request is None:  # finished (aborted) while its step was in flight
                continue
            start = request.num_computed_tokens
            token_ids = sampled.get(item.request_id)
            # Rejected drafts' K/V stays in the blocks, past the computed tokens: the
            # next step writes over it.
            num_rejected = item.num_draft_tokens - (len(token_ids) - 1 if token_ids else 0)
            request.num_computed_tokens += len(item.token_ids) - num_rejected
            if item.mm_features:
                self._release_images(request, request.num_computed_tokens)
            if num_rejected:  # their blocks go back: no swap or stat should count them
                self.kv_cache_manager.free_past(request, request.num_computed_tokens)
            prompt_len = request.num_prompt_tokens
            self.num_prompt_tokens_computed += min(request.num_computed_tokens, prompt_len) - min(
                start, prompt_len
            )
            if request.request_id in self.fork_waiters and self._at_fork_point(request):
                self._fork(request)
            scheduled_time = self.newly_scheduled.pop(item.request_id, None)
            this_prompt_logprobs = (
                (item.num_computed_tokens, prompt_logprobs[item.request_id])
                if item.request_id in prompt_logprobs
                else None
            )
            if token_ids is None:
                if this_prompt_logprobs is not None or scheduled_time is not None:
                    outputs.append(
                        EngineCoreOutput(
                            request.request_id,
                            [],
                            prompt_logprobs=this_prompt_logprobs,
                            scheduled_time=scheduled_time,
                            num_cached_tokens=request.num_cached_tokens,
                        )
                    )
                continue
            if item.num_draft_tokens:
                accepted = len(token_ids) - 1
                self.spec_stats.record(item.num_draft_tokens, accepted)
                # Each draft row costs a row of every product: after a rejection draft
                # one more than was accepted, after a full acceptance two more.
                grow = 2 if accepted == item.num_draft_tokens else 1
                self.num_drafts_next[request.request_id] = accepted + grow
                if item.draft_input_ids:
                    # The draft model computed the known tokens and its drafts but the
                    # last: the accepted ones are current.
                    request.num_draft_computed = (
                        item.num_computed_tokens
                        + len(item.token_ids)
                        - item.num_draft_tokens
                        + min(accepted, item.num_draft_tokens - 1)
                    )
            status = None
            for n, token_id in enumerate(token_ids, 1):
                request.append_output_token(token_id)
                status = self._advance_grammar(request, token_id) or self._check_stop(
                    request, token_id
                )
                if status is not None:
                    token_ids = token_ids[:n]
                    break
            self.num_generation_tokens += len(token_ids)
            if status is not None:
                self.running.remove(request)
                self._free(request, status)
            token_logprobs = logprobs.get(item.request_id)
            outputs.append(
                EngineCoreOutput(
                    request.request_id,
                    token_ids,
                    request.status.finish_reason,
                    request.stop_reason,
                    logprobs=token_logprobs[: len(token_ids)] if token_logprobs else None,
                    prompt_logprobs=this_prompt_logprobs,
                    scheduled_time=scheduled_time,
                    num_cached_tokens=request.num_cached_tokens,
                    num_preemptions=request.num_preemptions,
                )
            )
        return outputs

    # ---- policies -------------------------------------------------------------

    def _token_limit(self, request: Request) -> int:
        """How far the request may compute: all its tokens, or a leader up to its fork point."""
        if request.request_id in self.fork_waiters:
            return request.num_prompt_tokens - 1
        return request.num_tokens

    def _waits_for_image(self, request: Request, num_computed: int, num_new: int) -> bool:
        """Nothing to compute this step although tokens remain: its next image waits for
        encoder budget or cache room (not a leader at its fork point)."""
        return num_new == 0 and num_computed < self._token_limit(request)

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = min(self._token_limit(request) - num_computed, budget)
        if request.mm_features:
            num_new = self._fit_images(request, num_computed, num_new)
        return num_new

    def _fit_images(self, request: Request, start: int, num_new: int) -> int:
        """`num_new` cut to end before the first image whose encoder output is not held
        and does not fit this step's encoder budget or the encoder cache. An image
        larger than the whole budget runs alone in a step's encoder work."""
        cache, budget, rows = self.encoder_cache, self.encoder_budget, 0
        # Held outputs this chunk covers will be taken (`_use_images`): not room to evict.
        keep = {
            f.hash
            for f in request.mm_features
            if f.offset < start + num_new and f.offset + f.length > start and cache.holds(f.hash)
        }
        for feature in request.mm_features:
            if feature.offset >= start + num_new:
                break
            if feature.offset + feature.length <= start or cache.holds(feature.hash):
                continue
            first = budget == self.config.max_num_batched_tokens
            if (feature.length <= budget or first) and cache.can_hold(rows + feature.length, keep):
                budget -= feature.length
                rows += feature.length
                continue
            return feature.offset - start
        return num_new

    def _propose(self, request: Request, budget: int, spare_blocks: int) -> list[int]:
        """Draft tokens for a request about to decode its last token, in its own blocks
        and at most `spare_blocks` more; [] if none fit."""
        spec = self.config.speculative
        if (
            request.num_computed_tokens != request.num_tokens - 1
            or request.request_id in self.fork_waiters
        ):
            return []
        params = request.sampling_params
        # All drafts accepted means k + 1 new tokens: within max_tokens and max_model_len.
        room = self.config.max_model_len - request.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        kv = self.kv_cache_manager
        slots = (kv.num_blocks_of(request.request_id) + max(spare_blocks, 0)) * kv.block_size
        k = min(
            spec.num_speculative_tokens,
            self.num_drafts_next.get(request.request_id, spec.num_speculative_tokens),
            budget - 1,
            room,
            slots - request.num_tokens,
        )
        if k < 1:
            return []
        if spec.method == "draft":
            # Placeholders: the runner's draft model writes them. Its drafts are not
            # known here, so not for requests whose grammar masks each draft's row.
            return [] if request.grammar is not None else [0] * k
        drafts = propose_ngram(
            request.all_token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
        if drafts and request.grammar is not None:  # only drafts the grammar allows
            drafts = drafts[: request.grammar.num_valid(drafts)]
        return drafts

    def _running_loras(self) -> set[int] | None:
        """The adapters of the running requests (None: LoRA is off)."""
        if self.config.max_loras is None:
            return None
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def _lora_fits(self, request: Request, running_loras: set[int] | None) -> bool:
        """Whether its adapter can run beside the running requests' (at most
        `max_loras` adapters run at once, as they fit the model's slots)."""
        lora_id = request.lora_int_id
        return (
            running_loras is None
            or not lora_id
            or lora_id in running_loras
            or len(running_loras) < self.config.max_loras
        )

    def _next_waiting(self, running_loras: set[int] | None) -> Request | None:
        """The next request to admit: the queue's head, or with LoRA the first one whose
        adapter fits. A head that does not fit is passed over and keeps its place, so
        it does not hold up requests for resident adapters; once it has been passed
        over for LORA_MAX_PASSED_OVER steps, only base-model requests pass it, so the
        running adapters drain and its own gets a slot."""
        head = self.waiting.peek()
        if self._lora_fits(head, running_loras):
            return head
        if self.num_steps_head_passed_over >= LORA_MAX_PASSED_OVER:
            return next((r for r in self.waiting if not r.lora_int_id), None)
        return next((r for r in self.waiting if self._lora_fits(r, running_loras)), None)

    def _at_fork_point(self, request: Request) -> bool:
        return request.num_computed_tokens == request.num_prompt_tokens - 1

    def _fork(self, leader: Request) -> list[Request]:
        """Siblings join the running set sharing the leader's blocks; returns them."""
        siblings = self.fork_waiters.pop(leader.request_id, [])
        for sibling in siblings:
            self.kv_cache_manager.fork(leader, sibling)
            sibling.num_computed_tokens = leader.num_computed_tokens
            sibling.status = RequestStatus.RUNNING
            sibling.first_scheduled_time = time.monotonic()
            self.running.append(sibling)
        return siblings

    def _preempt_for_waiting(self, budget: int) -> list[str]:
        """Preempt running requests that the best waiting one outranks (priority
        policy) until its first chunk fits beside what the remaining running
        requests need this step."""
        if not self.waiting or not self.running or len(self.running) > self.config.max_num_seqs:
            return []
        best = self.waiting.peek()
        if not self._lora_fits(best, self._running_loras()):
            return []  # its adapter cannot run yet: preempting for it would gain nothing
        kv = self.kv_cache_manager
        bs = kv.block_size

        def blocks_needed(r: Request) -> int:
            end = min(r.num_tokens, r.num_computed_tokens + budget)
            return max(0, cdiv(end, bs) - kv.num_blocks_of(r.request_id))

        needed = cdiv(min(best.num_tokens, budget), bs)
        preempted = []
        while self.running:
            victim = self._last_preemptable()  # the least important
            if victim is None or not self.waiting.may_preempt(best, victim):
                break
            running_need = sum(blocks_needed(r) for r in self.running)
            fits = kv.block_pool.num_free_blocks >= needed + running_need
            if fits and len(self.running) < self.config.max_num_seqs:
                break
            self._preempt(victim)
            preempted.append(victim.request_id)
        return preempted

    def _last_preemptable(self) -> Request | None:
        """The least important running request whose step is not in flight."""
        return next((r for r in reversed(self.running) if r.request_id not in self.in_flight), None)

    def _preempt(self, request: Request, recompute: bool = False) -> None:
        """Take the request off the device and put it back at the front of the queue.

        Swap mode moves its blocks to host memory (falling back to recompute when
        the host pool is full); recompute mode frees them, and the request
        recomputes its tokens (prompt and outputs so far) when readmitted.
        """
        self.running.remove(request)
        self.in_flight.discard(request.request_id)  # a failed step's request, to retry
        self._release_images(request)
        request.num_draft_computed = 0  # the draft's K/V is neither swapped nor kept
        swap = self.config.preemption_mode == "swap" and not recompute
        if swap and self.kv_cache_manager.swap_out(request):
            self.num_preemptions["swap"] += 1
        else:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            self.num_preemptions["recompute"] += 1
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.prepend(request)

    def _release_images(self, request: Request, computed: int | None = None) -> None:
        """Let go of the images the request no longer needs: all of them (computed None),
        or those wholly before `computed` that do not come again after it."""
        ahead = (
            set()
            if computed is None
            else {f.hash for f in request.mm_features if f.offset + f.length > computed}
        )
        for feature in request.mm_features:
            if feature.hash not in ahead:
                self.encoder_cache.release(feature.hash, request.request_id)

    def _use_images(self, request: Request, start: int, end: int) -> list:
        """The request's images that positions start..end-1 cover: each one's encoder
        output is held for it from now on (a new one charged to the step's budget).
        Held ones are taken first, so making room for a new one never evicts them."""
        cache, request_id = self.encoder_cache, request.request_id
        features = [
            f for f in request.mm_features if f.offset < end and f.offset + f.length > start
        ]
        for feature in features:
            if request_id not in cache.users.get(feature.hash, ()):
                cache.queries += 1
                cache.hits += cache.holds(feature.hash)
            if cache.holds(feature.hash):
                cache.use(feature.hash, request_id)
        for feature in features:
            if not cache.holds(feature.hash):
                cache.add(feature.hash, feature.length)
                self.encoder_budget -= feature.length
                cache.use(feature.hash, request_id)
        return features

    def _scheduled(
        self, request: Request, num_new: int, drafts: list[int] = ()
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        draft_start = min(request.num_draft_computed, start)  # never past the target's
        params = request.sampling_params
        samples = start + num_new == request.num_tokens
        needs_history = params.needs_token_history
        wants_prompt_logprobs = (
            params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1
        )
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new] + list(drafts),
            num_computed_tokens=start,
            num_draft_tokens=len(drafts),
            draft_input_ids=request.all_token_ids[draft_start : start + num_new]
            if drafts and self.config.speculative.method == "draft"
            else [],
            draft_input_start=draft_start,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            sampling_params=params if samples else None,
            num_output_tokens=request.num_output_tokens,
            prompt_token_ids=request.prompt_token_ids if needs_history and samples else None,
            output_token_ids=request.output_token_ids if needs_history and samples else None,
            # Each position's logprobs score the token after it.
            prompt_logprob_targets=(
                request.all_token_ids[
                    start + 1 : min(start + num_new, request.num_prompt_tokens - 1) + 1
                ]
                if wants_prompt_logprobs
                else None
            ),
            prompt_logprobs_n=params.prompt_logprobs or 0,
            lora_request=request.lora_request,
            mm_features=self._use_images(request, start, start + num_new)
            if request.mm_features
            else [],
        )

    def _advance_grammar(self, request: Request, token_id: int) -> RequestStatus | None:
        """A grammar's request stops when the grammar is complete. (A token the grammar
        refuses cannot be sampled under its mask; it ends the request as failed.)"""
        if request.grammar is None:
            return None
        if not request.grammar.accept(token_id):
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if request.grammar.complete else None

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in params.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._release_images(request)
        self.num_drafts_next.pop(request.request_id, None)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        # A leader that leaves before its fork point hands its siblings to the queue.
        for sibling in self.fork_waiters.pop(request.request_id, []):
            self._enqueue(sibling)

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        kv_stats = kv.stats()
        allocated_slots = kv_stats.num_blocks_used * kv.block_size
        empty_slots = sum(
            kv.num_blocks_of(r.request_id) * kv.block_size - r.num_computed_tokens
            for r in self.running
        )
        return SchedulerStats(
            num_requests_running=len(self.running),
            num_requests_waiting=len(self.requests)
            - len(self.running)
            - kv_stats.num_requests_swapped,
            num_preemptions_recompute=self.num_preemptions["recompute"],
            num_preemptions_swap=self.num_preemptions["swap"],
            num_prompt_tokens=self.num_prompt_tokens_computed,
            num_generation_tokens=self.num_generation_tokens,
            kv_cache_fragmentation_perc=100.0 * empty_slots / allocated_slots
            if allocated_slots
            else 0.0,
            kv_cache=kv_stats,
            spec_decoding=self.spec_stats.snapshot() if self.spec_stats is not None else None,
            lora=self._lora_stats(),
            mm_cache_queries=self.encoder_cache.queries,
            mm_cache_hits=self.encoder_cache.hits,
        )

    def progress(self, limit: int) -> list[RequestProgress]:
        """At most `limit` sequences: running ones first, then the waiting queue in
        order, then those waiting elsewhere (for a grammar, or to fork)."""
        kv = self.kv_cache_manager
        shown: dict[str, Request] = {}
        for r in itertools.chain(self.running, self.waiting, self.requests.values()):
            if len(shown) >= limit:
                break
            shown.setdefault(r.request_id, r)
        out = []
        for r in shown.values():
            state = r.status.name.lower()
            if r.status == RequestStatus.PREEMPTED and kv.is_swapped(r):
                state = "swapped"
            out.append(
                RequestProgress(
                    r.request_id,
                    state,
                    r.priority,
                    r.num_prompt_tokens,
                    r.num_computed_tokens,
                    r.num_output_tokens,
                    r.sampling_params.max_tokens,
                    kv.num_blocks_of(r.request_id),
                    r.lora_request.lora_name if r.lora_request is not None else "",
                    r.arrival_time,
                )
            )
        return out

    def _lora_stats(self) -> LoRAStats | None:
        if self.config.max_loras is None:
            return None
        running, waiting = set(), set()
        for r in self.requests.values():
            if r.lora_request is not None:
                (running if r.status == RequestStatus.RUNNING else waiting).add(
                    r.lora_request.lora_name
                )
        return LoRAStats(self.config.max_loras, tuple(sorted(running)), tuple(sorted(waiting)))
