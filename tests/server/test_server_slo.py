"""Serving to a deadline over HTTP: a request that cannot meet its latency target is
answered 429 with Retry-After at once, the others complete, and /metrics counts both
(goodput: met, missed, refused)."""

from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest

from tests.helpers import RemoteServer

PROMPT_LEN = 400
BUDGET = 32  # tokens a step: a prompt is 13 steps
NUM_BURST = 60


def prompt(i: int) -> list[int]:
    """Distinct prompts (token ids under the tiny vocabulary's 400): no prefix-cache hits."""
    return [5 + (i * 7 + j) % 390 for j in range(PROMPT_LEN)]


@pytest.fixture(scope="module")
def server(tiny_llama):
    # Loose server targets: the slack queue is on, and only tight per-request ones refuse.
    args = ["--served-model-name", "tiny", "--max-num-batched-tokens", str(BUDGET)]
    args += ["--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000"]
    with RemoteServer(tiny_llama, *args) as s:
        yield s


def _body(i: int = 0, **fields) -> dict:
    return {"model": "tiny", "prompt": prompt(i), "max_tokens": 4, "ignore_eos": True, **fields}


def _slo_counts(server: RemoteServer) -> tuple[float, float, float]:
    """(met, missed, refused) from /metrics."""
    m = server.metrics()
    met = m[("pagoda:request_slo_met_total", ())]
    missed = sum(m[("pagoda:request_slo_missed_total", (("reason", r),))] for r in ("ttft", "tpot"))
    refused = sum(m[("pagoda:request_slo_refused_total", (("reason", r),))] for r in ("ttft", "tpot"))  # fmt: skip
    return met, missed, refused


def test_a_bad_target_is_a_400_naming_the_field(server):
    for field, value in (("slo_ttft_ms", -1), ("slo_tpot_ms", 0), ("slo_ttft_ms", "soon")):
        r = server.post("/v1/completions", json=_body(**{field: value}))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "slo_tpot_ms": -5}
    r = server.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "slo_tpot_ms"


def test_an_overloaded_server_refuses_what_it_cannot_serve_in_time(server):
    client = server.client()
    # Measured steps first (before any, nothing is refused).
    for i in range(4):
        client.completions.create(
            model="tiny", prompt=prompt(-1 - i), max_tokens=4, extra_body={"ignore_eos": True}
        )
    met0, missed0, refused0 = _slo_counts(server)
    assert (met0, missed0, refused0) == (4, 0, 0)  # the server's loose targets, met
    # A burst of requests that each want their first token within the time the server
    # estimates a quarter of them take: those behind more work are refused at once.
    m = server.metrics()
    num_steps = math.ceil(PROMPT_LEN / BUDGET)
    one = num_steps * m[("pagoda:step_cost_base_seconds", ())]
    one += PROMPT_LEN * m[("pagoda:step_cost_prefill_token_seconds", ())]
    target_ms = 1000 * one * NUM_BURST / 4

    async def one(i: int):
        async_client = server.async_client()
        try:
            return await async_client.completions.create(
                model="tiny",
                prompt=prompt(i),
                max_tokens=4,
                extra_body={"ignore_eos": True, "slo_ttft_ms": target_ms},
            )
        except openai.RateLimitError as e:
            return e
        finally:
            await async_client.close()

    async def burst():
        return await asyncio.gather(*(one(i) for i in range(NUM_BURST)))

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    done = [r for r in results if not isinstance(r, openai.RateLimitError)]
    assert refused and done, f"{len(refused)} refused of {NUM_BURST} (target {target_ms:.0f} ms)"
    for e in refused:
        assert e.status_code == 429 and int(e.response.headers["Retry-After"]) >= 1
        error = e.response.json()["error"]
        assert (error["code"], error["param"]) == ("slo_unmeetable", "slo_ttft_ms")
    assert all(len(r.choices[0].text) > 0 and r.usage.completion_tokens == 4 for r in done)
    after = server.wait_idle()
    assert after[("pagoda:num_blocks_used", ())] == 0
    met, missed, refused_count = _slo_counts(server)
    assert refused_count == len(refused)
    assert met + missed - met0 == len(done)  # each finished request: met or missed


def test_the_bench_client_counts_a_429_as_refused(server):
    from pagoda.bench.client import stream_request

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            # No step is that fast: refused, whatever the queue.
            body = _body(stream=True, slo_ttft_ms=1e-6)
            return await stream_request(http, server.base_url + "/completions", body, False)

    assert server.post("/v1/completions", json=_body()).status_code == 200  # a measured step
    res = asyncio.run(run())
    assert res.refused and res.error.startswith("HTTP 429") and res.retry_after >= 1
