"""PEFT LoRA adapters: checking one (from its config and its weight file's header) and
reading it.

An adapter is a folder as PEFT's `save_pretrained` writes it: `adapter_config.json`
and `adapter_model.safetensors` (or `adapter_model.bin`). pagoda serves adapters on
the decoder's linear layers, q/k/v/o_proj and gate/up/down_proj, in any subset and
any layers, with `lora_alpha` scaling (alpha / r, or alpha / sqrt(r) with rsLoRA),
PEFT's `rank_pattern` and `alpha_pattern` included. On mixture-of-experts models
(Mixtral, Qwen2/3-MoE, OLMoE) the attention takes adapters, and so do the MLPs of
the layers that are dense; the experts, the shared expert and the router do not
yet, and an adapter on them is refused by name. Anything that changes the math
beyond `W x + scaling * B A x` (DoRA, LoRA biases, trained base biases, modules to
save, embedding or lm_head adapters) is refused by name.

Every error is an `InvalidRequestError` naming the file and the field or weight.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.errors import InvalidRequestError
from pagoda.model_executor.models import is_moe_layer

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# Hugging Face module -> the block it sits in.
TARGET_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$"
)
# A LoRA weight inside a mixture-of-experts block: routed experts (Mixtral's
# block_sparse_moe.experts.N.w1, Qwen's mlp.experts.N.gate_proj), the shared expert, the
# router.
_MOE_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\."
    r"(?:experts\.\d+\.\w+|shared_experts?\.\w+|shared_expert_gate|gate)\.lora_[AB]\.weight$"
)
# PEFT config fields whose non-default values change the math pagoda runs.
_REFUSED = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA biases",
    "modules_to_save": "modules_to_save (full copies of modules)",
    "fan_in_fan_out": "fan_in_fan_out weights",
    "trainable_token_indices": "trainable token embeddings",
    "layer_replication": "layer replication",
    "use_qalora": "QA-LoRA",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    # (as PEFT 0.21 writes an MLP target of transformers 5's Mixtral, Qwen3-MoE, OLMoE)
    "target_parameters": "LoRA on parameters (target_parameters: e.g. fused experts)",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
}


def module_shapes(hf_config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Hugging Face module -> (in_features, out_features) for a Llama-family config."""
    hidden = hf_config["hidden_size"]
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    kv = (hf_config.get("num_key_value_heads") or heads) * head_dim
    inter = hf_config["intermediate_size"]
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


@dataclass(frozen=True)
class AdapterModule:
    """One adapted module: its weights' keys in the file and its scaling."""

    a_key: str
    b_key: str
    scaling: float


@dataclass
class LoRAAdapter:
    """An adapter's weights in float32: per (layer index, HF module), A [r, in] and
    B [out, r] with the scaling multiplied in."""

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _fail(path: str, what: str, param: str) -> None:
    raise InvalidRequestError(f"LoRA adapter {path}: {what}.", param)


