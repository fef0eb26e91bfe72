"""Request and response bodies of Anthropic's Messages API, as pydantic models.

Requests take only the fields listed here (an unknown one is a 400 naming it).
`temperature`, `top_p` and `top_k` are taken though the newest SDKs no longer send
them (older clients do; pass them in `extra_body`). Accepted and without effect:
`cache_control` (pagoda's prefix cache needs no markers), `citations`,
`metadata.user_id` (the request's `user`), `service_tier`, `speed`,
`inference_geo`, `output_config.effort`, `thinking.budget_tokens`. `thinking`
"disabled" turns a thinking chat template's `enable_thinking` off; "enabled" needs a
server started with `--reasoning-parser` (else a 400), whose reasoning comes back
as a `thinking` block (with an empty `signature`: nothing here signs it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Block(BaseModel):
    """A content block. Unknown fields are ignored, not refused: clients send back the
    blocks of a response they received, with the SDK's response-only fields
    (`caller`, `citations`, ...) in them."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextBlock(Block):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class ImageSource(AnthropicModel):
    type: Literal["base64", "url"]
    media_type: str | None = None  # base64
    data: str | None = None  # base64
    url: str | None = None  # url


class ImageBlock(Block):
    type: Literal["image"]
    source: ImageSource
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(Block):
    """An assistant's earlier call."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


ResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(Block):
    """What a call returned, in the user's next message."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(Block):
    """An assistant's earlier reasoning; not put back in the prompt (as Anthropic's
    models drop it from earlier turns)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(AnthropicModel):
    """A client tool (Anthropic's server tools, such as web search, are not served)."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool = False


class Thinking(AnthropicModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # enabled
    display: Literal["summarized", "omitted"] | None = None  # adaptive


class OutputFormat(AnthropicModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None  # structured outputs


class Metadata(AnthropicModel):
    user_id: str | None = None


class CountTokensRequest(AnthropicModel):
    """POST /v1/messages/count_tokens: what the prompt of such a request would be."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]  # text and tool_use blocks
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int
