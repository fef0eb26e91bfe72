"""Server limits: the API key (401), a bounded queue (503 + Retry-After), and a
graceful SIGTERM (every request answered, exit code 0)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import openai
import pytest

from tests.helpers import RemoteServer

KEY = "sk-pagoda-test"


@pytest.fixture(scope="module")
def server(tiny_llama):
    args = ["--served-model-name", "tiny", "--max-num-seqs", "2", "--max-queue-len", "2"]
    with RemoteServer(tiny_llama, *args, env={"PAGODA_API_KEY": KEY}) as s:
        yield s


def _error(r: httpx.Response, status: int, code: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code
    return error


def test_api_key_guards_v1(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        _error(httpx.get(server.base_url + "/models", headers=headers), 401, "invalid_api_key")
        r = httpx.post(server.base_url + "/completions", json=body, headers=headers)
        _error(r, 401, "invalid_api_key")
        r = httpx.post(server.base_url + "/chat/completions", json={}, headers=headers)
        _error(r, 401, "invalid_api_key")
    assert httpx.get(server.base_url + "/models", headers=auth).status_code == 200
    assert httpx.post(server.base_url + "/completions", json=body, headers=auth).status_code == 200
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path).status_code == 200, path
    # Which prefixes are cached is the key holder's to know.
    _error(httpx.get(server.url + "/kv_events"), 401, "invalid_api_key")
    with httpx.stream("GET", server.url + "/kv_events", headers=auth, timeout=30) as r:
        assert r.status_code == 200
        assert json.loads(next(r.iter_lines()))["cleared"] is True  # the snapshot first
    with pytest.raises(openai.AuthenticationError):
        server.client().models.list()
    ok = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    assert ok.completions.create(model="tiny", prompt="Hello", max_tokens=2).choices


def test_queue_full_gets_503(server):
    """max_num_seqs 2 + max_queue_len 2: two run, two wait, the fifth gets 503."""
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {
        "model": "tiny",
        "prompt": "The quick brown fox",
        "max_tokens": 480,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.base_url, headers=auth, timeout=60) as http:
        streams, lines = [], []
        try:
            for i in range(4):
                cm = http.stream("POST", "/completions", json=body)
                response = cm.__enter__()
                streams.append(cm)
                assert response.status_code == 200  # accepted
                if i < 2:
                    # And running. Keep the iterator: closing it would hang up.
                    lines.append(response.iter_lines())
                    next(lines[-1])
            deadline = time.monotonic() + 10
            while server.metrics()[("pagoda:num_requests_waiting", ())] != 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            short = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
            r = http.post("/completions", json=short)
            _error(r, 503, "queue_full")
            assert int(r.headers["Retry-After"]) >= 1
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
            _error(http.post("/chat/completions", json=chat), 503, "queue_full")
            # A multi-prompt request is refused whole.
            _error(
                http.post("/completions", json={**short, "prompt": ["a", "b"]}), 503, "queue_full"
            )
        finally:
            for cm in streams:
                cm.__exit__(None, None, None)  # hang up: aborts them
    after = server.wait_idle()
    assert after[("pagoda:num_blocks_used", ())] == 0
    r = httpx.post(
        server.base_url + "/completions",
        json={"model": "tiny", "prompt": "Hello", "max_tokens": 2},
        headers=auth,
    )
    assert r.status_code == 200


def test_sigterm_finishes_or_aborts_in_flight_and_exits_0(tiny_llama):
    """Short requests in flight finish; long ones are aborted after --shutdown-timeout
    (their streams end with finish_reason "abort"); the process exits 0."""
    args = ["--served-model-name", "tiny", "--api-key", KEY, "--shutdown-timeout", "0.5"]
    server = RemoteServer(tiny_llama, *args)
    try:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)

        async def run():
            started = asyncio.Event()
            num_started = 0

            async def one(max_tokens: int):
                nonlocal num_started
                stream = await client.completions.create(
                    model="tiny",
                    prompt="Hello world",
                    max_tokens=max_tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                finish, text = None, ""
                async for chunk in stream:
                    if not text:
                        num_started += 1
                        if num_started == 16:
                            started.set()
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                return finish

            async def kv_events() -> int:
                """A router's KV event stream: ended by the server when it drains, not cut."""
                auth = {"Authorization": f"Bearer {KEY}"}
                async with (
                    httpx.AsyncClient(timeout=60) as http,
                    http.stream("GET", server.url + "/kv_events", headers=auth) as r,
                ):
                    return len([line async for line in r.aiter_lines()])

            events = asyncio.create_task(kv_events())
            tasks = [asyncio.create_task(one(3 if i % 2 else 480)) for i in range(16)]
            await asyncio.wait_for(started.wait(), 60)
            server.proc.send_signal(15)  # SIGTERM, with every request streaming
            results = await asyncio.gather(*tasks)
            assert await events >= 1  # the snapshot and the changes, then a clean end
            await client.close()
            return results

        results = asyncio.run(run())
        assert server.proc.wait(60) == 0, server.output()
        assert results[1::2] == ["length"] * 8  # the short ones finished
        assert results[0::2] == ["abort"] * 8  # the long ones were cut at the timeout
    finally:
        server.stop()


def test_sigterm_ends_the_process_even_with_a_client_that_never_reads(tiny_llama):
    """A client that sends a long streaming request and then neither reads nor hangs up
    cannot keep the server alive past its shutdown timeout (plus uvicorn's grace)."""
    server = RemoteServer(tiny_llama, "--served-model-name", "tiny", "--shutdown-timeout", "1")
    try:
        # About 9 MB of events: far more than the socket buffers hold, so the server's
        # writes wait for a reader that never comes.
        body = json.dumps(
            {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "stream": True, "n": 64}
        ).encode()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            time.sleep(2)  # streaming into a socket nobody reads
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(30) == 0
            assert time.monotonic() - start < 15  # 1 s of grace, then uvicorn's 5 s, then out
    finally:
        server.stop()
