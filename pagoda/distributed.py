"""Where a worker stands in a model split across processes, and the collectives it
runs: tensor parallel (each layer's heads, MLP columns and vocabulary split across a
group, one all-reduce per row-parallel linear) and pipeline parallel (contiguous
layer ranges per stage, activations sent stage to stage), over torch.distributed
(gloo on the CPU). The per-layer all-reduces of small batches go through shared
memory instead (`SharedMemoryAllReduce`): gloo's round trips over loopback TCP cost
about 0.7 ms each, and a decode step makes two per layer.

Ranks: global rank = pp_rank * tp_size + tp_rank. Rank 0 of the last stage is the
driver: the only one that samples and answers the engine.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagoda import envs


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # a torch.distributed ProcessGroup; None when tp_size is 1
    shm: SharedMemoryAllReduce | None = None  # the TP group's fast path, if it has one

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        return self.is_last_stage and self.tp_rank == 0

    @classmethod
    def init(
        cls, tp_size: int, pp_size: int, rank: int, shm_dir: str | None = None
    ) -> ParallelContext:
        """After `init_process_group`: every rank builds every TP group (torch.distributed
        asks that of all ranks) and keeps its own. `shm_dir`: a folder in shared memory
        that all ranks see (they are on one machine): the TP group's all-reduces of
        small tensors go through a file there."""
        import torch.distributed as dist

        own = None
        for stage in range(pp_size):
            ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
            group = dist.new_group(ranks) if tp_size > 1 else None
            if rank in ranks:
                own = group
        tp_rank, pp_rank = rank % tp_size, rank // tp_size
        shm = None
        if tp_size > 1 and shm_dir is not None and platform.machine() in ("x86_64", "AMD64"):
            path = os.path.join(shm_dir, f"all-reduce-stage{pp_rank}")
            shm = SharedMemoryAllReduce(path, tp_rank, tp_size, own)
        return cls(tp_rank, tp_size, pp_rank, pp_size, own, shm)

    def sum_over_workers(self, n: int) -> int:
        """The sum of `n` over every worker (each its own shard's bytes per block)."""
        if self.world_size == 1:
            return n
        import torch.distributed as dist

        total = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(total)
        return int(total)

    # ---- tensor parallel -------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every TP rank's `x` (in place)."""
        if self.tp_size == 1 or (self.shm is not None and self.shm.all_reduce(x)):
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.tp_group)
        return x

    def gather_columns(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Each TP rank's [rows, sizes[rank]] slice -> the whole [rows, sum(sizes)] on TP
        rank 0, None on the others (gloo's gather wants equal shapes: slices are
        padded to the largest, and trimmed again)."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        width = max(sizes)
        padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
        root = dist.get_global_rank(self.tp_group, 0)
        if self.tp_rank != 0:
            dist.gather(padded, None, dst=root, group=self.tp_group)
            return None
        parts = [torch.empty_like(padded) for _ in range(self.tp_size)]
        dist.gather(padded, parts, dst=root, group=self.tp_group)
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)

    # ---- pipeline parallel -----------------------------------------------------

    def send_to_next_stage(self, *tensors: torch.Tensor) -> None:
        import torch.distributed as dist

        for t in tensors:
            dist.send(t.contiguous(), self.rank + self.tp_size)

    def recv_from_prev_stage(self, *like: tuple[tuple[int, ...], torch.dtype]):
        import torch.distributed as dist

        out = []
        for shape, dtype in like:
            t = torch.empty(shape, dtype=dtype)
            dist.recv(t, self.rank - self.tp_size)
            out.append(t)
        return out


SINGLE = ParallelContext()


class SharedMemoryAllReduce:
    """An all-reduce among the TP ranks of one machine through a shared file mapping:
    each rank copies its tensor into its slot and raises its flag (the all-reduce's
    sequence number); once every flag is up, each sums the slots in the same order
    (so every rank gets the same bits). Two sets of slots, used in turn: a rank writes
    a set again only after every rank has raised its flag for the other set, which it
    does only after reading this one. x86 keeps stores in order, so a raised flag
    means its slot is written (other machines use gloo). Tensors larger than a slot
    (prefill batches, where the products dwarf the all-reduce) go through gloo."""

    SLOT_BYTES = 1 << 20  # a decode batch of 256 rows of a 1024-wide hidden in fp32
    FLAG_STRIDE = 64  # one cache line per rank's flag

    def __init__(self, path: str, rank: int, size: int, group: Any) -> None:
        import torch.distributed as dist

        self.rank, self.size = rank, size
        header = self.FLAG_STRIDE * size
        total = header + 2 * size * self.SLOT_BYTES
        if rank == 0:
            with open(path, "wb") as f:
                f.truncate(total)
        dist.barrier(group=group)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), total)
        self.flags = np.ndarray((size,), np.int64, buffer=self._map, strides=(self.FLAG_STRIDE,))
        raw = torch.frombuffer(self._map, dtype=torch.uint8, offset=header, count=total - header)
        self.slots = raw.view(2, size, self.SLOT_BYTES)
        self.seq = 0
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(path)  # the mappings stay; nothing is left behind

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum `x` over the ranks in place; False (nothing done) if it is too large."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.SLOT_BYTES or not x.is_contiguous():
            return False
        self.seq += 1
        slots = self.slots[self.seq % 2, :, :nbytes].view(x.dtype).view(self.size, *x.shape)
        slots[self.rank].copy_(x)
        self.flags[self.rank] = self.seq
        deadline = None
        while self.flags.min() < self.seq:
            if deadline is None:
                deadline = time.monotonic() + envs.distributed_timeout_s()
            elif time.monotonic() > deadline:
                raise RuntimeError("all-reduce: a tensor-parallel peer did not answer")
            os.sched_yield()  # a rank sharing this core gets it
        torch.sum(slots, dim=0, out=x)
        return True


def split_range(n: int, size: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """Rank `rank`'s contiguous share [start, end) of n items among `size`, cut at
    multiples of `unit` where n allows (quantized blocks of 32 along K)."""
    if n % unit:
        unit = 1
    units = n // unit
    return rank * units // size * unit, (rank + 1) * units // size * unit


def split_heads(
    num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int
) -> tuple[int, int, int, int]:
    """A TP rank's attention heads: (first q head, q heads, first KV head, KV heads).

    Each rank takes whole groups of query heads with the KV head they share (GQA), so
    its own attention is plain GQA over its own K/V: with more KV heads than ranks they
    are split as evenly as they go (3 KV heads on 2 ranks: 1 and 2, nothing stored
    twice); with fewer, each KV head is replicated on tp_size / num_kv_heads ranks,
    which split its query heads."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv_start, kv_end = split_range(num_kv_heads, tp_size, tp_rank)
        return kv_start * group, (kv_end - kv_start) * group, kv_start, kv_end - kv_start
    replicas = tp_size // num_kv_heads
    if tp_size % num_kv_heads or group % replicas:
        raise ValueError(
            f"tensor_parallel_size {tp_size} cannot split {num_heads} attention heads "
            f"sharing {num_kv_heads} KV heads: with fewer KV heads than ranks, it must be "
            "a multiple of the KV heads that divides each KV head's query heads."
        )
    kv = tp_rank // replicas
    per_rank = group // replicas
    return kv * group + (tp_rank % replicas) * per_rank, per_rank, kv, 1


def split_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """A pipeline stage's layers [start, end): contiguous, as even as they go."""
    if num_layers < pp_size:
        raise ValueError(
            f"pipeline_parallel_size {pp_size} is more than the model's {num_layers} layers."
        )
    return split_range(num_layers, pp_size, pp_rank)
