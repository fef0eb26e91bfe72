"""`Ops`: one implementation of each primitive, and `TORCH_OPS`, the PyTorch twins
(see pagoda/ops/__init__.py for the table)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagoda.ops import torch_ops


@dataclass(frozen=True)
class Ops:
    """One implementation of each primitive. Ops that work in place say so; callers
    use the return value either way."""

    backend: str  # "torch" | "cpu" | "triton"
    linear: Callable[..., torch.Tensor]  # (x, weight, bias) -> x @ weight.T + bias
    quant_linear: Callable[..., torch.Tensor]  # (x, QuantizedWeight, bias), the same
    dequantize: Callable[..., torch.Tensor]  # (QuantizedWeight, dtype) -> [N, K]
    rms_norm: Callable[..., torch.Tensor]  # (x, weight, eps)
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (x, residual, weight, eps)
    rotary_embedding: Callable[..., torch.Tensor]  # (qk, positions, cos, sin)
    # (q, k_cache, v_cache, tables, lens, scale, k_scales=None, v_scales=None)
    decode_attention: Callable[..., torch.Tensor]
    # (y, x, LinearLoRA, LoRAMapping) -> y += each segment's adapter product, in place
    add_lora: Callable[..., torch.Tensor]
    # (x, router_logits, top_k, renormalize) -> (grouped x, token_of, weights, counts)
    moe_group: Callable[..., tuple]
    # (expert outputs, token_of, weights, num_tokens) -> y
    moe_combine: Callable[..., torch.Tensor]
    # The C++ decode loop (csrc/decode_loop.cpp), where the kernels are built: its class,
    # and for a linear (weight, qweight, bias) its arguments there and the most rows at
    # which the loop runs it exactly as `linear`/`quant_linear` would (None: it cannot).
    decode_loop: type | None = None
    decode_loop_linear: Callable[..., tuple[tuple, int] | None] | None = None
    # Whether the decode loop adds LoRA products as `add_lora` does (its C++ kernel).
    decode_loop_lora: bool = False
    # (q, k, v, LayerKV, AttentionMetadata, scale) -> [T, H, D]: this step's K/V written,
    # then the whole step's attention in the backend's own kernels. None: `write_kv`
    # and `paged_attention` over `decode_attention` (pagoda/attention/paged.py).
    attention: Callable[..., torch.Tensor] | None = None


TORCH_OPS = Ops(
    backend="torch",
    linear=torch_ops.linear,
    quant_linear=torch_ops.quant_linear,
    dequantize=torch_ops.dequantize,
    rms_norm=torch_ops.rms_norm,
    add_rms_norm=torch_ops.add_rms_norm,
    rotary_embedding=torch_ops.rotary_embedding,
    decode_attention=torch_ops.decode_attention,
    add_lora=torch_ops.add_lora,
    moe_group=torch_ops.moe_group,
    moe_combine=torch_ops.moe_combine,
)
