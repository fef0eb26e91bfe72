"""Finding a model, reading its config, weights, tokenizer and generation defaults.

Two sources: a Hugging Face folder (config.json, safetensors single or sharded,
tokenizer files, generation_config.json) or a GGUF file (dequantized at load
time; tokenizer and chat template from its metadata). Weights come out with
Hugging Face names, so one model file serves both.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from pagoda.model_executor.gguf_loader import gguf_config, gguf_reader, iter_gguf_weights
from pagoda.model_executor.models import ARCHITECTURES
from pagoda.model_executor.quantization import (
    BLOCK,
    QuantizedWeight,
    from_awq,
    from_gguf,
    from_gptq,
    quantize_per_channel,
)

# A vision-language model's text half, by its config's model_type.
_TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# Weights that stay floats whatever the quantization: a vision encoder and its projector.
_FLOAT_ONLY = ("vision_tower.", "multi_modal_projector.")


def check_architecture(hf_config: dict[str, Any], path: str) -> None:
    archs = hf_config.get("architectures") or []
    if not archs or archs[0] not in ARCHITECTURES:
        raise ValueError(
            f"model {path!r}: architecture {archs or None} is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}."
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
        return gguf_config(gguf_reader(path))
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {config_path}: {e}") from e
    config = _normalized(config)
    archs = config.get("architectures") or []
    if archs and archs[0] in _TEXT_HALF_OF:
        return _text_half(config)
    if "text_config" in config and "vision_config" in config:
        config = _flatten_vision_language(config)
    return config


# Checkpoints whose text model pagoda serves alone (their vision tower is not loaded).
_TEXT_HALF_OF = ("Gemma3ForConditionalGeneration",)


def _normalized(config: dict[str, Any]) -> dict[str, Any]:
    """The config as transformers 5 reads it (its config class fills what older files
    leave out: rope_parameters, layer_types from a sliding-window pattern, SmolLM3's
    no_rope_layers, ...), so every family reads one form. A model type transformers
    does not know stays as written (and is refused by architecture later)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    model_type = config.get("model_type")
    if not model_type:
        return config
    if model_type == "nomic_bert":  # Nomic's original spelling, as transformers names it
        from pagoda.model_executor.models.nomic_bert import native_config

        config = native_config(config)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notes on old-style fields are not ours to show
    try:
        fields = {k: v for k, v in config.items() if k != "model_type"}
        return {**config, **AutoConfig.for_model(model_type, **fields).to_dict()}
    except (ValueError, KeyError, TypeError):
        return config
    finally:
        hf_logging.set_verbosity(verbosity)


def _text_half(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's text model (Gemma 3 4B and up): its text_config's keys
    at the top, the architecture the whole checkpoint's."""
    text = dict(config.get("text_config") or {})
    return {
        **text,
        "architectures": config["architectures"],
        "tie_word_embeddings": config.get(
            "tie_word_embeddings", text.get("tie_word_embeddings", True)
        ),
        "eos_token_id": config.get("eos_token_id", text.get("eos_token_id")),
        "bos_token_id": config.get("bos_token_id", text.get("bos_token_id")),
    }


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
        source = iter_gguf_weights(
            path, hf_config, quantization == "auto", lambda n: _kept(n, keep_full_precision)
        )
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
