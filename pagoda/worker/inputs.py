"""A step's flat inputs: token ids, positions, slot mapping and the attention
metadata of a list of scheduled requests (decodes first), for the model runner, its
draft model and its GPU twin."""

from __future__ import annotations

import itertools

import torch

from pagoda.attention.context import AttentionMetadata
from pagoda.core.sched_output import ScheduledRequest


def prepare_inputs(
    reqs: list[ScheduledRequest], block_size: int, device: torch.device = torch.device("cpu")
):
    """Flat inputs and attention metadata for `reqs`, decodes first: (input_ids,
    positions, metadata, cu_q: each request's first row and the end). Built on the
    host; what the model reads is then copied to `device` (cu_q stays on the host)."""
    bs = block_size
    query_lens = torch.tensor([len(r.token_ids) for r in reqs])
    context_lens = torch.tensor([r.num_computed_tokens for r in reqs])
    cu_q = torch.zeros(len(reqs) + 1, dtype=torch.int64)
    torch.cumsum(query_lens, 0, out=cu_q[1:])
    max_blocks = max(len(r.block_ids) for r in reqs)
    block_tables = torch.tensor([r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in reqs])
    block_tables.clamp_(min=0)  # blocks behind every window (NO_BLOCK): never read
    input_ids = torch.tensor(list(itertools.chain.from_iterable(r.token_ids for r in reqs)))
    num_tokens = input_ids.shape[0]
    # Per token: which request, and its position within that request's sequence.
    req_idx = torch.repeat_interleave(torch.arange(len(reqs)), query_lens)
    positions = torch.arange(num_tokens) - cu_q[req_idx] + context_lens[req_idx]
    slot_mapping = block_tables[req_idx, positions // bs] * bs + positions % bs
    # Decode rows are tokens: a request's drafts are decodes at successive positions,
    # each seeing the context up to itself, exactly as decoding them one by one would.
    num_decode_reqs = sum(1 for r in reqs if is_decode(r))
    num_decodes = int(cu_q[num_decode_reqs])
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decodes=num_decodes,
        decode_block_tables=block_tables[req_idx[:num_decodes]],
        decode_seq_lens=positions[:num_decodes] + 1,
        prefill_query_starts=cu_q[num_decode_reqs:-1].tolist(),
        prefill_query_lens=query_lens[num_decode_reqs:].tolist(),
        prefill_context_lens=context_lens[num_decode_reqs:].tolist(),
        prefill_block_tables=[
            block_tables[i, : len(reqs[i].block_ids)] for i in range(num_decode_reqs, len(reqs))
        ],
        prefill_starts=cu_q[num_decode_reqs:-1],
        prefill_lens=query_lens[num_decode_reqs:],
        prefill_contexts=context_lens[num_decode_reqs:],
        prefill_tables=block_tables[num_decode_reqs:],
    )
    if device.type != "cpu":
        # (From pageable memory an asynchronous copy is staged at once: no wait for
        # the device, and the host tensors may go.)
        input_ids = input_ids.to(device, non_blocking=True)
        positions = positions.to(device, non_blocking=True)
        meta = meta.to(device)
    return input_ids, positions, meta, cu_q


def is_decode(r: ScheduledRequest) -> bool:
    return len(r.token_ids) == 1 or r.num_draft_tokens > 0
