"""`pagoda bench`: metrics on hand-made timelines, the seeded workloads, the SSE client
against a mock transport, each subcommand end to end on a tiny model (`bench serve`
against a real `pagoda serve` on 127.0.0.1), and static vs continuous batching.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from pagoda.bench import client as bench_client
from pagoda.bench.client import stream_request
from pagoda.bench.metrics import RequestTimeline, compute_metrics, summarize
from pagoda.bench.workloads import (
    CHAT_TOPICS,
    BenchRequest,
    assign_poisson_arrivals,
    load_dataset,
    make_workload,
)
from pagoda.entrypoints.cli import main
from tests.helpers import RemoteServer, free_port

KV_BYTES = str(16 << 20)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-9)


# ---- metrics ------------------------------------------------------------------------------


def test_timeline_latencies():
    t = RequestTimeline(arrival=10.0, token_times=[10.5, 10.7, 11.0, 11.6])
    assert t.ttft == approx(0.5)
    assert t.e2el == approx(1.6)
    assert t.tpot == approx((1.6 - 0.5) / 3)
    assert t.itls == [approx(0.2), approx(0.3), approx(0.6)]
    one = RequestTimeline(arrival=0.0, token_times=[0.25])
    assert one.tpot is None and one.itls == [] and one.e2el == one.ttft == 0.25
    # Streamed chunks that carry several tokens: TPOT divides by the tokens, not the chunks.
    chunked = RequestTimeline(arrival=0.0, token_times=[1.0, 2.0, 3.0], num_tokens=9)
    assert chunked.tpot == approx(2.0 / 8)
    assert chunked.itls == [approx(1.0), approx(1.0)]


def test_summarize_percentiles():
    s = summarize([i / 1000 for i in range(1, 11)])  # 1..10 ms
    # Linear interpolation between closest ranks: p90 at rank 8.1, p99 at rank 8.91 (0-based).
    assert s == {
        "mean": approx(5.5),
        "median": approx(5.5),
        "p90": approx(9.1),
        "p99": approx(9.91),
    }
    assert summarize([2.0, 4.0, 9.0], scale=1.0) == {
        "mean": approx(5.0),
        "median": approx(4.0),
        "p90": approx(8.0),  # rank 1.8: 4 + 0.8 * 5
        "p99": approx(8.9),  # rank 1.98
    }
    assert summarize([]) == {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}


def _timelines() -> list[RequestTimeline]:
    return [
        # TTFT 100 ms, TPOT 50 ms, E2EL 250 ms
        RequestTimeline(0.0, [0.1, 0.15, 0.2, 0.25], prompt_len=10, output_len=4),
        # TTFT 500 ms, TPOT 100 ms, E2EL 700 ms
        RequestTimeline(1.0, [1.5, 1.6, 1.7], prompt_len=20, output_len=3),
        # TTFT 200 ms, one token: no TPOT
        RequestTimeline(1.0, [1.2], prompt_len=30, output_len=1),
        # failed, and very fast: must not count anywhere
        RequestTimeline(0.0, [0.001, 0.002], prompt_len=1000, output_len=2, success=False),
        # no token at all: failed too
        RequestTimeline(0.5, [], prompt_len=1000, output_len=50),
    ]


def test_compute_metrics_known_answers():
    m = compute_metrics(_timelines(), duration=2.0)
    assert (m["completed"], m["failed"], m["duration_s"]) == (3, 2, 2.0)
    assert m["request_throughput"] == approx(3 / 2.0)
    assert m["output_throughput"] == approx((4 + 3 + 1) / 2.0)
    assert m["total_token_throughput"] == approx((4 + 3 + 1 + 10 + 20 + 30) / 2.0)
    assert m["ttft_ms"]["mean"] == approx((100 + 500 + 200) / 3)
    assert m["ttft_ms"]["median"] == approx(200)
    assert m["tpot_ms"]["mean"] == approx(75)  # the one-token request has no TPOT
    assert m["e2el_ms"]["mean"] == approx((250 + 700 + 200) / 3)
    # ITL: three gaps of 50 ms, two of 100 ms.
    assert m["itl_ms"]["mean"] == approx((3 * 50 + 2 * 100) / 5)
    assert m["itl_ms"]["median"] == approx(50)
    assert m["goodput"] == approx(3 / 2.0)  # no SLO: every completed request is good
    per = m["per_request"]
    assert per["ttft_ms"] == [approx(100), approx(500), approx(200), None, None]
    assert per["tpot_ms"] == [approx(50), approx(100), None, None, None]
    assert per["e2el_ms"] == [approx(250), approx(700), approx(200), None, None]
    assert per["output_len"] == [4, 3, 1, 0, 0]


@pytest.mark.parametrize(
    ("slo_ttft_ms", "slo_tpot_ms", "num_good"),
    [
        (300, None, 2),  # TTFT 100 and 200 pass, 500 fails
        (None, 60, 2),  # TPOT 50 passes, 100 fails; one-token requests have no TPOT to miss
        (300, 60, 2),
        (150, 60, 1),
        (50, None, 0),
        (1000, 1000, 3),
    ],
)
def test_goodput(slo_ttft_ms, slo_tpot_ms, num_good):
    m = compute_metrics(_timelines(), 4.0, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
    assert m["goodput"] == approx(num_good / 4.0)
    assert m["request_throughput"] == approx(3 / 4.0)  # SLOs never change throughput


def test_refused_requests_are_counted_and_never_good():
    """A 429 (a server shedding load) is neither completed nor a failure, and not good."""
    refused = [RequestTimeline(2.0, [], success=False, refused=True) for _ in range(3)]
    m = compute_metrics(_timelines() + refused, 4.0, slo_ttft_ms=300)
    assert (m["completed"], m["refused"], m["failed"], m["good"]) == (3, 3, 2, 2)
    assert m["goodput"] == approx(2 / 4.0)
    assert m["per_request"]["ttft_ms"][-3:] == [None, None, None]


def test_compute_metrics_all_failed_and_zero_duration():
    m = compute_metrics([RequestTimeline(0.0, [], success=False)], duration=0.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["request_throughput"] == m["output_throughput"] == m["goodput"] == 0.0
    assert m["ttft_ms"]["p99"] == 0.0


# ---- workloads ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "count", "prompt_range", "output_range"),
    [
        ("mixed", 64, (32, 512), (32, 256)),
        ("uniform", 256, (128, 128), (128, 128)),
        ("shared-prefix", 64, (448 + 16, 448 + 64), (64, 64)),
        ("long", 8, (4096, 4096), (64, 64)),
        ("online", 256, (32, 512), (32, 256)),
    ],
)
def test_workload_shapes(tokenizer, name, count, prompt_range, output_range):
    reqs = make_workload(name, tokenizer)
    assert len(reqs) == count
    assert len(make_workload(name, tokenizer, num_prompts=5)) == 5
    special = set(tokenizer.all_special_ids)
    for r in reqs:
        assert prompt_range[0] <= len(r.prompt_token_ids) <= prompt_range[1]
        assert output_range[0] <= r.output_len <= output_range[1]
        assert all(0 <= i < len(tokenizer) and i not in special for i in r.prompt_token_ids)
    if name in ("mixed", "online"):  # the ranges are really used, not one corner of them
        assert min(len(r.prompt_token_ids) for r in reqs) < 150
        assert max(len(r.prompt_token_ids) for r in reqs) > 400
        assert len({r.output_len for r in reqs}) > 20
    if name != "online":
        assert all(r.arrival_time == 0.0 for r in reqs)


def test_chat_workload(tokenizer):
    """Open questions, one user turn each (plain text: the test tokenizer has no chat
    template), 128 tokens out, several distinct asks."""
    reqs = make_workload("chat", tokenizer)
    assert len(reqs) == 16 and all(r.output_len == 128 for r in reqs)
    assert len({r.prompt for r in reqs}) > 8
    for r in reqs:
        assert r.prompt_token_ids == tokenizer.encode(r.prompt, add_special_tokens=False)
        assert any(t in r.prompt for t in CHAT_TOPICS)


def test_workload_long_fits_the_model(tokenizer):
    reqs = make_workload("long", tokenizer, num_prompts=2, max_model_len=512)
    assert [len(r.prompt_token_ids) + r.output_len for r in reqs] == [512, 512]


def test_workload_seeds(tokenizer):
    def ids(seed):
        return [(r.prompt_token_ids, r.output_len) for r in make_workload("mixed", tokenizer, seed)]

    assert ids(42) == ids(42)
    assert ids(42) != ids(43)
    assert make_workload("mixed", tokenizer)[0].prompt_token_ids == ids(42)[0][0]  # 42 by default


def test_shared_prefix_shares_448_tokens(tokenizer):
    reqs = make_workload("shared-prefix", tokenizer, num_prompts=16)
    prefix = reqs[0].prompt_token_ids[:448]
    assert all(r.prompt_token_ids[:448] == prefix for r in reqs)
    # ...and only those: the requests' own parts differ.
    assert len({tuple(r.prompt_token_ids[448:]) for r in reqs}) == 16
    other = make_workload("shared-prefix", tokenizer, seed=7, num_prompts=1)[0]
    assert other.prompt_token_ids[:448] != prefix


def test_multiturn_turns_resend_their_history(tokenizer):
    """16 conversations of 4 turns, round-robin: each turn's prompt starts with the
    whole of the conversation's previous one, and conversations share nothing."""
    reqs = make_workload("multiturn", tokenizer)
    assert len(reqs) == 64 and all(r.output_len == 128 for r in reqs)
    for i, r in enumerate(reqs):
        if i >= 16:
            before = reqs[i - 16].prompt_token_ids
            assert r.prompt_token_ids[: len(before)] == before
            assert len(r.prompt_token_ids) == len(before) + 128 + 64
        else:
            assert len(r.prompt_token_ids) == 1024
    assert len({tuple(r.prompt_token_ids[:16]) for r in reqs[:16]}) == 16
    assert len(make_workload("multiturn", tokenizer, num_prompts=6)) == 6


