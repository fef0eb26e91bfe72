"""Finding a model, reading its config, weights, tokenizer and generation defaults.

Two sources: a Hugging Face folder (config.json, safetensors single or sharded,
tokenizer files, generation_config.json) or a GGUF file (dequantized at load
time; tokenizer and chat template from its metadata). Weights come out with
Hugging Face names, so one model file serves both.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from pagoda.model_executor.quantization import (
    BLOCK,
    GGUF_PLAIN_TYPES,
    QuantizedWeight,
    from_awq,
    from_gguf,
    from_gptq,
    quantize_per_channel,
)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "OlmoeForCausalLM",
    "LlavaForConditionalGeneration",
)
# A vision-language model's text half, by its config's model_type.
_TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# Weights that stay floats whatever the quantization: a vision encoder and its projector.
_FLOAT_ONLY = ("vision_tower.", "multi_modal_projector.")
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
}


def resolve_model(model: str | None) -> tuple[str, bool]:
    """(path, is_gguf) for a model name: None (the default), a folder or a .gguf file."""
    if model is None:
        from pagoda.model_executor.default_model import default_model_path

        return default_model_path(), True
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"model file {model!r} is not a .gguf file.")
        return model, True
    if os.path.isdir(model):
        if os.path.isfile(os.path.join(model, "config.json")):
            return model, False
        ggufs = sorted(f for f in os.listdir(model) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(model, ggufs[0]), True
        raise FileNotFoundError(f"model folder {model!r} has no config.json (nor one .gguf file).")
    raise FileNotFoundError(
        f"model {model!r} is not a local folder or .gguf file (pagoda does not download from a hub)."
    )


def check_architecture(hf_config: dict[str, Any], path: str) -> None:
    archs = hf_config.get("architectures") or []
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model {path!r}: architecture {archs or None} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )


def resolve_dtype(dtype: str, hf_config: dict[str, Any], device: str = "cpu") -> str:
    if dtype != "auto":
        return dtype
    if device == "cuda":  # bf16 from Ampere on, else fp16
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    # bf16 wherever the CPU computes it natively (AVX-512 BF16 / AMX), else fp32.
    return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


# ---- config ----------------------------------------------------------------------


def load_hf_config(path: str, is_gguf: bool) -> dict[str, Any]:
    if is_gguf:
        return _gguf_config(_gguf_reader(path))
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {config_path}: {e}") from e
    if "text_config" in config and "vision_config" in config:
        config = _flatten_vision_language(config)
    # transformers 5 writes rope settings as rope_parameters; older files as rope_theta/rope_scaling.
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    if config.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    return config


def _flatten_vision_language(config: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config as the rest of pagoda reads configs: the text model's
    keys at the top (vocab_size, hidden_size, ...), the architecture the whole model's,
    and the vision side under `vision_config` (with the projector's settings)."""
    text = dict(config["text_config"])
    model_type = text.get("model_type", "llama")
    if model_type not in _TEXT_ARCHITECTURES:
        raise ValueError(
            f"vision-language model: text model type {model_type!r} is not supported; "
            f"supported: {', '.join(_TEXT_ARCHITECTURES)}."
        )
    vision = dict(config["vision_config"])
    for key in (
        "vision_feature_layer",
        "vision_feature_select_strategy",
        "projector_hidden_act",
        "multimodal_projector_bias",
    ):
        if key in config:
            vision[key] = config[key]
    image_token_id = config.get("image_token_id", config.get("image_token_index"))
    if image_token_id is None:
        raise ValueError("vision-language config has no image_token_id (image_token_index).")
    return {
        **text,
        "architectures": config["architectures"],
        "text_architectures": [_TEXT_ARCHITECTURES[model_type]],
        "vision_config": vision,
        "image_token_id": int(image_token_id),
        "tie_word_embeddings": config.get(
            "tie_word_embeddings", text.get("tie_word_embeddings", False)
        ),
    }


