"""The real default model: SmolLM2-135M-Instruct from its GGUF file, against transformers
loading the same GGUF (dequantized): float32 token for token, bfloat16 by greedy agreement."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, BeamSearchParams, SamplingParams
from tests.helpers import QUESTIONS, agreement_with_hf_steps, load_hf, quantized_modules

pytestmark = pytest.mark.slow


def test_smollm2_gguf_matches_hf(gguf_path):

    llm = LLM(gguf_path, dtype="float32", kv_cache_memory_bytes=1 << 28)
    tok = llm.get_tokenizer()
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)

    hf = load_hf(gguf_path, torch.float32)
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


def test_smollm2_bf16_greedy_agrees_with_hf_bf16(gguf_path):
    """In bf16, two correct engines differ in the last bit of some attention
    outputs (summation order), and greedy decoding then parts at the first
    near-tie of the top two logits: position-wise agreement after that measures
    luck, not fidelity. So this checks every pagoda token against HF bf16's own
    greedy choice on the same prefix, HF decoding with its KV cache step by step
    (decode numerics on both sides). The target is 90% (issue 6).

    The file's blocks are expanded to bf16 (`quantization="none"`), as transformers
    expands them: the same weights on both sides, so only bf16 arithmetic differs
    (the blocks with int8 activations have their own test in test_quantization.py)."""
    llm = LLM(gguf_path, dtype="bfloat16", quantization="none", kv_cache_memory_bytes=1 << 28)
    assert not quantized_modules(llm), "the bf16 path must hold no quantized blocks"
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    outs = llm.chat(convs, params, use_tqdm=False)
    agree, total = agreement_with_hf_steps(load_hf(gguf_path, torch.bfloat16), outs)
    assert total == 8 * 32
    assert agree / total >= 0.9, f"bf16 greedy agreement with HF bf16: {agree}/{total}"


def test_smollm2_beam_search_matches_hf(gguf_path):
    """Beam search on the real model (fp32, the GGUF's blocks dequantized on both sides):
    every returned beam equal to transformers' `generate(num_beams=4)`, scores too."""
    llm = LLM(gguf_path, dtype="float32", quantization="none", kv_cache_memory_bytes=1 << 28)
    tok = llm.get_tokenizer()
    eos = list(llm.llm_engine.model_config.eos_token_ids)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS[:2]]
    params = BeamSearchParams(beam_width=4, max_tokens=16, length_penalty=0.6)
    prompts = [
        tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
        for c in convs
    ]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    hf = load_hf(gguf_path, torch.float32)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                num_beams=4, num_return_sequences=4, length_penalty=0.6, eos_token_id=eos,
                pad_token_id=eos[0], return_dict_in_generate=True, output_scores=True,
                repetition_penalty=1.0, no_repeat_ngram_size=0,
            )  # fmt: skip
        for seq, score, beam in zip(
            ref.sequences, ref.sequences_scores, out.sequences, strict=True
        ):
            tokens = seq[len(prompt) :].tolist()
            end = next((i for i, t in enumerate(tokens) if t in eos), None)
            tokens = tokens if end is None else tokens[: end + 1]
            assert beam.tokens[len(prompt) :] == tokens
            assert beam.cum_logprob / len(tokens) ** 0.6 == pytest.approx(score.item(), abs=1e-4)
