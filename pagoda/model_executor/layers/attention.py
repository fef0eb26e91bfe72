import torch
from torch import nn

from pagoda.attention.context import get_attention_metadata
from pagoda.attention.kv_cache import LayerKV
from pagoda.attention.paged import AttentionParams, paged_attention, write_kv
from pagoda.ops import TORCH_OPS, Ops


class Attention(nn.Module):
    """Paged attention over this layer's KV cache, which the model runner binds (`kv`).

    `scale`: the softmax scale (None: head_dim ** -0.5); `sliding_window`: each query
    sees only its `sliding_window` latest keys, itself included (None: all); `softcap`:
    logits become softcap * tanh(logits / softcap) before the mask (Gemma 2). A layer
    whose module reads the cache itself (MLA's) uses it only for the binding and the
    cache's shape (`num_kv` 1)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        ops: Ops = TORCH_OPS,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        num_kv: int = 2,
    ):
        super().__init__()
        self.num_kv = num_kv  # rows a token in the cache: K and V, or MLA's one latent row
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        self.params = AttentionParams(self.scale, sliding_window or 0, softcap or 0.0)
        self.ops = ops
        self.kv = LayerKV(torch.empty(0), torch.empty(0))

    @property
    def sliding_window(self) -> int:
        return self.params.window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] -> [T, H, D]."""
        meta = get_attention_metadata()
        if self.ops.attention is not None:  # the backend's own (the GPU's Triton kernels)
            return self.ops.attention(q, k, v, self.kv, meta, self.params)
        write_kv(k, v, self.kv, meta.slot_mapping)
        return paged_attention(q, k, v, self.kv, meta, self.params, self.ops.decode_attention)
