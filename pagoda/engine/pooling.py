"""The front door of pooling requests (embed, classify, score): their checks, and their
prompt tokenized as the model's own tokenizer does it (special tokens, a pair's
separators and segments; truncation where asked). Its prompt is a text, token ids, or
for a cross-encoder a pair of texts: {"text_1": query, "text_2": document}."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pagoda.checks import check_text, fail, show
from pagoda.config import ModelConfig
from pagoda.engine.validation import RequestValidator, check_trace_headers
from pagoda.lora.request import LoRARequest
from pagoda.pooling_params import PoolingParams
from pagoda.request import POOLING_SAMPLING, Request

_VERBS = {"embed": "embeddings", "classify": "classification", "score": "pair scores"}


class PoolingInputs:
    def __init__(
        self,
        tokenizer,
        validator: RequestValidator,
        model_config: ModelConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
    ) -> None:
        """`tokenizer`: the Processor's own copy. A pooling prompt runs whole in one step:
        at most `max_num_batched_tokens` tokens, and `max_model_len`."""
        self.tokenizer = tokenizer
        self.validator = validator
        self.model_config = model_config
        self.max_tokens = min(max_model_len, max_num_batched_tokens)

    def process(
        self,
        request_id: str,
        prompt: Any,
        params: PoolingParams,
        priority: int,
        arrival_time: float | None,
        lora_request: LoRARequest | None,
        trace_headers: Mapping[str, str] | None,
    ) -> tuple[list[Request], str | None]:
        """The one Request of a pooling request (its id is the request's), and its text.
        Raises InvalidRequestError naming the field."""
        params.check_fields()
        self._check_task(params)
        text, token_ids, pair_start = self._tokenize(prompt, params.truncate_prompt_tokens)
        request = Request(
            request_id,
            token_ids,
            POOLING_SAMPLING,
            priority,
            arrival_time,
            lora_request,
            check_trace_headers(trace_headers),
            pooling_params=dataclasses.replace(params, pair_start=pair_start),
        )
        return [request], text

    def _check_task(self, params: PoolingParams) -> None:
        mc = self.model_config
        serves = "classify" if params.task == "score" else params.task
        if serves not in mc.tasks:
            hint = "; start it with --task embed" if "generate" in mc.tasks else ""
            fail(
                "model",
                f"{mc.model!r} does not give {_VERBS[params.task]}: it serves "
                f"{', '.join(sorted(mc.tasks))}{hint}",
            )
        if params.dimensions is not None and params.dimensions > mc.pooler.dimension:
            fail(
                "dimensions",
                f"must be at most the model's {mc.pooler.dimension}",
                params.dimensions,
            )

    def _tokenize(
        self, prompt: Any, truncate: int | None
    ) -> tuple[str | None, list[int], int | None]:
        """(text, token ids, where a pair's second text starts or None)."""
        pair = None
        if isinstance(prompt, dict) and set(prompt) == {"text_1", "text_2"}:
            prompt, pair = prompt["text_1"], check_text(prompt["text_2"], "text_2")
            check_text(prompt, "text_1")
        elif isinstance(prompt, dict) and set(prompt) == {"prompt"}:
            prompt = prompt["prompt"]
        if isinstance(prompt, dict) and set(prompt) == {"prompt_token_ids"}:
            ids = self.validator.check_token_ids(
                prompt["prompt_token_ids"], "prompt_token_ids", self.max_tokens * 64
            )
            text, token_ids, types = None, list(ids[:truncate] if truncate else ids), None
        elif isinstance(prompt, str):
            check_text(prompt, "prompt")
            template = self.model_config.hf_config.get("rerank_template")
            if pair is not None and template:  # a GGUF reranker's: the pair in one text
                text, token_ids = self._fill(template, prompt, pair, truncate)
                types = pair = None
            else:
                enc = self.tokenizer(prompt, pair, truncation=truncate is not None, max_length=truncate)  # fmt: skip
                text, token_ids, types = prompt, enc["input_ids"], enc.get("token_type_ids")
        else:
            fail("prompt", "must be a string, {'prompt_token_ids': [...]} or "
                 "{'text_1': ..., 'text_2': ...}", show(prompt))  # fmt: skip
        if not token_ids or text == "":
            fail("prompt", "must not be empty")
        if len(token_ids) > self.max_tokens:
            fail(
                "prompt",
                f"is {len(token_ids)} tokens long; a pooling prompt runs whole, in one step, "
                f"of at most {self.max_tokens} tokens (max_model_len, max_num_batched_tokens): "
                "set truncate_prompt_tokens to cut it",
                code="context_length_exceeded",
            )
        pair_start = types.index(1) if pair is not None and types and 1 in types else None
        return text, token_ids, pair_start

    def _fill(self, template: str, query: str, document: str, truncate: int | None) -> tuple[str, list[int]]:  # fmt: skip
        """The pair filled into a reranker's template (as llama-server fills its rerank
        prompt), tokenized. Truncation cuts the document's last tokens, then the query's,
        never the template's: the score is read at its end."""
        values = {"{document}": document, "{query}": query}
        text, spans = "", {field: [] for field in values}
        for piece in re.split(r"(\{query\}|\{document\})", template):
            if piece in values:  # (a value is never searched again for a field's name)
                spans[piece].append((len(text), len(text) + len(values[piece])))
                piece = values[piece]
            text += piece
        enc = self.tokenizer(text, return_offsets_mapping=truncate is not None)
        ids = enc["input_ids"]
        if truncate is None or len(ids) <= truncate:
            return text, ids
        cut: list[int] = []  # the indices of the tokens cut, the document's last first
        for field in values:
            inside = [i for i, (start, end) in enumerate(enc["offset_mapping"])
                      if end > start and any(a <= start and end <= b for a, b in spans[field])]  # fmt: skip
            cut += inside[::-1][: len(ids) - truncate - len(cut)]
        if len(ids) - len(cut) > truncate:
            fail("truncate_prompt_tokens", f"must be at least {len(ids) - len(cut)}: the tokens "
                 "left with every token of the query and document cut (the model's rerank "
                 "template is never cut)", truncate)  # fmt: skip
        gone = set(cut)
        return text, [t for i, t in enumerate(ids) if i not in gone]


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The pairs to score: one text against each of a list (or one), or two lists of one
    length pairwise. Raises InvalidRequestError naming the field."""
    firsts = [data_1] if isinstance(data_1, str) else list(data_1)
    seconds = [data_2] if isinstance(data_2, str) else list(data_2)
    if not firsts or not seconds:
        fail("text_1" if not firsts else "text_2", "must not be empty")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        fail("text_2", f"has {len(seconds)} texts for {len(firsts)} in text_1 (one, or as many)")
    return list(zip(firsts, seconds, strict=True))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / max(math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)), 1e-12)
