"""Incremental detokenization never splits a multi-byte UTF-8 character."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagoda.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["你好，世界！今天天气很好。", "emoji 😀🎉👍🏽 and 🇫🇷 flags", "mixed: café naïve 日本語 ok"]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_whole_characters(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # byte-level pieces: many characters span tokens
    detok = IncrementalDetokenizer(
        tokenizer, tokenizer.encode("Hi", add_special_tokens=False), True, [], False
    )
    deltas = []
    for i, token_id in enumerate(ids):
        before = detok.output_text
        detok.add_tokens([token_id], last=i == len(ids) - 1)
        deltas.append(detok.output_text[len(before) :])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == tokenizer.decode(ids)


def test_stop_string_inside_multibyte_text(tokenizer):
    ids = tokenizer.encode("你好，世界！", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], True, ["世界"], False)
    hit = None
    for token_id in ids:
        hit = hit or detok.add_tokens([token_id])
    assert hit == "世界" and detok.output_text == "你好，"


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("Hello", add_special_tokens=False) + [tokenizer.eos_token_id]
    for skip, expected in ((True, "Hello"), (False, "Hello</s>")):
        detok = IncrementalDetokenizer(tokenizer, [], skip, [], False)
        for t in ids:
            detok.add_tokens([t])
        assert detok.output_text == expected
