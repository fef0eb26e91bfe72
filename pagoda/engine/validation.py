"""The front door's checks of a request's parts against the model and the engine:
sampling parameters (against the context left and the server's `RequestLimits`),
token ids (against the vocabulary), LoRA requests (against the adapter folder) and
trace headers. Each raises `InvalidRequestError` naming the field.

`RequestValidator` holds the Processor's copy of the tokenizer (bad words and stop
strings are tokenized here) and nothing that changes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from pagoda.checks import (
    INT64_MAX,
    check_int,
    check_list,
    check_real,
    check_strings,
    check_text,
    fail,
    is_int,
)
from pagoda.config import LoRAConfig, ModelConfig, RequestLimits
from pagoda.core.structured_output import build_grammar
from pagoda.lora.adapter import LoRAAdapter, check_adapter, load_adapter
from pagoda.lora.request import LoRARequest
from pagoda.sampling_params import RequestOutputKind, SamplingParams

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context
_INT_KEY = re.compile(r"-?[0-9]{1,20}")


def check_trace_headers(headers: Any) -> dict[str, str] | None:
    """The W3C trace-context entries of `headers` (names in any case), or None."""
    if headers is None:
        return None
    if not isinstance(headers, Mapping):
        fail("trace_headers", "must be a mapping of header names to values", headers)
    out = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            fail("trace_headers", "names and values must be strings", f"{name!r}: {value!r}")
        if name.lower() in TRACE_HEADERS:
            check_text(value, f"trace_headers.{name.lower()}", 512)
            out[name.lower()] = value
    return out or None


class RequestValidator:
    def __init__(
        self,
        tokenizer,
        model_config: ModelConfig,
        max_model_len: int,
        limits: RequestLimits,
        lora_config: LoRAConfig | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.limits = limits
        self.lora_config = lora_config
        self.vocab_size = int(model_config.hf_config["vocab_size"])

    # ---- token ids ---------------------------------------------------------------------

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """The tokenizer's ids for `text`, every one an id the model has (a tokenizer may
        know more tokens than the model's embedding holds)."""
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        self.check_vocabulary(ids, param)
        return ids

    def check_vocabulary(self, ids: list[int], param: str) -> None:
        if ids and max(ids) >= self.vocab_size:
            fail(
                param,
                f"holds a token ({max(ids)}) beyond the model's vocabulary ({self.vocab_size})",
            )

    def check_token_ids(self, token_ids: Any, param: str, max_len: int) -> list[int]:
        """A list of token ids, each in [0, vocab_size)."""
        check_list(token_ids, param, max_len, allow_empty=True)
        for t in token_ids:
            if not is_int(t) or not 0 <= t < self.vocab_size:
                fail(param, f"must hold token ids in [0, {self.vocab_size})", t)
        return token_ids

    # ---- LoRA ----------------------------------------------------------------------------

    def check_lora(self, lora_request: Any, param: str = "lora_request") -> LoRARequest:
        """A LoRARequest this engine can serve: LoRA on, a name, an id >= 1, and an
        adapter folder that fits the model and max_lora_rank (read from its config and
        its weight file's header; no tensor is read here)."""
        if self.lora_config is None:
            fail(param, "needs LoRA on: start the engine with enable_lora=True (--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            fail(param, "must be a LoRARequest", type(lora_request).__name__)
        check_text(lora_request.lora_name, param, 256, where=f"{param}.lora_name")
        if not lora_request.lora_name:
            fail(param, "must not be empty", where=f"{param}.lora_name")
        lora_id = lora_request.lora_int_id
        if not is_int(lora_id) or not 1 <= lora_id <= INT64_MAX:
            fail(param, "must be an integer >= 1", lora_id, where=f"{param}.lora_int_id")
        check_text(lora_request.lora_path, param, 4096, where=f"{param}.lora_path")
        check_adapter(
            lora_request.lora_path,
            self.model_config.hf_config,
            self.lora_config.max_lora_rank,
            param,
        )
        return lora_request

    def load_lora(self, lora_request: Any, param: str = "lora_request") -> LoRAAdapter:
        """Check a LoRARequest (`check_lora`) and read its adapter's weights."""
        self.check_lora(lora_request, param)
        return load_adapter(
            lora_request.lora_path,
            self.model_config.hf_config,
            self.lora_config.max_lora_rank,
            param,
        )

    # ---- sampling parameters ---------------------------------------------------------------

    def check_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """A checked copy of `params` for a prompt of `num_prompt_tokens`, with the
        engine's fields (EOS ids, bad words as token ids) filled in. The fields are
        checked again (`SamplingParams.check_fields`): they may have changed since
        construction."""
        p, limits, vocab = params, self.limits, self.vocab_size
        room = self.max_model_len - num_prompt_tokens
        p.check_fields()
        check_int(p.n, "n", 1, limits.max_n)
        if p.use_beam_search:
            name = "n" if p.best_of is None else "best_of"
            check_int(p.beam_width, name, 1, min(limits.max_n, vocab // 2))
            if p.logprobs not in (None, 0):  # a beam's tokens carry their own logprobs only
                fail("logprobs", "must be 0 or unset with use_beam_search", p.logprobs)
        logit_bias = self._check_logit_bias(p.logit_bias)
        if p.allowed_token_ids is not None:
            self.check_token_ids(p.allowed_token_ids, "allowed_token_ids", vocab)
            if not p.allowed_token_ids:
                fail("allowed_token_ids", "must not be empty")
        bad_words = None
        if p.bad_words is not None:
            bad_words = check_strings(
                p.bad_words, "bad_words", limits.max_stop_string_chars, limits.max_bad_words
            )
        max_tokens = self._max_tokens(p.max_tokens, room, num_prompt_tokens)
        check_int(p.min_tokens, "min_tokens", 0, max_tokens or room)
        stop = []
        if p.stop is not None:
            stop = check_strings(
                p.stop, "stop", limits.max_stop_string_chars, limits.max_stop_strings
            )
        stop_token_ids = []
        if p.stop_token_ids is not None:
            stop_token_ids = list(self.check_token_ids(p.stop_token_ids, "stop_token_ids", vocab))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(p, name) is not None:
                check_int(getattr(p, name), name, 0, limits.max_logprobs)
        if not isinstance(p.output_kind, RequestOutputKind):
            fail("output_kind", "must be a RequestOutputKind", p.output_kind)
        bad_words_token_ids = self._bad_words(bad_words)
        if p.allowed_token_ids is not None:
            banned = {w[0] for w in bad_words_token_ids if len(w) == 1}
            if p.min_tokens > 0:
                eos = () if p.ignore_eos else self.model_config.eos_token_ids
                banned |= {*stop_token_ids, *eos}
            if set(p.allowed_token_ids) <= banned:
                fail(
                    "allowed_token_ids",
                    "leaves no token to sample: bad_words or min_tokens ban every one",
                )
        grammar = None
        if p.structured_outputs is not None:
            grammar = build_grammar(p.structured_outputs)
        return dataclasses.replace(
            p,
            grammar=grammar,
            top_k=-1 if p.top_k == 0 else p.top_k,  # 0 also means off, as in vLLM
            logit_bias=logit_bias,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            bad_words=bad_words,
            eos_token_ids=self.model_config.eos_token_ids,
            bad_words_token_ids=bad_words_token_ids,
        )

    def _max_tokens(self, max_tokens: int | None, room: int, num_prompt_tokens: int) -> int | None:
        """max_tokens within the context left after the prompt and the server's cap (the
        cap, or none, when unset)."""
        cap = self.limits.max_tokens
        if max_tokens is None:
            return None if cap is None else min(room, cap)
        if cap is not None and max_tokens > cap:
            fail("max_tokens", f"must be at most {cap} on this server", max_tokens)
        if max_tokens > room:
            fail(
                "max_tokens",
                f"is too large: this model's maximum context length (max_model_len) is "
                f"{self.max_model_len} tokens and the prompt is {num_prompt_tokens}, which "
                f"leaves room for {room} tokens, not {max_tokens}",
                code="context_length_exceeded",
            )
        return max_tokens

    def _check_logit_bias(self, logit_bias: Any) -> dict[int, float] | None:
        """token id (an int, or its decimal string as JSON has it) -> bias in [-100, 100]."""
        if logit_bias is None:
            return None
        if not isinstance(logit_bias, dict):
            fail("logit_bias", "must map token ids to numbers", logit_bias)
        if len(logit_bias) > self.limits.max_logit_bias:
            fail("logit_bias", f"may hold at most {self.limits.max_logit_bias} entries")
        out = {}
        for key, bias in logit_bias.items():
            if isinstance(key, str) and _INT_KEY.fullmatch(key):
                key = int(key)
            if not is_int(key) or not 0 <= key < self.vocab_size:
                fail("logit_bias", f"keys must be token ids in [0, {self.vocab_size})", key)
            out[key] = check_real(bias, "logit_bias", -100.0, 100.0)
        return out

    def _bad_words(self, words: Iterable[str] | None) -> list[list[int]]:
        """Each bad word as token ids, with and without a leading space (as vLLM does)."""
        out = []
        for word in words or ():
            for variant in (word, " " + word.lstrip()):
                ids = self.encode(variant, "bad_words", add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def check_num_prompts(self, num_prompts: int) -> None:
        """How many prompts one request (a /v1/completions body) may carry."""
        if num_prompts < 1:
            fail("prompt", "must not be empty")
        if num_prompts > self.limits.max_prompts:
            fail("prompt", f"may hold at most {self.limits.max_prompts} prompts ({num_prompts})")
