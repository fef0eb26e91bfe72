"""Multi-LoRA: PEFT adapters built with `peft` on tiny random models, served many in one
batch, against Hugging Face transformers with the same adapter applied by PEFT (greedy,
float32, token for token).

Adapters differ in rank (2-16, one with a rank_pattern), target sets (all linears,
attention only, MLP only, one layer only), alpha (alpha_pattern, rsLoRA). PEFT's
`init_lora_weights=False` makes B random too, so every adapter changes the outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil

import pytest
import torch

from pagoda import LLM, EngineArgs, LLMEngine, LoRARequest, SamplingParams
from pagoda.errors import InvalidRequestError
from tests.helpers import (
    ADAPTERS,
    QUESTIONS,
    broken_copy,
    edit_config,
    load_hf,
    make_adapter,
    make_model,
    tiny_prompts,
)

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(tiny_llama, str(root / name), seed, **config)
        for seed, (name, config) in enumerate(ADAPTERS.items(), 1)
    }


def lora_requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(adapters.items(), 1)}


class PeftReference:
    """HF transformers greedy decoding with each adapter applied by PEFT (cached)."""

    def __init__(self, base_folder: str, adapters: dict[str, str]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
        names = list(adapters)
        self.model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            self.model.load_adapter(adapters[name], adapter_name=name)
        self.model.eval()
        self.cache: dict[tuple, list[int]] = {}

    def greedy(self, prompt: list[int], adapter: str | None, max_tokens: int = MAX_TOKENS):
        key = (tuple(prompt), adapter, max_tokens)
        if key not in self.cache:
            ids = torch.tensor([prompt])
            kwargs = dict(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
            )
            with torch.inference_mode():
                if adapter is None:
                    with self.model.disable_adapter():
                        out = self.model.generate(**kwargs)
                else:
                    self.model.set_adapter(adapter)
                    out = self.model.generate(**kwargs)
            self.cache[key] = out[0, len(prompt) :].tolist()
        return self.cache[key]


@pytest.fixture(scope="module")
def reference(tiny_llama, adapters) -> PeftReference:
    return PeftReference(tiny_llama, adapters)


def lora_llm(folder: str, **kwargs) -> LLM:
    defaults = {"dtype": "float32", "kv_cache_memory_bytes": 1 << 24, "max_loras": 4}
    return LLM(folder, enable_lora=True, max_lora_rank=16, **{**defaults, **kwargs})


# min_tokens bans EOS as HF's min_new_tokens does.
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


def generate(llm: LLM, prompts, loras, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    return [o.outputs[0].token_ids for o in outs]


def mixed(prompts, requests: dict[str, LoRARequest]):
    """Prompt i under adapter i mod (adapters + 1); the last of each round, the base model."""
    names = [*requests, None]
    picks = [names[i % len(names)] for i in range(len(prompts))]
    return picks, [requests[n] if n is not None else None for n in picks]


def record_steps(llm: LLM) -> list[tuple[int, object]]:
    """From now on, per step: (its number of distinct adapters, its LoRAMapping)."""
    manager = llm.llm_engine.model_runner.lora_manager
    steps: list[tuple[int, object]] = []
    prepare = manager.prepare

    def recording(lora_requests, num_tokens):
        mapping = prepare(lora_requests, num_tokens)
        steps.append((len({r.lora_int_id for r in lora_requests if r is not None}), mapping))
        return mapping

    manager.prepare = recording
    return steps


def test_mixed_batch_matches_peft(tiny_llama, adapters, reference):
    llm = lora_llm(tiny_llama)
    prompts = tiny_prompts(llm.get_tokenizer(), 20, seed=3)
    picks, loras = mixed(prompts, lora_requests(adapters))
    steps = record_steps(llm)
    outputs = generate(llm, prompts, loras)
    for prompt, pick, out in zip(prompts, picks, outputs, strict=True):
        assert out == reference.greedy(prompt, pick), pick
    assert max(n for n, _ in steps) == 4  # the four adapters and the base model shared steps
    # Each adapter changes what the model says.
    for name in adapters:
        assert any(
            reference.greedy(p, name) != reference.greedy(p, None)
            for p, pick in zip(prompts, picks, strict=True)
            if pick == name
        ), name
    assert llm.llm_engine.kv_cache_manager.block_pool.num_used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_more_adapters_than_slots(tiny_llama, adapters, reference, mode):
    """Two slots and a host cache of two for four adapters, and a KV cache that forces
    preemption: the same outputs, never more than two adapters in a step, adapters
    evicted from the host cache and read again."""
    llm = lora_llm(
        tiny_llama,
        max_loras=2,
        max_cpu_loras=2,
        kv_cache_memory_bytes=40 * 8192,
        max_model_len=160,
        preemption_mode=mode,
    )
    prompts = tiny_prompts(llm.get_tokenizer(), 20, seed=4)
    picks, loras = mixed(prompts, lora_requests(adapters))
    steps = record_steps(llm)
    for _ in range(2):  # the second time, the first adapters come back from disk
        outputs = generate(llm, prompts, loras)
        for prompt, pick, out in zip(prompts, picks, outputs, strict=True):
            assert out == reference.greedy(prompt, pick), pick
    engine = llm.llm_engine
    assert engine.get_stats().num_preemptions > 0
    assert max(n for n, _ in steps) == 2
    assert engine.model_runner.lora_manager.num_loads > len(adapters)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_long_segments_match_peft(tiny_llama, adapters, reference):
    """Prefill steps whose segments are longer than LORA_GEMM_ROWS: cut for oneDNN's
    GEMMs, the rest to the C++ kernel."""
    from pagoda.ops.cpu import LORA_GEMM_ROWS

    llm = lora_llm(tiny_llama, max_num_batched_tokens=2048)
    prompts = [(p * 6)[:400] for p in tiny_prompts(llm.get_tokenizer(), 12, seed=13)]
    picks = ["all8"] * 8 + ["mlp16"] * 4
    steps = record_steps(llm)
    requests = lora_requests(adapters)
    outputs = generate(llm, prompts, [requests[n] for n in picks])
    for prompt, pick, out in zip(prompts, picks, outputs, strict=True):
        assert out == reference.greedy(prompt, pick), pick
    longest = max(end - start for _, m in steps if m for start, end, _ in m.segments)
    assert longest > LORA_GEMM_ROWS


def test_evicted_and_reloaded_between_calls(tiny_llama, adapters, reference):
    llm = lora_llm(tiny_llama, max_loras=1, max_cpu_loras=1)
    requests = lora_requests(adapters)
    prompts = tiny_prompts(llm.get_tokenizer(), 3, seed=5)
    order = ["all8", "mlp16", "all8", None, "qv4rs", "all8"]
    for name in order:
        lora = requests[name] if name else None
        outputs = generate(llm, prompts, lora)
        assert outputs == [reference.greedy(p, name) for p in prompts], name
    assert llm.llm_engine.model_runner.lora_manager.num_loads == 5  # every switch reads again
    assert llm.llm_engine.list_loras() == [requests["all8"].lora_int_id]


def test_prefix_cache_is_keyed_by_adapter(tiny_llama, adapters, reference):
    llm = lora_llm(tiny_llama)
    requests = lora_requests(adapters)
    prompt = tiny_prompts(llm.get_tokenizer(), 1, seed=6)[0][:2] * 40  # 80 tokens, 5 blocks
    kv = llm.llm_engine.kv_cache_manager

    def run(name):
        hits = kv.prefix_cache_hits
        (out,) = generate(llm, [prompt], requests[name] if name else None)
        assert out == reference.greedy(prompt, name), name
        return kv.prefix_cache_hits - hits

    assert run(None) == 0
    assert run("all8") == 0  # the base model's blocks hold other K/V
    assert run("all8") == 64  # its own, four full blocks
    assert run("mlp16") == 0
    assert run(None) == 64


def test_qwen2_with_bias_and_adapters(tmp_path):
    folder = make_model(str(tmp_path / "qwen2"), "qwen2")
    adapters = {
        "all4": make_adapter(folder, str(tmp_path / "all4"), 1, r=4, target_modules="all-linear"),
        "kv8": make_adapter(
            folder, str(tmp_path / "kv8"), 2, r=8, target_modules=["k_proj", "v_proj"]
        ),
    }
    reference = PeftReference(folder, adapters)
    llm = lora_llm(folder)
    prompts = tiny_prompts(llm.get_tokenizer(), 9, seed=7)
    picks, loras = mixed(prompts, lora_requests(adapters))
    for prompt, pick, out in zip(prompts, picks, generate(llm, prompts, loras), strict=True):
        assert out == reference.greedy(prompt, pick), pick


# Mixture-of-experts models: adapters on the attention of every layer and on the MLP of
# the dense layers (Qwen3-MoE's mlp_only_layers); the experts take none yet.
MOE_MODELS = {
    "mixtral": ("mixtral", {}),
    "qwen3_moe-dense0": ("qwen3_moe", dict(mlp_only_layers=[0])),
    "olmoe": ("olmoe", {}),
}
MOE_ADAPTERS = {
    "attn4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "qo8last": dict(r=8, target_modules=["q_proj", "o_proj"], layers_to_transform=[1]),
}


def write_adapter(path: str, weights: dict[str, torch.Tensor], r: int, alpha: float) -> str:
    """An adapter folder by hand, as PEFT before transformers 5 names MoE models'
    weights (PEFT 0.21 turns an MLP target of transformers 5's Mixtral, Qwen3-MoE or
    OLMoE into `target_parameters` on the fused experts, which pagoda refuses by name,
    whatever layers it names)."""
    import json
    import os

    from safetensors.torch import save_file

    os.makedirs(path)
    save_file({f"base_model.model.{k}": v.contiguous() for k, v in weights.items()},
              os.path.join(path, "adapter_model.safetensors"))  # fmt: skip
    modules = sorted({k.split(".")[-3] for k in weights})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": modules}, f)
    return path


def dense_mlp_adapter(folder: str, tmp_path, layer: int) -> tuple[str, str]:
    """(an adapter on `layer`'s dense MLP, written by hand; a copy of the model with it
    merged into the weights, W + alpha / r B A, for transformers to run)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(11)
    r, alpha, weights = 4, 8.0, {}
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            base = getattr(model.model.layers[layer].mlp, name).weight
            a, b = torch.randn(r, base.shape[1]) * 0.3, torch.randn(base.shape[0], r) * 0.3
            base += alpha / r * b @ a
            key = f"model.layers.{layer}.mlp.{name}"
            weights[f"{key}.lora_A.weight"], weights[f"{key}.lora_B.weight"] = a, b
    merged = str(tmp_path / "merged")
    model.save_pretrained(merged)
    return write_adapter(str(tmp_path / "mlp4first"), weights, r, alpha), merged


