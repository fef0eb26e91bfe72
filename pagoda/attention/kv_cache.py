"""The paged KV cache tensors: every layer's K and V in blocks, in the model's dtype or
quantized (int8, or fp8 e4m3) with one fp16 scale per token and head.

    data    [layers, 2 (K/V), num_blocks, block_size, kv_heads, head_dim]
    scales  [layers, 2 (K/V), num_blocks, block_size, kv_heads]   (quantized only)

Multi-head latent attention (DeepSeek) keeps one row per token and layer instead of
K and V (num_kv 1): the compressed latent and the rope key, which serve as its one
key head and, cut to the latent, its value.

A quantized row is `round(x / s)` with s = max|x| / qmax (127 for int8, 448 for fp8
e4m3), s rounded to fp16 first so that the stored scale is the one used. Blocks
hold 1.9x (bf16 model) or 3.9x (float32) the tokens for the same bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.model_executor.huge_pages import huge_page_zeros

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@dataclass(frozen=True)
class KVShape:
    """What a model's paged cache holds, per token, in each layer."""

    num_layers: int
    kv_heads: int
    head_dim: int
    num_kv: int = 2  # K and V; MLA's latent row serves as both: 1


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
        num_kv: int = 2,
    ) -> None:
        """`dtype`: the model's, or int8 / float8_e4m3fn (then with scales). Zeroed, so
        that masked-out slots never hold NaN (0 * NaN would leak through attention).
        `pin_memory`: page-locked host memory (a GPU's swap pool: faster copies).
        `num_kv`: 2 (K and V), or 1 (MLA's latent rows)."""
        shape = (num_layers, num_kv, num_blocks, block_size, num_kv_heads)
        kw = dict(device=device, pin_memory=pin_memory)
        # Decode attention streams the cache as it streams the weights: huge pages.
        on_huge_pages = torch.device(device).type == "cpu" and not pin_memory
        zeros = huge_page_zeros if on_huge_pages else functools.partial(torch.zeros, **kw)
        self.data = zeros((*shape, head_dim), dtype=dtype)
        self.scales = zeros(shape, dtype=torch.float16) if dtype in _QMAX else None

    @classmethod
    def of(
        cls, shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, **kw
    ) -> PagedKVCache:
        return cls(
            shape.num_layers, num_blocks, block_size, shape.kv_heads, shape.head_dim, dtype,
            num_kv=shape.num_kv, **kw,
        )  # fmt: skip

    @staticmethod
    def bytes_per_block(
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        num_kv: int = 2,
    ) -> int:
        per_token_head = head_dim * torch.tensor([], dtype=dtype).element_size()
        if dtype in _QMAX:
            per_token_head += 2  # the fp16 scale
        return num_kv * num_layers * block_size * num_kv_heads * per_token_head

    @classmethod
    def bytes_per_block_of(cls, shape: KVShape, block_size: int, dtype: torch.dtype) -> int:
        return cls.bytes_per_block(
            shape.num_layers, block_size, shape.kv_heads, shape.head_dim, dtype, shape.num_kv
        )

    @property
    def shape(self) -> KVShape:
        layers, num_kv, _, _, kv_heads, head_dim = self.data.shape
        return KVShape(layers, kv_heads, head_dim, num_kv)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    def layer(self, i: int) -> LayerKV:
        """Layer i's K and V (with one row a token, MLA's: the same tensor twice)."""
        v = self.data.shape[1] - 1  # 1, or 0 for latent rows
        if self.scales is None:
            return LayerKV(self.data[i, 0], self.data[i, v])
        return LayerKV(self.data[i, 0], self.data[i, v], self.scales[i, 0], self.scales[i, v])

    def tensors(self) -> list[torch.Tensor]:
        """What a block is made of, for moving it: the values (fp8 as its bytes), and
        the scales if quantized; block ids index dim 2 of each."""
        return [raw(self.data)] + ([self.scales] if self.scales is not None else [])

    def copy_blocks(self, src_ids: list[int], dst_ids: list[int]) -> None:
        """Blocks `src_ids` into blocks `dst_ids` (copy-on-write), on the cache's device."""
        source = torch.tensor(src_ids, device=self.data.device)
        index = torch.tensor(dst_ids, device=self.data.device)
        for t in self.tensors():
            t[:, :, index] = t[:, :, source]

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each block's K/V as bytes: its values, then its scales if any (for the disk
        tier, whose writer thread calls this; `write_blocks` takes them back). Through
        numpy views of the host tensors: no torch op, so no second caller of torch's
        thread pool while a step runs."""
        views = [t.view(torch.uint8).numpy() for t in self.tensors()]
        return [b"".join(v[:, :, b].tobytes() for v in views) for b in block_ids]

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Blocks `block_ids` from `read_blocks`' bytes (of a cache of the same shape):
        one copy each, from the payload into the cache."""
        views = [t.view(torch.uint8).numpy() for t in self.tensors()]
        sizes = [v[:, :, 0].size for v in views]
        for block_id, payload in zip(block_ids, payloads, strict=True):
            if len(payload) != sum(sizes):
                raise ValueError(f"a KV block is {sum(sizes)} bytes, got {len(payload)}.")
            data, start = np.frombuffer(payload, dtype=np.uint8), 0
            for v, size in zip(views, sizes, strict=True):
                v[:, :, block_id] = data[start : start + size].reshape(v[:, :, block_id].shape)
                start += size


