"""Phi-3, Phi-3.5 and Phi-4-mini: Llama's math with q/k/v and gate/up fused in the
checkpoint itself (the loader takes them apart, so tensor parallel cuts each part), a sliding
window on every layer where the config sets one shorter than the context, and
longrope scaling over a partial rotary embedding (Phi-4-mini turns 3/4 of each head)."""

from __future__ import annotations

from typing import Any

from pagoda.model_executor.models.transformer import (
    DecoderConfig,
    DecoderForCausalLM,
    llama_decoder,
)


class Phi3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        return llama_decoder(cfg)
