"""`EngineArgs`: everything a user can set on an engine (vLLM's names and meanings),
and `create_engine_config()`, which checks every field once, reads the model's
config, refuses by name what the chosen paths do not run yet (by what the model
needs, see `pagoda.model_executor.models.needs`), and returns a frozen `EngineConfig`.
Torch-free to import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from math import inf
from typing import Any

from pagoda.config import (
    DEVICES,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPES,
    KERNEL_BACKENDS,
    KV_CACHE_DTYPES,
    MAX_LORA_RANK,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    REASONING_PARSERS,
    SCHEDULING_POLICIES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RequestLimits,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagoda.model_executor import model_files
from pagoda.model_executor.models import (
    BIDIRECTIONAL,
    LATENT_ATTENTION,
    VISION,
    needs,
    position_offset,
)
from pagoda.model_executor.tasks import pooler_config, resolve_tasks
from pagoda.refusals import (
    check_batch_invariant,
    check_cuda,
    check_kv_offload,
    check_kv_transfer,
    check_parallel,
    cuda_refusal,
)

logger = logging.getLogger(__name__)


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
    # Serving to a deadline (see pagoda/core/deadlines.py): every request's targets for
    # time to first token and time per output token, in ms, unless it sets its own. The
    # waiting queue then runs by slack, and a request whose target cannot be met is
    # refused at once (DeadlineUnmeetableError; 429 in the server). None: off.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # A KV cache tier on disk (see pagoda.core.kv_tier): full prefix blocks that leave
    # memory are kept here, up to kv_offload_bytes, and read back on a prefix miss, across
    # restarts and by every server sharing the directory. None: off.
    kv_offload_dir: str | None = None
    kv_offload_bytes: int = 16 << 30
    # A host-RAM tier before the disk's, of at most this many bytes (0: none): the blocks
    # most recently written or read load from there without a file read.
    kv_offload_ram_bytes: int = 0
    # Prefill on one replica, decode on another, the blocks passed through the disk tier
    # both see (vLLM's field): {"kv_role": "kv_producer"} answers a request only once its
    # prompt's full blocks are written there; "kv_consumer" and "kv_both" read them as
    # any tier hit (`pagoda router --policy pd` sends each request through both).
    kv_transfer_config: dict[str, Any] | None = None
    seed: int = 0
    num_threads: int | None = None
    kernel_backend: str = "auto"
    quantization: str = "auto"
    keep_full_precision: tuple[str, ...] = ()
    # Quantized linears at small batch quantize their activations to int8 (llama.cpp's
    # way: fast); None: on for bf16/fp16 models and where "auto" chose float32 (a CPU
    # without native bf16: AVX2 alone), off where float32 was asked for by name
    # (exactness first).
    int8_activations: bool | None = None
    # Decode steps of a few rows run the layers in one C++ call (csrc/decode_loop.cpp,
    # bitwise the same result); True keeps every step in the Python model (vLLM's name).
    enforce_eager: bool = False
    # Each request's tokens and logprobs bitwise the same whatever else is in the batch,
    # however its prompt is chunked or cached (pagoda.ops.cpu: one kernel and one order of
    # sums per output element at every row count; attention per query row).
    batch_invariant: bool = False
    # A reasoning model's `<think>` block: split from the answer in responses, and
    # grammars constrain only what follows it (vLLM's name; see pagoda.engine.reasoning).
    reasoning_parser: str | None = None
    task: str = "auto"  # auto | generate | embed | classify | score (model_executor/tasks.py)
    # Fields laid over the model's config.json (vLLM's --hf-overrides), e.g. Qwen3-Reranker
    # as its card gives it: {"architectures": ["Qwen3ForSequenceClassification"],
    # "classifier_from_token": ["no", "yes"]}: a classifier whose labels are those tokens'
    # logits (pagoda.worker.model_setup.classifier_head).
    hf_overrides: dict[str, Any] | None = None
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

    def verify(self) -> None:
        """Each field alone: types, ranges, names; raises ValueError naming it."""

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
        for name in ("max_logprobs", "max_stop_strings", "max_bad_words", "max_logit_bias",
                     "kv_offload_ram_bytes"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")
        for name in (
            "kv_cache_memory_bytes",
            "max_model_len",
            "num_threads",
            "swap_space",
            "kv_offload_bytes",
            "max_tokens_limit",
            "max_cpu_loras",
        ):
            if getattr(self, name) is not None:
                positive(name)
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < inf
            ):
                raise ValueError(
                    f"{name} must be a positive number of milliseconds, got {value!r}."
                )
        if self.kv_offload_dir is not None and not (
            isinstance(self.kv_offload_dir, str) and self.kv_offload_dir
        ):
            raise ValueError(f"kv_offload_dir must be a directory, got {self.kv_offload_dir!r}.")
        check_kv_transfer(self)
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
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}."
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}."
            )
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(
                f"hf_overrides must be a JSON object of config fields, got {self.hf_overrides!r}."
            )
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

    def create_engine_config(self) -> EngineConfig:
        """Check every field, read the model's config, refuse what the chosen paths do
        not run, and build every part's config. Raises ValueError naming the field."""
        self.verify()
        device = self.resolved_device(warn=True)
        model = self._model_config(device)
        spec = None
        if self.speculative_config is not None:
            spec = SpeculativeConfig.from_dict(self.speculative_config)
        return EngineConfig(
            model=model,
            cache=self._cache_config(device, model),
            device=DeviceConfig(
                device, self.gpu_memory_utilization, self.max_num_batched_tokens, self.max_num_seqs
            ),
            parallel=ParallelConfig(
                self.tensor_parallel_size,
                self.pipeline_parallel_size,
                self.distributed_executor_backend,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=model.max_model_len,
                scheduling_policy=self.scheduling_policy,
                preemption_mode=self.preemption_mode,
                speculative=spec,
                max_loras=self.max_loras if self.enable_lora else None,
                slo_ttft_ms=self.slo_ttft_ms,
                slo_tpot_ms=self.slo_tpot_ms,
            ),
            limits=self._request_limits(),
            lora=self._lora_config(),
            draft_model=self._draft_model_config(model, spec),
            num_threads=self.num_threads,
        )

    def create_model_config(self) -> ModelConfig:
        """The model's config alone, checked as `create_engine_config` checks it."""
        self.verify()
        return self._model_config(self.resolved_device(warn=True))

    def _model_config(self, device: str) -> ModelConfig:
        from pagoda.model_executor import model_loader

        path, is_gguf = model_files.resolve_model(self.model)
        hf_config = self._hf_config(path, is_gguf)
        model_loader.check_architecture(hf_config, path)
        arch = hf_config["architectures"][0]
        model_needs = needs(arch)
        if self.enable_lora and LATENT_ATTENTION in model_needs:
            raise ValueError(
                "enable_lora: LoRA adapters on multi-head latent attention models are not "
                f"supported yet ({arch})."
            )
        if BIDIRECTIONAL in model_needs and (self.enable_lora or self.speculative_config):
            name = "enable_lora" if self.enable_lora else "speculative_config"
            raise ValueError(f"{name}: not supported for encoder models yet ({arch}).")
        if self.enable_lora and VISION in model_needs:
            raise ValueError(
                f"enable_lora: LoRA adapters on vision-language models are not supported yet ({arch})."
            )
        check_parallel(self, hf_config)
        check_kv_offload(self, hf_config)
        check_batch_invariant(self, hf_config, device)
        quantization, kernel_backend = self.quantization, self.kernel_backend
        if device == "cuda":
            check_cuda(self, hf_config)
            quantization = "none"  # GGUF blocks expanded to the dtype: no GPU kernel yet
            kernel_backend = "triton" if kernel_backend == "auto" else kernel_backend
        # (RoBERTa's first rows are the padding id's and before: never a token's)
        offset = position_offset(arch, hf_config)
        model_max_len = int(hf_config.get("max_position_embeddings") or 2048) - offset
        if self.max_model_len is not None and self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's "
                f"{model_max_len} positions (max_position_embeddings "
                f"{model_max_len + offset})."
            )
        dtype = model_loader.resolve_dtype(self.dtype, hf_config, device)
        eos_token_ids, generation_defaults = model_loader.load_generation_config(
            path, is_gguf, hf_config
        )
        tasks = resolve_tasks(self.task, arch, path, is_gguf)
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
            else dtype != "float32" or self.dtype == "auto",
            enforce_eager=self.enforce_eager,
            batch_invariant=self.batch_invariant,
            max_model_len=self.max_model_len or model_max_len,
            max_model_len_is_default=self.max_model_len is None,
            eos_token_ids=eos_token_ids,
            generation_defaults=generation_defaults,
            seed=self.seed,
            reasoning_parser=self.reasoning_parser,
            tasks=tasks,
            pooler=pooler_config(path, is_gguf, hf_config) if "embed" in tasks else None,
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
            path, is_gguf = model_files.resolve_model(self.model)
            refusal = cuda_refusal(self, self._hf_config(path, is_gguf))
            if refusal is not None:
                if warn:
                    logger.warning("device auto: %s; running on the CPU.", refusal)
                return "cpu"
        return "cuda"

    def _hf_config(self, path: str, is_gguf: bool) -> dict[str, Any]:
        """The model's config (from its folder or GGUF metadata), `hf_overrides` laid over."""
        from pagoda.model_executor import model_loader

        return {**model_loader.load_hf_config(path, is_gguf), **(self.hf_overrides or {})}

    def _draft_model_config(
        self, target: ModelConfig, spec: SpeculativeConfig | None
    ) -> ModelConfig | None:
        """Speculative method "draft": the draft model's config, checked against the
        target's (same vocabulary, context as long; text-only, since the draft sees
        token ids alone). None for any other method."""
        if spec is None or spec.method != "draft":
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

    def _cache_config(self, device: str, model: ModelConfig) -> CacheConfig:
        # An encoder's blocks are bookkeeping: a block's states depend on the whole prompt.
        encoder = BIDIRECTIONAL in needs(model.architecture)
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes
            or (None if device == "cuda" else default_kv_cache_bytes()),
            enable_prefix_caching=self.enable_prefix_caching and not encoder,
            swap_space_bytes=self.swap_space if self.preemption_mode == "swap" else 0,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_offload_dir=self.kv_offload_dir,
            kv_offload_bytes=self.kv_offload_bytes,
            kv_offload_ram_bytes=self.kv_offload_ram_bytes,
            kv_role=(self.kv_transfer_config or {}).get("kv_role"),
        )

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras or self.max_loras,
        )

    def _request_limits(self) -> RequestLimits:
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


def default_kv_cache_bytes() -> int:
    """A quarter of available memory, capped at 4 GiB (vLLM's CPU default)."""
    import psutil

    return int(min(4 << 30, psutil.virtual_memory().available // 4))
