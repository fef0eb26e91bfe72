"""Multi-head latent attention (DeepSeek V2/V3), with the paged cache holding the latent.

Per token, MLA compresses the hidden state into a latent c [kv_lora] (normed) and one
shared rope key k_pe [rope]; each head's key and value are up-projections of c:

    k_h = [W_UK_h c, k_pe]      v_h = W_UV_h c       (W_UK, W_UV: the rows of kv_b_proj)

The cache keeps [c, k_pe] (kv_lora + rope values a token and layer, one "head") in
place of H keys and values. Decodes attend in the latent space: q_h . k_h =
(W_UK_h^T q_nope_h) . c + q_pe_h . k_pe, so the query is absorbed into the latent
[W_UK_h^T q_nope_h, q_pe_h] and the latent rows serve as one shared key head (MQA) and,
cut to c, as the value; the output o_h = W_UV_h (sum_j p_j c_j) comes back out of the
latent space. That is the kernel layer's decode attention with a value width below the
key's (`v_dim`). Prefill chunks expand their context's latents into keys and values
(kv_b_proj over the rows) and attend as usual: a long prompt's product is cheaper so.

DeepSeek's checkpoints interleave each rope pair; the loader turns their rows into
the rotate-half layout (see deepseek.py), so the usual rotary kernel turns them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.attention.context import get_attention_metadata
from pagoda.attention.kv_cache import dequantize_kv, gather
from pagoda.attention.paged import AttentionParams, attend, visible, write_kv
from pagoda.distributed import SINGLE, ParallelContext
from pagoda.model_executor.layers.attention import Attention
from pagoda.model_executor.layers.layernorm import RMSNorm
from pagoda.model_executor.layers.linear import Linear
from pagoda.model_executor.layers.rotary import RotaryEmbedding
from pagoda.ops import Ops

# HF builds the q and latent norms with RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float  # (nope + rope) ** -0.5, times YaRN's mscale squared
    bias: bool = False  # on q_a_proj and kv_a_proj_with_mqa (attention_bias)
    rope: str = "default"
    sliding_window: None = None  # (MLA layers see everything)

    def build(
        self,
        hidden_size: int,
        norm_eps: float,
        ops: Ops,
        ropes: dict[str, RotaryEmbedding],
        parallel: ParallelContext = SINGLE,
        gemma_norms: bool = False,
    ) -> MLAttention:
        return MLAttention(self, hidden_size, norm_eps, ops, ropes[self.rope], parallel)


class MLAttention(nn.Module):
    def __init__(
        self,
        cfg: MLAConfig,
        hidden: int,
        eps: float,
        ops: Ops,
        rotary: RotaryEmbedding,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        if parallel.tp_size > 1:
            raise ValueError(
                "tensor_parallel_size > 1: multi-head latent attention is not split yet."
            )
        self.config = cfg
        H, nope, rope = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.num_heads, self.lora = H, cfg.kv_lora_rank
        q_out = H * (nope + rope)
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_out, False, ops)
        else:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, cfg.bias, ops)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_out, False, ops)
        self.kv_a_proj_with_mqa = Linear(hidden, cfg.kv_lora_rank + rope, cfg.bias, ops)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, ops)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (nope + cfg.v_head_dim), False, ops)
        self.o_proj = Linear(H * cfg.v_head_dim, hidden, cfg.bias, ops)
        self.rotary_emb = rotary
        # The paged cache's view: one latent row a token (K and V alike), the model's scale.
        self.attn = Attention(H, 1, cfg.kv_lora_rank + rope, ops, cfg.scale, num_kv=1)
        self.ops = ops
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        T, H, nope, lora = x.shape[0], self.num_heads, cfg.qk_nope_head_dim, self.lora
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, H, nope + cfg.qk_rope_head_dim)
        compressed = self.kv_a_proj_with_mqa(x)  # [T, lora + rope]
        latent = self.kv_a_layernorm(compressed[:, :lora].contiguous())  # [T, lora]
        # Every head's rope query and the shared rope key, turned in one pass.
        pe = torch.cat([q[:, :, nope:], compressed[:, None, lora:]], dim=1)  # [T, H + 1, rope]
        pe = self.rotary_emb(positions, pe)
        q_nope, q_pe, k_pe = q[:, :, :nope], pe[:, :H], pe[:, H]
        rows = torch.cat([latent, k_pe], dim=-1).unsqueeze(1)  # [T, 1, lora + rope]
        meta = get_attention_metadata()
        cache = self.attn.kv
        write_kv(rows, None, cache, meta.slot_mapping)
        out = q.new_empty(T, H, cfg.v_head_dim)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], meta)
        for start, qlen, ctx, table in zip(
            meta.prefill_query_starts,
            meta.prefill_query_lens,
            meta.prefill_context_lens,
            meta.prefill_block_tables,
            strict=True,
        ):
            chunk = slice(start, start + qlen)
            own = rows[chunk, 0] if ctx == 0 and not cache.quantized else None
            query = torch.cat([q_nope[chunk], q_pe[chunk]], dim=-1)  # [L, H, nope + rope]
            out[chunk] = self._prefill(query, own, table, ctx)
        return self.o_proj(out.reshape(T, H * cfg.v_head_dim))

    def absorbed_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, lora], W_UV [H, v, lora]): kv_b_proj's rows per head, dense
        (dequantized once, to `dtype`, if its weight came quantized)."""
        if self._absorbed is None:
            cfg = self.config
            b = self.kv_b_proj
            w = b.weight if b.qweight is None else self.ops.dequantize(b.qweight, dtype)
            w = w.view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, self.lora)
            nope = cfg.qk_nope_head_dim
            self._absorbed = w[:, :nope].contiguous(), w[:, nope:].contiguous()
        return self._absorbed

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta) -> torch.Tensor:
        """Decode rows in the latent space: q_nope [B, H, nope], q_pe [B, H, rope] ->
        [B, H, v]."""
        w_uk, w_uv = self.absorbed_weights(q_nope.dtype)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, lora]
        query = torch.cat([q_latent, q_pe], dim=-1)  # [B, H, lora + rope]
        cache = self.attn.kv
        o_latent = self.ops.decode_attention(
            query,
            cache.k,
            cache.v,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            self.config.scale,
            cache.k_scales,
            cache.v_scales,
            v_dim=self.lora,
        )  # fmt: skip  [B, H, lora]
        return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(self, query, own_rows, table, ctx: int) -> torch.Tensor:
        """One chunk: query [L, H, nope + rope] at positions ctx..; its context's latent
        rows expanded into keys and values. own_rows: this chunk's rows when it has no
        context (else read from the cache). -> [L, H, v]."""
        cfg = self.config
        L, H, lora = query.shape[0], self.num_heads, self.lora
        if own_rows is None:
            cache = self.attn.kv
            rows = gather(cache.k, table)[: ctx + L, 0]  # [S, lora + rope]
            if cache.quantized:
                rows = dequantize_kv(rows, gather(cache.k_scales, table)[: ctx + L, 0], query.dtype)
        else:
            rows = own_rows
        S = rows.shape[0]
        kv = self.kv_b_proj(rows[:, :lora].contiguous()).view(S, H, -1)  # [S, H, nope + v]
        k_nope, values = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k_pe = rows[:, None, lora:].expand(S, H, cfg.qk_rope_head_dim)
        keys = torch.cat([k_nope, k_pe], dim=-1)  # [S, H, nope + rope]
        mask = None
        if ctx:
            mask = visible(torch.arange(ctx, ctx + L, device=query.device), 0, S, 0)
        o = attend(
            query.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), mask, AttentionParams(cfg.scale),
            is_causal=not ctx,
        )  # fmt: skip
        return o.squeeze(0).transpose(0, 1)  # [L, H, v]

    def kv_bytes_per_token(self, element_size: int) -> tuple[int, int]:
        """(this layer's latent cache, the expanded K and V it stands for), in bytes."""
        cfg = self.config
        expanded = self.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        return (self.lora + cfg.qk_rope_head_dim) * element_size, expanded * element_size
