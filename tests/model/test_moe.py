"""Mixture-of-experts models: Mixtral, Qwen2-MoE and OLMoE greedy outputs equal Hugging
Face transformers' token for token (float32), with every engine setting that must not
change them; the grouped expert step against a per-token reference; loader errors."""

from __future__ import annotations

import functools

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.model_executor.layers.fused_moe import FusedMoE
from pagoda.ops import TORCH_OPS
from tests.gguf_writer import copy_fields
from tests.helpers import (
    MAX_TOKENS,
    agreement_on_prefixes,
    hf_greedy,
    make_model,
    pagoda_greedy,
    tiny_prompts,
)

VARIANTS = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    # Renormalized top-k, and a dense first layer among the sparse ones.
    "qwen2_moe-norm-dense0": ("qwen2_moe", dict(norm_topk_prob=True, mlp_only_layers=[0])),
    "olmoe": ("olmoe", {}),
    "olmoe-clip": ("olmoe", dict(clip_qkv=0.3, norm_topk_prob=True)),
}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {
        name: make_model(str(root / name), arch, **overrides)
        for name, (arch, overrides) in VARIANTS.items()
    }


@functools.cache
def _llm(folder: str, **kwargs) -> LLM:
    return LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 24, **kwargs)


def _reference(folder: str):
    prompts = tiny_prompts(_llm(folder).get_tokenizer())
    return prompts, hf_greedy(folder, tuple(map(tuple, prompts)), MAX_TOKENS)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_hf(moe_models, variant):
    folder = moe_models[variant]
    prompts, expected = _reference(folder)
    llm = _llm(folder)
    assert pagoda_greedy(llm, prompts) == expected  # 16 prompts in one batch
    assert llm.llm_engine.get_stats().kv_cache.num_blocks_used == 0


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(dict(max_num_batched_tokens=7), id="chunk-every-prompt"),
        pytest.param(dict(max_num_seqs=1), id="max_num_seqs=1"),
        pytest.param(dict(kernel_backend="torch"), id="reference-kernels"),
        # 12 blocks of 16 tokens for 16 requests: preemption and recompute.
        pytest.param(dict(kv_cache_memory_bytes=12 * 8192), id="preemption"),
    ],
)
def test_settings_do_not_change_outputs(moe_models, settings):
    folder = moe_models["qwen2_moe"]
    prompts, expected = _reference(folder)
    llm = LLM(folder, dtype="float32", **{"kv_cache_memory_bytes": 1 << 24, **settings})
    assert pagoda_greedy(llm, prompts) == expected
    stats = llm.llm_engine.get_stats()
    assert stats.kv_cache.num_blocks_used == 0
    if "kv_cache_memory_bytes" in settings:
        assert stats.num_preemptions > 0


def test_prefix_caching_does_not_change_outputs(moe_models):
    folder = moe_models["mixtral"]
    prompts, expected = _reference(folder)
    llm = LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 24)
    assert pagoda_greedy(llm, prompts) == expected
    assert pagoda_greedy(llm, prompts) == expected  # now from the prefix cache
    assert llm.llm_engine.get_stats().kv_cache.prefix_cache_hits > 0


