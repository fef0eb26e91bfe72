"""The body of POST /v1/responses (OpenAI's Responses API), as a pydantic model.

Input items stay dicts here: `serving_responses.conversation` checks them and
names the one at fault (`input[2].content[0]`). Accepted and without effect:
`user`, `safety_identifier`, `prompt_cache_key` (pagoda's prefix cache keys on the
tokens themselves), `metadata` (echoed back), `service_tier` auto/default,
`stream_options`, `reasoning.summary`. `reasoning.effort` "none" turns a thinking
chat template's `enable_thinking` off; another effort needs `--reasoning-parser`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pagoda.entrypoints.openai.protocol import OpenAIModel, only


class TextConfig(OpenAIModel):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None
    # vLLM's extras.
    top_k: int | None = None
    seed: int | None = None
    priority: int = 0

    SUPPORTED_ONLY: ClassVar = {
        "background": only(None, False, why="responses run in the foreground"),
        "conversation": only(None, why="conversations are not stored; use previous_response_id"),
        "prompt": only(None, why="stored prompt templates are not supported"),
        "truncation": only(None, "disabled", why="a prompt too long is refused, not truncated"),
        "top_logprobs": only(None, 0, why="logprobs are not returned by /v1/responses"),
        "include": only(None, [], why="no extra output can be included"),
        "max_tool_calls": only(None, why="built-in tools are not served"),
        "service_tier": only(None, "auto", "default", why="pagoda has one service tier"),
    }
