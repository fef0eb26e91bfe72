"""Building a runner's model: loading its weights, reading what its paged cache
holds, and attaching the cache to its attention layers (shared by the model runner
and its draft model)."""

from __future__ import annotations

import torch

from pagoda.attention.kv_cache import KVShape, PagedKVCache
from pagoda.config import ModelConfig
from pagoda.distributed import SINGLE, ParallelContext
from pagoda.model_executor import model_loader
from pagoda.model_executor.layers.attention import Attention
from pagoda.model_executor.layers.mla import MLAttention
from pagoda.model_executor.models import BASE_MODEL, model_class, needs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(mc: ModelConfig, ops, parallel: ParallelContext = SINGLE) -> torch.nn.Module:
    # Built with uninitialized (so never touched, never resident) float32 weights; each
    # gets its storage as it loads, in the model's dtype or in its quantized blocks.
    # (Not the meta device: its first use imports about 70 MiB of Python.)
    cls = model_class(mc.architecture)
    cfg = {**mc.hf_config, "max_model_len": mc.max_model_len}  # the rope tables' length
    model = cls(cfg, ops) if parallel is SINGLE else cls(cfg, ops, parallel)
    weights = model_loader.iter_weights(
        mc.path, mc.is_gguf, mc.hf_config, mc.quantization, mc.keep_full_precision
    )
    if BASE_MODEL in needs(mc.architecture):  # a decoder saved without its LM head
        model.lm_head = None  # (it embeds only)
    # A decoder's base model saved alone (sentence-transformers' embedding models) names
    # its weights without the "model." that the causal LM puts before them.
    bare = ("layers.", "embed_tokens.", "norm.")
    weights = (("model." + n if n.startswith(bare) else n, w) for n, w in weights)
    model.load_weights(weights, DTYPES[mc.dtype])
    _release_free_memory()  # the loader's scratch (file parses, repacking) goes back
    return model.eval()


def kv_cache_shape(model: torch.nn.Module) -> KVShape:
    """What a model's paged cache holds: its attention layers', all alike."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    first = layers[0]
    return KVShape(len(layers), first.num_kv_heads, first.head_dim, first.num_kv)


def common_window(model: torch.nn.Module) -> int | None:
    """The largest sliding window if every attention layer of the whole model has one
    (read from its configs: a pipeline stage holds some layers only), else None."""
    decoder = getattr(model, "decoder", None) or getattr(
        getattr(model, "language_model", None), "decoder", None
    )
    if decoder is None:
        return None
    windows = [layer.attention.sliding_window for layer in decoder.layers]
    return max(windows) if windows and all(windows) else None


def expanded_kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int | None:
    """What the K and V of every head of every layer take per token in `dtype` where
    the cache holds latent rows instead (MLA), else None."""
    layers = [m for m in model.modules() if isinstance(m, MLAttention)]
    if not layers:
        return None
    size = torch.tensor([], dtype=dtype).element_size()
    return sum(layer.kv_bytes_per_token(size)[1] for layer in layers)


def attach_kv_cache(model: torch.nn.Module, kv_cache: PagedKVCache) -> None:
    for i, layer in enumerate(m for m in model.modules() if isinstance(m, Attention)):
        layer.kv = kv_cache.layer(i)


def _release_free_memory() -> None:
    """Ask glibc to return freed heap pages to the OS (about 25 MiB after a GGUF load)."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)
