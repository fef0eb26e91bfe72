"""`pagoda router`: routing by prompt prefix over replicas, and what it relays.

The policy tests drive `Router` alone; the rest run two real `pagoda serve`
replicas and a real `pagoda router` on 127.0.0.1, driven by the official client.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import openai
import pytest

from pagoda.entrypoints.router import Router, RouterConfig
from pagoda.entrypoints.router.prefix_table import PrefixTable
from pagoda.entrypoints.router.tokens import PromptTokenizer
from tests.helpers import RemoteRouter, RemoteServer, free_port, reachable

MODEL = "SmolLM2-135M-Instruct"

# ---- the policy alone --------------------------------------------------------------------


def make_router(backends: list[str], policy: str = "prefix", tokenizer=None, **kwargs) -> Router:
    return Router(RouterConfig(backends=tuple(backends), policy=policy, **kwargs), tokenizer)


def family_prompts(num_families: int, per_family: int, prefix_len: int = 64) -> list[list[int]]:
    """Prompts in families: each family shares a prefix, each prompt ends its own way."""
    prompts = []
    for f in range(per_family * num_families):
        family = f % num_families
        prefix = [(family * 37 + i * 11) % 300 + 3 for i in range(prefix_len)]
        prompts.append(prefix + [(f * 13 + i) % 300 + 3 for i in range(8)])
    return prompts


def route(router: Router, prompts: list[list[int]]) -> list[int]:
    chosen = []
    for p in prompts:
        hashes = router.block_hashes({"prompt": p})
        replica = router.choose(hashes)
        router.record(hashes, replica)
        chosen.append(replica.index)
    return chosen


def test_prefix_policy_keeps_each_family_on_one_replica():
    prompts = family_prompts(4, 6)
    router = make_router(["http://a", "http://b"], "prefix")
    chosen = route(router, prompts)
    by_family = {f: {chosen[i] for i in range(f, len(prompts), 4)} for f in range(4)}
    assert all(len(replicas) == 1 for replicas in by_family.values())
    assert sorted(chosen[:4]) == [0, 0, 1, 1]  # new families spread out
    rr = route(make_router(["http://a", "http://b"], "round-robin"), prompts)
    assert rr == [0, 1] * 12


def test_loads_first_then_cache():
    router = make_router(["http://a", "http://b"], "prefix", balance_threshold=2)
    hashes = router.block_hashes({"prompt": list(range(3, 67))})
    assert len(hashes) == 4
    router.record(hashes, router.replicas[0])
    assert router.choose(hashes).index == 0
    router.replicas[0].in_flight = 3  # within 2 of the other? no: 3 > 0 + 2
    assert router.choose(hashes).index == 1
    router.replicas[0].in_flight = 2
    assert router.choose(hashes).index == 0
    router.set_health(router.replicas[0], False)  # down: its blocks are forgotten
    assert router.choose(hashes).index == 1
    router.set_health(router.replicas[0], True)
    router.replicas[0].in_flight = 0
    assert router.table.matched_blocks(hashes, 0) == 0
    assert make_router(["http://a"], "least-loaded").choose(hashes).index == 0
    with pytest.raises(ValueError, match="policy"):
        make_router(["http://a"], "random")


def test_chat_and_text_prompts_hash_through_the_tokenizer(tiny_llama):
    router = make_router(["http://a"], tokenizer=PromptTokenizer.load(tiny_llama))
    text = "the quick brown fox jumps over the lazy dog " * 8

    def chat(end: str) -> list[bytes]:
        return router.block_hashes({"messages": [{"role": "user", "content": text + end}]})

    a, b = chat("one"), chat("two, and a longer ending than the first one has " * 3)
    assert len(a) >= 3 and b[: len(a) - 1] == a[: len(a) - 1]  # the shared prefix
    parts = [{"role": "user", "content": [{"type": "text", "text": text + "one"}]}]
    assert router.block_hashes({"messages": parts}) == a
    assert len(router.block_hashes({"prompt": text})) >= 3
    assert router.block_hashes({"prompt": [1, -5] * 20}) == []  # ids no vocabulary has


def test_prefix_table_is_bounded_and_chained():
    table = PrefixTable(capacity=3)
    table.record([b"a", b"b", b"c", b"d"], 0)
    assert b"a" not in table.owners and table.matched_blocks([b"b", b"c"], 0) == 2
    assert table.matched_blocks([b"x", b"b"], 0) == 0  # a prefix, not any block


# ---- real replicas ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(tiny_llama):
    servers = [RemoteServer(tiny_llama), RemoteServer(tiny_llama)]
    yield servers
    for s in servers:
        s.stop()


def hits(servers) -> float:
    return sum(s.metrics()[("pagoda:prefix_cache_hits_total", ())] for s in servers)


def test_prefix_routing_beats_round_robin_on_cache_hits(replicas, tiny_llama):
    """The shared-prefix workload, 4 families of 6: by prefix, only each family's first
    request misses its prefix; round-robin sends each family to both replicas."""
    prompts = family_prompts(4, 6)
    random.Random(0).shuffle(prompts)  # families arrive interleaved, in no fixed turn
    got = {}
    for policy, offset in (("prefix", 0), ("round-robin", 1)):
        # Distinct tokens per policy: the replicas' caches keep the first run's blocks.
        run = [[(t + offset * 101) % 300 + 3 for t in p] for p in prompts]
        router = RemoteRouter([s.url for s in replicas], tiny_llama, "--policy", policy)
        try:
            before = hits(replicas)
            client = router.client()
            for p in run:
                client.completions.create(model=tiny_llama, prompt=p, max_tokens=2)
            got[policy] = hits(replicas) - before
            m = router.metrics()
        finally:
            router.stop()
        counts = [m[("pagoda_router:requests_total", (("replica", s.url),))] for s in replicas]
        assert counts[0] > 0 and counts[1] > 0 and sum(counts) == len(run)
    assert got["prefix"] >= 20 * 64  # 20 of 24 requests found their 64-token prefix
    assert got["round-robin"] < got["prefix"]


def test_relays_streams_errors_and_models(replicas, tiny_llama):
    router = RemoteRouter([s.url for s in replicas], tiny_llama)
    try:
        client = router.client()
        direct = replicas[0].client()
        prompt = list(range(5, 40))
        kwargs = dict(model=tiny_llama, prompt=prompt, max_tokens=12, temperature=0)
        want = direct.completions.create(**kwargs).choices[0].text
        assert client.completions.create(**kwargs).choices[0].text == want
        stream = client.completions.create(stream=True, **kwargs)
        assert "".join(c.choices[0].text for c in stream) == want
        chat = client.chat.completions.create(
            model=tiny_llama, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.choices[0].message.content is not None
        with pytest.raises(openai.BadRequestError) as routed:
            client.completions.create(model=tiny_llama, prompt="x", max_tokens=-1)
        with pytest.raises(openai.BadRequestError) as plain:
            direct.completions.create(model=tiny_llama, prompt="x", max_tokens=-1)
        assert routed.value.body == plain.value.body  # the replica's error, unchanged
        assert [m.id for m in client.models.list().data] == [tiny_llama]
    finally:
        router.stop()


def test_callers_that_leave_free_their_replica(replicas, tiny_llama):
    """A caller gone mid-stream, or before a non-streamed answer: the replica's
    connection is closed (so it aborts the request) and its in-flight count drops."""
    router = RemoteRouter([replicas[0].url], tiny_llama)
    body = {"model": tiny_llama, "prompt": "go", "max_tokens": 400, "ignore_eos": True}
    try:
        with httpx.stream("POST", router.url + "/v1/completions", json={**body, "stream": True},
                          timeout=30) as r:  # fmt: skip
            next(r.iter_lines())
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(router.url + "/v1/completions", json=body, timeout=0.05)
        key = ("pagoda_router:replica_in_flight", (("replica", replicas[0].url),))
        deadline = time.monotonic() + 30
        while router.metrics()[key] != 0:
            assert time.monotonic() < deadline, router.metrics()[key]
            time.sleep(0.1)
        replicas[0].wait_idle()  # both were aborted there, not run to the end
    finally:
        router.stop()


def test_replicas_found_by_dns(replicas, tiny_llama):
    """`--discover-dns HOST:PORT`, as a headless Kubernetes Service is used: the
    replicas are the addresses the name resolves to."""
    port = replicas[0].port
    router = RemoteRouter([], tiny_llama, "--discover-dns", f"localhost:{port}")
    try:
        r = router.client().completions.create(model=tiny_llama, prompt="hi", max_tokens=2)
        assert r.choices[0].text is not None
        routed = router.metrics()[
            ("pagoda_router:requests_total", (("replica", f"http://127.0.0.1:{port}"),))
        ]
        assert routed == 1
    finally:
        router.stop()
    r = make_router([], discover="localhost:1")
    asyncio.run(r.replica_set.rediscover())
    assert "http://127.0.0.1:1" in [x.url for x in r.replicas]
    r.replica_set.set_urls(["http://b"])
    assert [x.url for x in r.replicas] == ["http://b"] and r.replicas[0].index > 0
    with pytest.raises(ValueError, match="HOST:PORT"):
        make_router([], discover="localhost")


def test_a_draining_replica_passes_its_requests_on(replicas, tiny_llama):
    """A replica answering 503 (here a stand-in for one shutting down) started
    nothing: the request goes to another, and with no other its 503 comes back."""
    import threading

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response

    app = FastAPI()
    refusal = {"message": "shutting down", "type": "ServiceUnavailableError",
               "param": None, "code": "unavailable"}  # fmt: skip

    @app.post("/v1/completions")
    async def refuse():
        return JSONResponse({"error": refusal}, status_code=503)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    port = free_port()
    fake = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error"))
    threading.Thread(target=fake.run, daemon=True).start()
    while not fake.started:
        time.sleep(0.05)
    draining = f"http://127.0.0.1:{port}"
    try:
        router = RemoteRouter(
            [draining, replicas[0].url], tiny_llama, "--policy", "round-robin",
            "--health-check-interval", "60",
        )  # fmt: skip
        try:
            for i in range(3):
                r = router.client().completions.create(
                    model=tiny_llama, prompt=f"x {i}", max_tokens=2
                )
                assert r.choices[0].text is not None
            m = router.metrics()
            assert m[("pagoda_router:retries_total", ())] >= 1
            assert m[("pagoda_router:replica_healthy", (("replica", draining),))] == 0
        finally:
            router.stop()
        alone = RemoteRouter([draining], tiny_llama, "--health-check-interval", "60")
        try:
            with pytest.raises(openai.APIStatusError) as e:
                alone.client().completions.create(model=tiny_llama, prompt="x", max_tokens=2)
            assert e.value.status_code == 503 and e.value.body == refusal
        finally:
            alone.stop()
    finally:
        fake.should_exit = True


def test_a_dead_replica_loses_no_request_that_had_not_started(tiny_llama):
    servers = [RemoteServer(tiny_llama), RemoteServer(tiny_llama)]
    # Health checks far apart: the router learns of the death from the request itself.
    router = RemoteRouter(
        [s.url for s in servers], tiny_llama, "--policy", "round-robin",
        "--health-check-interval", "60",
    )  # fmt: skip
    try:
        client = router.client()
        servers[1].proc.kill()
        servers[1].proc.wait()
        for i in range(6):
            r = client.completions.create(model=tiny_llama, prompt=f"request {i}", max_tokens=3)
            assert r.choices[0].text is not None
        m = router.metrics()
        assert m[("pagoda_router:retries_total", ())] >= 1
        assert m[("pagoda_router:replica_healthy", (("replica", servers[1].url),))] == 0
        assert m[("pagoda_router:requests_total", (("replica", servers[0].url),))] == 6
    finally:
        router.stop()
        for s in servers:
            s.stop()


def test_prefill_and_decode_on_two_replicas(tiny_llama, tmp_path):
    """--policy pd: 16 requests at once, each prefilled on the producer (one token,
    answered once its blocks are in the shared tier), then decoded on the consumer,
    which finds every full prompt block in the tier: the tokens one replica gives.
    With the producer dead, the consumer prefills itself (the request is not lost)."""
    tier = ["--kv-offload-dir", str(tmp_path), "--kv-transfer-config"]
    producer = RemoteServer(tiny_llama, *tier, '{"kv_role": "kv_producer"}')
    consumer = RemoteServer(tiny_llama, *tier, '{"kv_role": "kv_consumer"}')
    router = RemoteRouter([], tiny_llama, "--policy", "pd", "--prefill", producer.url,
                          "--decode", consumer.url, "--health-check-interval", "60")  # fmt: skip
    prompts = [[(7 * i + j) % 300 + 3 for j in range(5 * 16 + 3)] for i in range(16)]
    kwargs = dict(model=tiny_llama, max_tokens=8, temperature=0)
    try:

        async def all_at_once(client, prompts):
            return await asyncio.gather(
                *(client.completions.create(prompt=p, **kwargs) for p in prompts)
            )

        got = asyncio.run(all_at_once(router.async_client(), prompts))
        direct = producer.client()  # a replica alone (its cache holds the prompts)
        want = [direct.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts]
        assert [r.choices[0].text for r in got] == want
        m = consumer.metrics()
        assert m[("pagoda:kv_tier_hit_tokens_total", ())] == 16 * 5 * 16
        assert m[("pagoda:prefix_cache_hits_total", ())] == 16 * 5 * 16
        routed = router.metrics()
        assert routed[("pagoda_router:requests_total", (("replica", producer.url),))] == 16
        assert routed[("pagoda_router:requests_total", (("replica", consumer.url),))] == 16
        producer.proc.kill()
        producer.proc.wait()
        late = router.client().completions.create(prompt=[5] * 40, **kwargs)
        assert late.choices[0].text == consumer.client().completions.create(
            prompt=[5] * 40, **kwargs).choices[0].text  # fmt: skip
    finally:
        router.stop()
        consumer.stop()
        producer.stop()


def test_serve_data_parallel(tiny_llama):
    """`pagoda serve --data-parallel-size 2`: two replicas (a core each) behind the
    prefix router on the one port; SIGTERM stops them all."""
    server = RemoteServer(tiny_llama, "--data-parallel-size", "2")
    try:
        client = server.client()
        for i in range(4):
            r = client.completions.create(model=tiny_llama, prompt=f"say {i}", max_tokens=3)
            assert r.choices[0].text is not None
        text = httpx.get(server.url + "/metrics").text
        urls = [
            line.split('replica="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith("pagoda_router:requests_total{")
        ]
        assert len(urls) == 2 and all(reachable(u) for u in urls)
        assert server.terminate() == 0
        assert not any(reachable(u) for u in urls)  # no replica outlives the server
    finally:
        server.stop()


def test_a_killed_replica_comes_back(gguf_path):
    """A replica of `--data-parallel-size 2` killed (SIGKILL) under load: the stream it
    served ends with an error event (not a broken connection), the other stream
    finishes, and the replica is started again, counted, and serves again."""
    server = RemoteServer(None, "--data-parallel-size", "2")  # SmolLM2: slow enough to kill
    try:
        client = server.client()
        streams = [
            client.completions.create(
                model=MODEL, prompt=f"stream {i}", max_tokens=300, stream=True,
                extra_body={"ignore_eos": True},
            )
            for i in range(2)
        ]  # fmt: skip
        for stream in streams:
            next(iter(stream))  # both running, one on each replica (least loaded)
        pid, url = _replica(server, 0)
        os.kill(pid, signal.SIGKILL)
        outcomes = []
        for stream in streams:
            try:
                outcomes.append(("done", sum(1 for _ in stream)))
            except openai.APIError as e:
                outcomes.append(("error", str(e)))
        assert sorted(kind for kind, _ in outcomes) == ["done", "error"], outcomes
        assert "stopped before it ended" in next(m for k, m in outcomes if k == "error")

        restarts = ("pagoda_router:replica_restarts_total", (("replica", url),))
        healthy = ("pagoda_router:replica_healthy", (("replica", url),))
        deadline = time.monotonic() + 120
        while not (server.metrics().get(restarts) == 1 and server.metrics().get(healthy) == 1):
            assert time.monotonic() < deadline, server.output()[-3000:]
            time.sleep(0.5)
        assert "exited with status -9; starting it again" in server.output()
        assert reachable(url)
        requests = ("pagoda_router:requests_total", (("replica", url),))
        before = server.metrics()[requests]
        for i in range(4):  # least loaded, ties going round: both replicas take some
            client.completions.create(model=MODEL, prompt=f"again {i}", max_tokens=2)
        assert server.metrics()[requests] > before
        assert server.terminate() == 0
    finally:
        server.stop()


def _replica(server: RemoteServer, i: int) -> tuple[int, str]:
    """(pid, url) of replica `i` of a `--data-parallel-size` server, from its log."""
    for line in server.output().splitlines():
        if f"replica {i}: pid " in line:
            words = line.split()
            return int(words[words.index("pid") + 1]), words[-1]
    raise AssertionError(server.output())


def test_kv_events_follow_the_replicas_caches(tiny_llama):
    """`--kv-events`: the router knows what each replica's prefix cache holds, from
    a snapshot when it connects and each change after: blocks a replica cached for a
    request that never passed the router, and no longer the blocks it evicted."""
    import threading

    import uvicorn

    from pagoda.entrypoints.router import build_app

    # 40 blocks each (the tiny llama's K/V is 8 KiB a block in float32).
    servers = [RemoteServer(tiny_llama, "--kv-cache-memory-bytes", str(40 * 8192)) for _ in "ab"]
    a, b = servers
    earlier = list(range(10, 74))  # on a before the router starts: in its snapshot
    a.client().completions.create(model=tiny_llama, prompt=earlier, max_tokens=1)
    router = make_router([s.url for s in servers], kv_events=True)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(router, health_check_interval=0.2), port=port, log_level="error")
    )
    threading.Thread(target=server.run, daemon=True).start()

    def held(prompt: list[int], replica: int) -> int:
        return router.table.matched_blocks(router.block_hashes({"prompt": prompt}), replica)

    def until(condition, what: str) -> None:
        deadline = time.monotonic() + 20
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    try:
        until(lambda: held(earlier, 0) == 4, "a's snapshot")
        assert held(earlier, 1) == 0
        # Sent straight to b: the router learns it from b's events, and routes there.
        families = [[(f * 41 + i * 7) % 300 + 3 for i in range(64)] for f in range(3)]
        for prompt in families:
            b.client().completions.create(model=tiny_llama, prompt=prompt, max_tokens=1)
            until(lambda p=prompt: held(p, 1) == 4, "b's events")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        before = hits([b])
        for prompt in families:
            client.completions.create(model=tiny_llama, prompt=prompt + [9, 9], max_tokens=1)
        assert hits([b]) - before == 3 * 64  # every one went to b and found its prefix
        # b fills its 40 blocks with other prompts: the families' blocks are evicted.
        for i in range(12):
            other = [(i * 53 + j * 3) % 300 + 3 for j in range(64)]
            b.client().completions.create(model=tiny_llama, prompt=other, max_tokens=1)
        until(lambda: all(held(p, 1) == 0 for p in families), "b's evictions")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert f'pagoda_router:kv_event_batches_total{{replica="{b.url}"}}' in metrics
    finally:
        server.should_exit = True
        for s in servers:
            s.stop()


def test_the_routers_tokens_are_the_engines(tiny_llama):
    """PromptTokenizer (tokenizers + jinja2, no torch) gives the ids the engine's front
    door gives: the same prefix hashes, so the router's prefix hits are real ones."""
    from pagoda.engine.processor import Processor
    from pagoda.engine_args import EngineArgs
    from pagoda.model_executor.model_files import load_tokenizer

    config = EngineArgs(model=tiny_llama).create_model_config()
    processor = Processor(load_tokenizer(tiny_llama, False), config, config.max_model_len)
    tokenizer = PromptTokenizer.load(tiny_llama)
    for text in ["hello world", "the quick brown fox " * 20, "ünïcödé and 中文 text"]:
        _, ids, _ = processor.process_prompt(text)
        assert tokenizer.encode(text) == ids
        conversation = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": text},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again: " + text},
        ]
        _, ids, _ = processor.process_prompt({"messages": conversation})
        assert tokenizer.chat(conversation) == ids
