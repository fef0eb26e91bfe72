import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows, bf16 products go to the small-M kernel (benchmarks/kernels.py,
# distinct weights per layer): 1.3-2.1x oneDNN at one row, 1.2-1.5x at 4-8, about even
# at 16, 0.86x at 64.
SMALL_GEMM_MAX_ROWS = 8


class Linear(nn.Linear):
    """nn.Linear; the model runner binds `small_gemm` (the C++ kernel) for bf16 models
    on CPUs with AVX512-BF16.

    Decode at small batch multiplies a few rows by every weight, once per step:
    a memory-bound stream, which the kernel reads once with no packing step.
    """

    small_gemm = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small_gemm is not None and x.shape[0] <= SMALL_GEMM_MAX_ROWS:
            return self.small_gemm(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
