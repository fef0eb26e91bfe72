"""What the engine hands back to users: vLLM's `RequestOutput` shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """A token's log probability, its rank among the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, holding the chosen token and the top-N.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion of a request. `token_ids` and `text` are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[PositionLogprobs] | None = None  # one per token, when asked for
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step; `finished` once every completion is."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # None for the first token
    metrics: dict[str, float] = field(default_factory=dict)
