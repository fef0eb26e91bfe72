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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

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
    _query_rows: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def query_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query token as a decode: (block tables [T, max_blocks], context lengths
        [T] including the token), built once per step for every layer that asks."""
        if self._query_rows is None:
            if not self.prefill_query_lens:
                self._query_rows = self.decode_block_tables, self.decode_seq_lens
            else:
                width = max(
                    [self.decode_block_tables.shape[1]]
                    + [len(t) for t in self.prefill_block_tables]
                )
                tables = [
                    F.pad(self.decode_block_tables, (0, width - self.decode_block_tables.shape[1]))
                ]
                lens = [self.decode_seq_lens]
                for qlen, ctx, table in zip(
                    self.prefill_query_lens, self.prefill_context_lens, self.prefill_block_tables,
                    strict=True,
                ):  # fmt: skip
                    tables.append(F.pad(table, (0, width - len(table))).expand(qlen, width))
                    lens.append(torch.arange(ctx + 1, ctx + qlen + 1))
                self._query_rows = torch.cat(tables), torch.cat(lens)
        return self._query_rows

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
            _query_rows=None,
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
