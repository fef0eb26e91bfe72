"""Offline throughput: pagoda (continuous, dynamic or static batching) and Hugging Face
`generate()` with static batching, on the same workload, each in its own process.

Same engine, model code and kernels in all three pagoda modes, so their ratio
isolates scheduling:
- static (gen 1): fixed batches in arrival order; a batch starts when the previous
  one has finished (its longest request) and all its members have arrived;
- dynamic (gen 2): when the engine is idle, a batch forms from the queue, up to
  `batch_size` or once the oldest queued request has waited `max_queue_delay`;
  nobody joins until the batch finishes;
- continuous (gen 3): requests join and leave at every step.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import resource
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from pagoda.bench.metrics import RequestTimeline, compute_metrics
from pagoda.bench.workloads import BenchRequest

BATCHING_MODES = ("continuous", "dynamic", "static")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_pagoda(
    engine_kwargs: dict[str, Any],
    reqs: list[BenchRequest],
    batching: str = "continuous",
    batch_size: int = 64,
    max_queue_delay: float = 0.05,
    progress: bool = True,
    lora_requests: list | None = None,
) -> dict[str, Any]:
    """`lora_requests`: the LoRARequest (or None) of each request, with enable_lora set
    in `engine_kwargs`."""
    from tqdm.auto import tqdm

    from pagoda import EngineArgs, LLMEngine, SamplingParams

    if batching not in BATCHING_MODES:
        raise ValueError(f"batching must be one of {BATCHING_MODES}, got {batching!r}.")
    engine = LLMEngine(EngineArgs(**engine_kwargs))
    loras = lora_requests or [None] * len(reqs)
    _warm_up_pagoda(engine, reqs, loras)
    sched, kv = engine.scheduler, engine.kv_cache_manager
    max_model_len = engine.max_model_len
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_time)
    not_arrived = deque(order)
    queue: deque[int] = deque()  # arrived, not yet handed to the engine
    in_engine: set[str] = set()
    timelines = [
        RequestTimeline(0.0, prompt_len=len(r.prompt_token_ids), output_len=r.output_len)
        for r in reqs
    ]
    seen_tokens = [0] * len(reqs)
    outputs_by_id: dict[int, list[int]] = {}
    steps, peak_blocks = 0, 0
    paged_eff, contiguous_eff, exact_eff = [], [], []
    bar = tqdm(total=len(reqs), desc=f"pagoda {batching}", disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()

    def admit(i: int) -> None:
        r = reqs[i]
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        prompt = {"prompt_token_ids": r.prompt_token_ids}
        engine.add_request(str(i), prompt, params, lora_request=loras[i])
        in_engine.add(str(i))

    while not_arrived or queue or in_engine:
        now = time.perf_counter() - start
        while not_arrived and reqs[not_arrived[0]].arrival_time <= now:
            i = not_arrived.popleft()
            timelines[i].arrival = start + reqs[i].arrival_time
            queue.append(i)
        if batching == "continuous":
            while queue:
                admit(queue.popleft())
        elif not in_engine and queue:
            ready = len(queue) >= batch_size or not not_arrived
            if batching == "dynamic":
                ready = ready or now - reqs[queue[0]].arrival_time >= max_queue_delay
            if ready:
                for _ in range(min(batch_size, len(queue))):
                    admit(queue.popleft())
        if not in_engine:
            if not_arrived:
                time.sleep(max(0.0, min(0.01, reqs[not_arrived[0]].arrival_time - now)))
            continue
        outputs = engine.step()
        t = time.perf_counter()
        steps += 1
        running = sched.running
        if running:
            held = sum(r.num_computed_tokens for r in running)
            used = kv.block_pool.num_used_blocks
            peak_blocks = max(peak_blocks, used)
            paged_eff.append(held / max(1, used * kv.block_size))
            contiguous_eff.append(held / (len(running) * max_model_len))
            exact_eff.append(
                held / sum(r.num_prompt_tokens + r.sampling_params.max_tokens for r in running)
            )
        for out in outputs:
            i = int(out.request_id)
            n = len(out.outputs[0].token_ids)
            timelines[i].token_times += [t] * (n - seen_tokens[i])
            seen_tokens[i] = n
            if out.finished:
                in_engine.discard(out.request_id)
                outputs_by_id[i] = out.outputs[0].token_ids
                bar.update(1)
    duration = time.perf_counter() - start
    bar.close()
    stats = engine.get_stats()
    result = compute_metrics(timelines, duration)
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    result.update(
        system=f"pagoda-{batching}",
        steps=steps,
        peak_rss_mib=_peak_rss_mib(),
        kv_blocks_total=stats.kv_cache.num_blocks_total,
        kv_blocks_peak=peak_blocks,
        kv_efficiency_paged=mean(paged_eff),
        kv_efficiency_contiguous_max_len=mean(contiguous_eff),
        kv_efficiency_contiguous_exact=mean(exact_eff),
        preemptions=stats.num_preemptions,
        prefix_cache_hit_rate=stats.kv_cache.prefix_cache_hit_rate,
        prompt_tokens_computed=stats.num_prompt_tokens,
        batching=batching,
        batch_size=batch_size if batching != "continuous" else None,
        # Equal digests: the same tokens (e.g. with and without speculative decoding).
        outputs_digest=hashlib.sha256(
            repr([outputs_by_id[i] for i in range(len(reqs))]).encode()
        ).hexdigest()[:16],
    )
    if stats.spec_decoding is not None:
        spec = stats.spec_decoding
        result.update(
            spec_acceptance_rate=spec.acceptance_rate,
            spec_acceptance_rate_per_pos=spec.acceptance_rate_per_pos,
            spec_mean_accepted_length=spec.mean_accepted_length,
        )
    return result


def _warm_up_pagoda(engine, reqs: list[BenchRequest], loras: list) -> None:
    """One short batch first, so one-time costs (thread pools, allocator, reading LoRA
    adapters from disk) are not timed."""
    from pagoda import SamplingParams

    first_of_each_adapter = [loras.index(lora) for lora in dict.fromkeys(loras) if lora]
    for i in dict.fromkeys([*range(min(4, len(reqs))), *first_of_each_adapter]):
        engine.add_request(
            f"warmup-{i}",
            {"prompt_token_ids": reqs[i].prompt_token_ids[:64]},
            SamplingParams(max_tokens=4, ignore_eos=True),
            lora_request=loras[i],
        )
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_cache_manager.block_pool.reset_prefix_cache()  # no head start from the warm-up


class _StepClock:
    """A `generate()` streamer that only timestamps each decoding step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf(
    model_path: str,
    is_gguf: bool,
    dtype: str,
    reqs: list[BenchRequest],
    batch_size: int,
    progress: bool = True,
    device: str = "cpu",
) -> dict[str, Any]:
    """Hugging Face `generate()` as a user writes it: arrival order, batches of
    `batch_size`, left padding, each batch runs to its longest output (on `device`)."""
    import os

    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype
    ]
    if is_gguf:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch_dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    model.to(device).eval()
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    with torch.inference_mode():  # warm-up, untimed
        model.generate(
            torch.tensor([reqs[0].prompt_token_ids[:64]], device=device),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=pad_id,
        )
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_time)
    timelines = [
        RequestTimeline(0.0, prompt_len=len(r.prompt_token_ids), output_len=r.output_len)
        for r in reqs
    ]
    bar = tqdm(total=len(reqs), desc=f"hf B={batch_size}", disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        wait = max(reqs[i].arrival_time for i in batch) - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        width = max(len(reqs[i].prompt_token_ids) for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            p = reqs[i].prompt_token_ids
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        max_new = max(reqs[i].output_len for i in batch)
        clock = _StepClock()
        with torch.inference_mode():
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_id,
                streamer=clock,
            )
        for i in batch:
            timelines[i].arrival = start + reqs[i].arrival_time
            timelines[i].token_times = clock.times[: reqs[i].output_len]
        bar.update(len(batch))
    duration = time.perf_counter() - start
    bar.close()
    result = compute_metrics(timelines, duration)
    result.update(
        system=f"hf-static-B{batch_size}", peak_rss_mib=_peak_rss_mib(), batch_size=batch_size,
        device=device,
    )  # fmt: skip
    return result


def _call(fn_name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    return globals()[fn_name](**kwargs)


def in_subprocess(fn_name: str, **kwargs: Any) -> dict[str, Any]:
    """Run one system in a fresh process: clean peak RSS, no shared caches or threads."""
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_call, fn_name, kwargs).result()