@pytest.mark.parametrize("variant", list(MOE_MODELS))
def test_moe_models_take_adapters_on_attention_and_dense_mlps(variant, tmp_path):
    arch, overrides = MOE_MODELS[variant]
    folder = make_model(str(tmp_path / variant), arch, **overrides)
    adapters = {
        name: make_adapter(folder, str(tmp_path / name), seed, **config)
        for seed, (name, config) in enumerate(MOE_ADAPTERS.items(), 1)
    }
    peft = PeftReference(folder, adapters)
    expected = {name: functools.partial(peft.greedy, adapter=name) for name in [*adapters, None]}
    if overrides.get("mlp_only_layers"):  # the dense layer's MLP under an adapter too
        adapters["mlp4first"], merged = dense_mlp_adapter(folder, tmp_path, layer=0)
        expected["mlp4first"] = functools.partial(
            PeftReference(merged, {"attn4": adapters["attn4"]}).greedy, adapter=None
        )
    llm = lora_llm(folder)
    prompts = tiny_prompts(llm.get_tokenizer(), 12, seed=5)
    picks, loras = mixed(prompts, lora_requests(adapters))
    for prompt, pick, out in zip(prompts, picks, generate(llm, prompts, loras), strict=True):
        assert out == expected[pick](prompt), pick
    for name in adapters:  # each adapter changes what the model says
        assert any(expected[name](p) != expected[None](p) for p in prompts), name
    from pagoda.ops import cpu

    module = cpu.load()
    if module is not None and module.lora_add_available():  # the C++ loop's decode steps
        assert llm.llm_engine.model_runner.decode_loop_max_rows
    assert llm.llm_engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_adapters_on_experts_are_refused_and_the_engine_serves_on(tmp_path):
    """Adapters on the routed experts, the shared expert or the router (PEFT's names
    before transformers 5), on the MLP of a layer that has experts, or on fused experts
    (target_parameters) are refused by name, and the engine serves on."""
    folder = make_model(str(tmp_path / "qwen2_moe"), "qwen2_moe")
    hidden, r = 64, 4
    refused = {}
    for i, module in enumerate(
        ["mlp.experts.3.up_proj", "mlp.shared_expert.down_proj", "mlp.gate", "mlp.down_proj"]
    ):
        weights = {
            f"model.layers.1.{module}.lora_A.weight": torch.randn(r, hidden),
            f"model.layers.1.{module}.lora_B.weight": torch.randn(hidden, r),
        }
        refused[module] = write_adapter(str(tmp_path / f"bad{i}"), weights, r, 8)
    attn = make_adapter(folder, str(tmp_path / "attn"), 3, r=4, target_modules=["v_proj"])
    fused = shutil.copytree(attn, str(tmp_path / "fused"))
    edit_config(fused, target_parameters=["gate_up_proj"])
    llm = lora_llm(folder)
    prompt = tiny_prompts(llm.get_tokenizer(), 1, seed=9)[0]
    cases = [(path, f"layers.1.{m}", "mixture-of-experts") for m, path in refused.items()]
    cases.append((fused, "target_parameters", "fused experts"))
    for i, (path, where, why) in enumerate(cases, 7):
        with pytest.raises(InvalidRequestError) as e:
            generate(llm, [prompt], LoRARequest("bad", i, path))
        assert e.value.param == "lora_request"
        assert where in str(e.value) and why in str(e.value), str(e.value)
    assert generate(llm, [prompt], LoRARequest("attn", 1, attn)) == [
        PeftReference(folder, {"attn": attn}).greedy(prompt, "attn")
    ]
    assert llm.llm_engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_sampling_n_and_speculation_under_an_adapter(tiny_llama, adapters, reference):
    """Seeded n = 3 under an adapter gives what the same requests give alone, and n-gram
    speculation keeps greedy outputs exact with adapters in the step."""
    llm = lora_llm(tiny_llama)
    requests = lora_requests(adapters)
    prompts = tiny_prompts(llm.get_tokenizer(), 4, seed=8)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, n=3, seed=11)
    alone = llm.generate(
        {"prompt_token_ids": prompts[0]}, params, use_tqdm=False, lora_request=requests["all8"]
    )[0]
    batch = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        use_tqdm=False,
        lora_request=[requests["all8"], requests["qv4rs"], None, requests["mlp16"]],
    )
    assert [c.token_ids for c in batch[0].outputs] == [c.token_ids for c in alone.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    spec = lora_llm(tiny_llama, speculative_config=ngram)
    repeated = [p[:10] * 4 for p in prompts]  # repeats itself: n-gram drafts
    picks = ["all8", None, "qv4rs"]
    outs = generate(spec, repeated[:3], [requests[n] if n else None for n in picks])
    for prompt, pick, out in zip(repeated[:3], picks, outs, strict=True):
        assert out == reference.greedy(prompt, pick), pick
    assert spec.llm_engine.get_stats().spec_decoding.num_drafts > 0


# ---- bad adapters and bad requests -------------------------------------------------------


@pytest.mark.parametrize(
    "how, message",
    [
        ("no_config", "adapter_config.json is missing"),
        ("no_weights", "no weight file"),
        ("bad_json", "adapter_config.json is not readable JSON"),
        ("truncated", "adapter_model.safetensors cannot be read"),
        ("dora", "use_dora is set: DoRA is not supported"),
        ("bias", "bias is 'all'"),
        ("modules_to_save", "modules_to_save is set"),
        ("rank_too_big", "r is 64, above this engine's max_lora_rank (16)"),
        ("rank_mismatch", "has shape [8, 128], expected [4, 128] (rank 4 from adapter_config.json"),
        ("not_lora", "peft_type is 'PREFIX_TUNING'"),
        ("extra_weight", "weight 'base_model.model.lm_head.lora_A.weight' is not a LoRA weight"),
        ("missing_b", "layer 0 q_proj has no lora_B weight"),
    ],
)
def test_bad_adapters_are_refused_and_the_engine_serves_on(
    tiny_llama, adapters, reference, tmp_path, how, message
):
    llm = lora_llm(tiny_llama)
    path = broken_copy(adapters["all8"], str(tmp_path / how), how)
    prompt = tiny_prompts(llm.get_tokenizer(), 1, seed=9)[0]
    with pytest.raises(InvalidRequestError) as e:
        generate(llm, [prompt], LoRARequest("bad", 7, path))
    assert e.value.param == "lora_request"
    assert message in str(e.value) and path in str(e.value)
    ok = LoRARequest("all8", 1, adapters["all8"])
    assert generate(llm, [prompt], ok) == [reference.greedy(prompt, "all8")]
    assert llm.llm_engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_adapter_of_another_model_is_refused(tiny_llama, adapters, tmp_path):
    wide = make_model(str(tmp_path / "wide"), "llama", hidden_size=96)
    llm = lora_llm(wide)
    with pytest.raises(
        InvalidRequestError,
        match=r"has shape \[64, 8\], expected \[96, 8\].*down_proj is 128 -> 96",
    ):
        generate(llm, [[5, 6, 7]], LoRARequest("all8", 1, adapters["all8"]))


@pytest.mark.parametrize(
    "lora, message",
    [
        ("adapter", "must be a LoRARequest"),
        (LoRARequest("", 1, "x"), "lora_request.lora_name must not be empty"),
        (LoRARequest("a", 0, "x"), "lora_request.lora_int_id must be an integer >= 1"),
        (LoRARequest("a", 1, "/no/such/adapter"), "no such folder"),
    ],
)
def test_bad_lora_requests(tiny_llama, lora, message):
    llm = lora_llm(tiny_llama)
    with pytest.raises(InvalidRequestError, match=message) as e:
        generate(llm, [[5, 6, 7]], lora)
    assert e.value.param == "lora_request"


def test_lora_off_refuses_adapters(tiny_llama, adapters):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 22)
    with pytest.raises(InvalidRequestError, match="enable_lora") as e:
        generate(llm, [[5, 6, 7]], LoRARequest("all8", 1, adapters["all8"]))
    assert e.value.param == "lora_request"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_loras=0), "max_loras must be a positive integer"),
        (dict(max_lora_rank=-1), "max_lora_rank must be a positive integer"),
        (dict(max_lora_rank=1024), "max_lora_rank must be at most 512"),
        (dict(max_loras=4, max_cpu_loras=2), r"max_cpu_loras \(2\) must be at least max_loras"),
        (dict(enable_lora="yes"), "enable_lora must be true or false"),
    ],
)
def test_bad_lora_engine_args(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).create_model_config()


