"""One flat context per step, entered with `with forward_context(meta, lora):`.

Models keep `forward(input_ids, positions)`; only the attention layer reads the
attention metadata, and only linears with adapter slots read the LoRA mapping.
The context is per thread: two engines stepping on two threads of one process
never see each other's batch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagoda.lora.manager import LoRAMapping


@dataclass
class AttentionMetadata:
    """The batch's layout for attention. Decode requests (one query token) come first:

    tokens  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]
              decodes     prefill 0   prefill 1
    """

    slot_mapping: torch.Tensor  # [T] int64: where each token's K/V is written
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with 0
    decode_seq_lens: torch.Tensor  # [num_decodes] int64: context incl. the new token
    # Prefills (chunks of any length over any context), one entry per request:
    prefill_query_starts: list[int]  # token offsets into the flat batch
    prefill_query_lens: list[int]
    prefill_context_lens: list[int]  # tokens already in the cache before this chunk
    prefill_block_tables: list[torch.Tensor]  # [num_blocks] int64 each
    # The same prefills as tensors on the model's device, for kernels that take them
    # all at once (the GPU's): [C] each, and the block tables [C, max_blocks].
    prefill_starts: torch.Tensor | None = None
    prefill_lens: torch.Tensor | None = None
    prefill_contexts: torch.Tensor | None = None
    prefill_tables: torch.Tensor | None = None

    def to(self, device: torch.device) -> AttentionMetadata:
        """The tensors a kernel reads, on `device` (the host lists stay)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return replace(
            self,
            slot_mapping=move(self.slot_mapping),
            decode_block_tables=move(self.decode_block_tables),
            decode_seq_lens=move(self.decode_seq_lens),
            prefill_starts=move(self.prefill_starts),
            prefill_lens=move(self.prefill_lens),
            prefill_contexts=move(self.prefill_contexts),
            prefill_tables=move(self.prefill_tables),
        )


class _Context(threading.local):
    meta: AttentionMetadata | None = None
    lora: LoRAMapping | None = None


_context = _Context()


@contextmanager
def forward_context(meta: AttentionMetadata, lora: LoRAMapping | None = None) -> Iterator[None]:
    """`lora`: the step's adapter segments (None: every token runs the base model)."""
    context = _context
    previous = context.meta, context.lora
    context.meta, context.lora = meta, lora
    try:
        yield
    finally:
        context.meta, context.lora = previous


def get_attention_metadata() -> AttentionMetadata:
    meta = _context.meta
    if meta is None:
        raise RuntimeError("attention called outside forward_context()")
    return meta


def get_lora_mapping() -> LoRAMapping | None:
    return _context.lora
