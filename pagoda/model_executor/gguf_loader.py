"""GGUF files as llama.cpp's converter writes them: their metadata read back into a
Hugging Face-style config, their tensors back under Hugging Face names, in HF's row
order (quantized blocks kept as blocks), so one model file serves both sources.

What the converter changed, and is undone here, by architecture:
- llama, granite, smollm3: q/k rows permuted for llama.cpp's interleaved rope;
- gemma2, gemma3: 1 added to every norm weight (the config says so: the Gemma family
  then uses them as they are), and no query_pre_attn_scalar, window pattern or
  local rope base in HF's form (llama.cpp's runtime rules, rebuilt here);
- phi3: q/k/v and gate/up kept fused (the loader takes them apart);
- deepseek2: kv_b_proj split into k_b (transposed) and v_b; MLA's sizes under
  *_mla keys; the key/value heads written as 1;
- qwen3 rerankers: the LM head cut to two rows, "yes" then "no" (see _reranker);
- bert, nomic-bert: see gguf_bert.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagoda.model_executor.gguf_bert import bert_config, bert_name
from pagoda.model_executor.gguf_file import GGUFFile
from pagoda.model_executor.quantization import GGUF_PLAIN_TYPES, QuantizedWeight, from_gguf


def gguf_reader(path: str) -> GGUFFile:
    """A parse of the file's header, its tensors mapped. Not kept: the config and the
    weights each read it (a fraction of a second even for a large vocabulary)."""
    try:
        return GGUFFile(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read GGUF file {path!r}: {e}") from e


_TOKENIZER_ARRAYS = ("tokens", "token_type", "merges", "scores")


def _fields(reader: GGUFFile) -> dict[str, Any]:
    return {  # less the vocabulary's large arrays, which the tokenizer loader reads itself
        key: value
        for key, value in reader.fields.items()
        if not (key.startswith("tokenizer.ggml.") and key.endswith(_TOKENIZER_ARRAYS))
    }


# ---- names --------------------------------------------------------------------------

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's (and --fuse-qkv's): taken apart at load
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # an MoE layer's router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma's four norms a layer (llama.cpp's ffn_norm is its pre_feedforward_layernorm).
_GEMMA_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_DEEPSEEK_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # files from before llama.cpp split it
    "attn_k_b": "self_attn.k_b",  # joined with v_b into kv_b_proj (see _join_kv_b)
    "attn_v_b": "self_attn.v_b",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",  # (written with a .bias suffix)
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# An MoE layer's experts, stacked [experts, rows, columns] in one tensor each.
_EXPERT_NAMES = {
    "ffn_gate_exps": "w1",
    "ffn_up_exps": "w3",
    "ffn_down_exps": "w2",
    "ffn_gate_up_exps": "gate_up",  # --fuse-gate-up-exps: gate then up, per expert
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_TOP_NAMES["cls.output"] = "score"  # a reranker's head (see _reranker)


@dataclass(frozen=True)
class _Arch:
    """What one `general.architecture` needs beyond the common keys."""

    architecture: str  # Hugging Face's
    config: Callable[[_Meta], dict[str, Any]] = lambda meta: {}
    names: dict[str, str] = field(default_factory=dict)  # block names that differ
    permuted_qk: bool = False  # q/k rows interleaved for llama.cpp's rope
    qkv_bias: bool = False
    fused_gate_up: bool = False  # ffn_up holds gate and up (Phi-3)


class _Meta:
    """A file's metadata, read under its architecture's prefix."""

    def __init__(self, reader) -> None:
        self.fields = _fields(reader)
        self.arch = self.fields.get("general.architecture")
        self.tensors = {t.name: t for t in reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.arch}.{key}", default)

    def tensor(self, name: str) -> np.ndarray | None:
        t = self.tensors.get(name)
        return None if t is None else np.asarray(t.data, dtype=np.float32).reshape(-1)


def _moe(meta: _Meta, norm: bool | None = None) -> dict[str, Any]:
    if not meta.get("expert_count"):
        return {}
    return {
        "num_experts": int(meta.get("expert_count")),
        "num_experts_per_tok": int(meta.get("expert_used_count")),
        "moe_intermediate_size": int(meta.get("expert_feed_forward_length", 0)),
        "shared_expert_intermediate_size": int(meta.get("expert_shared_feed_forward_length", 0)),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", False)) if norm is None else norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _llama(meta: _Meta) -> dict[str, Any]:
    if not meta.get("expert_count"):  # llama.cpp writes Mixtral as "llama" with experts
        return {}
    return {
        "architectures": ["MixtralForCausalLM"],
        "num_local_experts": int(meta.get("expert_count")),
        "num_experts_per_tok": int(meta.get("expert_used_count")),
    }


def _gemma(meta: _Meta, every: int, default_base: float, big_layers: int) -> dict[str, Any]:
    """llama.cpp's Gemma rules: layer i is local unless (i + 1) % every == 0; the
    softmax scale is 1/sqrt(hidden / heads) for the 27B model (`big_layers` layers),
    else 1/sqrt(head_dim); local layers take rope.freq_base_swa, unscaled."""
    layers, heads = int(meta.get("block_count")), int(meta.get("attention.head_count"))
    hidden = int(meta.get("embedding_length"))
    head_dim = int(meta.get("attention.key_length") or hidden // heads)
    window = int(meta.get("attention.sliding_window", 4096 if meta.arch == "gemma2" else 0) or 0)
    local = [window > 0 and (i + 1) % every != 0 for i in range(layers)]
    full_rope = {
        "rope_type": "default",
        "rope_theta": float(meta.get("rope.freq_base", default_base)),
    }
    if meta.get("rope.scaling.type") == "linear" and meta.get("rope.scaling.factor"):
        full_rope.update(rope_type="linear", factor=float(meta.get("rope.scaling.factor")))
    local_base = float(meta.get("rope.freq_base_swa", 10000.0))  # llama.cpp's default
    out = {
        "head_dim": head_dim,
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in local],
        "query_pre_attn_scalar": hidden // heads if layers == big_layers else head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "gguf_norms_include_one": True,
        "final_logit_softcapping": meta.get("final_logit_softcapping"),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": local_base},
            "full_attention": full_rope,
        },
    }
    if meta.arch == "gemma2":  # llama.cpp's defaults when the keys are absent
        out["attn_logit_softcapping"] = float(meta.get("attn_logit_softcapping", 50.0))
        out["final_logit_softcapping"] = float(meta.get("final_logit_softcapping", 30.0))
        out["rope_parameters"] = full_rope
    return out


def _phi3(meta: _Meta) -> dict[str, Any]:
    heads, hidden = int(meta.get("attention.head_count")), int(meta.get("embedding_length"))
    head_dim = hidden // heads
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
        "partial_rotary_factor": int(meta.get("rope.dimension_count", head_dim)) / head_dim,
    }
    long, short = meta.tensor("rope_factors_long.weight"), meta.tensor("rope_factors_short.weight")
    if long is not None and short is not None:
        rope.update(
            rope_type="longrope",
            long_factor=long.tolist(),
            short_factor=short.tolist(),
            attention_factor=float(meta.get("rope.scaling.attn_factor", 1.0)),
        )
    window = int(meta.get("attention.sliding_window") or 0)
    return {
        "head_dim": head_dim,
        "original_max_position_embeddings": int(
            meta.get("rope.scaling.original_context_length") or meta.get("context_length")
        ),
        "rope_parameters": rope,
        "sliding_window": window or None,
    }


def _granite(meta: _Meta) -> dict[str, Any]:
    head_dim = int(meta.get("embedding_length")) // int(meta.get("attention.head_count"))
    return {
        "attention_multiplier": float(meta.get("attention.scale", 0.0)) or head_dim**-0.5,
        "embedding_multiplier": float(meta.get("embedding_scale", 1.0)),
        "residual_multiplier": float(meta.get("residual_scale", 1.0)),
        "logits_scaling": float(meta.get("logit_scale", 1.0)),
    }


def _deepseek2(meta: _Meta) -> dict[str, Any]:
    heads = int(meta.get("attention.head_count"))
    rope_dim = int(meta.get("rope.dimension_count"))
    key_length = int(meta.get("attention.key_length_mla") or meta.get("attention.key_length"))
    value_length = int(meta.get("attention.value_length_mla") or meta.get("attention.value_length"))
    sigmoid = int(meta.get("expert_gating_func", 1)) == 2 or any(
        name.endswith("exp_probs_b.bias") for name in meta.tensors
    )
    groups = int(meta.get("expert_group_count", 1) or 1)
    topk = "group_limited_greedy" if groups > 1 else "greedy"
    out = {
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "num_key_value_heads": heads,
        "head_dim": rope_dim,
        "q_lora_rank": meta.get("attention.q_lora_rank"),
        "kv_lora_rank": int(meta.get("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": key_length - rope_dim,
        "v_head_dim": value_length,
        "n_routed_experts": int(meta.get("expert_count", 0)),
        "num_experts_per_tok": int(meta.get("expert_used_count", 0)) or None,
        "moe_intermediate_size": int(meta.get("expert_feed_forward_length", 0)),
        "n_shared_experts": int(meta.get("expert_shared_count", 0)),
        "routed_scaling_factor": float(meta.get("expert_weights_scale", 1.0) or 1.0),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", False)),
        "first_k_dense_replace": int(meta.get("leading_dense_block_count", 0)),
        "n_group": groups,
        "topk_group": int(meta.get("expert_group_used_count", 1) or 1),
        "scoring_func": "sigmoid" if sigmoid else "softmax",
        "topk_method": "noaux_tc" if sigmoid else topk,
        "rope_interleave": True,
    }
    if meta.get("rope.scaling.type") == "yarn":
        mscale = float(meta.get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        out["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
            "factor": float(meta.get("rope.scaling.factor")),
            "original_max_position_embeddings": int(
                meta.get("rope.scaling.original_context_length")
            ),
            "beta_fast": float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta.get("rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": mscale,
            "mscale_all_dim": mscale,
        }
    return out


_ARCHS = {
    "llama": _Arch("LlamaForCausalLM", _llama, permuted_qk=True),
    "qwen2": _Arch("Qwen2ForCausalLM", qkv_bias=True),
    "qwen2moe": _Arch("Qwen2MoeForCausalLM", _moe, qkv_bias=True),
    "qwen3": _Arch("Qwen3ForCausalLM"),
    # llama.cpp always renormalizes Qwen3-MoE's top-k (the released models' norm_topk_prob).
    "qwen3moe": _Arch("Qwen3MoeForCausalLM", lambda m: _moe(m, norm=True)),
    "gemma2": _Arch("Gemma2ForCausalLM", lambda m: _gemma(m, 2, 10000.0, 46), _GEMMA_NAMES),
    "gemma3": _Arch("Gemma3ForCausalLM", lambda m: _gemma(m, 6, 1000000.0, 62), _GEMMA_NAMES),
    "phi3": _Arch("Phi3ForCausalLM", _phi3, {"ffn_up": "mlp.gate_up_proj"}),
    "granite": _Arch("GraniteForCausalLM", _granite, permuted_qk=True),
    "smollm3": _Arch(
        "SmolLM3ForCausalLM", lambda m: {"no_rope_layer_interval": 4}, permuted_qk=True
    ),
    "deepseek2": _Arch("DeepseekV2ForCausalLM", _deepseek2, _DEEPSEEK_NAMES),
}


def gguf_config(reader) -> dict[str, Any]:
    """The file's hyperparameters as a Hugging Face config. An architecture pagoda
    does not read comes back as "gguf:<name>" (refused by the caller, by name)."""
    meta = _Meta(reader)
    if meta.arch in ("bert", "nomic-bert"):
        return bert_config(meta)
    arch = _ARCHS.get(meta.arch)
    if arch is None:
        return {"architectures": [f"gguf:{meta.arch}"]}
    num_heads = int(meta.get("attention.head_count"))
    hidden = int(meta.get("embedding_length"))
    embed = meta.tensors.get("token_embd.weight")
    vocab = meta.get("vocab_size") or (
        int(embed.shape[-1]) if embed is not None else len(reader.fields["tokenizer.ggml.tokens"])
    )
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
    }
    freqs = meta.tensor("rope_freqs.weight")  # llama3 scaling, as per-frequency divisors
    if freqs is not None:
        rope["freq_factors"] = freqs.tolist()
    scaling = meta.get("rope.scaling.type")
    if scaling in ("linear", "yarn") and meta.get("rope.scaling.factor"):
        rope.update(rope_type=scaling, factor=float(meta.get("rope.scaling.factor")))
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = int(
                meta.get("rope.scaling.original_context_length") or meta.get("context_length")
            )
    config = {
        "architectures": [arch.architecture],
        "model_type": meta.arch,
        "hidden_size": hidden,
        "intermediate_size": int(meta.get("feed_forward_length", 0)),
        "num_hidden_layers": int(meta.get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get("attention.head_count_kv", num_heads)),
        "head_dim": int(
            meta.get("attention.key_length")
            or meta.get("rope.dimension_count")
            or hidden // num_heads
        ),
        "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": rope,
        "max_position_embeddings": int(meta.get("context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in meta.tensors,
        "attention_bias": arch.qkv_bias,
        "bos_token_id": meta.fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.fields.get("tokenizer.ggml.eos_token_id"),
    }
    config.update(arch.config(meta))
    if "cls.output.weight" in meta.tensors:
        config.update(_reranker(meta))
    return config


def _reranker(meta: _Meta) -> dict[str, Any]:
    """Qwen3-Reranker as llama.cpp's converter writes it (the LM head cut to the rows of
    "yes" and "no", and a template for the pairs), as Qwen3ForSequenceClassification with
    the rows swapped: a pair's score, label 1's probability, is P("yes") as in llama.cpp."""
    if meta.arch != "qwen3" or meta.get("classifier.output_labels") != ["yes", "no"]:
        return {"architectures": [f"gguf:{meta.arch} with a classifier head (cls.output)"]}
    return {
        "architectures": ["Qwen3ForSequenceClassification"],
        "id2label": {0: "no", 1: "yes"},
        "rerank_template": meta.fields.get("tokenizer.chat_template.rerank"),
    }


def _hf_name(name: str, arch: _Arch) -> str | None:
    """The Hugging Face name (for stacked experts: with `{}` where the expert goes)."""
    stem, _, suffix = name.rpartition(".")  # suffix: weight | bias
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part in _EXPERT_NAMES:
            return f"model.layers.{layer}.mlp.experts.{{}}.{_EXPERT_NAMES[part]}.{suffix}"
        mapped = arch.names.get(part) or _LAYER_NAMES.get(part)
        if mapped is None:
            return None
        if mapped.endswith("_bias"):  # a parameter whose name is its whole role
            return f"model.layers.{layer}.{mapped}"
        return f"model.layers.{layer}.{mapped}.{suffix}"
    mapped = _TOP_NAMES.get(stem)
    return f"{mapped}.{suffix}" if mapped else None


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp stores Llama's q/k rows interleaved per rotary pair; undo that.
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_order(name: str, hf_config: dict[str, Any]) -> np.ndarray | None:
    """HF's row order of a q, k or fused q/k/v weight (or bias) that llama.cpp's
    converter permuted for its rope (q and k permuted before --fuse-qkv fuses them)."""
    if not name.endswith((".weight", ".bias")):
        return None
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    q, k = np.arange(heads * head_dim), np.arange(kv_heads * head_dim)
    part = name.rsplit(".", 2)[-2]
    if part == "q_proj":
        return _unpermute_rope(q, heads)
    if part == "k_proj":
        return _unpermute_rope(k, kv_heads)
    if part == "qkv_proj":
        v = np.arange(kv_heads * head_dim)
        return np.concatenate(
            [_unpermute_rope(q, heads), len(q) + _unpermute_rope(k, kv_heads), len(q) + len(k) + v]
        )
    return None


def iter_gguf_weights(
    path: str,
    hf_config: dict[str, Any],
    keep_quantized: bool,
    kept: Callable[[str], bool],
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face name, weight) for every tensor of the file: block-quantized ones
    kept as blocks where `keep_quantized` and not `kept(name)` (a full-precision
    pattern), the rest dequantized to float32."""
    from gguf.quants import dequantize

    reader = gguf_reader(path)
    model_type = hf_config["model_type"]
    encoder = model_type in ("bert", "roberta", "xlm-roberta", "nomic_bert")
    arch = None if encoder else _ARCHS[model_type]  # (encoders': bert_name)
    k_b: dict[str, np.ndarray] = {}  # DeepSeek's k_b, until its v_b comes
    for tensor in reader.tensors:
        name = (
            bert_name(tensor.name, model_type == "nomic_bert")
            if encoder
            else _hf_name(tensor.name, arch)
        )
        if name is None:
            continue  # rope_freqs, rope_factors_*: read into the config
        order = _rope_order(name, hf_config) if arch and arch.permuted_qk else None
        if name == "score.weight":
            order = np.array([1, 0])  # llama.cpp's [yes, no] as [no, yes] (see _reranker)
        stacked = "{}" in name  # experts: one weight each, as Hugging Face names them
        joined = name.endswith((".k_b.weight", ".v_b.weight"))
        if (
            keep_quantized
            and not joined
            and tensor.tensor_type.name not in GGUF_PLAIN_TYPES
            and not kept(name)
        ):
            try:
                if stacked:
                    for expert, data in enumerate(tensor.data):
                        yield from _expert(name, expert, from_gguf(tensor.tensor_type.name, data))
                    continue
                weight = from_gguf(tensor.tensor_type.name, tensor.data)
            except (NotImplementedError, ValueError) as e:
                raise ValueError(
                    f"GGUF {path!r}: cannot read {tensor.name} ({tensor.tensor_type.name}): {e}"
                ) from e
            if order is not None:  # the same row order as the dequantized path
                weight = weight.rows(torch.from_numpy(order))
            yield name, weight
            continue
        try:
            w = dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise ValueError(
                f"GGUF {path!r}: cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {e}"
            ) from e
        w = np.array(w.reshape(tuple(reversed(tensor.shape))), dtype=np.float32)  # owned, writable
        if order is not None:
            w = w[order]
        if stacked:
            for expert in range(w.shape[0]):
                yield from _expert(name, expert, torch.from_numpy(w[expert]))
            continue
        if joined:
            layer = name.rsplit(".", 2)[0]
            if name.endswith(".k_b.weight"):
                k_b[layer] = w
                continue
            yield f"{layer}.kv_b_proj.weight", torch.from_numpy(_join_kv_b(k_b.pop(layer), w))
            continue
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # llama.cpp keeps this one-row matrix as a vector
        yield name, torch.from_numpy(w)


def _expert(name: str, expert: int, w):
    """One expert's weight under HF's name; a fused gate/up as its two halves."""
    if not name.endswith(".gate_up.weight"):
        yield name.format(expert), w
        return
    rows = w.shape[0] // 2
    halves = (slice(0, rows), slice(rows, 2 * rows))
    for part, half in zip(("w1", "w3"), halves, strict=True):
        piece = w.rows(half) if isinstance(w, QuantizedWeight) else w[half]
        yield name.replace(".gate_up.", f".{part}.").format(expert), piece


def _join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """DeepSeek's kv_b_proj [heads * (nope + v), kv_lora] from llama.cpp's k_b [heads,
    kv_lora, nope] and v_b [heads, v, kv_lora]."""
    heads, kv_lora, _ = k_b.shape
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, kv_lora)
