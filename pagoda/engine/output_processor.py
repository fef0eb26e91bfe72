"""Turns engine-core outputs into `RequestOutput`s: detokenizes, applies stop strings,
gathers the n completions of a request (parallel sampling) into one output, and
keeps each request's timeline (arrival, first scheduled, first and last token).

It is the one owner of the requests a user sees: `len(states)` is the number of
unfinished requests, and the per-step `IterationStats` it returns are what the
metrics record.

What each output carries follows the request's `output_kind`: DELTA outputs
hold only what the step added (nothing accumulates here, so a long stream
costs O(1) per step); CUMULATIVE and FINAL_ONLY keep the totals.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pagoda.core.sched_output import EngineCoreOutput
from pagoda.core.stats import FinishedRequestStats, IterationStats
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.lora.request import LoRARequest
from pagoda.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagoda.request import SLO, Request
from pagoda.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


@dataclass
class CompletionState:
    index: int
    child_id: str  # the scheduler's request id
    detokenizer: IncrementalDetokenizer
    keeps_totals: bool  # CUMULATIVE or FINAL_ONLY
    wants_logprobs: bool
    num_tokens: int = 0
    num_preemptions: int = 0  # the scheduler's count for this completion
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Totals (only when keeps_totals).
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    # This step's delta.
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[PositionLogprobs] = field(default_factory=list)
    newly_finished: bool = False

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.newly_finished = True
        self.new_text += self.detokenizer.flush()

    def to_output(self, kind: RequestOutputKind) -> CompletionOutput:
        delta = kind == RequestOutputKind.DELTA
        logprobs = (
            (self.new_logprobs if delta else list(self.logprobs)) if self.wants_logprobs else None
        )
        return CompletionOutput(
            index=self.index,
            text=self.new_text if delta else self.text,
            token_ids=self.new_token_ids if delta else list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=self.cumulative_logprob,
        )

    def add_delta_to_totals(self) -> None:
        if self.keeps_totals:
            self.text += self.new_text
            self.token_ids += self.new_token_ids
            self.logprobs += self.new_logprobs

    def clear_delta(self) -> None:
        self.new_text, self.new_token_ids, self.new_logprobs = "", [], []
        self.newly_finished = False


@dataclass
class RequestState:
    """One user request and its n completions (one per child request in the scheduler)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    completions: list[CompletionState]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    error: str | None = None
    error_is_client: bool = False
    lora_request: LoRARequest | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held when it was admitted
    trace_headers: dict[str, str] | None = None
    # A pooling request (no completions): its scheduler id, and what its hidden states
    # pooled into, once known.
    pooling: str | None = None
    pooled: Any = None
    ended: bool = False  # aborted or failed
    slo: SLO | None = None  # its latency targets (the goodput metrics read them)

    @property
    def finished(self) -> bool:
        if self.pooling is not None:
            return self.pooled is not None or self.ended
        return all(c.finish_reason is not None for c in self.completions)

    @property
    def num_generation_tokens(self) -> int:
        return sum(c.num_tokens for c in self.completions)

    def to_output(self) -> RequestOutput | PoolingRequestOutput | None:
        """This step's output, or None where the output kind has nothing to send."""
        kind, finished = self.output_kind, self.finished
        if self.pooling is not None:
            return PoolingRequestOutput(
                self.request_id,
                None if self.pooled is None else PoolingOutput(self.pooled),
                self.prompt_token_ids,
                finished,
                dataclasses.replace(self.metrics),
                self.error,
                self.error_is_client,
            ) if finished else None  # fmt: skip
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind == RequestOutputKind.DELTA:
            completions = [
                c for c in self.completions if c.new_token_ids or c.new_text or c.newly_finished
            ]
            # Prompt logprobs go out once, with the first token (when they are complete).
            prompt_logprobs = None
            ready = finished or any(c.num_tokens for c in self.completions)
            if self.prompt_logprobs is not None and not self.prompt_logprobs_sent and ready:
                prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        else:
            completions = self.completions
            # A copy: the reader may be another thread, and chunks still append to it.
            prompt_logprobs = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        if not completions and prompt_logprobs is None and not finished:
            return None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.to_output(kind) for c in completions],
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            metrics=dataclasses.replace(self.metrics),  # a copy: the reader may be another thread
            error=self.error,
            error_is_client=self.error_is_client,
            lora_request=self.lora_request,
            num_cached_tokens=self.num_cached_tokens,
        )

    def finished_stats(self) -> FinishedRequestStats:
        m = self.metrics
        reason = next((c.finish_reason for c in self.completions if c.finish_reason), "abort")
        if self.pooled is not None:
            reason = "stop"
        if self.error is not None:
            reason = "error"
        num_gen = self.num_generation_tokens
        tpot = None
        if num_gen > 1 and m.first_token_time is not None:
            tpot = (m.last_token_time - m.first_token_time) / (num_gen - 1)
        return FinishedRequestStats(
            finish_reason=reason,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_generation_tokens=num_gen,
            e2e_latency=m.finished_time - m.arrival_time,
            time_per_output_token=tpot,
            lora_name=self.lora_request.lora_name if self.lora_request is not None else "",
            request_id=self.request_id,
            timeline=dataclasses.replace(m),
            num_cached_tokens=self.num_cached_tokens,
            num_preemptions=sum(c.num_preemptions for c in self.completions),
            trace_headers=self.trace_headers,
            slo=self.slo,
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}  # unfinished children only

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states or request_id in self.child_to_parent

    def parent_id(self, child_id: str) -> str:
        return self.child_to_parent[child_id][0]

    def child_ids(self, request_id: str) -> list[str]:
        """The scheduler ids of the request's completions that are still running."""
        state = self.states.get(request_id)
        if state is None:
            return []
        if state.pooling is not None:
            return [] if state.finished else [state.pooling]
        return [c.child_id for c in state.completions if c.finish_reason is None]

    def add_request(self, request_id: str, children: list[Request], prompt: str | None) -> None:
        first = children[0]
        p = first.sampling_params
        keeps_totals = p.output_kind != RequestOutputKind.DELTA
        completions = []
        pooling = first.request_id if first.pooling_params is not None else None
        if pooling is not None:  # it reports under its own id, and writes no text
            self.child_to_parent[pooling] = (request_id, 0)
        for i, child in enumerate([] if pooling is not None else children):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                first.prompt_token_ids,
                p.skip_special_tokens,
                p.stop,
                p.include_stop_str_in_output,
            )
            completions.append(
                CompletionState(i, child.request_id, detok, keeps_totals, p.logprobs is not None)
            )
            self.child_to_parent[child.request_id] = (request_id, i)
        self.states[request_id] = RequestState(
            request_id,
            prompt,
            first.prompt_token_ids,
            p.output_kind,
            completions,
            RequestMetrics(arrival_time=first.arrival_time, queued_time=time.monotonic()),
            prompt_logprobs=[None] if p.prompt_logprobs is not None else None,
            lora_request=first.lora_request,
            trace_headers=first.trace_headers,
            pooling=pooling,
            slo=first.slo,
        )

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput], now: float, pooled: dict | None = None
    ) -> tuple[list[RequestOutput], list[str], list[str], IterationStats]:
        """Apply one step's core outputs (at time `now`), and what pooling requests'
        hidden states came to (`pooled`, request id -> result).

        Returns (outputs of requests with something to send, child ids that hit a
        stop string or pooled, child ids that failed here, the step's stats). The
        caller must finish the stopped and failed children in the scheduler.
        """
        stats = IterationStats()
        progressed: dict[str, RequestState] = {}
        stopped: list[str] = []
        for request_id, data in (pooled or {}).items():
            if request_id not in self.child_to_parent:  # aborted while its step ran
                continue
            state = self.states[self.child_to_parent[request_id][0]]
            state.pooled, progressed[state.request_id] = data, state
            stopped.append(request_id)
            state.metrics.first_token_time = state.metrics.last_token_time = now
            stats.time_to_first_tokens.append(now - state.metrics.arrival_time)
            stats.num_prompt_tokens += len(state.prompt_token_ids)
        for out in core_outputs:
            parent_id, index = self.child_to_parent[out.request_id]
            state = self.states[parent_id]
            progressed[parent_id] = state
            if state.error is not None:  # failed earlier in this step: nothing more counts
                continue
            try:
                c = state.completions[index] if state.pooling is None else None
                if self._apply(state, c, out, now, stats):
                    stopped.append(out.request_id)
            except Exception as e:  # a bug this request's data tripped: it fails alone
                logger.exception("request %s failed in output processing", parent_id)
                self._fail(state, f"output processing failed: {e!r}", False)
        failed = []
        for state in progressed.values():
            if state.error is not None:
                children = [state.pooling] if state.pooling else [c.child_id for c in state.completions]  # fmt: skip
                failed += [cid for cid in children if cid in self.child_to_parent]
        return self._emit(progressed.values(), now, stats), stopped, failed, stats

    def _apply(
        self,
        state: RequestState,
        c: CompletionState | None,
        out: EngineCoreOutput,
        now: float,
        stats: IterationStats,
    ) -> bool:
        """One completion's step; True if it hit a stop string the scheduler must apply."""
        m = state.metrics
        if out.scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = out.scheduled_time
            stats.queue_times.append(out.scheduled_time - m.arrival_time)
            state.num_cached_tokens = out.num_cached_tokens
        if c is None:  # a pooling request: its result comes apart (process_outputs)
            return False
        c.num_preemptions = max(c.num_preemptions, out.num_preemptions)
        if out.prompt_logprobs is not None:
            self._add_prompt_logprobs(state, *out.prompt_logprobs)
        if not out.new_token_ids:
            return False
        if m.first_token_time is None:
            m.first_token_time = now
            stats.time_to_first_tokens.append(now - m.arrival_time)
            stats.num_prompt_tokens += len(state.prompt_token_ids)
        elif m.last_token_time != now:  # one gap per request per step, however many children
            stats.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        new_token_ids = out.new_token_ids
        last = out.finish_reason is not None
        if len(new_token_ids) > 1 and c.detokenizer.stop:
            # Several tokens in one step (speculative decoding): a stop string ends the
            # completion at the token that completes it, as one token a step would.
            text, stop_str = "", None
            for n, token_id in enumerate(new_token_ids, 1):
                is_last = last and n == len(new_token_ids)
                piece, stop_str = c.detokenizer.add_tokens([token_id], last=is_last)
                text += piece
                if stop_str is not None:
                    new_token_ids = new_token_ids[:n]
                    break
        else:
            text, stop_str = c.detokenizer.add_tokens(new_token_ids, last=last)
        stats.num_generation_tokens += len(new_token_ids)
        c.num_tokens += len(new_token_ids)
        c.new_token_ids += new_token_ids
        if out.logprobs is not None and c.wants_logprobs:
            for chosen, entry in out.logprobs[: len(new_token_ids)]:
                c.new_logprobs.append(self._to_logprobs(entry))
                c.cumulative_logprob = (c.cumulative_logprob or 0.0) + entry[chosen][0]
        if out.cumulative_logprob is not None:
            c.cumulative_logprob = out.cumulative_logprob
        c.new_text += text
        if stop_str is not None:
            c.finish("stop", stop_str)
            return out.finish_reason is None
        if out.finish_reason is not None:
            c.finish(out.finish_reason, out.stop_reason)
        return False

    def _emit(self, states, now: float, stats: IterationStats) -> list[RequestOutput]:
        outputs = []
        for state in states:
            for c in state.completions:
                if c.finish_reason is not None:
                    self.child_to_parent.pop(c.child_id, None)
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
                self.child_to_parent.pop(state.pooling, None)
            for c in state.completions:
                c.add_delta_to_totals()
            output = state.to_output()
            if output is not None:
                outputs.append(output)
            for c in state.completions:
                c.clear_delta()
            if finished:
                stats.finished_requests.append(state.finished_stats())
                del self.states[state.request_id]
        return outputs

    def abort_requests(
        self, request_ids: list[str], now: float, num_preemptions: dict[str, int] | None = None
    ) -> tuple[list[RequestOutput], IterationStats]:
        """End the given requests (unknown ids are ignored); their unfinished completions
        get finish_reason "abort". The caller frees their children in the scheduler;
        `num_preemptions` (child id -> count) brings the scheduler's last counts."""
        for child_id, count in (num_preemptions or {}).items():
            parent = self.child_to_parent.get(child_id)
            if parent is not None and self.states[parent[0]].pooling is None:
                c = self.states[parent[0]].completions[parent[1]]
                c.num_preemptions = max(c.num_preemptions, count)
        return self._end(request_ids, now, lambda state: None)

    def fail_requests(
        self, failures: dict[str, tuple[str, bool]], now: float
    ) -> tuple[list[RequestOutput], IterationStats]:
        """End requests that failed alone: request id -> (message, whether the client's
        input was the cause). The caller frees their children in the scheduler."""
        return self._end(list(failures), now, lambda s: self._fail(s, *failures[s.request_id]))

    def _end(self, request_ids, now, mark) -> tuple[list[RequestOutput], IterationStats]:
        stats = IterationStats()
        states = [self.states[r] for r in dict.fromkeys(request_ids) if r in self.states]
        for state in states:
            state.ended = True
            mark(state)
            for c in state.completions:
                if c.finish_reason is None:
                    c.finish("abort")
        return self._emit(states, now, stats), stats

    @staticmethod
    def _fail(state: RequestState, message: str, client_error: bool) -> None:
        state.error, state.error_is_client, state.ended = message, client_error, True
        for c in state.completions:
            if c.finish_reason is None:
                c.finish("error")

    def _add_prompt_logprobs(self, state: RequestState, start: int, entries: list[dict]) -> None:
        # Position p's entry scores prompt token p + 1; a recompute after preemption repeats positions.
        have = len(state.prompt_logprobs) - 1  # positions already scored
        for offset, entry in enumerate(entries):
            if start + offset == have:
                state.prompt_logprobs.append(self._to_logprobs(entry))
                have += 1

    def _to_logprobs(self, entry: dict[int, tuple[float, int]]) -> PositionLogprobs:
        ids = list(entry)
        texts = self.tokenizer.batch_decode([[i] for i in ids])
        return {
            i: Logprob(lp, rank, text)
            for i, (lp, rank), text in zip(ids, entry.values(), texts, strict=True)
        }
