"""Incremental detokenization: whole characters only, stop strings cut across tokens,
text that may begin a stop string held back until it cannot, O(1) state per step."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagoda.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["你好，世界！今天天气很好。", "emoji 😀🎉👍🏽 and 🇫🇷 flags", "mixed: café naïve 日本語 ok"]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def stream(detok: IncrementalDetokenizer, ids: list[int], last: bool = True):
    """Feed ids one at a time; returns (released pieces, stop string or None)."""
    pieces, stop = [], None
    for i, token_id in enumerate(ids):
        text, stop = detok.add_tokens([token_id], last=last and i == len(ids) - 1)
        pieces.append(text)
        if stop is not None:
            break
    return pieces, stop


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_whole_characters(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # byte-level pieces: many characters span tokens
    detok = IncrementalDetokenizer(
        tokenizer, tokenizer.encode("Hi", add_special_tokens=False), True, [], False
    )
    pieces, stop = stream(detok, ids)
    assert stop is None
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == tokenizer.decode(ids)
    assert len(detok.token_ids) <= 8  # a window, not the whole output


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_inside_multibyte_text(tokenizer, include):
    ids = tokenizer.encode("你好，世界！", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], True, ["世界"], include)
    pieces, stop = stream(detok, ids)
    assert stop == "世界"
    assert "".join(pieces) == ("你好，世界" if include else "你好，")
    assert detok.add_tokens(ids[-1:]) == ("", None)  # nothing after a stop


def test_text_that_may_begin_a_stop_string_is_held_back(tokenizer):
    """With stop "fox jumps", the tail that could still grow into it is never released
    early, so a streaming client never sees text that is later cut."""
    ids = tokenizer.encode("The quick brown fox jumps over", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], True, ["fox jumps", "zzz"], False)
    released = ""
    for token_id in ids:
        text, stop = detok.add_tokens([token_id])
        released += text
        assert "fox" not in released
        if stop:
            break
    assert stop == "fox jumps" and released == "The quick brown "
    # Without a match, the held-back tail comes out when the completion ends.
    detok = IncrementalDetokenizer(tokenizer, [], True, ["fox jumps!"], False)
    pieces, stop = stream(detok, ids, last=False)
    assert stop is None and "".join(pieces) + detok.flush() == "The quick brown fox jumps over"


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("Hello", add_special_tokens=False) + [tokenizer.eos_token_id]
    for skip, expected in ((True, "Hello"), (False, "Hello</s>")):
        detok = IncrementalDetokenizer(tokenizer, [], skip, [], False)
        assert "".join(stream(detok, ids)[0]) == expected
