"""Tokenizers that transformers does not build from a GGUF file: BERT's WordPiece as
llama.cpp's converter writes it (`tokenizer.ggml.model == "bert"`), rebuilt as the Hugging
Face tokenizer it came from. Torch-free (the router tokenizes too).

What the converter did to the vocabulary, undone here: every token but the control ones
([CLS], [SEP], [PAD], [UNK], [MASK]) respelled for llama.cpp's "phantom space" matcher,
a word's first piece with "▁" (U+2581) before it and a "##" continuation without its
"##". What it did not keep, inferred: whether the tokenizer lowercases (and strips
accents, which BERT ties to lowercasing): an uncased vocabulary, made from lowercased
text, has no capitals among its ordinary tokens; a cased one has many. (llama.cpp's own
WordPiece always lowercases; Hugging Face's, which the model was trained with, is
followed here.)
"""

from __future__ import annotations

from pagoda.model_executor.gguf_file import GGUFFile

_PHANTOM = "\u2581"
# gguf.TokenType
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
# A vocabulary is cased when at least this share of its ordinary tokens has a capital.
_CASED_SHARE = 0.01


def wordpiece_tokenizer(path: str):
    """The Hugging Face tokenizer of a GGUF file's BERT vocabulary: BertNormalizer
    (lowercasing as inferred), BertPreTokenizer, WordPiece ("##" continuations, the
    file's unknown token), [CLS] A [SEP] and [CLS] A [SEP] B [SEP] (B of token type 1)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    fields = GGUFFile(path).fields

    def field(key: str):
        return fields.get(f"tokenizer.ggml.{key}")

    tokens, kinds = list(field("tokens") or ()), list(field("token_type") or ())
    if not tokens or len(kinds) != len(tokens):
        raise ValueError("the GGUF file's BERT vocabulary has no tokens or token types.")
    names = [  # each id's token as the Hugging Face vocabulary spells it
        t if kind == _CONTROL else (t[1:] if t.startswith(_PHANTOM) else "##" + t)
        for t, kind in zip(tokens, kinds, strict=True)
    ]
    vocab: dict[str, int] = {}
    for i, name in enumerate(names):
        vocab.setdefault(name, i)
    words = [t for t, kind in zip(tokens, kinds, strict=True) if kind == _NORMAL]
    cased = sum(w != w.lower() for w in words) >= _CASED_SHARE * max(len(words), 1)

    def special(key: str, fallback: str | None = None) -> int | None:
        i = field(f"{key}_token_id")
        if i is None and fallback is not None:
            i = field(f"{fallback}_token_id")
        return int(i) if i is not None and 0 <= int(i) < len(tokens) else None

    unk_id = special("unknown")
    unk_id = vocab.get("[UNK]") if unk_id is None else unk_id
    cls_id, sep_id = special("cls", "bos"), special("seperator", "eos")  # (gguf's spelling)
    if unk_id is None or cls_id is None or sep_id is None:
        raise ValueError(
            "the GGUF file's BERT vocabulary names no unknown, [CLS] or [SEP] token "
            "(tokenizer.ggml.unknown_token_id, cls_token_id, seperator_token_id)."
        )
    unk, cls, sep = names[unk_id], names[cls_id], names[sep_id]
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=not cased
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=[cls, "$A", sep],
        pair=[cls, "$A", sep, "$B:1", f"{sep}:1"],
        special_tokens=[(cls, cls_id), (sep, sep_id)],
    )
    tok.decoder = decoders.WordPiece(prefix="##")
    pairs = list(zip(tokens, kinds, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in pairs if k == _CONTROL]
    )
    # Tokens added to the original's vocabulary: whole words, never split.
    tok.add_tokens([AddedToken(t.removeprefix(_PHANTOM)) for t, k in pairs if k == _USER_DEFINED])
    named = {"unk_token": unk_id, "cls_token": cls_id, "sep_token": sep_id,
             "pad_token": special("padding"), "mask_token": special("mask")}  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        **{k: names[i] for k, i in named.items() if i is not None},
    )
