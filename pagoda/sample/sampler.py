"""Logits -> token ids, batched: a pure function of logits and per-step sampling tensors.

Greedy rows take the argmax. Random rows sample with the exponential race
(argmax of probs / Exp(1) noise), which needs no cumsum or host sync; a row
with a seed draws its noise from a generator seeded by (seed, output index),
so its tokens do not depend on what else shares the batch, nor on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.sampling_params import SamplingParams


@dataclass
class SamplingTensors:
    """One step's sampling parameters, one row per sampling request."""

    temperature: torch.Tensor  # [B] float32; 0 rows are greedy
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    all_greedy: bool
    seeds: dict[int, int]  # row -> seed for this draw

    @classmethod
    def from_params(
        cls, params: list[SamplingParams], num_output_tokens: list[int], vocab_size: int
    ) -> SamplingTensors:
        all_greedy = all(p.greedy for p in params)
        temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params])
        if all_greedy:
            return cls(temperature, None, None, None, True, {})
        top_k = top_p = min_p = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params])
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params])
        seeds = {
            row: _draw_seed(p.seed, n)
            for row, (p, n) in enumerate(zip(params, num_output_tokens, strict=True))
            if p.seed is not None and not p.greedy
        }
        return cls(temperature, top_k, top_p, min_p, False, seeds)


def _draw_seed(seed: int, output_index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + output_index) % (1 << 63)


def sample(logits: torch.Tensor, st: SamplingTensors, generator: torch.Generator) -> torch.Tensor:
    """logits: [B, V] float32 -> token ids [B] int64."""
    greedy_ids = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy_ids
    greedy = st.temperature == 0.0
    logits = logits / torch.where(greedy, 1.0, st.temperature).unsqueeze(1)
    if st.top_k is not None or st.top_p is not None:
        logits = apply_top_k_top_p(logits, st.top_k, st.top_p)
    probs = logits.softmax(dim=-1)
    if st.min_p is not None:
        threshold = st.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, seed in st.seeds.items():
        noise[row].exponential_(generator=torch.Generator().manual_seed(seed))
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, greedy_ids, sampled)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask all but the top-k logits and the smallest set whose probability reaches top-p."""
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(min=0).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits)
