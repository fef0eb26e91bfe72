"""Checkpoint weights into a model: one loader for every family.

A family declares its checkpoint's names (`WeightNames`): which Hugging Face fragments
fuse into one parameter (q/k/v into qkv_proj), which fused checkpoint weights come
apart first (Phi-3's qkv_proj, so that tensor parallel cuts each part), renames, and
what to skip. The loader does the rest: pipeline stages, tensor-parallel shards,
fusing parts as they stream in, stacking experts, keeping quantized blocks quantized.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from pagoda.model_executor.layers.layernorm import RMSNorm
from pagoda.model_executor.layers.linear import Embedding, Linear
from pagoda.model_executor.quantization import QuantizedWeight
from pagoda.ops import TORCH_OPS

logger = logging.getLogger(__name__)

QKV, GATE_UP = ".qkv_proj.", ".gate_up_proj."


@dataclass(frozen=True)
class WeightNames:
    """What a family's checkpoint calls its weights, against pagoda's modules."""

    # Hugging Face name fragment -> (the fused parameter's fragment, part index).
    stacked: dict[str, tuple[str, int]] = field(
        default_factory=lambda: {
            ".q_proj.": (QKV, 0),
            ".k_proj.": (QKV, 1),
            ".v_proj.": (QKV, 2),
            ".gate_proj.": (GATE_UP, 0),
            ".up_proj.": (GATE_UP, 1),
        }
    )
    # Fragment renames, applied first: the checkpoint's -> the module's.
    renames: tuple[tuple[str, str], ...] = ((".post_attention_layernorm.", ".ffn_norm."),)
    # Fused checkpoint weights taken apart into these parts (then fused again): Phi-3's,
    # and a GGUF's written with --fuse-qkv.
    splits: tuple[str, ...] = (QKV, GATE_UP)
    # Leading name prefixes rewritten (a multimodal checkpoint's text half).
    prefixes: tuple[tuple[str, str], ...] = ()
    # Weights skipped: name substrings, and layers past the model's (DeepSeek V3's MTP).
    ignored: tuple[str, ...] = ("rotary_emb.inv_freq",)
    skip_extra_layers: bool = False


_LAYER_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.")
# An expert's weight, by Mixtral's (w1, w3, w2) or Qwen2-MoE's and OLMoE's names.
_EXPERT_WEIGHT = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
# -> 0: the gate half of w13, 1: its up half, 2: w2.
_EXPERT_SHARDS = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}

Weight = torch.Tensor | QuantizedWeight


def load_weights(model: nn.Module, weights: Iterable[tuple[str, Weight]], dtype: torch.dtype):
    """Load Hugging Face-named weights into `model` (a DecoderForCausalLM): dense tensors
    (stored in `dtype`; Gemma's norms in float32) or block-quantized ones (kept so, see
    QuantizedWeight). q/k/v and gate/up are fused from their parts once all have come;
    fused parts stay quantized (see QuantizedWeight.cat where their formats differ).

    Raises ValueError naming any parameter left unloaded or of the wrong shape.
    """
    _Loader(model, dtype).run(weights)


def load_by_name(
    model: nn.Module,
    weights: Iterable[tuple[str | None, Weight]],
    dtype: torch.dtype,
    params: dict[str, nn.Parameter] | None = None,
) -> None:
    """For models outside the decoder's loader (encoders, a vision tower): each weight
    into the parameter of its (module's own) name, skipping None names; a quantized one
    kept quantized in a `Linear` or `Embedding`, else in `dtype`. `params`: those to
    load (default: all the model's). Raises ValueError naming a weight with no place,
    of the wrong shape, or missing."""
    params = dict(model.named_parameters()) if params is None else params
    todo = set(params)
    for name, w in weights:
        if name is None:
            continue
        if name not in params:
            raise ValueError(f"checkpoint weight {name!r} has no place in {type(model).__name__}.")  # fmt: skip
        module_name, attr = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        if tuple(w.shape) != tuple(params[name].shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(w.shape)}, expected {tuple(params[name].shape)}."
            )
        if isinstance(w, QuantizedWeight) and isinstance(module, Linear):
            module.set_quantized(w)
        elif isinstance(w, QuantizedWeight) and isinstance(module, Embedding):
            module.set_quantized(w, dtype)
        else:
            if isinstance(w, QuantizedWeight):
                w = TORCH_OPS.dequantize(w, dtype)
            setattr(module, attr, nn.Parameter(w.to(dtype).contiguous(), requires_grad=False))
        todo.discard(name)
    if todo:
        missing = sorted(todo)
        raise ValueError(
            f"checkpoint is missing weights: {', '.join(missing[:5])}"
            + (" ..." if len(missing) > 5 else "")
        )


class _Loader:
    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model = model
        self.names: WeightNames = model.weight_names
        self.dtype = dtype
        self.params = dict(model.named_parameters())
        self.loaded: set[str] = set()
        self.pending: dict[str, dict[int, tuple[str, Weight]]] = {}
        self.experts: dict[str, dict[tuple[int, int], Weight]] = {}
        self.experts_dequantized = False
        # Each fused q/k/v linear's attention (its parts' sizes).
        self.attention_of = {
            id(m.qkv_proj): m
            for m in model.modules()
            if isinstance(getattr(m, "qkv_proj", None), Linear)
        }

    def run(self, weights: Iterable[tuple[str, Weight]]) -> None:
        for name, w in weights:
            name = self._rename(name)
            if name is not None:
                self._one(name, w)
        if self.experts_dequantized:
            logger.warning("MoE experts came partly quantized: all loaded in %s.", self.dtype)
        for target, parts in self.experts.items():
            expected = self.params[target].shape[0] * (1 if target.endswith(".w2") else 2)
            raise ValueError(
                f"checkpoint is missing {expected - len(parts)} expert weights of {target!r}."
            )
        missing = sorted(set(self.params) - self.loaded - {"lm_head.weight"})
        if missing:
            raise ValueError(
                f"checkpoint is missing weights: {', '.join(missing[:5])}"
                + (" ..." if len(missing) > 5 else "")
            )
        self._finish_norms()
        self._tie()

    def _rename(self, name: str) -> str | None:
        """The parameter name a checkpoint weight loads into here, or None (skipped)."""
        names = self.names
        if any(part in name for part in names.ignored):
            return None
        for old, new in names.prefixes:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        if name == "lm_head.weight" and self.model.tie_word_embeddings:
            return None
        layer = _LAYER_WEIGHT.match(name)
        inner = self.model.model
        if layer is not None:
            index = int(layer.group(1))
            if names.skip_extra_layers and index >= len(inner.layers):
                return None
            if not inner.start_layer <= index < inner.end_layer:
                return None  # another pipeline stage's
        elif name.startswith("model.embed_tokens.") and inner.embed_tokens is None:
            if self.model.tie_word_embeddings and self.model.lm_head is not None:
                return name.replace("model.embed_tokens.", "lm_head.")  # a tied last stage
            return None
        elif name.startswith("lm_head.") and self.model.lm_head is None:
            return None
        for old, new in names.renames:
            name = name.replace(old, new)
        return name

    def _one(self, name: str, w: Weight) -> None:
        split = next((part for part in self.names.splits if part in name), None)
        if split is not None:
            self._split(name, w, split)
            return
        w = self.model.adapt_weight(name, w)
        expert = _EXPERT_WEIGHT.match(name)
        if expert is not None:
            self._stack_expert(expert, w)
            return
        fused = next(
            (
                (name.replace(hf_part, fused_part), index, fused_part)
                for hf_part, (fused_part, index) in self.names.stacked.items()
                if hf_part in name
            ),
            None,
        )
        if fused is None:
            self._check_place(name, name)
            self._load(name, [w], [name])
            self.loaded.add(name)
            return
        fused_name, index, fused_part = fused
        self._check_place(fused_name, name)
        parts = self.pending.setdefault(fused_name, {})
        parts[index] = (name, w)
        if len(parts) == (3 if fused_part == QKV else 2):
            del self.pending[fused_name]
            names, ws = zip(*(parts[i] for i in range(len(parts))), strict=True)
            self._load(fused_name, list(ws), list(names))
            self.loaded.add(fused_name)

    def _check_place(self, target: str, name: str) -> None:
        if target not in self.params:
            raise ValueError(
                f"checkpoint weight {name!r} has no place in {type(self.model).__name__}."
            )

    def _split(self, name: str, w: Weight, fused_part: str) -> None:
        """A fused checkpoint weight (Phi-3's qkv_proj, gate_up_proj) into its parts, each
        then fused again as if it had come apart (so tensor parallel cuts each part)."""
        if fused_part == QKV:
            cfg = self.model.model.layers[int(_LAYER_WEIGHT.match(name).group(1))].self_attn.config
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            sizes, parts = [q, kv, kv], (".q_proj.", ".k_proj.", ".v_proj.")
        else:
            sizes, parts = [w.shape[0] // 2] * 2, (".gate_proj.", ".up_proj.")
        if w.shape[0] != sum(sizes):
            raise ValueError(f"weight {name!r} has {w.shape[0]} rows, expected {sum(sizes)}.")
        start = 0
        for size, part in zip(sizes, parts, strict=True):
            if isinstance(w, QuantizedWeight):
                piece = w.rows(slice(start, start + size))
            else:
                piece = w[start : start + size]
            self._one(name.replace(fused_part, part), piece)
            start += size

    def _stack_expert(self, match: re.Match, w: Weight) -> None:
        """One expert's gate, up or down weight into its layer's experts; they are set
        once every expert's part has come: kept quantized, one weight per expert, when
        all came quantized, else stacked into one tensor in the model's dtype."""
        prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
        shard = _EXPERT_SHARDS[part]
        target = f"{prefix}.{'w2' if shard == 2 else 'w13'}"
        if target not in self.params:
            raise ValueError(f"checkpoint weight {match.group(0)!r} has no place in this model.")
        param = self.params[target]
        num_experts, rows = param.shape[0], param.shape[1] // (1 if shard == 2 else 2)
        if not 0 <= expert < num_experts:
            raise ValueError(f"checkpoint weight {match.group(0)!r}: only {num_experts} experts.")
        if tuple(w.shape) != (rows, param.shape[2]):
            raise ValueError(
                f"weight {match.group(0)!r} has shape {tuple(w.shape)}, "
                f"expected {(rows, param.shape[2])}."
            )
        parts = self.experts.setdefault(target, {})
        parts[(expert, shard % 2)] = w
        if len(parts) < num_experts * (1 if shard == 2 else 2):
            return
        del self.experts[target]
        self.loaded.add(target)
        module_name, attr = target.rsplit(".", 1)
        moe = self.model.get_submodule(module_name)
        quantized = [isinstance(part_w, QuantizedWeight) for part_w in parts.values()]
        if all(quantized):
            halves = 1 if shard == 2 else 2
            moe.set_quantized(
                attr,
                [QuantizedWeight.cat([parts[(e, h)] for h in range(halves)]) if halves > 1
                 else parts[(e, 0)] for e in range(num_experts)],
            )  # fmt: skip
            return
        data = torch.empty(param.shape, dtype=self.dtype)
        for (e, half), part_w in parts.items():
            if isinstance(part_w, QuantizedWeight):
                part_w = TORCH_OPS.dequantize(part_w, self.dtype)
            data[e, half * rows : (half + 1) * rows].copy_(part_w)
        setattr(moe, attr, nn.Parameter(data, requires_grad=False))
        self.experts_dequantized |= any(quantized)

    def _load(self, target: str, parts: list[Weight], names: list[str]) -> None:
        """Give parameter `target` its weight from `parts` (its shards, in order)."""
        module_name, attr = target.rsplit(".", 1)
        module = self.model.get_submodule(module_name)
        param = getattr(module, attr)
        shard = getattr(module, "shard", None)
        if shard is not None:  # this tensor-parallel rank's slice of each part
            parts = [shard.take(i, p, n) for i, (p, n) in enumerate(zip(parts, names, strict=True))]
        sizes = [param.shape[0]] if len(parts) == 1 else self._part_sizes(module, param.shape[0])
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
                module.set_quantized(weight, self.dtype)
                return
        # Gemma's norm weights and DeepSeek's router stay float32 (as HF computes them).
        dtype = torch.float32 if getattr(module, "keep_float32", False) else self.dtype
        data = torch.empty(param.shape, dtype=dtype)
        offset = 0
        for part in parts:
            if isinstance(part, QuantizedWeight):
                part = TORCH_OPS.dequantize(part, dtype)
            data[offset : offset + part.shape[0]].copy_(part)
            offset += part.shape[0]
        setattr(module, attr, nn.Parameter(data, requires_grad=False))

    def _part_sizes(self, module: nn.Module, rows: int) -> list[int]:
        """The parts of a fused weight of `rows` rows: q, k, v, or gate and up."""
        attn = self.attention_of.get(id(module))
        if attn is not None:
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [rows // 2] * 2  # a layer's MLP or a shared expert: each its own size

    def _finish_norms(self) -> None:
        """Gemma's norms hold 1 + w: add the one (Hugging Face folders store w; llama.cpp
        writes its files with the one added, and says so in the config we read)."""
        if self.model.config.get("gguf_norms_include_one"):
            return
        for module in self.model.modules():
            if isinstance(module, RMSNorm) and module.gemma and module.weight is not None:
                module.weight.data = 1.0 + module.weight.data

    def _tie(self) -> None:
        model = self.model
        embed = model.model.embed_tokens
        if model.lm_head is None:  # not the last pipeline stage
            return
        if model.tie_word_embeddings and embed is not None:
            if embed.qweight is not None:
                model.lm_head.set_quantized(embed.qweight)
            else:
                model.lm_head.weight = embed.weight
        elif "lm_head.weight" not in self.loaded:
            raise ValueError("checkpoint is missing weights: lm_head.weight")
