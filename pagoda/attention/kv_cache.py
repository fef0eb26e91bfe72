"""The paged KV cache tensors: every layer's K and V in blocks, in the model's dtype or
quantized (int8, or fp8 e4m3) with one fp16 scale per token and head.

    data    [layers, 2 (K/V), num_blocks, block_size, kv_heads, head_dim]
    scales  [layers, 2 (K/V), num_blocks, block_size, kv_heads]   (quantized only)

A quantized row is `round(x / s)` with s = max|x| / qmax (127 for int8, 448 for fp8
e4m3), s rounded to fp16 first so that the stored scale is the one used. Blocks
hold 1.9x (bf16 model) or 3.9x (float32) the tokens for the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@dataclass
class LayerKV:
    """One layer's K and V (views into the cache), as its attention reads them."""

    k: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor
    k_scales: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads] fp16
    v_scales: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scales is not None


def raw(t: torch.Tensor) -> torch.Tensor:
    """`t` for indexing and copying: PyTorch's CPU gathers and index_copy_ do not take
    fp8, so fp8 moves as its bytes."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def gather(values: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, ...] through block_table [..., MB] -> [..., MB * bs, ...], in its dtype."""
    out = raw(values)[block_table].flatten(block_table.dim() - 1, block_table.dim())
    return out.view(values.dtype)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, kv_heads, head_dim] -> (values in `dtype`, fp16 scales [T, kv_heads])."""
    qmax = _QMAX[dtype]
    scales = (x.abs().amax(-1).float() / qmax).half()
    s = scales.float().unsqueeze(-1)
    q = (x.float() / torch.where(s > 0, s, 1.0)).clamp(-qmax, qmax)
    return (q.round().to(dtype) if dtype == torch.int8 else q.to(dtype)), scales


def dequantize_kv(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_kv` (up to rounding): [..., head_dim] in `dtype`."""
    return (values.float() * scales.float().unsqueeze(-1)).to(dtype)


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        """`dtype`: the model's, or int8 / float8_e4m3fn (then with scales). Zeroed, so
        that masked-out slots never hold NaN (0 * NaN would leak through attention).
        `pin_memory`: page-locked host memory (a GPU's swap pool: faster copies)."""
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads)
        kw = dict(device=device, pin_memory=pin_memory)
        self.data = torch.zeros((*shape, head_dim), dtype=dtype, **kw)
        self.scales = torch.zeros(shape, dtype=torch.float16, **kw) if dtype in _QMAX else None

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        per_token_head = head_dim * torch.tensor([], dtype=dtype).element_size()
        if dtype in _QMAX:
            per_token_head += 2  # the fp16 scale
        return 2 * num_layers * block_size * num_kv_heads * per_token_head

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    def layer(self, i: int) -> LayerKV:
        if self.scales is None:
            return LayerKV(self.data[i, 0], self.data[i, 1])
        return LayerKV(self.data[i, 0], self.data[i, 1], self.scales[i, 0], self.scales[i, 1])

    def like(self, num_blocks: int, pin_memory: bool = False) -> PagedKVCache:
        """An empty host cache of the same layout with `num_blocks` blocks (the swap
        pool; page-locked with `pin_memory`, for a GPU's)."""
        layers, _, _, block_size, heads, head_dim = self.data.shape
        return PagedKVCache(
            layers, num_blocks, block_size, heads, head_dim, self.dtype, "cpu", pin_memory
        )

    def copy_blocks(self, src: PagedKVCache, src_ids: list[int], dst_ids: list[int]) -> None:
        """Blocks `src_ids` of `src` (this cache or another, on any device) into blocks
        `dst_ids` here (between a GPU and the host: one gather, one copy, one scatter)."""
        device = self.data.device
        index = torch.tensor(dst_ids, device=device)
        source = torch.tensor(src_ids, device=src.data.device)
        raw(self.data)[:, :, index] = raw(src.data)[:, :, source].to(device)
        if self.scales is not None:
            self.scales[:, :, index] = src.scales[:, :, source].to(device)
