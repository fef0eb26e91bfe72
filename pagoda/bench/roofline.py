"""`pagoda bench roofline`: each engine phase (a prefill chunk, decode at each batch size)
as a fraction of this machine's limit for it.

A step's limit is the roofline's: max(bytes it must read / read bandwidth, FLOPs it must
do / the peak of the path its linears take), both from the loaded model and the KV
cache's layout (`ModelCost`), the machine's figures from `machine_limits`. A fraction of
1.0 would be a step that only streams its bytes or only does its arithmetic, at the
measured peak. What the limit leaves out is the gap: the engine around the forward
(scheduling, sampling, outputs), small ops, kernels below their roof, and past the
integer paths' rows the dequantization of block weights before oneDNN's GEMM.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from pagoda.model_executor.layers.attention import Attention
from pagoda.model_executor.layers.fused_moe import FusedMoE
from pagoda.model_executor.layers.linear import Embedding
from pagoda.model_executor.layers.rotary import RotaryEmbedding
from pagoda.model_executor.quantization import PER_CHANNEL, StackedWeight
from pagoda.ops.cpu import W8A8_INT_MAX_ROWS, quant_linear_max_rows
from pagoda.worker.model_setup import DTYPES

FLOAT_PATHS = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def limit_seconds(
    num_bytes: float, flops: float, read_gbs: float, peak_gflops: float
) -> tuple[float, str]:
    """(the roofline's time for a step: max(bytes / bandwidth, FLOPs / peak), which of
    the two bounds it: "memory" or "compute")."""
    memory_s = num_bytes / (read_gbs * 1e9)
    compute_s = flops / (peak_gflops * 1e9)
    return (memory_s, "memory") if memory_s >= compute_s else (compute_s, "compute")


@dataclass
class ModelCost:
    """What one step of a loaded model reads and computes.

    Bytes: every parameter, buffer and quantized weight (at its stored size: qs, d, m,
    qh) is read whole each step, except lookup tables, read for the rows used (an
    embedding row and rope's cos and sin rows per token; a tied embedding is counted
    once, whole, as the lm_head), and MoE experts, counted as the most a step can
    read: min(experts, rows x top_k) of them. KV: every sequence reads its context's K and V once.
    FLOPs: 2 x the multiply-adds of the linears (the lm_head only on sampled rows: the
    runner computes logits nowhere else), plus attention's 4 x context x heads x
    head_dim per layer and row (QK^T and PV; a sliding window caps the context).
    """

    whole_bytes: int
    bytes_per_row: int
    linear_macs_per_row: int  # every linear but the lm_head, the experts' own aside
    lm_head_macs_per_row: int
    attention: list[tuple[int, int | None]]  # a layer's (heads x head_dim, window)
    experts: list[tuple[int, int, int, int]]  # a MoE layer's (experts, top_k, bytes, MACs) each
    kv_bytes_per_token: int  # every layer's K and V
    largest_linear: tuple[int, int]  # [out, in], the layers' (not the lm_head)
    weight_format: str | None  # the largest linear's block format or "w8a8"; None: float

    def _per_layer_context(self, context: int) -> int:
        """Tokens of context summed over the attention layers (windows applied)."""
        return sum(min(context, window or context) for _, window in self.attention)

    def step_bytes(self, rows: int, kv_tokens: list[int]) -> int:
        """Bytes a step of `rows` token rows reads, its sequences holding `kv_tokens`
        tokens of K/V each (their contexts, or a prefill chunk's own, written once)."""
        kv_per_layer = self.kv_bytes_per_token // max(1, len(self.attention))
        kv = sum(kv_per_layer * self._per_layer_context(c) for c in kv_tokens)
        experts = sum(min(n, rows * k) * b for n, k, b, _ in self.experts)
        return self.whole_bytes + rows * self.bytes_per_row + experts + kv

    def step_flops(self, contexts: list[int], sampled_rows: int) -> int:
        """FLOPs of a step whose rows attend over `contexts` tokens each (one entry a
        row), `sampled_rows` of them through the lm_head."""
        macs = len(contexts) * self.linear_macs_per_row
        macs += sum(k * m for _, k, _, m in self.experts) * len(contexts)
        macs += sampled_rows * self.lm_head_macs_per_row
        for heads_dim, window in self.attention:
            macs += 2 * heads_dim * sum(min(c, window or c) for c in contexts)
        return 2 * macs

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def model_cost(model: nn.Module, kv_bytes_per_token: int) -> ModelCost:
    """The `ModelCost` of a loaded pagoda model (see ModelCost for what is counted)."""
    seen: set[int] = set()  # storages counted already (a tied weight is one tensor)

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or t.numel() == 0 or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return total

    def own_tensors(module: nn.Module) -> list:
        tensors = [t for _, t in module.named_parameters(recurse=False)]
        tensors += [t for _, t in module.named_buffers(recurse=False)]
        qweights = [getattr(module, "qweight", None)]  # a Linear's or an Embedding's
        qweights += (getattr(module, "q13", None) or []) + (getattr(module, "q2", None) or [])
        for q in qweights:  # (a FusedMoE's experts, one QuantizedWeight each)
            tensors += [] if q is None else list(q.parts())
        return tensors

    lm_head = getattr(model, "lm_head", None)
    lm_head_macs = 0
    whole = 0
    if lm_head is not None:  # first: a tied embedding's table is counted here, once
        whole = nbytes(own_tensors(lm_head))
        lm_head_macs = lm_head.in_features * lm_head.out_features
    per_row = linear_macs = 0
    attention, experts = [], []
    largest, largest_module = (0, 0), None
    for module in model.modules():
        if module is lm_head:
            continue
        if isinstance(module, Embedding | RotaryEmbedding):  # lookup tables: rows used
            per_row += sum(nbytes([t]) // t.shape[0] for t in own_tensors(module) if t is not None)
        elif isinstance(module, FusedMoE):
            expert_bytes = nbytes(own_tensors(module)) // module.num_experts
            hidden = module.w2.shape[1] if module.w2 is not None else module.q2[0].shape[0]
            macs = 3 * module.intermediate_size * hidden  # gate and up, then down
            experts.append((module.num_experts, module.top_k, expert_bytes, macs))
        else:
            whole += nbytes(own_tensors(module))
        if isinstance(module, nn.Linear):
            linear_macs += module.in_features * module.out_features
            shape = (module.out_features, module.in_features)
            if shape[0] * shape[1] > largest[0] * largest[1]:
                largest, largest_module = shape, module
        if isinstance(module, Attention):
            attention.append((module.num_heads * module.head_dim, module.sliding_window or None))
    qweight = getattr(largest_module, "qweight", None)
    return ModelCost(
        whole_bytes=whole,
        bytes_per_row=per_row,
        linear_macs_per_row=linear_macs,
        lm_head_macs_per_row=lm_head_macs,
        attention=attention,
        experts=experts,
        kv_bytes_per_token=kv_bytes_per_token,
        largest_linear=largest,
        weight_format=qweight.format if qweight is not None else None,
    )


def largest_qweight(model: nn.Module, cost: ModelCost):
    """The QuantizedWeight of the layers' largest linear, or None (float weights)."""
    lm_head = getattr(model, "lm_head", None)
    for module in model.modules():
        if module is lm_head or not isinstance(module, nn.Linear):
            continue
        if (module.out_features, module.in_features) == cost.largest_linear:
            qweight = getattr(module, "qweight", None)
            if isinstance(qweight, StackedWeight):  # (parts of two formats: the largest)
                return max(qweight.pieces, key=lambda piece: piece.shape[0])
            return qweight
    return None


def int8_max_rows(qweight, model_config, ops_backend: str) -> int:
    """The most rows at which the engine runs the layers' largest linear (`qweight`,
    None: float) on integers (int8 activations: pagoda.ops.cpu's quant_linear paths), 0
    where it never does."""
    if qweight is None or ops_backend != "cpu" or not model_config.int8_activations:
        return 0
    if model_config.batch_invariant:  # integer products at every row count
        return 1 << 62
    if qweight.format == PER_CHANNEL:
        return W8A8_INT_MAX_ROWS
    return quant_linear_max_rows(DTYPES[model_config.dtype], qweight)


# ---- the engine's steps, timed ----------------------------------------------------------


def _prompt(rng: random.Random, vocab: list[int], length: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [rng.choice(vocab) for _ in range(length)]}


def time_prefill(engine, vocab: list[int], num_tokens: int, repeats: int, rng) -> float:
    """Median seconds of a step that prefills one fresh `num_tokens`-token prompt (and
    samples its first token), after one untimed step. Fresh random prompts: no prefix
    cache hits."""
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(repeats + 1):
        engine.add_request(f"prefill-{i}", _prompt(rng, vocab, num_tokens), params)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        if engine.has_unfinished_requests():
            raise RuntimeError(f"a {num_tokens}-token prompt did not prefill in one step.")
    return statistics.median(times[1:])


def time_decode(
    engine, vocab: list[int], batch: int, prompt_len: int, warmup: int, steps: int, rng
) -> tuple[float, list[list[int]]]:
    """(median seconds of `steps` decode steps of `batch` sequences, after `warmup`
    untimed ones; for each timed step, every sequence's context: the tokens its row
    attends over)."""
    from pagoda import SamplingParams

    room = engine.max_model_len - prompt_len  # tokens a sequence may still generate
    if room < 1 + warmup + steps:
        raise ValueError(
            f"a {prompt_len}-token prompt leaves {room} of max_model_len "
            f"({engine.max_model_len}) for {1 + warmup + steps} tokens: lower --context-len."
        )
    params = SamplingParams(temperature=0.0, max_tokens=room, ignore_eos=True)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, _prompt(rng, vocab, prompt_len), params)
    generated = dict.fromkeys(ids, 0)
    times, contexts = [], []

    def step() -> float:
        start = time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - start
        for o in outs:
            generated[o.request_id] = len(o.outputs[0].token_ids)  # (cumulative outputs)
        return seconds

    try:
        while min(generated.values()) == 0:  # prefill, chunked as the scheduler likes
            step()
        for i in range(warmup + steps):
            before = dict(generated)
            seconds = step()
            if any(generated[r] != before[r] + 1 for r in ids):
                raise RuntimeError(
                    f"a decode step of batch {batch} did not advance every sequence by "
                    "one token (max_num_seqs, or a KV cache too small for the batch?)."
                )
            if i >= warmup:  # a row's input is its latest token, after its prompt
                times.append(seconds)
                contexts.append([prompt_len + before[r] for r in ids])
    finally:
        engine.abort_request(ids)
    return statistics.median(times), contexts


# ---- the command ------------------------------------------------------------------------


def phase_row(
    phase: str, seconds: float, num_bytes: float, flops: float, path: str, limits, **extra
) -> dict[str, Any]:
    """One table row: the measured step against its roofline limit."""
    peak = limits.peaks_gflops[path]
    limit_s, bound = limit_seconds(num_bytes, flops, limits.read_gbs, peak)
    return {
        "phase": phase,
        **extra,
        "path": path,
        "measured_ms": 1000 * seconds,
        "limit_ms": 1000 * limit_s,
        "memory_ms": 1000 * num_bytes / (limits.read_gbs * 1e9),
        "compute_ms": 1000 * flops / (peak * 1e9),
        "bound": bound,
        "fraction": limit_s / seconds,
        "bytes": num_bytes,
        "flops": flops,
        "intensity": flops / num_bytes,
        "achieved_gflops": flops / seconds / 1e9,
        "peak_gflops": peak,
    }


def run_roofline(
    engine_kwargs: dict[str, Any],
    batch_sizes: list[int],
    context_len: int,
    prefill_tokens: int,
    decode_steps: int = 8,
    repeats: int = 3,
    read_bytes: int = 1 << 30,
    seed: int = 42,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Load the engine, measure the machine (with the engine's threads), time a prefill
    chunk and decode at each batch size: ({"model": ModelCost, "limits": MachineLimits,
    as JSON}, one row per phase). Raises ValueError where the model does not run in this
    process on the CPU (split across workers, on a GPU) or decodes several tokens a step."""
    from pagoda import EngineArgs, LLMEngine
    from pagoda.bench.machine_limits import measure_limits

    if engine_kwargs.get("speculative_config"):
        raise ValueError("bench roofline times plain decode steps: no speculative_config.")
    engine = LLMEngine(EngineArgs(**engine_kwargs))
    try:
        runner = engine.model_runner
        model = getattr(runner, "model", None)
        if model is None or runner.device.type != "cpu":
            raise ValueError("bench roofline needs the model in this process, on the CPU.")
        cost = model_cost(model, runner.bytes_per_block // engine.cache_config.block_size)
        dtype = engine.model_config.dtype
        float_path = FLOAT_PATHS[dtype]
        qweight = largest_qweight(model, cost)
        limits = measure_limits(
            cost.largest_linear,
            qweight,
            float_peaks=tuple(dict.fromkeys(("bf16", "fp32", float_path))),
            read_bytes=read_bytes,
            repeats=repeats,
        )
        int8_rows = int8_max_rows(qweight, engine.model_config, runner.ops.backend)
        if "int8" not in limits.peaks_gflops:
            int8_rows = 0  # (the engine lacks the kernel then, too)

        def path(rows: int) -> str:
            return "int8" if rows <= int8_rows else float_path

        special = set(engine.tokenizer.all_special_ids)
        vocab = [i for i in range(len(engine.tokenizer)) if i not in special]
        rng = random.Random(seed)
        num_tokens = min(
            prefill_tokens, engine.scheduler_config.max_num_batched_tokens, engine.max_model_len - 1
        )
        seconds = time_prefill(engine, vocab, num_tokens, repeats, rng)
        rows = [
            phase_row(
                "prefill",
                seconds,
                cost.step_bytes(num_tokens, [num_tokens]),
                cost.step_flops(list(range(1, num_tokens + 1)), 1),
                path(num_tokens),
                limits,
                rows=num_tokens,
                context=num_tokens,
                tok_s=num_tokens / seconds,
            )
        ]
        warmup = 2
        # Timed step i (from 0) attends over prompt_len + 1 + warmup + i tokens: prompts
        # this long put the timed steps' mean context at context_len (+0.5 for even steps).
        prompt_len = max(1, context_len - 1 - warmup - (decode_steps - 1) // 2)
        for batch in batch_sizes:
            seconds, contexts = time_decode(
                engine, vocab, batch, prompt_len, warmup, decode_steps, rng
            )
            # The timed steps' mean: each step's context is a token longer than the last.
            num_bytes = statistics.mean(cost.step_bytes(batch, c) for c in contexts)
            flops = statistics.mean(cost.step_flops(c, batch) for c in contexts)
            context = statistics.mean(statistics.mean(c) for c in contexts)
            rows.append(
                phase_row(
                    "decode",
                    seconds,
                    num_bytes,
                    flops,
                    path(batch),
                    limits,
                    rows=batch,
                    context=context,
                    tok_s=batch / seconds,
                )
            )
    finally:
        engine.shutdown()
    return {"model": cost.to_json(), "limits": limits.to_json()}, rows


def format_roofline(found: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The machine's figures, then one line per phase."""
    limits = found["limits"]
    peaks = ", ".join(f"{k} {v:,.0f}" for k, v in limits["peaks_gflops"].items())
    flags = [name for name, on in limits["flags"].items() if on]
    lines = [
        f"machine: {limits['cpu']} ({', '.join(flags) or 'no AMX/AVX512-BF16/VNNI'}), "
        f"{limits['num_threads']} threads",
        f"  read {limits['read_gbs']:.1f} GB/s; peaks (GFLOP/s; int8 GOP/s) {peaks}",
    ]
    if limits["int8_missing"]:
        lines.append(f"  int8: none ({limits['int8_missing']})")
    if limits["bf16_no_amx_gflops"] is not None:
        lines.append(f"  bf16 without AMX: {limits['bf16_no_amx_gflops']:,.0f} GFLOP/s")
    else:
        lines.append(f"  {limits['no_amx_note']}")
    model = found["model"]
    lines.append(
        f"model: {model['whole_bytes'] / 2**20:.1f} MiB read each step, "
        f"{model['kv_bytes_per_token']:,} KV bytes per token, "
        f"weights {model['weight_format'] or 'float'}"
    )
    header = (
        f"{'phase':<8}{'rows':>6}{'context':>9}{'path':>6}{'ms/step':>10}{'limit ms':>10}"
        f"{'bound':>9}{'of limit':>10}{'tok/s':>10}"
    )
    lines += ["", header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['phase']:<8}{r['rows']:>6}{r['context']:>9.0f}{r['path']:>6}"
            f"{r['measured_ms']:>10.2f}{r['limit_ms']:>10.2f}{r['bound']:>9}"
            f"{100 * r['fraction']:>9.1f}%{r['tok_s']:>10.1f}"
        )
    return "\n".join(lines)
