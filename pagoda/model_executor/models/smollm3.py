"""SmolLM3: Llama with no rotary embedding on some layers (NoPE: `no_rope_layers[i]`
is 0; by default every fourth layer)."""

from __future__ import annotations

from typing import Any

from pagoda.model_executor.models.transformer import (
    DecoderConfig,
    DecoderForCausalLM,
    llama_decoder,
)


class SmolLM3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        num_layers = cfg["num_hidden_layers"]
        interval = cfg.get("no_rope_layer_interval") or 4
        uses_rope = cfg.get("no_rope_layers") or [
            int((i + 1) % interval != 0) for i in range(num_layers)
        ]
        return llama_decoder(cfg, attention=lambda i: {"rope": "default" if uses_rope[i] else None})