def _route(logits: torch.Tensor, top_k: int, renormalize: bool):
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def _per_token_reference(moe: FusedMoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Each token through each of its chosen experts, one at a time."""
    weights, ids = _route(logits, moe.top_k, moe.renormalize)
    out = torch.zeros_like(x)
    inter = moe.intermediate_size
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            e = ids[t, j]
            gate_up = moe.w13[e] @ x[t]
            h = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += weights[t, j] * (moe.w2[e] @ h)
    return out


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 3, 37])
def test_grouped_experts_equal_per_token(backend, renormalize, num_tokens):
    from pagoda.ops import select_ops

    torch.manual_seed(num_tokens)
    moe = FusedMoE(8, 3, 32, 24, renormalize, select_ops(backend, torch.float32))
    moe.w13.data.normal_()
    moe.w2.data.normal_()
    x = torch.randn(num_tokens, 32)
    logits = torch.randn(num_tokens, 8)
    logits[:, 5] = -1e4  # an expert nobody picks: skipped
    got = moe(x, logits)
    torch.testing.assert_close(got, _per_token_reference(moe, x, logits), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [False, True])
def test_moe_kernels_equal_their_twins(dtype, renormalize):
    from pagoda.ops import select_ops, torch_ops

    cpu = select_ops("cpu", dtype)
    torch.manual_seed(1)
    for num_tokens, num_experts, top_k in ((1, 8, 2), (5, 16, 4), (70, 64, 8), (9, 4, 4)):
        x = torch.randn(num_tokens, 48).to(dtype)
        # Distinct logits in each row (multiples of 1/8, exact in bf16): no top-k ties,
        # whose order torch.topk leaves open.
        ranks = torch.stack([torch.randperm(num_experts) for _ in range(num_tokens)])
        logits = (ranks.float() / 8 - 2).to(dtype)
        want = torch_ops.moe_group(x, logits, top_k, renormalize)
        got = cpu.moe_group(x, logits, top_k, renormalize)
        assert got[3] == want[3]  # pairs per expert
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])  # order, rows
        torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-7)  # weights
        if renormalize:
            sums = torch.zeros(num_tokens).index_add_(0, got[1], got[2])
            torch.testing.assert_close(sums, torch.ones(num_tokens))
        out = torch.randn(num_tokens * top_k, 48).to(dtype)
        # With the same weights, the combine rounds as its twin does: bitwise equal.
        y = cpu.moe_combine(out, want[1], want[2], num_tokens)
        assert torch.equal(y, torch_ops.moe_combine(out, want[1], want[2], num_tokens))
    with pytest.raises(RuntimeError, match="top_k"):
        cpu.moe_group(x, logits, num_experts + 1, False)


def test_grouped_experts_in_bf16_with_the_cpu_kernels():
    from pagoda.ops import select_ops

    ops = select_ops("cpu", torch.bfloat16)
    torch.manual_seed(0)
    moe32 = FusedMoE(8, 2, 64, 96, True, TORCH_OPS)
    moe32.w13.data.normal_(std=0.1)
    moe32.w2.data.normal_(std=0.1)
    moe16 = FusedMoE(8, 2, 64, 96, True, ops)
    moe16.w13.data = moe32.w13.data.bfloat16()
    moe16.w2.data = moe32.w2.data.bfloat16()
    for num_tokens in (1, 5, 40):  # the small-batch kernel and oneDNN
        x = torch.randn(num_tokens, 64)
        logits = torch.randn(num_tokens, 8)
        want = moe32(x, logits)
        got = moe16(x.bfloat16(), logits.bfloat16()).float()
        assert (got - want).abs().max() <= 0.03 * want.abs().max()


def test_missing_expert_is_named(moe_models, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(moe_models["mixtral"], folder)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 expert weights of 'model\.layers\.1\.mlp"):
        LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 22)


@pytest.mark.parametrize(
    "variant, quantization",
    [("mixtral", "q8_0"), ("mixtral", "q4_1"), ("mixtral", "w8a8"), ("qwen2_moe", "q8_0")],
)
def test_quantized_experts_stay_quantized(moe_models, variant, quantization):
    """Every expert keeps its quantized weight (no stacked float copy), and the CPU
    kernels' outputs follow the dequantized reference (kernel_backend "torch":
    dequantize, then F.linear). (Qwen2-MoE's tiny experts have 48 inner features, no
    multiple of a 32-weight block: their down projections stay float, stacked, beside
    the quantized gate/up.)"""
    folder = moe_models[variant]
    prompts, expected = _reference(folder)
    llm = LLM(folder, dtype="float32", quantization=quantization, kv_cache_memory_bytes=1 << 24)
    experts = llm.llm_engine.model_runner.model.model.layers[0].mlp.experts
    assert experts.quantized and experts.w13 is None and len(experts.q13) == experts.num_experts
    if variant == "qwen2_moe":
        assert experts.q2 is None and experts.w2.dtype == torch.float32
    else:
        assert experts.w2 is None and {q.format for q in experts.q2} == {quantization}
    assert {q.format for q in experts.q13} == {quantization}
    got = pagoda_greedy(llm, prompts, max_tokens=4)
    reference = LLM(
        folder, dtype="float32", quantization=quantization, kernel_backend="torch",
        kv_cache_memory_bytes=1 << 24,
    )  # fmt: skip
    want = pagoda_greedy(reference, prompts, max_tokens=4)
    # int8 activations (and the kernels' float sums) move a near tie now and then.
    assert sum(g[0] == w[0] for g, w in zip(got, want, strict=True)) >= 14  # of 16
    if quantization == "q8_0":  # and q8_0 stays near the float model itself
        assert sum(g[0] == e[0] for g, e in zip(got, expected, strict=True)) >= 11


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "w8a8"])
def test_quantized_experts_equal_their_dequantized_reference(fmt):
    """Quantized experts through quant_linear (float activations) equal the same
    experts dequantized and stacked, through the dense path."""
    from pagoda.model_executor.model_loader import QUANTIZE_AT_LOAD, _quantize
    from pagoda.ops import select_ops

    ops = select_ops("cpu", torch.float32, int8_activations=False)
    torch.manual_seed(3)
    dense = FusedMoE(8, 2, 64, 32, True, ops)
    quantized = FusedMoE(8, 2, 64, 32, True, ops)
    ggml_type = QUANTIZE_AT_LOAD[fmt]
    q13 = [_quantize(torch.randn(64, 64) * 0.1, ggml_type) for _ in range(8)]
    q2 = [_quantize(torch.randn(64, 32) * 0.1, ggml_type) for _ in range(8)]
    quantized.set_quantized("w13", q13)
    quantized.set_quantized("w2", q2)
    dense.w13.data = torch.stack([TORCH_OPS.dequantize(q, torch.float32) for q in q13])
    dense.w2.data = torch.stack([TORCH_OPS.dequantize(q, torch.float32) for q in q2])
    for num_tokens in (1, 6, 40):
        x, logits = torch.randn(num_tokens, 64), torch.randn(num_tokens, 8)
        torch.testing.assert_close(quantized(x, logits), dense(x, logits), rtol=1e-5, atol=1e-5)


def write_moe_gguf(path: str, folder: str, tokenizer_gguf: str, expert_type: str = "F32"):
    """A llama.cpp-layout GGUF of the HF folder's Mixtral ("llama" with experts; q/k
    rows permuted as convert_hf_to_gguf does) or Qwen2-MoE ("qwen2moe": q/k/v biases,
    the shared expert and its gate), experts stacked per layer, with
    `tokenizer_gguf`'s tokenizer; the experts in `expert_type`."""
    import json
    import os

    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from safetensors.torch import load_file

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    w = {
        k: v.float().numpy()
        for k, v in load_file(os.path.join(folder, "model.safetensors")).items()
    }
    heads, kv_heads, hidden = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["hidden_size"],
    )
    mixtral = "num_local_experts" in cfg
    arch, moe = ("llama", "block_sparse_moe") if mixtral else ("qwen2moe", "mlp")
    num_experts = cfg["num_local_experts"] if mixtral else cfg["num_experts"]
    expert_parts = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    writer = GGUFWriter(path, arch)
    copy_fields(writer, tokenizer_gguf, skip=lambda key: key.startswith("llama."))
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base((cfg.get("rope_parameters") or cfg)["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if not mixtral:
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])

    def permute(x, n):  # llama.cpp's order of Llama's q/k rows: rotary pairs interleaved
        if not mixtral:
            return x
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    writer.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", w["model.norm.weight"])
    writer.add_tensor("output.weight", w["lm_head.weight"])
    qtype = GGMLQuantizationType[expert_type]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        parts = {
            "attn_norm": w[p + "input_layernorm.weight"],
            "ffn_norm": w[p + "post_attention_layernorm.weight"],
            "attn_q": permute(w[p + "self_attn.q_proj.weight"], heads),
            "attn_k": permute(w[p + "self_attn.k_proj.weight"], kv_heads),
            "attn_v": w[p + "self_attn.v_proj.weight"],
            "attn_output": w[p + "self_attn.o_proj.weight"],
            "ffn_gate_inp": w[f"{p}{moe}.gate.weight"],
        }
        if not mixtral:
            for part, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                parts[f"ffn_{part}_shexp"] = w[f"{p}mlp.shared_expert.{hf}.weight"]
            parts["ffn_gate_inp_shexp"] = w[p + "mlp.shared_expert_gate.weight"][0]
            for part in ("q", "k", "v"):
                writer.add_tensor(f"blk.{i}.attn_{part}.bias", w[f"{p}self_attn.{part}_proj.bias"])
        for part, x in parts.items():
            writer.add_tensor(f"blk.{i}.{part}.weight", np.ascontiguousarray(x))
        for part, hf in zip(
            ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), expert_parts, strict=True
        ):
            stacked = np.stack([w[f"{p}{moe}.experts.{e}.{hf}.weight"] for e in range(num_experts)])
            if expert_type == "F32" or stacked.shape[-1] % 32:  # Qwen2-MoE's 48-wide downs
                writer.add_tensor(f"blk.{i}.{part}.weight", stacked)
            else:
                writer.add_tensor(
                    f"blk.{i}.{part}.weight", quantize(stacked, qtype), raw_dtype=qtype
                )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def moe_gguf(request, tmp_path_factory, gguf_path):
    """(HF folder of a tiny MoE model with SmolLM2's vocabulary size, its GGUF twin in
    F32, and in Q8_0 experts)."""
    root = tmp_path_factory.mktemp(f"{request.param}-gguf")
    folder = make_model(str(root / "hf"), request.param, vocab_size=49152)
    f32, q8 = str(root / "f32.gguf"), str(root / "q8_0.gguf")
    write_moe_gguf(f32, folder, gguf_path)
    write_moe_gguf(q8, folder, gguf_path, "Q8_0")
    return folder, f32, q8


