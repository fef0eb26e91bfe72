"""4-bit GPTQ and AWQ checkpoints, written here from a tiny model in each format's
documented layout and checked against that format's reference dequantization.

- GPTQ (AutoGPTQ): qweight int32 [K/8, N], eight 4-bit values along K per word (value
  i at bits 4i); qzeros int32 [G, N/8] along N, stored minus one; scales fp16 [G, N];
  g_idx [K]. weight[n, k] = scale[g, n] * (q[k, n] - zero[g, n]).
- AWQ (AutoAWQ, GEMM): qweight int32 [K, N/8] and qzeros int32 [G, N/8] along N in the
  column order 0, 2, 4, 6, 1, 3, 5, 7; scales fp16 [G, N]; no minus one.

The packers below are written from those descriptions, independently of pagoda's
unpacking; the reference is computed from the codes before packing.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.model_executor.quantization import from_awq, from_gptq
from pagoda.ops import TORCH_OPS
from tests.helpers import (
    agreement_with_hf_steps,
    assert_greedy_equals_hf,
    quantized_modules,
    tiny_prompts,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]


def quantize_groups(w: torch.Tensor, group_size: int, sym: bool):
    """w [N, K] -> (codes [K, N] in 0..15, zeros [G, N], scales fp16 [G, N])."""
    n, k = w.shape
    groups = w.T.reshape(k // group_size, group_size, n).double()  # [G, gs, N]
    if sym:
        scale = (groups.abs().amax(1) / 7.5).clamp(min=1e-8)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = groups.amin(1), groups.amax(1)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = torch.round(-lo / scale.half().double()).clamp(0, 15)
    scale = scale.half()
    codes = torch.round(groups / scale.double().unsqueeze(1)) + zero.unsqueeze(1)
    codes = codes.clamp(0, 15).reshape(k, n).to(torch.int64)
    return codes, zero.to(torch.int64), scale


def reference(codes, zeros, scales, group_size: int) -> torch.Tensor:
    """weight [N, K] = scale * (q - zero), per the formats' own dequantization."""
    g = torch.arange(codes.shape[0]) // group_size
    return (scales[g].double() * (codes - zeros[g]).double()).T


def pack(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values per int32 word along `dim` (word value i at bits 4i is the
    group's element order[i])."""
    v = values.numpy().astype(np.uint32)
    v = np.moveaxis(v, dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)[..., list(order)]
    words = sum(v[..., i] << np.uint32(4 * i) for i in range(8)).astype(np.uint32)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(words, -1, dim)).view(np.int32))


def gptq_tensors(w, group_size, sym):
    codes, zeros, scales = quantize_groups(w, group_size, sym)
    k = codes.shape[0]
    tensors = {
        "qweight": pack(codes, 0),
        "qzeros": pack(zeros - 1, 1),
        "scales": scales,
        "g_idx": (torch.arange(k) // group_size).to(torch.int32),
    }
    return tensors, reference(codes, zeros, scales, group_size)


def awq_tensors(w, group_size):
    codes, zeros, scales = quantize_groups(w, group_size, sym=False)
    tensors = {
        "qweight": pack(codes, 1, AWQ_ORDER),
        "qzeros": pack(zeros, 1, AWQ_ORDER),
        "scales": scales,
    }
    return tensors, reference(codes, zeros, scales, group_size)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("method", ["gptq-sym", "gptq", "awq"])
def test_unpacking_matches_the_reference_dequantization(method, group_size):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(group_size)) * 0.05
    if method == "awq":
        t, ref = awq_tensors(w, group_size)
        qw = from_awq(t["qweight"], t["qzeros"], t["scales"], group_size)
    else:
        t, ref = gptq_tensors(w, group_size, sym=method == "gptq-sym")
        qw = from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group_size)
    got = TORCH_OPS.dequantize(qw, torch.float32).double()
    assert qw.shape == (48, 256)
    if method == "gptq-sym":  # every zero point 8: q4_0 blocks, exactly
        assert qw.format == "q4_0"
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    else:  # q4_1: the minimum -scale * zero rounded once to fp16
        assert qw.format == "q4_1"
        bound = 2.0**-11 * (ref.abs() + 2 * qw.m.double().abs().repeat_interleave(32, 1))
        assert ((got - ref).abs() <= bound * 1.01 + 1e-12).all()
    assert (got - w.double()).abs().max() < 0.05  # and the codes are w's, not noise


def test_act_order_and_bad_group_sizes_are_refused():
    t, _ = gptq_tensors(torch.randn(16, 128) * 0.05, 64, sym=True)
    with pytest.raises(ValueError, match="act-order"):
        from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"].flip(0), 64)
    with pytest.raises(ValueError, match="group_size"):
        from_gptq(t["qweight"], t["qzeros"], t["scales"], None, 48)


def write_checkpoint(src: str, dst: str, method: str, group_size: int):
    """The tiny model's linears in `method`'s format (everything else as it is), and the
    float reference model's state with those linears dequantized by the reference."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(os.path.join(src, "model.safetensors"))
    out, ref_state = {}, dict(state)
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if name.endswith("proj.weight"):
            if method == "awq":
                tensors, ref = awq_tensors(w, group_size)
            else:
                tensors, ref = gptq_tensors(w, group_size, sym=method == "gptq-sym")
            out.update({f"{module}.{part}": t for part, t in tensors.items()})
            ref_state[name] = ref.to(w.dtype)
        else:
            out[name] = w
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
         "version": "gemm"}
        if method == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
              "sym": method == "gptq-sym"}
    )  # fmt: skip
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return ref_state


@pytest.mark.parametrize("method", ["gptq-sym", "gptq", "awq"])
def test_checkpoint_end_to_end(tiny_llama, tmp_path, method):
    """Loaded as blocks (never as floats); float32 activations on them against HF on the
    reference-dequantized weights: token for token for symmetric GPTQ (q4_0, exact);
    with zero points, whose -scale * zero is rounded to fp16 (a few 1e-4 here, on steps
    of about 0.1), at least 95% of tokens agree on their own prefixes."""
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path / method)
    ref_state = write_checkpoint(tiny_llama, folder, method, group_size=32)
    llm = LLM(folder, dtype="float32", int8_activations=False, kv_cache_memory_bytes=1 << 24)
    held = quantized_modules(llm)
    assert len(held) == 2 * 4  # qkv, o, gate_up, down per layer
    assert set(held.values()) == {"q4_0" if method == "gptq-sym" else "q4_1"}
    prompts = tiny_prompts(llm.get_tokenizer(), n=8, seed=9)
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    hf.load_state_dict(ref_state)
    if method == "gptq-sym":
        assert_greedy_equals_hf(hf, prompts, outs)
    else:
        agree, total = agreement_with_hf_steps(hf, outs)
        assert agree / total >= 0.95, f"{agree}/{total}"
    # --quantization none: the same checkpoint dequantized at load, as floats.
    dense = LLM(folder, dtype="float32", quantization="none", kv_cache_memory_bytes=1 << 24)
    assert not quantized_modules(dense)
    again = dense.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_unsupported_checkpoints_are_refused_by_name(tiny_llama, tmp_path):
    folder = str(tmp_path / "gptq8")
    write_checkpoint(tiny_llama, folder, "gptq", group_size=32)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"]["bits"] = 8
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="bits=8"):
        LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 24)
