"""Building a runner's model: loading its weights, reading what its paged cache
holds, and attaching the cache to its attention layers (shared by the model runner
and its draft model)."""

from __future__ import annotations

import logging

import torch

from pagoda.attention.kv_cache import KVShape, PagedKVCache
from pagoda.config import ModelConfig
from pagoda.distributed import SINGLE, ParallelContext
from pagoda.model_executor import model_loader
from pagoda.model_executor.huge_pages import move_to_huge_pages
from pagoda.model_executor.layers.attention import Attention
from pagoda.model_executor.layers.mla import MLAttention
from pagoda.model_executor.models import BASE_MODEL, BIDIRECTIONAL, CLASSIFIER, model_class, needs
from pagoda.ops import TORCH_OPS

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    mc: ModelConfig, ops, parallel: ParallelContext = SINGLE, huge_pages: bool = True
) -> torch.nn.Module:
    """`huge_pages`: the weights moved onto transparent huge pages (a model that stays
    on the CPU; see pagoda.model_executor.huge_pages)."""
    # Built with uninitialized (so never touched, never resident) float32 weights; each
    # gets its storage as it loads, in the model's dtype or in its quantized blocks.
    # (Not the meta device: its first use imports about 70 MiB of Python.)
    cls = model_class(mc.architecture)
    cfg = {**mc.hf_config, "max_model_len": mc.max_model_len}  # the rope tables' length
    model = cls(cfg, ops) if parallel is SINGLE else cls(cfg, ops, parallel)
    weights = model_loader.iter_weights(
        mc.path, mc.is_gguf, mc.hf_config, mc.quantization, mc.keep_full_precision
    )
    model_needs = needs(mc.architecture)
    from_tokens = mc.hf_config.get("classifier_from_token")
    decoder_classifier = CLASSIFIER in model_needs and BIDIRECTIONAL not in model_needs
    if BASE_MODEL in model_needs or (decoder_classifier and not from_tokens):
        model.lm_head = None  # a decoder saved without its LM head: it embeds or classifies
    # A decoder's base model saved alone (sentence-transformers' embedding models) names
    # its weights without the "model." that the causal LM puts before them.
    bare = ("layers.", "embed_tokens.", "norm.")
    weights = (("model." + n if n.startswith(bare) else n, w) for n, w in weights)
    head: dict[str, torch.Tensor] = {}
    if decoder_classifier:  # its head ("score") is not a causal LM's: kept aside
        weights = _diverted(weights, "score.weight", head)
    model.load_weights(weights, DTYPES[mc.dtype])
    if decoder_classifier:
        model.score = classifier_head(mc, model, head.get("score.weight"))
        model.lm_head = None  # (logits of the whole vocabulary are never asked of it)
    if huge_pages:
        moved = move_to_huge_pages(model)
        if moved:
            logger.info("weights on transparent huge pages: %.1f MiB", moved / 2**20)
    _release_free_memory()  # the loader's scratch (file parses, repacking) goes back
    return model.eval()


def _diverted(weights, name: str, into: dict):
    """`weights` without the one called `name`, which goes into `into`."""
    for n, w in weights:
        if n == name:
            into[n] = w
        else:
            yield n, w


def classifier_head(mc: ModelConfig, model: torch.nn.Module, score) -> torch.Tensor:
    """A decoder classifier's head [labels, hidden] in the model's dtype: its checkpoint's
    `score.weight`, or, with `classifier_from_token` in the config (Qwen3-Reranker as
    vLLM serves it: ["no", "yes"]), the LM head's rows of those tokens, so that label i's
    logit is token i's and a pair's score, the softmax's last label, is P("yes")."""
    dtype = DTYPES[mc.dtype]
    tokens = mc.hf_config.get("classifier_from_token")
    if not tokens:
        if score is None:
            raise ValueError(f"{mc.model}: {mc.architecture} has no score.weight (its classifier).")
        return (
            score if isinstance(score, torch.Tensor) else TORCH_OPS.dequantize(score, dtype)
        ).to(dtype)
    from pagoda.model_executor.model_files import load_tokenizer

    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(
            f"hf_overrides: classifier_from_token must be a list of tokens, got {tokens!r}."
        )
    tokenizer = load_tokenizer(mc.path, mc.is_gguf)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    unknown = [
        t for t, i in zip(tokens, ids, strict=True) if i is None or i == tokenizer.unk_token_id
    ]
    if unknown:
        raise ValueError(
            f"hf_overrides: classifier_from_token {unknown} are not tokens of {mc.model}."
        )
    lm_head = model.lm_head
    if lm_head.qweight is None:
        return lm_head.weight.detach()[ids].to(dtype).clone()
    return TORCH_OPS.dequantize(lm_head.qweight.rows(ids), dtype)


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