def test_online_arrivals_are_poisson(tokenizer):
    rate = 4.0
    reqs = make_workload("online", tokenizer, num_prompts=1000, request_rate=rate)
    times = [r.arrival_time for r in reqs]
    assert times[0] == 0.0
    assert all(b > a for a, b in zip(times[:-1], times[1:], strict=True))
    mean_gap = times[-1] / (len(times) - 1)
    assert mean_gap == pytest.approx(1 / rate, rel=0.15)  # ~5 standard errors
    # At rate inf (the default), everyone arrives at once.
    assert {r.arrival_time for r in make_workload("online", tokenizer, num_prompts=8)} == {0.0}
    # Same seed, same arrivals.
    again = [BenchRequest([1], 1) for _ in range(1000)]
    assign_poisson_arrivals(again, rate, random.Random(3))
    same = [BenchRequest([1], 1) for _ in range(1000)]
    assign_poisson_arrivals(same, rate, random.Random(3))
    assert [r.arrival_time for r in again] == [r.arrival_time for r in same]


def test_unknown_workload(tokenizer):
    with pytest.raises(ValueError, match="workload must be one of"):
        make_workload("bursty", tokenizer)


def test_load_dataset(tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "The quick brown fox", "output_len": 7},
        {"prompt_token_ids": [10, 11, 12]},
        {"prompt_token_ids": [13, 14], "prompt": "ignored for ids", "output_len": 3},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]))
    reqs = load_dataset(str(path), tokenizer, default_output_len=5)
    assert reqs[0].prompt_token_ids == tokenizer.encode("The quick brown fox")
    assert (reqs[0].prompt, reqs[0].output_len) == ("The quick brown fox", 7)
    assert (reqs[1].prompt_token_ids, reqs[1].prompt, reqs[1].output_len) == ([10, 11, 12], None, 5)
    assert (reqs[2].prompt_token_ids, reqs[2].output_len) == ([13, 14], 3)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "ok"}\n{not json}\n', r"prompts\.jsonl:2: not JSON"),
        (
            '{"prompt": "ok"}\n\n{"text": "x"}\n',
            r"prompts\.jsonl:3: needs 'prompt' or 'prompt_token_ids'",
        ),
        ('{"prompt": 5}\n', r"prompts\.jsonl:1: needs 'prompt'"),
        ("\n\n", r"prompts\.jsonl: no requests"),
    ],
)
def test_load_dataset_errors(tokenizer, tmp_path, text, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_dataset(str(path), tokenizer)


# ---- the SSE client, against canned responses -----------------------------------------------


def _sse(*events) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def _stream(body: bytes, status: int = 200, chat: bool = False, content_type="text/event-stream"):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers={"content-type": content_type})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream_request(client, "http://x/v1/completions", {}, chat)

    return asyncio.run(go())


