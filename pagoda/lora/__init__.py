"""Multi-LoRA serving: PEFT adapters over one base model, many in one batch."""

from pagoda.lora.request import LoRARequest

__all__ = ["LoRARequest"]
