from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda.attention.context import get_lora_mapping
from pagoda.model_executor.quantization import QuantizedWeight
from pagoda.ops import TORCH_OPS, Ops

if TYPE_CHECKING:
    from pagoda.lora.manager import LinearLoRA


class Linear(nn.Linear):
    """nn.Linear whose product is the kernel layer's: `linear` on a dense weight, or
    `quant_linear` once the loader gives it a block-quantized one (`set_quantized`).
    With LoRA on, the LoRA manager gives it adapter slots (`lora`), and the step's
    adapter segments add their products (`add_lora`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: Ops = TORCH_OPS):
        super().__init__(in_features, out_features, bias=bias)
        self.ops = ops
        self.qweight: QuantizedWeight | None = None
        self.lora: LinearLoRA | None = None

    def reset_parameters(self) -> None:
        """Nothing: the weights come from a checkpoint. (Initializing them would touch
        memory that the loader then frees for the checkpoint's own weight.)"""

    def set_quantized(self, qweight: QuantizedWeight) -> None:
        """Use `qweight` (the same [out, in] shape) in place of the dense weight."""
        if tuple(qweight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"quantized weight of shape {qweight.shape} for a "
                f"{self.out_features}x{self.in_features} layer."
            )
        del self.weight  # the dense parameter: never materialized
        self.weight = None
        self.qweight = qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            y = self.ops.quant_linear(x, self.qweight, self.bias)
        else:
            y = self.ops.linear(x, self.weight, self.bias)
        if self.lora is not None and (mapping := get_lora_mapping()) is not None:
            y = self.ops.add_lora(y, x, self.lora, mapping)
        return y


class Embedding(nn.Embedding):
    """nn.Embedding whose table may be block-quantized: a lookup dequantizes only the
    rows it reads."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ops: Ops = TORCH_OPS):
        super().__init__(num_embeddings, embedding_dim)
        self.ops = ops
        self.qweight: QuantizedWeight | None = None
        self.out_dtype = torch.float32

    def reset_parameters(self) -> None:
        """Nothing: the table comes from a checkpoint (see Linear.reset_parameters)."""

    def set_quantized(self, qweight: QuantizedWeight, dtype: torch.dtype) -> None:
        if tuple(qweight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"quantized embedding of shape {qweight.shape}.")
        del self.weight
        self.weight = None
        self.qweight, self.out_dtype = qweight, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.ops.dequantize(self.qweight.rows(input_ids), self.out_dtype)
        return super().forward(input_ids)
