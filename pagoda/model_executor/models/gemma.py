"""Gemma 2 and Gemma 3 (text; also the text half of Gemma3ForConditionalGeneration).

Llama's shape with Gemma's choices:
- RMSNorm as `x * (1 + w)` in float32 (see RMSNorm's `gemma`), and four norms a
  layer: before and after the attention, before and after the MLP ("sandwich");
- embeddings times sqrt(hidden), that factor rounded to the model's dtype;
- a GeGLU MLP (tanh GELU);
- softmax scale query_pre_attn_scalar ** -0.5;
- local layers that see a sliding window and global ones that see everything, as
  `layer_types` says (Gemma 2 alternates; Gemma 3 has five local to one global);
- Gemma 2 soft-caps the attention logits and the final logits (cap * tanh(x / cap));
- Gemma 3 normalizes each head's query and key, and turns local and global layers
  with their own rope tables (rope_local_base_freq 10k; the global one maybe scaled).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pagoda.model_executor.models.transformer import (
    DecoderConfig,
    DecoderForCausalLM,
    LayerConfig,
    llama_decoder,
    rope_parameters,
)
from pagoda.model_executor.weight_loader import WeightNames

_GEMMA_NAMES = WeightNames(
    renames=(
        (".post_attention_layernorm.", ".attn_output_norm."),
        (".pre_feedforward_layernorm.", ".ffn_norm."),
        (".post_feedforward_layernorm.", ".ffn_output_norm."),
    ),
    # Gemma3ForConditionalGeneration: its text model (transformers 5's and 4's names);
    # the vision tower and projector are not loaded.
    prefixes=(
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ),
    ignored=("rotary_emb.inv_freq", "vision_tower.", "multi_modal_projector."),
)


def _gemma_decoder(cfg: dict[str, Any], attention) -> DecoderConfig:
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(
            f"{cfg['architectures'][0]}: use_bidirectional_attention (an embedding model) "
            "is not supported by the generative runner."
        )
    scalar = cfg.get("query_pre_attn_scalar") or cfg.get("head_dim")
    softcap = cfg.get("attn_logit_softcapping")

    def layer_attention(i: int) -> dict[str, Any]:
        return {"scale": scalar**-0.5, "softcap": softcap, "o_bias": False, **attention(i)}

    base = llama_decoder(
        cfg,
        attention=layer_attention,
        gemma_norms=True,
        embed_scale=cfg["hidden_size"] ** 0.5,
        embed_scale_in_dtype=True,
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
    )
    layers = tuple(
        LayerConfig(layer.attention, layer.mlp, sandwich_norms=True) for layer in base.layers
    )
    return replace(base, layers=layers)


class Gemma2ForCausalLM(DecoderForCausalLM):
    weight_names = _GEMMA_NAMES

    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        return _gemma_decoder(cfg, lambda i: {})


class Gemma3ForCausalLM(DecoderForCausalLM):
    weight_names = _GEMMA_NAMES

    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]

        def attention(i: int) -> dict[str, Any]:
            return {"qk_norm": "head", "rope": types[i]}

        base = _gemma_decoder(cfg, attention)
        ropes = {t: rope_parameters(cfg, t) for t in set(types)}
        return replace(base, ropes=ropes)
