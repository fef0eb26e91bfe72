"""Per-request sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagoda.checks import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    check_bool,
    check_int,
    check_real,
    fail,
)

_GREEDY_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's names); set exactly one field.

    `json`: a JSON schema (a dict, or its JSON text); `json_object`: any JSON
    object; `regex`: a regular expression (Rust `regex` syntax); `choice`: one of
    these strings; `grammar`: a Lark grammar (llguidance's dialect) or a GBNF one
    (llama.cpp's). Every token sampled is one the grammar allows, and the request
    stops when the grammar is complete.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far: text, token ids, logprobs
    DELTA = 1  # only what this step added (the server streams these)
    FINAL_ONLY = 2  # one output, when the request finishes (LLM.generate)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    Construction checks each field's type and range (as vLLM's does); the engine's
    front door (`Processor`) checks again when the request is added, against the
    model's and server's limits too. Both raise `pagoda.errors.InvalidRequestError`
    (a `ValueError`) naming the field.
    `temperature == 0` means greedy; `seed` makes sampling reproducible
    whatever else shares the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off; above the vocabulary size: the whole vocabulary
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (plus the chosen one)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Beam search (vLLM's extra fields; transformers' `early_stopping`): `best_of` beams
    # (n if unset), the best n returned. See pagoda/core/beams.py.
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as transformers'
    # Filled in by the engine (generation config, tokenizer); not user-facing.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # The checked grammar (llguidance's serialized form), from structured_outputs.
    grammar: str | None = field(default=None, repr=False)
    # The grammar starts once the output holds these tokens (a reasoning model's
    # `</think>`: the grammar constrains the answer, not the reasoning); () from the start.
    grammar_after: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        self.check_fields()

    def check_fields(self) -> None:
        """Each field's type and range, as far as they need neither the model nor the
        server's limits; raises InvalidRequestError naming the field."""
        check_int(self.n, "n", 1, INT32_MAX)
        check_real(self.temperature, "temperature", 0.0, 1e6)
        check_real(self.top_p, "top_p", 0.0, 1.0, lo_open=True)
        check_int(self.top_k, "top_k", -1, INT32_MAX)
        check_real(self.min_p, "min_p", 0.0, 1.0)
        check_real(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        check_real(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        check_real(self.repetition_penalty, "repetition_penalty", 0.0, 100.0, lo_open=True)
        if self.seed is not None:
            check_int(self.seed, "seed", INT64_MIN, INT64_MAX)
        if self.max_tokens is not None:
            check_int(self.max_tokens, "max_tokens", 1, INT64_MAX)
        check_int(self.min_tokens, "min_tokens", 0, self.max_tokens or INT64_MAX)
        for name in ("logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, 0 if "logprobs" in name else 1, INT64_MAX)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            check_bool(getattr(self, name), name)
        self._check_beam_search()

    def _check_beam_search(self) -> None:
        """Beams rank by the model's own log-probabilities: nothing may reshape them."""
        check_bool(self.use_beam_search, "use_beam_search")
        check_real(self.length_penalty, "length_penalty", -1e6, 1e6)
        if self.early_stopping not in (True, False, "never"):
            fail("early_stopping", "must be true, false or 'never'", self.early_stopping)
        if self.best_of is not None:
            check_int(self.best_of, "best_of", self.n, INT32_MAX)
        if not self.use_beam_search:
            if self.best_of not in (None, self.n):
                fail("best_of", "other than n needs use_beam_search", self.best_of)
            if self.length_penalty != 1.0 or self.early_stopping is not False:
                name = "length_penalty" if self.length_penalty != 1.0 else "early_stopping"
                fail(name, "applies only with use_beam_search")
            return
        unset = {
            "temperature": self.temperature == 0.0,
            "top_p": self.top_p == 1.0,
            "top_k": self.top_k in (-1, 0),
            "min_p": self.min_p == 0.0,
            "presence_penalty": self.presence_penalty == 0.0,
            "frequency_penalty": self.frequency_penalty == 0.0,
            "repetition_penalty": self.repetition_penalty == 1.0,
            "logit_bias": not self.logit_bias,
            "allowed_token_ids": self.allowed_token_ids is None,
            "bad_words": not self.bad_words,
            "min_tokens": self.min_tokens == 0,
            "stop": not self.stop,
            "prompt_logprobs": self.prompt_logprobs is None,
            "structured_outputs": self.structured_outputs is None,
        }
        for name, ok in unset.items():
            if not ok and name == "temperature":
                fail(name, "must be 0 with use_beam_search (beams rank by the model's own "
                     "log-probabilities)", self.temperature)  # fmt: skip
            if not ok:
                fail(name, "cannot be used with use_beam_search", getattr(self, name))

    @property
    def beam_width(self) -> int:
        """Beams kept at each step (with use_beam_search)."""
        return self.best_of or self.n

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling looks at the prompt and output tokens so far."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.bad_words_token_ids
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


@dataclass
class BeamSearchParams:
    """`LLM.beam_search`'s parameters (vLLM's names; `early_stopping` is transformers'):
    keep `beam_width` beams, return them best first. The score of a finished beam is
    its summed log-probability over (its output length ** length_penalty)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # 0 only: beams rank by the model's own log-probabilities
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def to_sampling_params(self) -> SamplingParams:
        """The same search as SamplingParams (use_beam_search, n = best_of = beam_width);
        raises InvalidRequestError naming a bad field."""
        return SamplingParams(
            n=self.beam_width,
            best_of=self.beam_width,
            use_beam_search=True,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            early_stopping=self.early_stopping,
            logprobs=0,  # each token's own log-probability, as vLLM's sequences carry
        )