def _pattern_value(patterns: dict[str, Any], module_key: str, default: Any) -> Any:
    """PEFT's rank_pattern/alpha_pattern lookup: the first key that matches the end of
    the module's name (`get_pattern_key`)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_key):
            return patterns[key]
    return default


def _read_config(path: str, param: str) -> dict[str, Any]:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        _fail(path, "no such folder", param)
    if not os.path.isfile(file):
        _fail(path, f"{CONFIG_FILE} is missing", param)
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        _fail(path, f"{CONFIG_FILE} is not readable JSON ({e})", param)
    if not isinstance(config, dict):
        _fail(path, f"{CONFIG_FILE} must hold a JSON object", param)
    return config


def _check_config(path: str, config: dict[str, Any], max_rank: int, param: str) -> None:
    def bad(field: str, why: str) -> None:
        _fail(path, f"{CONFIG_FILE}: {field} {why}", param)

    if config.get("peft_type", "LORA") != "LORA":
        bad("peft_type", f"is {config.get('peft_type')!r}; only 'LORA' adapters are served")
    for field, what in _REFUSED.items():
        if config.get(field):
            bad(field, f"is set: {what} is not supported")
    if config.get("bias", "none") != "none":
        bad("bias", f"is {config['bias']!r}: trained base biases are not supported (only 'none')")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        bad("r", f"must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        bad("lora_alpha", f"must be a number, got {alpha!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(field) or {}, dict):
            bad(field, "must be an object")
    ranks = [r, *(config.get("rank_pattern") or {}).values()]
    for rank in ranks:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            bad("rank_pattern", f"holds {rank!r}, not a positive integer")
    if max(ranks) > max_rank:
        bad("r", f"is {max(ranks)}, above this engine's max_lora_rank ({max_rank})")


def _weight_file(path: str, param: str) -> str:
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            return file
    _fail(path, f"no weight file ({' or '.join(WEIGHT_FILES)})", param)


def _read_state(file: str, path: str, param: str) -> dict[str, torch.Tensor]:
    try:
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(file)
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file
        _fail(path, f"{os.path.basename(file)} cannot be read ({e})", param)


def _header_shapes(file: str, path: str, param: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from a safetensors header (no tensor is read)."""
    from safetensors import safe_open

    try:
        with safe_open(file, "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as e:
        _fail(path, f"{os.path.basename(file)} cannot be read ({e})", param)


def _checked_config(path: str, max_rank: int, param: str) -> tuple[dict[str, Any], str]:
    """(the adapter's config, checked; its weight file)."""
    config = _read_config(path, param)
    _check_config(path, config, max_rank, param)
    return config, _weight_file(path, param)


def check_adapter(
    path: str, hf_config: dict[str, Any], max_rank: int, param: str = "lora_request"
) -> None:
    """Check an adapter folder against the model and `max_rank` without reading its
    tensors: its config and, for safetensors, its weights' names and shapes from the
    header (an `adapter_model.bin` is checked when it is read). Raises
    InvalidRequestError, with `param`, naming the file and the field or weight at
    fault."""
    config, file = _checked_config(path, max_rank, param)
    if file.endswith(".safetensors"):
        _modules(path, config, file, _header_shapes(file, path, param), hf_config, param)


def _modules(
    path: str,
    config: dict[str, Any],
    file: str,
    shapes: dict[str, tuple[int, ...]],
    hf_config: dict[str, Any],
    param: str,
) -> dict[tuple[int, str], AdapterModule]:
    """(layer index, HF module) -> what is adapted there, from the weights' names and
    shapes."""
    fname = os.path.basename(file)
    expected = module_shapes(hf_config)
    num_layers = hf_config["num_hidden_layers"]
    keys: dict[tuple[int, str], dict[str, str]] = {}
    for key in shapes:
        match = _KEY.match(key)
        moe_match = _MOE_KEY.match(key) or (match if match and match[2] == "mlp" else None)
        if moe_match and is_moe_layer(hf_config, int(moe_match[1])):
            _fail(
                path,
                f"{fname}: weight {key!r} is in a mixture-of-experts layer's MLP (its "
                "experts, shared expert or router); LoRA there is not supported yet "
                "(q/k/v/o_proj and dense layers' gate/up/down_proj are)",
                param,
            )
        if match is None or TARGET_MODULES.get(match[3]) != match[2]:
            _fail(
                path,
                f"{fname}: weight {key!r} is not a LoRA weight of a decoder layer's "
                f"{'/'.join(TARGET_MODULES)} (the only ones pagoda serves)",
                param,
            )
        layer = int(match[1])
        if layer >= num_layers:
            _fail(
                path,
                f"{fname}: weight {key!r} is for layer {layer}; the model has {num_layers}",
                param,
            )
        keys.setdefault((layer, match[3]), {})[match[4]] = key
    if not keys:
        _fail(path, f"{fname} holds no LoRA weights", param)
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    modules = {}
    for (layer, module), ab in sorted(keys.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            _fail(path, f"{fname}: layer {layer} {module} has no {missing} weight", param)
        module_key = f"model.layers.{layer}.{TARGET_MODULES[module]}.{module}"
        rank = _pattern_value(config.get("rank_pattern") or {}, module_key, r)
        in_features, out_features = expected[module]
        for part, want in (("A", (rank, in_features)), ("B", (out_features, rank))):
            if shapes[ab[part]] != want:
                _fail(
                    path,
                    f"{fname}: weight {ab[part]!r} has shape {list(shapes[ab[part]])}, expected "
                    f"{list(want)} (rank {rank} from {CONFIG_FILE}; this model's {module} is "
                    f"{in_features} -> {out_features})",
                    param,
                )
        module_alpha = _pattern_value(config.get("alpha_pattern") or {}, module_key, alpha)
        scaling = module_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        modules[(layer, module)] = AdapterModule(ab["A"], ab["B"], float(scaling))
    return modules


def load_adapter(
    path: str, hf_config: dict[str, Any], max_rank: int, param: str = "lora_request"
) -> LoRAAdapter:
    """Check an adapter as `check_adapter` does and read its weights in float32, the
    scaling multiplied into B (and every weight finite)."""
    config, file = _checked_config(path, max_rank, param)
    state = _read_state(file, path, param)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    weights = {}
    for where, m in _modules(path, config, file, shapes, hf_config, param).items():
        a = state[m.a_key].to(torch.float32).contiguous()
        b = (state[m.b_key].to(torch.float32) * m.scaling).contiguous()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            _fail(path, f"weights of layer {where[0]} {where[1]} are not all finite", param)
        weights[where] = (a, b)
    return LoRAAdapter(weights)
