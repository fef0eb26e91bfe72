"""What a model serves (its tasks: generate, embed, classify, score) and how it pools its
hidden states into an embedding. Torch-free: the config layer and the front door read it.

A decoder generates, and with `task="embed"` (or a sentence-transformers folder, as
Qwen3-Embedding's is) embeds too, in the same engine: last-token pooling by default.
An encoder (BERT, XLM-RoBERTa) embeds; one with a classifier head (a cross-encoder)
classifies and scores text pairs. A model that embeds also scores pairs: the cosine
of their embeddings.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from pagoda.model_executor.models import BASE_MODEL, BIDIRECTIONAL, CLASSIFIER, needs

TASKS = ("auto", "generate", "embed", "classify", "score")

# sentence-transformers' pooling modes (as named now, and by their old flags) -> ours
_POOLING_MODES = {
    "cls": "cls",
    "cls_token": "cls",
    "mean": "mean",
    "mean_tokens": "mean",
    "lasttoken": "last",
}


def resolve_tasks(task: str, architecture: str, path: str, is_gguf: bool) -> frozenset[str]:
    """The tasks an engine on this model serves, given the `task` asked for ("auto": the
    model's own). Raises ValueError naming `task` for one the model cannot serve."""
    model_needs = needs(architecture)
    if CLASSIFIER in model_needs:
        natural = {"classify", "score"}
    elif model_needs & {BIDIRECTIONAL, BASE_MODEL}:
        natural = {"embed", "score"}
    elif not is_gguf and _modules(path):  # a decoder saved as a sentence-transformers model
        natural = {"generate", "embed", "score"}
    else:
        natural = {"generate"}
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}.")
    if task == "auto" or task in natural:
        return frozenset(natural)
    if task in ("embed", "score") and "generate" in natural:  # a decoder, pooled
        return frozenset({"generate", "embed", "score"})
    raise ValueError(
        f"task {task!r}: {architecture} serves {', '.join(sorted(natural))}, not {task}."
    )


@dataclass(frozen=True)
class PoolerConfig:
    """How hidden states become an embedding: `method` ("mean", "cls" or "last") over a
    prompt's tokens, then the `dense` layers (sentence-transformers Dense folders, in
    order), then unit length if `normalize`. `dimension`: the embedding's size."""

    method: str
    normalize: bool
    dense: tuple[str, ...]
    dimension: int


def pooler_config(path: str, is_gguf: bool, hf_config: dict[str, Any]) -> PoolerConfig:
    """From a sentence-transformers folder's modules.json where there is one, else the
    family's default: an encoder's CLS token, a decoder's last token; normalized."""
    method = "cls" if BIDIRECTIONAL in needs(hf_config["architectures"][0]) else "last"
    method = hf_config.get("pooling_method", method)  # a GGUF file's pooling_type
    dimension = int(hf_config["hidden_size"])
    modules = [] if is_gguf else _modules(path)
    if not modules:
        return PoolerConfig(method, True, (), dimension)
    normalize, dense = False, []
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        folder = os.path.join(path, module.get("path", ""))
        if kind == "Pooling":
            method = _pooling_method(folder)
        elif kind == "Dense":
            config = _read_json(os.path.join(folder, "config.json"))
            dense.append(folder)
            dimension = int(config["out_features"])
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ValueError(f"{path}: sentence-transformers module {kind!r} is not supported.")
    return PoolerConfig(method, normalize, tuple(dense), dimension)


def _pooling_method(folder: str) -> str:
    """A Pooling module's mode: sentence-transformers 5+ write `"pooling_mode": "mean"`,
    earlier versions one flag per mode (`pooling_mode_mean_tokens`)."""
    config = _read_json(os.path.join(folder, "config.json"))
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [key.removeprefix("pooling_mode_") for key, on in config.items()
                 if key.startswith("pooling_mode_") and on]  # fmt: skip
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or _POOLING_MODES.get(modes[0]) is None:
        raise ValueError(f"{folder}: pooling {modes} is not supported (cls, mean, lasttoken).")
    return _POOLING_MODES[modes[0]]


def _modules(path: str) -> list[dict]:
    modules = os.path.join(path, "modules.json")
    return _read_json(modules) if os.path.isfile(modules) else []


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
