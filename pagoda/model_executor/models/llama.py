"""Llama, and the variants that only flip config switches: Mistral (a sliding window on
every layer), Qwen2 (q/k/v bias; windows on the layers `layer_types` names), SmolLM
(v1, v2); and their mixture-of-experts kin, whose MLP is a `SparseMoeBlock`: Mixtral,
Qwen2-MoE (a gated shared expert beside the routed ones; dense layers where
`mlp_only_layers` or `decoder_sparse_step` say) and OLMoE (RMSNorm on the whole q and
k projections, optional `clip_qkv`).
"""

from __future__ import annotations

from typing import Any

from pagoda.model_executor.layers.fused_moe import MoEConfig
from pagoda.model_executor.models import is_moe_layer
from pagoda.model_executor.models.transformer import (
    DecoderConfig,
    DecoderForCausalLM,
    llama_decoder,
)
from pagoda.model_executor.weight_loader import WeightNames


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        return llama_decoder(cfg, windows=False)  # (HF's Llama has no sliding window)


class MistralForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        return llama_decoder(cfg)


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        return llama_decoder(cfg, attention=lambda i: {"bias": True, "o_bias": False})


def moe_config(cfg: dict[str, Any], renormalize: bool | None = None) -> MoEConfig:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu).")
    return MoEConfig(
        num_experts=cfg.get("num_local_experts") or cfg["num_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        renormalize=bool(cfg.get("norm_topk_prob", False)) if renormalize is None else renormalize,
        shared_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
    )


def moe_decoder(cfg: dict[str, Any], renormalize: bool | None = None, **kw) -> DecoderConfig:
    """A Llama-shaped decoder whose MLPs are routed experts where `is_moe_layer` says."""
    moe = moe_config(cfg, renormalize)
    return llama_decoder(cfg, mlp=lambda i: moe if is_moe_layer(cfg, i) else None, **kw)


class MixtralForCausalLM(DecoderForCausalLM):
    weight_names = WeightNames(
        renames=((".post_attention_layernorm.", ".ffn_norm."), (".block_sparse_moe.", ".mlp."))
    )

    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        return moe_decoder(cfg, renormalize=True)


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        bias = bool(cfg.get("qkv_bias", True))
        return moe_decoder(cfg, attention=lambda i: {"bias": bias, "o_bias": False})


class OlmoeForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        clip = cfg.get("clip_qkv")
        attention = lambda i: {"qk_norm": "projection", "clip_qkv": clip}  # noqa: E731
        return moe_decoder(cfg, attention=attention, windows=False)  # (HF's OLMoE has none)
