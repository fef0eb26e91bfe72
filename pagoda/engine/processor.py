"""The front door: the only place a request is checked, for `LLM`, `LLMEngine` and the
server alike. Then the prompt is tokenized (a conversation rendered through the
model's chat template first) and turned into `Request`s. The checks of a request's
parts are `RequestValidator`'s (`engine/validation.py`), the rendering of chat
messages `ChatRenderer`'s (`engine/chat.py`); this module builds the requests.

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
from collections.abc import Mapping
from typing import Any

from pagoda.checks import (
    INT64_MAX,
    INT64_MIN,
    check_bool,
    check_int,
    check_real,
    check_text,
    fail,
    show,
)
from pagoda.config import LoRAConfig, ModelConfig, RequestLimits
from pagoda.engine.chat import ChatRenderer
from pagoda.engine.pooling import PoolingInputs
from pagoda.engine.reasoning import THINK_CLOSE, prompt_state
from pagoda.engine.validation import RequestValidator, check_trace_headers
from pagoda.lora.request import LoRARequest
from pagoda.pooling_params import PoolingParams
from pagoda.request import SLO, MultiModalFeature, Request
from pagoda.sampling_params import SamplingParams

# str | {"prompt": str, "multi_modal_data"?: {"image": image | [image]}}
#     | {"prompt_token_ids": [int], "prompt"?: str}
#     | {"messages": [...], "add_generation_prompt"?: bool, "chat_template_kwargs"?: dict,
#        "tools"?: [OpenAI tool]}
PromptType = str | dict[str, Any]

PROMPT_FORMS = (
    ({"messages"}, {"add_generation_prompt", "chat_template_kwargs", "tools"}),
    ({"prompt_token_ids"}, {"prompt"}),
    ({"prompt"}, {"multi_modal_data"}),
)
# A chat message's content parts: text, and for vision-language models images (OpenAI's
# image_url with a data: URI or an allowed URL; vLLM's image_pil with a PIL image).

MAX_SLO_MS = 86_400_000.0  # a latency target of a day at most


class Processor:
    def __init__(
        self,
        tokenizer,
        model_config: ModelConfig,
        max_model_len: int,
        limits: RequestLimits | None = None,
        lora_config: LoRAConfig | None = None,
        max_num_batched_tokens: int | None = None,
        slo_defaults: SLO | None = None,
    ) -> None:
        """`slo_defaults`: the engine's latency targets, for requests that set none."""
        self.tokenizer = copy.deepcopy(tokenizer)  # never shared with the engine thread
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.limits = limits or RequestLimits()
        self.slo_defaults = slo_defaults
        self.images = None  # a vision-language model's image processor
        if "vision_config" in model_config.hf_config:
            from pagoda.multimodal import ImageInputProcessor

            self.images = ImageInputProcessor(
                model_config.path, model_config.hf_config, self.limits
            )
        self.validator = RequestValidator(
            self.tokenizer, model_config, max_model_len, self.limits, lora_config
        )
        self.chat = ChatRenderer(self.validator, self.images, self.limits)
        self.pooling = PoolingInputs(
            self.tokenizer,
            self.validator,
            model_config,
            max_model_len,
            max_num_batched_tokens or max_model_len,
        )
        # The validator's and the renderer's checks, under the front door's names.
        self.check_lora = self.validator.check_lora
        self.load_lora = self.validator.load_lora
        self.check_params = self.validator.check_params
        self.check_num_prompts = self.validator.check_num_prompts
        self.render_chat = self.chat.render_chat
        # A reasoning model's grammars start after this (see pagoda.engine.reasoning).
        self.reasoning_end: tuple[int, ...] = ()
        if model_config.reasoning_parser is not None:
            ids = self.tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
            self.reasoning_end = tuple(ids)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        slo: SLO | None = None,
    ) -> tuple[list[Request], str | None]:
        """Check and tokenize a request. Returns (one Request per completion, the prompt
        text if it had one). Child i of a request with n > 1 has id "<request_id>#<i>"
        and, if seeded, seed + i. `trace_headers`: the caller's W3C trace context
        (`traceparent`, `tracestate`), the parent of the request's span when traces
        are exported. `slo`: its latency targets, each unset one the engine's (a pooling
        request has none). With PoolingParams, its one Request pools (engine/pooling.py).
        Raises InvalidRequestError naming the field."""
        check_text(request_id, "request_id", 256)
        if not request_id:
            fail("request_id", "must not be empty")
        check_int(priority, "priority", INT64_MIN, INT64_MAX)
        slo = self._slo(slo or SLO())
        if lora_request is not None:
            self.check_lora(lora_request)
        if isinstance(params, PoolingParams):
            return self.pooling.process(
                request_id, prompt, params, priority, arrival_time, lora_request, trace_headers
            )
        if "generate" not in self.model_config.tasks:
            fail("model", f"{self.model_config.model!r} does not generate: it serves "
                 f"{', '.join(sorted(self.model_config.tasks))}")  # fmt: skip
        if params is None:
            params = self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            fail("params", "must be a SamplingParams", type(params).__name__)
        trace_headers = check_trace_headers(trace_headers)
        text, token_ids, features = self.process_prompt(prompt, params.truncate_prompt_tokens)
        params = self.check_params(params, len(token_ids))
        if params.grammar is not None and self.reasoning_end and self._reasons(text, token_ids):
            params = dataclasses.replace(params, grammar_after=self.reasoning_end)
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = dataclasses.replace(params, seed=params.seed + i)
            children.append(
                Request(
                    child_id,
                    token_ids,
                    child_params,
                    priority,
                    arrival_time,
                    lora_request,
                    trace_headers,
                    features,
                    slo=slo,
                )  # fmt: skip
            )
        return children, text

    def _slo(self, slo: SLO) -> SLO | None:
        """The request's own targets, checked, with the engine's filling the gaps."""
        for name, value in (("slo_ttft_ms", slo.ttft_ms), ("slo_tpot_ms", slo.tpot_ms)):
            if value is not None:
                check_real(value, name, 0.0, MAX_SLO_MS, lo_open=True)
        return slo.or_defaults(self.slo_defaults)

    def _reasons(self, text: str | None, token_ids: list[int]) -> bool:
        """Whether reasoning may come before the answer: the prompt did not close it."""
        return prompt_state(text or self.tokenizer.decode(token_ids[-16:])) != "closed"

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.model_config.generation_defaults)

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
                text, token_ids, features = self.chat.render_chat(
                    prompt["messages"],
                    prompt.get("add_generation_prompt", True),
                    prompt.get("chat_template_kwargs"),
                    prompt.get("tools"),
                )
            elif param == "prompt_token_ids":
                text = prompt.get("prompt")
                if text is not None:
                    check_text(text, "prompt")
                token_ids = self.validator.check_token_ids(
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
            self.validator.check_vocabulary(token_ids, param)
        elif token_ids is None:
            token_ids = self.validator.encode(text, param)
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

    # ---- /tokenize and /detokenize -----------------------------------------------------

    def tokenize(self, text: Any, add_special_tokens: Any = True) -> list[int]:
        check_text(text, "prompt")
        check_bool(add_special_tokens, "add_special_tokens")
        return self.validator.encode(text, "prompt", add_special_tokens)

    def detokenize(self, token_ids: Any) -> str:
        self.validator.check_token_ids(token_ids, "tokens", self.max_model_len * 64)
        return self.tokenizer.decode(token_ids)
