"""Nomic BERT (nomic-embed-text): BERT's post-LayerNorm layers and token types, with
rotary positions in place of a position table, q/k/v and the MLP without biases, and a
SwiGLU MLP. Its checkpoints come spelled two ways, and both load here:

- transformers' own (`NomicBertModel` since transformers 5): q/k/v_proj, o_proj,
  gate/up/down_proj, post_attention_layernorm, post_mlp_layernorm;
- Nomic's original (the `trust_remote_code` one on the Hub): GPT-2's config names
  (n_embd, n_layer, ...; see `native_config`), attn.Wqkv, attn.out_proj, mlp.fc11 (up),
  mlp.fc12 (gate), mlp.fc2, norm1, norm2, emb_ln.

q/k/v and gate/up are held fused (one product each), as a GGUF file holds q/k/v.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model_executor.layers.linear import Embedding, Linear
from pagoda.model_executor.layers.rotary import RotaryEmbedding
from pagoda.model_executor.models.bert import bidirectional_attention
from pagoda.model_executor.quantization import QuantizedWeight
from pagoda.model_executor.weight_loader import load_by_name
from pagoda.ops import TORCH_OPS, Ops

# Nomic's original config keys -> transformers' NomicBertConfig's.
_GPT2_KEYS = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_inner": "intermediate_size",
    "n_positions": "max_position_embeddings",
    "layer_norm_epsilon": "layer_norm_eps",
}
# What transformers' NomicBertModel computes; an original config asking otherwise is refused.
_ORIGINAL_FIXED = {
    "prenorm": False,
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_scaling_factor": None,
    "rotary_emb_scale_base": None,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "parallel_block": False,
    "use_rms_norm": False,
    "causal": False,
}


def native_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Nomic BERT config in transformers' names (an original one translated; one
    already in transformers' names comes back as it is). Raises ValueError naming a
    setting of the original code that transformers' model does not compute."""
    if "n_embd" not in cfg:
        return cfg
    for key, value in _ORIGINAL_FIXED.items():
        if key in cfg and cfg[key] != value:
            raise ValueError(
                f"nomic_bert config: {key}={cfg[key]!r} is not supported (only {value!r})."
            )
    act = cfg.get("activation_function", "swiglu")
    if act != "swiglu":
        raise ValueError(f"nomic_bert config: activation_function {act!r} is not supported (swiglu).")  # fmt: skip
    out = {k: v for k, v in cfg.items() if k not in _GPT2_KEYS and k not in _ORIGINAL_FIXED}
    out.update({new: cfg[old] for old, new in _GPT2_KEYS.items() if cfg.get(old) is not None})
    out.setdefault("intermediate_size", 4 * cfg["n_embd"])
    if cfg.get("max_trained_positions"):  # (n_positions claims 8192; llama.cpp takes 2048 too)
        out["max_position_embeddings"] = min(cfg["max_trained_positions"], cfg.get("n_positions") or 1 << 30)  # fmt: skip
    out["hidden_act"] = "silu"
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": float(cfg.get("rotary_emb_base", 1000))}  # fmt: skip
    for key in ("activation_function", "rotary_emb_base", "auto_map"):
        out.pop(key, None)
    return out


# Original names -> this module's (fragments; q/k/v and gate/up fused at load).
_ORIGINAL_NAMES = (
    ("encoder.layers.", "layers."),
    ("emb_ln.", "embeddings.LayerNorm."),
    (".attn.Wqkv.", ".self_attn.qkv_proj."),
    (".attn.out_proj.", ".self_attn.o_proj."),
    (".mlp.fc11.", ".mlp.up_proj."),
    (".mlp.fc12.", ".mlp.gate_proj."),
    (".mlp.fc2.", ".mlp.down_proj."),
    (".norm1.", ".post_attention_layernorm."),
    (".norm2.", ".post_mlp_layernorm."),
)
# A part of a fused weight -> (the fused module, its index).
_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_NUM_PARTS = Counter(fused for fused, _ in _PARTS.values())  # fused -> how many parts


class NomicBertLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], ops: Ops) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12)
        self.num_heads = cfg["num_attention_heads"]
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        inner = self.num_heads * self.head_dim
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = Linear(hidden, 3 * inner, False, ops)
        self.self_attn.o_proj = Linear(inner, hidden, False, ops)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = Linear(hidden, 2 * cfg["intermediate_size"], False, ops)
        self.mlp.down_proj = Linear(cfg["intermediate_size"], hidden, False, ops)
        self.post_mlp_layernorm = nn.LayerNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
    ) -> torch.Tensor:
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        qkv = self.self_attn.qkv_proj(x)
        qk, v = qkv.split([2 * H * D, H * D], dim=-1)
        q, k = rotary(positions, qk.view(T, 2 * H, D)).split([H, H], dim=1)
        attn = bidirectional_attention(q, k, v.view(T, H, D)).reshape(T, H * D)
        x = self.post_attention_layernorm(x + self.self_attn.o_proj(attn))
        gate, up = self.mlp.gate_up_proj(x).chunk(2, dim=-1)
        return self.post_mlp_layernorm(x + self.mlp.down_proj(F.silu(gate) * up))


class NomicBertModel(nn.Module):
    """The encoder: word and token-type embeddings, then the layers; forward -> hidden
    states [T, hidden]."""

    def __init__(self, cfg: dict[str, Any], ops: Ops = TORCH_OPS) -> None:
        super().__init__()
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"nomic_bert: hidden_act {act!r} is not supported (silu: SwiGLU).")
        self.config = cfg
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = Embedding(cfg["vocab_size"], hidden, ops)
        self.embeddings.token_type_embeddings = Embedding(cfg.get("type_vocab_size", 2), hidden, ops)  # fmt: skip
        self.embeddings.LayerNorm = nn.LayerNorm(hidden, cfg.get("layer_norm_eps", 1e-12))
        params = cfg.get("rope_parameters") or {"rope_theta": 1000.0}
        positions = int(cfg.get("max_position_embeddings", 2048))
        self.rotary = RotaryEmbedding(
            cfg.get("head_dim") or hidden // heads, positions, params, positions, ops
        )
        self.layers = nn.ModuleList(
            NomicBertLayer(cfg, ops) for _ in range(cfg["num_hidden_layers"])
        )
        self.dtype = torch.float32  # the activations' (set by load_weights)
        self.takes_token_types = cfg.get("type_vocab_size", 2) > 1

    def forward(self, input_ids, positions, inputs_embeds=None, token_type_ids=None):
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        emb = self.embeddings
        x = emb.word_embeddings(input_ids) + emb.token_type_embeddings(token_type_ids)
        x = emb.LayerNorm(x).to(self.dtype)
        for layer in self.layers:
            x = layer(x, positions, self.rotary)  # one table, every layer
        return x

    def build_decode_loop(self) -> int:
        return 0  # nothing decodes

    def lora_linears(self):
        return iter(())

    def load_weights(self, weights, dtype: torch.dtype = torch.float32) -> None:
        """Either spelling's names (with or without a "bert." or "model." prefix); q/k/v
        and gate/up fused as their parts arrive, quantized parts staying quantized."""
        self.dtype = dtype
        pending: dict[str, dict[int, Any]] = {}

        def named():
            for name, w in weights:
                name = f".{name.removeprefix('bert.').removeprefix('model.')}"
                for old, new in _ORIGINAL_NAMES:
                    name = name.replace(old, new)
                name = name[1:]
                if name.startswith(("pooler.", "lm_head.", "cls.")) or "inv_freq" in name:
                    continue
                stem, part, suffix = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", name)  # fmt: skip
                if part not in _PARTS:
                    yield name, w
                    continue
                fused, index = _PARTS[part]
                key = f"{stem}.{fused}.{suffix}"
                pending.setdefault(key, {})[index] = w
                if len(pending[key]) == _NUM_PARTS[fused]:
                    arrived = pending.pop(key)
                    yield key, _cat([arrived[i] for i in sorted(arrived)], dtype)

        load_by_name(self, named(), dtype)


def _cat(parts: list, dtype: torch.dtype):
    """Parts stacked along the output rows: quantized ones kept quantized where all are."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedWeight.cat(parts)
    return torch.cat([TORCH_OPS.dequantize(p, dtype) if isinstance(p, QuantizedWeight) else p.to(dtype) for p in parts])  # fmt: skip
