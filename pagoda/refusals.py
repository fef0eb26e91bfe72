"""What the chosen paths do not run yet, refused by field before anything loads: the GPU
path's and a model split across workers' (by what the model needs, see
`pagoda.model_executor.models.needs`). Torch-free."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagoda.config import KV_ROLES
from pagoda.model_executor.models import (
    BASE_MODEL,
    BIDIRECTIONAL,
    CLASSIFIER,
    EXPERTS,
    LATENT_ATTENTION,
    NORMS_ACROSS_HEADS,
    VISION,
    needs,
)

if TYPE_CHECKING:
    from pagoda.engine_args import EngineArgs


def check_cuda(args: EngineArgs, hf_config: dict[str, Any]) -> None:
    refusal = cuda_refusal(args, hf_config)
    if refusal is not None:
        raise ValueError(refusal)


def cuda_refusal(args: EngineArgs, hf_config: dict[str, Any]) -> str | None:
    """What the GPU path does not run yet, by field (None: it runs this)."""
    arch = hf_config["architectures"][0]
    head_dim = hf_config.get("head_dim") or (
        hf_config["hidden_size"] // hf_config["num_attention_heads"]
    )
    if args.kernel_backend != "torch":  # the Triton attention's tiles
        tiles = "a power of 2 of at least 16 (the Triton attention's tiles)"
        if not _tile_size(args.block_size):
            return f"block_size {args.block_size} on device 'cuda' must be {tiles}"
        if not _tile_size(head_dim):
            return f"model {arch!r}: head_dim {head_dim} on device 'cuda' must be {tiles}"
    refusals = {
        "quantization": args.quantization not in ("auto", "none"),
        "kernel_backend": args.kernel_backend not in ("auto", "torch", "triton"),
        "kv_cache_dtype": args.kv_cache_dtype != "auto",
        "enable_lora": args.enable_lora,
        "tensor_parallel_size": args.tensor_parallel_size * args.pipeline_parallel_size > 1,
        "model": bool(
            needs(arch) & {EXPERTS, LATENT_ATTENTION, VISION, BIDIRECTIONAL, BASE_MODEL, CLASSIFIER}
        ),
        "task": args.task not in ("auto", "generate"),  # pooling: CPU-tested only
        "speculative_config": (args.speculative_config or {}).get("method")
        in ("draft", "draft_model"),
        "kv_offload_dir": args.kv_offload_dir is not None,  # the disk tier: CPU-tested only
    }
    for name, refused in refusals.items():
        if refused:
            value = arch if name == "model" else getattr(args, name)
            return (
                f"{name} {value!r} is not supported on device 'cuda' yet (the GPU path "
                "runs dense Llama-family models in float32/bf16/fp16, one process)"
            )
    return None


def check_parallel(args: EngineArgs, hf_config: dict[str, Any]) -> None:
    """What a model split across workers does not run yet, refused by name."""
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    if tp * pp == 1:
        return
    name = "tensor_parallel_size" if tp > 1 else "pipeline_parallel_size"
    arch = hf_config["architectures"][0]
    if args.enable_lora:
        raise ValueError(f"{name} > 1: LoRA adapters are not split across workers yet.")
    model_needs = needs(arch)
    if model_needs & {VISION, BIDIRECTIONAL, CLASSIFIER}:
        raise ValueError(f"{name} > 1: {arch} is not split across workers yet.")
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


def check_kv_offload(args: EngineArgs, hf_config: dict[str, Any]) -> None:
    """What the disk tier does not keep yet, refused by name."""
    if args.kv_offload_dir is None:
        return
    arch = hf_config["architectures"][0]
    refusals = {
        "a model split across workers": args.tensor_parallel_size * args.pipeline_parallel_size > 1,
        "enable_prefix_caching off (blocks are found by their prefix's hash)": not (
            args.enable_prefix_caching
        ),
        f"an encoder ({arch} keeps no KV cache)": BIDIRECTIONAL in needs(arch),
        "a draft model (its own KV blocks are not kept)": (args.speculative_config or {}).get(
            "method"
        )
        in ("draft", "draft_model"),
    }
    for what, refused in refusals.items():
        if refused:
            raise ValueError(f"kv_offload_dir: not supported with {what} yet.")


def check_kv_transfer(args: EngineArgs) -> None:
    """kv_transfer_config's shape: {"kv_role": one of KV_ROLES}, on a disk tier (the
    blocks' only transport); raises ValueError naming the field."""
    config = args.kv_transfer_config
    if config is None:
        return
    if not isinstance(config, dict) or set(config) != {"kv_role"}:
        raise ValueError(
            'kv_transfer_config must be {"kv_role": ...} (the blocks travel through the '
            f"disk tier, kv_offload_dir: no other connector), got {config!r}."
        )
    if config["kv_role"] not in KV_ROLES:
        raise ValueError(
            f"kv_transfer_config.kv_role must be one of {KV_ROLES}, got {config['kv_role']!r}."
        )
    if args.kv_offload_dir is None:
        raise ValueError(
            "kv_transfer_config: set kv_offload_dir to a directory the prefill and "
            "decode replicas share (the blocks pass through it)."
        )


def check_batch_invariant(args: EngineArgs, hf_config: dict[str, Any], device: str) -> None:
    """What the batch-invariant mode (pagoda.ops.cpu) does not cover yet, refused by name."""
    if not args.batch_invariant:
        return
    model_needs = needs(hf_config["architectures"][0])
    refusals = {
        "device 'cuda' (cuBLAS and the Triton kernels pick their splits by shape)": (
            device == "cuda"
        ),
        "kernel_backend 'torch' (it needs pagoda's C++ CPU kernels)": (
            args.kernel_backend == "torch"
        ),
        "tensor_parallel_size > 1 (the all-reduce's sums are cut by the step's size)": (
            args.tensor_parallel_size > 1
        ),
        "multi-head latent attention (its absorbed products are batched matmuls)": (
            LATENT_ATTENTION in model_needs
        ),
        "an encoder model": BIDIRECTIONAL in model_needs,
        "a vision-language model (its image encoder runs batched)": VISION in model_needs,
    }
    for what, refused in refusals.items():
        if refused:
            raise ValueError(f"batch_invariant: not supported with {what} yet.")


def _tile_size(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0
