"""Tokenizers that transformers does not build from a GGUF file: the encoders'
vocabularies as llama.cpp's converter writes them, rebuilt as the Hugging Face
tokenizers they came from. Torch-free (the router tokenizes too).

BERT's WordPiece (`tokenizer.ggml.model == "bert"`): every token but the control ones
([CLS], [SEP], [PAD], [UNK], [MASK]) was respelled for llama.cpp's "phantom space"
matcher, a word's first piece with "▁" (U+2581) before it and a "##" continuation
without its "##"; undone here. What the converter did not keep, inferred: whether the
tokenizer lowercases (and strips accents, which BERT ties to lowercasing): an uncased
vocabulary, made from lowercased text, has no capitals among its ordinary tokens; a
cased one has many. (llama.cpp's own WordPiece always lowercases; Hugging Face's,
which the model was trained with, is followed here.)

XLM-R's SentencePiece Unigram (`"t5"`: bge-m3, multilingual-e5, bge-reranker): the
pieces, their scores and the precompiled normalization map are kept as they were.

RoBERTa's byte-level BPE (`"gpt2"` in a BERT file: all-distilroberta, the RoBERTa
cross-encoders): the tokens (as GPT-2's byte alphabet spells them) and merges are
kept as they were.
"""

from __future__ import annotations

from pagoda.model_executor.gguf_file import GGUFFile

_PHANTOM = "\u2581"
# gguf.TokenType
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
# A vocabulary is cased when at least this share of its ordinary tokens has a capital.
_CASED_SHARE = 0.01


class _Vocabulary:
    """A GGUF file's tokenizer.ggml.* fields, and the Hugging Face tokenizer over them."""

    def __init__(self, path: str, kind: str) -> None:
        self.fields, self.kind = GGUFFile(path).fields, kind
        self.tokens = list(self.field("tokens") or ())
        self.types = list(self.field("token_type") or ())
        if not self.tokens or len(self.types) != len(self.tokens):
            raise ValueError(f"the GGUF file's {kind} vocabulary has no tokens or token types.")

    def field(self, key: str):
        return self.fields.get(f"tokenizer.ggml.{key}")

    def special(self, key: str, fallback: str | None = None) -> int | None:
        i = self.field(f"{key}_token_id")
        if i is None and fallback is not None:
            i = self.field(f"{fallback}_token_id")
        return int(i) if i is not None and 0 <= int(i) < len(self.tokens) else None

    def ends(self, unk_id: int | None) -> tuple[int, int, int]:
        """(unknown, first, separator) ids: [CLS]/<s> from cls or bos, [SEP]/</s> from
        the separator or eos."""
        # ("seperator": the gguf package's spelling)
        cls_id, sep_id = self.special("cls", "bos"), self.special("seperator", "eos")
        if unk_id is None or cls_id is None or sep_id is None:
            raise ValueError(
                f"the GGUF file's {self.kind} vocabulary names no unknown, first or separator "
                "token (tokenizer.ggml.unknown_token_id, cls/bos_token_id, seperator/eos_token_id)."
            )
        return unk_id, cls_id, sep_id

    def tokenizer(self, tok, names: list[str], ids: tuple[int, int, int], pair: str, input_names: list[str]):  # fmt: skip
        """`tok` (a tokenizers.Tokenizer over `names`, each id's token as the original
        spells it) finished: {first} $A {sep} for one text, the template `pair` for two,
        the control tokens special, the user-defined ones whole words."""
        from tokenizers import AddedToken, processors
        from transformers import PreTrainedTokenizerFast

        unk_id, cls_id, sep_id = ids
        first, sep = names[cls_id], names[sep_id]
        tok.post_processor = processors.TemplateProcessing(
            single=[first, "$A", sep],
            pair=pair.replace("{first}", first).replace("{sep}", sep),
            special_tokens=[(first, cls_id), (sep, sep_id)],
        )
        pairs = list(zip(self.tokens, self.types, strict=True))
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, k in pairs if k == _CONTROL]
        )
        # Tokens added to the original's vocabulary: whole words, never split.
        tok.add_tokens(
            [AddedToken(t.removeprefix(_PHANTOM)) for t, k in pairs if k == _USER_DEFINED]
        )
        named = {"unk_token": unk_id, "cls_token": cls_id, "sep_token": sep_id,
                 "pad_token": self.special("padding"), "mask_token": self.special("mask")}  # fmt: skip
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            model_input_names=input_names,
            **{k: names[i] for k, i in named.items() if i is not None},
        )


