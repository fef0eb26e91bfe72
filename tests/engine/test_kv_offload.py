"""The disk KV tier under a real engine (--kv-offload-dir): a restart finds a prompt's
blocks there and answers as a prefix-cache hit would; damaged, truncated or foreign
files are misses that give the cold output; blocks evicted from a small pool come
back from the tier; the metrics count it; what it does not keep yet is refused."""

from __future__ import annotations

import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda import LLM, EngineArgs, SamplingParams
from pagoda.metrics import EngineMetrics
from tests.helpers import hf_greedy, make_model, tiny_prompts

BS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # the tiny model's, float32: layers, K/V, kv heads, head_dim


@pytest.fixture(scope="module")
def prompt(tiny_llama) -> list[int]:
    """A prompt of 6 full blocks and a bit (what the tier keeps: full blocks)."""
    from transformers import AutoTokenizer

    tokens = [t for p in tiny_prompts(AutoTokenizer.from_pretrained(tiny_llama), 12) for t in p]
    return tokens[: 6 * BS + 5]


def answer(folder: str, tier: str, prompt: list[int], **kwargs):
    """A fresh engine on the tier's directory (a restart): its output and KV stats."""
    llm = LLM(model=folder, kv_offload_dir=str(tier), block_size=BS, **kwargs)
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    stats = llm.llm_engine.get_stats().kv_cache
    llm.llm_engine.shutdown()  # (writes what is queued)
    return out, stats


def tier_files(tier) -> list[str]:
    (folder,) = [os.path.join(tier, d) for d in os.listdir(tier)]
    return sorted(os.path.join(folder, f) for f in os.listdir(folder))


