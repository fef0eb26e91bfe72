"""A vision-language model behind the OpenAI server: images as data: URIs through the
official `openai` client, URLs fetched only from allowed hosts (with a size cap), and a
400 naming the problem for every bad image while the server serves on."""

from __future__ import annotations

import http.server
import threading

import httpx
import pytest

from pagoda import LLM
from tests.helpers import MM_GREEDY, RemoteServer, data_uri, image

MAX_IMAGE_BYTES = 20 << 20  # RequestLimits.max_image_bytes


@pytest.fixture(scope="module")
def image_host():
    """An HTTP server on 127.0.0.1 serving /cat.png, /big.png (over the size cap) and
    404 for anything else."""
    import io

    buf = io.BytesIO()
    image(5).save(buf, format="PNG")
    files = {"/cat.png": buf.getvalue(), "/big.png": b"\0" * (MAX_IMAGE_BYTES + 10)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            if self.path == "/redirect":  # to the allowed image: still refused
                self.send_response(302)
                self.send_header("location", "/cat.png")
                self.send_header("content-length", "0")
                self.end_headers()
                return
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("content-length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def server(tiny_llava):
    args = ["--served-model-name", "llava", "--allowed-media-domains", "127.0.0.1"]
    with RemoteServer(tiny_llava, *args, "--limit-mm-per-prompt", '{"image": 2}') as s:
        yield s


def ask(url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in "},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "?"},
            ],
        }
    ]


def chat(server, messages, **kwargs):
    return server.client().chat.completions.create(
        model="llava", messages=messages, max_tokens=MM_GREEDY.max_tokens, temperature=0, **kwargs
    )


def test_data_uri_image_matches_offline(server, tiny_llava):
    img = image(5)
    offline = LLM(tiny_llava, dtype="float32").chat(ask(data_uri(img)), MM_GREEDY, use_tqdm=False)
    expected = offline[0].outputs[0].text
    reply = chat(server, ask(data_uri(img)))
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(offline[0].prompt_token_ids)
    # JPEG is decoded too; streamed, the deltas add up to the same reply for the PNG.
    assert chat(server, ask(data_uri(img, "JPEG"))).choices[0].message.content
    stream = chat(server, ask(data_uri(img)), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    # Text-only chats still work on a vision-language model.
    assert chat(server, [{"role": "user", "content": "Hello"}]).choices[0].message.content


def test_urls_on_allowed_hosts_are_fetched(server, image_host):
    by_uri = chat(server, ask(data_uri(image(5)))).choices[0].message.content
    assert chat(server, ask(image_host + "/cat.png")).choices[0].message.content == by_uri


def bad(server, messages) -> dict:
    r = httpx.post(
        server.base_url + "/chat/completions",
        json={"model": "llava", "messages": messages, "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages"
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(
    "url, match",
    [
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", "could not be decoded as an image"),
        ("data:image/png;base64,***", "base64 payload is malformed"),
        ("https://example.com/cat.png", "remote URL on 'example.com'"),
        ("ftp://127.0.0.1/cat.png", "data: URI"),
    ],
)
def test_bad_images_are_400(server, url, match):
    assert match in bad(server, ask(url))["message"]


def test_fetch_failures_and_limits_are_400(server, image_host):
    assert "could not be fetched" in bad(server, ask(image_host + "/missing.png"))["message"]
    assert "larger than the limit" in bad(server, ask(image_host + "/big.png"))["message"]
    assert "redirects are not followed" in bad(server, ask(image_host + "/redirect"))["message"]
    assert "well-formed URL" in bad(server, ask("http://[x/a.png"))["message"]
    three = [{"type": "image_url", "image_url": {"url": data_uri(image(i))}} for i in range(3)]
    assert "more than 2 images" in bad(server, [{"role": "user", "content": three}])["message"]
    one = [{"role": "user", "content": "<image> <image> two placeholders, no image"}]
    assert "2 image placeholder(s)" in bad(server, one)["message"]
    # After all that, the server serves, and the encoder cache shows in the metrics.
    assert chat(server, ask(data_uri(image(6)))).choices[0].message.content
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    queries = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("pagoda:mm_cache_queries_total")
    )
    assert queries >= 1