def test_stream_request_parses_completions_and_chat():
    res = _stream(
        _sse(
            {"choices": [{"index": 0, "text": "Hel"}]},
            {"choices": [{"index": 0, "text": ""}]},  # no text: no token time
            {"choices": [{"index": 0, "text": "lo", "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}},
            b"[DONE]",
        )
    )
    assert res.error is None and res.text == "Hello"
    assert len(res.chunk_times) == 2 and res.chunk_times[0] <= res.chunk_times[1] <= res.end_time
    assert (res.prompt_tokens, res.completion_tokens) == (5, 4)

    # Chat: the role-only first delta is no token; a server without usage leaves it None.
    res = _stream(
        _sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
            b"[DONE]",
        ),
        chat=True,
    )
    assert res.error is None and res.text == "Hi" and len(res.chunk_times) == 1
    assert res.completion_tokens is None


def test_stream_request_failures():
    res = _stream(b'{"error": {"message": "max_tokens is too large"}}', status=400)
    assert res.error == "HTTP 400: max_tokens is too large"
    res = _stream(b"upstream exploded", status=502, content_type="text/plain")
    assert res.error == "HTTP 502: upstream exploded"
    res = _stream(_sse({"choices": [{"text": "a"}]}, {"error": {"message": "engine died"}}))
    assert res.error == "engine died"
    res = _stream(b'error: {"code": 500, "message": "slot unavailable"}\n\n')  # llama.cpp
    assert res.error == "slot unavailable"
    res = _stream(_sse(b"[DONE]"))
    assert res.error == "the stream carried no output"
    res = _stream(b"data: {truncated\n\n")
    assert res.error.startswith("JSONDecodeError")


# ---- end to end: throughput, latency -------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(tokenizer, tmp_path_factory) -> str:
    """Six requests of 8..40 prompt tokens and 4..12 output tokens."""
    rng = random.Random(0)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    path = tmp_path_factory.mktemp("bench") / "tiny.jsonl"
    rows = [
        {"prompt_token_ids": [rng.choice(vocab) for _ in range(n)], "output_len": m}
        for n, m in [(8, 4), (40, 12), (16, 6), (24, 8), (32, 4), (12, 10)]
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _engine_flags(model: str) -> list[str]:
    return ["--model", model, "--dtype", "float32", "--kv-cache-memory-bytes", KV_BYTES]


def test_bench_throughput_pagoda(tiny_llama, dataset, tmp_path, capsys):
    out = tmp_path / "thr.json"
    argv = [
        "bench",
        "throughput",
        "--dataset",
        dataset,
        "--batching",
        "static",
        "--batch-size",
        "2",
    ]
    assert (
        main([*argv, *_engine_flags(tiny_llama), "--no-progress", "--output-json", str(out)]) == 0
    )
    assert "pagoda-static" in capsys.readouterr().out
    (r,) = json.loads(out.read_text())["results"]
    assert r["system"] == "pagoda-static" and r["batch_size"] == 2
    assert (r["completed"], r["failed"]) == (6, 0)
    assert r["per_request"]["output_len"] == [4, 12, 6, 8, 4, 10]


def test_bench_throughput_compare(tiny_llama, dataset, tmp_path, capsys):
    out, png = tmp_path / "cmp.json", tmp_path / "cmp.png"
    argv = ["bench", "throughput", "--dataset", dataset, "--compare", "--hf-batch-sizes", "2"]
    argv += ["--batch-size", "2", "--no-progress", "--output-json", str(out), "--plot", str(png)]
    assert main([*argv, *_engine_flags(tiny_llama)]) == 0
    table = capsys.readouterr().out
    doc = json.loads(out.read_text())
    systems = ["pagoda-continuous", "pagoda-dynamic", "pagoda-static", "hf-static-B2"]
    assert [r["system"] for r in doc["results"]] == systems
    assert all(s in table for s in systems)
    for r in doc["results"]:
        assert (r["completed"], r["failed"]) == (6, 0)
        assert r["output_throughput"] > 0 and r["peak_rss_mib"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(r[key]) == {"mean", "median", "p90", "p99"}
        assert r["request_throughput"] == pytest.approx(6 / r["duration_s"])
        assert r["output_throughput"] == pytest.approx(44 / r["duration_s"])
    for key in ("kv_blocks_peak", "preemptions", "prefix_cache_hit_rate", "kv_efficiency_paged"):
        assert key in doc["results"][0]
    assert {"command", "config", "machine", "versions"} <= set(doc)
    assert doc["config"]["num_requests"] == 6 and doc["versions"]["pagoda"]
    assert png.stat().st_size > 1000


def test_bench_latency(tiny_llama, tmp_path, capsys):
    out = tmp_path / "lat.json"
    argv = ["bench", "latency", "--batch-sizes", "1,3", "--input-len", "16", "--output-len", "4"]
    assert main([*argv, *_engine_flags(tiny_llama), "--output-json", str(out)]) == 0
    assert "decode step ms" in capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        assert r["prefill_s"] > 0 and r["decode_step_ms"] > 0 and r["ttft_ms"] > 0
        assert r["prefill_tok_s"] == pytest.approx(r["batch_size"] * 16 / r["prefill_s"])


# ---- roofline: the arithmetic by hand, then end to end ----------------------------------------


def test_roofline_limit_is_the_slower_of_reading_and_computing():
    from pagoda.bench.roofline import limit_seconds

    # 2 GB at 20 GB/s: 0.1 s; 1 GFLOP at 100 GFLOP/s: 0.01 s.
    assert limit_seconds(2e9, 1e9, 20.0, 100.0) == (approx(0.1), "memory")
    # 0.2 GB: 0.01 s; 50 GFLOP at 100 GFLOP/s: 0.5 s.
    assert limit_seconds(2e8, 50e9, 20.0, 100.0) == (approx(0.5), "compute")


def test_roofline_step_bytes_and_flops_by_hand():
    from pagoda.bench.roofline import ModelCost

    cost = ModelCost(
        whole_bytes=1000,
        bytes_per_row=10,
        linear_macs_per_row=100,
        lm_head_macs_per_row=50,
        attention=[(8, None), (8, 4)],  # heads x head_dim 8; the second slides over 4 tokens
        experts=[],
        kv_bytes_per_token=32,  # 16 per layer
        largest_linear=(10, 10),
        weight_format=None,
    )
    # Two sequences of context 3 and 6: layer 1 reads 3 + 6 tokens, layer 2 3 + 4.
    assert cost.step_bytes(2, [3, 6]) == 1000 + 2 * 10 + 16 * (3 + 6) + 16 * (3 + 4)
    # Linears on both rows, the lm_head on both, attention 2 x 8 MACs per context token.
    assert cost.step_flops([3, 6], 2) == 2 * (2 * 100 + 2 * 50 + 16 * (3 + 6) + 16 * (3 + 4))
    assert cost.step_flops([3, 6], 1) == cost.step_flops([3, 6], 2) - 2 * 50
    # MoE: 4 experts of 100 bytes and 7 MACs, top 2: one row reads 2 of them, three rows 4.
    moe = ModelCost(**{**cost.to_json(), "experts": [(4, 2, 100, 7)]})
    assert moe.step_bytes(1, []) - cost.step_bytes(1, []) == 2 * 100
    assert moe.step_bytes(3, []) - cost.step_bytes(3, []) == 4 * 100
    assert moe.step_flops([1], 1) - cost.step_flops([1], 1) == 2 * 2 * 7


def test_roofline_int8_rows_follow_the_kernel_layer():
    from types import SimpleNamespace

    from pagoda.bench.roofline import int8_max_rows
    from pagoda.ops.cpu import (
        QUANT_LINEAR_MAX_ROWS,
        QUANT_LINEAR_MAX_ROWS_FLOAT32,
        W8A8_INT_MAX_ROWS,
    )

    def weight(fmt: str, shape=(576, 1536)):
        return SimpleNamespace(format=fmt, shape=shape)

    on = SimpleNamespace(int8_activations=True, batch_invariant=False, dtype="bfloat16")
    assert int8_max_rows(weight("q4_1"), on, "cpu") == QUANT_LINEAR_MAX_ROWS
    on_float32 = SimpleNamespace(int8_activations=True, batch_invariant=False, dtype="float32")
    assert int8_max_rows(weight("q4_1"), on_float32, "cpu") == QUANT_LINEAR_MAX_ROWS_FLOAT32 > 16
    # Large 4-bit weights keep their blocks at every row count in float32 (not in bf16).
    large = (6144, 2048)
    assert int8_max_rows(weight("q4_0", large), on_float32, "cpu") > 1 << 30
    assert int8_max_rows(weight("q4_k", large), on_float32, "cpu") > 1 << 30
    assert int8_max_rows(weight("q6_k", large), on_float32, "cpu") == QUANT_LINEAR_MAX_ROWS_FLOAT32
    assert int8_max_rows(weight("q4_0", large), on, "cpu") == QUANT_LINEAR_MAX_ROWS
    assert int8_max_rows(weight("w8a8"), on, "cpu") == W8A8_INT_MAX_ROWS
    assert int8_max_rows(None, on, "cpu") == 0  # float weights
    assert int8_max_rows(weight("q4_1"), on, "torch") == 0  # PyTorch alone: dequantized
    off = SimpleNamespace(int8_activations=False, batch_invariant=False, dtype="bfloat16")
    assert int8_max_rows(weight("q4_1"), off, "cpu") == 0
    invariant = SimpleNamespace(int8_activations=True, batch_invariant=True, dtype="bfloat16")
    assert int8_max_rows(weight("q4_1"), invariant, "cpu") > 1 << 30


def test_roofline_bf16_peak_in_a_child_without_amx():
    """The child process that measures bf16 with oneDNN off AMX tiles (run only where the
    CPU has AMX; here on any CPU, where the cap changes nothing)."""
    from pagoda.bench.machine_limits import bf16_gflops_without_amx

    assert bf16_gflops_without_amx((64, 64), 16, 1, 1) > 0


def test_bench_roofline(tiny_llama, tmp_path, capsys):
    from safetensors import safe_open

    from pagoda.bench.roofline import limit_seconds

    out, png = tmp_path / "roof.json", tmp_path / "roof.png"
    argv = ["bench", "roofline", "--batch-sizes", "1,2", "--context-len", "24"]
    argv += ["--prefill-tokens", "32", "--decode-steps", "3", "--quick"]
    argv += ["--output-json", str(out), "--plot", str(png)]
    assert main([*argv, *_engine_flags(tiny_llama)]) == 0
    assert "of limit" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    rows, model, limits = doc["results"], doc["config"]["model"], doc["config"]["limits"]
    assert [(r["phase"], r["rows"]) for r in rows] == [
        ("prefill", 32),
        ("decode", 1),
        ("decode", 2),
    ]

    # The weights, independently: every tensor of the checkpoint in float32, the
    # embedding (untied) for the rows used only, and rope's cos and sin rows (head_dim / 2
    # floats each) per row.
    with safe_open(f"{tiny_llama}/model.safetensors", framework="pt") as f:
        sizes = {name: f.get_tensor(name).numel() * 4 for name in f.keys()}  # noqa: SIM118
    with open(f"{tiny_llama}/config.json") as f:
        cfg = json.load(f)
    hidden, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    head_dim, kv_heads = hidden // heads, cfg["num_key_value_heads"]
    assert model["whole_bytes"] == sum(sizes.values()) - sizes["model.embed_tokens.weight"]
    assert model["bytes_per_row"] == hidden * 4 + head_dim * 4
    assert model["kv_bytes_per_token"] == layers * 2 * kv_heads * head_dim * 4
    assert model["weight_format"] is None
    # FLOPs of the 32-token prefill: the layers' linears on every row, the lm_head on the
    # one sampled, attention over 1..32 tokens.
    macs = hidden * (heads + 2 * kv_heads) * head_dim + hidden * hidden  # q, k, v, o
    macs += 3 * hidden * cfg["intermediate_size"]  # gate, up, down
    attention = 2 * 2 * heads * head_dim * layers * (32 * 33 // 2)
    assert rows[0]["flops"] == 2 * (32 * layers * macs + hidden * cfg["vocab_size"]) + attention

    for r in rows:
        assert r["measured_ms"] > 0 and r["limit_ms"] > 0 and r["fraction"] > 0
        assert r["bound"] in ("memory", "compute") and r["path"] == "fp32"  # no int8 in fp32
        assert r["limit_ms"] == approx(max(r["memory_ms"], r["compute_ms"]))
        assert r["tok_s"] == approx(r["rows"] / r["measured_ms"] * 1000)
        # The JSON holds all it takes to recompute the limit and the fraction.
        seconds, bound = limit_seconds(
            r["bytes"], r["flops"], limits["read_gbs"], limits["peaks_gflops"][r["path"]]
        )
        assert (1000 * seconds, bound) == (approx(r["limit_ms"]), r["bound"])
        assert r["fraction"] == approx(r["limit_ms"] / r["measured_ms"])
    for r in rows[1:]:  # decode: the weights, a row each, every sequence's context of K/V
        batch, context = r["rows"], r["context"]
        assert 24 <= context <= 25  # the timed steps' mean: context_len, or half a token over
        expected = model["whole_bytes"] + batch * model["bytes_per_row"]
        expected += model["kv_bytes_per_token"] * batch * context
        assert r["bytes"] == approx(expected)

    assert limits["read_gbs"] > 0 and limits["peaks_gflops"]["bf16"] > 0
    assert limits["peaks_gflops"]["fp32"] > 0 and limits["gemm_shape"] == [256, 64]
    assert ("int8" in limits["peaks_gflops"]) != bool(limits["int8_missing"])
    if limits["flags"]["amx_tile"]:
        assert limits["bf16_no_amx_gflops"] > 0
    else:
        assert limits["bf16_no_amx_gflops"] is None and "no AMX" in limits["no_amx_note"]
    assert {"command", "machine", "versions"} <= set(doc) and png.stat().st_size > 1000


def test_bench_roofline_quantized_paths(tiny_llama):
    """q4_1 blocks in bf16: decode at 1-2 rows runs on integers (where the kernels are
    built), the 32-row prefill on the dequantized weight's bf16 GEMM."""
    from pagoda.bench.roofline import run_roofline

    kwargs = dict(model=tiny_llama, dtype="bfloat16", quantization="int4")
    kwargs["kv_cache_memory_bytes"] = 16 << 20
    found, rows = run_roofline(
        kwargs, [1, 2], 24, 32, decode_steps=2, repeats=1, read_bytes=64 << 20
    )
    assert found["model"]["weight_format"] == "q4_1"
    decode_path = "int8" if "int8" in found["limits"]["peaks_gflops"] else "bf16"
    assert [r["path"] for r in rows] == ["bf16", decode_path, decode_path]
    assert found["limits"]["int8_format"] == "q4_1"  # the model's own weight was measured


# ---- end to end: serve, against a real server -------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama):
    with RemoteServer(tiny_llama, "--served-model-name", "tiny") as s:
        yield s


def _serve(server, tiny_llama, tmp_path, *args: str) -> dict:
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", server.url, "--tokenizer", tiny_llama, "--no-progress"]
    assert main([*argv, "--output-json", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_bench_serve_text_prompts(server, tiny_llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_client, "KV_SAMPLE_INTERVAL", 0.01)
    doc = _serve(server, tiny_llama, tmp_path, "--workload", "uniform", "--num-prompts", "4")
    assert "tiny" in capsys.readouterr().out
    (r,) = doc["results"]
    assert r["system"] == "tiny" and doc["config"]["model"] == "tiny"  # from GET /v1/models
    assert (r["completed"], r["failed"]) == (4, 0)
    assert (r["output_tokens"], r["output_tokens_requested"]) == (4 * 128, 4 * 128)
    assert r["output_len_mismatches"] == 0 and r["errors"] == {}
    assert r["request_rate"] == "inf"
    # The prompts went as text: the server counted its own tokens, about 128 each.
    assert r["total_token_throughput"] > r["output_throughput"]
    assert r["ttft_ms"]["mean"] > 0 and r["tpot_ms"]["mean"] > 0 and r["e2el_ms"]["p99"] > 0
    assert r["e2el_ms"]["mean"] >= r["ttft_ms"]["mean"]
    # The server's KV cache usage, scraped from /metrics during the run.
    times = [t for t, _ in r["kv_usage"]]
    assert len(times) >= 5 and times == sorted(times) and times[-1] <= r["duration_s"] + 1
    assert all(0 <= u <= 100 for _, u in r["kv_usage"])
    assert 0 < r["kv_usage_peak"] <= 100  # 4 requests of ~256 tokens in 2048 blocks


def test_kv_usage_of_each_server():
    pagoda = 'pagoda:kv_cache_usage_perc{model_name="a"} 0.25\npagoda:kv_cache_usage_perc{model_name="b"} 0.5'
    assert bench_client.kv_usage_of(pagoda) == 0.5
    assert bench_client.kv_usage_of('# HELP x\nvllm:kv_cache_usage_perc{engine="0"} 0.125') == 0.125
    assert bench_client.kv_usage_of("llamacpp:kv_cache_usage_ratio 0.75\n") == 0.75
    assert bench_client.kv_usage_of("pagoda:kv_cache_usage_perc_other 1\nfoo 2") is None


def test_bench_serve_ids_sweep_and_plot(server, tiny_llama, dataset, tmp_path):
    png = tmp_path / "sweep.png"
    doc = _serve(
        server, tiny_llama, tmp_path, "--dataset", dataset, "--prompt-ids", "--model", "tiny",
        "--sweep", "20,inf", "--max-concurrency", "2", "--label", "pagoda", "--plot", str(png),
        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
    )  # fmt: skip
    assert [(r["system"], r["request_rate"]) for r in doc["results"]] == [
        ("pagoda", "20"),
        ("pagoda", "inf"),
    ]
    for r in doc["results"]:
        assert (r["completed"], r["failed"], r["max_concurrency"]) == (6, 0, 2)
        assert r["per_request"]["output_len"] == [4, 12, 6, 8, 4, 10]
        # Token-id prompts: the server's prompt count is exactly the dataset's.
        prompt_tokens = 8 + 40 + 16 + 24 + 32 + 12
        assert r["total_token_throughput"] * r["duration_s"] == pytest.approx(prompt_tokens + 44)
        assert r["goodput"] == pytest.approx(r["request_throughput"])  # generous SLOs
    assert png.stat().st_size > 1000
    from PIL import Image

    with Image.open(png) as image:  # three panels: TTFT, TPOT and the KV cache over time
        assert image.width == 18 * 120


def test_bench_serve_chat_without_usage(server, tiny_llama, dataset, tmp_path):
    # A server that sends no usage: the client counts the streamed text's tokens itself.
    doc = _serve(
        server, tiny_llama, tmp_path, "--dataset", dataset, "--endpoint", "/v1/chat/completions",
        "--extra-body", '{"stream_options": {"include_usage": false}}',
    )  # fmt: skip
    (r,) = doc["results"]
    assert (r["completed"], r["failed"]) == (6, 0)
    assert 0 < r["output_tokens"] <= 2 * 44  # re-tokenized text: near, not exactly, 44


def test_bench_serve_counts_failures(server, tiny_llama, tokenizer, tmp_path):
    path = tmp_path / "one_too_long.jsonl"
    rows = [{"prompt_token_ids": [10] * n, "output_len": 4} for n in (8, 600, 8)]  # 600 > 512
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = _serve(server, tiny_llama, tmp_path, "--dataset", str(path), "--prompt-ids")
    (r,) = doc["results"]
    assert (r["completed"], r["failed"]) == (2, 1)
    assert r["per_request"]["ttft_ms"][1] is None
    ((message, count),) = r["errors"].items()
    assert message.startswith("HTTP 400") and count == 1


def test_bench_serve_errors(server, tiny_llama, capsys):
    base = ["bench", "serve", "--base-url", server.url, "--tokenizer", tiny_llama]
    assert main([*base, "--extra-body", '{"temperature": -1}', "--num-prompts", "2"]) == 2
    assert "the test request" in capsys.readouterr().err
    assert main([*base, "--endpoint", "/v1/chat/completions", "--prompt-ids"]) == 2
    assert "--prompt-ids needs" in capsys.readouterr().err
    dead = f"http://127.0.0.1:{free_port()}"  # nobody listens
    assert main(["bench", "serve", "--base-url", dead, "--tokenizer", tiny_llama]) == 2
    assert "pass --model" in capsys.readouterr().err


# ---- static vs continuous batching, in process -----------------------------------------------


def test_static_batches_wait_for_their_longest(tiny_llama, tokenizer):
    """8 requests in 2 batches of 4; request 0 wants 48 tokens, the rest 4. Static: the
    second batch starts only when request 0 is done. Continuous: it starts at once."""
    from pagoda.bench.throughput import run_pagoda

    rng = random.Random(1)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    reqs = [
        BenchRequest([rng.choice(vocab) for _ in range(16)], 48 if i == 0 else 4) for i in range(8)
    ]
    kwargs = dict(model=tiny_llama, dtype="float32", kv_cache_memory_bytes=16 << 20)
    runs = {
        mode: run_pagoda(kwargs, reqs, batching=mode, batch_size=4, progress=False)["per_request"]
        for mode in ("static", "continuous")
    }
    for per in runs.values():
        assert per["output_len"] == [48] + [4] * 7
        assert all(per["e2el_ms"][i] < per["e2el_ms"][0] for i in range(1, 4))
    static, continuous = runs["static"], runs["continuous"]
    # All arrive at t=0, so TTFT and E2EL are on one clock.
    assert min(static["ttft_ms"][4:]) >= static["e2el_ms"][0]
    assert max(continuous["ttft_ms"][4:]) < continuous["e2el_ms"][0]
    assert max(continuous["e2el_ms"][4:]) < continuous["e2el_ms"][0]
