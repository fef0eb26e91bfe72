"""A decoder layer's self-attention: the fused q/k/v product, optional q/k norms, rotary
embedding, paged attention, the output product.

    x [T, hidden] ── qkv_proj ──▶ q [T, H, D], k, v [T, KVH, D]
                     q/k norm   (per head: Qwen3, Gemma 3; whole projections: OLMoE)
                     rotary     (this layer's table, or none: SmolLM3's NoPE layers)
                     attention  (paged; a sliding window, soft-capped logits, a scale)
    o [T, H * D] ── o_proj ──▶ [T, hidden]

Tensor parallel: this rank's heads (`split_heads`): its rows of q/k/v, and o_proj on
their columns (row parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.distributed import SINGLE, ParallelContext, split_heads
from pagoda.model_executor.layers.attention import Attention
from pagoda.model_executor.layers.layernorm import RMSNorm
from pagoda.model_executor.layers.linear import Linear, Shard
from pagoda.model_executor.layers.rotary import RotaryEmbedding
from pagoda.ops import Ops

QK_NORMS = (None, "head", "projection")


@dataclass(frozen=True)
class AttentionConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool = False  # on q, k and v (Qwen2)
    o_bias: bool = False  # on the output product (Llama's attention_bias)
    qk_norm: str | None = None  # see QK_NORMS
    clip_qkv: float | None = None  # q, k, v clamped to [-clip, clip] (OLMoE)
    scale: float | None = None  # the softmax scale; None: head_dim ** -0.5
    softcap: float | None = None  # logits = softcap * tanh(logits / softcap) (Gemma 2)
    sliding_window: int | None = None  # a query sees its `window` latest keys, itself included
    rope: str | None = "default"  # the model's rope table for this layer (None: no rotary)

    def build(
        self,
        hidden_size: int,
        norm_eps: float,
        ops: Ops,
        ropes: dict[str, RotaryEmbedding],
        parallel: ParallelContext,
        gemma_norms: bool = False,
    ) -> SelfAttention:
        return SelfAttention(self, hidden_size, norm_eps, ops, ropes, parallel, gemma_norms)


class SelfAttention(nn.Module):
    def __init__(
        self,
        cfg: AttentionConfig,
        hidden_size: int,
        norm_eps: float,
        ops: Ops,
        ropes: dict[str, RotaryEmbedding],
        parallel: ParallelContext = SINGLE,
        gemma_norms: bool = False,
    ) -> None:
        super().__init__()
        if cfg.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {cfg.qk_norm!r}.")
        self.config = cfg
        self.head_dim = D = cfg.head_dim
        q_start, self.num_heads, kv_start, self.num_kv_heads = split_heads(
            cfg.num_heads, cfg.num_kv_heads, parallel.tp_size, parallel.tp_rank
        )
        self.q_size = self.num_heads * D
        self.kv_size = self.num_kv_heads * D
        qkv_shard = o_shard = None
        if parallel.tp_size > 1:
            q_part = (cfg.num_heads * D, q_start * D, self.q_size)
            kv_part = (cfg.num_kv_heads * D, kv_start * D, self.kv_size)
            qkv_shard, o_shard = Shard(0, (q_part, kv_part, kv_part)), Shard(1, (q_part,))
        self.qkv_proj = Linear(
            hidden_size, self.q_size + 2 * self.kv_size, cfg.bias, ops, qkv_shard, parallel
        )
        self.o_proj = Linear(self.q_size, hidden_size, cfg.o_bias, ops, o_shard, parallel)
        if cfg.rope is not None and cfg.rope not in ropes:
            raise ValueError(f"attention: no rope table {cfg.rope!r} (have {sorted(ropes)}).")
        self.rotary_emb = ropes.get(cfg.rope)  # shared with the layers of the same table
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, D, ops, cfg.scale, cfg.sliding_window, cfg.softcap
        )
        self.clip_qkv = cfg.clip_qkv
        self.q_norm = self.k_norm = None
        if cfg.qk_norm == "head":  # one weight for every head's D values
            self.q_norm = RMSNorm(D, norm_eps, ops, gemma_norms)
            self.k_norm = RMSNorm(D, norm_eps, ops, gemma_norms)
        elif cfg.qk_norm == "projection":
            self.q_norm = RMSNorm(self.q_size, norm_eps, ops)
            self.k_norm = RMSNorm(self.kv_size, norm_eps, ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None or self.clip_qkv is not None:
            qkv = self._norm_and_clip(qkv)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.rotary_emb is not None:
            qk = self.rotary_emb(positions, qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, KVH, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v)  # [T, H, D]
        return self.o_proj(o.reshape(T, self.q_size))

    def _norm_and_clip(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.config.qk_norm == "head":  # each head's D values: rows of [T * heads, D]
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        elif self.q_norm is not None:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        qkv = torch.cat([q, k, v], dim=-1)
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        return qkv
