import torch
from torch import nn

from pagoda.ops import TORCH_OPS, Ops


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like Hugging Face's; optionally fused with the residual add.

    forward(x) -> normed;  forward(x, residual) -> (normed(x + residual), x + residual)

    `gemma`: Gemma's norm, `(x_f32 * rsqrt) * (1 + w)` rounded once, where Llama's rounds
    `x * rsqrt` to the dtype before the weight. Its weight is kept in float32 and holds
    1 + w (the loader adds the 1, or finds it added, as llama.cpp writes Gemma's files);
    a float32 weight is what tells the kernels to multiply before rounding.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, ops: Ops = TORCH_OPS, gemma: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.ops = ops
        self.gemma = gemma  # the weight is 1 + w, in float32 whatever the model's dtype
        self.keep_float32 = gemma  # (the loader's cue)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
