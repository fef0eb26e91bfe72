"""A prompt's hidden states -> what a pooling request returns: an embedding (pooled over
its tokens, through sentence-transformers' Dense layers, maybe unit length and cut to
its first dimensions), or a classifier's class probabilities or score."""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from pagoda.model_executor.tasks import PoolerConfig
from pagoda.pooling_params import PoolingParams

# sentence-transformers' Dense activations, by their class path's last part
_ACTIVATIONS = {
    "Identity": lambda x: x,
    "Tanh": torch.tanh,
    "ReLU": F.relu,
    "GELU": F.gelu,
    "Sigmoid": torch.sigmoid,
}


class Pooler:
    def __init__(self, config: PoolerConfig, dtype: torch.dtype) -> None:
        self.method = config.method
        self.normalize = config.normalize
        self.dense = [_load_dense(folder, dtype) for folder in config.dense]

    def embed(self, rows: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """rows: [tokens, hidden] of one prompt -> its embedding [dimension] (float32)."""
        pooled = {"mean": lambda: rows.mean(0), "cls": lambda: rows[0], "last": lambda: rows[-1]}
        v = pooled[self.method]()
        for weight, bias, activation in self.dense:
            v = activation(F.linear(v, weight, bias))
        v = v.float()
        if params.dimensions is not None:  # Matryoshka: the first dimensions hold most
            v = v[: params.dimensions]
        normalize = self.normalize if params.normalize is None else params.normalize
        return F.normalize(v, dim=-1) if normalize else v


def classifier_output(logits: torch.Tensor, task: str) -> torch.Tensor:
    """A classifier's logits [labels] -> "classify": the labels' probabilities; "score": a
    relevance in (0, 1) (one label: its sigmoid, as sentence-transformers' CrossEncoder
    gives it; more: the probability of label 1)."""
    logits = logits.float()
    if task == "classify":
        return logits.softmax(-1)
    score = torch.sigmoid(logits[0]) if logits.shape[-1] == 1 else logits.softmax(-1)[1]
    return score.reshape(1)


def _load_dense(folder: str, dtype: torch.dtype):
    """A sentence-transformers Dense module: (weight, bias or None, activation)."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    name = config.get("activation_function", "torch.nn.modules.linear.Identity").rsplit(".", 1)[-1]
    if name not in _ACTIVATIONS:
        raise ValueError(f"{folder}: activation {name!r} is not supported ({', '.join(_ACTIVATIONS)}).")  # fmt: skip
    path = os.path.join(folder, "model.safetensors")
    if os.path.isfile(path):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=True)
    bias = state.get("linear.bias")
    return (
        state["linear.weight"].to(dtype),
        None if bias is None else bias.to(dtype),
        _ACTIVATIONS[name],
    )
