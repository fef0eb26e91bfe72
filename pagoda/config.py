"""Typed, frozen configuration, split by concern and validated once.

`EngineArgs` is what users fill in (vLLM's names); `create_engine_config`
checks every field, reads the model's config, and returns frozen configs. No
torch here: the scheduler and block pool import this module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pagoda.model_executor.models import (
    EXPERTS,
    LATENT_ATTENTION,
    NORMS_ACROSS_HEADS,
    VISION,
    needs,
)

logger = logging.getLogger(__name__)

SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
KERNEL_BACKENDS = ("auto", "torch", "cpu", "triton")  # as pagoda.ops has them (no torch here)
DEVICES = ("auto", "cpu", "cuda")  # auto: CUDA where torch sees a GPU
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # auto: the model's dtype
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
    max_model_len: int
    max_model_len_is_default: bool
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict[str, Any] = field(hash=False)
    seed: int

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


@dataclass
class EngineArgs:
    """Everything a user can set on an engine; mirrors vLLM's `EngineArgs`."""

    model: str | None = None
    dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    swap_space: int = 1 << 30  # bytes of host memory for swapped-out blocks
    seed: int = 0
    num_threads: int | None = None
    kernel_backend: str = "auto"
    quantization: str = "auto"
    keep_full_precision: tuple[str, ...] = ()
    # Quantized linears at small batch quantize their activations to int8 (llama.cpp's
    # way: fast); None: on for bf16/fp16 models, off for float32 ones (exactness first).
    int8_activations: bool | None = None
    # Decode steps of a few rows run the layers in one C++ call (csrc/decode_loop.cpp,
    # bitwise the same result); True keeps every step in the Python model (vLLM's name).
    enforce_eager: bool = False
    # Speculative decoding (see SpeculativeConfig), e.g. {"method": "ngram",
    # "num_speculative_tokens": 4}; None: off.
    speculative_config: dict[str, Any] | None = None
    # LoRA adapters (see LoRAConfig); requests name theirs with a LoRARequest.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    # Request limits (see RequestLimits).
    max_n: int = RequestLimits.max_n
    max_logprobs: int = RequestLimits.max_logprobs
    max_stop_strings: int = RequestLimits.max_stop_strings
    max_stop_string_chars: int = RequestLimits.max_stop_string_chars
    max_bad_words: int = RequestLimits.max_bad_words
    max_logit_bias: int = RequestLimits.max_logit_bias
    max_tokens_limit: int | None = None
    max_prompts: int = RequestLimits.max_prompts
    # Vision-language models: {"image": N} images per prompt at most (vLLM's name).
    limit_mm_per_prompt: dict[str, int] | None = None
    # Hosts whose image URLs the front door may fetch (vLLM's name); none: refused.
    allowed_media_domains: tuple[str, ...] = ()
    # The model split across worker processes (vLLM's names): each layer's heads and
    # columns over tensor_parallel_size ranks, its layers over pipeline_parallel_size
    # stages. kv_cache_memory_bytes stays the whole engine's budget.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    # "cuda": weights, KV cache and sampling on the GPU, Triton kernels, CUDA graphs for
    # decode (enforce_eager turns them off); the KV cache takes what
    # gpu_memory_utilization leaves unless kv_cache_memory_bytes says otherwise.
    device: str = "auto"
    gpu_memory_utilization: float = 0.9

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def _verify(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")

        for name in (
            "block_size",
            "max_num_seqs",
            "max_loras",
            "max_lora_rank",
            "max_num_batched_tokens",
            "max_n",
            "max_stop_string_chars",
            "max_prompts",
            "tensor_parallel_size",
            "pipeline_parallel_size",
        ):
            positive(name)
        for name in ("max_logprobs", "max_stop_strings", "max_bad_words", "max_logit_bias"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")
        for name in (
            "kv_cache_memory_bytes",
            "max_model_len",
            "num_threads",
            "swap_space",
            "max_tokens_limit",
            "max_cpu_loras",
        ):
            if getattr(self, name) is not None:
                positive(name)
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}.")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(
                f"max_lora_rank must be at most {MAX_LORA_RANK}, got {self.max_lora_rank}."
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})."
            )
        if self.limit_mm_per_prompt is not None:
            limit = self.limit_mm_per_prompt
            if (
                not isinstance(limit, dict)
                or set(limit) - {"image"}
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                           for v in limit.values())
            ):  # fmt: skip
                raise ValueError(f'limit_mm_per_prompt must be like {{"image": 4}}, got {limit!r}.')
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}."
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}."
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}."
            )
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(
                f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}."
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}."
            )
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}.")
        utilization = self.gpu_memory_utilization
        if (
            isinstance(utilization, bool)
            or not isinstance(utilization, int | float)
            or not (0 < utilization <= 1)
        ):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}.")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, "
                f"got {self.distributed_executor_backend!r}."
            )

    def create_model_config(self) -> ModelConfig:
        from pagoda.model_executor import model_loader

        self._verify()
        path, is_gguf = model_loader.resolve_model(self.model)
        hf_config = model_loader.load_hf_config(path, is_gguf)
        model_loader.check_architecture(hf_config, path)
        model_needs = needs(hf_config["architectures"][0])
        if self.enable_lora and EXPERTS in model_needs:
            raise ValueError(
                "enable_lora: LoRA adapters on mixture-of-experts models are not supported yet "
                f"({hf_config['architectures'][0]})."
            )
        if self.enable_lora and VISION in model_needs:
            raise ValueError(
                "enable_lora: LoRA adapters on vision-language models are not supported yet "
                f"({hf_config['architectures'][0]})."
            )
        self._check_parallel(hf_config)
        device = self.resolved_device(warn=True)
        quantization, kernel_backend = self.quantization, self.kernel_backend
        if device == "cuda":
            self._check_cuda(hf_config)
            quantization = "none"  # GGUF blocks expanded to the dtype: no GPU kernel yet
            kernel_backend = "triton" if kernel_backend == "auto" else kernel_backend
        model_max_len = int(hf_config.get("max_position_embeddings") or 2048)
        if self.max_model_len is not None and self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's "
                f"max_position_embeddings ({model_max_len})."
            )
        dtype = model_loader.resolve_dtype(self.dtype, hf_config, device)
        eos_token_ids, generation_defaults = model_loader.load_generation_config(
            path, is_gguf, hf_config
        )
        return ModelConfig(
            model=self.model or path,
            path=path,
            is_gguf=is_gguf,
            hf_config=hf_config,
            dtype=dtype,
            kernel_backend=kernel_backend,
            quantization=quantization,
            keep_full_precision=tuple(self.keep_full_precision),
            int8_activations=self.int8_activations
            if self.int8_activations is not None
            else dtype != "float32",
            enforce_eager=self.enforce_eager,
            max_model_len=self.max_model_len or model_max_len,
            max_model_len_is_default=self.max_model_len is None,
            eos_token_ids=eos_token_ids,
            generation_defaults=generation_defaults,
            seed=self.seed,
        )

    def resolved_device(self, warn: bool = False) -> str:
        """ "cpu" or "cuda". "auto": CUDA where torch sees a GPU and the GPU path runs
        this configuration (else the CPU; `warn` logs why). Raises ValueError for
        "cuda" without a GPU."""
        if self.device == "cpu":
            return "cpu"
        import torch  # here only: the scheduler imports this module, never torch

        if not torch.cuda.is_available():
            if self.device == "cuda":
                raise ValueError("device 'cuda': torch sees no CUDA device.")
            return "cpu"
        if self.device == "auto":
            from pagoda.model_executor import model_loader

            path, is_gguf = model_loader.resolve_model(self.model)
            refusal = self._cuda_refusal(model_loader.load_hf_config(path, is_gguf))
            if refusal is not None:
                if warn:
                    logger.warning("device auto: %s; running on the CPU.", refusal)
                return "cpu"
        return "cuda"

    def _check_cuda(self, hf_config: dict[str, Any]) -> None:
        refusal = self._cuda_refusal(hf_config)
        if refusal is not None:
            raise ValueError(refusal)

    def _cuda_refusal(self, hf_config: dict[str, Any]) -> str | None:
        """What the GPU path does not run yet, by field (None: it runs this)."""
        arch = hf_config["architectures"][0]
        head_dim = hf_config.get("head_dim") or (
            hf_config["hidden_size"] // hf_config["num_attention_heads"]
        )
        if self.kernel_backend != "torch":  # the Triton attention's tiles
            tiles = "a power of 2 of at least 16 (the Triton attention's tiles)"
            if not _tile_size(self.block_size):
                return f"block_size {self.block_size} on device 'cuda' must be {tiles}"
            if not _tile_size(head_dim):
                return f"model {arch!r}: head_dim {head_dim} on device 'cuda' must be {tiles}"
        refusals = {
            "quantization": self.quantization not in ("auto", "none"),
            "kernel_backend": self.kernel_backend not in ("auto", "torch", "triton"),
            "kv_cache_dtype": self.kv_cache_dtype != "auto",
            "enable_lora": self.enable_lora,
            "tensor_parallel_size": self.tensor_parallel_size * self.pipeline_parallel_size > 1,
            "model": bool(needs(arch) & {EXPERTS, LATENT_ATTENTION, VISION}),
            "speculative_config": (self.speculative_config or {}).get("method")
            in ("draft", "draft_model"),
        }
        for name, refused in refusals.items():
            if refused:
                value = arch if name == "model" else getattr(self, name)
                return (
                    f"{name} {value!r} is not supported on device 'cuda' yet (the GPU path "
                    "runs dense Llama-family models in float32/bf16/fp16, one process)"
                )
        return None

    def create_device_config(self) -> DeviceConfig:
        return DeviceConfig(
            self.resolved_device(),
            self.gpu_memory_utilization,
            self.max_num_batched_tokens,
            self.max_num_seqs,
        )

    def _check_parallel(self, hf_config: dict[str, Any]) -> None:
        """What a model split across workers does not run yet, refused by name."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if tp * pp == 1:
            return
        name = "tensor_parallel_size" if tp > 1 else "pipeline_parallel_size"
        arch = hf_config["architectures"][0]
        if self.enable_lora:
            raise ValueError(f"{name} > 1: LoRA adapters are not split across workers yet.")
        model_needs = needs(arch)
        if VISION in model_needs:
            raise ValueError(f"{name} > 1: vision-language models ({arch}) are not supported yet.")
        if tp > 1 and NORMS_ACROSS_HEADS in model_needs:
            raise ValueError(
                f"tensor_parallel_size > 1: {arch} is not supported yet (its q/k norms span "
                "every head)."
            )
        if tp > 1 and LATENT_ATTENTION in model_needs:
            raise ValueError(
                f"tensor_parallel_size > 1: multi-head latent attention ({arch}) is not "
                "split across workers yet."
            )
        from pagoda.distributed import split_heads, split_layers

        heads = hf_config["num_attention_heads"]
        split_heads(heads, hf_config.get("num_key_value_heads") or heads, tp, 0)
        split_layers(hf_config["num_hidden_layers"], pp, 0)

    def create_parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.distributed_executor_backend,
        )

    def create_draft_model_config(self, target: ModelConfig) -> ModelConfig | None:
        """Speculative method "draft": the draft model's config, checked against the
        target's (same vocabulary, context as long; text-only, since the draft sees
        token ids alone). None for any other method."""
        if self.speculative_config is None:
            return None
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if spec.method != "draft":
            return None
        if VISION in needs(target.hf_config["architectures"][0]):
            raise ValueError(
                "speculative_config: draft-model speculation on a vision-language model is "
                'not supported yet (use method "ngram").'
            )
        draft = replace(
            self,
            model=spec.model or self.model,
            dtype=target.dtype,
            quantization=spec.quantization,
            max_model_len=None,
            keep_full_precision=(),  # the target's choice; the draft is to be cheap
            speculative_config=None,
            enable_lora=False,
            tensor_parallel_size=1,  # every worker runs the whole draft
            pipeline_parallel_size=1,
        ).create_model_config()
        name = f"speculative_config.model ({draft.model})"
        if draft.path == target.path and draft.quantization == target.quantization:
            logger.warning(
                "%s: the draft is the target itself, loaded the same way: every draft is "
                "accepted, and each costs what a target step does. Set "
                "speculative_config.quantization, or name a smaller model.",
                name,
            )
        if VISION in needs(draft.hf_config["architectures"][0]):
            raise ValueError(f"{name} is a vision-language model; a draft must be text-only.")
        if draft.hf_config["vocab_size"] != target.hf_config["vocab_size"]:
            raise ValueError(
                f"{name} has a vocabulary of {draft.hf_config['vocab_size']} tokens, the "
                f"target {target.hf_config['vocab_size']}: a draft must share the target's."
            )
        if draft.max_model_len < target.max_model_len:
            raise ValueError(
                f"{name} holds {draft.max_model_len} positions, fewer than max_model_len "
                f"({target.max_model_len}); lower max_model_len."
            )
        return draft

    def create_cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes
            or (None if self.resolved_device() == "cuda" else default_kv_cache_bytes()),
            enable_prefix_caching=self.enable_prefix_caching,
            swap_space_bytes=self.swap_space if self.preemption_mode == "swap" else 0,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def create_lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras or self.max_loras,
        )

    def create_request_limits(self) -> RequestLimits:
        return RequestLimits(
            max_n=self.max_n,
            max_logprobs=self.max_logprobs,
            max_stop_strings=self.max_stop_strings,
            max_stop_string_chars=self.max_stop_string_chars,
            max_bad_words=self.max_bad_words,
            max_logit_bias=self.max_logit_bias,
            max_tokens=self.max_tokens_limit,
            max_prompts=self.max_prompts,
            max_images=(self.limit_mm_per_prompt or {}).get("image", RequestLimits.max_images),
            allowed_media_domains=tuple(self.allowed_media_domains or ()),
        )

    def create_scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            scheduling_policy=self.scheduling_policy,
            preemption_mode=self.preemption_mode,
            speculative=SpeculativeConfig.from_dict(self.speculative_config)
            if self.speculative_config is not None
            else None,
            max_loras=self.max_loras if self.enable_lora else None,
        )


def default_kv_cache_bytes() -> int:
    """A quarter of available memory, capped at 4 GiB (vLLM's CPU default)."""
    import psutil

    return int(min(4 << 30, psutil.virtual_memory().available // 4))


def _tile_size(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0