class SwapPool:
    """The host pool for swapped-out blocks (same layout as the device's) and the
    copies to and from it.

    On a GPU a swap-out overlaps the step's compute: its blocks are gathered on the
    compute stream (so the step may reuse them at once), copied to page-locked
    staging on a side stream, and scattered into the pool when it is next read
    (`land`, at the start of the next `move_blocks`: by then the copy is done). A
    swap-in is a host gather into page-locked staging and an asynchronous copy on the
    compute stream, which the step's forward waits for in order. Only the staging is
    page-locked: the pool itself is touched by the host alone. On the CPU the same
    path runs with plain memory and no streams."""

    def __init__(self, device_cache: PagedKVCache, num_blocks: int) -> None:
        self.device = device_cache.data.device
        self.pinned = self.device.type == "cuda"
        block_size = device_cache.data.shape[3]
        self.cache = PagedKVCache.of(
            device_cache.shape, num_blocks, block_size, device_cache.dtype, device="cpu"
        )
        self.side_stream = torch.cuda.Stream(self.device) if self.pinned else None
        # Swap-outs not yet in the pool: (copy done event or None, staged, host ids).
        self._landing: list[tuple[torch.cuda.Event | None, list[torch.Tensor], list[int]]] = []

    def _ids(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the device (copied from pageable memory without waiting)."""
        return torch.tensor(ids).to(self.device, non_blocking=True)

    def swap_out(self, device_cache: PagedKVCache, dev_ids: list[int], host_ids: list[int]) -> None:
        source = self._ids(dev_ids)
        gathered = [t[:, :, source] for t in device_cache.tensors()]
        event = None
        if self.side_stream is not None:
            self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side_stream):
                staged = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True) for g in gathered]
                for host, dev in zip(staged, gathered, strict=True):
                    host.copy_(dev, non_blocking=True)
                    dev.record_stream(self.side_stream)  # freed before the copy ran
                event = torch.cuda.Event()
                event.record(self.side_stream)
            gathered = staged
        self._landing.append((event, gathered, host_ids))

    def land(self) -> None:
        """Scatter finished swap-outs into the pool, oldest first."""
        for event, staged, host_ids in self._landing:
            if event is not None:
                event.synchronize()
            index = torch.tensor(host_ids)
            for pool, blocks in zip(self.cache.tensors(), staged, strict=True):
                pool[:, :, index] = blocks
        self._landing.clear()

    def swap_in(self, device_cache: PagedKVCache, host_ids: list[int], dev_ids: list[int]) -> None:
        wanted = set(host_ids)
        if any(wanted.intersection(ids) for _, _, ids in self._landing):
            self.land()  # (not the case from the scheduler: it would wait for the copy)
        index = torch.tensor(host_ids)
        dest = self._ids(dev_ids)
        for pool, dev in zip(self.cache.tensors(), device_cache.tensors(), strict=True):
            shape = (*pool.shape[:2], len(host_ids), *pool.shape[3:])
            staged = torch.empty(shape, dtype=pool.dtype, pin_memory=self.pinned)
            torch.index_select(pool, 2, index, out=staged)
            dev[:, :, dest] = staged.to(self.device, non_blocking=True)
