import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like Hugging Face's; optionally fused with the residual add.

    forward(x) -> normed;  forward(x, residual) -> (normed(x + residual), x + residual)
    """

    kernels = None  # pagoda's C++ ops when the model runner binds them: one pass, in place

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.kernels is not None:
            if residual is None:
                return self.kernels.rms_norm(x, self.weight, self.eps)
            self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
