"""The names a server answers to: the base model's and its LoRA adapters' (vLLM's
`OpenAIServingModels`).

A request's `model` picks the base model (any of its served names) or an
adapter (404 for neither). Adapters come from `--lora-modules` at startup and
from `POST /v1/load_lora_adapter` at run time, and go with
`POST /v1/unload_lora_adapter`. Each load gets an id never used before, so an
adapter loaded again under an old name never meets the old one's cached KV.
Unloading changes nothing for requests in flight: the engine frees the
adapter once none uses it.

The registry is read and written on the event loop only.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.checks import check_text
from pagoda.engine.async_engine import AsyncEngine
from pagoda.entrypoints.openai.errors import APIError, from_invalid
from pagoda.entrypoints.openai.protocol import ModelCard, now
from pagoda.errors import InvalidRequestError
from pagoda.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry: `name=path`, or JSON {"name", "path", "base_model_name"}."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        if text.lstrip().startswith("{"):
            try:
                spec = json.loads(text)
                return cls(spec["name"], spec["path"], spec.get("base_model_name"))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"--lora-modules {text!r}: JSON needs 'name' and 'path' ({e})."
                ) from e
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {text!r}: expected NAME=PATH or a JSON object.")
        return cls(name, path)


def not_found(model: str, served: Sequence[str]) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist. This server serves: {', '.join(served)}.",
        "NotFoundError",
        "model",
        "model_not_found",
    )


class ServingModels:
    def __init__(self, engine: AsyncEngine, base_model_names: Sequence[str]) -> None:
        self.engine = engine
        self.base_model_names = list(base_model_names)
        self.lora_requests: dict[str, LoRARequest] = {}  # adapter name -> its request
        self._ids = itertools.count(1)

    @property
    def served_names(self) -> list[str]:
        return [*self.base_model_names, *self.lora_requests]

    def resolve(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """(the name to answer with, the adapter it names or None); 404 for a model this
        server does not serve."""
        if model is None:
            return self.base_model_names[0], None
        try:
            check_text(model, "model")
        except InvalidRequestError as e:
            raise from_invalid(e) from e
        if model in self.base_model_names:
            return model, None
        if model in self.lora_requests:
            return model, self.lora_requests[model]
        raise not_found(model, self.served_names)

    def cards(self) -> list[ModelCard]:
        return [self.card(name) for name in self.served_names]

    def card(self, name: str) -> ModelCard:
        lora = self.lora_requests.get(name)
        return ModelCard(
            id=name,
            created=now(),
            root=lora.lora_path if lora is not None else self.engine.model_config.path,
            parent=lora.base_model_name if lora is not None else None,
            max_model_len=self.engine.max_model_len,
            tasks=sorted(self.engine.model_config.tasks),
            input_modalities=self.input_modalities,
        )

    @property
    def input_modalities(self) -> list[str]:
        """What the model's prompts may hold (the processor takes images exactly when its
        config has a vision tower)."""
        vision = "vision_config" in self.engine.model_config.hf_config
        return ["text", "image"] if vision else ["text"]

    async def load_lora_adapter(self, module: LoRAModulePath) -> LoRARequest:
        """Check the adapter (on the processor thread), have the engine read it (on its
        own thread), and serve it under `module.name`. 400 for a name already served or a malformed
        adapter, 404 for a path that does not exist."""
        for param, value, max_chars in (
            ("lora_name", module.name, 256),
            ("lora_path", module.path, 4096),
        ):
            if not isinstance(value, str) or not value:
                raise APIError(400, f"{param} must be a non-empty string.", param=param)
            try:
                check_text(value, param, max_chars)
            except InvalidRequestError as e:
                raise from_invalid(e) from e
        if module.name in self.served_names:
            raise APIError(
                400,
                f"The model name `{module.name}` is already served; unload it first or "
                "choose another name.",
                param="lora_name",
                code="lora_already_loaded",
            )
        request = LoRARequest(
            module.name,
            next(self._ids),
            os.path.abspath(module.path),
            module.base_model_name or self.base_model_names[0],
        )
        try:
            await self.engine.add_lora(request)
        except InvalidRequestError as e:
            status = 404 if not os.path.isdir(request.lora_path) else 400
            kind = "NotFoundError" if status == 404 else "invalid_request_error"
            raise APIError(status, e.message, kind, "lora_path", "lora_load_failed") from e
        if module.name in self.served_names:  # loaded twice at once: the first one won
            self.engine.remove_lora(request.lora_int_id)
            raise APIError(
                400, f"The model name `{module.name}` is already served.", param="lora_name"
            )
        self.lora_requests[module.name] = request
        return request

    def unload_lora_adapter(self, name: str, lora_int_id: int | None = None) -> None:
        """Stop serving an adapter (404 if none has that name); requests in flight go on."""
        request = self.lora_requests.get(name)
        if request is None or (lora_int_id is not None and lora_int_id != request.lora_int_id):
            raise APIError(
                404,
                f"The LoRA adapter `{name}` is not loaded.",
                "NotFoundError",
                "lora_name",
                "lora_not_found",
            )
        del self.lora_requests[name]
        self.engine.remove_lora(request.lora_int_id)