def test_an_adapter_broken_after_the_front_door_fails_alone(
    tiny_llama, adapters, reference, tmp_path
):
    """Its file goes away between the check and the first step that reads it: that
    request ends with an error, the others finish as they would have."""
    engine = LLMEngine(
        EngineArgs(
            tiny_llama,
            dtype="float32",
            kv_cache_memory_bytes=1 << 22,
            enable_lora=True,
            max_loras=2,
        )
    )
    doomed = shutil.copytree(adapters["all8"], str(tmp_path / "doomed"))
    prompts = tiny_prompts(engine.tokenizer, 3, seed=10)
    loras = [None, LoRARequest("doomed", 5, doomed), LoRARequest("mlp16", 3, adapters["mlp16"])]
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY, lora_request=lora)
    shutil.rmtree(doomed)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["1"].outputs[0].finish_reason == "error"
    assert "doomed" in finished["1"].error and finished["1"].error_is_client
    assert finished["0"].outputs[0].token_ids == reference.greedy(prompts[0], None)
    assert finished["2"].outputs[0].token_ids == reference.greedy(prompts[2], "mlp16")
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_removed_in_flight_it_stays_until_its_requests_end(tiny_llama, adapters, reference):
    engine = LLMEngine(
        EngineArgs(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 22, enable_lora=True)
    )
    lora = LoRARequest("all8", 1, adapters["all8"])
    engine.add_lora(lora)  # read ahead: the first step needs no disk
    manager = engine.model_runner.lora_manager
    assert engine.list_loras() == [] and list(manager.host_cache) == [1]
    prompt = tiny_prompts(engine.tokenizer, 1, seed=11)[0]
    engine.add_request("r", {"prompt_token_ids": prompt}, GREEDY, lora_request=lora)
    for _ in range(4):
        engine.step()
    assert engine.list_loras() == [1]
    assert engine.remove_lora(1)
    out = None
    while engine.has_unfinished_requests():
        assert engine.list_loras() == [1]  # still in use
        out = next((o for o in engine.step() if o.finished), out)
    assert out.outputs[0].token_ids == reference.greedy(prompt, "all8")
    assert out.lora_request == lora
    assert manager.num_loads == 0  # never read from disk again
    assert engine.list_loras() == [] and not manager.host_cache  # freed once unused
    assert not engine.remove_lora(1)


