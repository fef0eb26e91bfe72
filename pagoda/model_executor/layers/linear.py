from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda.attention.context import get_lora_mapping
from pagoda.distributed import SINGLE, ParallelContext
from pagoda.model_executor.quantization import QuantizedWeight
from pagoda.ops import TORCH_OPS, Ops

if TYPE_CHECKING:
    from pagoda.lora.manager import LinearLoRA


@dataclass(frozen=True)
class Shard:
    """A tensor-parallel layer's cut of the checkpoint's weight: along `dim` (0: the
    output rows, column parallel; 1: the input columns, row parallel), for each part
    of a fused weight (q, k, v; gate, up), (the part's size in the checkpoint, this
    rank's first row or column, how many)."""

    dim: int
    parts: tuple[tuple[int, int, int], ...]

    def take(self, index: int, w: torch.Tensor | QuantizedWeight, name: str):
        """This rank's slice of part `index` of checkpoint weight `name` (a copy: the
        checkpoint's whole tensor is not kept alive). A row-parallel bias is whole."""
        if self.dim >= len(w.shape):
            return w
        full, start, size = self.parts[index]
        if w.shape[self.dim] != full:
            raise ValueError(
                f"weight {name!r} has shape {tuple(w.shape)}, expected {full} along dim {self.dim}."
            )
        if not isinstance(w, QuantizedWeight):
            return w.narrow(self.dim, start, size).clone()
        if self.dim == 1:
            return w.columns(start, start + size)
        return w.rows(slice(start, start + size)).map(torch.Tensor.clone)


class Linear(nn.Linear):
    """nn.Linear whose product is the kernel layer's: `linear` on a dense weight, or
    `quant_linear` once the loader gives it a block-quantized one (`set_quantized`).
    With LoRA on, the LoRA manager gives it adapter slots (`lora`), and the step's
    adapter segments add their products (`add_lora`).

    Tensor parallel: with a `shard`, the layer holds this rank's rows (column parallel:
    its output is this rank's slice) or columns (row parallel: its output is this
    rank's partial sum, added up across ranks by one all-reduce, the bias once)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        ops: Ops = TORCH_OPS,
        shard: Shard | None = None,
        parallel: ParallelContext = SINGLE,
    ):
        super().__init__(in_features, out_features, bias=bias)
        self.ops = ops
        self.qweight: QuantizedWeight | None = None
        self.lora: LinearLoRA | None = None
        self.shard = shard
        self.parallel = parallel
        self.reduces = shard is not None and shard.dim == 1

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
        bias = self.bias if not self.reduces or self.parallel.tp_rank == 0 else None
        if self.qweight is not None:
            y = self.ops.quant_linear(x, self.qweight, bias)
        else:
            y = self.ops.linear(x, self.weight, bias)
        if self.lora is not None and (mapping := get_lora_mapping()) is not None:
            y = self.ops.add_lora(y, x, self.lora, mapping)
        return self.parallel.all_reduce(y) if self.reduces else y


class Embedding(nn.Embedding):
    """nn.Embedding whose table may be block-quantized: a lookup dequantizes only the
    rows it reads. Tensor parallel (a `shard` of the vocabulary): each rank looks up the
    ids in its range, zeros elsewhere, and one all-reduce adds the ranks' rows."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        ops: Ops = TORCH_OPS,
        shard: Shard | None = None,
        parallel: ParallelContext = SINGLE,
    ):
        super().__init__(num_embeddings, embedding_dim)
        self.ops = ops
        self.qweight: QuantizedWeight | None = None
        self.out_dtype = torch.float32
        self.shard = shard
        self.parallel = parallel

    def reset_parameters(self) -> None:
        """Nothing: the table comes from a checkpoint (see Linear.reset_parameters)."""

    def set_quantized(self, qweight: QuantizedWeight, dtype: torch.dtype) -> None:
        if tuple(qweight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"quantized embedding of shape {qweight.shape}.")
        del self.weight
        self.weight = None
        self.qweight, self.out_dtype = qweight, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = None
        if self.shard is not None:
            input_ids = input_ids - self.shard.parts[0][1]
            outside = (input_ids < 0) | (input_ids >= self.num_embeddings)
            input_ids = input_ids.masked_fill(outside, 0)
        if self.qweight is not None:
            x = self.ops.dequantize(self.qweight.rows(input_ids), self.out_dtype)
        else:
            x = super().forward(input_ids)
        if outside is None:
            return x
        return self.parallel.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))
