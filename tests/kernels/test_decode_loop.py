"""The C++ decode loop (csrc/decode_loop.cpp) against the Python model it stands in for:
the same tokens and bitwise the same logprobs, for each kind of linear it runs (dense
float32 and bf16, q4_1, q8_0, q4_k and q6_k blocks, w8a8, q/k/v bias), at one to 64 rows (on the
small-batch kernels and past them, where bf16 rows are padded and quantized weights
dequantized as pagoda.ops.cpu does), and with speculative drafts (decode rows at
successive positions)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagoda import LLM, SamplingParams
from pagoda.ops import cpu
from tests.helpers import K_NATIVE_TYPES, make_model, tiny_prompts, write_tiny_gguf

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="the C++ kernels do not build here")


def loop_rows(kwargs: dict) -> int:
    """The most rows the loop takes: w8a8's past its small kernel only where oneDNN's
    integer GEMM is fast (cpu.W8A8_INT_MAX_ROWS; on AVX2 alone it dequantizes there)."""
    if kwargs.get("quantization") == "w8a8":
        return min(cpu.DECODE_LOOP_MAX_ROWS, cpu.W8A8_INT_MAX_ROWS)
    return cpu.DECODE_LOOP_MAX_ROWS


def run(model: str, prompts, enforce_eager: bool, **kwargs):
    llm = LLM(model, kv_cache_memory_bytes=1 << 23, enforce_eager=enforce_eager, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm.llm_engine.model_runner.decode_loop_max_rows, [o.outputs[0] for o in outs]


@pytest.mark.parametrize(
    "arch, kwargs",
    [
        ("llama", {"dtype": "float32"}),
        ("llama", {"dtype": "bfloat16"}),
        ("llama", {"dtype": "bfloat16", "quantization": "q4_1"}),
        ("llama", {"dtype": "bfloat16", "quantization": "q8_0"}),
        ("llama", {"dtype": "float32", "quantization": "w8a8", "int8_activations": True}),
        ("qwen2", {"dtype": "bfloat16", "quantization": "q4_0"}),  # q/k/v bias
    ],
)
# 1: every small kernel; 12: past bf16's and w8a8's (8 rows), within the blocks' (16);
# 37: past every one, padded to 40
@pytest.mark.parametrize("batch", [1, 12, 37])
def test_decode_loop_equals_eager(tiny_models, arch, kwargs, batch):
    prompts = tiny_prompts(AutoTokenizer.from_pretrained(tiny_models[arch]), batch, seed=batch)
    max_rows, got = run(tiny_models[arch], prompts, False, **kwargs)
    assert max_rows == loop_rows(kwargs)
    _, want = run(tiny_models[arch], prompts, True, **kwargs)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # bitwise: the same kernels, in the same order


def test_decode_loop_runs_k_quants_as_eager(gguf_path, tmp_path):
    """A GGUF file with Q4_K and Q6_K weights (and embedding), kept in their
    super-blocks, at 1, 12 and 37 rows: each engine built once for the three."""
    path = str(tmp_path / "k.gguf")
    write_tiny_gguf(path, gguf_path, K_NATIVE_TYPES)
    engines = [LLM(path, kv_cache_memory_bytes=1 << 23, enforce_eager=e) for e in (False, True)]
    assert engines[0].llm_engine.model_runner.decode_loop_max_rows == cpu.DECODE_LOOP_MAX_ROWS
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)
    for batch in (1, 12, 37):
        prompts = tiny_prompts(engines[0].get_tokenizer(), batch, seed=batch)
        got, want = (
            [o.outputs[0] for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
            for llm in engines
        )  # fmt: skip
        for a, b in zip(got, want, strict=True):
            assert a.token_ids == b.token_ids
            assert a.logprobs == b.logprobs


def test_the_loop_pads_rows_as_python_does():
    kernels = cpu.load()
    assert [kernels.bucket_rows(n) for n in range(1, 5000)] == [
        cpu.bucket_rows(n) for n in range(1, 5000)
    ]


def test_decode_loop_with_speculative_drafts(tiny_llama):
    prompts = tiny_prompts(AutoTokenizer.from_pretrained(tiny_llama), 3, seed=9)
    prompts = [p + p[:16] for p in prompts]  # repeated text: n-gram drafts
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    kwargs = {"dtype": "float32", "speculative_config": spec}
    max_rows, got = run(tiny_llama, prompts, False, **kwargs)
    assert max_rows
    _, want = run(tiny_llama, prompts, True, **kwargs)
    assert [a.logprobs for a in got] == [b.logprobs for b in want]


def test_not_built_where_it_cannot_run_as_eager(tiny_llama):
    used, _ = run(tiny_llama, [[5, 6, 7]], False, dtype="float32", kv_cache_dtype="int8")
    assert not used  # the loop writes an unquantized cache only
    used, _ = run(tiny_llama, [[5, 6, 7]], True, dtype="float32")
    assert not used
    used, _ = run(tiny_llama, [[5, 6, 7]], False, dtype="float32", kernel_backend="torch")
    assert not used


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:

    root = tmp_path_factory.mktemp("moe-loop")
    return {
        "mixtral": make_model(str(root / "mixtral"), "mixtral"),
        # A shared expert and a dense layer 0 among the sparse ones.
        "qwen2_moe": make_model(str(root / "qwen2_moe"), "qwen2_moe", mlp_only_layers=[0]),
        "olmoe": make_model(str(root / "olmoe"), "olmoe"),
        "olmoe_clip": make_model(str(root / "olmoe_clip"), "olmoe", clip_qkv=0.3),
    }


@pytest.mark.parametrize(
    "arch, kwargs",
    [
        ("mixtral", {"dtype": "float32"}),
        ("mixtral", {"dtype": "bfloat16"}),
        ("qwen2_moe", {"dtype": "bfloat16"}),
        ("olmoe", {"dtype": "float32"}),  # q/k norms
        ("olmoe_clip", {"dtype": "bfloat16"}),  # and clip_qkv
        # Quantized experts: one loop linear per expert (Qwen2-MoE's 48-wide downs stay
        # stacked floats beside quantized gate/ups).
        ("mixtral", {"dtype": "bfloat16", "quantization": "q8_0"}),
        ("mixtral", {"dtype": "bfloat16", "quantization": "q4_1"}),
        ("qwen2_moe", {"dtype": "bfloat16", "quantization": "q4_0"}),
        ("mixtral", {"dtype": "float32", "quantization": "w8a8", "int8_activations": True}),
    ],
)
@pytest.mark.parametrize("batch", [1, 5, 37])  # 37: some experts past their small kernels
def test_decode_loop_runs_moe_layers_as_eager(moe_models, arch, kwargs, batch):
    prompts = tiny_prompts(AutoTokenizer.from_pretrained(moe_models[arch]), batch, seed=batch)
    used, got = run(moe_models[arch], prompts, False, **kwargs)
    assert used == loop_rows(kwargs)
    _, want = run(moe_models[arch], prompts, True, **kwargs)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


def test_decode_loop_not_built_for_a_quantized_kv_cache(moe_models):
    used, _ = run(moe_models["mixtral"], [[5, 6, 7]], False, dtype="float32", kv_cache_dtype="int8")
    assert not used  # the loop reads an unquantized cache only
