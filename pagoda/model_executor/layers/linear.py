import torch
from torch import nn

from pagoda.ops import TORCH_OPS, Ops


class Linear(nn.Linear):
    """nn.Linear whose product is the kernel layer's `linear` (for small bf16 batches on
    the CPU, a kernel that streams each weight once; see pagoda.ops)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: Ops = TORCH_OPS):
        super().__init__(in_features, out_features, bias=bias)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)
