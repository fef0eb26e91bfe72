"""Encoders: BERT and (XLM-)RoBERTa, alone (embeddings) or with a classifier head
(cross-encoders: a text pair's relevance). Post-LayerNorm layers, bidirectional
attention within each prompt of the step, absolute positions (RoBERTa's after its
padding id), token types (a pair's second text is type 1). No KV cache: a prompt runs
whole, in one step, and leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention.context import get_attention_metadata
from pagoda.model_executor.layers.linear import Embedding, Linear
from pagoda.model_executor.models import position_offset
from pagoda.model_executor.quantization import QuantizedWeight
from pagoda.model_executor.weight_loader import load_by_name
from pagoda.ops import TORCH_OPS, Ops

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def bidirectional_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """q, k, v [T, heads, D] of the step's prompts, one after another -> [T, heads, D]:
    each token attends to every token of its own prompt (with `window`, to those at most
    that far on either side): SDPA over the prompts padded to the longest, the padding
    masked out."""
    meta = get_attention_metadata()
    lens = [1] * meta.num_decodes + meta.prefill_query_lens  # one-token prompts come first
    T, H, D = q.shape
    longest = max(lens)
    near = None
    if window is not None and window < longest:
        offsets = torch.arange(longest)
        near = (offsets[:, None] - offsets[None, :]).abs() <= window  # [L, L]
    if all(n == longest for n in lens):  # prompts of one length: a batch, nothing padded
        batched = (t.view(len(lens), longest, H, D).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(*batched, attn_mask=near)
        return out.transpose(1, 2).reshape(T, H, D)
    lens_t = torch.tensor(lens)
    starts = torch.cumsum(lens_t, 0) - lens_t
    offsets = torch.arange(longest)
    valid = offsets < lens_t[:, None]  # [B, L]
    rows = torch.where(valid, starts[:, None] + offsets, T)  # padding reads a zero row
    padded = [torch.cat([t, t.new_zeros(1, H, D)])[rows].transpose(1, 2) for t in (q, k, v)]
    mask = valid[:, None, None, :] if near is None else valid[:, None, None, :] & near
    out = F.scaled_dot_product_attention(*padded, attn_mask=mask)
    return out.transpose(1, 2)[valid]  # [T, H, D], in the step's order


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any], ops: Ops, position_offset: int) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.word_embeddings = Embedding(cfg["vocab_size"], hidden, ops)
        self.position_embeddings = Embedding(cfg["max_position_embeddings"], hidden, ops)
        self.token_type_embeddings = Embedding(cfg.get("type_vocab_size", 2), hidden, ops)
        self.LayerNorm = nn.LayerNorm(hidden, cfg.get("layer_norm_eps", 1e-12))
        self.position_offset = position_offset

    def forward(self, input_ids, positions, token_type_ids) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions + self.position_offset))


class BertLayer(nn.Module):
    """Self-attention, then a two-layer MLP, each added to its input and normalized
    after (Hugging Face's names: attention.self/output, intermediate, output)."""

    def __init__(self, cfg: dict[str, Any], ops: Ops) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12)
        self.num_heads = cfg["num_attention_heads"]
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.attention.self, name, Linear(hidden, hidden, True, ops))
        self.attention.output = _DenseNorm(hidden, hidden, eps, ops)
        self.intermediate = nn.Module()
        self.intermediate.dense = Linear(hidden, cfg["intermediate_size"], True, ops)
        self.output = _DenseNorm(cfg["intermediate_size"], hidden, eps, ops)
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)}).")
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, C = x.shape
        attn = self.attention.self
        q, k, v = (p(x).view(T, self.num_heads, -1) for p in (attn.query, attn.key, attn.value))
        h = self.attention.output(bidirectional_attention(q, k, v).reshape(T, C), x)
        return self.output(self.act(self.intermediate.dense(h)), h)


