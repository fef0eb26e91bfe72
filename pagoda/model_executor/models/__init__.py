"""Model registry: architecture name -> the module and class that build it, and what
the model needs beyond a dense decoder (its capabilities: what some paths do not run
yet refuse it by these, never by its name).

Torch-free to import (the config layer reads it); `model_class` imports the family's
module on first use.
"""

from __future__ import annotations

import importlib

EXPERTS = "experts"  # mixture-of-experts layers
LATENT_ATTENTION = "latent_attention"  # MLA: one latent row a token in the cache
VISION = "vision"  # an image encoder feeding the decoder
NORMS_ACROSS_HEADS = "norms_across_heads"  # q/k norms over every head at once (OLMoE)
BIDIRECTIONAL = "bidirectional"  # an encoder: every token sees every other; no KV cache
CLASSIFIER = "classifier"  # a classifier head: cross-encoders, decoder rerankers
BASE_MODEL = "base_model"  # a decoder saved without its LM head (embedding models)

# architecture -> (module under pagoda.model_executor.models, class)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),  # a window on every layer
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma", "Gemma3ForCausalLM"),  # its text half
    # Mixture of experts.
    "MixtralForCausalLM": ("llama", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("llama", "Qwen2MoeForCausalLM"),
    "OlmoeForCausalLM": ("llama", "OlmoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3", "Qwen3MoeForCausalLM"),
    # Multi-head latent attention and shared experts.
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekV3ForCausalLM"),
    # Vision-language: a vision encoder and projector feeding a Llama-family model.
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    # Decoders saved without their LM head (sentence-transformers' embedding models).
    "LlamaModel": ("llama", "LlamaForCausalLM"),
    "MistralModel": ("llama", "MistralForCausalLM"),
    "Qwen2Model": ("llama", "Qwen2ForCausalLM"),
    "Qwen3Model": ("qwen3", "Qwen3ForCausalLM"),
    # Decoders with a classifier on their last token (rerankers: Qwen3-Reranker's
    # sequence-classification form, or its causal LM read by two tokens' logits).
    "LlamaForSequenceClassification": ("llama", "LlamaForCausalLM"),
    "Qwen2ForSequenceClassification": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForSequenceClassification": ("qwen3", "Qwen3ForCausalLM"),
    # Encoders (embeddings), and with a classifier head (cross-encoders: scores).
    "BertModel": ("bert", "BertModel"),
    "ModernBertModel": ("modernbert", "ModernBertModel"),
    "NomicBertModel": ("nomic_bert", "NomicBertModel"),
    "RobertaModel": ("bert", "RobertaModel"),
    "XLMRobertaModel": ("bert", "RobertaModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "RobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
}


# architecture -> what it needs beyond a dense decoder (absent: nothing)
NEEDS = {
    "MixtralForCausalLM": {EXPERTS},
    "Qwen2MoeForCausalLM": {EXPERTS},
    "OlmoeForCausalLM": {EXPERTS, NORMS_ACROSS_HEADS},
    "Qwen3MoeForCausalLM": {EXPERTS},
    "DeepseekV2ForCausalLM": {EXPERTS, LATENT_ATTENTION},
    "DeepseekV3ForCausalLM": {EXPERTS, LATENT_ATTENTION},
    "LlavaForConditionalGeneration": {VISION},
    **dict.fromkeys(("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"), {BASE_MODEL}),
    **dict.fromkeys(
        (
            "LlamaForSequenceClassification",
            "Qwen2ForSequenceClassification",
            "Qwen3ForSequenceClassification",
        ),
        {CLASSIFIER},
    ),
    "BertModel": {BIDIRECTIONAL},
    "ModernBertModel": {BIDIRECTIONAL},
    "NomicBertModel": {BIDIRECTIONAL},
    "RobertaModel": {BIDIRECTIONAL},
    "XLMRobertaModel": {BIDIRECTIONAL},
    "BertForSequenceClassification": {BIDIRECTIONAL, CLASSIFIER},
    "RobertaForSequenceClassification": {BIDIRECTIONAL, CLASSIFIER},
    "XLMRobertaForSequenceClassification": {BIDIRECTIONAL, CLASSIFIER},
}


def position_offset(architecture: str, cfg: dict) -> int:
    """The row of its position table a model's first token reads: (XLM-)RoBERTa's come
    after the padding id's (a GGUF file's table was cut to start at its first token:
    its config says position_offset 0); every other model's, row 0."""
    if "Roberta" not in architecture:
        return 0
    return int(cfg.get("position_offset", cfg.get("pad_token_id", 1) + 1))


def is_moe_layer(cfg: dict, layer_idx: int) -> bool:
    """Whether layer `layer_idx` of a Llama-shaped MoE config (Mixtral, Qwen2/3-MoE,
    OLMoE) has experts: Qwen2/3-MoE may keep some layers dense."""
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if num_experts == 0 or layer_idx in (cfg.get("mlp_only_layers") or ()):
        return False
    return (layer_idx + 1) % (cfg.get("decoder_sparse_step") or 1) == 0


def needs(architecture: str) -> frozenset[str]:
    """What `architecture` needs beyond a dense decoder (EXPERTS, LATENT_ATTENTION, ...)."""
    return frozenset(NEEDS.get(architecture, ()))


def model_class(architecture: str):
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"pagoda.model_executor.models.{module}"), name)
