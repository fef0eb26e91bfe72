"""Chat messages -> a prompt: each message checked (roles, content parts, images,
earlier tool calls), then rendered through the model's chat template, with the
tools it may call (inlined for templates that do not know tools). Raises
`InvalidRequestError` naming `messages` (or the template argument at fault)."""

from __future__ import annotations

import inspect
import json
import re
from typing import Any

from pagoda.checks import check_all_text, check_bool, check_list, check_text, fail, show
from pagoda.config import RequestLimits
from pagoda.engine.tools import MAX_TOOLS, check_tools, inline_tools, template_knows_tools
from pagoda.engine.validation import RequestValidator
from pagoda.multimodal import load_image
from pagoda.request import MultiModalFeature

ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}
CONTENT_PARTS = {"text": "text", "image_url": "image_url", "image_pil": "image_pil"}
# A template that loops over a message's content parts (it takes {"type": "image"}).
_TEMPLATE_WALKS_PARTS = re.compile(r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)")


class ChatRenderer:
    def __init__(self, validator: RequestValidator, images, limits: RequestLimits) -> None:
        """`images`: a vision-language model's ImageInputProcessor, or None."""
        self.validator = validator
        self.tokenizer = validator.tokenizer
        self.images = images
        self.limits = limits
        # chat_template_kwargs may set template variables, never apply_chat_template's own
        # parameters (tokenize=True would hand back ids where text is expected).
        self._reserved_template_kwargs = set(
            inspect.signature(self.tokenizer.apply_chat_template).parameters
        ) - {"kwargs"}

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
            return text, self.validator.encode(text, "messages", add_special_tokens=False), []
        ids, features = self.images.process(text, images, "messages", add_special_tokens=False)
        self.validator.check_vocabulary(ids, "messages")
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
