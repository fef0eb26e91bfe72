"""A request that fails inside a step fails alone: the others finish with their exact
outputs, its client gets an error, no block leaks, and the engine goes on. A fault
that every request hits is the engine's: it stops, says so, and a server exits 1."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from pagoda import EngineArgs, LLMEngine, SamplingParams
from pagoda.engine.async_engine import AsyncEngine
from pagoda.entrypoints.openai.api_server import build_app
from pagoda.errors import EngineDeadError, RequestFailedError
from pagoda.sampling_params import RequestOutputKind
from tests.helpers import ROOT, fail_sampling, finish_all, free_port, tiny_prompts

FINAL = RequestOutputKind.FINAL_ONLY


def _engine(folder: str) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(model=folder, dtype="float32", kv_cache_memory_bytes=1 << 24)
    )


def _run(engine: LLMEngine, prompts, params) -> dict:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    return finish_all(engine)


class _Recorder:
    def __init__(self) -> None:
        self.finished = []

    def record(self, stats) -> None:
        self.finished += [r.finish_reason for r in stats.finished_requests]


def test_one_failing_request_of_sixteen_fails_alone(tiny_llama, monkeypatch):
    engine = _engine(tiny_llama)
    prompts = tiny_prompts(engine.tokenizer, n=16, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=FINAL)
    expected = _run(engine, prompts, params)

    recorder = _Recorder()
    engine.stat_loggers.append(recorder)
    victim = "7"
    fail_sampling(monkeypatch, lambda r: r.request_id == victim and r.num_output_tokens == 3)
    finals = _run(engine, prompts, params)

    assert set(finals) == {str(i) for i in range(16)}
    for rid, out in finals.items():
        got, want = out.outputs[0], expected[rid].outputs[0]
        if rid == victim:
            assert got.finish_reason == "error" and "injected sampling fault" in out.error
            assert not out.error_is_client  # not its input: a 500 for its client
            assert got.token_ids == want.token_ids[:3]  # what it had before the fault
        else:
            assert out.error is None
            assert (got.token_ids, got.text, got.finish_reason) == (
                want.token_ids,
                want.text,
                "length",
            )
    assert engine.get_stats().kv_cache.num_blocks_used == 0
    assert sorted(recorder.finished) == ["error"] + ["length"] * 15
    # The engine goes on.
    monkeypatch.undo()
    again = _run(engine, prompts[:2], params)
    assert [again[r].outputs[0].token_ids for r in ("0", "1")] == [
        expected[r].outputs[0].token_ids for r in ("0", "1")
    ]


def test_a_failing_child_ends_its_whole_request(tiny_llama, monkeypatch):
    """n=3: one child fails, so the request fails; its siblings are freed too."""
    engine = _engine(tiny_llama)
    fail_sampling(monkeypatch, lambda r: r.request_id == "x#1" and r.num_output_tokens == 2)
    engine.add_request("x", "Hello", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))
    engine.add_request("y", "Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["x"].error and {c.finish_reason for c in finals["x"].outputs} == {"error"}
    assert finals["y"].error is None and len(finals["y"].outputs[0].token_ids) == 8
    assert engine.get_stats().kv_cache.num_blocks_used == 0
    assert not engine.scheduler.requests


def test_a_lone_request_with_n_completions_fails_alone(tiny_llama, monkeypatch):
    """One request (n = 2) whose sampling fails is one request failing, not "every
    request of the step": the engine goes on."""
    engine = _engine(tiny_llama)
    fail_sampling(monkeypatch, lambda r: r.request_id.startswith("pair"))
    engine.add_request("pair", "Hello", SamplingParams(n=2, max_tokens=4))
    outs = [o for _ in range(3) for o in engine.step()]
    assert outs[-1].finished and outs[-1].error is not None
    monkeypatch.undo()
    assert (
        _run(engine, [[5, 6, 7]], SamplingParams(max_tokens=3, output_kind=FINAL))["0"].error
        is None
    )


