"""Resident LoRA adapters and their slots; which slot each token of a step uses.

Punica's layout, as vLLM has it: every adaptable linear holds `max_loras` slots of
stacked weights, and a step's tokens are grouped by adapter (the runner orders
its requests so) into segments. Each linear then runs, per segment, one
shrink x @ A^T [n, slices * R] and per slice one expand into its columns of the
output (`ops.add_lora`); a fused q/k/v or gate/up linear takes its modules'
adapters as slices. Ranks below `max_lora_rank` are zero-padded, and each slot
records its real rank per slice (0 where the adapter leaves a module alone), so
the kernels read only what an adapter has.

    LinearLoRA.a      [max_loras, slices, R, in]   A of each slice
    LinearLoRA.b      [max_loras, R, out]          B^T (scaling in), columns by slice
    LinearLoRA.ranks  [max_loras, slices] int32

Two tiers, vLLM's: adapters read from disk stay in a host cache of
`max_cpu_loras` (LRU); those a step needs are copied into slots, evicting the
least recently used slot that the step does not need. The scheduler keeps the
adapters of running requests within `max_loras`, so a step always finds room.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from pagoda.config import LoRAConfig
from pagoda.errors import InvalidRequestError
from pagoda.lora.adapter import LoRAAdapter, load_adapter, module_shapes
from pagoda.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass
class LinearLoRA:
    """The adapter slots of one linear layer (the manager writes them, the layer reads)."""

    a: torch.Tensor  # [max_loras, slices, R, in], float32 or bf16
    b: torch.Tensor  # [max_loras, R, out], the same dtype
    ranks: torch.Tensor  # [max_loras, slices] int32: each slot's rank per slice
    offsets: list[int]  # each slice's first output column
    widths: list[int]  # each slice's output columns
    modules: tuple[tuple[int, str], ...]  # (layer index, HF module) per slice


@dataclass
class LoRAMapping:
    """A step's adapter segments: tokens [start, end) use slot `slot`. Tokens of the
    base model belong to no segment. Both forms: ints for the PyTorch twin, a tensor
    for the C++ kernel."""

    segments: list[tuple[int, int, int]]
    segment_tensor: torch.Tensor  # [len(segments), 3] int64
    _splits: dict = field(default_factory=dict, repr=False)

    def split(self, rows: int) -> tuple[list[tuple[int, int, int]], torch.Tensor | None]:
        """(from each segment's start, the most tokens that are a multiple of `rows`, as
        ints; what is left of each segment, as a tensor, or None), computed once per
        step for every linear that asks. A decode step's segments, as a rule shorter
        than `rows`, are all left."""
        if rows not in self._splits:
            blocks, rest = [], []
            for start, end, slot in self.segments:
                cut = start + (end - start) // rows * rows
                if cut > start:
                    blocks.append((start, cut, slot))
                if cut < end:
                    rest.append((cut, end, slot))
            if not blocks:
                self._splits[rows] = [], self.segment_tensor
            else:
                self._splits[rows] = blocks, torch.tensor(rest) if rest else None
        return self._splits[rows]


class LoRAManager:
    def __init__(
        self,
        model: torch.nn.Module,
        hf_config: dict[str, Any],
        config: LoRAConfig,
        dtype: torch.dtype = torch.float32,
    ):
        """Give every adaptable linear of `model` (`model.lora_linears()`) its slots, in
        the model's `dtype`, as vLLM keeps adapters (for a bf16 model: half the bytes,
        and bf16 dot products and GEMMs)."""
        self.config = config
        self.hf_config = hf_config
        shapes = module_shapes(hf_config)
        rank, num_slots = config.max_lora_rank, config.max_loras
        self.linears: list[LinearLoRA] = []
        for layer_index, hf_modules, linear in model.lora_linears():
            widths = [shapes[module][1] for module in hf_modules]
            offsets = [sum(widths[:i]) for i in range(len(widths))]
            in_features = shapes[hf_modules[0]][0]
            lora = LinearLoRA(
                torch.zeros(num_slots, len(hf_modules), rank, in_features, dtype=dtype),
                torch.zeros(num_slots, rank, sum(widths), dtype=dtype),
                torch.zeros(num_slots, len(hf_modules), dtype=torch.int32),
                offsets,
                widths,
                tuple((layer_index, m) for m in hf_modules),
            )
            linear.lora = lora
            self.linears.append(lora)
        self.slot_lru: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.host_cache: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()
        self.num_loads = 0  # adapters read from disk (for tests and logs)
        nbytes = sum(lora.a.nbytes + lora.b.nbytes for lora in self.linears)
        logger.info(
            "LoRA: %d slots of rank %d in %s over %d linears (%.1f MiB), host cache of %d adapters",
            num_slots,
            rank,
            str(dtype).removeprefix("torch."),
            len(self.linears),
            nbytes / 2**20,
            config.max_cpu_loras,
        )

    # ---- a step --------------------------------------------------------------------

    def prepare(
        self, lora_requests: list[LoRARequest | None], num_tokens: list[int]
    ) -> LoRAMapping | None:
        """Make every adapter of the step resident and map its tokens. Requests come in
        the step's order, with `num_tokens[i]` tokens each, grouped by adapter (the
        runner sorts them so); None where no request uses one. Raises
        InvalidRequestError if an adapter cannot be read (then its requests fail)."""
        needed = {r.lora_int_id for r in lora_requests if r is not None}
        if not needed:
            return None
        if len(needed) > self.config.max_loras:
            raise RuntimeError(
                f"a step needs {len(needed)} adapters, more than max_loras "
                f"({self.config.max_loras}): the scheduler should have kept them within it"
            )
        segments: list[tuple[int, int, int]] = []
        start = 0
        for request, n in zip(lora_requests, num_tokens, strict=True):
            if request is not None:
                slot = self._slot_for(request, needed)
                if segments and segments[-1][1] == start and segments[-1][2] == slot:
                    segments[-1] = (segments[-1][0], start + n, slot)
                else:
                    segments.append((start, start + n, slot))
            start += n
        return LoRAMapping(segments, torch.tensor(segments, dtype=torch.int64))

    def _slot_for(self, request: LoRARequest, needed: set[int]) -> int:
        adapter_id = request.lora_int_id
        slot = self.slot_lru.get(adapter_id)
        if slot is not None:
            self.slot_lru.move_to_end(adapter_id)
            return slot
        adapter = self._host_adapter(request)
        free = set(range(self.config.max_loras)) - set(self.slot_lru.values())
        if free:
            slot = min(free)
        else:  # evict the least recently used adapter this step does not need (its slot
            # stays free if the write fails)
            victim = next(i for i in self.slot_lru if i not in needed)
            slot = self.slot_lru.pop(victim)
        self._write_slot(slot, adapter)
        self.slot_lru[adapter_id] = slot
        return slot

    def _host_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """From the host cache, or read from disk (evicting the least recently used)."""
        cached = self.host_cache.get(request.lora_int_id)
        if cached is not None:
            self.host_cache.move_to_end(request.lora_int_id)
            return cached[1]
        adapter = load_adapter(request.lora_path, self.hf_config, self.config.max_lora_rank)
        self.num_loads += 1
        self.add(request, adapter)
        return adapter

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for lora in self.linears:
            a, b = lora.a[slot], lora.b[slot]
            a.zero_()
            b.zero_()
            lora.ranks[slot] = 0
            for i, where in enumerate(lora.modules):
                weights = adapter.weights.get(where)
                if weights is None:  # this module is not adapted: rank 0
                    continue
                lora_a, lora_b = weights  # [r, in], [out, r]
                r = lora_a.shape[0]
                a[i, :r] = lora_a
                b[:r, lora.offsets[i] : lora.offsets[i] + lora.widths[i]] = lora_b.T
                lora.ranks[slot, i] = r

    # ---- adapters ------------------------------------------------------------------

    def check_identity(self, request: LoRARequest) -> None:
        """An id names one adapter: refuse a request whose id the host cache holds for
        another name or folder (it would run, and share KV, as that one)."""
        cached = self.host_cache.get(request.lora_int_id)
        if cached is not None and (cached[0].lora_name, cached[0].lora_path) != (
            request.lora_name,
            request.lora_path,
        ):
            raise InvalidRequestError(
                f"lora_request.lora_int_id {request.lora_int_id} is adapter "
                f"{cached[0].lora_name!r} at {cached[0].lora_path}; another adapter needs "
                "another id.",
                "lora_request",
            )

    def add(self, request: LoRARequest, adapter: LoRAAdapter) -> None:
        """Keep an adapter read elsewhere in the host cache (evicting the least recently
        used past `max_cpu_loras`)."""
        self.host_cache.pop(request.lora_int_id, None)
        while len(self.host_cache) >= self.config.max_cpu_loras:
            self.host_cache.popitem(last=False)
        self.host_cache[request.lora_int_id] = (request, adapter)

    def remove(self, adapter_id: int) -> bool:
        """Drop an adapter from its slot and the host cache (the engine calls this once
        no request uses it). Returns whether it was held."""
        held = self.host_cache.pop(adapter_id, None) is not None
        return self.slot_lru.pop(adapter_id, None) is not None or held

    def resident_ids(self) -> list[int]:
        """Adapters in slots, least recently used first."""
        return list(self.slot_lru)
