"""Typed, frozen configuration, split by concern and validated once.

`EngineArgs` (pagoda/engine_args.py) is what users fill in, with vLLM's names;
its `create_engine_config()` checks every field once, reads the model's config and
returns an `EngineConfig` of these. No torch here: the scheduler imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pagoda.model_executor.tasks import PoolerConfig

SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # one parser: both write <think>...</think>
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")  # engine/tool_parsers.py
KERNEL_BACKENDS = ("auto", "torch", "cpu", "triton")  # as pagoda.ops has them (no torch here)
DEVICES = ("auto", "cpu", "cuda")  # auto: CUDA where torch sees a GPU
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # auto: the model's dtype
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")  # kv_transfer_config's (vLLM's names)
DTYPES = ("auto", "float32", "bfloat16", "float16")
# "auto": keep a GGUF file's block-quantized weights quantized; "none": expand every
# weight to the model's dtype at load; a format (q8_0, q4_0, q4_1, q5_0, q5_1, int8 = q8_0,
# int4 = q4_1, or w8a8: int8 per output channel with activations quantized per row)
# quantizes a float checkpoint's linear and embedding weights at load.
QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "int8", "int4", "w8a8")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # what the user named, or the default model's path
    path: str  # a Hugging Face folder or a .gguf file
    is_gguf: bool
    hf_config: dict[str, Any] = field(repr=False, hash=False)
    dtype: str  # "float32" | "bfloat16" | "float16"
    kernel_backend: str  # "auto" | "torch" (PyTorch alone) | "cpu" (the C++ kernels, required)
    quantization: str  # see QUANTIZATIONS
    keep_full_precision: tuple[str, ...]  # module-name patterns that stay unquantized
    int8_activations: bool  # quantized linears quantize their activations to int8
    enforce_eager: bool  # no C++ decode loop: every step through the Python model
    batch_invariant: bool  # a request's results independent of its batch (pagoda.ops.cpu)
    max_model_len: int
    max_model_len_is_default: bool
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict[str, Any] = field(hash=False)
    seed: int
    reasoning_parser: str | None = None  # see pagoda.engine.reasoning
    # What it serves ("generate", "embed", "classify", "score"; see model_executor/tasks.py)
    # and, where it embeds, how its hidden states pool.
    tasks: frozenset[str] = frozenset({"generate"})
    pooler: PoolerConfig | None = None

    @property
    def architecture(self) -> str:
        return self.hf_config["architectures"][0]


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs, and what a GPU runner sizes from the scheduler's limits."""

    device: str = "cpu"  # "cpu" | "cuda"
    # The fraction of the GPU's memory pagoda may use (weights, the activations of the
    # largest step, the KV cache); the KV cache gets what is left of it (vLLM's meaning).
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048  # the largest step: the profiling forward's size
    max_num_seqs: int = 256  # the largest decode batch: the largest CUDA graph's


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kv_cache_memory_bytes: int | None  # None on a GPU: what gpu_memory_utilization leaves
    enable_prefix_caching: bool
    swap_space_bytes: int  # host pool for swapped-out blocks; 0 unless preemption_mode is "swap"
    kv_cache_dtype: str = "auto"  # see KV_CACHE_DTYPES
    kv_offload_dir: str | None = None  # the disk tier (pagoda.core.kv_tier); None: none
    kv_offload_bytes: int = 0
    kv_offload_ram_bytes: int = 0  # the tier's host-RAM part, before its files
    kv_role: str | None = None  # prefill/decode disaggregation: see EngineArgs.kv_transfer_config


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    speculative: SpeculativeConfig | None = None
    # With LoRA: the most adapters the running requests may use at once.
    max_loras: int | None = None
    # Latency targets (ms) of every request that sets none of its own; with either set,
    # the waiting queue runs by slack and requests that cannot meet theirs are refused
    # (pagoda/core/deadlines.py). None: off.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


