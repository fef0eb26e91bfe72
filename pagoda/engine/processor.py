"""The front door: the only place a request is checked, for `LLM`, `LLMEngine` and the
server alike. Then the prompt is tokenized (a conversation rendered through the
model's chat template first) and turned into `Request`s.

Every field of `SamplingParams` and of the prompt is checked against the
model's real limits (token ids in [0, vocab), the context length) and the
engine's `RequestLimits`: types, ranges, finite numbers, valid UTF-8 (no lone
surrogates), list lengths. A bad value raises `InvalidRequestError` (a
`ValueError`) that names the field in `param`; nothing past this point should
fail because of what a client sent.

Thread-safety: the Processor keeps its own copy of the tokenizer and no other
mutable state, so the server runs it on a worker thread (a long prompt never
blocks the event loop) while the engine thread detokenizes with its own. (The
server also decodes single tokens with this copy for logprobs: HF fast
tokenizers take that concurrently, since nothing changes their settings.)
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from pagoda.checks import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    check_bool,
    check_int,
    check_real,
    fail,
    is_int,
    show,
)
from pagoda.config import LoRAConfig, ModelConfig, RequestLimits
from pagoda.core.structured_output import build_grammar
from pagoda.engine.tools import MAX_TOOLS, check_tools, inline_tools, template_knows_tools
from pagoda.lora.adapter import LoRAAdapter, check_adapter, load_adapter
from pagoda.lora.request import LoRARequest
from pagoda.request import MultiModalFeature, Request
from pagoda.sampling_params import RequestOutputKind, SamplingParams

# str | {"prompt": str, "multi_modal_data"?: {"image": image | [image]}}
#     | {"prompt_token_ids": [int], "prompt"?: str}
#     | {"messages": [...], "add_generation_prompt"?: bool, "chat_template_kwargs"?: dict,
#        "tools"?: [OpenAI tool]}
PromptType = str | dict[str, Any]

ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}
PROMPT_FORMS = (
    ({"messages"}, {"add_generation_prompt", "chat_template_kwargs", "tools"}),
    ({"prompt_token_ids"}, {"prompt"}),
    ({"prompt"}, {"multi_modal_data"}),
)
# A chat message's content parts: text, and for vision-language models images (OpenAI's
# image_url with a data: URI or an allowed URL; vLLM's image_pil with a PIL image).
CONTENT_PARTS = {"text": "text", "image_url": "image_url", "image_pil": "image_pil"}
# A chat template that walks content parts itself (Hugging Face's multimodal templates);
# others get each image's placeholder text in the content string.
_TEMPLATE_WALKS_PARTS = re.compile(r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)")
_INT_KEY = re.compile(r"-?[0-9]{1,20}")


TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context


def check_trace_headers(headers: Any) -> dict[str, str] | None:
    """The W3C trace-context entries of `headers` (names in any case), or None."""
    if headers is None:
        return None
    if not isinstance(headers, Mapping):
        fail("trace_headers", "must be a mapping of header names to values", headers)
    out = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            fail("trace_headers", "names and values must be strings", f"{name!r}: {value!r}")
        if name.lower() in TRACE_HEADERS:
            check_text(value, f"trace_headers.{name.lower()}", 512)
            out[name.lower()] = value
    return out or None


def check_text(
    value: Any, param: str, max_chars: int | None = None, where: str | None = None
) -> str:
    """A str that is valid Unicode for UTF-8 (a lone surrogate is not), at most `max_chars`."""
    if not isinstance(value, str):
        fail(param, "must be a string", value, where=where)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        fail(param, f"is not valid UTF-8 (a lone surrogate at character {e.start})", where=where)
    if max_chars is not None and len(value) > max_chars:
        fail(param, f"must be at most {max_chars} characters long (is {len(value)})", where=where)
    return value


def check_list(value: Any, param: str, max_len: int, allow_empty: bool = False) -> list:
    if not isinstance(value, list):
        fail(param, "must be a list", value)
    if not value and not allow_empty:
        fail(param, "must not be empty")
    if len(value) > max_len:
        fail(param, f"may hold at most {max_len} entries (has {len(value)})")
    return value


def check_strings(value: Any, param: str, limits: RequestLimits, max_len: int) -> list[str]:
    """A non-empty string or a list of them (stop strings, bad words)."""
    values = [value] if isinstance(value, str) else check_list(value, param, max_len, True)
    for item in values:
        if not check_text(item, param, limits.max_stop_string_chars):
            fail(param, "must not hold empty strings")
    return list(values)


def check_all_text(value: Any, param: str, depth: int = 0) -> None:
    """Every string inside a JSON-like value is valid UTF-8 (template variables)."""
    if depth > 16:
        fail(param, "is nested too deeply")
    if isinstance(value, str):
        check_text(value, param)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_all_text(key, param, depth + 1)
            check_all_text(item, param, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_all_text(item, param, depth + 1)


class Processor:
    def __init__(
        self,
        tokenizer,
        model_config: ModelConfig,
        max_model_len: int,
        limits: RequestLimits | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)  # never shared with the engine thread
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.limits = limits or RequestLimits()
        self.lora_config = lora_config
        self.vocab_size = int(model_config.hf_config["vocab_size"])
        self.images = None  # a vision-language model's image processor
        if "vision_config" in model_config.hf_config:
            from pagoda.multimodal import ImageInputProcessor

            self.images = ImageInputProcessor(
                model_config.path, model_config.hf_config, self.limits
            )
        # chat_template_kwargs may set template variables, never apply_chat_template's own
        # parameters (tokenize=True would hand back ids where text is expected).
        self._reserved_template_kwargs = set(
            inspect.signature(self.tokenizer.apply_chat_template).parameters
        ) - {"kwargs"}

    # ---- the whole request ------------------------------------------------------------

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> tuple[list[Request], str | None]:
        """Check and tokenize a request. Returns (one Request per completion, the prompt
        text if it had one). Child i of a request with n > 1 has id "<request_id>#<i>"
        and, if seeded, seed + i. `trace_headers`: the caller's W3C trace context
        (`traceparent`, `tracestate`), the parent of the request's span when traces
        are exported. Raises InvalidRequestError naming the field."""
        check_text(request_id, "request_id", 256)
        if not request_id:
            fail("request_id", "must not be empty")
        check_int(priority, "priority", INT64_MIN, INT64_MAX)
        if lora_request is not None:
            self.check_lora(lora_request)
        if params is None:
            params = self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            fail("params", "must be a SamplingParams", type(params).__name__)
        trace_headers = check_trace_headers(trace_headers)
        text, token_ids, features = self.process_prompt(prompt, params.truncate_prompt_tokens)
        params = self.check_params(params, len(token_ids))
        if params.n == 1:
            return [
                Request(
                    request_id,
                    token_ids,
                    params,
                    priority,
                    arrival_time,
                    lora_request,
                    trace_headers,
                    features,
                )  # fmt: skip
            ], text
        children = []
        for i in range(params.n):
            child_params = (
                params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            )
            children.append(
                Request(
                    f"{request_id}#{i}",
                    token_ids,
                    child_params,
                    priority,
                    arrival_time,
                    lora_request,
                    trace_headers,
                    features,
                )
            )
        return children, text

    def check_lora(self, lora_request: Any, param: str = "lora_request") -> LoRARequest:
        """A LoRARequest this engine can serve: LoRA on, a name, an id >= 1, and an
        adapter folder that fits the model and max_lora_rank (read from its config and
        its weight file's header; no tensor is read here)."""
        if self.lora_config is None:
            fail(param, "needs LoRA on: start the engine with enable_lora=True (--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            fail(param, "must be a LoRARequest", type(lora_request).__name__)
        check_text(lora_request.lora_name, param, 256, where=f"{param}.lora_name")
        if not lora_request.lora_name:
            fail(param, "must not be empty", where=f"{param}.lora_name")
        lora_id = lora_request.lora_int_id
        if not is_int(lora_id) or not 1 <= lora_id <= INT64_MAX:
            fail(param, "must be an integer >= 1", lora_id, where=f"{param}.lora_int_id")
        check_text(lora_request.lora_path, param, 4096, where=f"{param}.lora_path")
        check_adapter(
            lora_request.lora_path,
            self.model_config.hf_config,
            self.lora_config.max_lora_rank,
            param,
        )
        return lora_request

    def load_lora(self, lora_request: Any, param: str = "lora_request") -> LoRAAdapter:
        """Check a LoRARequest (`check_lora`) and read its adapter's weights."""
        self.check_lora(lora_request, param)
        return load_adapter(
            lora_request.lora_path,
            self.model_config.hf_config,
            self.lora_config.max_lora_rank,
            param,
        )

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.model_config.generation_defaults)

    # ---- prompts ------------------------------------------------------------------------

    def process_prompt(
        self, prompt: PromptType, truncate_prompt_tokens: int | None = None
    ) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """(prompt text or None, token ids, its images' features): checked, tokenized,
        optionally cut to its last `truncate_prompt_tokens` tokens, and short enough to
        leave room for one token."""
        param, features, images = "prompt", [], None
        if isinstance(prompt, str):
            text, token_ids = self._check_prompt_text(prompt, "prompt"), None
        elif isinstance(prompt, dict):
            param = self._prompt_form(prompt)
            if param == "messages":
                text, token_ids, features = self.render_chat(
                    prompt["messages"],
                    prompt.get("add_generation_prompt", True),
                    prompt.get("chat_template_kwargs"),
                    prompt.get("tools"),
                )
            elif param == "prompt_token_ids":
                text = prompt.get("prompt")
                if text is not None:
                    check_text(text, "prompt")
                token_ids = self.check_token_ids(
                    prompt["prompt_token_ids"], "prompt_token_ids", self.max_model_len * 64
                )
                if self.images is not None and self.images.image_token_id in token_ids:
                    fail(param, "holds the image token, but images come only with a text "
                          "prompt (multi_modal_data) or chat messages")  # fmt: skip
            else:
                text, token_ids = self._check_prompt_text(prompt["prompt"], "prompt"), None
                if "multi_modal_data" in prompt:
                    images = self._check_multi_modal_data(prompt["multi_modal_data"])
        else:
            fail(
                "prompt",
                "must be a string or a dict with 'prompt', 'prompt_token_ids' or 'messages'",
                type(prompt).__name__,
            )
        if token_ids is None and self.images is not None:
            token_ids, features = self.images.process(text, images or [], param)
            self._check_vocabulary(token_ids, param)
        elif token_ids is None:
            token_ids = self._encode(text, param)
        if not token_ids:
            fail(param, "must not be empty")
        if truncate_prompt_tokens is not None:
            keep = check_int(
                truncate_prompt_tokens, "truncate_prompt_tokens", 1, self.max_model_len - 1
            )
            if features and keep < len(token_ids):
                fail("truncate_prompt_tokens", "cannot cut a prompt that holds images")
            token_ids = token_ids[-keep:]
        if len(token_ids) >= self.max_model_len:
            fail(
                param,
                f"is {len(token_ids)} tokens long; this model's maximum context length "
                f"(max_model_len) is {self.max_model_len} tokens, which must leave room for "
                "at least one generated token",
                code="context_length_exceeded",
            )
        return text, list(token_ids), features

    def _check_multi_modal_data(self, data: Any) -> list:
        if self.images is None:
            fail("multi_modal_data", "cannot be used: this model takes no images")
        if not isinstance(data, dict) or set(data) != {"image"}:
            fail("multi_modal_data", "must be {'image': an image or a list of images}",
                  show(data))  # fmt: skip
        return self.images.check_images(data["image"], "multi_modal_data")

    def check_num_prompts(self, num_prompts: int) -> None:
        """How many prompts one request (a /v1/completions body) may carry."""
        if num_prompts < 1:
            fail("prompt", "must not be empty")
        if num_prompts > self.limits.max_prompts:
            fail("prompt", f"may hold at most {self.limits.max_prompts} prompts ({num_prompts})")

    def _prompt_form(self, prompt: dict[str, Any]) -> str:
        keys = set(prompt)
        for required, optional in PROMPT_FORMS:
            if required <= keys:
                extra = keys - required - optional
                if extra:
                    fail(
                        "prompt",
                        f"has keys this form ({', '.join(sorted(required))}) does not take: "
                        f"{', '.join(sorted(map(str, extra)))}",
                    )
                return next(iter(required))
        fail("prompt", "must have 'prompt', 'prompt_token_ids' or 'messages'", sorted(keys))

    def _check_prompt_text(self, text: Any, param: str) -> str:
        check_text(text, param)
        if not text:
            fail(param, "must not be empty")
        return text

    def _encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """The tokenizer's ids for `text`, every one an id the model has (a tokenizer may
        know more tokens than the model's embedding holds)."""
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        self._check_vocabulary(ids, param)
        return ids

    def _check_vocabulary(self, ids: list[int], param: str) -> None:
        if ids and max(ids) >= self.vocab_size:
            fail(
                param,
                f"holds a token ({max(ids)}) beyond the model's vocabulary ({self.vocab_size})",
            )

    def check_token_ids(self, token_ids: Any, param: str, max_len: int) -> list[int]:
        """A list of token ids, each in [0, vocab_size)."""
        check_list(token_ids, param, max_len, allow_empty=True)
        for t in token_ids:
            if not is_int(t) or not 0 <= t < self.vocab_size:
                fail(param, f"must hold token ids in [0, {self.vocab_size})", t)
        return token_ids

    def render_chat(
        self,
        conversation: Any,
        add_generation_prompt: Any = True,
        template_kwargs: Any = None,
        tools: Any = None,
    ) -> tuple[str, list[int], list[MultiModalFeature]]:
        """A conversation (and the tools it may call) -> (prompt text, token ids, its
        images' features) through the model's chat template. Raises InvalidRequestError
        naming `messages` (or the template argument at fault)."""
        check_list(conversation, "messages", 100_000)
        check_bool(add_generation_prompt, "add_generation_prompt")
        if template_kwargs is not None:
            if not isinstance(template_kwargs, dict):
                fail("chat_template_kwargs", "must be an object", template_kwargs)
            reserved = self._reserved_template_kwargs & set(template_kwargs)
            if reserved:
                fail("chat_template_kwargs", f"may not set {', '.join(sorted(reserved))}")
            check_all_text(template_kwargs, "chat_template_kwargs")
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            fail("messages", "cannot be used: this model has no chat template; send a prompt")
        images: list = []
        walks_parts = bool(_TEMPLATE_WALKS_PARTS.search(template))
        messages = [
            self._check_message(i, m, images, walks_parts) for i, m in enumerate(conversation)
        ]
        if tools is not None:
            tools = check_tools(tools)
            check_all_text(tools, "tools")
        kwargs = dict(template_kwargs or {})
        if template_knows_tools(template):
            if tools:
                kwargs["tools"] = tools
        else:
            messages = inline_tools(messages, tools)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as e:  # the template raised (e.g. roles out of order)
            fail("messages", f"were refused by the chat template: {e}")
        # The template already holds any special tokens it wants.
        if self.images is None:
            return text, self._encode(text, "messages", add_special_tokens=False), []
        ids, features = self.images.process(text, images, "messages", add_special_tokens=False)
        self._check_vocabulary(ids, "messages")
        return text, ids, features

    def _check_message(
        self, i: int, message: Any, images: list, walks_parts: bool = False
    ) -> dict[str, Any]:
        """A message as the template takes it; its images (decoded) are appended to
        `images`, each leaving a placeholder in the content: an {"type": "image"} part
        for a template that walks parts, else the model's image token in the text."""
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            fail("messages", "must be an object", message, where=where)
        extra = set(message) - MESSAGE_KEYS
        if extra:
            fields = ", ".join(sorted(map(str, extra)))
            fail("messages", f"has fields pagoda does not support: {fields}", where=where)
        role = message.get("role")
        if role not in ROLES:
            fail("messages", f"must be one of {', '.join(ROLES)}", role, where=f"{where}.role")
        content = message.get("content")
        if isinstance(content, list):
            content = self._check_parts(content, f"{where}.content", images, walks_parts)
        else:
            content = check_text(
                "" if content is None else content, "messages", where=f"{where}.content"
            )
        out = {"role": role, "content": content}
        if message.get("name") is not None:
            out["name"] = check_text(message["name"], "messages", 256, where=f"{where}.name")
        if message.get("tool_calls") is not None:
            if role != "assistant":
                fail("messages", "only an assistant message has tool_calls", where=where)
            out["tool_calls"] = self._check_tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if message.get("tool_call_id") is not None:
            out["tool_call_id"] = check_text(
                message["tool_call_id"], "messages", 256, where=f"{where}.tool_call_id"
            )
        return out

    def _check_parts(
        self, parts: list, where: str, images: list, walks_parts: bool
    ) -> str | list[dict[str, str]]:
        """Content parts -> the content a template takes (see `_check_message`)."""
        out = []
        for j, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            key = CONTENT_PARTS.get(kind) if isinstance(kind, str) else None
            if key is None or set(part) != {"type", key}:
                why = "must be {'type': 'text', 'text': ...}" + (
                    ", {'type': 'image_url', 'image_url': {'url': ...}} or "
                    "{'type': 'image_pil', 'image_pil': PIL.Image}"
                    if self.images is not None
                    else " (this model takes no images)"
                )
                fail("messages", why, part, where=f"{where}[{j}]")
            if key == "text":
                out.append({"type": "text", "text": check_text(
                    part["text"], "messages", where=f"{where}[{j}].text")})  # fmt: skip
                continue
            if self.images is None:
                fail("messages", "holds an image, but this model takes no images",
                      where=f"{where}[{j}]")  # fmt: skip
            value = part[key]
            if key == "image_pil" and isinstance(value, str):
                fail("messages", "must be a PIL image (send URLs as image_url)",
                      where=f"{where}[{j}].image_pil")  # fmt: skip
            if key == "image_url":
                if isinstance(value, dict) and set(value) <= {"url", "detail"}:
                    value = value.get("url")
                elif not isinstance(value, str):
                    fail("messages", "must be {'url': ...}", show(value), where=f"{where}[{j}]")
            from pagoda.multimodal import load_image

            images.append(load_image(value, self.limits, "messages", f"{where}[{j}].{key}"))
            if len(images) > self.limits.max_images:
                fail("messages", f"hold more than {self.limits.max_images} images; "
                      "that is the limit per prompt (limit_mm_per_prompt)")  # fmt: skip
            out.append({"type": "image"})
        if walks_parts and any(p["type"] == "image" for p in out):
            return out
        token = self.images.image_token if self.images is not None else ""
        return "\n".join(p["text"] if p["type"] == "text" else token for p in out)

    def _check_tool_calls(self, calls: Any, where: str) -> list[dict]:
        """An assistant's earlier calls, with arguments as objects (what templates expect)."""
        check_list(calls, "messages", MAX_TOOLS)
        out = []
        for i, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            ok = isinstance(fn, dict) and isinstance(fn.get("name"), str)
            try:
                args = json.loads(fn["arguments"]) if ok else None
            except (TypeError, json.JSONDecodeError):
                args = None
            if not isinstance(args, dict):
                why = "must be {'id', 'type': 'function', 'function': {'name', 'arguments'}} with arguments a JSON object's text"
                fail("messages", why, call, where=f"{where}[{i}]")
            check_all_text(call, "messages")
            entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
            if isinstance(call.get("id"), str):
                entry["id"] = call["id"]
            out.append(entry)
        return out

    # ---- sampling parameters ---------------------------------------------------------------

    def check_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """A checked copy of `params` for a prompt of `num_prompt_tokens`, with the
        engine's fields (EOS ids, bad words as token ids) filled in."""
        p, limits, vocab = params, self.limits, self.vocab_size
        room = self.max_model_len - num_prompt_tokens
        check_int(p.n, "n", 1, limits.max_n)
        check_real(p.temperature, "temperature", 0.0, 1e6)
        check_real(p.top_p, "top_p", 0.0, 1.0, lo_open=True)
        top_k = check_int(p.top_k, "top_k", -1, INT32_MAX)
        check_real(p.min_p, "min_p", 0.0, 1.0)
        check_real(p.presence_penalty, "presence_penalty", -2.0, 2.0)
        check_real(p.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        check_real(p.repetition_penalty, "repetition_penalty", 0.0, 100.0, lo_open=True)
        logit_bias = self._check_logit_bias(p.logit_bias)
        if p.allowed_token_ids is not None:
            self.check_token_ids(p.allowed_token_ids, "allowed_token_ids", vocab)
            if not p.allowed_token_ids:
                fail("allowed_token_ids", "must not be empty")
        bad_words = None
        if p.bad_words is not None:
            bad_words = check_strings(p.bad_words, "bad_words", limits, limits.max_bad_words)
        if p.seed is not None:
            check_int(p.seed, "seed", INT64_MIN, INT64_MAX)
        max_tokens = p.max_tokens
        cap = room if limits.max_tokens is None else min(room, limits.max_tokens)
        if max_tokens is None:
            max_tokens = None if limits.max_tokens is None else cap
        else:
            check_int(max_tokens, "max_tokens", 1, INT64_MAX)
            if limits.max_tokens is not None and max_tokens > limits.max_tokens:
                fail(
                    "max_tokens", f"must be at most {limits.max_tokens} on this server", max_tokens
                )
            if max_tokens > room:
                fail(
                    "max_tokens",
                    f"is too large: this model's maximum context length (max_model_len) is "
                    f"{self.max_model_len} tokens and the prompt is {num_prompt_tokens}, which "
                    f"leaves room for {room} tokens, not {max_tokens}",
                    code="context_length_exceeded",
                )
        check_int(p.min_tokens, "min_tokens", 0, max_tokens or room)
        stop = (
            [] if p.stop is None else check_strings(p.stop, "stop", limits, limits.max_stop_strings)
        )
        stop_token_ids = []
        if p.stop_token_ids is not None:
            stop_token_ids = list(self.check_token_ids(p.stop_token_ids, "stop_token_ids", vocab))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            check_bool(getattr(p, name), name)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(p, name) is not None:
                check_int(getattr(p, name), name, 0, limits.max_logprobs)
        if not isinstance(p.output_kind, RequestOutputKind):
            fail("output_kind", "must be a RequestOutputKind", p.output_kind)
        bad_words_token_ids = self._bad_words(bad_words)
        if p.allowed_token_ids is not None:
            banned = {w[0] for w in bad_words_token_ids if len(w) == 1}
            if p.min_tokens > 0:
                eos = () if p.ignore_eos else self.model_config.eos_token_ids
                banned |= {*stop_token_ids, *eos}
            if set(p.allowed_token_ids) <= banned:
                fail(
                    "allowed_token_ids",
                    "leaves no token to sample: bad_words or min_tokens ban every one",
                )
        grammar = None
        if p.structured_outputs is not None:
            grammar = build_grammar(p.structured_outputs)
        return dataclasses.replace(
            p,
            grammar=grammar,
            top_k=-1 if top_k == 0 else top_k,  # 0 also means off, as in vLLM
            logit_bias=logit_bias,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            bad_words=bad_words,
            eos_token_ids=self.model_config.eos_token_ids,
            bad_words_token_ids=bad_words_token_ids,
        )

    def _check_logit_bias(self, logit_bias: Any) -> dict[int, float] | None:
        """token id (an int, or its decimal string as JSON has it) -> bias in [-100, 100]."""
        if logit_bias is None:
            return None
        if not isinstance(logit_bias, dict):
            fail("logit_bias", "must map token ids to numbers", logit_bias)
        if len(logit_bias) > self.limits.max_logit_bias:
            fail("logit_bias", f"may hold at most {self.limits.max_logit_bias} entries")
        out = {}
        for key, bias in logit_bias.items():
            if isinstance(key, str) and _INT_KEY.fullmatch(key):
                key = int(key)
            if not is_int(key) or not 0 <= key < self.vocab_size:
                fail("logit_bias", f"keys must be token ids in [0, {self.vocab_size})", key)
            out[key] = check_real(bias, "logit_bias", -100.0, 100.0)
        return out

    def _bad_words(self, words: Iterable[str] | None) -> list[list[int]]:
        """Each bad word as token ids, with and without a leading space (as vLLM does)."""
        out = []
        for word in words or ():
            for variant in (word, " " + word.lstrip()):
                ids = self._encode(variant, "bad_words", add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    # ---- /tokenize and /detokenize -----------------------------------------------------

    def tokenize(self, text: Any, add_special_tokens: Any = True) -> list[int]:
        check_text(text, "prompt")
        check_bool(add_special_tokens, "add_special_tokens")
        return self._encode(text, "prompt", add_special_tokens)

    def detokenize(self, token_ids: Any) -> str:
        self.check_token_ids(token_ids, "tokens", self.max_model_len * 64)
        return self.tokenizer.decode(token_ids)
