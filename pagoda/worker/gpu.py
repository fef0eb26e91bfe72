"""What the model runner does only on a GPU: size the KV cache from
`gpu_memory_utilization` (after a profiling forward of the largest step), and replay
decode steps from CUDA graphs.

    GPU memory:  [ weights, CUDA context, others | activations' peak | KV cache | free ]
                 |<------------- gpu_memory_utilization x total ------------>|

Decode steps are many small kernels (a few per layer); launching them one by one
from Python costs more than they run at small batch. `CUDAGraphRunner` captures the
model's forward once per batch-size bucket at startup, over persistent input
buffers; a decode step copies its inputs in, pads up to the bucket and replays.
"""

from __future__ import annotations

import gc
import logging

import torch

from pagoda.attention.context import AttentionMetadata, forward_context
from pagoda.attention.kv_cache import PagedKVCache
from pagoda.config import DeviceConfig
from pagoda.core.sched_output import ScheduledRequest
from pagoda.worker.inputs import prepare_inputs
from pagoda.worker.model_setup import attach_kv_cache, kv_cache_shape

logger = logging.getLogger(__name__)

# vLLM's default largest captured batch: past it, a step's kernels are long enough
# that launching them is cheap next to running them.
MAX_GRAPH_BATCH = 512


@torch.inference_mode()
def gpu_kv_budget(
    model: torch.nn.Module, config: DeviceConfig, max_model_len: int, block_size: int
) -> int:
    """Bytes for the KV cache: `gpu_memory_utilization` of the GPU's memory, less what
    is in use now (the weights, the CUDA context, other processes) and the activation
    peak of a forward over `max_num_batched_tokens` prompt tokens (chunks of at most
    `max_model_len`, over a throwaway cache) with float32 logits and their log-softmax
    at every position (what prompt logprobs of a whole step take: the worst case).
    Raises ValueError when nothing is left."""

    device = next(model.parameters()).device
    gc.collect()  # engines dropped earlier in this process (in cycles) free their memory first
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    tokens = config.max_num_batched_tokens
    lengths = [min(max_model_len, tokens - s) for s in range(0, tokens, max_model_len)]
    shape = kv_cache_shape(model)
    dtype = next(model.parameters()).dtype
    blocks = [-(-n // block_size) for n in lengths]
    cache = PagedKVCache.of(shape, sum(blocks), block_size, dtype, device=device)
    attach_kv_cache(model, cache)
    reqs, first = [], 0
    for i, (n, b) in enumerate(zip(lengths, blocks, strict=True)):
        reqs.append(
            ScheduledRequest(f"profile-{i}", [0] * n, 0, list(range(first, first + b)), None)
        )
        first += b
    input_ids, positions, meta, cu_q = prepare_inputs(reqs, block_size, device)
    with forward_context(meta):
        hidden = model(input_ids, positions)
    model.compute_logits(hidden).float().log_softmax(-1)
    torch.cuda.synchronize(device)
    cache_bytes = cache.data.numel() * cache.data.element_size()
    peak = torch.cuda.max_memory_allocated(device) - before - cache_bytes
    attach_kv_cache(model, PagedKVCache.of(shape, 0, block_size, dtype))
    del cache, hidden  # (the layers held views of it until now)
    torch.cuda.empty_cache()
    budget = int(config.gpu_memory_utilization * total) - in_use - peak
    gib = 1 << 30
    logger.info(
        "GPU memory: %.2f GiB in all; %.2f GiB in use (weights, context, others), an "
        "activation peak of %.2f GiB at %d tokens: %.2f GiB for the KV cache at "
        "gpu_memory_utilization %.2f",
        total / gib, in_use / gib, peak / gib, tokens, budget / gib,
        config.gpu_memory_utilization,
    )  # fmt: skip
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {config.gpu_memory_utilization} leaves no room for the "
            f"KV cache ({in_use / gib:.2f} GiB in use and {peak / gib:.2f} GiB of "
            f"activations of {total / gib:.2f} GiB); raise it or lower max_num_batched_tokens."
        )
    return budget


def graph_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then every multiple of 8 up to the largest."""
    largest = min(max_num_seqs, MAX_GRAPH_BATCH)
    return sorted({b for b in (1, 2, 4, *range(8, largest + 1, 8)) if b <= largest} | {largest})


class CUDAGraphRunner:
    """The model's decode forward as one CUDA graph per batch bucket. Padding rows
    (past the step's own, up to the bucket) write no K/V (slot -1) and attend to one
    token of whatever block their stale table row names; their outputs are dropped."""

    @torch.inference_mode()
    def __init__(
        self, model: torch.nn.Module, max_num_seqs: int, max_blocks: int, device: torch.device
    ) -> None:
        self.buckets = graph_buckets(max_num_seqs)
        largest = self.buckets[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, max_blocks, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()  # one memory pool, largest graph first
        for b in reversed(self.buckets):
            with forward_context(self._meta(b)):
                model(self.input_ids[:b], self.positions[:b])  # warm-up: compiles, picks kernels
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[b] = model(self.input_ids[:b], self.positions[:b])
            self.graphs[b] = graph
        torch.cuda.synchronize(device)
        # (Beyond gpu_memory_utilization's share: the pool holds the activations of a
        # step of at most MAX_GRAPH_BATCH tokens, small next to the profiled peak.)
        logger.info(
            "CUDA graphs captured for decode batches of %s: %.0f MiB of GPU memory",
            self.buckets, (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20,
        )  # fmt: skip

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            num_decodes=b,
            decode_block_tables=self.block_tables[:b],
            decode_seq_lens=self.seq_lens[:b],
            prefill_query_starts=[],
            prefill_query_lens=[],
            prefill_context_lens=[],
            prefill_block_tables=[],
        )

    def can_run(self, meta: AttentionMetadata, inputs_embeds, lora) -> bool:
        """A decode-only step of token ids, without adapters, within the largest bucket."""
        num_tokens = meta.slot_mapping.shape[0]
        return (
            inputs_embeds is None
            and lora is None
            and meta.num_decodes == num_tokens <= self.buckets[-1]
            and meta.decode_block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The hidden states [T, hidden] of a step `can_run` accepted (a view of the
        graph's output: valid until the next replay)."""
        n = input_ids.shape[0]
        b = next(size for size in self.buckets if size >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:b].fill_(-1)
        self.block_tables[:n, : meta.decode_block_tables.shape[1]].copy_(meta.decode_block_tables)
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        self.seq_lens[n:b].fill_(1)
        self.graphs[b].replay()
        return self.outputs[b][:n]
