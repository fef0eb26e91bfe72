"""Continuous batching: which requests run each step, and how many tokens each.

Tokens, not phases: every request has `num_computed_tokens`; each step hands
out new tokens under one budget (`max_num_batched_tokens`). A prompt chunk, a
prefix-cache hit and a decode token are the same arithmetic.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.sched_output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from pagoda.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0
        self.num_generation_tokens = 0

    # ---- queues -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) the given requests; unknown ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        # Running requests first, in admission order; victims come from the tail,
        # so a request already scheduled this step is never preempted.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv_cache_manager.allocate_slots(request, num_new) is None:
                victim = self._pick_victim(self.running[i:])
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1

        # Then waiting ones, unless this step already had to preempt.
        while (
            self.waiting
            and not preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self._peek_waiting()
            hit_block_ids, num_hit_tokens = [], 0
            if request.num_computed_tokens == 0:
                hit_block_ids, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, hit_block_ids) is None:
                break
            self.waiting.remove(request)
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_request_ids=preempted,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance every scheduled request; append sampled tokens; finish the stopped."""
        sampled = dict(zip(runner_output.request_ids, runner_output.sampled_token_ids, strict=True))
        outputs = []
        for item in scheduler_output.scheduled:
            request = self.requests[item.request_id]
            request.num_computed_tokens += len(item.token_ids)
            if request.num_computed_tokens <= request.num_prompt_tokens:
                self.num_prompt_tokens_computed += len(item.token_ids)
            token_id = sampled.get(item.request_id)
            if token_id is None:
                continue
            request.append_output_token(token_id)
            self.num_generation_tokens += 1
            status = self._check_stop(request, token_id)
            if status is not None:
                self.running.remove(request)
                self._free(request, status)
            outputs.append(
                EngineCoreOutput(
                    request.request_id,
                    [token_id],
                    request.status.finish_reason,
                    request.stop_reason,
                )
            )
        return outputs

    # ---- policies -------------------------------------------------------------

    def _peek_waiting(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return min(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        return self.waiting[0]

    def _pick_victim(self, candidates: list[Request]) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]  # the most recently admitted

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and put it back at the front of the queue;
        it will recompute its tokens (prompt and outputs so far) when readmitted."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        samples = start + num_new == request.num_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            num_computed_tokens=start,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            sampling_params=request.sampling_params if samples else None,
            num_output_tokens=request.num_output_tokens,
        )

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
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def get_stats(self) -> dict[str, float]:
        kv = self.kv_cache_manager
        return {
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "num_blocks_total": kv.num_blocks,
            "num_blocks_used": kv.block_pool.num_used_blocks,
            "kv_cache_usage_perc": 100.0 * kv.usage,
            "num_preemptions": self.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens_computed,
            "generation_tokens": self.num_generation_tokens,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
        }
