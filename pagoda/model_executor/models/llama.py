"""Llama, and the variants that only flip config switches: Mistral, Qwen2 (q/k/v bias),
SmolLM; and their mixture-of-experts kin, whose MLP is a `SparseMoeBlock`: Mixtral,
Qwen2-MoE (a gated shared expert beside the routed ones; dense layers where
`mlp_only_layers` or `decoder_sparse_step` say) and OLMoE (RMSNorm on the whole q
and k projections, optional `clip_qkv`).

Flat token batches: every activation is [T, ...] with T the step's tokens
across all requests. q/k/v and gate/up are fused into one matmul each, and each
MoE layer's experts are stacked into two [E, ...] tensors; the loader maps
Hugging Face's separate weights onto them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention.context import get_attention_metadata, get_lora_mapping
from pagoda.distributed import SINGLE, ParallelContext, split_heads, split_layers, split_range
from pagoda.model_executor.layers.attention import Attention
from pagoda.model_executor.layers.fused_moe import FusedMoE
from pagoda.model_executor.layers.layernorm import RMSNorm
from pagoda.model_executor.layers.linear import Embedding, Linear, Shard
from pagoda.model_executor.layers.rotary import RotaryEmbedding
from pagoda.model_executor.quantization import BLOCK, QuantizedWeight
from pagoda.ops import TORCH_OPS, Ops

logger = logging.getLogger(__name__)


class LlamaAttention(nn.Module):
    """Tensor parallel: this rank's heads (`split_heads`): its rows of q/k/v, and o_proj
    on their columns (row parallel)."""

    def __init__(
        self,
        cfg: dict[str, Any],
        ops: Ops,
        rotary_emb: RotaryEmbedding,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        total_heads = cfg["num_attention_heads"]
        total_kv_heads = cfg.get("num_key_value_heads") or total_heads
        self.head_dim = D = cfg.get("head_dim") or hidden // total_heads
        q_start, self.num_heads, kv_start, self.num_kv_heads = split_heads(
            total_heads, total_kv_heads, parallel.tp_size, parallel.tp_rank
        )
        self.q_size = self.num_heads * D
        self.kv_size = self.num_kv_heads * D
        arch = cfg["architectures"][0]
        bias = {
            "Qwen2ForCausalLM": True,
            "Qwen2MoeForCausalLM": bool(cfg.get("qkv_bias", True)),
        }.get(arch, bool(cfg.get("attention_bias", False)))
        qkv_shard = o_shard = None
        if parallel.tp_size > 1:
            q_part = (total_heads * D, q_start * D, self.q_size)
            kv_part = (total_kv_heads * D, kv_start * D, self.kv_size)
            qkv_shard, o_shard = Shard(0, (q_part, kv_part, kv_part)), Shard(1, (q_part,))
        self.qkv_proj = Linear(
            hidden, self.q_size + 2 * self.kv_size, bias, ops, qkv_shard, parallel
        )
        self.o_proj = Linear(self.q_size, hidden, False, ops, o_shard, parallel)
        self.rotary_emb = rotary_emb  # one table for every layer
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, ops)
        # OLMoE: RMSNorm over the whole q and k projections, then q, k, v clamped.
        self.q_norm = self.k_norm = None
        self.clip_qkv = cfg.get("clip_qkv")
        if arch == "OlmoeForCausalLM":
            eps = cfg.get("rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(self.q_size, eps, ops)
            self.k_norm = RMSNorm(self.kv_size, eps, ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None or self.clip_qkv is not None:
            qkv = self._norm_and_clip(qkv)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = self.rotary_emb(
            positions, qk.view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        )
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, KVH, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v)  # [T, H, D]
        return self.o_proj(o.reshape(T, self.q_size))

    def _norm_and_clip(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        qkv = torch.cat([q, k, v], dim=-1)
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        return qkv


class LlamaMLP(nn.Module):
    """Tensor parallel: this rank's columns of the intermediate (cut at blocks of 32, so
    quantized weights split whole): its rows of gate/up, down_proj on them."""

    def __init__(
        self,
        cfg: dict[str, Any],
        ops: Ops,
        intermediate_size: int | None = None,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], intermediate_size or cfg["intermediate_size"]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu).")
        bias = bool(cfg.get("mlp_bias", False))
        gate_up_shard = down_shard = None
        if parallel.tp_size > 1:
            start, end = split_range(inter, parallel.tp_size, parallel.tp_rank, BLOCK)
            part = (inter, start, end - start)
            gate_up_shard, down_shard = Shard(0, (part, part)), Shard(1, (part,))
            inter = end - start
        self.gate_up_proj = Linear(hidden, 2 * inter, bias, ops, gate_up_shard, parallel)
        self.down_proj = Linear(inter, hidden, bias, ops, down_shard, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    """A mixture-of-experts MLP: the router (`gate`), the routed experts, and for
    Qwen2-MoE a shared expert every token goes through, scaled by a sigmoid gate."""

    def __init__(self, cfg: dict[str, Any], ops: Ops) -> None:
        super().__init__()
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu).")
        hidden = cfg["hidden_size"]
        num_experts = cfg.get("num_local_experts") or cfg["num_experts"]
        mixtral = cfg["architectures"][0] == "MixtralForCausalLM"
        self.gate = Linear(hidden, num_experts, False, ops)
        self.experts = FusedMoE(
            num_experts,
            cfg["num_experts_per_tok"],
            hidden,
            cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
            renormalize=mixtral or bool(cfg.get("norm_topk_prob", False)),
            ops=ops,
        )
        self.shared_expert = self.shared_expert_gate = None
        if cfg.get("shared_expert_intermediate_size"):
            self.shared_expert = LlamaMLP(cfg, ops, cfg["shared_expert_intermediate_size"])
            self.shared_expert_gate = Linear(hidden, 1, False, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


def is_moe_layer(cfg: dict[str, Any], layer_idx: int) -> bool:
    """Whether layer `layer_idx` has experts (Qwen2-MoE may keep some layers dense)."""
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if num_experts == 0 or layer_idx in (cfg.get("mlp_only_layers") or ()):
        return False
    return (layer_idx + 1) % (cfg.get("decoder_sparse_step") or 1) == 0


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        ops: Ops,
        rotary_emb: RotaryEmbedding,
        layer_idx: int = 0,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(cfg, ops, rotary_emb, parallel)
        # Experts are not split: each rank runs them all on the whole hidden state.
        self.mlp = (
            SparseMoeBlock(cfg, ops)
            if is_moe_layer(cfg, layer_idx)
            else LlamaMLP(cfg, ops, parallel=parallel)
        )
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, ops)

    def forward(self, positions, x, residual):
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Pipeline parallel: a stage holds layers [start_layer, end_layer) (the others are
    empty placeholders, so names stay the checkpoint's), the first the embedding and
    the last the final norm."""

    def __init__(self, cfg: dict[str, Any], ops: Ops, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        self.hidden_size = cfg["hidden_size"]
        self.embed_tokens = None
        if parallel.is_first_stage:
            self.embed_tokens = vocab_parallel(Embedding, cfg, ops, parallel)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        rotary_emb = RotaryEmbedding(
            head_dim,
            cfg.get("max_position_embeddings", 2048),
            cfg.get("rope_theta", 10000.0),
            cfg.get("rope_scaling"),
            ops,
        )
        num_layers = cfg["num_hidden_layers"]
        self.start_layer, self.end_layer = split_layers(
            num_layers, parallel.pp_size, parallel.pp_rank
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, ops, rotary_emb, i, parallel)
            if self.start_layer <= i < self.end_layer
            else nn.Identity()
            for i in range(num_layers)
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6), ops)
        self.ops = ops
        self.decode_loop = None  # see build_decode_loop
        self.decode_loop_max_rows = 0

    def build_decode_loop(self) -> int:
        """Hand the layers to the C++ decode loop (csrc/decode_loop.cpp), which then runs
        decode-only steps of up to `decode_loop_max_rows` rows (8 or 16: while every
        linear takes its small-batch kernel) with the same kernels in the same order as
        `forward` (bitwise the same result) and no Python between them. Call once the
        weights are loaded and the KV cache is bound. It is built only if the kernels
        are, the cache is unquantized, and every linear is one the loop runs as the
        kernel layer would; MoE layers and OLMoE's q/k norms run there too. Returns
        the most rows it takes (0: not built)."""
        ops = self.ops
        if self.parallel.world_size > 1:  # its layers run whole, with no collectives
            return 0
        if ops.decode_loop is None or any(
            layer.self_attn.attn.kv.quantized
            # The loop clamps q/k/v only after OLMoE's q/k norms, with the model's eps.
            or (layer.self_attn.clip_qkv is not None and layer.self_attn.q_norm is None)
            or (layer.self_attn.q_norm is not None and layer.self_attn.q_norm.eps != self.norm.eps)
            for layer in self.layers
        ):
            return 0
        attn = self.layers[0].self_attn
        loop = ops.decode_loop(
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            attn.attn.scale,
            self.norm.eps,
            attn.rotary_emb.cos,
            attn.rotary_emb.sin,
            self.norm.weight,
        )
        max_rows = None

        def add(linear: Linear) -> int | None:
            """The linear's index in the loop, or None if the loop cannot run it."""
            nonlocal max_rows
            spec = ops.decode_loop_linear(linear.weight, linear.qweight, linear.bias)
            if spec is None:
                return None
            args, rows = spec
            max_rows = rows if max_rows is None else min(max_rows, rows)
            index = loop.add_linear(*args)
            if linear.lora is not None:  # adapter slots, added as ops.add_lora adds them
                if not ops.decode_loop_lora:
                    return None
                lora = linear.lora
                loop.set_lora(index, lora.a, lora.b, lora.ranks, lora.offsets)
            return index

        for layer in self.layers:
            mlp = layer.mlp
            dense = isinstance(mlp, LlamaMLP)
            linears = [add(layer.self_attn.qkv_proj), add(layer.self_attn.o_proj)]
            linears += [add(mlp.gate_up_proj), add(mlp.down_proj)] if dense else [-1, -1]
            if None in linears:
                return 0
            kv = layer.self_attn.attn.kv
            loop.add_layer(
                *linears,
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                kv.k,
                kv.v,
            )
            attn = layer.self_attn
            if attn.q_norm is not None:
                clip = -1.0 if attn.clip_qkv is None else float(attn.clip_qkv)
                loop.set_qk_norm(attn.q_norm.weight, attn.k_norm.weight, clip)
            if dense:
                continue
            experts = mlp.experts
            # The experts' products: stacked dense tensors (the loop's `dense`), or
            # quantized, one linear per expert.
            expert_linears = {}
            for part, stacked, quantized in (
                ("gate_up", experts.w13, experts.q13),
                ("down", experts.w2, experts.q2),
            ):
                specs = (
                    [ops.decode_loop_linear(stacked[0], None, None)]
                    if quantized is None
                    else [ops.decode_loop_linear(None, q, None) for q in quantized]
                )
                if None in specs:
                    return 0
                max_rows = min(max_rows, *(rows for _, rows in specs))
                if quantized is not None:
                    expert_linears[part] = [loop.add_linear(*args) for args, _ in specs]
            shared = [-1, -1, -1]
            if mlp.shared_expert is not None:
                shared_mlp = mlp.shared_expert
                shared = [
                    add(shared_mlp.gate_up_proj),
                    add(shared_mlp.down_proj),
                    add(mlp.shared_expert_gate),
                ]
            router = add(mlp.gate)
            if router is None or None in shared:
                return 0
            none = torch.empty(experts.num_experts, 0, 0)  # a part held per expert instead
            loop.set_moe(
                router,
                none if experts.w13 is None else experts.w13,
                none if experts.w2 is None else experts.w2,
                experts.top_k,
                experts.renormalize,
                *shared,
            )
            if expert_linears:
                loop.set_moe_experts(
                    expert_linears.get("gate_up", []), expert_linears.get("down", [])
                )
        self.decode_loop, self.decode_loop_max_rows = loop, max_rows
        return max_rows

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.parallel.is_first_stage:
            return self._forward_stage(positions)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, hidden]
        residual = None
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
        return self._run_layers(positions, x, residual)

    def _forward_stage(self, positions: torch.Tensor) -> torch.Tensor | None:
        """A later pipeline stage: the previous stage's hidden states and residual in."""
        first = self.layers[self.start_layer].input_layernorm.weight
        like = ((positions.shape[0], self.hidden_size), first.dtype)
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


