"""Granite (3.x): Llama with four multipliers: the embeddings (embedding_multiplier),
the softmax scale (attention_multiplier, in place of head_dim ** -0.5), each
sublayer's output before the residual add (residual_multiplier), and the logits
(divided by logits_scaling)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pagoda.model_executor.models.transformer import (
    DecoderConfig,
    DecoderForCausalLM,
    llama_decoder,
)


class GraniteForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        scale = cfg.get("attention_multiplier")
        base = llama_decoder(
            cfg,
            attention=lambda i: {"scale": scale},
            windows=False,
            embed_scale=cfg.get("embedding_multiplier"),
            logit_divisor=cfg.get("logits_scaling"),
        )
        multiplier = cfg.get("residual_multiplier")
        return replace(
            base,
            layers=tuple(replace(layer, residual_multiplier=multiplier) for layer in base.layers),
        )