def test_two_requests_on_an_unreadable_adapter_do_not_kill_the_engine(
    tiny_llama, adapters, reference, tmp_path
):
    """Every request of the step fails, but by its own input: the engine serves on."""
    engine = LLMEngine(
        EngineArgs(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 22, enable_lora=True)
    )
    doomed = shutil.copytree(adapters["all8"], str(tmp_path / "doomed"))
    lora = LoRARequest("doomed", 9, doomed)
    prompts = tiny_prompts(engine.tokenizer, 3, seed=14)
    for i in range(2):
        engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, GREEDY, lora_request=lora)
    shutil.rmtree(doomed)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert all(finished[r].outputs[0].finish_reason == "error" for r in "01")
    engine.add_request("2", {"prompt_token_ids": prompts[2]}, GREEDY)
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["2"].outputs[0].token_ids == reference.greedy(prompts[2], None)


def test_an_adapter_id_names_one_adapter(tiny_llama, adapters):
    engine = LLMEngine(
        EngineArgs(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 22, enable_lora=True)
    )
    engine.add_lora(LoRARequest("all8", 1, adapters["all8"]))
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 is adapter 'all8'") as e:
        engine.add_request(
            "x", "Hello", GREEDY, lora_request=LoRARequest("m", 1, adapters["mlp16"])
        )
    assert e.value.param == "lora_request" and not engine.has_unfinished_requests()


