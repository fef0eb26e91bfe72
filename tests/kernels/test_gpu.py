"""The GPU path (device "cuda"): greedy float32 outputs token for token Hugging Face's
on the same weights, with CUDA graphs and without; SmolLM2 in bf16 by greedy agreement;
the KV cache sized from gpu_memory_utilization; no block leaked. Skipped without CUDA
(benchmarks/gpu_check.sh runs them where a GPU is lent); the Triton kernels under them
are tested on the CPU too (tests/kernels/test_triton_kernels.py, in Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.helpers import (
    MAX_TOKENS,
    QUESTIONS,
    agreement_with_hf_steps,
    hf_greedy,
    load_hf,
    pagoda_greedy,
    swap_run,
    tiny_prompts,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _llm(folder: str, **kwargs) -> LLM:
    return LLM(folder, device="cuda", dtype="float32", **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "eager"])
def test_greedy_matches_hf(tiny_models, arch, eager):
    folder = tiny_models[arch]
    llm = _llm(folder, enforce_eager=eager, kv_cache_memory_bytes=1 << 26)
    prompts = tiny_prompts(llm.get_tokenizer())
    expected = hf_greedy(folder, tuple(map(tuple, prompts)), MAX_TOKENS)
    assert pagoda_greedy(llm, prompts) == expected
    assert (llm.llm_engine.model_runner.cuda_graphs is None) == eager
    assert llm.llm_engine.get_stats().kv_cache.num_blocks_used == 0


def test_cuda_graphs_equal_eager_under_pressure(tiny_llama):
    """Graph replays (padded to their bucket) give eager's tokens, through preemption,
    prefix-cache hits and n > 1 with seeds; every block comes back."""
    prompts = tiny_prompts(_llm(tiny_llama, kv_cache_memory_bytes=1 << 24).get_tokenizer(), 24)
    params = SamplingParams(max_tokens=20, temperature=0.8, n=3, seed=4, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = _llm(tiny_llama, enforce_eager=eager, kv_cache_memory_bytes=48 * 8192)
        runs = [
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for _ in range(2)
        ]
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0 and stats.kv_cache.prefix_cache_hits > 0
        assert stats.kv_cache.num_blocks_used == 0
        outs[eager] = [[[c.token_ids for c in o.outputs] for o in run] for run in runs]
    assert outs[False] == outs[True]


def test_swap_preemption_on_the_gpu(tiny_llama):
    """Swap-outs copied on the side stream while steps compute, swapped back in: HF's
    greedy tokens, and every device and host block comes back."""
    llm = swap_run(tiny_llama, host_blocks=64, device="cuda")
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_swap > 0 and stats.kv_cache.num_blocks_used == 0
    assert llm.llm_engine.kv_cache_manager.host_pool.num_free_blocks == 64


def test_kv_cache_from_gpu_memory_utilization(tiny_llama):
    small = _llm(tiny_llama, gpu_memory_utilization=0.05).llm_engine.model_runner.num_blocks
    large = _llm(tiny_llama, gpu_memory_utilization=0.10).llm_engine.model_runner.num_blocks
    assert 0 < small < large


def test_smollm2_on_the_gpu(gguf_path):
    """The default model's blocks, expanded to float32 on the GPU: HF's tokens; in
    bf16, at least 95% greedy agreement with HF bf16 step by step."""
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    llm = LLM(gguf_path, device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 28)
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    hf = load_hf(gguf_path, torch.float32)
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                              do_sample=False)  # fmt: skip
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist()
    llm = LLM(gguf_path, device="cuda", dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    outs = llm.chat(convs, params, use_tqdm=False)
    agree, total = agreement_with_hf_steps(load_hf(gguf_path, torch.bfloat16), outs)
    assert agree / total >= 0.95, f"bf16 greedy agreement with HF bf16: {agree}/{total}"
