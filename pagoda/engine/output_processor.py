"""Turns engine-core outputs into `RequestOutput`s: detokenizes, applies stop strings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagoda.core.sched_output import EngineCoreOutput
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.request import Request


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.detokenizer.output_text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        metrics = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finish_reason is not None,
            metrics=metrics,
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def add_request(self, request: Request, prompt: str | None) -> None:
        p = request.sampling_params
        detok = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            p.skip_special_tokens,
            p.stop,
            p.include_stop_str_in_output,
        )
        self.states[request.request_id] = RequestState(
            request.request_id, prompt, request.prompt_token_ids, detok, request.arrival_time
        )

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs of requests that progressed, ids that hit a stop string).

        The caller must finish the stop-string ids in the scheduler.
        """
        outputs, stopped = [], []
        now = time.monotonic()
        for out in core_outputs:
            state = self.states[out.request_id]
            if state.first_token_time is None:
                state.first_token_time = now
            state.output_token_ids.extend(out.new_token_ids)
            stop_str = state.detokenizer.add_tokens(out.new_token_ids, last=out.finish_reason is not None)
            if stop_str is not None and out.finish_reason is None:
                state.finish_reason, state.stop_reason = "stop", stop_str
                stopped.append(out.request_id)
            elif out.finish_reason is not None:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
                if stop_str is not None:
                    state.finish_reason, state.stop_reason = "stop", stop_str
            outputs.append(state.to_output())
            if state.finish_reason is not None:
                del self.states[out.request_id]
        return outputs, stopped

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                state.finish_reason = "abort"
                outputs.append(state.to_output())
        return outputs