def wordpiece_tokenizer(path: str):
    """The Hugging Face tokenizer of a GGUF file's BERT vocabulary: BertNormalizer
    (lowercasing as inferred), BertPreTokenizer, WordPiece ("##" continuations, the
    file's unknown token), [CLS] A [SEP] and [CLS] A [SEP] B [SEP] (B of token type 1)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    v = _Vocabulary(path, "BERT")
    names = [  # each id's token as the Hugging Face vocabulary spells it
        t if kind == _CONTROL else (t[1:] if t.startswith(_PHANTOM) else "##" + t)
        for t, kind in zip(v.tokens, v.types, strict=True)
    ]
    vocab: dict[str, int] = {}
    for i, name in enumerate(names):
        vocab.setdefault(name, i)
    words = [t for t, kind in zip(v.tokens, v.types, strict=True) if kind == _NORMAL]
    cased = sum(w != w.lower() for w in words) >= _CASED_SHARE * max(len(words), 1)
    unk_id = v.special("unknown")
    ids = v.ends(vocab.get("[UNK]") if unk_id is None else unk_id)
    tok = Tokenizer(models.WordPiece(vocab, unk_token=names[ids[0]], max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=not cased
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    pair = "{first} $A {sep} $B:1 {sep}:1"
    return v.tokenizer(tok, names, ids, pair, ["input_ids", "token_type_ids", "attention_mask"])


def unigram_tokenizer(path: str):
    """The Hugging Face tokenizer of a GGUF file's XLM-R vocabulary, built as
    transformers' XLMRobertaTokenizer builds it: Unigram over the pieces and scores,
    the precompiled normalization map, whitespace split, "▁" before each word (unless
    add_space_prefix is false), <s> A </s> and <s> A </s></s> B </s>."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    v = _Vocabulary(path, "Unigram")
    scores = list(v.field("scores") or ())
    if len(scores) != len(v.tokens):
        raise ValueError("the GGUF file's Unigram vocabulary has no score for each token.")
    ids = v.ends(v.special("unknown"))
    tok = Tokenizer(
        models.Unigram(list(zip(v.tokens, scores, strict=True)), unk_id=ids[0], byte_fallback=False)
    )
    charsmap = v.field("precompiled_charsmap")
    if charsmap:
        tok.normalizer = normalizers.Precompiled(bytes(charsmap))
    prepend = "always" if v.field("add_space_prefix") in (None, True) else "never"
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement=_PHANTOM, prepend_scheme=prepend),
    ])  # fmt: skip
    tok.decoder = decoders.Metaspace(replacement=_PHANTOM, prepend_scheme=prepend)
    pair = "{first} $A {sep} {sep} $B {sep}"
    return v.tokenizer(tok, v.tokens, ids, pair, ["input_ids", "attention_mask"])


def bpe_tokenizer(path: str):
    """The Hugging Face tokenizer of a BERT file's RoBERTa vocabulary, built as
    transformers' RobertaTokenizer builds it: GPT-2's byte-level pre-tokenizer (no
    prefix space) and BPE over the tokens and merges, <s> A </s> and <s> A </s></s> B
    </s>, <mask> taking the space before it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    v = _Vocabulary(path, "BPE")
    merges = [tuple(m.split(" ", 1)) for m in v.field("merges") or ()]
    if not merges:
        raise ValueError("the GGUF file's BPE vocabulary has no merges (tokenizer.ggml.merges).")
    vocab = {t: i for i, t in reversed(list(enumerate(v.tokens)))}  # (a repeat: its first id)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    ids, mask = v.ends(v.special("unknown")), v.special("mask")
    pair = "{first} $A {sep} {sep} $B {sep}"
    fast = v.tokenizer(tok, v.tokens, ids, pair, ["input_ids", "attention_mask"])
    if mask is not None:  # (RobertaTokenizer's: " <mask>" is the mask alone)
        fast.add_special_tokens({"mask_token": AddedToken(v.tokens[mask], lstrip=True, special=True, normalized=False)})  # fmt: skip
    return fast
