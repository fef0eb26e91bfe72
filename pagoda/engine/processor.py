"""The front door: validates a request, tokenizes it, and turns it into a `Request`."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagoda.config import ModelConfig
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class Processor:
    def __init__(self, tokenizer, model_config: ModelConfig, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.vocab_size = model_config.hf_config["vocab_size"]

    def render_chat(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A conversation -> {"prompt": text, "prompt_token_ids": ids} via the model's chat
        template. Raises ValueError (naming `messages`) when there is no template or it fails."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template; send a plain prompt.")
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            )
        except Exception as e:  # the template raised (e.g. roles out of order)
            raise ValueError(f"messages: the chat template failed on these messages: {e}") from e
        # The template already holds any special tokens it wants.
        return {
            "prompt": text,
            "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False),
        }

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.model_config.generation_defaults)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids). Raises ValueError naming the field."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if not isinstance(token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in token_ids
            ):
                raise ValueError("prompt_token_ids must be a list of integers.")
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt_token_ids has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}."
                )
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text, token_ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        else:
            raise ValueError(
                f"prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {type(prompt).__name__}."
            )
        if not token_ids:
            raise ValueError("prompt must not be empty.")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens long; max_model_len is {self.max_model_len} "
                "(the prompt must leave room for at least one generated token)."
            )
        return text, list(token_ids)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> tuple[list[Request], str | None]:
        """Returns (one Request per completion, prompt text). Child i of a request with
        n > 1 has id "<request_id>#<i>" and, if seeded, seed + i."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}.")
        if params is None:
            params = self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}.")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}.")
        for token_id in params.allowed_token_ids or ():
            if token_id >= self.vocab_size:
                raise ValueError(
                    f"allowed_token_ids has id {token_id} outside the vocabulary [0, {self.vocab_size})."
                )
        for token_id in params.logit_bias or {}:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"logit_bias has id {token_id} outside the vocabulary [0, {self.vocab_size})."
                )
        text, token_ids = self.tokenize_prompt(prompt)
        params = dataclasses.replace(
            params,
            eos_token_ids=self.model_config.eos_token_ids,
            bad_words_token_ids=self._bad_words(params.bad_words),
        )
        if params.n == 1:
            return [Request(request_id, token_ids, params, priority, arrival_time)], text
        children = []
        for i in range(params.n):
            child_params = (
                params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            )
            children.append(
                Request(f"{request_id}#{i}", token_ids, child_params, priority, arrival_time)
            )
        return children, text

    def _bad_words(self, words: list[str] | None) -> list[list[int]]:
        """Each bad word as token ids, with and without a leading space (as vLLM does)."""
        out = []
        for word in words or ():
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out
