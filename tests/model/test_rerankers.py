"""Decoder classifiers and rerankers against transformers on the same weights: a
*ForSequenceClassification decoder (its `score` head on the last token; Qwen3-Reranker's
seq-cls form), and a causal LM read by two tokens' logits through `hf_overrides`
(Qwen3-Reranker as its card serves it with vLLM), beside generation requests."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from pagoda import LLM, PoolingParams, SamplingParams
from tests.helpers import ENCODER_TEXTS, finish_all, make_model, tiny_prompts

QUERY = "the quick brown fox"
DOCUMENTS = ENCODER_TEXTS[1:] + ["a fox jumps over the dog"]


def save_classifier(causal: str, folder: str, cls_name: str, num_labels: int) -> str:
    """The causal LM's body under a random classifier head of `num_labels`, saved as
    transformers' `cls_name` (with its tokenizer)."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(causal, num_labels=num_labels)
    config.pad_token_id = config.eos_token_id
    torch.manual_seed(1)
    model = getattr(transformers, cls_name).from_pretrained(causal, config=config)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)  # scores spread over (0, 1): rankings differ
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(causal).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerankers")
    qwen3 = make_model(str(root / "qwen3"), "qwen3")
    llama = make_model(str(root / "llama"), "llama")
    return {
        "qwen3": qwen3,
        "qwen3-seq-cls": save_classifier(
            qwen3, str(root / "q3cls"), "Qwen3ForSequenceClassification", 1
        ),
        "llama-3-labels": save_classifier(
            llama, str(root / "l3"), "LlamaForSequenceClassification", 3
        ),
    }


def hf_logits(folder: str, cls_name: str, pairs) -> torch.Tensor:
    """transformers' logits of each (text_1, text_2) pair, tokenized as a pair, alone."""
    import transformers
    from transformers import AutoTokenizer

    model = getattr(transformers, cls_name).from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.inference_mode():
        return torch.stack(
            [model(torch.tensor([tok(a, b)["input_ids"]])).logits[0, -1] if cls_name.endswith("CausalLM")
             else model(torch.tensor([tok(a, b)["input_ids"]])).logits[0]
             for a, b in pairs]
        )  # fmt: skip


def test_sequence_classification_decoder_scores_as_transformers(folders):
    """Qwen3ForSequenceClassification with one label: a pair's score is the sigmoid of
    the last token's logit, as transformers computes it (and so CrossEncoder)."""
    folder = folders["qwen3-seq-cls"]
    llm = LLM(folder, dtype="float32")
    assert llm.llm_engine.model_config.tasks == {"classify", "score"}
    pairs = [(QUERY, d) for d in DOCUMENTS]
    expected = torch.sigmoid(hf_logits(folder, "Qwen3ForSequenceClassification", pairs)[:, 0])
    got = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-6)
    assert np.argsort(got).tolist() == np.argsort(expected.numpy()).tolist()
    assert len(set(np.round(got, 3))) > 2  # the head spreads them: the ranking means something


def test_sequence_classification_decoder_classifies_as_transformers(folders):
    folder = folders["llama-3-labels"]
    llm = LLM(folder, dtype="float32")
    got = [o.outputs.probs for o in llm.classify(ENCODER_TEXTS, use_tqdm=False)]
    import transformers
    from transformers import AutoTokenizer

    hf = transformers.LlamaForSequenceClassification.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.inference_mode():
        expected = [
            hf(**tok(t, return_tensors="pt")).logits[0].softmax(-1).numpy() for t in ENCODER_TEXTS
        ]
    np.testing.assert_allclose(got, expected, atol=1e-5)  # (float32 sums in another order)


def test_causal_lm_reranker_by_two_tokens_logits(folders):
    """Qwen3-Reranker served as its card serves it with vLLM: the causal LM, with
    hf_overrides naming Qwen3ForSequenceClassification and classifier_from_token
    [no, yes]; a pair's score is softmax([logit(no), logit(yes)])[yes] at its last
    token, as the card computes it with transformers. Beside generation requests on
    another engine of the same weights, which it does not change."""
    folder = folders["qwen3"]
    llm = LLM(folder, dtype="float32")
    vocab = llm.get_tokenizer().convert_ids_to_tokens(list(range(100, 102)))
    no, yes = vocab
    reranker = LLM(
        folder,
        dtype="float32",
        hf_overrides={
            "architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": [no, yes],
            "is_original_qwen3_reranker": True,
        },
    )
    pairs = [(QUERY, d) for d in DOCUMENTS]
    logits = hf_logits(folder, "Qwen3ForCausalLM", pairs)[:, [100, 101]]
    expected = logits.softmax(-1)[:, 1].numpy()
    got = [o.outputs.score for o in reranker.score(QUERY, DOCUMENTS, use_tqdm=False)]
    np.testing.assert_allclose(got, expected, atol=1e-6)
    probs = [o.outputs.probs for o in reranker.classify(DOCUMENTS, use_tqdm=False)]
    assert np.allclose(np.sum(probs, 1), 1) and len(probs[0]) == 2
    # The generation engine on the same folder is untouched by the overrides.
    prompts = tiny_prompts(llm.get_tokenizer(), n=2, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    assert all(o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False))  # fmt: skip