def test_a_waiting_adapter_is_not_starved(tiny_llama, adapters):
    """max_loras = 1 and a steady stream for one adapter: a request for another adapter
    is passed over at first, then the stream stops passing it and it runs."""
    from pagoda.core.lora_admission import MAX_STEPS_PASSED_OVER as LORA_MAX_PASSED_OVER

    engine = LLMEngine(
        EngineArgs(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 23, enable_lora=True)
    )
    requests = lora_requests(adapters)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    engine.add_request("s0", "Hello world", params, lora_request=requests["all8"])
    engine.step()
    engine.add_request("other", "Hello world", params, lora_request=requests["mlp16"])
    engine.add_request("base", "Hello world", params)
    done_at = {}
    for step in range(200):
        engine.add_request(f"s{step + 1}", "Hello world", params, lora_request=requests["all8"])
        for out in engine.step():
            if out.finished:
                done_at[out.request_id] = step
        if "other" in done_at:
            break
    assert done_at["base"] <= 8  # the base model never waits for adapters: 8 tokens, 8 steps
    assert LORA_MAX_PASSED_OVER < done_at["other"] < LORA_MAX_PASSED_OVER + 20


def test_lora_stats(tiny_llama, adapters):
    engine = LLMEngine(
        EngineArgs(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 22, enable_lora=True)
    )
    requests = lora_requests(adapters)
    engine.add_request("a", "The quick brown fox", GREEDY, lora_request=requests["all8"])
    engine.add_request("b", "Hello world", GREEDY, lora_request=requests["mlp16"])
    engine.add_request("c", "Hello world", GREEDY)
    engine.step()  # max_loras = 1: mlp16's request waits, the base model's runs
    stats = engine.get_stats().lora
    assert stats.max_loras == 1 and stats.num_resident == 1
    assert stats.running_adapters == ("all8",) and stats.waiting_adapters == ("mlp16",)
    assert engine.get_stats().num_requests_running == 2


