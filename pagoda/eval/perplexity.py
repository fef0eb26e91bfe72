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
    stride: int
    seconds: float


def perplexity(
    engine_kwargs: dict[str, Any],
    text: str,
    context: int = 512,
    stride: int = 256,
    use_tqdm: bool = True,
) -> PerplexityResult:
    from pagoda import LLM, SamplingParams

    llm = LLM(**engine_kwargs)
    token_ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    if context >= llm.llm_engine.max_model_len:
        raise ValueError(
            f"context ({context}) must be below max_model_len ({llm.llm_engine.max_model_len})."
        )
    spans = windows(token_ids, context, stride)
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
        stride=stride,
        seconds=time.perf_counter() - start,
    )


def as_record(result: PerplexityResult, engine_kwargs: dict[str, Any], file: str) -> dict:
    return {"file": file, "engine": engine_kwargs, **asdict(result)}
