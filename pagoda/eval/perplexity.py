"""Sliding-window perplexity of a model over a text, through the engine itself.

The windows are Hugging Face's ("Perplexity of fixed-length models"): windows of
`context` tokens starting every `stride` tokens; in each, only the tokens not
scored by an earlier window count (all but the first token, in the first). Each
window is one request asking for its prompt's logprobs, so the number measures
exactly what serves: paged attention, the kernels, quantized weights.

    ppl = exp(sum of -log p(token | the window's tokens before it) / tokens scored)
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

HELDOUT_TEXT = os.path.join(os.path.dirname(__file__), "heldout.txt")


@dataclass
class Window:
    token_ids: list[int]
    first_scored: int  # positions [first_scored, len) count


def halves(token_ids: list[int], context: int) -> list[Window]:
    """llama.cpp's `llama-perplexity` windows: whole chunks of `context` tokens, none
    overlapping, each scoring only its second half (the first half is its context)."""
    return [
        Window(token_ids[begin : begin + context], context // 2)
        for begin in range(0, len(token_ids) - context + 1, context)
    ]


def windows(token_ids: list[int], context: int, stride: int) -> list[Window]:
    """The sliding windows over `token_ids`, each scoring what no earlier one did."""
    if not 0 < stride <= context:
        raise ValueError(f"stride must be in [1, context={context}], got {stride}.")
    out, prev_end = [], 0
    for begin in range(0, len(token_ids), stride):
        end = min(begin + context, len(token_ids))
        num_new = end - prev_end  # tokens this window is the first to score
        window = token_ids[begin:end]
        if len(window) < 2:
            break
        out.append(Window(window, max(1, len(window) - num_new)))
        prev_end = end
        if end == len(token_ids):
            break
    return out


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    num_scored_tokens: int
    num_tokens: int
    num_windows: int
    context: int
    stride: int | None  # None: llama.cpp's windows
    seconds: float


def perplexity(
    engine_kwargs: dict[str, Any],
    text: str,
    context: int = 512,
    stride: int = 256,
    use_tqdm: bool = True,
    llama_cpp_windows: bool = False,
) -> PerplexityResult:
    """`llama_cpp_windows`: score as llama.cpp's perplexity tool does (see `halves`), for a
    figure comparable with its own; `stride` is then unused."""
    from pagoda import LLM, SamplingParams

    # Windows in flight need little KV cache; the engine's default (a quarter of memory,
    # up to 4 GiB) would only cost time to allocate.
    llm = LLM(**{"kv_cache_memory_bytes": 1 << 29, **_set(engine_kwargs)})
    token_ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    if context >= llm.llm_engine.max_model_len:
        raise ValueError(
            f"context ({context}) must be below max_model_len ({llm.llm_engine.max_model_len})."
        )
    spans = halves(token_ids, context) if llama_cpp_windows else windows(token_ids, context, stride)
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": w.token_ids} for w in spans],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=use_tqdm,
    )
    nll, scored = 0.0, 0
    for window, out in zip(spans, outputs, strict=True):
        for pos in range(window.first_scored, len(window.token_ids)):
            nll -= out.prompt_logprobs[pos][window.token_ids[pos]].logprob
            scored += 1
    return PerplexityResult(
        perplexity=math.exp(nll / scored),
        mean_nll=nll / scored,
        num_scored_tokens=scored,
        num_tokens=len(token_ids),
        num_windows=len(spans),
        context=context,
        stride=None if llama_cpp_windows else stride,
        seconds=time.perf_counter() - start,
    )


def as_record(result: PerplexityResult, engine_kwargs: dict[str, Any], file: str) -> dict:
    return {"file": file, "engine": engine_kwargs, **asdict(result)}


def _set(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}