def test_reranker_requests_batch_with_each_other_and_free_their_blocks(folders):
    """Scores of pairs added together, stepped as one batch, equal each scored alone."""
    llm = LLM(folders["qwen3-seq-cls"], dtype="float32", kv_cache_memory_bytes=1 << 24)
    alone = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    engine = llm.llm_engine
    for i, d in enumerate(DOCUMENTS):
        engine.add_request(f"s{i}", {"text_1": QUERY, "text_2": d}, PoolingParams(task="score"))
    finals = finish_all(engine)
    got = [float(finals[f"s{i}"].outputs.data[0]) for i in range(len(DOCUMENTS))]
    np.testing.assert_allclose(got, alone, atol=1e-6)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0 and not engine.scheduler.requests


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"architectures": ["Qwen3ForSequenceClassification"],
          "classifier_from_token": ["no-such-token-anywhere"]}, "classifier_from_token"),
        ({"architectures": ["Qwen3ForSequenceClassification"],
          "classifier_from_token": "yes"}, "classifier_from_token"),
        ({"architectures": ["Qwen3ForSequenceClassification"]}, "score.weight"),
        (["not", "a", "dict"], "hf_overrides"),
    ],
)  # fmt: skip
def test_bad_overrides_are_refused_by_name(folders, overrides, match):
    with pytest.raises(ValueError, match=match):
        LLM(folders["qwen3"], dtype="float32", hf_overrides=overrides)


# Qwen3-Reranker's prompt, from its model card (llama.cpp's converter stores it as the
# file's "rerank" template).
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant "
    "passages that answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


@pytest.mark.parametrize("qtype, atol", [(None, 1e-5), ("Q8_0", 2e-2)])
def test_qwen3_reranker_gguf_scores_as_the_card(folders, tmp_path, qtype, atol):
    """A Qwen3-Reranker GGUF file as llama.cpp's converter writes it (the LM head cut to
    the rows of "yes" and "no", the pair filled into the file's rerank template): a
    pair's score is P("yes") of the causal LM on the filled template, softmax over the
    two tokens' logits, as the model card computes it with transformers."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from tests.gguf_writer import write_gguf

    folder, yes, no = folders["qwen3"], 100, 101
    path = write_gguf(str(tmp_path / "r.gguf"), folder, qtype, reranker=(yes, no, RERANK_TEMPLATE))
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=1 << 24)
    assert llm.llm_engine.model_config.tasks == {"classify", "score"}
    got = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]

    model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    texts = [RERANK_TEMPLATE.replace("{query}", QUERY).replace("{document}", d) for d in DOCUMENTS]
    with torch.inference_mode():
        logits = torch.stack([model(**tok(t, return_tensors="pt")).logits[0, -1] for t in texts])
    expected = logits[:, [yes, no]].softmax(-1)[:, 0].numpy()
    assert expected.std() > 0.01  # the documents score apart
    np.testing.assert_allclose(got, expected, atol=atol)
    if qtype is None:
        assert np.argsort(got).tolist() == np.argsort(expected).tolist()
    probs = [o.outputs.probs for o in llm.classify(DOCUMENTS[:2], use_tqdm=False)]
    assert np.allclose(np.sum(probs, 1), 1) and len(probs[0]) == 2
    if qtype is None:
        check_truncation(llm, model, tok, yes, no)


def check_truncation(llm, model, tok, yes, no) -> None:
    """truncate_prompt_tokens on a templated pair cuts the document's last tokens, then
    the query's, never the template's (whose end the score is read at): the scored ids
    are the filled template's with those tokens gone, and score as transformers scores
    them; a limit below the template's own tokens is refused by name, with the least."""
    query, doc = "fox " * 6, "the quick brown fox jumps over the lazy dog " * 3
    full = tok(RERANK_TEMPLATE.replace("{query}", query).replace("{document}", doc))["input_ids"]
    before, after = RERANK_TEMPLATE.split("{document}")
    suffix = tok(after)["input_ids"]  # (it starts at a special token: alike alone or whole)
    assert full[-len(suffix) :] == suffix

    def scored(limit: int) -> list[int]:
        (out,) = llm.score(query, [doc], truncate_prompt_tokens=limit, use_tqdm=False)
        ids = out.prompt_token_ids
        assert len(ids) == limit and ids[-len(suffix) :] == suffix
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1]
        assert abs(out.outputs.score - logits[[yes, no]].softmax(-1)[0].item()) < 1e-5
        return ids

    assert scored(len(full) - 7) == full[: -len(suffix) - 7] + suffix  # the document's end
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens.*at least \d+") as refused:
        llm.score(query, [doc], truncate_prompt_tokens=10, use_tqdm=False)
    least = int(re.search(r"at least (\d+)", str(refused.value)).group(1))
    assert least <= len(full) - 30  # the document's 27 words and the query's 6 go first
    with pytest.raises(ValueError, match=f"at least {least}"):
        llm.score(query, [doc], truncate_prompt_tokens=least - 1, use_tqdm=False)
    head = tok(before.split("{query}")[0])["input_ids"]  # (its last, " ", joins the query's)
    assert scored(least)[: len(head) - 1] == head[:-1]
    assert llm.score(query, [doc], use_tqdm=False)[0].prompt_token_ids == full  # serves on


def test_a_decoder_gguf_with_another_classifier_head_is_refused(tmp_path):
    """llama.cpp reads cls.output of a decoder as Qwen3-Reranker's yes/no rows alone;
    any other decoder with such a head is refused by name, not served as a causal LM."""
    from tests.gguf_writer import write_gguf

    path = write_gguf(str(tmp_path / "l.gguf"), make_model(str(tmp_path / "llama"), "llama"),
                      reranker=(100, 101, RERANK_TEMPLATE))  # fmt: skip
    with pytest.raises(ValueError, match=r"llama with a classifier head \(cls.output\)"):
        LLM(path, dtype="float32")
