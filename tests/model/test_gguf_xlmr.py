"""XLM-R GGUF files (bge-m3 and multilingual-e5 embedders, bge-reranker cross-encoders) and
RoBERTa ones (all-distilroberta, the RoBERTa cross-encoders) as llama.cpp's converter
writes them (tests/gguf_bert_writer.py: a "t5" vocabulary of SentencePiece pieces and
scores with NFKC's precompiled map, or a "gpt2" one of byte-level BPE tokens and merges;
the position table cut to start after the padding id, the head as cls and cls.output),
against the folders they were written from: the rebuilt tokenizer's ids,
sentence-transformers' embeddings, CrossEncoder's scores. A BERT cross-encoder's file,
which the converter writes without its pooler, is refused by name; the folders' own
context stops where their positions do."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda import LLM
from pagoda.engine_args import EngineArgs
from tests.gguf_bert_writer import write_bert_gguf
from tests.helpers import ENCODER_TEXTS, make_encoder, make_sentence_transformer, quantized_modules

# NFKC's map at work (a ligature, full-width letters, a circled digit), accents, CJK the
# vocabulary lacks, runs of spaces, special tokens written in the text.
TEXTS = ENCODER_TEXTS + [
    "ﬁne ＡＢＣ ① café  東京",
    "Unbelievably QUICK foxes!! jumped... over (lazy) dogs?",
    "  leading   and trailing  ",
    "<s> special </s> inside <mask>",
    "x",
]
QUERY = "the quick brown fox"
DOCUMENTS = ["Paged attention keeps blocks.", "The quick brown fox jumps.", "Hello world, today", "ＡＢＣ"]  # fmt: skip


@pytest.fixture(scope="module", params=["xlm-roberta", "roberta"])
def files(request, tmp_path_factory):
    """An XLM-R (or RoBERTa) sentence-transformers folder (mean pooling) with its F32
    and Q8_0 files, and a cross-encoder (one label) with its F32 file; the tokenizer
    cache in a folder of this module's."""
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGODA_CACHE_DIR", str(root / "cache"))
        encoder = make_encoder(str(root / "encoder"), request.param)
        st = make_sentence_transformer(str(root / "st"), encoder, "mean")
        ce = make_encoder(str(root / "ce"), request.param, num_labels=1)
        yield {
            "kind": request.param,
            "st": (st, write_bert_gguf(str(root / "st.gguf"), st)),
            "st-q8_0": (st, write_bert_gguf(str(root / "st-q8_0.gguf"), st, "Q8_0")),
            "ce": (ce, write_bert_gguf(str(root / "ce.gguf"), ce)),
        }


def test_gguf_xlmr_tokenizer_equals_the_folders(files):
    """The Unigram (BPE) tokenizer rebuilt from the file gives the folder's ids on texts
    and pairs (<s> A </s></s> B </s>), through the precompiled map (the byte alphabet),
    and decodes alike."""
    from transformers import AutoTokenizer

    from pagoda.model_executor.model_files import load_tokenizer

    folder, path = files["ce"]
    hf = AutoTokenizer.from_pretrained(folder)
    if files["kind"] == "xlm-roberta":
        assert (
            hf.backend_tokenizer.normalizer.normalize_str("ﬁ ＡＢＣ ①") == "fi ABC 1"
        )  # (the map)
    for got in (load_tokenizer(path, True), load_tokenizer(path, True)):  # (built, then cached)
        for text in TEXTS:
            assert got(text)["input_ids"] == hf(text)["input_ids"], text
        for doc in DOCUMENTS:
            assert got(QUERY, doc)["input_ids"] == hf(QUERY, doc)["input_ids"]
    ids = hf(" ".join(TEXTS))["input_ids"]
    assert hf.mask_token_id in ids  # (what it covers)
    if files["kind"] == "xlm-roberta":
        assert hf.unk_token_id in ids
    assert got.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name, bound", [("st", 0.999999), ("st-q8_0", 0.999)])
def test_gguf_xlmr_embeddings_equal_sentence_transformers(files, name, bound):
    """LLM(file).embed against SentenceTransformer(folder).encode (RoBERTa's positions
    from the cut table); Q8_0 matrices kept as Q8_0 blocks."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoConfig

    folder, path = files[name]
    expected = SentenceTransformer(folder, device="cpu").encode(TEXTS)
    llm = LLM(path, dtype="float32")
    config = llm.llm_engine.model_config
    assert config.architecture == AutoConfig.from_pretrained(folder).architectures[0]
    assert config.max_model_len == 128
    got = np.asarray([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    cos = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cos.min() >= bound
    formats = set(quantized_modules(llm).values())
    assert formats == ({"q8_0"} if name.endswith("q8_0") else set())


def test_gguf_xlmr_reranker_equals_cross_encoder(files):
    """The cross-encoder's file scores each (query, document) as CrossEncoder.predict
    does on the folder (its dense-tanh-out_proj head over <s>, the sigmoid of one
    label), in the same order."""
    from sentence_transformers import CrossEncoder

    folder, path = files["ce"]
    expected = CrossEncoder(folder, device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    llm = LLM(path, dtype="float32")
    assert (
        llm.llm_engine.model_config.architecture
        == {
            "xlm-roberta": "XLMRobertaForSequenceClassification",
            "roberta": "RobertaForSequenceClassification",
        }[files["kind"]]
    )
    got = np.asarray([o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)])
    assert np.abs(got - expected).max() < 1e-5, (got, expected)
    assert list(np.argsort(got)) == list(np.argsort(expected))


def test_gguf_classifier_heads_it_cannot_compute_are_refused(tmp_path):
    """A BERT cross-encoder's file has no pooler (the converter drops it): refused by
    name, not scored wrong."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
        folder = make_encoder(str(tmp_path / "bert-ce"), "bert", num_labels=1)
        path = write_bert_gguf(str(tmp_path / "bert-ce.gguf"), folder)
        with pytest.raises(ValueError, match="pooler"):
            EngineArgs(path).create_model_config()


def test_xlmr_folders_stop_where_their_positions_do(files):
    """max_position_embeddings 130 with padding id 1: 128 positions for tokens. A
    128-token input embeds; one more is refused by name, and the engine serves on."""
    folder, _ = files["st"]
    llm = LLM(folder, dtype="float32")
    assert llm.llm_engine.model_config.max_model_len == 128
    ids = [0] + [10] * 126 + [2]
    assert len(llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="prompt"):
        llm.embed([{"prompt_token_ids": ids + [10]}], use_tqdm=False)
    assert llm.embed(["still here"], use_tqdm=False)[0].outputs.embedding