def test_moe_gguf_matches_hf(moe_gguf):
    """llama.cpp's MoE layouts (stacked experts, the router as ffn_gate_inp; Qwen2-MoE's
    shared expert): greedy tokens equal transformers' on the HF folder the file was
    written from."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, f32, q8 = moe_gguf
    llm = LLM(f32, dtype="float32", kv_cache_memory_bytes=1 << 24)
    expected_arch = AutoConfig.from_pretrained(folder).architectures[0]
    assert llm.llm_engine.model_config.architecture == expected_arch
    prompts = tiny_prompts(AutoTokenizer.from_pretrained(folder), n=8, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run to max_new_tokens, as ignore_eos
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                              do_sample=False)[0, len(prompt):].tolist()  # fmt: skip
        assert out.outputs[0].token_ids == ref
    # Q8_0 experts stay quantized, one weight per expert, and agree with their own
    # dequantized weights (the same file loaded as floats).
    quantized = LLM(q8, dtype="float32", kv_cache_memory_bytes=1 << 24, int8_activations=False)
    experts = quantized.llm_engine.model_runner.model.model.layers[0].mlp.experts
    assert experts.quantized and len(experts.q13) == 8
    got = [list(o.outputs[0].token_ids) for o in quantized.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]  # fmt: skip
    dequantized = LLM(q8, dtype="float32", kv_cache_memory_bytes=1 << 24, quantization="none")
    assert agreement_on_prefixes(dequantized, prompts, got) >= 0.97  # 1.0 when written
