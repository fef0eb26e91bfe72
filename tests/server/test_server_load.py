"""Many concurrent streams against one server: 256 streaming requests from the
async openai client, 64 of which hang up at random points. Every finished
stream has the right token count; once idle, no KV block is in use."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.helpers import RemoteServer

NUM_STREAMS = 256
NUM_DISCONNECTS = 64
MAX_TOKENS = 6
LONG_MAX_TOKENS = 200  # long enough that a hung-up stream is still running when it goes


@pytest.fixture(scope="module")
def server(tiny_llama):
    with RemoteServer(tiny_llama, "--max-num-seqs", "256", "--served-model-name", "tiny") as s:
        yield s


async def _run(server: RemoteServer) -> tuple[list, list]:
    rng = random.Random(0)
    words = ["The", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "Paged", "blocks"]
    client = server.async_client(timeout=120)
    hang_up = set(rng.sample(range(NUM_STREAMS), NUM_DISCONNECTS))

    async def one(i: int):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))
        disconnect_after = rng.randint(1, 8) if i in hang_up else None
        stream = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=LONG_MAX_TOKENS if disconnect_after else MAX_TOKENS,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage, finish, num_chunks = None, None, 0
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
                continue
            num_chunks += 1
            finish = chunk.choices[0].finish_reason or finish
            if disconnect_after is not None and num_chunks >= disconnect_after:
                await stream.close()  # hang up mid-stream
                return "disconnected", num_chunks
        return usage, finish

    try:
        results = await asyncio.gather(*(one(i) for i in range(NUM_STREAMS)))
    finally:
        await client.close()
    return results, sorted(hang_up)


def test_256_concurrent_streams_and_disconnects(server):
    before = server.wait_idle()
    results, hang_up = asyncio.run(_run(server))
    for i, result in enumerate(results):
        if i in hang_up:
            assert result[0] == "disconnected"
            continue
        usage, finish = result
        assert finish == "length", (i, result)
        assert usage.completion_tokens == MAX_TOKENS
        assert usage.total_tokens == usage.prompt_tokens + MAX_TOKENS
    after = server.wait_idle(timeout=60)
    assert after[("pagoda:num_blocks_used", ())] == 0
    assert after[("pagoda:kv_cache_usage_perc", ())] == 0

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    num_finished = NUM_STREAMS - NUM_DISCONNECTS
    assert delta("pagoda:request_success_total", finished_reason="length") == num_finished
    assert delta("pagoda:request_success_total", finished_reason="abort") == NUM_DISCONNECTS
    assert delta("pagoda:e2e_request_latency_seconds_count") == NUM_STREAMS
    # The server still answers normally afterwards.
    r = server.client().completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert r.usage.completion_tokens >= 1
