"""Failures around a split model: steps in flight (pipeline parallel) whose requests
are aborted, ids reused, a failed step's isolation; workers whose step fails between
collectives, or fails in sampling after them; a large step and a large answer crossing
on one worker's pipe. Each once hung the engine or gave one request another's K/V."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import psutil
import pytest

from pagoda import EngineArgs, LLMEngine, SamplingParams
from pagoda.core.sched_output import ScheduledRequest, SchedulerOutput
from pagoda.errors import EngineDeadError, InvalidRequestError
from pagoda.sampling_params import RequestOutputKind
from tests.helpers import fail_sampling, finish_all, tiny_prompts

FINAL = RequestOutputKind.FINAL_ONLY


class InProcessPipeline:
    """Stands in for a two-stage executor in this process: a step runs when submitted
    (as stage 0 starts it) and its outcome, output or error, is handed over when
    collected, so the engine keeps two steps in flight as under pipeline parallel and
    a failure can be injected with monkeypatch."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.outcomes = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def submit(self, sched) -> None:
        try:
            self.outcomes.append(self.runner.execute_model(sched))
        except Exception as e:
            self.outcomes.append(e)

    def collect(self):
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def _pipelined_engine(model: str, num_blocks: int) -> LLMEngine:
    # The tiny llama's K/V per block: 2 layers x (K, V) x 16 tokens x 2 heads x 16 x 4 bytes.
    engine = LLMEngine(
        EngineArgs(
            model=model, dtype="float32", kv_cache_memory_bytes=num_blocks * 8192,
            enforce_eager=True, enable_prefix_caching=False,
        )
    )  # fmt: skip
    engine.model_runner = InProcessPipeline(engine.model_runner)
    engine._pipeline_depth = 2
    return engine


