"""Greedy agreement with Hugging Face transformers on the same weights: the eight chat
questions the fidelity checks ask, transformers loaded from a GGUF file, and each
generated token scored against transformers' own greedy choice on the same prefix.
Shared by benchmarks/fidelity.py and the tests (through tests/helpers.py)."""

from __future__ import annotations

import os

import torch

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "What is 12 times 7?",
    "Give me a synonym for happy.",
    "Why is the sky blue?",
]


def load_hf(gguf_path: str, dtype: torch.dtype):
    """transformers' model for a GGUF file, its tensors dequantized to `dtype`."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=dtype
    ).eval()


def agreement_with_hf_steps(hf, outputs) -> tuple[int, int]:
    """(agreeing, total): each generated token against HF's own greedy choice on the same
    prefix, HF decoding step by step with its KV cache (decode numerics on both sides).
    Position-wise agreement after a first near-tie would measure luck, not fidelity."""
    from transformers import DynamicCache

    agree = total = 0
    for out in outputs:
        cache, step_ids = DynamicCache(), torch.tensor([out.prompt_token_ids])
        for token in out.outputs[0].token_ids:
            with torch.inference_mode():
                logits = hf(input_ids=step_ids, past_key_values=cache, use_cache=True).logits
            agree += int(logits[0, -1].float().argmax()) == token
            total += 1
            step_ids = torch.tensor([[token]])
    return agree, total