# ---- kernels --------------------------------------------------------------------------------


def random_slots(
    num_slots: int, widths: list[int], rank: int, in_features: int, seed: int, dtype=torch.float32
):
    """A LinearLoRA with random weights in `dtype`, zero past each slot's rank (as the
    manager keeps it)."""
    from pagoda.lora.manager import LinearLoRA

    g = torch.Generator().manual_seed(seed)
    num_slices = len(widths)
    ranks = torch.randint(0, rank + 1, (num_slots, num_slices), generator=g, dtype=torch.int32)
    ranks[0] = rank  # one full slot
    a = torch.randn(num_slots, num_slices, rank, in_features, generator=g) * 0.1
    b = torch.randn(num_slots, rank, sum(widths), generator=g) * 0.1
    offsets = [sum(widths[:i]) for i in range(num_slices)]
    for slot in range(num_slots):
        for i, r in enumerate(ranks[slot].tolist()):
            a[slot, i, r:] = 0
            b[slot, r:, offsets[i] : offsets[i] + widths[i]] = 0
    return LinearLoRA(a.to(dtype), b.to(dtype), ranks, offsets, widths, ())


@pytest.mark.parametrize(
    "dtype, weight_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),  # AVX512-BF16 dot products where the CPU has them
    ],
)
@pytest.mark.parametrize("widths, rank", [([40, 16, 16], 8), ([96], 16), ([50, 50], 3)])
def test_lora_kernel_matches_the_twin(dtype, weight_dtype, widths, rank):
    from pagoda.lora.manager import LoRAMapping
    from pagoda.ops import cpu, torch_ops

    module = cpu.load()
    if module is None or not module.lora_add_available():
        pytest.skip("the C++ kernels do not build here")
    lora = random_slots(3, widths, rank, 76, seed=rank, dtype=weight_dtype)  # (K: a tail)
    # The kernel's input has NaN past each slot's rank: a read there would show.
    poisoned = dataclasses.replace(lora, a=lora.a.clone(), b=lora.b.clone())
    for slot in range(3):
        for i, r in enumerate(lora.ranks[slot].tolist()):
            poisoned.a[slot, i, r:] = float("nan")
            offset, width = lora.offsets[i], lora.widths[i]
            poisoned.b[slot, r:, offset : offset + width] = float("nan")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(23, 76, generator=g).to(dtype)
    y = torch.randn(23, sum(widths), generator=g).to(dtype)
    segments = [(0, 5, 1), (7, 8, 0), (8, 20, 2), (20, 21, 0)]  # rows 5, 6, 21, 22: base
    mapping = LoRAMapping(segments, torch.tensor(segments))
    # The reference: the twin in float32 on the same (possibly bf16-rounded) values.
    exact = dataclasses.replace(lora, a=lora.a.float(), b=lora.b.float())
    want = torch_ops.add_lora(y.clone().float(), x.float(), exact, mapping)
    got = y.clone()
    module.lora_add(
        got, x, poisoned.a, poisoned.b, lora.ranks, lora.offsets, mapping.segment_tensor
    )
    base_rows = [5, 6, 21, 22]
    assert torch.equal(got[base_rows], y[base_rows])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # y rounded to bf16, and with bf16 weights the shrink's output too
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_add_lora_cuts_long_segments(dtype):
    """The CPU op: multiples of LORA_GEMM_ROWS rows through oneDNN, the rest through
    lora_add, against the float32 twin."""
    from pagoda.lora.manager import LoRAMapping
    from pagoda.ops import cpu, torch_ops

    ops = cpu.cpu_ops(dtype)
    if ops is None:
        pytest.skip("the C++ kernels do not build here")
    lora = random_slots(3, [40, 16, 16], 8, 72, seed=4, dtype=dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1300, 72, generator=g).to(dtype)
    y = torch.randn(1300, 72, generator=g).to(dtype)
    segments = [(0, 1100, 1), (1100, 1150, 0), (1160, 1300, 2)]
    mapping = LoRAMapping(segments, torch.tensor(segments))
    blocks, rest = mapping.split(cpu.LORA_GEMM_ROWS)
    assert blocks == [(0, 1024, 1)]
    assert rest.tolist() == [[1024, 1100, 1], [1100, 1150, 0], [1160, 1300, 2]]
    exact = dataclasses.replace(lora, a=lora.a.float(), b=lora.b.float())
    want = torch_ops.add_lora(y.clone().float(), x.float(), exact, mapping)
    got = ops.add_lora(y.clone(), x, lora, mapping)
    assert torch.equal(got[1150:1160], y[1150:1160])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_loop_with_adapters_equals_eager(tiny_llama, adapters, dtype):
    """The C++ decode loop adds each adapter's part with the same kernel, arguments and
    order as the Python model: bitwise the same logprobs, adapters and base in one step."""
    from pagoda.ops import cpu

    module = cpu.load()
    if module is None or not module.lora_add_available():
        pytest.skip("the decode loop takes adapters only with the C++ lora_add (AVX512, AVX2)")
    if dtype == "bfloat16" and not module.small_gemm_available():
        pytest.skip("the decode loop does not run this here")
    runs = []
    for eager in (False, True):
        llm = lora_llm(tiny_llama, dtype=dtype, enforce_eager=eager)
        prompts = tiny_prompts(llm.get_tokenizer(), 6, seed=12)
        _, loras = mixed(prompts, lora_requests(adapters))
        params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
        )
        runs.append(
            (llm.llm_engine.model_runner.decode_loop_max_rows, [o.outputs[0] for o in outs])
        )
    (loop_rows, got), (eager_rows, want) = runs
    assert loop_rows and not eager_rows
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


