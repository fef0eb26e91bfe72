"""Continuous batching: which requests run each step, and how many tokens each.

Tokens, not phases: every request has `num_computed_tokens`; each step hands
out new tokens under one budget (`max_num_batched_tokens`). A prompt chunk, a
prefix-cache hit and a decode token are the same arithmetic.

The scheduler owns the queues, each request's lifecycle, the budget, preemption (recompute or
swap) and priority; features sit beside it. The encoder budget, LoRA admission and grammar
admission are `SchedulerPart`s it calls at fixed points (`core/scheduler_part.py`); drafts,
forks, beam search and deadlines (the slack order, refusals) are parts it calls by name.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagoda.config import SchedulerConfig
from pagoda.core.beams import BeamSearch
from pagoda.core.deadlines import Deadlines
from pagoda.core.drafts import Drafts
from pagoda.core.encoder_cache import EncoderBudget
from pagoda.core.forks import Forks
from pagoda.core.grammar_admission import GrammarAdmission
from pagoda.core.kv_cache_manager import KVCacheManager, cdiv
from pagoda.core.lora_admission import LoRAAdmission
from pagoda.core.request_queue import create_request_queue
from pagoda.core.sched_output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from pagoda.core.scheduler_part import SchedulerPart
from pagoda.core.stats import RequestProgress, SchedulerStats, progress, scheduler_stats
from pagoda.core.structured_output import GrammarCompiler
from pagoda.core.whole_prompts import WholePrompts
from pagoda.request import Request, RequestStatus


@dataclass
class _Step:
    """What one `schedule()` call has handed out so far."""

    budget: int  # tokens left
    max_requests: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    running_short: bool = False  # running ones were preempted or wait: none may start

    @property
    def full(self) -> bool:
        return self.budget <= 0 or len(self.scheduled) >= self.max_requests


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        grammar_compiler: GrammarCompiler | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.deadlines = Deadlines(config)  # with latency targets: the slack order, refusals
        self.waiting = create_request_queue(config.scheduling_policy, self.deadlines.slack)
        # The waiting queue's policy orders it; the request to preempt first is last.
        self.running: list[Request] = []
        # Requests first scheduled in this step -> when; reported once by update_from_output.
        self.newly_scheduled: dict[str, float] = {}
        # Requests in a step whose output has not come back (pipeline parallel keeps
        # several steps outstanding): not scheduled again, never preempted, until it does.
        self.in_flight: set[str] = set()
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.num_prompt_tokens_computed = 0
        self.num_generation_tokens = 0
        # The features beside the loop.
        self.images = EncoderBudget(config.max_num_batched_tokens)
        self.loras = LoRAAdmission(config.max_loras) if config.max_loras is not None else None
        self.grammars = GrammarAdmission(grammar_compiler) if grammar_compiler else None
        self.parts: list[SchedulerPart] = [
            p for p in (self.images, self.loras, self.grammars, WholePrompts()) if p is not None
        ]
        spec = config.speculative
        self.drafts = Drafts(spec, config.max_model_len) if spec is not None else None
        self.forks = Forks(kv_cache_manager)
        self.beams = BeamSearch(config.max_model_len)

    def add_request(self, request: Request, fork_siblings: Iterable[Request] = ()) -> None:
        """Queue a request (DeadlineUnmeetableError, nothing queued, if it cannot meet its
        latency targets). `fork_siblings` (same prompt and params) share its prompt's blocks."""
        siblings = list(fork_siblings)
        self.deadlines.admit(request, self.waiting, self.running, 1 + len(siblings))
        if request.sampling_params.use_beam_search:  # the completions: its best beams
            request, siblings = self.beams.add([request, *siblings]), []
        for r in (request, *siblings):
            self.requests[r.request_id] = r
            if r.sampling_params.grammar is not None:
                if self.grammars is None:
                    raise ValueError("this scheduler has no grammar compiler")
                self.grammars.add(r)
        self.waiting.add(request)
        self.forks.add(request, siblings)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) the given requests; unknown ids are
        ignored. A beam search's completion ids finish all its beams."""
        finished = []
        for request_id in self.beams.expand(request_ids):
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
            else:  # a sibling still waiting to fork
                self.forks.drop_sibling(request)
            self._free(request, status)
            finished.append(request)
        return finished

    def fail_requests(self, request_ids: Iterable[str]) -> set[int]:
        """Finish requests whose step failed (FINISHED_ERROR). Returns the blocks they had
        allocated for that step, which may hold nothing valid: a request of the same step
        that holds one must be recomputed (`recompute_requests`)."""
        suspect: set[int] = set()
        request_ids = self.beams.expand(request_ids)
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

    def schedule(self, max_requests: int | None = None) -> SchedulerOutput:
        """The next step. `max_requests`: at most this many requests in it (pipeline
        parallel splits the requests over the steps it keeps in flight)."""
        # No cap by default: forks may run more than max_num_seqs.
        step = _Step(self.config.max_num_batched_tokens, max_requests or sys.maxsize)
        self.waiting.order_running(self.running)
        head = self.waiting.peek() if self.waiting else None
        for part in self.parts:
            part.begin_step(self.running, head)
        step.preempted += self._preempt_for_waiting(step.budget)
        self._schedule_running(step)
        if not step.running_short:
            self._schedule_waiting(step)
        if not step.scheduled and self.waiting:
            self._park_idle_beams(step)
        self.in_flight.update(item.request_id for item in step.scheduled)
        return self._output(step)

    def _schedule_running(self, step: _Step) -> None:
        """Running requests first, most important first; room comes from the tail, so a
        request already scheduled this step is never preempted."""
        kv = self.kv_cache_manager
        speculate = self.drafts is not None and self.drafts.enabled(len(self.running))
        i = 0
        while i < len(self.running) and not step.full:
            request = self.running[i]
            num_new = self._num_new_tokens(request, request.num_computed_tokens, step.budget)
            if request.request_id in self.in_flight or num_new == 0:
                i += 1
                continue
            # Drafts never take a block that a request after this one may need.
            spare_blocks = kv.block_pool.num_free_blocks - (len(self.running) - i - 1)
            drafts = self._propose(request, step.budget, spare_blocks) if speculate else []
            if (
                drafts
                and kv.allocate_slots(request, num_new, num_lookahead=len(drafts)) is not None
            ):
                self._take(step, request, num_new, drafts)
            elif self._make_room(step, request, num_new, i):
                self._take(step, request, num_new)
            if request.status == RequestStatus.RUNNING:  # else it gave its own room
                i += 1

    def _make_room(self, step: _Step, request: Request, num_new: int, i: int) -> bool:
        """Allocate `num_new` slots for running[i], preempting from the tail (at worst
        itself) until they fit; False if they did not."""
        kv = self.kv_cache_manager
        while kv.allocate_slots(request, num_new) is None:
            step.running_short = True
            victim = self._last_preemptable()  # at worst, `request` itself
            if victim is request and any(
                r.request_id in self.in_flight for r in self.running[i + 1 :]
            ):
                # The room would come from requests whose steps are in flight: wait for
                # those to come back rather than throw this one's work away.
                return False
            self._preempt(victim)
            step.preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, step: _Step) -> None:
        """Then waiting ones in the queue's order, while they fit."""
        kv = self.kv_cache_manager
        while self.waiting and not step.full and len(self.running) < self.config.max_num_seqs:
            request = self._next_waiting()
            if request is None or request.request_id in step.preempted:
                break  # never readmit in the step that preempted it
            num_new = self._allocate_waiting(request, step.budget)
            if num_new is None:
                break
            self._start(request)
            if num_new == 0:  # a leader whose fork point is already computed (or cached)
                siblings = self.forks.fork_if_ready(request)
                self.running += siblings
                for r in [request, *siblings]:
                    num = self._num_new_tokens(r, r.num_computed_tokens, step.budget)
                    if num == 0 or kv.allocate_slots(r, num) is None:
                        break
                    self._take(step, r, num)
                continue
            self._take(step, request, num_new)

    def _park_idle_beams(self, step: _Step) -> None:
        """Nothing could run, yet requests wait: beams waiting for their group (holding
        blocks, computing nothing) give their blocks back, and the queue tries again."""
        idle = [r for r in self.running if self.beams.reported(r) and r.request_id not in self.in_flight]  # fmt: skip
        for request in idle:
            self._preempt(request)
            step.preempted.append(request.request_id)
        if idle:
            self._schedule_waiting(step)

    def _allocate_waiting(self, request: Request, budget: int) -> int | None:
        """Blocks for a waiting request's first chunk (swapped back in, or after its
        prefix-cache hits); its number of new tokens, or None if it cannot start."""
        kv = self.kv_cache_manager
        if kv.is_swapped(request):
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
            if self._waits(request, request.num_computed_tokens, num_new):
                return None
            return None if kv.swap_in(request, num_new) is None else num_new
        hit_block_ids, num_hit_tokens = [], 0
        lookup = not request.reads_every_position
        if lookup:
            hit_block_ids, num_hit_tokens = kv.get_computed_blocks(request)
        num_new = self._num_new_tokens(request, num_hit_tokens, budget)
        if self._waits(request, num_hit_tokens, num_new):
            return None
        if kv.allocate_slots(request, num_new, hit_block_ids) is None:
            return None
        if lookup:
            kv.record_prefix_lookup(request.num_tokens, num_hit_tokens, hit_block_ids)
        request.num_computed_tokens = num_hit_tokens
        return num_new

    def _start(self, request: Request) -> None:
        """A waiting request whose blocks were allocated joins the running set."""
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.num_cached_tokens = request.num_computed_tokens
            request.first_scheduled_time = time.monotonic()
            self.newly_scheduled[request.request_id] = request.first_scheduled_time
        self.running.append(request)

    def _take(self, step: _Step, request: Request, num_new: int, drafts: list[int] = ()) -> None:
        """The request computes `num_new` tokens (and verifies `drafts`) in this step."""
        start = request.num_computed_tokens
        for part in self.parts:
            part.scheduled(request, start, num_new)
        draft_inputs = (
            self.drafts.inputs(request, start + num_new, drafts) if self.drafts else ([], start)
        )
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        step.scheduled.append(
            ScheduledRequest.of(request, num_new, drafts, draft_inputs, block_ids)
        )
        step.budget -= num_new + len(drafts)

    def _output(self, step: _Step) -> SchedulerOutput:
        copies, swap_out, swap_in, load = self.kv_cache_manager.take_block_ops()
        grammars = self.grammars
        return SchedulerOutput(
            scheduled=step.scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - step.budget,
            preempted_request_ids=step.preempted,
            blocks_to_copy=copies,
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
            blocks_to_load=load,
            grammar_bitmask=grammars.bitmask(self.requests, step.scheduled) if grammars else None,
            encoder_cache_evicted=self.images.cache.take_evicted(),
        )

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
            token_ids = sampled.get(item.request_id)
            self._advance(request, item, token_ids)
            if token_ids is not None and self.beams.owns(request):  # its group appends
                self.beams.report(request, logprobs[item.request_id][0])
                token_ids = None
            elif token_ids is not None:
                if item.num_draft_tokens:
                    self.drafts.verified(request, item, len(token_ids))
                token_ids = self._append(request, token_ids)
            rid = item.request_id
            output = EngineCoreOutput.of(
                self.beams.completion_id(rid), request, item.num_computed_tokens, token_ids,
                logprobs.get(rid), prompt_logprobs.get(rid), self.newly_scheduled.pop(rid, None),
            )  # fmt: skip
            if output is not None:
                outputs.append(output)
        return outputs + self._step_beams()

    def _step_beams(self) -> list[EngineCoreOutput]:
        """Groups whose every beam reported take their step: beams continued, forked
        (sharing the parent's blocks where it holds them) or ended (core/beams.py)."""
        outputs = []
        for step in self.beams.take_steps():
            for parent, child in step.shared:
                self.requests[child.request_id] = child
                self.forks.share(parent, child)
                self.running.append(child)
            for request in step.queued:
                self.requests[request.request_id] = request
                self.waiting.prepend(request)
            self.finish_requests([r.request_id for r in step.ended], RequestStatus.FINISHED_STOPPED)
            self.num_generation_tokens += step.num_tokens
            outputs += step.outputs
        return outputs

    def _advance(
        self, request: Request, item: ScheduledRequest, token_ids: list[int] | None
    ) -> None:
        """Its computed tokens move past what the step computed, less rejected drafts
        (whose K/V stays in the blocks, past the computed tokens: the next step writes
        over it)."""
        start = request.num_computed_tokens
        num_rejected = item.num_draft_tokens - (len(token_ids) - 1 if token_ids else 0)
        request.num_computed_tokens += len(item.token_ids) - num_rejected
        if num_rejected:  # their blocks go back: no swap or stat should count them
            self.kv_cache_manager.free_past(request, request.num_computed_tokens)
        for part in self.parts:
            part.computed(request)
        prompt_len = request.num_prompt_tokens
        self.num_prompt_tokens_computed += min(request.num_computed_tokens, prompt_len) - min(
            start, prompt_len
        )
        self.running += self.forks.fork_if_ready(request)

    def _append(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append sampled tokens up to the first that stops the request (which then
        finishes); returns those appended."""
        status = None
        for n, token_id in enumerate(token_ids, 1):
            request.append_output_token(token_id)
            # A part may end it (a grammar complete or refused), else a stop condition.
            statuses = (part.token_appended(request, token_id) for part in self.parts)
            status = next((s for s in statuses if s is not None), None)
            status = status or request.stop_status(token_id, self.config.max_model_len)
            if status is not None:
                token_ids = token_ids[:n]
                break
        self.num_generation_tokens += len(token_ids)
        if status is not None:
            self.running.remove(request)
            self._free(request, status)
        return token_ids

    def _admits(self, request: Request) -> bool:
        return all(part.admits(request) for part in self.parts)

    def _next_waiting(self) -> Request | None:
        """The next request to start: the queue's head, or the first one every part
        admits (the others keep their places)."""
        head = self.waiting.peek()
        if self._admits(head):
            return head
        return next((r for r in self.waiting if self._admits(r)), None)

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = min(self.forks.token_limit(request) - num_computed, budget)
        for part in self.parts:
            num_new = part.limit_tokens(request, num_computed, num_new)
        return num_new

    def _waits(self, request: Request, num_computed: int, num_new: int) -> bool:
        """Nothing to compute this step although tokens remain: a part holds it back
        (an image waits for encoder room); not a leader at its fork point."""
        return num_new == 0 and num_computed < self.forks.token_limit(request)

    def _propose(self, request: Request, budget: int, spare_blocks: int) -> list[int]:
        """Drafts in the request's own blocks and at most `spare_blocks` more."""
        kv = self.kv_cache_manager
        slots = (kv.num_blocks_of(request.request_id) + max(spare_blocks, 0)) * kv.block_size
        return self.drafts.propose(request, self.forks.token_limit(request), budget, slots)

    def _preempt_for_waiting(self, budget: int) -> list[str]:
        """Preempt running requests that the best waiting one outranks (priority policy) until
        its first chunk fits beside what the remaining running requests need this step."""
        if not self.waiting or not self.running or len(self.running) > self.config.max_num_seqs:
            return []
        best = self.waiting.peek()
        if not self._admits(best):
            return []  # it cannot start yet: preempting for it would gain nothing
        kv = self.kv_cache_manager

        def blocks_needed(r: Request) -> int:
            end = min(r.num_tokens, r.num_computed_tokens + budget)
            return max(0, cdiv(end, kv.block_size) - kv.num_blocks_of(r.request_id))

        needed = cdiv(min(best.num_tokens, budget), kv.block_size)
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
        """Off the device and back to the front of the queue: its blocks swapped to host
        memory (swap mode, while the host pool has room), else freed, to be recomputed."""
        self.running.remove(request)
        self.in_flight.discard(request.request_id)  # a failed step's request, to retry
        self._release(request, finished=False)
        swap = self.config.preemption_mode == "swap" and not recompute
        if swap and self.kv_cache_manager.swap_out(request):
            self.num_preemptions["swap"] += 1
        else:
            self.kv_cache_manager.free(request, save=False)  # (saving would hold the room)
            request.num_computed_tokens = 0
            self.num_preemptions["recompute"] += 1
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        if not self.beams.park(request):  # a beam that reported waits for its group
            self.waiting.prepend(request)

    def _release(self, request: Request, finished: bool) -> None:
        for part in self.parts:
            part.released(request, finished)
        if self.drafts is not None:
            self.drafts.released(request, finished)
        self.beams.released(request, finished)

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._release(request, finished=True)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        # A leader that leaves before its fork point hands its siblings to the queue.
        for sibling in self.forks.leader_left(request):
            self.waiting.add(sibling)

    def get_stats(self) -> SchedulerStats:
        return scheduler_stats(self)

    def progress(self, limit: int) -> list[RequestProgress]:
        """At most `limit` sequences: running, then waiting in order, then the others."""
        return progress(self, limit)
