"""The families released since 2024, each against Hugging Face transformers on the same
tiny random weights: greedy outputs token for token in float32, for a batch of prompts
in one call, and again with every prompt chunked and requests preempted. Windowed
families (Gemma 2/3, Mistral, Qwen2 with use_sliding_window) run prompts and outputs
past three times their window, on the C++ decode loop and on the PyTorch twins."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from tests.helpers import (
    FAMILY_DEFAULTS,
    FAMILY_MAX_TOKENS,
    GGUF_OVERRIDES,
    WINDOW,
    agreement_on_prefixes,
    family_greedy,
    family_hf_greedy,
    make_model,
    tiny_prompts,
)

FAMILIES = [
    "qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3", "granite", "smollm3", "deepseek_v2",
    "deepseek_v3",
]  # fmt: skip
WINDOWED = ["gemma2", "gemma3", "mistral_window", "qwen2_window"]


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {arch: make_model(str(root / arch), arch) for arch in FAMILIES + WINDOWED[2:]}


def long_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """Prompts of 3-6 windows (66-116 tokens), so that prompt and output reach past 3x
    the window (and past Phi-3's original context of 64)."""
    prompts = tiny_prompts(tokenizer, n, seed)
    return [(p * 116)[: 66 + (17 * i) % 51] for i, p in enumerate(prompts)]


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_matches_hf(family_models, arch):
    """8 prompts in one batch, then chunked into 7-token pieces under a cache so small
    that requests are preempted: HF's tokens, and no block left in use."""
    folder = family_models[arch]
    llm = LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 24)
    # (Phi-3's: past its original context, where HF takes the long factors as we do.)
    prompts = (long_prompts if arch == "phi3" else tiny_prompts)(llm.get_tokenizer(), 8, 11)
    expected = family_hf_greedy(folder, tuple(map(tuple, prompts)), FAMILY_MAX_TOKENS)
    assert family_greedy(llm, prompts) == expected
    assert llm.llm_engine.get_stats().kv_cache.num_blocks_used == 0
    block_bytes = llm.llm_engine.model_runner.bytes_per_block
    del llm
    tight = LLM(
        folder, dtype="float32", kv_cache_memory_bytes=12 * block_bytes,
        max_num_batched_tokens=7, max_model_len=160,
    )  # fmt: skip
    assert family_greedy(tight, prompts) == expected
    stats = tight.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.kv_cache.num_blocks_used == 0


@pytest.mark.parametrize("arch", WINDOWED)
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_sliding_window_past_three_windows(family_models, tmp_path_factory, arch, backend):
    folder = family_models.get(arch) or make_model(str(tmp_path_factory.mktemp(arch)), arch)
    llm = LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 24, kernel_backend=backend)
    assert llm.llm_engine.model_config.max_model_len == 512  # not capped at the window
    windows = {m.sliding_window for m in _attention_layers(llm)}
    assert WINDOW in windows
    prompts = long_prompts(llm.get_tokenizer(), n=8, seed=12)
    assert min(len(p) for p in prompts) + 40 > 3 * WINDOW
    expected = family_hf_greedy(folder, tuple(map(tuple, prompts)), 40)
    assert family_greedy(llm, prompts, 40) == expected
    # Chunks shorter than the window, and prefix-cache hits on the second run.
    chunked = LLM(
        folder, dtype="float32", kv_cache_memory_bytes=1 << 24, kernel_backend=backend,
        max_num_batched_tokens=13,
    )  # fmt: skip
    assert family_greedy(chunked, prompts, 40) == expected
    assert family_greedy(chunked, prompts, 40) == expected
    assert chunked.llm_engine.get_stats().kv_cache.prefix_cache_hits > 0


def test_all_sliding_model_holds_only_its_window(family_models):
    """Mistral with a window on every layer: blocks behind the window go back as each
    sequence moves on, so 8 blocks (128 tokens) serve 8 sequences of up to 156 tokens
    each, to HF's tokens, chunked and preempted; max_model_len stays the model's. A
    second pass hits the prefix cache on the blocks its windows reach."""
    folder = family_models["mistral_window"]
    probe = LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 22)
    block_bytes = probe.llm_engine.model_runner.bytes_per_block
    prompts = long_prompts(probe.get_tokenizer(), n=8, seed=19)
    del probe
    llm = LLM(
        folder, dtype="float32", kv_cache_memory_bytes=8 * block_bytes,
        max_num_batched_tokens=16, max_num_seqs=4,
    )  # fmt: skip
    engine = llm.llm_engine
    assert engine.model_runner.sliding_window == WINDOW
    assert engine.model_config.max_model_len == engine.max_model_len == 512
    assert max(len(p) for p in prompts) + 40 > 8 * 16  # longer than the whole cache
    expected = family_hf_greedy(folder, tuple(map(tuple, prompts)), 40)
    assert family_greedy(llm, prompts, 40) == expected
    assert family_greedy(llm, prompts, 40) == expected
    stats = engine.get_stats()
    assert stats.kv_cache.num_blocks_used == 0 and stats.kv_cache.prefix_cache_hits > 0