def _gguf_reader(path: str):
    """A parse of the file (memory-mapped). Not kept: its metadata objects alone take
    about 150 MiB for a 49k-token vocabulary, so the config and the weights each parse
    and let go (about a second each)."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # the gguf package raises assorted errors on bad files
        raise ValueError(f"cannot read GGUF file {path!r}: {e}") from e


def _gguf_fields(reader) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(
            ("tokens", "token_type", "merges", "scores")
        ):
            continue  # large arrays the tokenizer loader reads itself
        try:
            out[key] = field.contents()
        except Exception:
            continue
    return out


def _gguf_config(reader) -> dict[str, Any]:
    meta = _gguf_fields(reader)
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        return {"architectures": [f"gguf:{arch}"]}

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    # Experts come stacked per layer. llama.cpp writes Mixtral as "llama" with experts.
    experts = {}
    if arch == "llama" and get("expert_count"):
        experts = {
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": int(get("expert_count")),
            "num_experts_per_tok": int(get("expert_used_count")),
        }
    elif arch == "qwen2moe":
        experts = {
            "num_experts": int(get("expert_count")),
            "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length", 0)),
            "norm_topk_prob": bool(get("expert_weights_norm", False)),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    return {
        "architectures": [_GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(
            get("attention.key_length") or get("rope.dimension_count") or hidden // num_heads
        ),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch in ("qwen2", "qwen2moe"),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        **experts,
    }


def load_generation_config(
    path: str, is_gguf: bool, hf_config: dict[str, Any]
) -> tuple[tuple[int, ...], dict[str, Any]]:
    """(EOS token ids, default sampling values) from generation_config.json or the config."""
    gen: dict[str, Any] = {}
    if not is_gguf:
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
    eos = gen.get("eos_token_id", hf_config.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p") if k in gen}
    if not gen.get("do_sample", True):
        defaults = {}
    return eos_ids, defaults


# ---- weights ---------------------------------------------------------------------


# --quantization for weights that come as floats: the format each is quantized to (a
# GGUF block type, by the gguf package's quantizer, or w8a8: int8 per channel).
QUANTIZE_AT_LOAD = {
    "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1",
    "int8": "Q8_0", "int4": "Q4_1", "w8a8": "w8a8",
}  # fmt: skip


def iter_weights(
    path: str,
    is_gguf: bool,
    hf_config: dict[str, Any],
    quantization: str = "none",
    keep_full_precision: Sequence[str] = (),
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face parameter name, weight) for every weight in the checkpoint.

    `quantization`: "none" gives float tensors only; "auto" keeps every block-quantized
    GGUF tensor quantized, as a `QuantizedWeight` (see `from_gguf`); a
    format name (int8 = q8_0, int4 = q4_1; w8a8: int8 per channel) quantizes the linear and embedding
    weights to it at load (a GGUF file's are dequantized first). Weights matching a `keep_full_precision` pattern (fnmatch
    on the module name, with or without "model.": "lm_head", "layers.0.*") stay floats.
    """
    if is_gguf:
        source = _iter_gguf_weights(path, hf_config, quantization == "auto", keep_full_precision)
    elif "quantization_config" in hf_config:
        source = _iter_int4_checkpoint(
            _iter_safetensors(path), hf_config["quantization_config"], quantization == "auto"
        )
    else:
        source = _iter_safetensors(path)
    if quantization not in QUANTIZE_AT_LOAD:
        yield from source
        return
    ggml_type = QUANTIZE_AT_LOAD[quantization]
    for name, w in source:
        if (
            isinstance(w, torch.Tensor)
            and w.dim() == 2
            and w.shape[1] % BLOCK == 0
            and not _kept(name, keep_full_precision)
            and not any(part in name for part in _FLOAT_ONLY)
        ):
            yield name, _quantize(w, ggml_type)
        else:
            yield name, w


_INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def _iter_int4_checkpoint(
    source: Iterator[tuple[str, torch.Tensor]], config: dict[str, Any], keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """A GPTQ or AWQ checkpoint's tensors with each linear's parts (qweight, qzeros,
    scales, g_idx) joined into its `weight`: kept as blocks, or dequantized to float32."""
    from pagoda.ops.torch_ops import dequantize

    method = config.get("quant_method")
    if method not in ("gptq", "awq"):
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported (gptq, awq)."
        )
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} with bits={bits} is not supported (4-bit only).")
    if method == "awq" and config.get("version", "gemm").lower() != "gemm":
        raise ValueError(f"AWQ version {config.get('version')!r} is not supported (gemm).")
    group_size = int(config.get("group_size", config.get("q_group_size", 128)))

    def join(module: str, parts: dict[str, torch.Tensor]) -> tuple[str, Any]:
        missing = [p for p in _INT4_PARTS[:3] if p not in parts]
        if missing:
            raise ValueError(f"{method} checkpoint: {module} lacks {', '.join(missing)}.")
        try:
            if method == "gptq":
                minus_one = config.get("checkpoint_format", "gptq") != "gptq_v2"
                weight = from_gptq(parts["qweight"], parts["qzeros"], parts["scales"],
                                   parts.get("g_idx"), group_size, minus_one)  # fmt: skip
            else:
                weight = from_awq(parts["qweight"], parts["qzeros"], parts["scales"], group_size)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"{method} checkpoint: {module}: {e}") from e
        return f"{module}.weight", weight if keep_quantized else dequantize(weight, torch.float32)

    pending: dict[str, dict[str, torch.Tensor]] = {}  # module -> its parts so far
    for name, tensor in source:
        module, _, part = name.rpartition(".")
        if part not in _INT4_PARTS:
            yield name, tensor
            continue
        for done in [m for m in pending if m != module]:  # a module's parts are adjacent
            yield join(done, pending.pop(done))
        pending.setdefault(module, {})[part] = tensor
    for module, parts in pending.items():
        yield join(module, parts)


