"""pagoda: a high-throughput, memory-efficient inference and serving engine for LLMs."""

from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine_args import EngineArgs
from pagoda.entrypoints.llm import LLM
from pagoda.lora.request import LoRARequest
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
