"""ModernBERT (an encoder for embeddings): pre-LayerNorm layers without biases, fused
q/k/v, rotary positions (a base of its own for local and for global layers), local
layers that see `local_attention // 2` tokens on either side and global ones that see
the whole prompt, a GeGLU MLP."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.model_executor.layers.linear import Embedding, Linear
from pagoda.model_executor.models.bert import _ACTIVATIONS, bidirectional_attention
from pagoda.model_executor.weight_loader import load_by_name
from pagoda.ops import TORCH_OPS, Ops


def _rope_thetas(cfg: dict[str, Any]) -> dict[str, float]:
    """The rotary base of each layer type ("full_attention", "sliding_attention")."""
    params = cfg.get("rope_parameters") or {}
    return {
        "full_attention": (params.get("full_attention") or {}).get(
            "rope_theta", cfg.get("global_rope_theta", 160000.0)
        ),
        "sliding_attention": (params.get("sliding_attention") or {}).get(
            "rope_theta", cfg.get("local_rope_theta", 10000.0)
        ),
    }


def _layer_types(cfg: dict[str, Any]) -> list[str]:
    every = cfg.get("global_attn_every_n_layers", 3)
    return cfg.get("layer_types") or [
        "sliding_attention" if i % every else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    ]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by position (the halves paired, as transformers' rotate_half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], ops: Ops, index: int, layer_type: str) -> None:
        super().__init__()
        hidden, eps, bias = (
            cfg["hidden_size"],
            cfg.get("norm_eps", 1e-5),
            cfg.get("norm_bias", False),
        )
        self.num_heads = cfg["num_attention_heads"]
        self.layer_type = layer_type
        self.window = cfg.get("local_attention", 128) // 2 if layer_type == "sliding_attention" else None  # fmt: skip
        self.attn_norm = None if index == 0 else nn.LayerNorm(hidden, eps, bias=bias)
        self.attn = nn.Module()
        self.attn.Wqkv = Linear(hidden, 3 * hidden, cfg.get("attention_bias", False), ops)
        self.attn.Wo = Linear(hidden, hidden, cfg.get("attention_bias", False), ops)
        self.mlp_norm = nn.LayerNorm(hidden, eps, bias=bias)
        self.mlp = nn.Module()
        mlp_bias = cfg.get("mlp_bias", False)
        self.mlp.Wi = Linear(hidden, 2 * cfg["intermediate_size"], mlp_bias, ops)
        self.mlp.Wo = Linear(cfg["intermediate_size"], hidden, mlp_bias, ops)
        self.act = _ACTIVATIONS[cfg.get("hidden_activation", "gelu")]

    def forward(self, x: torch.Tensor, rope: dict[str, tuple]) -> torch.Tensor:
        T, C = x.shape
        h = x if self.attn_norm is None else self.attn_norm(x)
        q, k, v = self.attn.Wqkv(h).view(T, 3, self.num_heads, -1).unbind(1)
        cos, sin = rope[self.layer_type]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        x = x + self.attn.Wo(bidirectional_attention(q, k, v, self.window).reshape(T, C))
        gate_in, gate = self.mlp.Wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp.Wo(self.act(gate_in) * gate)


class ModernBertModel(nn.Module):
    takes_token_types = False

    def __init__(self, cfg: dict[str, Any], ops: Ops = TORCH_OPS) -> None:
        super().__init__()
        hidden, eps, bias = (
            cfg["hidden_size"],
            cfg.get("norm_eps", 1e-5),
            cfg.get("norm_bias", False),
        )
        self.config = cfg
        self.head_dim = hidden // cfg["num_attention_heads"]
        self.thetas = _rope_thetas(cfg)
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = Embedding(cfg["vocab_size"], hidden, ops)
        self.embeddings.norm = nn.LayerNorm(hidden, eps, bias=bias)
        types = _layer_types(cfg)
        self.layers = nn.ModuleList(
            ModernBertLayer(cfg, ops, i, types[i]) for i in range(cfg["num_hidden_layers"])
        )
        self.final_norm = nn.LayerNorm(hidden, eps, bias=bias)
        self.dtype = torch.float32

    def forward(self, input_ids, positions, inputs_embeds=None, token_type_ids=None):
        x = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids).to(self.dtype))
        rope = {kind: self._rope(positions, theta) for kind, theta in self.thetas.items()}
        for layer in self.layers:
            x = layer(x, rope)
        return self.final_norm(x)

    def _rope(self, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] at each position (float32, then the model's dtype)."""
        inv = 1.0 / theta ** (
            torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        )
        angles = positions.float()[:, None] * inv[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def build_decode_loop(self) -> int:
        return 0

    def lora_linears(self):
        return iter(())

    def load_weights(self, weights, dtype: torch.dtype = torch.float32) -> None:
        """Hugging Face's names, with or without a head's "model." prefix."""
        self.dtype = dtype

        def named():
            for name, w in weights:
                name = name.removeprefix("model.")
                yield (None if name.startswith(("head.", "classifier.", "decoder.")) else name), w

        load_by_name(self, named(), dtype)
