"""Request and response bodies of the OpenAI API (and vLLM's extras), as pydantic models.

Requests take only the fields listed here: an unknown one is a 400 naming it
("Unrecognized request argument supplied", as OpenAI answers), never ignored.
The models check types only; values are checked by the engine's front door
(`Processor`). Fields pagoda accepts but cannot honour in every value are in
each request's `SUPPORTED_ONLY`: another value is a 400 that says why.

Accepted and without effect here: `user` (an end-user id for the provider's
abuse monitoring), `metadata` (tags for stored completions, and nothing is
stored), `service_tier` "auto"/"default".
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def only(*allowed: Any, why: str) -> tuple[Callable[[Any], bool], str]:
    """A SUPPORTED_ONLY entry: the values pagoda takes, and why not others."""
    return (lambda value: value in allowed), why


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# ---- errors -------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- shared pieces ----------------------------------------------------------------


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class SamplingFields(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's)."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras (sent with the openai client's `extra_body`).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    # Latency targets in ms (pagoda's; the server's --slo-* by default): the request is
    # refused with a 429 if it cannot meet them.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    use_beam_search: bool = False  # best_of beams (n if unset), the n best returned
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # transformers' beam search rule: true, false, "never"
    return_tokens_as_token_ids: bool = False
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None

    SUPPORTED_ONLY: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "spaces_between_special_tokens": only(
            True, why="fast tokenizers always decode special tokens without added spaces"
        ),
        "return_tokens_as_token_ids": only(False, why="tokens are returned as text"),
        "guided_decoding_backend": only(
            None, "auto", "guidance", "llguidance", why="pagoda's grammars are llguidance's"
        ),
    }


# ---- /v1/completions ------------------------------------------------------------------

# Strict ints: a token id is never a bool, a float or a numeric string.
PromptInput = str | list[str] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True

    SUPPORTED_ONLY: ClassVar = {
        **SamplingFields.SUPPORTED_ONLY,
        "suffix": only(None, "", why="suffix (insertion) is not supported"),
        "add_special_tokens": only(True, why="text prompts are tokenized as the model expects"),
    }


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extra, when the request set prompt_logprobs: per prompt token (None
    # for the first), token id -> its logprob.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ---- /v1/chat/completions ---------------------------------------------------------------


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[dict[str, Any]] | None = None  # text parts; checked by the Processor
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's extras.
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None

    SUPPORTED_ONLY: ClassVar = {
        **SamplingFields.SUPPORTED_ONLY,
        "functions": only(None, [], why="function calling is not supported"),
        "function_call": only(None, "none", "auto", why="function calling is not supported"),
        "modalities": only(None, ["text"], why="only text output is supported"),
        "audio": only(None, why="only text output is supported"),
        "prediction": only(None, why="predicted outputs are not supported"),
        "reasoning_effort": only(None, why="this is not a reasoning model"),
        "web_search_options": only(None, why="web search is not supported"),
        "store": only(None, False, why="pagoda stores nothing"),
        "service_tier": only(None, "auto", "default", why="pagoda has one service tier"),
        "echo": only(False, why="echoing the last message is not supported"),
        "continue_final_message": only(False, why="continuing a final message is not supported"),
        "add_special_tokens": only(
            False, why="the chat template already places the special tokens"
        ),
        "chat_template": only(
            None, why="the server uses the model's own chat template; a request cannot set one"
        ),
        "documents": only(None, why="documents (RAG templates) are not supported"),
    }


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None  # the next piece of the JSON text


class DeltaToolCall(BaseModel):
    """A piece of a streamed call: its id, type and name come first (arguments ""), then
    pieces of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # With a reasoning parser: the <think> block (vLLM's name, and its older one).
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ---- models, tokenizer ----------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagoda"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    tasks: list[str] | None = None  # pagoda's: what it serves (generate, embed, classify, score)
    # What a prompt may hold: ["text"], or ["text", "image"] for a vision-language model.
    input_modalities: list[str] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(OpenAIModel):  # vLLM's POST /v1/load_lora_adapter
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):  # vLLM's POST /v1/unload_lora_adapter
    lora_name: str
    lora_int_id: StrictInt | None = None


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