def test_blocks_of_a_failed_step_are_not_served_from_the_prefix_cache(tiny_llama, monkeypatch):
    """A request that fails before its K/V are written (here: building the step's
    inputs) leaves blocks that were findable by hash from the moment they were
    allocated. They stop being findable, and a request of the same step that shared
    them (a same-step prefix hit) computes its tokens again: its output is exact."""
    from pagoda.worker.model_runner import ModelRunner

    engine = _engine(tiny_llama)
    prompt = tiny_prompts(engine.tokenizer, n=1, seed=9)[0] * 3  # several full blocks
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=FINAL)
    want = _run(engine, [prompt], params)["0"].outputs[0].token_ids
    engine.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()

    real = ModelRunner._prepare_inputs

    def faulty(self, reqs):
        if any(r.request_id == "bad" for r in reqs):
            raise RuntimeError("injected input fault")
        return real(self, reqs)

    monkeypatch.setattr(ModelRunner, "_prepare_inputs", faulty)
    engine.add_request("bad", {"prompt_token_ids": prompt}, params)
    engine.add_request("same-step", {"prompt_token_ids": prompt}, params)  # hits bad's blocks
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["bad"].error is not None
    assert finals["same-step"].error is None and finals["same-step"].outputs[0].token_ids == want
    monkeypatch.undo()
    later = _run(engine, [prompt], params)["0"]  # no stale block served from the cache
    assert later.outputs[0].token_ids == want
    assert engine.get_stats().kv_cache.num_blocks_used == 0


def test_a_fault_every_request_hits_stops_the_engine(tiny_llama, monkeypatch):
    engine = _engine(tiny_llama)
    fail_sampling(monkeypatch, lambda r: True)
    for i in range(3):
        engine.add_request(str(i), "Hello", SamplingParams(max_tokens=4))
    with pytest.raises(EngineDeadError, match="every request"):
        while engine.has_unfinished_requests():
            engine.step()


def test_async_engine_failure_and_death(tiny_llama, monkeypatch):
    dead = []
    engine = AsyncEngine.from_engine_args(
        EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 24),
        on_dead=dead.append,
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def collect(request_id):
        return [out async for out in engine.generate("Hello", params, request_id)]

    async def both():
        return await asyncio.gather(collect("ok"), collect("bad"), return_exceptions=True)

    try:
        fail_sampling(monkeypatch, lambda r: r.request_id == "bad" and r.num_output_tokens == 1)
        ok, bad = asyncio.run(both())
        assert isinstance(bad, RequestFailedError) and "injected" in str(bad)
        assert ok[-1].finished and len(ok[-1].outputs[0].token_ids) == 6
        assert engine.is_running and not dead

        # A fault that hits whatever runs: lone requests fail until the engine gives up
        # (a few steps in a row), then every stream ends with EngineDeadError.
        fail_sampling(monkeypatch, lambda r: True)
        errors = []
        for i in range(5):
            try:
                asyncio.run(collect(f"doomed-{i}"))
            except (RequestFailedError, EngineDeadError) as e:
                errors.append(type(e))
            if not engine.is_running:
                break
        assert errors == [RequestFailedError, RequestFailedError, EngineDeadError]
        deadline = time.monotonic() + 10
        while not dead and time.monotonic() < deadline:  # on_dead runs after the streams end
            time.sleep(0.01)
        assert not engine.is_running and isinstance(dead[0], EngineDeadError)
        with pytest.raises(EngineDeadError):
            asyncio.run(collect("late"))
        # A server on this engine says so on /health, and refuses new work with 503.
        client = TestClient(build_app(engine, ["tiny"], owns_engine=False))
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "Hello"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        engine.shutdown(timeout=10)


# A `pagoda serve` whose engine starts failing every step once the file FAULT names exists.
_FAULTY_SERVER = """
import os, sys
from pagoda.sample import sampler
real = sampler.SamplingTensors.from_requests.__func__
def faulty(cls, reqs, vocab_size):
    if os.path.exists(os.environ["FAULT"]):
        raise RuntimeError("injected engine fault")
    return real(cls, reqs, vocab_size)
sampler.SamplingTensors.from_requests = classmethod(faulty)
from pagoda.entrypoints.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_server_exits_1_when_the_engine_dies(tiny_llama, tmp_path):
    """In-flight requests end with an error, /health says so, the process exits 1."""
    port, fault = free_port(), tmp_path / "fault"
    cmd = [sys.executable, "-c", _FAULTY_SERVER, "serve", tiny_llama, "--port", str(port)]
    cmd += ["--dtype", "float32", "--kv-cache-memory-bytes", str(16 << 20)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env={**os.environ, "FAULT": str(fault)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}

        async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> list[str]:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = []
                async for line in r.aiter_lines():
                    started.set()
                    if line:
                        lines.append(line)
                return lines

        async def two_streams() -> list[list[str]]:
            async with httpx.AsyncClient(timeout=60) as client:
                events = [asyncio.Event(), asyncio.Event()]
                tasks = [asyncio.create_task(stream(client, e)) for e in events]
                for e in events:
                    await e.wait()
                fault.touch()  # every step fails from now on: both requests in one step
                return await asyncio.gather(*tasks)

        for lines in asyncio.run(two_streams()):
            assert '"engine_dead"' in lines[-2] and lines[-1] == "data: [DONE]"
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