def test_phi3_longrope_by_context_length(family_models):
    """Longrope's factor set follows the engine's context (llama.cpp's rule): the short
    factors within the original 64 positions (HF's choice for sequences that short),
    the long ones past it (HF's choice for a sequence longer than 64 tokens)."""
    folder = family_models["phi3"]
    short = LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 24, max_model_len=64)
    prompts = [p[:30] for p in tiny_prompts(short.get_tokenizer(), n=6, seed=13)]
    assert family_greedy(short, prompts, 20) == family_hf_greedy(
        folder, tuple(map(tuple, prompts)), 20
    )
    long = LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 24)
    prompts = [p for p in long_prompts(long.get_tokenizer(), n=6, seed=14) if len(p) > 64]
    assert len(prompts) >= 4
    assert family_greedy(long, prompts, 20) == family_hf_greedy(
        folder, tuple(map(tuple, prompts)), 20
    )


def test_decode_loop_runs_every_family(family_models):
    """The C++ decode loop is built for every family and gives the eager path's tokens."""
    for arch in ["qwen3", "gemma2", "gemma3", "granite", "smollm3", "phi3"]:
        folder = family_models[arch]
        outs = {}
        for eager in (False, True):
            llm = LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 24, enforce_eager=eager)
            rows = llm.llm_engine.model_runner.decode_loop_max_rows
            assert (rows == 0) == eager, arch
            prompts = long_prompts(llm.get_tokenizer(), n=4, seed=15)
            params = SamplingParams(temperature=0.8, seed=3, max_tokens=30, logprobs=2)
            result = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
            )
            outs[eager] = [
                (o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in result
            ]
        assert outs[False] == outs[True], arch


def _attention_layers(llm: LLM):
    from pagoda.model_executor.layers.attention import Attention

    model = llm.llm_engine.model_runner.model
    return [m for m in model.modules() if isinstance(m, Attention)]


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory, family_models) -> dict[str, tuple[str, str]]:
    """(HF folder, the GGUF file llama.cpp's converter would write from it) per family."""
    from tests.gguf_writer import write_gguf

    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch in FAMILIES:
        folder = family_models[arch]
        if arch in GGUF_OVERRIDES:
            folder = make_model(str(root / arch), arch, **GGUF_OVERRIDES[arch])
        out[arch] = folder, write_gguf(str(root / f"{arch}.gguf"), folder)
    return out


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_gguf_matches_hf(gguf_models, arch):
    """llama.cpp's layout of each family (its names, q/k permutation, Gemma's +1 norms,
    Phi-3's fused tensors and rope factor tensors, Granite's scales as keys) loads to
    the HF folder's tokens; the tokenizer and chat template come from the file."""
    from transformers import AutoTokenizer

    folder, path = gguf_models[arch]
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=1 << 24)
    assert llm.llm_engine.model_config.architecture == _hf_architecture(folder)
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = (long_prompts if arch == "phi3" else tiny_prompts)(hf_tokenizer, 8, 16)
    expected = family_hf_greedy(folder, tuple(map(tuple, prompts)), FAMILY_MAX_TOKENS)
    assert family_greedy(llm, prompts) == expected
    text = "The quick brown fox jumps over the lazy dog."
    assert llm.get_tokenizer().encode(text) == hf_tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hello world"}]
    assert llm.get_tokenizer().apply_chat_template(messages, tokenize=False).startswith("<|user|>")


@pytest.mark.parametrize("arch", ["granite", "qwen3"])
def test_gguf_with_fused_qkv(tmp_path, gguf_models, arch):
    """A file written with --fuse-qkv (one attn_qkv; Granite's q and k rows permuted
    for llama.cpp's rope before they were fused) loads to HF's tokens."""
    from transformers import AutoTokenizer

    from tests.gguf_writer import write_gguf

    folder, _ = gguf_models[arch]
    path = write_gguf(str(tmp_path / f"{arch}-fused.gguf"), folder, fuse_qkv=True)
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=1 << 22)
    prompts = tiny_prompts(AutoTokenizer.from_pretrained(folder), n=6, seed=16)
    assert family_greedy(llm, prompts) == family_hf_greedy(
        folder, tuple(map(tuple, prompts)), FAMILY_MAX_TOKENS
    )


def test_quantized_family_gguf_keeps_its_blocks(tmp_path, gguf_models):
    """Q8_0 files of Qwen3 and Gemma 3: the blocks stay blocks, and the tokens agree
    with the same file expanded to floats."""
    from transformers import AutoTokenizer

    from tests.gguf_writer import write_gguf

    for arch in ("qwen3", "gemma3"):
        folder, _ = gguf_models[arch]
        path = write_gguf(str(tmp_path / f"{arch}-q8_0.gguf"), folder, "Q8_0")
        quantized = LLM(
            path, dtype="float32", kv_cache_memory_bytes=1 << 24, int8_activations=False
        )
        layer = quantized.llm_engine.model_runner.model.model.layers[0]
        assert layer.self_attn.qkv_proj.qweight is not None
        assert layer.mlp.down_proj.qweight is not None
        prompts = tiny_prompts(AutoTokenizer.from_pretrained(folder), n=6, seed=17)
        got = family_greedy(quantized, prompts)
        dense = LLM(path, dtype="float32", kv_cache_memory_bytes=1 << 24, quantization="none")
        assert agreement_on_prefixes(dense, prompts, got) >= 0.97


