"""`LoRARequest`: which adapter a request runs under (vLLM's name and fields). No torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter for a request: `lora_path` is its folder (adapter_config.json
    and adapter_model.safetensors), `lora_int_id` (>= 1) identifies it to the engine.

    As in vLLM, the id is the adapter's identity: the engine's adapter caches and the
    prefix cache are keyed by it, so a different adapter needs a different id. It is a
    plain record; the front door checks it when a request is added.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