def test_request_aborted_in_flight_is_not_run_again_over_another(tiny_llama, monkeypatch):
    """A step in flight fails; before it comes back, one of its requests is aborted
    and its blocks go to a new request, whose step runs first. Finding who failed
    must not run the aborted request again: it would write its K/V into the new
    request's blocks."""
    from transformers import AutoTokenizer

    prompts = tiny_prompts(AutoTokenizer.from_pretrained(tiny_llama), n=16, seed=4)
    a, c, b = [p for p in prompts if 40 <= len(p) <= 72][:3]
    # As many blocks as a and c take with their outputs: b can only have a's.
    blocks = -(-(len(a) + 8) // 16) + -(-(len(c) + 8) // 16)
    assert -(-(len(b) + 8) // 16) <= -(-(len(a) + 8) // 16)
    engine = _pipelined_engine(tiny_llama, num_blocks=blocks)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=FINAL)
    engine.add_request("b", {"prompt_token_ids": b}, params)
    alone = finish_all(engine)["b"].outputs[0].token_ids

    fail_sampling(monkeypatch, lambda r: r.request_id == "a")
    engine.add_request("a", {"prompt_token_ids": a}, params)
    engine.add_request("c", {"prompt_token_ids": c}, params)
    assert engine.step() == []  # the step of a and c is submitted (and failed)
    free_before = engine.kv_cache_manager.block_pool.num_free_blocks
    engine.abort_request("a")
    assert engine.kv_cache_manager.block_pool.num_free_blocks > free_before
    with pytest.raises(InvalidRequestError, match="request_id"):  # its step is in flight
        engine.add_request("a", {"prompt_token_ids": a}, params)
    engine.add_request("b", {"prompt_token_ids": b}, params)  # takes a's blocks
    finals = finish_all(engine)
    assert finals["b"].outputs[0].token_ids == alone
    assert finals["c"].outputs[0].finish_reason == "length"
    assert engine.scheduler.in_flight == set() and not engine.scheduler.newly_scheduled
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    engine.add_request("a", {"prompt_token_ids": a}, params)  # free again


# ---- real worker processes -----------------------------------------------------------


def _split_engine(model: str, **parallel) -> LLMEngine:
    return LLMEngine(
        EngineArgs(model=model, dtype="float32", kv_cache_memory_bytes=64 * 8192, **parallel)
    )


def _scheduled(rid: str, token_ids: list[int], first_block: int, **kwargs) -> ScheduledRequest:
    """A fresh prompt's whole prefill on blocks first_block, first_block + 1, ..."""
    blocks = list(range(first_block, first_block + -(-len(token_ids) // 16)))
    return ScheduledRequest(
        rid, token_ids, 0, blocks, SamplingParams(temperature=0, max_tokens=1), **kwargs
    )


def test_a_sampling_error_on_the_driver_keeps_the_ranks_in_step(tiny_llama):
    """The driver fails a request's prompt logprobs after the logits gathers: the
    other rank must not be left in a gather the driver never joins (it used to wait
    there, and every later collective paired the wrong tensors)."""
    engine = _split_engine(tiny_llama, tensor_parallel_size=2)
    executor = engine.model_runner
    try:
        prompt = [5, 6, 7, 8, 9, 10, 11, 12]

        def step(targets: list[int]) -> SchedulerOutput:
            logprobs = dict(prompt_logprob_targets=targets, prompt_logprobs_n=2)
            return SchedulerOutput(
                [
                    _scheduled("bad", prompt, 1, **logprobs),
                    _scheduled("good", prompt, 2, **logprobs),
                ],
                len(prompt) * 2,
            )

        with pytest.raises(RuntimeError, match="index"):  # a target past the vocabulary
            executor.execute_model(step([*prompt[1:], 10**6]))
        # The same workers go on, in step: the good step matches one process's answer.
        got = executor.execute_model(step(prompt[1:] + [13]))
        one = LLMEngine(
            EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory_bytes=64 * 8192)
        )
        want = one.model_runner.execute_model(step(prompt[1:] + [13]))
        assert got.sampled_token_ids == want.sampled_token_ids
        for rid in ("bad", "good"):
            assert [sorted(e) for e in got.prompt_logprobs[rid]] == [
                sorted(e) for e in want.prompt_logprobs[rid]
            ]
    finally:
        engine.shutdown()


def test_a_step_failing_between_collectives_stops_the_engine_at_once(tiny_llama):
    """An error in the forward (here a block table too short for its tokens, on every
    rank) may leave the ranks out of step: the engine stops, and all workers with it,
    without waiting for a collective's timeout."""
    engine = _split_engine(tiny_llama, tensor_parallel_size=2)
    workers = [psutil.Process(p.pid) for p in engine.model_runner.workers]
    broken = replace(_scheduled("x", list(range(5, 45)), 1), block_ids=[1])  # 40 tokens
    with pytest.raises(EngineDeadError, match="out of step"):
        engine.model_runner.execute_model(SchedulerOutput([broken], 40))
    _, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive
    engine.shutdown()


def test_a_large_step_and_a_large_answer_cross_on_the_pipe(tiny_llama):
    """Pipeline parallel sends the next step while the driver writes its answer to the
    last. Both larger than a socket's buffer (a big grammar bitmask, here padding; the
    prompt logprobs of long prompts): the worker reads as it writes, so neither waits
    for the other for good."""
    engine = _split_engine(tiny_llama, pipeline_parallel_size=2)
    executor = engine.model_runner
    submit = executor.submit
    padding = np.zeros((256, 1024), np.int32)  # 1 MiB, rows no grammar reads
    executor.submit = lambda sched: submit(replace(sched, grammar_bitmask=padding))
    prompts = [[5 + (i + j) % 300 for j in range(450)] for i in range(4)]
    params = SamplingParams(max_tokens=2, prompt_logprobs=20, output_kind=FINAL)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finals = {}
    runner = threading.Thread(target=lambda: finals.update(finish_all(engine)), daemon=True)
    runner.start()
    runner.join(120)
    try:
        assert not runner.is_alive(), "the engine and the driver wait on each other"
        assert sorted(finals) == ["0", "1", "2", "3"]
        assert all(len(o.prompt_logprobs) == 450 for o in finals.values())
    finally:
        for p in executor.workers:  # a stuck engine thread gets EPIPE and ends
            p.kill()
        runner.join(10)
        engine.shutdown()
