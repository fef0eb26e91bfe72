"""Per-step latency: prefill and decode step times for batch sizes 1..N, TTFT/TPOT at batch 1."""

from __future__ import annotations

import random
import time
from typing import Any


def run_latency(
    engine_kwargs: dict[str, Any],
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    seed: int = 42,
) -> list[dict[str, Any]]:
    from pagoda import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine(EngineArgs(**engine_kwargs))
    special = set(engine.tokenizer.all_special_ids)
    vocab = [i for i in range(len(engine.tokenizer)) if i not in special]
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rows = []
    for batch in batch_sizes:
        for i in range(batch):
            prompt = [rng.choice(vocab) for _ in range(input_len)]
            engine.add_request(f"{batch}-{i}", {"prompt_token_ids": prompt}, params)
        start = time.perf_counter()
        step_times, first_token, started = [], None, set()
        num_prefill_steps = 0
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            step_times.append(time.perf_counter() - t0)
            started.update(o.request_id for o in outs if o.outputs[0].token_ids)
            if first_token is None and started:
                first_token = time.perf_counter() - start
            if not num_prefill_steps and len(started) == batch:  # every prompt is in
                num_prefill_steps = len(step_times)
        total = time.perf_counter() - start
        decode = step_times[num_prefill_steps:]
        rows.append(
            {
                "batch_size": batch,
                "input_len": input_len,
                "output_len": output_len,
                "prefill_s": sum(step_times[:num_prefill_steps]),
                "prefill_tok_s": batch * input_len / sum(step_times[:num_prefill_steps]),
                "decode_step_ms": 1000 * sum(decode) / max(1, len(decode)),
                "decode_tok_s": batch * len(decode) / sum(decode) if decode else 0.0,
                "ttft_ms": 1000 * first_token,
                "tpot_ms": 1000 * (total - first_token) / max(1, output_len - 1),
            }
        )
    return rows


def format_latency(rows: list[dict[str, Any]]) -> str:
    header = f"{'batch':>6}{'prefill s':>11}{'prefill tok/s':>15}{'decode step ms':>16}{'decode tok/s':>14}{'TTFT ms':>10}{'TPOT ms':>10}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['batch_size']:>6}{r['prefill_s']:>11.3f}{r['prefill_tok_s']:>15.0f}{r['decode_step_ms']:>16.1f}"
            f"{r['decode_tok_s']:>14.1f}{r['ttft_ms']:>10.0f}{r['tpot_ms']:>10.1f}"
        )
    return "\n".join(lines)
