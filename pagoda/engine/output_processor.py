"""Turns engine-core outputs into `RequestOutput`s: detokenizes, applies stop strings,
gathers the n completions of a request (parallel sampling) into one output."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagoda.core.sched_output import EngineCoreOutput
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pagoda.request import Request


@dataclass
class CompletionState:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.visible_text(finished=self.finish_reason is not None),
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob,
        )


@dataclass
class RequestState:
    """One user request and its n completions (one per child request in the scheduler)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    completions: list[CompletionState]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def to_output(self) -> RequestOutput:
        metrics = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.to_output() for c in self.completions],
            finished=self.finished,
            prompt_logprobs=list(self.prompt_logprobs)
            if self.prompt_logprobs is not None
            else None,
            metrics=metrics,
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}
        self.parent_to_children: dict[str, list[str]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states or request_id in self.child_to_parent

    def child_ids(self, request_id: str) -> list[str]:
        """The scheduler ids of the request's completions that are still running."""
        return [
            cid
            for cid in self.parent_to_children.get(request_id, ())
            if cid in self.child_to_parent
        ]

    def add_request(self, request_id: str, children: list[Request], prompt: str | None) -> None:
        first = children[0]
        p = first.sampling_params
        completions = []
        for i, child in enumerate(children):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                first.prompt_token_ids,
                p.skip_special_tokens,
                p.stop,
                p.include_stop_str_in_output,
            )
            completions.append(
                CompletionState(i, detok, logprobs=[] if p.logprobs is not None else None)
            )
            self.child_to_parent[child.request_id] = (request_id, i)
        self.parent_to_children[request_id] = [c.request_id for c in children]
        self.states[request_id] = RequestState(
            request_id,
            prompt,
            first.prompt_token_ids,
            first.arrival_time,
            completions,
            prompt_logprobs=[None] if p.prompt_logprobs is not None else None,
        )

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs of requests that progressed, child ids that hit a stop string).

        The caller must finish the stop-string ids in the scheduler.
        """
        progressed: dict[str, RequestState] = {}
        stopped = []
        now = time.monotonic()
        for out in core_outputs:
            parent_id, index = self.child_to_parent[out.request_id]
            state = self.states[parent_id]
            progressed[parent_id] = state
            if out.prompt_logprobs is not None:
                self._add_prompt_logprobs(state, *out.prompt_logprobs)
            if not out.new_token_ids:
                continue
            if state.first_token_time is None:
                state.first_token_time = now
            c = state.completions[index]
            c.token_ids.extend(out.new_token_ids)
            if out.logprobs is not None and c.logprobs is not None:
                chosen, entry = out.logprobs
                c.logprobs.append(self._to_logprobs(entry))
                c.cumulative_logprob = (c.cumulative_logprob or 0.0) + entry[chosen][0]
            stop_str = c.detokenizer.add_tokens(
                out.new_token_ids, last=out.finish_reason is not None
            )
            if stop_str is not None:
                c.finish_reason, c.stop_reason = "stop", stop_str
                if out.finish_reason is None:
                    stopped.append(out.request_id)
            elif out.finish_reason is not None:
                c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
            if c.finish_reason is not None:
                del self.child_to_parent[out.request_id]
        outputs = []
        for parent_id, state in progressed.items():
            outputs.append(state.to_output())
            if state.finished:
                del self.states[parent_id]
                del self.parent_to_children[parent_id]
        return outputs, stopped

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            for cid in self.child_ids(request_id):
                del self.child_to_parent[cid]
            state = self.states.pop(request_id, None)
            self.parent_to_children.pop(request_id, None)
            if state is not None:
                for c in state.completions:
                    if c.finish_reason is None:
                        c.finish_reason = "abort"
                outputs.append(state.to_output())
        return outputs

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
