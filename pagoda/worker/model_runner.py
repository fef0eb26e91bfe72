"""The one place where scheduling decisions become tensors.

Owns the model, the KV cache tensors (allocated once from a byte budget) and
the sampling generator. Each step it turns a `SchedulerOutput` into flat
tensors, runs the model once, computes logits only where a token is sampled,
samples, and copies back exactly the sampled ids (and what pooling requests'
hidden states pool into: embeddings, scores).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagoda.attention.context import forward_context
from pagoda.attention.kv_cache import KV_CACHE_DTYPES, KVShape, PagedKVCache, SwapPool
from pagoda.config import CacheConfig, DeviceConfig, LoRAConfig, ModelConfig
from pagoda.core.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagoda.distributed import SINGLE, ParallelContext
from pagoda.lora.manager import LoRAManager
from pagoda.model_executor.layers.pooler import Pooler, classifier_output
from pagoda.model_executor.models import BIDIRECTIONAL, needs
from pagoda.ops import select_ops
from pagoda.sample.sampler import SamplingTensors, compute_logprobs, sample
from pagoda.worker.draft_model import DraftModel
from pagoda.worker.gpu import CUDAGraphRunner, gpu_kv_budget
from pagoda.worker.inputs import is_decode, prepare_inputs
from pagoda.worker.model_setup import (
    DTYPES,
    attach_kv_cache,
    common_window,
    expanded_kv_bytes_per_token,
    kv_cache_shape,
    load_model,
)

logger = logging.getLogger(__name__)


@dataclass
class StepLogits:
    """What the driver samples from, once a step's forward and gathers are done."""

    reqs: list[ScheduledRequest]  # in the runner's order (decodes first), drafts filled in
    logits: torch.Tensor | None  # [sampled rows, V]: each sampling request's rows in order
    prompt_logits: dict[str, torch.Tensor]  # request id -> [prompt positions scored, V]
    grammar_bitmask: Any  # the step's [rows, ceil(V / 32)] int32 array, or None
    pooled: dict[str, torch.Tensor] | None = None  # pooling request id -> its result


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        lora_config: LoRAConfig | None = None,
        draft_model_config: ModelConfig | None = None,
        parallel: ParallelContext = SINGLE,
        device_config: DeviceConfig = DeviceConfig(),
    ) -> None:
        """`parallel`: this worker's place when the model is split across workers (see
        pagoda.worker.executor); each holds its shard of the model and of every KV
        block, and only the driver samples. `device_config`: the CPU, or a GPU (the
        weights, the KV cache and sampling there; decode steps from CUDA graphs)."""
        self.model_config = model_config
        self.parallel = parallel
        self.block_size = cache_config.block_size
        self.dtype = DTYPES[model_config.dtype]
        self.device = torch.device(device_config.device)
        cfg = model_config.hf_config
        self.vocab_size = cfg["vocab_size"]
        self.ops = select_ops(
            model_config.kernel_backend,
            self.dtype,
            model_config.int8_activations,
            model_config.batch_invariant,
        )
        on_cpu = self.device.type == "cpu"
        self.model = load_model(model_config, self.ops, parallel, on_cpu).to(self.device)
        self.drafter = None  # speculative method "draft": its model and KV pool
        if draft_model_config is not None:
            self.drafter = DraftModel(draft_model_config, self.ops, self.block_size)
        self.lora_manager = (
            LoRAManager(
                self.model,
                model_config.hf_config,
                lora_config,
                self.dtype,
            )
            if lora_config is not None
            else None
        )
        # Embeddings from the hidden states (an embedding model, or a decoder with --task embed).
        self.pooler = None
        if model_config.pooler is not None:
            self.pooler = Pooler(model_config.pooler, self.dtype)
        self.encoder = BIDIRECTIONAL in needs(model_config.architecture)
        budget = cache_config.kv_cache_memory_bytes
        if budget is None and not self.encoder:  # a GPU: what gpu_memory_utilization leaves
            budget = gpu_kv_budget(
                self.model, device_config, model_config.max_model_len, self.block_size
            )
        if self.encoder:  # no KV cache: a prompt runs whole and leaves nothing behind
            self.num_blocks = self._bookkeeping_blocks()
        else:
            self.num_blocks = self._allocate_kv_cache(budget, cache_config.kv_cache_dtype)
        # Where every layer slides (and no draft model reads the same tables), blocks
        # behind the largest window can go back to the pool.
        self.sliding_window = None if self.drafter is not None else common_window(self.model)
        # Decode-only steps of up to this many rows run in one C++ call (0: none do).
        self.decode_loop_max_rows = (
            0 if model_config.enforce_eager else self.model.build_decode_loop()
        )  # (0 when split across workers: the loop runs no collectives)
        if self.decode_loop_max_rows:
            logger.info(
                "decode steps of up to %d rows: one C++ call (csrc/decode_loop.cpp)",
                self.decode_loop_max_rows,
            )
        # Host pool for swapped-out blocks, same layout; empty unless preemption swaps.
        self.num_host_blocks = (
            cache_config.swap_space_bytes // parallel.sum_over_workers(self.bytes_per_block)
            if self.bytes_per_block
            else 0
        )
        self.swap_pool = SwapPool(self.kv_cache, self.num_host_blocks)
        # A GPU: decode steps replay CUDA graphs, captured now for each batch size bucket.
        self.cuda_graphs = None
        # (The Triton backend's: the PyTorch twins' attention is not graph-safe.)
        if self.device.type == "cuda" and not model_config.enforce_eager and self.ops.attention:
            self.cuda_graphs = CUDAGraphRunner(
                self.model,
                device_config.max_num_seqs,
                -(-model_config.max_model_len // self.block_size),
                self.device,
            )
        self.generator = torch.Generator(self.device).manual_seed(model_config.seed)
        # Vision-language models: image hash -> encoder output [rows, hidden]; the
        # scheduler's EncoderCacheManager says what to drop.
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.num_images_encoded = 0

    def _allocate_kv_cache(self, budget_bytes: int, kv_cache_dtype: str) -> int:
        """As many blocks as the budget holds; with a draft model each block also holds
        the draft's K/V for its tokens, in a pool of its own."""
        shape = kv_cache_shape(self.model)
        dtype = KV_CACHE_DTYPES.get(kv_cache_dtype, self.dtype)
        self.bytes_per_block = PagedKVCache.bytes_per_block_of(shape, self.block_size, dtype)
        per_block = self.bytes_per_block
        if self.drafter is not None:
            per_block += self.drafter.bytes_per_block(dtype)
        # The budget is the engine's, over every worker's shard of a block.
        per_block = self.parallel.sum_over_workers(per_block)
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes ({budget_bytes}) is smaller than one block "
                f"({per_block} bytes)."
            )
        self.kv_cache = PagedKVCache.of(
            shape, num_blocks, self.block_size, dtype, device=self.device
        )
        attach_kv_cache(self.model, self.kv_cache)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks, dtype)
        self.kv_cache_dtype_name = (
            kv_cache_dtype if kv_cache_dtype != "auto" else str(dtype).removeprefix("torch.")
        )
        per_token = self.bytes_per_block // self.block_size
        # What K and V of every head would take: MLA's latent rows stand for more.
        self.kv_expanded_bytes_per_token = (
            expanded_kv_bytes_per_token(self.model, dtype) or per_token
        )
        logger.info(
            "KV cache: %d blocks of %d tokens in %s (%.1f MiB, %d bytes per token%s)",
            num_blocks,
            self.block_size,
            self.kv_cache_dtype_name,
            num_blocks * self.bytes_per_block / 2**20,
            per_token,
            ""
            if self.kv_expanded_bytes_per_token == per_token
            else f"; latent rows: expanded K and V would take {self.kv_expanded_bytes_per_token}"
            f", {self.kv_expanded_bytes_per_token / per_token:.1f}x more",
        )
        return num_blocks

    def _bookkeeping_blocks(self) -> int:
        """An encoder's: the scheduler's blocks are bookkeeping only (no prefix caching,
        nothing swapped), so there are plenty of them and no tensors behind them."""
        self.kv_cache = PagedKVCache.of(KVShape(1, 1, 1), 1, self.block_size, self.dtype)
        self.bytes_per_block = 0
        self.kv_cache_dtype_name = "none"
        self.kv_expanded_bytes_per_token = 0
        return 1 << 16

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run the scheduled requests (after `move_blocks`). Each request's result depends
        on its own inputs alone and its K/V writes are idempotent, so the engine may run
        any subset of a step again (how it isolates a request that fails)."""
        return self.sample_step(self.forward_step(sched))

    @torch.inference_mode()
    def forward_step(self, sched: SchedulerOutput) -> StepLogits | None:
        """The part of a step that every rank of a split model runs in step with the
        others: inputs, the forward and every logits gather, in one fixed order. Returns
        the logits the driver samples from (None elsewhere, or when nothing samples).

        When the model is split, an error here may leave the ranks out of step in their
        collectives (see Worker.execute_model); `sample_step` runs no collective."""
        # Decodes (one query token, or one and its drafts) first: attention batches
        # them in one call. Within each, requests of one adapter side by side: its
        # tokens form one segment of the LoRA products.
        for image_hash in sched.encoder_cache_evicted:
            self.encoder_cache.pop(image_hash, None)
        reqs = sorted(sched.scheduled, key=lambda r: (not is_decode(r), r.lora_int_id))
        if not reqs:
            return None
        if self.drafter is not None:
            reqs = self.drafter.propose(reqs)
        input_ids, positions, meta, cu_q = self._prepare_inputs(reqs)
        inputs_embeds = None
        if any(r.mm_features for r in reqs):
            inputs_embeds = self._embed_with_images(reqs, input_ids, cu_q)
        lora = None
        if self.lora_manager is not None:
            lora = self.lora_manager.prepare(
                [r.lora_request for r in reqs], [len(r.token_ids) for r in reqs]
            )
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(meta, inputs_embeds, lora):
            hidden = self.cuda_graphs.run(input_ids, positions, meta)  # [T, hidden]
        else:
            with forward_context(meta, lora):
                if getattr(self.model, "takes_token_types", False):
                    types = _token_types(reqs, cu_q).to(self.device, non_blocking=True)
                    hidden = self.model(input_ids, positions, inputs_embeds, types)
                else:
                    hidden = self.model(input_ids, positions, inputs_embeds)  # [T, hidden]
        if hidden is None:  # a pipeline stage before the last: sent on
            return None
        pooled = self._pool(reqs, hidden, cu_q)
        # Prompt logprobs: each chunk position scores the next prompt token.
        prompt_logits = {}
        for i, r in enumerate(reqs):
            if r.prompt_logprob_targets:
                start = int(cu_q[i])
                rows = hidden[start : start + len(r.prompt_logprob_targets)]
                prompt_logits[r.request_id] = self.model.compute_logits(rows)
        # One logits row per sampled position: a request's last token, or with drafts
        # each of its positions (position j samples what follows draft j).
        sampling = [(i, r) for i, r in enumerate(reqs) if r.sampling_params is not None]
        rows = []
        for i, r in sampling:
            end = int(cu_q[i + 1])
            rows += range(end - 1 - r.num_draft_tokens, end)
        logits = None
        if rows:  # every row (decodes without drafts): no gather, no index to copy
            if len(rows) < hidden.shape[0]:
                hidden = hidden[torch.tensor(rows).to(hidden.device, non_blocking=True)]
            logits = self.model.compute_logits(hidden)  # [rows, V]
        if not self.parallel.is_driver:  # it took part in the gathers; the driver samples
            return None
        return StepLogits(reqs, logits, prompt_logits, sched.grammar_bitmask, pooled)

    @torch.inference_mode()  # workers call it on its own, not through execute_model
    def sample_step(self, step: StepLogits | None) -> ModelRunnerOutput:
        """Tokens (and logprobs) from the step's logits: on the driver only, after every
        collective, so an error here fails only the requests it belongs to."""
        if step is None:
            return ModelRunnerOutput([], [])
        prompt_logprobs = self._prompt_logprobs(step.reqs, step.prompt_logits)
        pooled = step.pooled and {rid: v.cpu() for rid, v in step.pooled.items()}
        sampled = [r for r in step.reqs if r.sampling_params is not None]
        if not sampled:
            return ModelRunnerOutput([], [], prompt_logprobs=prompt_logprobs, pooled=pooled)
        logits = step.logits
        row_reqs, grammar_rows, bitmask_rows = [], [], []
        for r in sampled:
            if r.grammar_row is not None:
                grammar_rows += range(len(row_reqs), len(row_reqs) + r.num_draft_tokens + 1)
                bitmask_rows += range(r.grammar_row, r.grammar_row + r.num_draft_tokens + 1)
            row_reqs += _draft_rows(r) if r.num_draft_tokens else [r]
        st = SamplingTensors.from_requests(row_reqs, self.vocab_size)
        if grammar_rows:
            st.grammar = (grammar_rows, torch.from_numpy(step.grammar_bitmask[bitmask_rows]))
        st = st.to(self.device)
        sampled_ids = sample(logits, st, self.generator)
        row_tokens = sampled_ids.tolist()  # the step's one wait for the device
        row_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in sampled):
            num_top = [r.sampling_params.logprobs or 0 for r in row_reqs]
            row_logprobs = compute_logprobs(logits.float(), sampled_ids, num_top)
        token_ids, logprobs, row = [], [], 0
        for r in sampled:
            n = _num_accepted(r, row_tokens[row : row + r.num_draft_tokens + 1]) + 1
            token_ids.append(row_tokens[row : row + n])
            if row_logprobs is not None and r.sampling_params.logprobs is not None:
                logprobs.append(row_logprobs[row : row + n])
            else:
                logprobs.append(None)
            row += r.num_draft_tokens + 1
        return ModelRunnerOutput(
            [r.request_id for r in sampled],
            token_ids,
            logprobs=logprobs if row_logprobs is not None else None,
            prompt_logprobs=prompt_logprobs,
            pooled=pooled,
        )

    @torch.inference_mode()
    def move_blocks(self, sched: SchedulerOutput) -> None:
        """Swap-outs first (their device blocks may be reused this step), then swap-ins,
        copies, and loads from the disk tier."""
        self.swap_pool.land()
        if sched.blocks_to_swap_out:
            dev, host = zip(*sched.blocks_to_swap_out, strict=True)
            self.swap_pool.swap_out(self.kv_cache, list(dev), list(host))
        if sched.blocks_to_swap_in:
            host, dev = zip(*sched.blocks_to_swap_in, strict=True)
            self.swap_pool.swap_in(self.kv_cache, list(host), list(dev))
        if sched.blocks_to_copy:
            src, dst = zip(*sched.blocks_to_copy, strict=True)
            self.kv_cache.copy_blocks(list(src), list(dst))
            if self.drafter is not None:  # the request keeps its draft positions
                self.drafter.kv_cache.copy_blocks(list(src), list(dst))
        if sched.blocks_to_load:
            block_ids, payloads = zip(*sched.blocks_to_load, strict=True)
            self.kv_cache.write_blocks(list(block_ids), list(payloads))

    def _embed_with_images(
        self, reqs: list[ScheduledRequest], input_ids: torch.Tensor, cu_q: torch.Tensor
    ) -> torch.Tensor:
        """The step's token embeddings with each image's encoder output at its
        placeholder positions. Images not in the encoder cache are encoded first, in one
        batch per image size (a step the engine runs again finds them cached)."""
        new = {f.hash: f for r in reqs for f in r.mm_features if f.hash not in self.encoder_cache}
        by_shape: dict[tuple, list] = {}
        for feature in new.values():
            by_shape.setdefault(tuple(feature.data.shape), []).append(feature)
        for features in by_shape.values():
            pixels = torch.stack([f.data for f in features])
            for f, rows in zip(features, self.model.encode_images(pixels), strict=True):
                self.encoder_cache[f.hash] = rows.clone()  # not a view of the batch
            self.num_images_encoded += len(features)
        embeds = self.model.embed_input_ids(input_ids)  # [T, hidden]
        for i, r in enumerate(reqs):
            start, end = r.num_computed_tokens, r.num_computed_tokens + len(r.token_ids)
            row = int(cu_q[i]) - start  # the flat batch row of this request's position 0
            for f in r.mm_features:
                lo, hi = max(start, f.offset), min(end, f.offset + f.length)
                embeds[row + lo : row + hi] = self.encoder_cache[f.hash][
                    lo - f.offset : hi - f.offset
                ]
        return embeds

    def _prompt_logprobs(self, reqs: list[ScheduledRequest], prompt_logits: dict):
        """For requests asking prompt logprobs: each chunk position's logprob of the next
        prompt token (and the top ones)."""
        out = {}
        for r in reqs:
            if r.request_id in prompt_logits:
                targets = torch.tensor(r.prompt_logprob_targets, device=self.device)
                n = r.prompt_logprobs_n
                logits = prompt_logits[r.request_id].float()
                out[r.request_id] = [
                    entry for _, entry in compute_logprobs(logits, targets, [n] * len(targets))
                ]
        return out or None

    def _pool(self, reqs: list[ScheduledRequest], hidden: torch.Tensor, cu_q: torch.Tensor):
        """Each pooling request's result from its prompt's hidden states (the whole
        prompt is in this step): an embedding, or its classifier's probabilities or
        score; None where the step has no pooling request."""
        pooled = {}
        for i, r in enumerate(reqs):
            p = r.pooling_params
            if p is None:
                continue
            rows = hidden[int(cu_q[i]) : int(cu_q[i + 1])]
            if p.task == "embed":
                pooled[r.request_id] = self.pooler.embed(rows, p)
            else:
                logits = self.model.classify(rows)[0]
                pooled[r.request_id] = classifier_output(logits, p.task)
        return pooled or None

    def _prepare_inputs(self, reqs: list[ScheduledRequest]):
        return prepare_inputs(reqs, self.block_size, self.device)


def _token_types(reqs: list[ScheduledRequest], cu_q: torch.Tensor) -> torch.Tensor:
    """[T] token types: 1 from a scored pair's second text on (BERT's segments), else 0."""
    types = torch.zeros(int(cu_q[-1]), dtype=torch.int64)
    for i, r in enumerate(reqs):
        start = r.pooling_params and r.pooling_params.pair_start
        if start:
            types[int(cu_q[i]) + start : int(cu_q[i + 1])] = 1
    return types


def _draft_rows(r: ScheduledRequest) -> list[ScheduledRequest]:
    """The request as its sampler sees it at each drafted position: position j follows
    drafts 0..j-1, as if they had been accepted (penalties, min_tokens, bad words and a
    seed's draw all follow the output so far), so a draft is kept exactly when the
    target samples it, and what is emitted is what decoding one token a step emits."""
    drafts = r.draft_token_ids
    return [
        replace(
            r,
            num_output_tokens=r.num_output_tokens + j,
            output_token_ids=None
            if r.output_token_ids is None
            else r.output_token_ids + drafts[:j],
        )
        for j in range(r.num_draft_tokens + 1)
    ]


def _num_accepted(r: ScheduledRequest, sampled: list[int]) -> int:
    """Drafts kept: the longest run that the target's samples at their positions match.
    (For a point-mass draft, as n-gram lookup is, this is rejection sampling: draft x
    survives with probability p(x), and a rejected one is replaced by a sample of p
    without x.)"""
    drafts = r.draft_token_ids
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return n
