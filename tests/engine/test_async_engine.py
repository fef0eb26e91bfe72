"""AsyncEngine: the LLMEngine loop in a background thread behind asyncio streams."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagoda import LLM, EngineArgs, SamplingParams
from pagoda.core.stats import KVCacheStats, SchedulerStats
from pagoda.engine.async_engine import AsyncEngine, EngineNotAcceptingError, QueueFullError
from pagoda.metrics import EngineMetrics
from tests.helpers import tiny_prompts


def _args(folder: str) -> EngineArgs:
    return EngineArgs(model=folder, dtype="float32", kv_cache_memory_bytes=1 << 24)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = AsyncEngine.from_engine_args(_args(tiny_llama), model_name="tiny")
    yield engine
    engine.shutdown()


async def _collect(engine: AsyncEngine, prompt, params, request_id=None):
    outputs = [out async for out in engine.generate(prompt, params, request_id)]
    return outputs


def test_generate_matches_llm(engine, tiny_llama):
    prompts = [{"prompt_token_ids": p} for p in tiny_prompts(engine.tokenizer, n=8, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=10)

    async def run():
        return await asyncio.gather(*(_collect(engine, p, params) for p in prompts))

    results = asyncio.run(run())
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 24)
    expected = llm.generate(prompts, params, use_tqdm=False)
    for outputs, want in zip(results, expected, strict=True):
        final = outputs[-1]
        assert final.finished and all(not o.finished for o in outputs[:-1])
        assert final.outputs[0].token_ids == want.outputs[0].token_ids
        assert final.outputs[0].text == want.outputs[0].text
        # Outputs are cumulative: each holds more tokens than the one before.
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(set(lengths)) and lengths[-1] == 10


def test_closing_the_stream_aborts_and_frees_blocks(engine):
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    before = engine.metrics.render().decode()

    async def run():
        gen = engine.generate("The quick brown fox", params, "to-close")
        seen = [await gen.__anext__() for _ in range(3)]
        assert engine.get_stats().kv_cache.num_blocks_used > 0
        await gen.aclose()  # what a client disconnect does
        await engine.wait_idle()
        return seen

    seen = asyncio.run(run())
    assert 3 <= len(seen[-1].outputs[0].token_ids) < 300
    stats = engine.get_stats()
    assert stats.kv_cache.num_blocks_used == 0 and stats.num_requests_running == 0
    line = 'pagoda:request_success_total{finished_reason="abort",model_name="tiny"}'
    after = engine.metrics.render().decode()
    assert _value(after, line) == _value(before, line) + 1


def test_a_slow_reader_gets_the_newest_output(engine):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def run():
        stream = await engine.add_request("slow", "Hello world", params)
        await engine.wait_idle()  # the request ran to its end while nobody read
        return [out async for out in stream]

    outputs = asyncio.run(run())
    assert len(outputs) == 1 and outputs[0].finished
    assert len(outputs[0].outputs[0].token_ids) == 20


def test_cancelling_the_consumer_aborts(engine):
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def run():
        task = asyncio.create_task(_collect(engine, "Hello world", params, "to-cancel"))
        while engine.get_stats().num_requests_running == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.wait_idle()

    asyncio.run(run())
    assert engine.get_stats().kv_cache.num_blocks_used == 0


def test_bad_input_raises_and_engine_goes_on(engine):
    async def run():
        with pytest.raises(ValueError, match="prompt_token_ids"):
            await _collect(engine, {"prompt_token_ids": [1, 10**6]}, SamplingParams())
        with pytest.raises(ValueError, match="request_id"):
            await engine.add_request("", "Hello", SamplingParams())
        stream = await engine.add_request("dup", "Hello", SamplingParams(max_tokens=50))
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("dup", "Hello", SamplingParams())
        outputs = [o async for o in stream]
        return outputs[-1]

    final = asyncio.run(run())
    assert final.finished and final.request_id == "dup"
    assert engine.get_stats().kv_cache.num_blocks_used == 0


def test_queue_limit(engine):
    engine.max_queue_len = 0
    try:

        async def run():
            with pytest.raises(QueueFullError):
                await engine.add_request("q", "Hello", SamplingParams(max_tokens=2))

        asyncio.run(run())
    finally:
        engine.max_queue_len = None


def test_idle_engine_does_not_step(engine):
    async def run():
        await _collect(engine, "Hello", SamplingParams(max_tokens=2))
        await engine.wait_idle()

    asyncio.run(run())
    steps = engine.num_steps
    time.sleep(0.2)
    assert engine.num_steps == steps


def test_many_loops_and_threads(engine):
    """Requests from two event loops in two threads at once each get their own outputs."""
    import threading

    results = {}
    params = SamplingParams(temperature=0, max_tokens=5)

    def worker(name: str):
        results[name] = asyncio.run(_collect(engine, "Hello world", params))[-1]

    threads = [threading.Thread(target=worker, args=(f"t{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    texts = {r.outputs[0].text for r in results.values()}
    assert len(results) == 2 and len(texts) == 1


def test_shutdown_aborts_in_flight(tiny_llama):
    engine = AsyncEngine.from_engine_args(_args(tiny_llama))
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def run():
        stream = await engine.add_request("long", "Hello", params)
        first = await stream.__anext__()
        await asyncio.to_thread(engine.shutdown, True)
        rest = [o async for o in stream]
        with pytest.raises(EngineNotAcceptingError):
            await engine.add_request("late", "Hello", params)
        return first, rest

    first, rest = asyncio.run(run())
    assert not first.finished
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert not engine.is_running
    assert engine.engine.get_stats().kv_cache.num_blocks_used == 0


def _stats(num_running: int) -> SchedulerStats:
    kv = KVCacheStats(
        dtype="bfloat16",
        block_size=16,
        num_blocks_total=10,
        num_blocks_used=4,
        num_requests_swapped=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
    )
    return SchedulerStats(num_running, 0, 0, 0, 0, 0, 0.0, kv)


def test_metrics_registries_are_separate():
    a = EngineMetrics("m", 512, lambda: _stats(3))
    b = EngineMetrics("m", 512, lambda: _stats(5))
    a.prompt_tokens.inc(7)
    ta, tb = a.render().decode(), b.render().decode()
    assert _value(ta, 'pagoda:prompt_tokens_total{model_name="m"}') == 7
    assert _value(tb, 'pagoda:prompt_tokens_total{model_name="m"}') == 0
    assert _value(ta, 'pagoda:num_requests_running{model_name="m"}') == 3
    assert _value(tb, 'pagoda:num_requests_running{model_name="m"}') == 5


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise KeyError(series)


def test_a_stream_delivers_what_came_before_a_failure():
    """Deltas merged for a reader that fell behind go out before the error that followed."""
    from pagoda.engine.async_engine import RequestStream
    from pagoda.errors import RequestFailedError
    from pagoda.outputs import CompletionOutput, RequestOutput
    from pagoda.sampling_params import RequestOutputKind

    def delta(text: str, error: str | None = None) -> RequestOutput:
        c = CompletionOutput(0, text, [1], "error" if error else None)
        return RequestOutput("r", None, [1], [c], error is not None, error=error)

    async def run():
        stream = RequestStream("r", asyncio.get_running_loop(), RequestOutputKind.DELTA)
        for item in (delta("a"), delta("b"), delta("", error="boom")):
            stream._put(item)
        first = await stream.__anext__()
        with pytest.raises(RequestFailedError, match="boom"):
            await stream.__anext__()
        return first.outputs[0].text

    assert asyncio.run(run()) == "ab"
