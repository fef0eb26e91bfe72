"""LLMEngine's contract: add_request / step / abort_request / has_unfinished_requests / get_stats,
and clear errors for bad input that leave the engine usable."""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import torch

from pagoda import LLM, EngineArgs, LLMEngine, RequestOutput, SamplingParams
from tests.helpers import tiny_prompts


@functools.cache
def _engine(folder: str) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(model=folder, dtype="float32", kv_cache_memory_bytes=1 << 24)
    )


def _drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    final = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return final


def test_step_loop_and_abort(tiny_llama):
    engine = _engine(tiny_llama)
    prompts = tiny_prompts(engine.tokenizer, n=6, seed=1)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    outs = engine.step()
    assert {o.request_id for o in outs} <= {f"r{i}" for i in range(6)}
    assert engine.get_stats().kv_cache.num_blocks_used > 0
    aborted = engine.abort_request(["r1", "r4"])
    assert {o.request_id for o in aborted} == {"r1", "r4"}
    assert all(o.outputs[0].finish_reason == "abort" and o.finished for o in aborted)
    engine.abort_request("no-such-request")  # a no-op
    final = _drain(engine)
    assert set(final) == {"r0", "r2", "r3", "r5"}
    assert all(len(o.outputs[0].token_ids) == 30 for o in final.values())
    stats = engine.get_stats()
    assert stats.kv_cache.num_blocks_used == 0 and stats.num_requests_running == 0
    assert stats.num_generation_tokens >= 4 * 30


def test_abort_waiting_request_frees_nothing_twice(tiny_llama):
    engine = _engine(tiny_llama)
    engine.add_request("w", "Hello world", SamplingParams(max_tokens=4))
    engine.abort_request("w")
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache.num_blocks_used == 0


def test_request_output_fields(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 24)
    outs = llm.generate(
        ["Hello world", {"prompt_token_ids": [5, 6, 7]}],
        SamplingParams(temperature=0, max_tokens=5),
        use_tqdm=False,
    )
    assert [o.prompt for o in outs] == ["Hello world", None]
    assert outs[1].prompt_token_ids == [5, 6, 7]
    tok = llm.get_tokenizer()
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.index == 0 and c.finish_reason in ("stop", "length")
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_chat_uses_template(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 24)
    out = llm.chat(
        [{"role": "user", "content": "Hello"}],
        SamplingParams(temperature=0, max_tokens=4),
        use_tqdm=False,
    )[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(
        "<|user|>Hello</s><|assistant|>", add_special_tokens=False
    )
    two = llm.chat(
        [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], use_tqdm=False
    )
    assert len(two) == 2


def test_bad_requests_leave_engine_usable(tiny_llama):
    engine = _engine(tiny_llama)
    engine.add_request(
        "good", "Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("empty", "", SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("empty-ids", {"prompt_token_ids": []}, SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", {"prompt_token_ids": [5] * 600}, SamplingParams())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request("oov", {"prompt_token_ids": [10**6]}, SamplingParams())
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("good", "Hello again", SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("typed", 42, SamplingParams())
    final = _drain(engine)
    assert len(final["good"].outputs[0].token_ids) == 8
    assert engine.get_stats().kv_cache.num_blocks_used == 0


def test_bad_engine_args(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="block_size"):
        LLM(tiny_llama, block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_llama, dtype="int3")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_llama, max_model_len=10**6)
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(tiny_llama, scheduling_policy="random")
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(tiny_llama, no_such_arg=1)
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))
    with pytest.raises(ValueError, match="device"):
        LLM(tiny_llama, device="tpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(tiny_llama, gpu_memory_utilization=1.5)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda'"):
            LLM(tiny_llama, device="cuda")


def test_what_the_gpu_path_refuses_is_named(tiny_llama, tmp_path):
    """On device "cuda", what it does not run yet is refused by its field (checked
    here without a GPU: the check comes before any device is touched)."""
    odd_heads = str(tmp_path / "head-dim-24")
    shutil.copytree(tiny_llama, odd_heads)
    cfg = json.loads((tmp_path / "head-dim-24" / "config.json").read_text())
    (tmp_path / "head-dim-24" / "config.json").write_text(json.dumps({**cfg, "head_dim": 24}))
    for kwargs, field in (
        (dict(quantization="q8_0"), "quantization"),
        (dict(enable_lora=True), "enable_lora"),
        (dict(tensor_parallel_size=2), "tensor_parallel_size"),
        (dict(kv_cache_dtype="int8"), "kv_cache_dtype"),
        (dict(speculative_config={"method": "draft"}), "speculative_config"),
        (dict(block_size=8), "block_size 8 .* power of 2"),
        (dict(block_size=24), "block_size 24"),
        (dict(model=odd_heads), "head_dim 24"),
    ):
        args = EngineArgs(**{"model": tiny_llama, "device": "cuda", **kwargs})
        args.resolved_device = lambda warn=False: "cuda"  # as on a machine with a GPU
        with pytest.raises(ValueError, match=field):
            args.create_model_config()


def test_broken_model_folders(tiny_llama, tmp_path):
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_llama, no_weights)
    os.remove(no_weights / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(no_weights))

    unknown = tmp_path / "unknown-arch"
    shutil.copytree(tiny_llama, unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (unknown / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM"):
        LLM(str(unknown))

    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_llama, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(corrupt))

    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="bad.gguf"):
        LLM(str(bad_gguf))


def test_sharded_safetensors(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_llama, sharded)
    os.remove(sharded / "model.safetensors")
    AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(
        sharded, max_shard_size="100KB"
    )
    assert (sharded / "model.safetensors.index.json").exists()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    a = LLM(str(sharded), dtype="float32", kv_cache_memory_bytes=1 << 24).generate(
        "Hello world", params, use_tqdm=False
    )
    b = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 24).generate(
        "Hello world", params, use_tqdm=False
    )
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
