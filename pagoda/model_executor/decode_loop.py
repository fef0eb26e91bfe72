"""Hands a built decoder to the C++ decode loop (csrc/decode_loop.cpp), which then runs
decode-only steps of up to `decode_loop_max_rows` rows (pagoda.ops.cpu's
DECODE_LOOP_MAX_ROWS) with the same kernels in the same order as the Python layers
(bitwise the same result: each linear dispatched by its rows as pagoda.ops.cpu does)
and no Python between them.

Each layer crosses as its config describes it (pagoda/model_executor/models/
transformer.py): the attention's heads, scale, window, soft cap, rope table (or none)
and q/k norms; Gemma's output norms; Granite's residual multiplier; the MLP's
activation, or its experts. A layer the loop cannot run keeps the whole model in
Python (returns 0), and the reason is logged.
"""

from __future__ import annotations

import logging

import torch

from pagoda.model_executor.layers.fused_moe import SparseMoeBlock
from pagoda.model_executor.layers.linear import Linear
from pagoda.model_executor.layers.mlp import ACTIVATIONS, GatedMLP
from pagoda.model_executor.layers.self_attention import SelfAttention
from pagoda.ops import cpu

logger = logging.getLogger(__name__)


class _Unsupported(Exception):
    """Why the loop cannot run this model (logged; the Python path runs it)."""


def build_decode_loop(model) -> int:
    """Build the loop for `model` (a DecoderModel) once its weights are loaded and its
    KV cache is bound. It is built only if the kernels are, the cache is unquantized,
    and every layer is one the loop runs as the Python layer would. Returns the most
    rows it takes (0: not built)."""
    if model.parallel.world_size > 1:  # its layers run whole, with no collectives
        return 0
    if model.ops.decode_loop is None:
        return 0
    try:
        loop, max_rows = _Builder(model).build()
    except _Unsupported as e:
        logger.info("C++ decode loop not built (%s): decode steps run in Python.", e)
        return 0
    model.decode_loop, model.decode_loop_max_rows = loop, max_rows
    return max_rows


class _Builder:
    def __init__(self, model) -> None:
        self.model = model
        self.ops = model.ops
        self.loop = model.ops.decode_loop(model.norm.eps, model.norm.weight)
        self.kernels = cpu.load()  # the loop's module: its enums
        self.max_rows: int | None = None

    def build(self):
        for layer in self.model.layers:
            self._layer(layer)
        return self.loop, self.max_rows

    def _rows(self, rows: int) -> None:
        self.max_rows = rows if self.max_rows is None else min(self.max_rows, rows)

    def _linear(self, linear: Linear | None) -> int:
        """The linear's index in the loop (-1 for none)."""
        if linear is None:
            return -1
        spec = self.ops.decode_loop_linear(linear.weight, linear.qweight, linear.bias)
        if spec is None:
            raise _Unsupported("a linear's format has no small-batch kernel here")
        linear_spec, rows = spec
        self._rows(rows)
        index = self.loop.add_linear(linear_spec)
        if linear.lora is not None:  # adapter slots, added as ops.add_lora adds them
            if not self.ops.decode_loop_lora:
                raise _Unsupported("LoRA without its C++ kernel")
            lora = linear.lora
            self.loop.set_lora(index, lora.a, lora.b, lora.ranks, lora.offsets)
        return index

    def _layer(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, SelfAttention):
            raise _Unsupported(f"{type(attn).__name__} layers")
        kv = attn.attn.kv
        if kv.quantized:
            raise _Unsupported("a quantized KV cache")
        if attn.clip_qkv is not None and attn.q_norm is None:
            raise _Unsupported("clip_qkv without q/k norms")
        dense = isinstance(mlp, GatedMLP)
        if not dense and not isinstance(mlp, SparseMoeBlock):
            raise _Unsupported(f"{type(mlp).__name__} MLPs")
        qkv, o = self._linear(attn.qkv_proj), self._linear(attn.o_proj)
        gate_up = self._linear(mlp.gate_up_proj) if dense else -1
        down = self._linear(mlp.down_proj) if dense else -1
        params = attn.attn.params
        activation = ACTIVATIONS[mlp.activation][1] if dense else "silu"  # (unused for experts)
        self.loop.add_layer(
            qkv=qkv, o=o, gate_up=gate_up, down=down,
            input_norm=layer.input_layernorm.weight, ffn_norm=layer.ffn_norm.weight,
            k_cache=kv.k, v_cache=kv.v, num_heads=attn.num_heads, scale=params.scale,
            window=params.window, softcap=params.softcap,
            activation=getattr(self.kernels.Activation, activation.upper()),
            residual_multiplier=layer.residual_multiplier or 0.0,
        )  # fmt: skip
        if attn.rotary_emb is not None:
            self.loop.set_rope(attn.rotary_emb.cos, attn.rotary_emb.sin)
        if attn.q_norm is not None:
            clip = -1.0 if attn.clip_qkv is None else float(attn.clip_qkv)
            per_head = attn.config.qk_norm == "head"
            self.loop.set_qk_norm(attn.q_norm.weight, attn.k_norm.weight, per_head, clip)
        if layer.attn_output_norm is not None:
            self.loop.set_output_norms(layer.attn_output_norm.weight, layer.ffn_output_norm.weight)
        if not dense:
            self._experts(mlp)

    def _experts(self, mlp: SparseMoeBlock) -> None:
        experts = mlp.experts
        # The experts' products: stacked dense tensors (the loop's `dense`), or
        # quantized, one linear per expert.
        expert_linears = {}
        for part, stacked, quantized in (
            ("gate_up", experts.w13, experts.q13),
            ("down", experts.w2, experts.q2),
        ):
            specs = (
                [self.ops.decode_loop_linear(stacked[0], None, None)]
                if quantized is None
                else [self.ops.decode_loop_linear(None, q, None) for q in quantized]
            )
            if None in specs:
                raise _Unsupported("an expert's format has no small-batch kernel here")
            for _, rows in specs:
                self._rows(rows)
            if quantized is not None:
                expert_linears[part] = [self.loop.add_linear(spec) for spec, _ in specs]
        shared = [-1, -1, -1]
        if mlp.shared_expert is not None:
            shared_mlp = mlp.shared_expert
            shared = [
                self._linear(shared_mlp.gate_up_proj),
                self._linear(shared_mlp.down_proj),
                self._linear(mlp.shared_expert_gate),
            ]
        router = self._linear(mlp.gate)
        none = torch.empty(experts.num_experts, 0, 0)  # a part held per expert instead
        self.loop.set_moe(
            router,
            none if experts.w13 is None else experts.w13,
            none if experts.w2 is None else experts.w2,
            experts.top_k,
            experts.renormalize,
            *shared,
        )
        if expert_linears:
            self.loop.set_moe_experts(
                expert_linears.get("gate_up", []), expert_linears.get("down", [])
            )
