"""The served model's prompts as token ids, in the router's process without torch
(transformers loads it): the `tokenizers` library over the model's tokenizer.json,
and jinja2 over its chat template the way transformers renders one (sandboxed, with
trim_blocks and lstrip_blocks, `raise_exception`, `tojson`, `strftime_now`). The ids
only place requests by their prefix: a template this renders differently costs
prefix hits, never a wrong answer (the replica renders the request itself).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
import sys
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagoda.model_executor.model_files import resolve_model, tokenizer_cache_dir

logger = logging.getLogger(__name__)

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class PromptTokenizer:
    def __init__(self, folder: str) -> None:
        """`folder`: a tokenizer saved by transformers (tokenizer.json and
        tokenizer_config.json)."""
        self.tokenizer = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        config_path = os.path.join(folder, "tokenizer_config.json")
        config: dict[str, Any] = {}
        if os.path.isfile(config_path):
            with open(config_path) as f:
                config = json.load(f)
        template = config.get("chat_template")
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        self.special = {name: _content(config.get(name)) for name in _SPECIAL}
        self.template = _compile(template) if isinstance(template, str) else None

    @classmethod
    def load(cls, model: str | None) -> PromptTokenizer | None:
        """The tokenizer of `model` (a folder or a GGUF file, None: the default model);
        None, with a warning, where it cannot be read (the router then routes by load)."""
        try:
            path, is_gguf = resolve_model(model)
            if not is_gguf:
                return cls(path)
            folder = tokenizer_cache_dir(path)
            if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
                # The vocabulary's conversion needs transformers: in a child process, which
                # leaves it in the cache folder (as the engines' first start does).
                code = (
                    "import sys; from pagoda.model_executor.model_files import load_tokenizer; "
                    "load_tokenizer(sys.argv[1], True)"
                )
                subprocess.run([sys.executable, "-c", code, path], check=True)
            return cls(folder)
        except Exception as e:
            logger.warning("router: no tokenizer for %s (%r): routing by load only", model, e)
            return None

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids (with the tokenizer's special tokens, as the engine)."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def chat(self, messages: list[dict]) -> list[int]:
        """A conversation's ids through the chat template, ready for the answer."""
        if self.template is None:
            return []
        text = self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def _content(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _compile(template: str) -> jinja2.Template:
    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)
