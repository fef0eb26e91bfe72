"""LLaVA: a vision encoder (CLIP or SigLIP), a two-layer projector, and a Llama-family
text model that reads the projected image features at the prompt's image-token
positions.

The engine runs the encoder once per image (`encode_images`, batched over the
step's new images), keeps the result in the model runner's encoder cache, and
hands the text model `inputs_embeds` with those rows in place; the text model
itself is a Llama-family decoder, so decoding (and the C++ decode loop) is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model_executor.models import model_class
from pagoda.model_executor.quantization import QuantizedWeight
from pagoda.model_executor.weight_loader import load_by_name
from pagoda.multimodal import num_image_tokens
from pagoda.ops import TORCH_OPS, Ops

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}."
        )
    return _ACTIVATIONS[name]


def _empty_linear(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
    # Storage comes at load (`load_weights` replaces each parameter).
    return nn.Linear(in_features, out_features, bias=bias, device="meta")


class VisionEncoderLayer(nn.Module):
    """Pre-LayerNorm transformer layer: bidirectional attention, then a two-layer MLP."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.eps = cfg.get("layer_norm_eps", 1e-5)
        self.layer_norm1 = nn.LayerNorm(hidden, self.eps, device="meta")
        self.layer_norm2 = nn.LayerNorm(hidden, self.eps, device="meta")
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, name, _empty_linear(hidden, hidden))
        self.mlp = nn.Module()
        self.mlp.fc1 = _empty_linear(hidden, cfg["intermediate_size"])
        self.mlp.fc2 = _empty_linear(cfg["intermediate_size"], hidden)
        self.act = _activation(cfg.get("hidden_act", "quick_gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        N, P, C = x.shape  # images, patches (+ class token), hidden
        attn, mlp = self.self_attn, self.mlp
        h = self.layer_norm1(x)
        q, k, v = (
            proj(h).view(N, P, self.num_heads, C // self.num_heads).transpose(1, 2)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        o = F.scaled_dot_product_attention(q, k, v)  # [N, heads, P, D]
        x = x + attn.out_proj(o.transpose(1, 2).reshape(N, P, C))
        return x + mlp.fc2(self.act(mlp.fc1(self.layer_norm2(x))))


class VisionTower(nn.Module):
    """CLIP's vision transformer (class token, pre-LayerNorm) or SigLIP's (neither; a
    bias on the patch embedding). Only the layers up to the deepest one the projector
    reads are run; the post-LayerNorm and heads are never used by LLaVA."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.clip = cfg.get("model_type", "clip_vision_model") == "clip_vision_model"
        hidden, patch = cfg["hidden_size"], cfg["patch_size"]
        self.patch_size = patch
        self.image_size = cfg["image_size"]
        num_positions = (self.image_size // patch) ** 2 + (1 if self.clip else 0)
        embed = nn.Module()
        embed.patch_embedding = nn.Conv2d(
            cfg.get("num_channels", 3), hidden, patch, patch, bias=not self.clip, device="meta"
        )
        embed.position_embedding = nn.Embedding(num_positions, hidden, device="meta")
        if self.clip:
            embed.class_embedding = nn.Parameter(torch.empty(hidden, device="meta"))
        self.embeddings = embed
        if self.clip:
            self.pre_layrnorm = nn.LayerNorm(hidden, cfg.get("layer_norm_eps", 1e-5), device="meta")
        encoder = nn.Module()
        encoder.layers = nn.ModuleList(
            VisionEncoderLayer(cfg) for _ in range(cfg["num_hidden_layers"])
        )
        self.encoder = encoder

    def forward(self, pixel_values: torch.Tensor, feature_layers: list[int]) -> list[torch.Tensor]:
        """pixel_values [N, C, H, W] -> the hidden states after each of `feature_layers`
        (0: the embeddings; i: after layer i), each [N, P, hidden]."""
        embed = self.embeddings
        x = embed.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [N, patches, C]
        if self.clip:
            cls = embed.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
        x = x + embed.position_embedding.weight
        if self.clip:
            x = self.pre_layrnorm(x)
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers[: max(feature_layers)], 1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in feature_layers]


class LlavaForConditionalGeneration(nn.Module):
    def __init__(self, cfg: dict[str, Any], ops: Ops = TORCH_OPS) -> None:
        super().__init__()
        self.config = cfg
        vision = cfg["vision_config"]
        self.image_token_id = cfg["image_token_id"]
        self.vision_tower = VisionTower(vision)
        layers = vision.get("vision_feature_layer", -2)
        num_layers = vision["num_hidden_layers"]
        # Hugging Face counts hidden states 0..num_layers (0: the embeddings); -k from the end.
        self.feature_layers = [
            i if i >= 0 else num_layers + 1 + i
            for i in (layers if isinstance(layers, list) else [layers])
        ]
        self.drop_class_token = vision.get("vision_feature_select_strategy", "default") == "default"
        projector_in = vision["hidden_size"] * len(self.feature_layers)
        bias = bool(vision.get("multimodal_projector_bias", True))
        projector = nn.Module()
        projector.linear_1 = _empty_linear(projector_in, cfg["hidden_size"], bias)
        projector.linear_2 = _empty_linear(cfg["hidden_size"], cfg["hidden_size"], bias)
        self.multi_modal_projector = projector
        self.projector_act = _activation(vision.get("projector_hidden_act", "gelu"))
        self.num_image_tokens = num_image_tokens(vision)
        text = {**cfg, "architectures": cfg["text_architectures"]}
        self.language_model = model_class(text["architectures"][0])(text, ops)

    # ---- the engine's interface (as LlamaForCausalLM's, plus images) -------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, H, W] -> image features [N, num_image_tokens, hidden], in
        the text model's embedding space."""
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        states = self.vision_tower(pixel_values.to(dtype), self.feature_layers)
        if self.drop_class_token and self.vision_tower.clip:
            states = [s[:, 1:] for s in states]
        x = torch.cat(states, dim=-1)
        projector = self.multi_modal_projector
        return projector.linear_2(self.projector_act(projector.linear_1(x)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def build_decode_loop(self) -> int:
        return self.language_model.build_decode_loop()

    def lora_linears(self):
        return self.language_model.lora_linears()

    # ---- weights ---------------------------------------------------------------------

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """Hugging Face's LLaVA names in either layout (transformers 4: `language_model.
        model.*`; 5: `model.language_model.*`; towers with or without `vision_model.`):
        the text model's go to `LlamaForCausalLM.load_weights` as they stream, the
        vision tower's and projector's are kept floats in `dtype`."""
        vision: dict[str, torch.Tensor] = {}
        self.language_model.load_weights(self._split(weights, vision), dtype)
        own = {
            n: p
            for n, p in self.named_parameters(remove_duplicate=False)
            if not n.startswith("language_model.")
        }
        unused = ("vision_tower.post_layernorm.", "vision_tower.head.")
        named = ((None if n.startswith(unused) else n, w) for n, w in vision.items())
        load_by_name(self, named, dtype, own)

    @staticmethod
    def _split(weights, vision: dict[str, torch.Tensor]) -> Iterator[tuple[str, Any]]:
        """Yield the text model's weights under LlamaForCausalLM's names; put the rest
        (vision tower, projector) into `vision` under this module's names."""
        for name, w in weights:
            name = name.removeprefix("model.")  # transformers 5 puts every part under model.
            if name.startswith("language_model."):
                name = name.removeprefix("language_model.")
                if not name.startswith(("model.", "lm_head.")):
                    name = "model." + name  # transformers 5: language_model.layers.*
                yield name, w
            elif name.startswith("lm_head."):
                yield name, w
            else:
                vision[name.replace("vision_tower.vision_model.", "vision_tower.")] = w
