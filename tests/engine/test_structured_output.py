"""Structured outputs (llguidance grammars) in the engine: every kind of constraint, the
batch around a constrained request, n > 1, preemption, speculative drafts, bad grammars.

The tiny models are random: whatever they produce under a grammar is the mask's doing.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.core.structured_output import GrammarCompileError, GrammarCompiler, build_grammar
from tests.helpers import NGRAM, completions, spec_engine, tiny_prompts

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "pet": {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def constrained(**kind) -> SamplingParams:
    return SamplingParams(
        temperature=0.9, seed=3, max_tokens=120, structured_outputs=StructuredOutputsParams(**kind)
    )


def texts(llm: LLM, prompts, params) -> list[str]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [c.text for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 22)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    return tiny_prompts(llm.get_tokenizer(), 6, seed=7)


def test_json_schema(llm, prompts):
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], constrained(json=PERSON), use_tqdm=False
    )
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"  # the grammar completed
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    # The schema as JSON text works the same; one compile serves every request.
    assert texts(llm, prompts, constrained(json=json.dumps(PERSON))) == [
        o.outputs[0].text for o in outs
    ]


def test_json_object_regex_choice_and_grammars(llm, prompts):
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], constrained(json_object=True), use_tqdm=False
    )
    for c in (o.outputs[0] for o in outs):  # a random model may not close its object in time
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    assert all(re.fullmatch(pattern, t) for t in texts(llm, prompts, constrained(regex=pattern)))
    choices = ["yes", "no", "don't know"]
    got = texts(llm, prompts * 4, constrained(choice=choices))
    assert set(got) <= set(choices) and len(set(got)) > 1  # the model, not the mask, picks
    lark = 'start: "x=" NUM ";"\nNUM: /[1-9][0-9]?/'
    assert all(
        re.fullmatch(r"x=[1-9][0-9]?;", t) for t in texts(llm, prompts, constrained(grammar=lark))
    )
    gbnf = 'root ::= "(" [a-c]+ ")"'
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], constrained(grammar=gbnf), use_tqdm=False
    )
    for c in (o.outputs[0] for o in outs):
        if c.finish_reason == "stop":  # the grammar completed
            assert re.fullmatch(r"\([a-c]+\)", c.text), c.text
        else:  # cut at max_tokens: still a prefix the grammar allows
            assert c.finish_reason == "length" and re.fullmatch(r"\([a-c]*", c.text), c.text
    # Unconstrained, the same model produces none of these.
    free = texts(llm, prompts, SamplingParams(temperature=0.9, seed=3, max_tokens=30))
    assert not any(re.fullmatch(pattern, t) or t in choices for t in free)


def test_greedy_is_deterministic_and_the_batch_is_untouched(llm):
    """A grammar request batched with 15 unconstrained ones: each of those gives exactly
    its output without it, and the constrained one its output alone."""
    prompts = tiny_prompts(llm.get_tokenizer(), 16, seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = texts(llm, prompts[1:], greedy)
    params = [
        SamplingParams(
            temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=PERSON)
        )
    ]
    params += [greedy] * 15
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs[1:]] == alone
    first = outs[0].outputs[0].text
    jsonschema.validate(json.loads(first), PERSON)
    assert texts(llm, prompts[:1], params[0]) == [first]


def test_parallel_sampling(llm, prompts):
    params = SamplingParams(
        n=4, temperature=1.0, seed=5, max_tokens=120,
        structured_outputs=StructuredOutputsParams(json=PERSON),
    )  # fmt: skip
    got = texts(llm, prompts[:2], params)
    assert len(got) == 8 and len(set(got)) > 1
    for text in got:
        jsonschema.validate(json.loads(text), PERSON)


def test_preemption_gives_the_unpreempted_output(tiny_llama, llm):
    prompts = tiny_prompts(llm.get_tokenizer(), 6, seed=4)
    params = SamplingParams(
        temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=PERSON)
    )
    want = texts(llm, prompts, params)
    for mode in ("recompute", "swap"):
        small = LLM(
            tiny_llama,
            dtype="float32",
            block_size=4,
            kv_cache_memory_bytes=60 * llm.llm_engine.model_runner.bytes_per_block // 4,
            preemption_mode=mode,
        )
        assert texts(small, prompts, params) == want
        stats = small.llm_engine.get_stats()
        assert stats.num_preemptions > 0
        assert stats.kv_cache.num_blocks_used == 0


@pytest.fixture
def draft_oracle(monkeypatch):
    """Drafts that continue with the expected output, one token spoiled (often into one the
    grammar refuses, which the scheduler must drop before verification)."""
    expected: list[tuple[list[int], list[int]]] = []

    def propose(token_ids, k, n_min, n_max):
        for prompt, output in expected:
            done = len(token_ids) - len(prompt)
            if token_ids[: len(prompt)] == prompt and output[:done] == token_ids[len(prompt) :]:
                draft = list(output[done : done + k])
                spoil = len(token_ids) % 5
                if spoil < len(draft):
                    draft[spoil] = (draft[spoil] + 7) % 300
                return draft
        return []

    monkeypatch.setattr("pagoda.core.drafts.propose_ngram", propose)
    return expected


def test_speculative_drafts_keep_to_the_grammar(tiny_llama, llm, draft_oracle):
    prompts = tiny_prompts(llm.get_tokenizer(), 3, seed=6)
    params = SamplingParams(
        temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=PERSON)
    )
    want = completions(llm, prompts, params)
    draft_oracle += list(zip(prompts, want, strict=True))
    spec = spec_engine(tiny_llama, NGRAM)
    assert completions(spec, prompts, params) == want
    stats = spec.llm_engine.get_stats().spec_decoding
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize(
    "kind, message",
    [
        ({}, "exactly one of"),
        ({"json": PERSON, "regex": "a"}, "exactly one of"),
        ({"json": "{not json"}, r"structured_outputs.json is not valid JSON"),
        ({"json": {"type": "objec"}}, "Invalid type: objec"),
        ({"json": {"properties": {"a": {"$ref": "#/nope"}}}}, "nope"),
        ({"json": [1]}, "must be a JSON schema"),
        ({"regex": "a(b"}, "unclosed group"),
        ({"regex": ""}, "non-empty string"),
        ({"choice": []}, "list of 1 to"),
        ({"choice": ["a", 3]}, "non-empty strings"),
        ({"grammar": "start: foo"}, "unknown name"),
        ({"json_object": "yes"}, "must be true"),
    ],
)
def test_bad_grammars_name_the_field_and_the_engine_serves_on(llm, kind, message):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**kind))
    with pytest.raises(ValueError, match=message) as info:
        llm.generate("hello", params, use_tqdm=False)
    assert info.value.param == "structured_outputs"
    assert llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].text


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(llm, prompts, monkeypatch):
    bad = build_grammar(StructuredOutputsParams(regex="z+"))
    compile_one = GrammarCompiler._compile

    def compile_or_fail(self, grammar):
        if grammar == bad:
            raise GrammarCompileError("too big for this tokenizer")
        return compile_one(self, grammar)

    monkeypatch.setattr(GrammarCompiler, "_compile", compile_or_fail)
    params = [
        SamplingParams(n=2, max_tokens=5, structured_outputs=StructuredOutputsParams(regex="z+")),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
    assert "too big for this tokenizer" in outs[0].error and outs[0].error_is_client
    assert [c.finish_reason for c in outs[0].outputs] == ["error", "error"]
    assert len(outs[1].outputs[0].token_ids) == 5
    engine_ = llm.llm_engine
    assert not engine_.has_unfinished_requests() and not engine_.scheduler.requests
    assert engine_.kv_cache_manager.block_pool.num_used_blocks == 0


def test_each_distinct_grammar_compiles_once(tiny_llama, prompts):
    fresh = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 22)
    for _ in range(3):
        texts(fresh, prompts, constrained(json=PERSON))
    texts(fresh, prompts, constrained(regex="[ab]+c"))
    assert len(fresh.llm_engine.grammar_compiler.compile_seconds) == 2


@pytest.mark.parametrize("vocab", [400, 49150])
def test_bitmask_kernel_matches_torch_and_the_bits(vocab, monkeypatch):
    import torch

    from pagoda.ops import cpu
    from pagoda.sample import sampler

    words = (vocab + 31) // 32
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, vocab, generator=g).to(torch.bfloat16)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=g)
    bitmask[1], bitmask[2] = -1, 0  # all allowed, none allowed
    rows = [6, 0, 3, 2, 5]
    got = sampler.apply_bitmask(logits, rows, bitmask)
    bits = torch.tensor(
        [[(int(w) >> b) & 1 for w in row for b in range(32)][:vocab] for row in bitmask.tolist()]
    ).bool()
    want = logits.float()
    want[rows] = torch.where(bits, want[rows], float("-inf"))
    assert torch.equal(got, want) and got.dtype == torch.float32
    if cpu.load() is not None:  # the C++ kernel ran above; now the torch path
        monkeypatch.setattr(cpu, "load", lambda: None)
        assert torch.equal(sampler.apply_bitmask(logits, rows, bitmask), want)


def test_a_slow_compile_holds_up_only_its_own_request(tiny_llama, prompts, monkeypatch):
    import threading

    from pagoda import EngineArgs, LLMEngine

    release = threading.Event()
    compile_one = GrammarCompiler._compile

    def slow(self, grammar):
        release.wait(30)
        return compile_one(self, grammar)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    engine_ = LLMEngine(
        EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 22)
    )
    engine_.add_request("json", {"prompt_token_ids": prompts[0]}, constrained(json=PERSON))
    engine_.add_request(
        "free", {"prompt_token_ids": prompts[1]}, SamplingParams(max_tokens=8, ignore_eos=True)
    )
    finished = set()
    for _ in range(20):  # the free request runs to its end while the grammar compiles
        finished |= {o.request_id for o in engine_.step() if o.finished}
    assert finished == {"free"} and engine_.scheduler.grammars.compiling
    release.set()
    while engine_.has_unfinished_requests():
        for out in engine_.step():
            if out.finished:
                jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
                finished.add(out.request_id)
    assert finished == {"free", "json"}


def test_with_prefix_caching_priority_and_every_sampler_setting(tiny_llama, prompts):
    llm = LLM(
        tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 22, scheduling_policy="priority"
    )
    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=50, min_p=0.01, seed=4, max_tokens=120,
        repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
        logit_bias={5: 3.0}, logprobs=2,
        structured_outputs=StructuredOutputsParams(json=PERSON),
    )  # fmt: skip
    batch = [{"prompt_token_ids": p} for p in prompts]
    first = llm.generate(batch, params, use_tqdm=False, priority=list(range(len(batch))))
    again = llm.generate(batch, params, use_tqdm=False)  # served from the prefix cache
    assert llm.llm_engine.get_stats().kv_cache.prefix_cache_hits > 0
    for a, b in zip(first, again, strict=True):
        assert a.outputs[0].text == b.outputs[0].text
        jsonschema.validate(json.loads(a.outputs[0].text), PERSON)
        assert len(a.outputs[0].logprobs) == len(a.outputs[0].token_ids)
