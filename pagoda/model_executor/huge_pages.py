"""The model's weights and the KV cache on transparent huge pages (Linux).

A decode step streams every weight once, and at a few thousand tokens of context the KV
cache as well. On 4 KiB pages that stream misses the TLB every 4 KiB; on 2 MiB pages
the same kernels read faster. Measured (`benchmarks/huge_pages.py`, AMD EPYC, 2
threads; docs/perf/huge_pages.json): `quant_linear` at one row over Qwen3-1.7B's 28
Q4_0 layers, 30.5 ms on 4 KiB pages against 27.2 ms on 2 MiB pages; Q8_0 51.4 against
48.4 ms.

The kernel's usual mode, "madvise", gives huge pages only to memory advised for them.
PyTorch's allocator advises only under THP_MEM_ALLOC_ENABLE=1, read once at its first
allocation (before pagoda could set it), and weights made from NumPy arrays (GGUF
blocks) never come from it. So pagoda copies the model's tensors, once loaded, into
one advised arena of its own (`move_to_huge_pages`), and allocates the KV cache in one
(`huge_page_zeros`, resident as it is written). Where the kernel has no transparent
huge pages ("never", or not Linux) nothing moves.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import re
from collections.abc import Callable, Iterator

import torch

from pagoda.model_executor.quantization import QuantizedWeight, StackedWeight

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor's start in an arena: a cache line
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or None
    where it has none."""
    try:
        with open(_THP_ENABLED) as f:
            found = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return found.group(1) if found else None


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """A uint8 [nbytes] tensor on fresh memory, 2 MiB aligned and advised for huge
    pages, or None where the kernel has none. The tensor keeps its mapping alive; the
    mapping goes when the last view of it does."""
    if nbytes <= 0 or thp_mode() not in ("always", "madvise"):
        return None
    advised = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # whole huge pages, the last one too
    area = mmap.mmap(-1, advised + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(area, dtype=torch.uint8)  # (holds `area`)
    start = -whole.data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel without the advice: plain pages
        area.madvise(mmap.MADV_HUGEPAGE, start, advised)
    return whole[start : start + nbytes]


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype), on huge pages where the kernel has them. Not
    written here: a fresh anonymous mapping reads as zeros, and each 2 MiB page is
    faulted in when first written. Writing the whole cache up front, as torch.zeros
    does, made every start pay for it: the default 4 GiB took about 4.7 s of the 13 s
    `pagoda serve` needed to be ready on a slow 2-vCPU VM (py-spy)."""
    buffer = huge_page_buffer(math.prod(shape) * dtype.itemsize)
    if buffer is None:
        return torch.zeros(shape, dtype=dtype)
    return buffer.view(dtype).view(shape)


def move_to_huge_pages(model: torch.nn.Module, min_bytes: int = 1 << 16) -> int:
    """Copy the CPU storages of `model`'s tensors of at least `min_bytes` (parameters,
    buffers, plain tensor attributes, QuantizedWeights' parts, also in lists) into one
    arena on huge pages, each tensor's view of its storage kept (tied weights stay one
    tensor). Returns the bytes moved (0 where the kernel has no huge pages)."""
    # Per storage: the storage, and each place that views it with the view's geometry,
    # taken now (a parameter tied into two modules is listed twice and moved at the first).
    places: dict[int, tuple[torch.UntypedStorage, list[tuple]]] = {}
    for tensor, put in _tensor_refs(model):
        storage = tensor.untyped_storage()
        if tensor.device.type == "cpu" and storage.nbytes() >= min_bytes:
            view = (put, tensor.dtype, tensor.storage_offset(), tensor.shape, tensor.stride())
            places.setdefault(storage.data_ptr(), (storage, []))[1].append(view)
    total = sum(_aligned(storage.nbytes()) for storage, _ in places.values())
    arena = huge_page_buffer(total)
    if arena is None:
        return 0
    base, at = arena.storage_offset(), 0
    while places:  # one storage at a time, each let go once moved: peak = model + one
        storage, views = places.pop(next(iter(places)))
        n = storage.nbytes()
        arena[at : at + n].copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (n,)))
        del storage
        for put, dtype, offset, shape, stride in views:
            start = (base + at) // dtype.itemsize + offset
            put(torch.empty(0, dtype=dtype).set_(arena.untyped_storage(), start, shape, stride))
        at += _aligned(n)
    return at


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _tensor_refs(model: torch.nn.Module) -> Iterator[tuple[torch.Tensor, Callable]]:
    """(tensor, a function that puts another in its place) for each tensor `model`
    holds."""
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                yield p, functools.partial(_set_data, p)
        for name, b in module._buffers.items():
            if b is not None:
                yield b, functools.partial(module._buffers.__setitem__, name)
        for name, value in vars(module).items():
            if not name.startswith("_"):
                yield from _refs_in(value, functools.partial(module.__dict__.__setitem__, name))


def _refs_in(value, put: Callable) -> Iterator[tuple[torch.Tensor, Callable]]:
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        yield value, put
    elif isinstance(value, StackedWeight):
        yield from _refs_in(value.pieces, put)
    elif isinstance(value, QuantizedWeight):
        for field in QuantizedWeight.TENSOR_FIELDS:
            if getattr(value, field) is not None:
                yield getattr(value, field), functools.partial(setattr, value, field)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _refs_in(item, functools.partial(value.__setitem__, i))


def _set_data(p: torch.nn.Parameter, new: torch.Tensor) -> None:
    p.data = new