class _DenseNorm(nn.Module):
    """LayerNorm(dense(x) + residual): a BERT layer's two outputs."""

    def __init__(self, in_features: int, out_features: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.dense = Linear(in_features, out_features, True, ops)
        self.LayerNorm = nn.LayerNorm(out_features, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertModel(nn.Module):
    """The encoder: embeddings and layers; forward -> hidden states [T, hidden]."""

    prefix = "bert."  # its weights' prefix under a head (BertForSequenceClassification)
    position_offset = 0

    def __init__(self, cfg: dict[str, Any], ops: Ops = TORCH_OPS) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg, ops, self.position_offset_of(cfg))
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            BertLayer(cfg, ops) for _ in range(cfg["num_hidden_layers"])
        )
        self.dtype = torch.float32  # the activations' (set by load_weights)
        self.takes_token_types = cfg.get("type_vocab_size", 2) > 1

    def position_offset_of(self, cfg: dict[str, Any]) -> int:
        return self.position_offset

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, positions, token_type_ids).to(self.dtype)
        for layer in self.encoder.layer:
            x = layer(x)
        return x

    def build_decode_loop(self) -> int:
        return 0  # nothing decodes

    def lora_linears(self):
        return iter(())

    # ---- weights ---------------------------------------------------------------------

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """Hugging Face's names (with or without the head's prefix; old checkpoints'
        LayerNorm gamma/beta); linears and tables may come quantized and stay so."""
        self.dtype = dtype
        load_by_name(self, ((self._name(n), w) for n, w in weights), dtype)

    def _name(self, name: str) -> str | None:
        """The parameter a checkpoint weight loads into here, or None (not used)."""
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
            "LayerNorm.beta", "LayerNorm.bias"
        )
        name = name.removeprefix(self.prefix)
        if name.startswith("pooler.") or name.endswith("position_ids"):
            return None  # embeddings pool their own way; position ids are computed
        return name


class RobertaModel(BertModel):
    """(XLM-)RoBERTa: BERT's layers, positions counted from after the padding id."""

    prefix = "roberta."

    def position_offset_of(self, cfg: dict[str, Any]) -> int:
        return position_offset("RobertaModel", cfg)


class BertForSequenceClassification(nn.Module):
    """A cross-encoder: BERT, its pooler (tanh of a dense layer over the [CLS] token) and a
    classifier over that; `classify` -> the logits of each prompt."""

    encoder_class = BertModel

    def __init__(self, cfg: dict[str, Any], ops: Ops = TORCH_OPS) -> None:
        super().__init__()
        self.encoder = self.encoder_class(cfg, ops)
        self.takes_token_types = self.encoder.takes_token_types
        self.num_labels = len(cfg.get("id2label") or {}) or cfg.get("num_labels", 2)
        self.head = self._head(cfg, ops)

    def _head(self, cfg: dict[str, Any], ops: Ops) -> nn.Module:
        hidden = cfg["hidden_size"]
        head = nn.Module()
        head.pooler = nn.Module()
        head.pooler.dense = Linear(hidden, hidden, True, ops)
        head.classifier = Linear(hidden, self.num_labels, True, ops)
        return head

    def forward(self, input_ids, positions, inputs_embeds=None, token_type_ids=None):
        return self.encoder(input_ids, positions, inputs_embeds, token_type_ids)

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """One prompt's hidden states [T, hidden] -> logits [1, labels], from its first
        token ([CLS])."""
        head = self.head
        return head.classifier(torch.tanh(head.pooler.dense(rows[:1])))

    def build_decode_loop(self) -> int:
        return 0

    def lora_linears(self):
        return iter(())

    def load_weights(self, weights, dtype: torch.dtype = torch.float32) -> None:
        """The encoder's weights to it; the head's (`pooler.*`, `classifier.*`) here."""
        head: dict[str, Any] = {}
        prefix = self.encoder.prefix

        def encoder_weights():
            for name, w in weights:
                short = name.removeprefix(prefix)
                if short.startswith("pooler.") or name.startswith("classifier."):
                    head[short] = w
                else:
                    yield name, w

        self.encoder.load_weights(encoder_weights(), dtype)
        self.head.load_state_dict(
            {k: w.to(torch.float32) if isinstance(w, torch.Tensor) else TORCH_OPS.dequantize(w, torch.float32)
             for k, w in head.items()},
            strict=True,
            assign=True,
        )  # fmt: skip
        self.head.to(dtype)


class RobertaForSequenceClassification(BertForSequenceClassification):
    """(XLM-)RoBERTa's cross-encoders: its head is a dense layer, tanh and `out_proj` over
    the first token (no pooler)."""

    encoder_class = RobertaModel

    def _head(self, cfg: dict[str, Any], ops: Ops) -> nn.Module:
        hidden = cfg["hidden_size"]
        head = nn.Module()
        head.classifier = nn.Module()
        head.classifier.dense = Linear(hidden, hidden, True, ops)
        head.classifier.out_proj = Linear(hidden, self.num_labels, True, ops)
        return head

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        c = self.head.classifier
        return c.out_proj(torch.tanh(c.dense(rows[:1])))