# Worker processes on this machine, or Ray actors on any host of a Ray cluster.
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """A model split across workers: `tensor_parallel_size` ranks per pipeline stage,
    `pipeline_parallel_size` stages (see pagoda.distributed)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


SPECULATIVE_METHODS = ("ngram", "draft")
# The decode kernels read each weight once for up to 8 rows: a request and 7 drafts.
MAX_SPECULATIVE_TOKENS = 7


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, vLLM's `speculative_config` (a dict on EngineArgs, JSON on
    the command line). "ngram" is prompt lookup: the k tokens that followed the most
    recent earlier occurrence of the sequence's last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min) are verified in one forward. "draft"
    (vLLM's "draft_model" too) runs a smaller or more quantized model with the same
    vocabulary k steps ahead, greedily; `model` names it (default: the target's own
    weights) and `quantization` says how it loads, so {"method": "draft"} beside
    `quantization="none"` drafts with a GGUF file's own blocks for its bf16 expansion."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: drafts verified per step and request
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # No drafts in a step where at least this many requests run: the extra rows cost
    # more than they save once the batch alone keeps the kernels busy. SmolLM2 Q4_1,
    # `grounded`, 2-core Sapphire Rapids (benchmarks/speculative.py): 1.31x at one
    # request, 1.18x at 2, 0.94x at 4, 0.89x at 8.
    disable_by_batch_size: int = 3
    model: str | None = None  # "draft": its checkpoint (None: the target's)
    quantization: str = "auto"  # "draft": see QUANTIZATIONS

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {spec!r}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}."
            )
        if spec.get("method") == "draft_model":  # vLLM's name for it
            spec = {**spec, "method": "draft"}
        config = cls(**spec)
        if config.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
                f"got {config.method!r}."
            )
        for name in known - {"method", "model", "quantization"}:
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"speculative_config.{name} must be a positive integer, got {value!r}."
                )
        if config.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be at most "
                f"{MAX_SPECULATIVE_TOKENS}, got {config.num_speculative_tokens}."
            )
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(
                "speculative_config.prompt_lookup_min must not exceed prompt_lookup_max "
                f"({config.prompt_lookup_min} > {config.prompt_lookup_max})."
            )
        if config.method != "draft" and (config.model is not None or "quantization" in spec):
            raise ValueError('speculative_config.model and .quantization are for method "draft".')
        if config.model is not None and (not isinstance(config.model, str) or not config.model):
            raise ValueError(f"speculative_config.model must be a path, got {config.model!r}.")
        if config.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"speculative_config.quantization must be one of {QUANTIZATIONS}, "
                f"got {config.quantization!r}."
            )
        return config


MAX_LORA_RANK = 512  # vLLM's largest; the LoRA kernel's scratch is sized for it


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's names): adapters resident at once in the step's slots,
    the largest rank a slot holds, and adapters kept in the host cache."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, beyond the model's own limits (vocabulary,
    max_model_len). The Processor enforces them for every entry point."""

    max_n: int = 64  # completions per request
    max_logprobs: int = 20  # top-N logprobs per token (sampled and prompt)
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256  # per stop string, and per bad word
    max_bad_words: int = 64
    max_logit_bias: int = 1024  # logit_bias entries
    max_tokens: int | None = None  # cap on a request's max_tokens (None: max_model_len)
    max_prompts: int = 256  # prompts in one /v1/completions request
    max_images: int = 8  # images in one prompt (vLLM's limit_mm_per_prompt["image"])
    max_image_bytes: int = 20 << 20  # an image's encoded size (OpenAI's limit)
    max_image_pixels: int = 4096 * 4096  # an image's width x height, checked before decoding
    # Hosts whose image URLs may be fetched; none: remote URLs are refused.
    allowed_media_domains: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineConfig:
    """Every part's config, checked together (`EngineArgs.create_engine_config`).
    `scheduler.max_model_len` is the model's; the engine lowers it to what the KV
    cache holds once that is known (a derived value, returned, never written back)."""

    model: ModelConfig
    cache: CacheConfig
    device: DeviceConfig
    parallel: ParallelConfig
    scheduler: SchedulerConfig
    limits: RequestLimits
    lora: LoRAConfig | None
    draft_model: ModelConfig | None  # speculative method "draft"
    num_threads: int | None  # torch threads (None: torch's default)
