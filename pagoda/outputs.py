"""What the engine hands back to users: vLLM's `RequestOutput` shape.

A request's outputs are deltas or cumulative, as its `SamplingParams.output_kind`
asks (see `RequestOutputKind`): the server streams deltas, `LLM.generate` takes
one final output, `LLMEngine.step()` users get cumulative ones by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.lora.request import LoRARequest


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
    """One completion of a request: everything so far, or what one step added (delta)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[PositionLogprobs] | None = None  # one per token, when asked for
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PoolingOutput:
    """What a pooling request's hidden states came to (float32, on the host): an embedding
    [dimension], class probabilities [labels], or a score [1]."""

    data: Any


@dataclass
class PoolingRequestOutput:
    """A pooling request's one output (vLLM's shape), when it finishes. `outputs` is None
    when it was aborted or failed (`error` says why)."""

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool = True
    metrics: RequestMetrics | None = None
    error: str | None = None
    error_is_client: bool = False


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ClassificationOutput:
    probs: list[float]


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt (vLLM's shape)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationRequestOutput:
    """`LLM.classify`'s result for one prompt (vLLM's shape)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s result for one pair (vLLM's shape); `prompt_token_ids`: the pair's
    as the cross-encoder read it, or the two texts' one after the other."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class BeamSearchSequence:
    """One beam of `LLM.beam_search` (vLLM's shape): `tokens` hold the prompt and the
    output, `text` their text (without a final stop token)."""

    tokens: list[int]
    logprobs: list[PositionLogprobs]  # one per output token: its own logprob
    lora_request: LoRARequest | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class RequestMetrics:
    """A request's timeline (time.monotonic() seconds); kept by the output processor."""

    arrival_time: float
    queued_time: float | None = None  # when the engine took it (after its checks)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after a step; `finished` once every completion is.

    `error` says why a request failed alone (its completions then end with
    finish_reason "error"); `error_is_client` is True when its own input was the cause.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # None for the first token
    metrics: RequestMetrics | None = None
    error: str | None = None
    error_is_client: bool = False
    lora_request: LoRARequest | None = None  # the adapter it ran under
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held when it was admitted

    def add(self, delta: RequestOutput) -> None:
        """Append a later delta output of the same request to this one (a stream
        reader that fell behind reads several steps as one)."""
        by_index = {c.index: c for c in self.outputs}
        for new in delta.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(new)
                by_index[new.index] = new
                continue
            old.text += new.text
            old.token_ids = old.token_ids + new.token_ids
            if new.logprobs is not None:
                old.logprobs = (old.logprobs or []) + new.logprobs
            old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
            old.cumulative_logprob = new.cumulative_logprob
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs
        self.finished, self.metrics = delta.finished, delta.metrics
        self.error = self.error or delta.error
        self.error_is_client = self.error_is_client or delta.error_is_client
