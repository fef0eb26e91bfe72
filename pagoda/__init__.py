"""pagoda: a high-throughput, memory-efficient inference and serving engine for LLMs.

The names below load on first use (PEP 562), so a process that never runs a model
(`pagoda router`, the CLI's argument parsing) never imports torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.engine_args import EngineArgs
    from pagoda.entrypoints.llm import LLM
    from pagoda.lora.request import LoRARequest
    from pagoda.outputs import (
        BeamSearchOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from pagoda.pooling_params import PoolingParams
    from pagoda.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
_EXPORTS = {
    "LLM": "pagoda.entrypoints.llm",
    "BeamSearchOutput": "pagoda.outputs",
    "BeamSearchParams": "pagoda.sampling_params",
    "EmbeddingRequestOutput": "pagoda.outputs",
    "PoolingParams": "pagoda.pooling_params",
    "PoolingRequestOutput": "pagoda.outputs",
    "ScoringRequestOutput": "pagoda.outputs",
    "CompletionOutput": "pagoda.outputs",
    "EngineArgs": "pagoda.engine_args",
    "LLMEngine": "pagoda.engine.llm_engine",
    "LoRARequest": "pagoda.lora.request",
    "RequestOutput": "pagoda.outputs",
    "SamplingParams": "pagoda.sampling_params",
    "StructuredOutputsParams": "pagoda.sampling_params",
}
__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "ScoringRequestOutput",
    "EngineArgs",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once
    return value
