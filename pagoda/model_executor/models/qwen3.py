"""Qwen3: Qwen2's layers with an RMSNorm on each head's query and key (before the
rotary embedding) and no q/k/v bias; Qwen3-MoE: the same attention over routed
experts (no shared expert; `norm_topk_prob` renormalizes the top-k weights)."""

from __future__ import annotations

from typing import Any

from pagoda.model_executor.models.llama import moe_decoder
from pagoda.model_executor.models.transformer import (
    DecoderConfig,
    DecoderForCausalLM,
    llama_decoder,
)


def _attention(i: int) -> dict[str, Any]:
    return {"qk_norm": "head"}


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        return llama_decoder(cfg, attention=_attention)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        return moe_decoder(cfg, attention=_attention)
