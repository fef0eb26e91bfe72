"""The decoder-only transformer every family here is an instance of.

A family module (llama.py, qwen3.py, gemma.py, ...) reads its Hugging Face config into
a `DecoderConfig`: the model-wide choices (norm kind, embedding and logit scales) and
one `LayerConfig` per layer (its attention, its MLP or experts, its norms). The modules below build the model from it; the C++ decode loop (decode_loop.py) is
handed each built layer's settings, so the two cannot drift apart silently.

One layer, with the residual stream kept beside the sublayers' outputs (each norm
adds the previous output into it first, in one fused op):

    x ─ input_layernorm ─ self_attn ─[attn_output_norm]─[* residual_multiplier]─┐
    residual += that;  h = ffn_norm(residual)                                    │
    h ─ mlp ─[ffn_output_norm]─[* residual_multiplier] ─▶ the next layer's x ◀───┘

Gemma's "sandwich" norms are the bracketed output norms; Granite scales each
sublayer's output. Flat token batches: every activation is [T, ...], T the step's
tokens across all requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagoda.attention.context import get_attention_metadata, get_lora_mapping
from pagoda.distributed import SINGLE, ParallelContext, split_layers, split_range
from pagoda.model_executor.layers.layernorm import RMSNorm
from pagoda.model_executor.layers.linear import Embedding, Linear, Shard
from pagoda.model_executor.layers.mlp import GatedMLP
from pagoda.model_executor.layers.rotary import RotaryEmbedding
from pagoda.model_executor.quantization import QuantizedWeight
from pagoda.model_executor.weight_loader import WeightNames, load_weights
from pagoda.ops import TORCH_OPS, Ops


@dataclass(frozen=True)
class LayerConfig:
    attention: Any  # an AttentionConfig (or MLA's): `.build(...)` makes the module
    mlp: Any  # an MLPConfig, a MoEConfig, ...: `.build(hidden, ops, parallel)`
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too (Gemma)
    residual_multiplier: float | None = None  # each sublayer's output scaled (Granite)


@dataclass(frozen=True)
class DecoderConfig:
    hidden_size: int
    vocab_size: int
    norm_eps: float
    layers: tuple[LayerConfig, ...]
    # Rope tables by name (the layers' `rope`), each its parameters in transformers 5's form.
    ropes: dict[str, dict[str, Any]] = field(hash=False)
    max_position_embeddings: int
    num_positions: int  # rows of every rope table: the engine's max_model_len
    rope_head_dim: int  # the head dim a table's partial_rotary_factor applies to
    gemma_norms: bool = False  # every norm's weight is 1 + w, in float32 (see RMSNorm)
    # Gemma's embeddings times sqrt(hidden) rounded to the model's dtype; Granite's times
    # its multiplier (a float) . None: unscaled.
    embed_scale: float | None = None
    embed_scale_in_dtype: bool = False
    logit_divisor: float | None = None  # logits / divisor (Granite's logits_scaling)
    final_logit_softcap: float | None = None  # cap * tanh(logits / cap) (Gemma 2)
    tie_word_embeddings: bool = False


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: DecoderConfig,
        layer: LayerConfig,
        ops: Ops,
        ropes: dict[str, RotaryEmbedding],
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        hidden, eps, gemma = cfg.hidden_size, cfg.norm_eps, cfg.gemma_norms
        self.config = layer
        self.self_attn = layer.attention.build(hidden, eps, ops, ropes, parallel, gemma)
        self.mlp = layer.mlp.build(hidden, ops, parallel)
        self.input_layernorm = RMSNorm(hidden, eps, ops, gemma)
        self.ffn_norm = RMSNorm(hidden, eps, ops, gemma)
        self.attn_output_norm = self.ffn_output_norm = None
        if layer.sandwich_norms:
            self.attn_output_norm = RMSNorm(hidden, eps, ops, gemma)
            self.ffn_output_norm = RMSNorm(hidden, eps, ops, gemma)
        self.residual_multiplier = layer.residual_multiplier

    def forward(self, positions, x, residual):
        """x: the previous sublayer's output (the embeddings at the first layer, with
        residual None) -> (this layer's MLP output, the residual stream before it)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self._finish(self.self_attn(positions, h), self.attn_output_norm)
        h, residual = self.ffn_norm(h, residual)
        return self._finish(self.mlp(h), self.ffn_output_norm), residual

    def _finish(self, h: torch.Tensor, output_norm: RMSNorm | None) -> torch.Tensor:
        if output_norm is not None:
            h = output_norm(h)
        if self.residual_multiplier is not None:
            h = h * self.residual_multiplier
        return h


class DecoderModel(nn.Module):
    """Pipeline parallel: a stage holds layers [start_layer, end_layer) (the others are
    empty placeholders, so names stay the checkpoint's), the first the embedding and
    the last the final norm."""

    def __init__(self, cfg: DecoderConfig, ops: Ops, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        self.hidden_size = cfg.hidden_size
        self.embed_tokens = None
        if parallel.is_first_stage:
            self.embed_tokens = vocab_parallel(Embedding, cfg, ops, parallel)
        self.rotary = nn.ModuleDict(
            {
                name: RotaryEmbedding(
                    cfg.rope_head_dim,
                    cfg.num_positions,
                    params,
                    cfg.max_position_embeddings,
                    ops,
                    cfg.num_positions,
                )  # fmt: skip
                for name, params in cfg.ropes.items()
            }
        )
        num_layers = len(cfg.layers)
        self.start_layer, self.end_layer = split_layers(
            num_layers, parallel.pp_size, parallel.pp_rank
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, layer, ops, dict(self.rotary), parallel)
            if self.start_layer <= i < self.end_layer
            else nn.Identity()
            for i, layer in enumerate(cfg.layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ops, cfg.gemma_norms)
        self.ops = ops
        self.dtype = torch.float32  # the activations' (set by load_weights)
        self.decode_loop = None  # see pagoda.model_executor.decode_loop
        self.decode_loop_max_rows = 0

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        scale = self.config.embed_scale
        if scale is None:
            return x
        if self.config.embed_scale_in_dtype:  # Gemma: sqrt(hidden) as the dtype holds it
            return x * torch.tensor(scale, dtype=x.dtype)
        return x * scale

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        if not self.parallel.is_first_stage:
            return self._forward_stage(positions)
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # [T, hidden]
        if self.decode_loop is not None and x.shape[0] <= self.decode_loop_max_rows:
            meta = get_attention_metadata()
            if meta.num_decodes == x.shape[0]:
                lora = get_lora_mapping()
                return self.decode_loop.run(
                    x,
                    positions,
                    meta.slot_mapping,
                    meta.decode_block_tables,
                    meta.decode_seq_lens,
                    lora.segment_tensor if lora is not None else None,
                )
        return self._run_layers(positions, x, None)

    def _forward_stage(self, positions: torch.Tensor) -> torch.Tensor | None:
        """A later pipeline stage: the previous stage's hidden states and residual in."""
        like = ((positions.shape[0], self.hidden_size), self.dtype)
        x, residual = self.parallel.recv_from_prev_stage(like, like)
        return self._run_layers(positions, x, residual)

    def _run_layers(self, positions, x, residual) -> torch.Tensor | None:
        """This stage's layers; then the final norm, or (not the last stage) the
        hidden states and residual out to the next stage (returns None)."""
        for layer in self.layers[self.start_layer : self.end_layer]:
            x, residual = layer(positions, x, residual)
        if not self.parallel.is_last_stage:
            self.parallel.send_to_next_stage(x, residual)
            return None
        x, _ = self.norm(x, residual)
        return x


def vocab_parallel(cls, cfg: DecoderConfig, ops: Ops, parallel: ParallelContext):
    """An Embedding or the lm_head over this TP rank's range of the vocabulary."""
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    if parallel.tp_size == 1:
        return cls(vocab, hidden, ops) if cls is Embedding else cls(hidden, vocab, False, ops)
    start, end = split_range(vocab, parallel.tp_size, parallel.tp_rank)
    shard = Shard(0, ((vocab, start, end - start),))
    if cls is Embedding:
        return Embedding(end - start, hidden, ops, shard, parallel)
    return Linear(hidden, end - start, False, ops, shard, parallel)


class DecoderForCausalLM(nn.Module):
    """The engine's interface to a decoder: forward -> hidden states, compute_logits,
    load_weights, the C++ decode loop, LoRA's linears. A family subclasses it with its
    config reader (`decoder_config`) and its checkpoint's names (`weight_names`)."""

    weight_names = WeightNames()

    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        raise NotImplementedError

    def __init__(
        self, cfg: dict[str, Any], ops: Ops = TORCH_OPS, parallel: ParallelContext = SINGLE
    ) -> None:
        """`cfg`: the Hugging Face config (a dict; pagoda's loader adds max_model_len).
        `ops`: the kernel layer's implementations, chosen once at load (pagoda.ops).
        The linear and embedding weights are left uninitialized: `load_weights` gives
        every parameter its storage, in the model's dtype or quantized. `parallel`: this
        worker's shard of the model (its heads, columns and vocabulary; its layers)."""
        super().__init__()
        self.config = cfg
        self.decoder = decoder = self.decoder_config(cfg)
        self.parallel = parallel
        self.model = DecoderModel(decoder, ops, parallel)
        self.tie_word_embeddings = decoder.tie_word_embeddings
        self.lm_head = None  # the last stage's
        if parallel.is_last_stage:
            self.lm_head = vocab_parallel(Linear, decoder, ops, parallel)
            ranges = (
                split_range(decoder.vocab_size, parallel.tp_size, r)
                for r in range(parallel.tp_size)
            )
            self.vocab_sizes = [end - start for start, end in ranges]  # each TP rank's
        first_and_last = self.lm_head is not None and self.model.embed_tokens is not None
        if self.tie_word_embeddings and first_and_last:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] (or the embeddings [T, hidden] given) -> hidden
        states [T, hidden]."""
        return self.model(input_ids, positions, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def build_decode_loop(self) -> int:
        from pagoda.model_executor.decode_loop import build_decode_loop

        return build_decode_loop(self.model)

    def lora_linears(self) -> Iterable[tuple[int, tuple[str, ...], Linear]]:
        """(layer index, the Hugging Face modules it fuses, in order, linear) for every
        linear that LoRA adapters may target."""
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            if hasattr(attn, "qkv_proj"):
                yield i, ("q_proj", "k_proj", "v_proj"), attn.qkv_proj
                yield i, ("o_proj",), attn.o_proj
            if isinstance(layer.mlp, GatedMLP):  # experts take no adapters (yet)
                yield i, ("gate_proj", "up_proj"), layer.mlp.gate_up_proj
                yield i, ("down_proj",), layer.mlp.down_proj

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits [rows, vocab] (Granite's divided, Gemma 2's soft-capped in the
        model's dtype, as HF computes them); tensor parallel, on TP rank 0 only (None
        elsewhere)."""
        logits = self.parallel.gather_columns(self.lm_head(hidden), self.vocab_sizes)
        if logits is None:
            return None
        if self.decoder.logit_divisor is not None:
            logits = logits / self.decoder.logit_divisor
        if self.decoder.final_logit_softcap is not None:
            cap = self.decoder.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    # A classifier on the last token [labels, hidden] (sequence-classification decoders,
    # rerankers); set by pagoda.worker.model_setup.classifier_head. None: none.
    score: torch.Tensor | None = None

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """One prompt's hidden states [T, hidden] -> its classifier's logits [1, labels]:
        the last token's, as transformers' *ForSequenceClassification read a causal model
        (its last token is the only one that has seen the whole prompt)."""
        return nn.functional.linear(rows[-1:].to(self.score.dtype), self.score)

    def adapt_weight(self, name: str, w: torch.Tensor | QuantizedWeight):
        """A checkpoint weight (under the module's name) as the module computes with it:
        unchanged, unless a family says otherwise (DeepSeek's interleaved rope rows)."""
        return w

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """Load Hugging Face-named weights (see pagoda.model_executor.weight_loader)."""
        load_weights(self, weights, dtype)
        self.model.dtype = dtype


# ---- reading Hugging Face configs -------------------------------------------------


def head_dim_of(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def rope_parameters(cfg: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """A layer type's rope parameters in transformers 5's form (the config's own, or one
    entry of a per-layer-type dict), with legacy rope_theta/rope_scaling and
    partial_rotary_factor folded in."""
    params = cfg.get("rope_parameters") or {}
    nested = any(isinstance(v, dict) for v in params.values())
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    elif nested:
        params = params.get("full_attention") or {}
    if not nested:  # (legacy rope_scaling is one dict for every layer)
        params = {**(cfg.get("rope_scaling") or {}), **params}
    params.setdefault("rope_theta", cfg.get("rope_theta") or 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    if cfg.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if cfg.get("original_max_position_embeddings") is not None:
        params.setdefault(
            "original_max_position_embeddings", cfg["original_max_position_embeddings"]
        )
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return params


def sliding_windows(cfg: dict[str, Any]) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers decides it:
    by `layer_types` where the config has them (Gemma, Qwen2/3 with
    use_sliding_window), else `sliding_window` on every layer (Mistral, Phi-3). A window
    as long as the context changes nothing and counts as none."""
    num_layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if not window or not cfg.get("use_sliding_window", True):
        return [None] * num_layers
    if window >= cfg.get("max_model_len", cfg.get("max_position_embeddings") or window + 1):
        return [None] * num_layers
    types = cfg.get("layer_types")
    if types is None:
        return [int(window)] * num_layers
    return [int(window) if t == "sliding_attention" else None for t in types]


def llama_decoder(
    cfg: dict[str, Any], attention=None, mlp=None, windows: bool = True, **overrides
) -> DecoderConfig:
    """A Llama-shaped model's DecoderConfig: one rope table, GQA attention with the
    config's windows (`windows` False: none, where HF's model ignores the field),
    gated MLPs. `attention(i)`: fields that layer i's AttentionConfig changes; `mlp(i)`:
    layer i's MLP config (default: dense); `overrides`: DecoderConfig fields."""
    from pagoda.model_executor.layers.mlp import MLPConfig
    from pagoda.model_executor.layers.self_attention import AttentionConfig

    heads = cfg["num_attention_heads"]
    layer_windows = sliding_windows(cfg) if windows else [None] * cfg["num_hidden_layers"]
    layers = []
    for i in range(cfg["num_hidden_layers"]):
        fields = dict(
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim_of(cfg),
            bias=bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            sliding_window=layer_windows[i],
        )
        attn = AttentionConfig(**{**fields, **(attention(i) if attention is not None else {})})
        layer_mlp = mlp(i) if mlp is not None else None
        if layer_mlp is None:
            act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
            layer_mlp = MLPConfig(cfg["intermediate_size"], act, bool(cfg.get("mlp_bias")))
        layers.append(LayerConfig(attn, layer_mlp))
    max_positions = int(cfg.get("max_position_embeddings") or 2048)
    fields = dict(
        hidden_size=cfg["hidden_size"],
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        layers=tuple(layers),
        ropes={"default": rope_parameters(cfg)},
        max_position_embeddings=max_positions,
        num_positions=int(cfg.get("max_model_len") or max_positions),
        rope_head_dim=head_dim_of(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    return DecoderConfig(**{**fields, **overrides})