def test_a_restart_loads_the_prompt_from_the_tier(tiny_llama, prompt, tmp_path):
    cold, cold_stats = answer(tiny_llama, tmp_path, prompt)
    assert cold.num_cached_tokens == 0 and cold_stats.tier.hits == 0
    assert len(tier_files(tmp_path)) >= 6  # the prompt's full blocks (and the output's)
    warm, stats = answer(tiny_llama, tmp_path, prompt)
    assert warm.num_cached_tokens == 6 * BS == stats.tier_hit_tokens
    assert stats.tier.hits == 6 and stats.tier.bytes_read > 0 and stats.tier.bytes_written == 0
    hf = hf_greedy(tiny_llama, (tuple(prompt),), GREEDY.max_tokens)[0]
    assert list(warm.outputs[0].token_ids) == list(cold.outputs[0].token_ids) == hf


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign"])
def test_a_damaged_file_is_a_miss(tiny_llama, prompt, tmp_path, damage):
    """The first block's file spoiled: nothing is loaded past it, the answer is the cold
    one, and the file is gone."""
    from pagoda.core.kv_cache_manager import hash_block

    tier = tmp_path / "tier"
    cold, _ = answer(tiny_llama, tier, prompt)
    name = hash_block(None, prompt[:BS]).hex() + ".kv"
    (first,) = [f for f in tier_files(tier) if os.path.basename(f) == name]
    if damage == "garbage":
        with open(first, "r+b") as f:
            f.seek(os.path.getsize(first) // 2)
            f.write(os.urandom(64))
    elif damage == "truncated":
        os.truncate(first, os.path.getsize(first) // 3)
    else:  # another cache's block (int8 K/V) under this cache's name
        answer(tiny_llama, tmp_path / "other", prompt, kv_cache_dtype="int8")
        (other,) = [f for f in tier_files(tmp_path / "other") if os.path.basename(f) == name]
        os.replace(other, first)
    warm, stats = answer(tiny_llama, tier, prompt)
    assert warm.num_cached_tokens == 0 and stats.tier.blocks_removed == 1
    assert list(warm.outputs[0].token_ids) == list(cold.outputs[0].token_ids)


def test_blocks_evicted_from_a_small_pool_come_back_from_the_tier(tiny_llama, prompt, tmp_path):
    """Other prompts push the first one's blocks out of memory; it is then found in
    the tier, in the same process; nothing stays held once the writer is done."""
    from transformers import AutoTokenizer

    others = tiny_prompts(AutoTokenizer.from_pretrained(tiny_llama), 6, seed=5)
    others = [(p * 8)[: 6 * BS] for p in others]
    llm = LLM(model=tiny_llama, kv_offload_dir=str(tmp_path), block_size=BS,
              kv_cache_memory_bytes=16 * BLOCK_BYTES, dtype="float32")  # fmt: skip
    engine = llm.llm_engine
    first = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    for other in others:
        llm.generate([{"prompt_token_ids": other}], GREEDY, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    stats = engine.get_stats().kv_cache
    assert again.num_cached_tokens == 6 * BS and stats.tier_hit_tokens >= 6 * BS
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    engine.kv_tier.flush()
    engine.kv_cache_manager.release_saved()
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
    # The writer may still have been saving blocks when `stats` was read; after the
    # flush the tier holds still, so the gauges are compared with a fresh read.
    stats = engine.get_stats().kv_cache
    metrics = EngineMetrics("tiny", engine.max_model_len, engine.get_stats)
    values = {
        s.name: s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    assert values["pagoda:kv_tier_hit_tokens_total"] == stats.tier_hit_tokens
    assert values["pagoda:kv_tier_written_bytes_total"] > 0
    assert values["pagoda:kv_tier_blocks"] == stats.tier.stored_blocks > 0
    engine.shutdown()


def test_what_the_tier_does_not_keep_yet_is_refused(tiny_llama, tmp_path):
    from pagoda.refusals import cuda_refusal

    for kwargs, match in [
        (dict(tensor_parallel_size=2), "split across workers"),
        (dict(enable_prefix_caching=False), "enable_prefix_caching"),
        (dict(speculative_config={"method": "draft", "model": tiny_llama,
                                  "num_speculative_tokens": 2}), "draft model"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=f"kv_offload_dir: .*{match}"):
            EngineArgs(
                model=tiny_llama, kv_offload_dir=str(tmp_path), **kwargs
            ).create_engine_config()
    with pytest.raises(ValueError, match="kv_offload_dir must be a directory"):
        EngineArgs(model=tiny_llama, kv_offload_dir="").verify()
    args = EngineArgs(model=tiny_llama, kv_offload_dir=str(tmp_path))
    assert "kv_offload_dir" in cuda_refusal(args, args.create_model_config().hf_config)
    sliding = make_model(str(tmp_path / "mistral_window"), "mistral_window")
    with pytest.raises(ValueError, match="kv_offload_dir: .*every layer of the model slides"):
        LLM(model=sliding, kv_offload_dir=str(tmp_path / "tier"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("num_kv", [2, 1])  # K and V, or MLA's one latent row
def test_blocks_leave_and_come_back_as_they_were(dtype, num_kv):
    """read_blocks -> write_blocks into another cache of the same shape: the same bytes
    (values and fp16 scales), in other block ids; a payload of another length is refused."""
    import torch

    from pagoda.attention.kv_cache import PagedKVCache

    dtype = getattr(torch, dtype)
    source = PagedKVCache(3, 8, 4, 2, 8, dtype, num_kv=num_kv)
    raw = source.data.view(torch.uint8)
    raw.copy_(torch.randint(0, 120, raw.shape, dtype=torch.uint8))
    if source.scales is not None:
        source.scales.normal_()
    payloads = source.read_blocks([5, 2])
    assert [len(p) for p in payloads] == [source.bytes_per_block_of(source.shape, 4, dtype)] * 2
    dest = PagedKVCache(3, 8, 4, 2, 8, dtype, num_kv=num_kv)
    dest.write_blocks([1, 6], payloads)
    for a, b in [(5, 1), (2, 6)]:
        for t_src, t_dst in zip(source.tensors(), dest.tensors(), strict=True):
            assert torch.equal(t_src[:, :, a].view(torch.uint8), t_dst[:, :, b].view(torch.uint8))
    assert dest.data[:, :, [0, 2, 3, 4, 5, 7]].view(torch.uint8).count_nonzero() == 0
    with pytest.raises(ValueError, match="a KV block is"):
        dest.write_blocks([0], [payloads[0][:-1]])


def test_prefill_on_a_producer_decode_on_a_consumer(tiny_llama, tmp_path):
    """kv_transfer_config: a producer's one-token answers come only once the prompts'
    full blocks are in the shared tier, so a consumer sent the requests right after
    finds every one of them there (no wait, no retry) and decodes what one engine alone
    decodes. Two engines in one process, as two replicas on one directory."""
    from transformers import AutoTokenizer

    prompts = [(p * 4)[: 5 * BS + 3] for p in tiny_prompts(AutoTokenizer.from_pretrained(tiny_llama), 6, seed=11)]  # fmt: skip
    alone = LLM(model=tiny_llama, block_size=BS, kv_cache_memory_bytes=1 << 24)
    want = [list(o.outputs[0].token_ids) for o in alone.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]  # fmt: skip
    role = lambda r: dict(model=tiny_llama, block_size=BS, kv_cache_memory_bytes=1 << 24,  # noqa: E731
                          kv_offload_dir=str(tmp_path), kv_transfer_config={"kv_role": r})  # fmt: skip
    producer, consumer = LLM(**role("kv_producer")), LLM(**role("kv_consumer"))
    one = SamplingParams(max_tokens=1, temperature=0.0)
    producer.generate([{"prompt_token_ids": p} for p in prompts], one, use_tqdm=False)
    outs = consumer.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [5 * BS] * len(prompts)
    assert consumer.llm_engine.get_stats().kv_cache.tier_hit_tokens == 5 * BS * len(prompts)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(kv_transfer_config={"kv_role": "kv_producer"}), "kv_offload_dir"),
        (dict(kv_offload_dir="x", kv_transfer_config={"kv_role": "sender"}), "kv_role"),
        (dict(kv_offload_dir="x", kv_transfer_config={"kv_role": "kv_producer",
                                                      "kv_connector": "NixlConnector"}),
         "kv_transfer_config"),
    ],
)  # fmt: skip
def test_kv_transfer_config_is_checked(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs).verify()


@pytest.mark.parametrize("ram_bytes", [0, 1 << 20])
def test_the_host_ram_tier_serves_blocks_whose_files_are_gone(
    tiny_llama, prompt, tmp_path, ram_bytes
):
    """kv_offload_ram_bytes: the tier's host-RAM part, before its files (on a GPU, where a
    block leaving device memory lands first). Blocks pushed out of a small pool come back
    from it with every file deleted; without it, the same run recomputes them."""
    from transformers import AutoTokenizer

    others = tiny_prompts(AutoTokenizer.from_pretrained(tiny_llama), 6, seed=5)
    others = [(p * 8)[: 6 * BS] for p in others]
    llm = LLM(model=tiny_llama, kv_offload_dir=str(tmp_path), block_size=BS,
              kv_cache_memory_bytes=16 * BLOCK_BYTES, dtype="float32", kv_offload_ram_bytes=ram_bytes)  # fmt: skip
    first = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    for other in others:
        llm.generate([{"prompt_token_ids": other}], GREEDY, use_tqdm=False)
    llm.llm_engine.kv_tier.flush()
    for path in tier_files(tmp_path):
        os.remove(path)
    again = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    tier = llm.llm_engine.get_stats().kv_cache.tier
    if ram_bytes:
        assert again.num_cached_tokens == 6 * BS and tier.ram_hits >= 6
    else:
        assert again.num_cached_tokens == 0 and tier.ram_hits == 0
