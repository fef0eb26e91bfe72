"""Tensor and pipeline parallel over gloo (worker processes on this machine): greedy
and seeded outputs token for token those of one process, on tiny random models whose
heads split evenly and not, with n > 1, prefix caching and preemption; worker death
and shutdown leave no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine_args import EngineArgs
from pagoda.errors import EngineDeadError
from tests.helpers import RemoteServer, make_model, tiny_prompts

# The tiny llama's K/V per block of 16 tokens in float32: 2 layers x K, V x 2 KV heads x 16.
KV_BYTES = 40 * 2 * 2 * 16 * 2 * 16 * 4  # 40 blocks


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parallel")
    return {
        "llama": make_model(str(root / "llama"), "llama"),  # 4 heads, 2 KV heads
        "qwen2": make_model(str(root / "qwen2"), "qwen2"),  # q/k/v bias
        # 6 heads on 3 KV heads (SmolLM2's shape): TP=2 splits the KV heads 1 and 2.
        "uneven": make_model(
            str(root / "uneven"), "llama", num_attention_heads=6, num_key_value_heads=3,
            hidden_size=96, intermediate_size=160, num_hidden_layers=3,
        ),
        # One KV head: both ranks hold it, each with half its query heads.
        "mqa": make_model(str(root / "mqa"), "llama", num_key_value_heads=1),
    }  # fmt: skip


def _budget(model: str, num_blocks: int) -> int:
    """Bytes for `num_blocks` blocks of the model's K/V (float32, 16 tokens a block). The
    budget is the engine's, so every layout that stores nothing twice gets as many
    blocks, and the same schedule."""
    import json

    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = cfg["num_hidden_layers"] * 2 * 16 * cfg["num_key_value_heads"] * head_dim * 4
    return num_blocks * per_block


def _run(model: str, prompts, params, **kwargs):
    # 20 blocks: the prompts below preempt (recompute).
    llm = LLM(
        model, dtype="float32", kv_cache_memory_bytes=_budget(model, 20), max_model_len=160,
        **kwargs,
    )  # fmt: skip
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        engine = llm.llm_engine
        stats = engine.get_stats()
        return (
            [[c.token_ids for c in o.outputs] for o in outs],
            [[c.token_ids for c in o.outputs] for o in again],
            stats,
            engine.model_runner.num_blocks,
        )
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    "arch,tp,pp",
    [
        ("llama", 2, 1),
        ("qwen2", 2, 1),
        ("uneven", 2, 1),
        ("mqa", 2, 1),
        ("uneven", 1, 3),  # one layer per stage
        ("llama", 2, 2),  # 4 workers on this machine's cores
    ],
)
def test_outputs_match_one_process(models, arch, tp, pp):
    model = models[arch]
    prompts = tiny_prompts(_tokenizer(model), n=10, seed=11)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, n=2, seed=7, ignore_eos=True)
    for params in (greedy, seeded):
        want, want_again, want_stats, want_blocks = _run(model, prompts, params)
        got, got_again, stats, blocks = _run(
            model, prompts, params, tensor_parallel_size=tp, pipeline_parallel_size=pp
        )
        assert got == want
        assert got_again == want_again == want  # the second pass hits the prefix cache
        assert stats.kv_cache.prefix_cache_hits > 0
        if arch == "mqa":  # its one KV head is stored on both ranks
            assert blocks == want_blocks // 2
        else:  # the engine's budget, whatever the split
            assert blocks == want_blocks
        if pp == 1 and arch != "mqa":  # the same schedule (pipelines keep pp steps in flight)
            assert stats.num_preemptions == want_stats.num_preemptions
        assert stats.num_preemptions > 0  # the budget was small enough to preempt


def test_pipeline_keeps_a_step_in_flight_per_stage(models):
    llm = LLM(
        models["llama"], dtype="float32", kv_cache_memory_bytes=KV_BYTES,
        pipeline_parallel_size=2,
    )  # fmt: skip
    runner = llm.llm_engine.model_runner
    submit, collect = runner.submit, runner.collect
    outstanding = most = 0

    def counting_submit(sched) -> None:
        nonlocal outstanding, most
        submit(sched)
        outstanding += 1
        most = max(most, outstanding)

    def counting_collect():
        nonlocal outstanding
        outstanding -= 1
        return collect()

    runner.submit, runner.collect = counting_submit, counting_collect
    try:
        prompts = tiny_prompts(_tokenizer(models["llama"]), n=8, seed=3)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
        assert most == 2 and outstanding == 0
    finally:
        llm.llm_engine.shutdown()


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def test_smollm2_q4_1_tensor_parallel(gguf_path):
    """The real model's Q4_1 blocks, split: 9 heads on 3 KV heads (1 and 2 per rank),
    the vocabulary in halves, the tied lm_head with its embedding's half."""
    prompts = [
        {"messages": [{"role": "user", "content": text}]}
        for text in ("What is the capital of France?", "Name three colors.", "Count to five.")
    ]
    params = SamplingParams(max_tokens=16, temperature=0)
    outs = {}
    for tp in (1, 2):
        llm = LLM(
            gguf_path, dtype="float32", kv_cache_memory_bytes=32 << 20, tensor_parallel_size=tp
        )
        try:
            outs[tp] = [
                o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
            ]
        finally:
            llm.llm_engine.shutdown()
    assert outs[2] == outs[1]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(tensor_parallel_size=2, enable_lora=True), "tensor_parallel_size"),
        (dict(tensor_parallel_size=3), "tensor_parallel_size"),  # 4 heads on 2 KV heads
        (dict(pipeline_parallel_size=3), "pipeline_parallel_size"),  # 2 layers
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(tensor_parallel_size=2, distributed_executor_backend="x"), "distributed_executor"),
    ],
)
def test_refused_layouts_name_the_field(models, kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(model=models["llama"], **kwargs).create_model_config()


def _workers(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_worker_death_stops_the_engine(models):
    engine = LLMEngine(
        EngineArgs(
            model=models["llama"], dtype="float32", kv_cache_memory_bytes=KV_BYTES,
            tensor_parallel_size=2,
        )
    )  # fmt: skip
    # This engine's workers (pytest may hold other children, e.g. Ray's).
    workers = [psutil.Process(p.pid) for p in engine.model_runner.workers]
    assert len(workers) == 2
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50))
    engine.step()
    workers[1].kill()
    with pytest.raises(EngineDeadError, match="worker 1"):
        for _ in range(50):
            engine.step()
    psutil.wait_procs(workers, timeout=15)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)
    engine.shutdown()  # again: nothing left to do


