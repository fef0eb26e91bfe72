import torch
from torch import nn

from pagoda.attention.context import get_attention_metadata
from pagoda.attention.kv_cache import LayerKV
from pagoda.attention.paged import paged_attention, write_kv
from pagoda.ops import TORCH_OPS, Ops


class Attention(nn.Module):
    """Paged attention over this layer's KV cache, which the model runner binds (`kv`)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, ops: Ops = TORCH_OPS):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.ops = ops
        self.kv = LayerKV(torch.empty(0), torch.empty(0))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] -> [T, H, D]."""
        meta = get_attention_metadata()
        if self.ops.attention is not None:  # the backend's own (the GPU's Triton kernels)
            return self.ops.attention(q, k, v, self.kv, meta, self.scale)
        write_kv(k, v, self.kv, meta.slot_mapping)
        return paged_attention(q, k, v, self.kv, meta, self.scale, self.ops.decode_attention)
