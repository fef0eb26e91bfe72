"""`LLM`: the offline API, vLLM's names and shapes."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.pooling import cosine, score_pairs
from pagoda.engine.processor import PromptType
from pagoda.engine_args import EngineArgs
from pagoda.lora.request import LoRARequest
from pagoda.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """Generate for many prompts at once with continuous batching.

    `LLM(model=None)` serves the default model, SmolLM2-135M-Instruct. Every
    keyword is an `EngineArgs` field.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}.")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in input order.
        `lora_request`: one adapter for every prompt, or one (or None) per prompt.
        `slo_ttft_ms`, `slo_tpot_ms`: every prompt's latency targets (default: the
        engine's); if one cannot be met, DeadlineUnmeetableError (a ValueError) is raised
        and none runs."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = _per_prompt(sampling_params, "sampling_params", len(prompts))
        loras = _per_prompt(lora_request, "lora_request", len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts.")
        default_params = self.llm_engine.processor.default_sampling_params()
        request_ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = str(next(self._counter))
                # One output per request, when it finishes: nothing accumulates per step.
                if params is None or isinstance(params, SamplingParams):
                    params = replace(
                        params or default_params, output_kind=RequestOutputKind.FINAL_ONLY
                    )
                self.llm_engine.add_request(
                    request_id,
                    prompt,
                    params,
                    priority[i] if priority else 0,
                    lora_request=loras[i],
                    slo_ttft_ms=slo_ttft_ms,
                    slo_tpot_ms=slo_tpot_ms,
                )
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)  # all or nothing
            raise
        return self._run_engine(request_ids, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: each prompt's `params.beam_width` best beams, best
        first (transformers' `generate(num_beams=...)`, step for step; see
        pagoda/core/beams.py). Beams share their common blocks in the KV cache."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
        outputs = self.generate(prompts, params.to_sampling_params(), use_tqdm, lora_request)
        tokenizer = self.get_tokenizer()
        return [
            BeamSearchOutput([_beam(out, c, tokenizer) for c in out.outputs]) for out in outputs
        ]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (vLLM's `LLM.embed`): an embedding model's, or a
        decoder's served with task="embed". `pooling_params`: dimensions, normalize,
        truncate_prompt_tokens."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task="embed")
        return [
            EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()), o.prompt_token_ids)
            for o in self._pool(prompts, params, use_tqdm, lora_request)
        ]  # fmt: skip

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities, from a classifier model (vLLM's `LLM.classify`)."""
        params = PoolingParams(task="classify")
        return [
            ClassificationRequestOutput(o.request_id, ClassificationOutput(o.outputs.data.tolist()), o.prompt_token_ids)
            for o in self._pool(prompts, params, use_tqdm, lora_request)
        ]  # fmt: skip

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """Relevance of text pairs (vLLM's `LLM.score`): one text against each of a list,
        or two lists pairwise. A cross-encoder reads each pair whole (its sigmoid score);
        an embedding model scores the cosine of the two texts' embeddings."""
        pairs = score_pairs(data_1, data_2)
        if "classify" in self.llm_engine.model_config.tasks:
            params = PoolingParams(task="score", truncate_prompt_tokens=truncate_prompt_tokens)
            prompts = [{"text_1": a, "text_2": b} for a, b in pairs]
            return [
                ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids)
                for o in self._pool(prompts, params, use_tqdm, None)
            ]  # fmt: skip
        texts = [t for pair in pairs for t in pair]
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        embedded = self.embed(texts, params, use_tqdm)
        out = []
        for a, b in zip(embedded[0::2], embedded[1::2], strict=True):
            score = cosine(a.outputs.embedding, b.outputs.embedding)
            out.append(ScoringRequestOutput(a.request_id, ScoringOutput(score), a.prompt_token_ids + b.prompt_token_ids))  # fmt: skip
        return out

    def _pool(self, prompts, params: PoolingParams, use_tqdm: bool, lora_request):
        outputs = self.generate(prompts, params, use_tqdm, lora_request)
        for out in outputs:
            if out.outputs is None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        return outputs

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the model's chat
        template; `tools` (OpenAI's tool definitions) go into the prompt as the template
        renders them (`pagoda.engine.tools` parses calls out of the replies);
        `chat_template_kwargs`: the template's own variables (vLLM's name), e.g. Qwen3's
        {"enable_thinking": False}."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            {"messages": c, "add_generation_prompt": add_generation_prompt} for c in conversations
        ]
        for prompt in prompts:
            if tools is not None:
                prompt["tools"] = tools
            if chat_template_kwargs is not None:
                prompt["chat_template_kwargs"] = chat_template_kwargs
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        bar = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            dynamic_ncols=True,
            disable=not use_tqdm,
        )
        start, num_in, num_out = time.perf_counter(), 0, 0
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                        num_in += len(out.prompt_token_ids)
                        if isinstance(out, RequestOutput):
                            num_out += sum(len(o.token_ids) for o in out.outputs)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(
                            f"in: {num_in / elapsed:.0f} tok/s, out: {num_out / elapsed:.0f} tok/s"
                        )
                        bar.update(1)
                if pending and not engine.has_unfinished_requests():
                    raise RuntimeError(
                        f"engine stopped with requests unfinished: {sorted(pending)[:5]}"
                    )
        except BaseException:
            engine.abort_request(list(pending))  # leave no request behind (e.g. on Ctrl-C)
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]


def _beam(out: RequestOutput, c, tokenizer) -> BeamSearchSequence:
    tokens = out.prompt_token_ids + c.token_ids
    text_tokens = tokens[:-1] if c.finish_reason == "stop" else tokens
    return BeamSearchSequence(
        tokens, c.logprobs or [], out.lora_request, c.cumulative_logprob or 0.0,
        tokenizer.decode(text_tokens), c.finish_reason, c.stop_reason,
    )  # fmt: skip


def _per_prompt(value: Any, name: str, num_prompts: int) -> list:
    """One value for every prompt, or a list of one per prompt."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != num_prompts:
            raise ValueError(f"{name} has {len(value)} entries for {num_prompts} prompts.")
        return list(value)
    return [value] * num_prompts