def _hf_architecture(folder: str) -> str:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder).architectures[0]


def test_mla_cache_holds_latent_rows(family_models):
    """DeepSeek's cache holds one latent row a token and layer (kv_lora + rope values),
    not every head's K and V; the engine says both sizes (log, stats, /metrics). An
    int8 latent cache still agrees with the float one."""

    cfg = FAMILY_DEFAULTS["deepseek_v3"]
    llm = LLM(family_models["deepseek_v3"], dtype="float32", kv_cache_memory_bytes=1 << 22)
    kv = llm.llm_engine.get_stats().kv_cache
    layers, heads = cfg["num_hidden_layers"], 4
    assert kv.bytes_per_token == layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    per_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]
    assert kv.expanded_bytes_per_token == layers * heads * per_head * 4
    prompts = tiny_prompts(llm.get_tokenizer(), n=6, seed=18)
    int8 = LLM(family_models["deepseek_v3"], dtype="float32", kv_cache_dtype="int8",
               kv_cache_memory_bytes=1 << 22)  # fmt: skip
    assert agreement_on_prefixes(llm, prompts, family_greedy(int8, prompts)) >= 0.9


# Qwen3's way to turn thinking off: an empty think block in the generation prompt.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}</s></s>{% endif %}"
    "{% endif %}"
)


def test_chat_template_kwargs_reach_the_template(tmp_path):
    """`chat_template_kwargs` (Qwen3's enable_thinking) reach the model's template, in
    LLM.chat as in the chat API's field."""
    from transformers import AutoTokenizer

    folder = make_model(str(tmp_path / "qwen3"), "qwen3")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(folder)
    llm = LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 22)
    messages = [{"role": "user", "content": "Hello world"}]
    params = SamplingParams(max_tokens=1)
    thinking = llm.chat(messages, params, use_tqdm=False)[0].prompt_token_ids
    plain = llm.chat(
        messages, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False}
    )[0].prompt_token_ids
    assert plain[: len(thinking)] == thinking and plain[len(thinking) :] == [2, 2]


def test_what_a_family_does_not_run_yet_is_refused_by_name(family_models):
    """MLA split across workers, LoRA on DeepSeek's MLA: a ValueError naming the
    field, before anything loads."""
    from pagoda import EngineArgs
    from pagoda.refusals import cuda_refusal

    folder = family_models["deepseek_v2"]
    with pytest.raises(ValueError, match="tensor_parallel_size > 1: multi-head latent"):
        EngineArgs(model=folder, tensor_parallel_size=2).create_model_config()
    with pytest.raises(ValueError, match="enable_lora: LoRA adapters on multi-head latent"):
        EngineArgs(model=folder, enable_lora=True).create_model_config()
    args = EngineArgs(model=folder)
    refusal = cuda_refusal(args, args.create_model_config().hf_config)
    assert refusal is not None and "DeepseekV2ForCausalLM" in refusal


def test_a_pipeline_stage_sees_the_whole_models_windows(family_models):
    """Blocks go back behind the window only where every layer of the whole model
    slides: a later pipeline stage of Qwen2 with use_sliding_window (its last layer
    slides, its first does not) holds only sliding layers, and must not say so."""
    import json
    import pathlib

    from pagoda.distributed import ParallelContext
    from pagoda.model_executor.model_loader import load_hf_config
    from pagoda.model_executor.models import model_class
    from pagoda.ops import TORCH_OPS
    from pagoda.worker.model_runner import common_window

    for arch, whole in (("qwen2_window", None), ("mistral_window", WINDOW)):
        folder = family_models[arch]
        cfg = load_hf_config(folder, False)
        config = json.loads(pathlib.Path(folder, "config.json").read_text())
        cls = model_class(config["architectures"][0])
        last_stage = cls(cfg, TORCH_OPS, ParallelContext(pp_rank=1, pp_size=2))
        assert common_window(last_stage) == whole, arch


def test_the_gpu_path_refuses_by_what_a_model_needs():
    """Every architecture with experts, latent attention or a vision tower is refused
    on device 'cuda' (OLMoE once slipped through a check by name); the dense ones,
    Gemma 3's text half among them, are not."""
    from pagoda import EngineArgs
    from pagoda.model_executor.models import ARCHITECTURES, needs
    from pagoda.refusals import cuda_refusal

    shape = {"hidden_size": 256, "num_attention_heads": 4}
    refused = set()
    for arch in ARCHITECTURES:
        refusal = cuda_refusal(EngineArgs(model="unused"), {"architectures": [arch], **shape})
        if refusal is not None:
            assert arch in refusal and "device 'cuda'" in refusal
            refused.add(arch)
    assert refused == {arch for arch in ARCHITECTURES if needs(arch)}
    assert {"OlmoeForCausalLM", "MixtralForCausalLM", "LlavaForConditionalGeneration"} <= refused
    assert "Gemma3ForConditionalGeneration" not in refused