def vocab_parallel(cls, cfg: dict[str, Any], ops: Ops, parallel: ParallelContext):
    """An Embedding or the lm_head over this TP rank's range of the vocabulary."""
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    if parallel.tp_size == 1:
        return cls(vocab, hidden, ops) if cls is Embedding else cls(hidden, vocab, False, ops)
    start, end = split_range(vocab, parallel.tp_size, parallel.tp_rank)
    shard = Shard(0, ((vocab, start, end - start),))
    if cls is Embedding:
        return Embedding(end - start, hidden, ops, shard, parallel)
    return Linear(hidden, end - start, False, ops, shard, parallel)


class LlamaForCausalLM(nn.Module):
    # Hugging Face name fragment -> (fused parameter, shard index)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(
        self, cfg: dict[str, Any], ops: Ops = TORCH_OPS, parallel: ParallelContext = SINGLE
    ) -> None:
        """`ops`: the kernel layer's implementations, chosen once at load (pagoda.ops).
        The linear and embedding weights are left uninitialized: `load_weights` gives
        every parameter its storage, in the model's dtype or quantized. `parallel`: this
        worker's shard of the model (its heads, columns and vocabulary; its layers)."""
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        self.model = LlamaModel(cfg, ops, parallel)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = None  # the last stage's
        if parallel.is_last_stage:
            self.lm_head = vocab_parallel(Linear, cfg, ops, parallel)
            ranges = (
                split_range(cfg["vocab_size"], parallel.tp_size, r) for r in range(parallel.tp_size)
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

    def build_decode_loop(self) -> int:
        return self.model.build_decode_loop()

    def lora_linears(self) -> Iterable[tuple[int, tuple[str, ...], Linear]]:
        """(layer index, the Hugging Face modules it fuses, in order, linear) for every
        linear that LoRA adapters may target."""
        for i, layer in enumerate(self.model.layers):
            yield i, ("q_proj", "k_proj", "v_proj"), layer.self_attn.qkv_proj
            yield i, ("o_proj",), layer.self_attn.o_proj
            if isinstance(layer.mlp, LlamaMLP):  # experts take no adapters (yet)
                yield i, ("gate_proj", "up_proj"), layer.mlp.gate_up_proj
                yield i, ("down_proj",), layer.mlp.down_proj

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits [rows, vocab]; tensor parallel, on TP rank 0 only (None elsewhere)."""
        return self.parallel.gather_columns(self.lm_head(hidden), self.vocab_sizes)

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """Load Hugging Face-named weights: dense tensors (stored in `dtype`) or block-
        quantized ones (kept so, see QuantizedWeight). q/k/v and gate/up are fused from
        their parts once all have come; fused parts stay quantized (in q8_0 when
        their formats differ).

        Raises ValueError naming any parameter left unloaded or of the wrong shape.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pending: dict[str, dict[int, torch.Tensor | QuantizedWeight]] = {}
        experts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        experts_dequantized = False
        for name, w in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            name = self._stage_name(name)
            if name is None:  # another pipeline stage's
                continue
            name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for it
            expert = _EXPERT_WEIGHT.match(name)
            if expert is not None:
                if self._stack_expert(expert, w, params, experts, loaded, dtype):
                    experts_dequantized = True
                continue
            fused = next(
                (
                    (name.replace(hf_part, fused_part), shard, fused_part)
                    for hf_part, (fused_part, shard) in self.stacked_params.items()
                    if hf_part in name
                ),
                None,
            )
            if fused is None:
                if name not in params:
                    raise ValueError(
                        f"checkpoint weight {name!r} has no place in {type(self).__name__}."
                    )
                self._load(name, [w], [name], dtype)
                loaded.add(name)
                continue
            fused_name, shard, fused_part = fused
            if fused_name not in params:
                raise ValueError(
                    f"checkpoint weight {name!r} has no place in {type(self).__name__}."
                )
            parts = pending.setdefault(fused_name, {})
            parts[shard] = (name, w)
            if len(parts) == (3 if fused_part == ".qkv_proj." else 2):
                del pending[fused_name]
                names, ws = zip(*(parts[i] for i in range(len(parts))), strict=True)
                self._load(fused_name, list(ws), list(names), dtype)
                loaded.add(fused_name)
        if experts_dequantized:
            logger.warning("MoE experts came partly quantized: all loaded in %s.", dtype)
        for target, parts in experts.items():
            expected = params[target].shape[0] * (1 if target.endswith(".w2") else 2)
            raise ValueError(
                f"checkpoint is missing {expected - len(parts)} expert weights of {target!r}."
            )
        missing = sorted(set(params) - loaded - {"lm_head.weight"})
        if missing:
            raise ValueError(
                f"checkpoint is missing weights: {', '.join(missing[:5])}"
                + (" ..." if len(missing) > 5 else "")
            )
        embed = self.model.embed_tokens
        if self.lm_head is None:  # not the last pipeline stage
            return
        if self.tie_word_embeddings and embed is not None:
            if embed.qweight is not None:
                self.lm_head.set_quantized(embed.qweight)
            else:
                self.lm_head.weight = embed.weight
        elif "lm_head.weight" not in loaded:
            raise ValueError("checkpoint is missing weights: lm_head.weight")

    def _stage_name(self, name: str) -> str | None:
        """The parameter that checkpoint weight `name` loads into on this pipeline
        stage, or None if another stage holds it (a tied lm_head on a last stage
        without the embedding loads the embedding's table)."""
        layer = _LAYER_WEIGHT.match(name)
        if layer is not None:
            inner = self.model
            return name if inner.start_layer <= int(layer.group(1)) < inner.end_layer else None
        if name.startswith("model.embed_tokens.") and self.model.embed_tokens is None:
            if self.tie_word_embeddings and self.lm_head is not None:
                return name.replace("model.embed_tokens.", "lm_head.")
            return None
        if name.startswith("lm_head.") and self.lm_head is None:
            return None
        return name

    def _stack_expert(self, match, w, params, experts, loaded, dtype) -> bool:
        """One expert's gate, up or down weight into its layer's experts; they are set
        once every expert's part has come: kept quantized, one weight per expert, when
        all came quantized, else stacked into one tensor in `dtype`. Returns whether a
        quantized weight was dequantized (some came quantized and some not)."""
        prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
        shard = _EXPERT_SHARDS[part]
        target = f"{prefix}.{'w2' if shard == 2 else 'w13'}"
        if target not in params:
            raise ValueError(f"checkpoint weight {match.group(0)!r} has no place in this model.")
        param = params[target]
        num_experts, rows = param.shape[0], param.shape[1] // (1 if shard == 2 else 2)
        if not 0 <= expert < num_experts:
            raise ValueError(f"checkpoint weight {match.group(0)!r}: only {num_experts} experts.")
        if tuple(w.shape) != (rows, param.shape[2]):
            raise ValueError(
                f"weight {match.group(0)!r} has shape {tuple(w.shape)}, "
                f"expected {(rows, param.shape[2])}."
            )
        parts = experts.setdefault(target, {})
        parts[(expert, shard % 2)] = w
        if len(parts) < num_experts * (1 if shard == 2 else 2):
            return False
        del experts[target]
        loaded.add(target)
        module_name, attr = target.rsplit(".", 1)
        moe = self.get_submodule(module_name)
        quantized = [isinstance(part_w, QuantizedWeight) for part_w in parts.values()]
        if all(quantized):
            halves = 1 if shard == 2 else 2
            moe.set_quantized(
                attr,
                [QuantizedWeight.cat([parts[(e, h)] for h in range(halves)]) if halves > 1
                 else parts[(e, 0)] for e in range(num_experts)],
            )  # fmt: skip
            return False
        data = torch.empty(param.shape, dtype=dtype)
        for (e, half), part_w in parts.items():
            if isinstance(part_w, QuantizedWeight):
                part_w = TORCH_OPS.dequantize(part_w, dtype)
            data[e, half * rows : (half + 1) * rows].copy_(part_w)
        setattr(moe, attr, nn.Parameter(data, requires_grad=False))
        return any(quantized)

    def _load(
        self,
        target: str,
        parts: list[torch.Tensor | QuantizedWeight],
        names: list[str],
        dtype: torch.dtype,
    ) -> None:
        """Give parameter `target` its weight from `parts` (its shards, in order)."""
        module_name, attr = target.rsplit(".", 1)
        module = self.get_submodule(module_name)
        param = getattr(module, attr)
        shard = getattr(module, "shard", None)
        if shard is not None:  # this tensor-parallel rank's slice of each part
            parts = [shard.take(i, p, n) for i, (p, n) in enumerate(zip(parts, names, strict=True))]
        sizes = (
            [param.shape[0]]
            if len(parts) == 1
            else self._shard_sizes(f".{target.split('.')[-2]}.", param.shape[0])
        )
        for part, name, size in zip(parts, names, sizes, strict=True):
            want = (size, *param.shape[1:])
            if tuple(part.shape) != want:
                raise ValueError(f"weight {name!r} has shape {tuple(part.shape)}, expected {want}.")
        quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
        if attr == "weight" and len(quantized) == len(parts):
            weight = parts[0] if len(parts) == 1 else QuantizedWeight.cat(parts)
            if isinstance(module, Linear):
                module.set_quantized(weight)
                return
            if isinstance(module, Embedding):
                module.set_quantized(weight, dtype)
                return
        data = torch.empty(param.shape, dtype=dtype)
        offset = 0
        for part in parts:
            if isinstance(part, QuantizedWeight):
                part = TORCH_OPS.dequantize(part, dtype)
            data[offset : offset + part.shape[0]].copy_(part)
            offset += part.shape[0]
        setattr(module, attr, nn.Parameter(data, requires_grad=False))

    def _shard_sizes(self, fused_part: str, rows: int) -> list[int]:
        """The parts of a fused weight of `rows` rows: q, k, v, or gate and up."""
        attn = self.model.layers[self.model.start_layer].self_attn
        if fused_part == ".qkv_proj.":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [rows // 2] * 2  # a layer's MLP or a shared expert: each its own size


_LAYER_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.")
# An expert's weight, by Mixtral's (w1, w3, w2) or Qwen2-MoE's and OLMoE's names.
_EXPERT_WEIGHT = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
# -> 0: the gate half of w13, 1: its up half, 2: w2.
_EXPERT_SHARDS = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}
