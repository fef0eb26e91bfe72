"""A decoder layer's gated MLP: act(x W_gate) * (x W_up), then W_down.

gate and up are one fused product. Tensor parallel: this rank's columns of the
intermediate (cut at blocks of 32, so quantized weights split whole): its rows of
gate/up, down_proj on them (row parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed import SINGLE, ParallelContext, split_range
from pagoda.model_executor.layers.linear import Linear, Shard
from pagoda.model_executor.quantization import BLOCK
from pagoda.ops import Ops

# Hugging Face's activation names -> the gate's function (and its C++ decode loop code).
# name -> (the function, its name in the C++ decode loop's Activation enum)
ACTIVATIONS = {
    "silu": (F.silu, "silu"),
    "swish": (F.silu, "silu"),
    "gelu_pytorch_tanh": (lambda x: F.gelu(x, approximate="tanh"), "gelu_tanh"),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), "gelu_tanh"),
}


def check_activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(
            f"hidden_act {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}."
        )
    return name


@dataclass(frozen=True)
class MLPConfig:
    intermediate_size: int
    activation: str = "silu"
    bias: bool = False

    def build(self, hidden_size: int, ops: Ops, parallel: ParallelContext = SINGLE) -> GatedMLP:
        return GatedMLP(hidden_size, self, ops, parallel)


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, cfg: MLPConfig, ops: Ops, parallel: ParallelContext = SINGLE
    ) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.activation = check_activation(cfg.activation)
        self.act = ACTIVATIONS[cfg.activation][0]
        gate_up_shard = down_shard = None
        if parallel.tp_size > 1:
            start, end = split_range(inter, parallel.tp_size, parallel.tp_rank, BLOCK)
            part = (inter, start, end - start)
            gate_up_shard, down_shard = Shard(0, (part, part)), Shard(1, (part,))
            inter = end - start
        self.gate_up_proj = Linear(hidden_size, 2 * inter, cfg.bias, ops, gate_up_shard, parallel)
        self.down_proj = Linear(inter, hidden_size, cfg.bias, ops, down_shard, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