def _serve(model: str) -> tuple[RemoteServer, list[psutil.Process]]:
    server = RemoteServer(model, "--tensor-parallel-size", "2")
    workers = _workers(server.proc.pid)
    assert len(workers) == 2, server.output()
    return server, workers


def _gone(procs: list[psutil.Process]) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=20)
    return not alive


def test_server_sigterm_leaves_no_workers(models):
    server, workers = _serve(models["llama"])
    try:
        reply = server.client().completions.create(
            model=models["llama"], prompt="hello there", max_tokens=8, temperature=0
        )
        assert reply.choices[0].text
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.output()
        assert _gone(workers)
    finally:
        server.stop()


def test_server_crash_leaves_no_workers(models):
    server, workers = _serve(models["llama"])
    try:
        server.proc.kill()  # no shutdown code runs: the kernel signals the workers
        server.proc.wait(10)
        assert _gone(workers)
    finally:
        server.stop()


def test_server_exits_nonzero_when_a_worker_dies(models):
    server, workers = _serve(models["llama"])
    try:
        workers[0].kill()
        client = server.client()
        with pytest.raises(Exception):  # noqa: B017 - the engine is gone: a 5xx, or no reply
            client.completions.create(model=models["llama"], prompt="hi", max_tokens=8)
        assert server.proc.wait(30) == 1, server.output()
        assert _gone(workers)
    finally:
        server.stop()


def test_offline_script_without_main_guard(models, tmp_path):
    """Workers are fresh interpreters running pagoda's module, not the caller's script
    again (multiprocessing's spawn would re-import it: a script without a main guard)."""
    script = tmp_path / "script.py"
    script.write_text(
        "from pagoda import LLM, SamplingParams\n"
        f"llm = LLM({models['llama']!r}, dtype='float32', tensor_parallel_size=2,\n"
        f"          kv_cache_memory_bytes={KV_BYTES})\n"
        "out = llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(max_tokens=4),\n"
        "                   use_tqdm=False)\n"
        "print('tokens', len(out[0].outputs[0].token_ids))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "tokens 4" in done.stdout