def _kept(name: str, patterns: Sequence[str]) -> bool:
    module = name.rsplit(".", 1)[0]
    short = module.removeprefix("model.")
    return any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(short, p) for p in patterns)


def _quantize(w: torch.Tensor, ggml_type: str) -> QuantizedWeight:
    """A float weight in a GGUF block format, by the `gguf` package's own quantizer, or
    in int8 per channel (w8a8)."""
    if ggml_type == "w8a8":
        return quantize_per_channel(w)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    raw = quantize(w.float().numpy(), GGMLQuantizationType[ggml_type])
    return from_gguf(ggml_type, raw)


def _iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {folder!r} has no .safetensors weights.")
    for name in files:
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"weight file {file!r} (listed in the index) is missing.")
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield key, f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error type on a bad header
            raise ValueError(f"cannot read weight file {file!r}: {e}") from e


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # an MoE layer's router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# An MoE layer's experts, stacked [experts, rows, columns] in one tensor each.
_GGUF_EXPERT_NAMES = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face name (for stacked experts: with `{}` where the expert goes)."""
    stem, _, suffix = name.rpartition(".")  # suffix: weight | bias
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part in _GGUF_EXPERT_NAMES:
            return f"model.layers.{layer}.mlp.experts.{{}}.{_GGUF_EXPERT_NAMES[part]}.{suffix}"
        mapped = _GGUF_LAYER_NAMES.get(part)
        return f"model.layers.{layer}.{mapped}.{suffix}" if mapped else None
    mapped = _GGUF_TOP_NAMES.get(stem)
    return f"{mapped}.{suffix}" if mapped else None


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp stores Llama q/k rows interleaved per rotary pair; undo that.
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _iter_gguf_weights(
    path: str, hf_config: dict[str, Any], keep_quantized: bool, keep_full_precision: Sequence[str]
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    from gguf.quants import dequantize

    reader = _gguf_reader(path)
    is_llama = hf_config.get("model_type") == "llama"
    for tensor in reader.tensors:
        name = _gguf_to_hf_name(tensor.name)
        if name is None:
            continue  # e.g. rope_freqs, recomputed from the config
        rope_heads = None
        if is_llama and name.endswith(("q_proj.weight", "k_proj.weight")):
            rope_heads = hf_config[
                "num_attention_heads" if "q_proj" in name else "num_key_value_heads"
            ]
        stacked = "{}" in name  # experts: one weight each, as Hugging Face names them
        if (
            keep_quantized
            and tensor.tensor_type.name not in GGUF_PLAIN_TYPES
            and not _kept(name, keep_full_precision)
        ):
            try:
                if stacked:
                    for expert, data in enumerate(tensor.data):
                        yield name.format(expert), from_gguf(tensor.tensor_type.name, data)
                    continue
                weight = from_gguf(tensor.tensor_type.name, tensor.data)
            except (NotImplementedError, ValueError) as e:
                raise ValueError(
                    f"GGUF {path!r}: cannot read {tensor.name} ({tensor.tensor_type.name}): {e}"
                ) from e
            if rope_heads is not None:  # the same row order as the dequantized path
                order = _unpermute_rope(np.arange(weight.shape[0]), rope_heads)
                weight = weight.rows(torch.from_numpy(order))
            yield name, weight
            continue
        try:
            w = dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise ValueError(
                f"GGUF {path!r}: cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {e}"
            ) from e
        w = np.array(
            w.reshape(tuple(reversed(tensor.shape.tolist()))), dtype=np.float32
        )  # owned, writable
        if rope_heads is not None:
            w = _unpermute_rope(w, rope_heads)
        if stacked:
            for expert in range(w.shape[0]):
                yield name.format(expert), torch.from_numpy(w[expert])
            continue
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # llama.cpp keeps this one-row matrix as a vector
        yield name, torch.from_numpy(w)


# ---- tokenizer -------------------------------------------------------------------


def load_tokenizer(path: str, is_gguf: bool):
    from transformers import AutoTokenizer

    try:
        if not is_gguf:
            return AutoTokenizer.from_pretrained(path)
        # Converting a GGUF vocabulary takes seconds; keep the result in the cache folder.
        cached = _tokenizer_cache_dir(path)
        if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(cached)
        tokenizer = AutoTokenizer.from_pretrained(
            os.path.dirname(path) or ".", gguf_file=os.path.basename(path)
        )
        with contextlib.suppress(OSError):  # a read-only cache only costs time
            tokenizer.save_pretrained(cached)
        return tokenizer
    except Exception as e:
        raise ValueError(f"cannot load the tokenizer of {path!r}: {e}") from e


def _tokenizer_cache_dir(gguf_path: str) -> str:
    from pagoda import envs

    st = os.stat(gguf_path)
    key = hashlib.sha256(
        f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    return os.path.join(envs.cache_dir(), "tokenizers", key)
