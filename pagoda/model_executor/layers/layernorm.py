import torch
from torch import nn

from pagoda.ops import TORCH_OPS, Ops


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like Hugging Face's; optionally fused with the residual add.

    forward(x) -> normed;  forward(x, residual) -> (normed(x + residual), x + residual)
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, ops: Ops = TORCH_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
