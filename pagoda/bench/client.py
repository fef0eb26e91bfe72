"""The benchmark client's side of one request (a streamed POST, timestamped chunk by
chunk, as any OpenAI-compatible server answers it) and of the server's KV cache
usage over a run (scraped from its /metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

# KV cache usage gauges of the servers we compare, each as a fraction of 1.
KV_USAGE_GAUGES = (
    "pagoda:kv_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",  # vLLM before v1
    "llamacpp:kv_cache_usage_ratio",  # llama-server --metrics
)
KV_SAMPLE_INTERVAL = 0.5  # seconds between scrapes of /metrics


@dataclass
class StreamResult:
    """What one streamed request gave back; `error` is None on success."""

    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried text
    end_time: float = 0.0
    text: str = ""
    prompt_tokens: int | None = None  # from the usage chunk, when the server sent one
    completion_tokens: int | None = None
    error: str | None = None
    # A 429 (refused: a latency target it could not meet, or a rate limit), and when the
    # server said to come back (its Retry-After, seconds).
    refused: bool = False
    retry_after: float | None = None


def _error_message(body: str) -> str:
    """The message of an OpenAI-style `{"error": {"message": ...}}` body (or of a bare
    `{"message": ...}`, as llama.cpp streams it); else the body itself, cut short."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body.strip()[:500]
    err = doc.get("error", doc) if isinstance(doc, dict) else doc
    if isinstance(err, dict) and "message" in err:
        return str(err["message"])
    return str(err)[:500]


async def stream_request(client, url: str, payload: dict[str, Any], chat: bool) -> StreamResult:
    """POST one streaming request and timestamp every chunk that carries text."""
    import httpx

    res = StreamResult(send_time=time.perf_counter())
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                res.refused = resp.status_code == 429
                with contextlib.suppress(TypeError, ValueError):
                    res.retry_after = float(resp.headers.get("Retry-After"))
                return res
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if line.startswith("error:"):  # llama.cpp's form of an in-stream error
                    res.error = _error_message(line[6:])
                    return res
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if not isinstance(event, dict):
                    continue
                if event.get("error"):
                    res.error = _error_message(data)
                    return res
                if usage := event.get("usage"):
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.completion_tokens = usage.get("completion_tokens")
                texts = [
                    (c.get("delta") or {}).get("content") if chat else c.get("text")
                    for c in event.get("choices") or []
                ]
                if any(texts):
                    pieces += [t for t in texts if t]
                    res.chunk_times.append(now)
    except (httpx.HTTPError, ValueError) as e:  # connection, timeout, bad JSON
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    res.end_time = time.perf_counter()
    res.text = "".join(pieces)
    if res.error is None and not res.chunk_times:
        if not res.completion_tokens:
            res.error = "the stream carried no output"
        else:  # tokens that decode to no text (special tokens): one token time, at the end
            res.chunk_times.append(res.end_time)
    return res


# ---- KV cache usage over a run ------------------------------------------------------------


def kv_usage_of(metrics_text: str) -> float | None:
    """The KV cache usage in a /metrics body as a fraction (the largest over models),
    or None if it carries none of `KV_USAGE_GAUGES`."""
    values = []
    for line in metrics_text.splitlines():
        if line.startswith(KV_USAGE_GAUGES):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in KV_USAGE_GAUGES:
                with contextlib.suppress(ValueError):
                    values.append(float(line.rsplit(" ", 1)[1]))
    return max(values) if values else None


async def sample_kv_usage(client, metrics_url: str, start: float, out: list) -> None:
    """Append (seconds since `start`, percent used) every KV_SAMPLE_INTERVAL until
    cancelled; stops at once on a server without such a gauge or without /metrics."""
    import httpx

    while True:
        try:
            resp = await client.get(metrics_url)
            usage = kv_usage_of(resp.text) if resp.status_code == 200 else None
        except httpx.HTTPError:
            usage = None
        if usage is None:
            return
        out.append((round(time.perf_counter() - start, 3), round(100 * usage, 2)))
        await asyncio.sleep(KV_SAMPLE_INTERVAL)
