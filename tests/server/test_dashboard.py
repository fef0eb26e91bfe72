"""The live dashboard and request traces: the engine's snapshot (block map, requests'
progress), the /dashboard feed through a real server, its API key, the JSON request
log, and the page itself in a real headless Chromium."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time

import httpx
import pytest

from pagoda import EngineArgs, LLMEngine, SamplingParams
from pagoda.core.block_pool import CACHED, FREE, SHARED, USED
from tests.helpers import CHROMIUM, RemoteServer, launch_chromium

KEY = "dash-key"
BLOCK_BYTES = 8192  # tiny llama: 2 layers x 2 x 16 tokens x 2 heads x 16 dims x 4 bytes


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 20)
    )


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_snapshot_block_map_and_progress(engine):
    num_blocks = engine.get_stats().kv_cache.num_blocks_total
    snap = engine.snapshot()
    assert snap.block_map == FREE * num_blocks and snap.requests == []
    prompt = list(range(5, 45))  # 40 tokens: two full blocks and a partial one
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    forked = SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": prompt}, forked)
    engine.add_request("b", {"prompt_token_ids": list(range(100, 120))}, greedy, priority=3)
    engine.add_request("late", {"prompt_token_ids": list(range(200, 208))}, greedy)
    for _ in range(3):
        engine.step()
    snap = engine.snapshot()
    by_id = {r.request_id: r for r in snap.requests}
    assert snap.num_requests == 4 == len(snap.requests)  # a's two completions, b, late
    children = [r for r in snap.requests if r.request_id.startswith("a")]
    assert len(children) == 2
    for r in snap.requests:
        assert r.state == "running"
        assert r.num_output_tokens >= 1 and r.max_tokens == 30
        assert r.num_computed_tokens == r.num_prompt_tokens + r.num_output_tokens - 1
        assert r.num_blocks == engine.scheduler.kv_cache_manager.num_blocks_of(r.request_id)
    assert by_id["b"].priority == 3 and by_id["b"].num_prompt_tokens == 20
    # a's two completions share its two full prompt blocks (refcount 2).
    assert snap.block_map.count(SHARED) == 2
    held = sum(r.num_blocks for r in snap.requests)
    assert snap.block_map.count(USED) + 2 * snap.block_map.count(SHARED) == held
    assert len(snap.block_map) == num_blocks
    _run(engine)
    snap = engine.snapshot()
    assert snap.requests == [] and snap.block_map.count(USED) == snap.block_map.count(SHARED) == 0
    # Freed full blocks stay findable by hash: cached, evictable.
    assert snap.block_map.count(CACHED) >= 2
    assert snap.stats.kv_cache.num_blocks_used == 0


def test_snapshot_shows_waiting_and_preempted(tiny_llama):
    # One sequence at a time: the second waits.
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=tiny_llama, dtype="float32", kv_cache_memory_bytes=6 * BLOCK_BYTES, max_num_seqs=1
        )
    )
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("first", {"prompt_token_ids": list(range(5, 25))}, params)
    engine.add_request("second", {"prompt_token_ids": list(range(7, 27))}, params)
    engine.step()
    snap = engine.snapshot()
    assert [(r.request_id, r.state) for r in snap.requests] == [
        ("first", "running"),
        ("second", "waiting"),
    ]
    assert snap.requests[1].num_blocks == 0 and snap.requests[1].num_computed_tokens == 0
    _run(engine)


def test_feed_samples_only_while_watched(tiny_llama):
    """The engine is asked for snapshots only while a page reads the feed; the latency
    recorder keeps nothing otherwise."""
    import asyncio

    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.entrypoints.openai.dashboard import DashboardFeed

    engine = AsyncEngine.from_engine_args(
        EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 20)
    )
    try:
        feed = DashboardFeed(engine, interval=0.05)

        async def watch(num_samples: int) -> list[str]:
            page = feed.events()
            got = [await page.__anext__() for _ in range(2 + num_samples)]
            await page.aclose()  # the page goes away
            return got

        async def scenario():
            got = await watch(3)
            assert [e.split("\n", 1)[0] for e in got] == ["event: info", "event: history"] + [
                "event: sample"
            ] * 3
            await asyncio.sleep(0.3)  # the sampler sees no page at its next turn and stops
            assert feed._task is None and not feed.recorder.active
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            async for _ in engine.generate("unwatched", params):
                pass
            assert not feed.recorder.ttfts  # nothing kept while nobody watched
            second = await watch(1)  # a new page: history from before, sampling again
            history = json.loads(second[1].split("data: ", 1)[1])
            assert len(history) >= 3 and feed._task is not None

        asyncio.run(scenario())
    finally:
        engine.shutdown()


# ---- through a real server -----------------------------------------------------------


@pytest.fixture(scope="module")
def request_log():
    fd, path = tempfile.mkstemp(prefix="pagoda-requests-", suffix=".jsonl")
    os.close(fd)
    yield path
    os.unlink(path)


@pytest.fixture(scope="module")
def server(tiny_llama, request_log):
    args = ["--api-key", KEY, "--dashboard-interval", "0.1", "--request-log", request_log]
    with RemoteServer(tiny_llama, *args) as s:
        yield s


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


class EventReader:
    """Reads /dashboard/events in a thread; `events` is what came, as (kind, data)."""

    def __init__(self, url: str, **kwargs) -> None:
        self.events: list[tuple[str, object]] = []
        self.status: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, kwargs), daemon=True)
        self._thread.start()

    def _read(self, url, kwargs) -> None:
        with httpx.stream("GET", url, timeout=60, **kwargs) as response:
            self.status = response.status_code
            kind = None
            for line in response.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    self.events.append((kind, json.loads(line[6:])))
                if self._stop.is_set():
                    return

    def samples(self) -> list[dict]:
        return [data for kind, data in self.events if kind == "sample"]

    def wait(self, predicate, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in self.samples() if predicate(s)]
            if found:
                return found[0]
            time.sleep(0.02)
        raise TimeoutError(f"no sample matched; last: {self.samples()[-1:]}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_dashboard_needs_the_key(server):
    for path in ("/dashboard", "/dashboard/events"):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(server.url + path + "?api_key=wrong", timeout=10)
        assert r.status_code == 401
    r = httpx.get(server.url + "/dashboard?api_key=" + KEY, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<canvas id="blockmap"' in r.text and "http" not in r.text.split("<script>")[1]
    cookie = r.cookies.get("pagoda_api_key")
    assert cookie == KEY and "httponly" in r.headers["set-cookie"].lower()
    # The page's event stream goes with the cookie; a script gets in with the header.
    for kwargs in (
        {"cookies": {"pagoda_api_key": KEY}},
        {"headers": {"Authorization": f"Bearer {KEY}"}},
    ):
        reader = EventReader(server.url + "/dashboard/events", **kwargs)
        reader.wait(lambda s: True)
        reader.close()
        assert reader.status == 200


def test_feed_follows_the_engine(server, request_log):
    reader = EventReader(
        server.url + "/dashboard/events", headers={"Authorization": f"Bearer {KEY}"}
    )
    try:
        reader.wait(lambda s: s["running"] == 0)
        kinds = [kind for kind, _ in reader.events]
        assert kinds[:2] == ["info", "history"]
        info = reader.events[0][1]
        assert info["num_blocks"] == 2048 and info["block_size"] == 16
        client = _client(server)
        done = threading.Event()

        prompts = ["The same prefix " * 8 + str(i) for i in range(12)]
        load = Load(client, server_model(server), prompts, max_tokens=400)
        waiter = threading.Thread(target=lambda: ([t.join() for t in load.threads], done.set()))
        waiter.start()
        busy = reader.wait(lambda s: s["running"] > 0 and s["requests"])
        assert busy["block_map"].count(USED) + busy["block_map"].count(SHARED) > 0
        assert busy["kv_usage_perc"] > 0
        for r in busy["requests"]:
            assert r["state"] in ("running", "waiting", "preempted", "swapped")
            assert r["max_tokens"] == 400 and r["age_s"] >= 0
        assert done.wait(120) and not load.errors, load.errors
        idle = reader.wait(lambda s: s["running"] == 0 and s["t"] > busy["t"] and not s["requests"])
        assert idle["block_map"].count(USED) == idle["block_map"].count(SHARED) == 0
        assert idle["block_map"].count(CACHED) > 0  # the shared prefix stays cached
        rates = [s["generation_tps"] for s in reader.samples() if s["generation_tps"]]
        assert rates and max(rates) > 0
        assert any(s["ttft_p50_ms"] for s in reader.samples())
        assert any(s["tpot_p50_ms"] for s in reader.samples())
        assert all(s["snapshot_ms"] < 1000 for s in reader.samples())
    finally:
        reader.close()
    # A page that connects now gets the samples so far as its history.
    late = EventReader(server.url + "/dashboard/events", headers={"Authorization": f"Bearer {KEY}"})
    late.wait(lambda s: True)
    late.close()
    history = late.events[1][1]
    assert late.events[1][0] == "history" and len(history) >= len(reader.samples()) - 2
    assert "block_map" not in history[0]
    # Every request left one trace line.
    traces = _read_lines(request_log)
    assert len([t for t in traces if t["num_generation_tokens"] == 400]) >= 12
    t = traces[-1]
    assert t["event"] == "request_finished" and t["finish_reason"] == "length"
    assert t["arrival_time"] <= t["queued_time"] <= t["first_scheduled_time"]
    assert t["first_scheduled_time"] <= t["first_token_time"] <= t["finished_time"]
    assert abs(t["finished_time"] - time.time()) < 600
    assert t["ttft_s"] == pytest.approx(t["first_token_time"] - t["arrival_time"], abs=1e-5)
    assert t["num_prompt_tokens"] > 0 and t["tpot_s"] > 0
    # The 12 prompts share their first block: all but the first found it cached.
    assert sum(1 for t in traces[-12:] if t["num_cached_tokens"] >= 16) >= 11


def _read_lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


class Load:
    """Completions sent at once from threads (ignore_eos, so each runs max_tokens)."""

    def __init__(self, client, model: str, prompts: list[str], max_tokens: int) -> None:
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._send, args=(client, model, p, max_tokens))
            for p in prompts
        ]
        for t in self.threads:
            t.start()

    def _send(self, client, model, prompt, max_tokens) -> None:
        try:
            client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True}
            )
        except BaseException as e:
            self.errors.append(e)

    def join(self) -> None:
        for t in self.threads:
            t.join()
        assert not self.errors, self.errors


def server_model(server) -> str:
    return httpx.get(
        server.base_url + "/models", headers={"Authorization": f"Bearer {KEY}"}
    ).json()["data"][0]["id"]


def test_request_log_counts_preemptions(tiny_llama):
    """A pool too small for all: requests get preempted and their lines say how often."""
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    try:
        args = ["--kv-cache-memory-bytes", str(12 * BLOCK_BYTES), "--request-log", path]
        with RemoteServer(tiny_llama, *args) as s:
            prompts = [f"prompt number {i} " * 4 for i in range(6)]
            Load(s.client(), tiny_llama, prompts, max_tokens=60).join()
            preemptions = s.wait_idle()[("pagoda:num_preemptions_total", ())]
        traces = _read_lines(path)
        assert len(traces) == 6 and all(t["num_generation_tokens"] == 60 for t in traces)
        assert preemptions > 0
        assert sum(t["num_preemptions"] for t in traces) == preemptions
    finally:
        os.unlink(path)


def test_dashboard_does_not_hold_up_shutdown(tiny_llama):
    with RemoteServer(tiny_llama, "--shutdown-timeout", "30") as s:
        reader = EventReader(s.url + "/dashboard/events")
        reader.wait(lambda sample: True)
        started = time.monotonic()
        assert s.terminate(timeout=30) == 0
        assert time.monotonic() - started < 10  # not the 30 s an open stream could hold it
        reader.close()
        assert reader.samples()[-1].get("error")


# ---- the page, in a real browser -------------------------------------------------------

REQUIRE_BROWSER = os.environ.get("PAGODA_REQUIRE_BROWSER") == "1"


def test_dashboard_in_a_browser(server, tmp_path):
    if CHROMIUM is None:
        if REQUIRE_BROWSER:
            pytest.fail("PAGODA_REQUIRE_BROWSER=1 but no chromium on PATH")
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    client = _client(server)
    model = server_model(server)
    with sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            requests_out = []
            page.on("request", lambda r: requests_out.append(r.url))
            page.goto(f"{server.url}/dashboard?api_key={KEY}")
            page.wait_for_function("document.getElementById('running-count').textContent === '0'")
            assert page.locator("#blockmap").get_attribute("data-used") == "0"
            assert (
                page.locator("#blockmap").get_attribute("data-free") == "2048"
                or int(page.locator("#blockmap").get_attribute("data-cached")) > 0
            )
            load = Load(client, model, [f"Tell me about block {i}." for i in range(16)], 400)
            page.wait_for_function(
                "Number(document.getElementById('running-count').textContent) > 0"
                " && Number(document.getElementById('blockmap').dataset.used) > 0"
                " && document.querySelectorAll('tr.request').length > 0",
                timeout=60_000,
            )
            page.screenshot(path=str(tmp_path / "dashboard-busy.png"), full_page=True)
            rows = page.locator("tr.request")
            assert rows.count() > 0
            assert rows.first.locator("td").nth(1).inner_text() in ("running", "waiting")
            load.join()
            page.wait_for_function(
                "document.getElementById('running-count').textContent === '0'"
                " && document.getElementById('blockmap').dataset.used === '0'"
                " && document.querySelectorAll('tr.request').length === 0",
                timeout=60_000,
            )
            assert int(page.locator("#blockmap").get_attribute("data-cached")) > 0
            # The throughput chart got the load's samples (the page's own series).
            assert page.evaluate("samples.some((p) => p.generation_tps > 0)")
            assert "live" in page.locator("#status").inner_text()
            # Nothing fetched from anywhere but this server.
            assert requests_out and all(u.startswith(server.url) for u in requests_out)
        finally:
            browser.close()


# ---- OpenTelemetry traces --------------------------------------------------------------


class OTLPReceiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1 that keeps the spans it is sent."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        for span in scope_spans.spans:
                            receiver.spans.append((resource_spans.resource, span))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def _attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = (
            [x.string_value for x in v.array_value.values]
            if kind == "array_value"
            else getattr(v, kind)
        )
    return out


def test_otlp_traces_one_span_per_request(tiny_llama):
    pytest.importorskip("opentelemetry.sdk")
    receiver = OTLPReceiver()
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    try:
        args = ["--otlp-traces-endpoint", receiver.url, "--served-model-name", "tiny"]
        # The SDK's batch processor exports every 100 ms here (5 s by default).
        with RemoteServer(tiny_llama, *args, env={"OTEL_BSP_SCHEDULE_DELAY": "100"}) as s:
            client = s.client()
            client.completions.create(
                model="tiny", prompt="traced request", max_tokens=5,
                extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
            )  # fmt: skip
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "untraced"}], max_tokens=3
            )
            deadline = time.monotonic() + 30
            while len(receiver.spans) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert s.terminate() == 0
    finally:
        receiver.close()
    assert len(receiver.spans) == 2
    (resource, traced), (_, untraced) = sorted(
        receiver.spans, key=lambda rs: _attributes(rs[1])["gen_ai.usage.completion_tokens"]
    )[::-1]
    assert {kv.key: kv.value.string_value for kv in resource.attributes}["service.name"] == "pagoda"
    assert traced.name == "llm_request"
    # The caller's trace: the span is the traceparent's child.
    assert traced.trace_id.hex() == trace_id and traced.parent_span_id.hex() == parent_id
    assert untraced.trace_id.hex() != trace_id and not untraced.parent_span_id
    a = _attributes(traced)
    assert a["gen_ai.response.model"] == "tiny" and a["gen_ai.request.id"].startswith("cmpl-")
    assert a["gen_ai.usage.completion_tokens"] == 5 and a["gen_ai.usage.prompt_tokens"] > 0
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["pagoda.num_preemptions"] == 0
    duration = (traced.end_time_unix_nano - traced.start_time_unix_nano) / 1e9
    assert duration == pytest.approx(a["gen_ai.latency.e2e"], abs=1e-3)
    assert abs(traced.end_time_unix_nano / 1e9 - time.time()) < 600
    events = {e.name: e.time_unix_nano for e in traced.events}
    assert list(events) == ["queued", "first_scheduled", "first_token"]
    times = [traced.start_time_unix_nano, *events.values(), traced.end_time_unix_nano]
    assert times == sorted(times)


def test_bad_trace_headers_are_refused(engine):
    from pagoda.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="trace_headers"):
        engine.add_request("t", "hello", trace_headers=["traceparent"])
    with pytest.raises(InvalidRequestError, match="trace_headers.traceparent"):
        engine.add_request("t", "hello", trace_headers={"traceparent": "x" * 600})
    assert not engine.has_unfinished_requests()