@pytest.mark.slow
def test_smollm2_adapters_match_peft(gguf_path, tmp_path):
    """The real model from its GGUF file (its Q4_1 blocks kept, float32 activations)
    with two PEFT adapters and the base model in one batch, against transformers on the
    dequantized file with PEFT: token for token."""
    from peft import LoraConfig, get_peft_model

    hf = load_hf(gguf_path, torch.float32)
    torch.manual_seed(2)
    configs = {
        "a": LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False),
        "b": LoraConfig(
            r=16,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            init_lora_weights=False,
        ),
    }
    peft_model = get_peft_model(hf, configs["a"], adapter_name="a")
    peft_model.add_adapter("b", configs["b"])
    with torch.no_grad():  # random B, small enough that the model still talks
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.3)
    peft_model.save_pretrained(str(tmp_path))  # a non-default adapter goes to its own folder
    peft_model.eval()

    llm = LLM(gguf_path, dtype="float32", kv_cache_memory_bytes=1 << 27, enable_lora=True,
              max_loras=2, max_lora_rank=16)  # fmt: skip
    requests = {n: LoRARequest(n, i, str(tmp_path / n)) for i, n in enumerate(configs, 1)}
    picks = ["a", "b", None, "a", "b", None]
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS[: len(picks)]]
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = llm.chat(convs, params, use_tqdm=False, lora_request=[requests.get(p) for p in picks])
    differs = 0
    for pick, out in zip(picks, outs, strict=True):
        ids = torch.tensor([out.prompt_token_ids])
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                      do_sample=False)  # fmt: skip
        with torch.inference_mode():
            if pick is None:
                with peft_model.disable_adapter():
                    ref = peft_model.generate(**kwargs)
            else:
                peft_model.set_adapter(pick)
                ref = peft_model.generate(**kwargs)
                with peft_model.disable_adapter():
                    base = peft_model.generate(**kwargs)
                differs += not torch.equal(ref, base)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), pick
    assert differs >= 3  # the adapters change what the model says
