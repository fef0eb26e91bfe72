"""GGUF files of BERT embedding models as llama.cpp's converter writes them (all-MiniLM,
bge, e5, ...; `general.architecture` bert; nomic-embed-text: nomic-bert), and of XLM-R
and RoBERTa ones (bge-m3, multilingual-e5, all-distilroberta; the bge-reranker and
RoBERTa cross-encoders, their head as cls and cls.output): their config from llama.cpp's
keys, their tensors under BertModel's (NomicBertModel's) names. BERT's tensors are
written one to one, norms and biases in F32, the position and token-type tables always
F32, the other matrices in the file's type (quantized blocks kept as blocks, as
gguf_loader keeps a decoder's). The vocabulary's respelling is undone in
gguf_tokenizer.py."""

from __future__ import annotations

from typing import Any

_BERT_TOP = {
    "token_embd": "embeddings.word_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
    "cls": "classifier.dense",
    "cls.output": "classifier.out_proj",
}
_BERT_LAYER = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
# Nomic BERT: no position table (rotary), q/k/v fused, a gated MLP; pagoda's module names.
_NOMIC_TOP = {k: v for k, v in _BERT_TOP.items() if not k.startswith(("position_embd", "cls"))}
_NOMIC_LAYER = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_output_norm": "post_attention_layernorm",
    "ffn_up": "mlp.up_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_down": "mlp.down_proj",
    "layer_output_norm": "post_mlp_layernorm",
}
# llama.cpp's pooling_type -> pagoda's pooling method. 0 (none: per-token states) and an
# absent key leave the family's default, the [CLS] token; 4 (rank) is a classifier's.
_POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}
_RANK = 4
# A BERT-architecture file's vocabulary -> the RoBERTa it came from (class prefix, model_type).
_ROBERTAS = {"t5": ("XLMRoberta", "xlm-roberta"), "gpt2": ("Roberta", "roberta")}


def bert_config(meta) -> dict[str, Any]:
    """A BERT (or Nomic BERT) embedding model's config from llama.cpp's keys; the table
    sizes from the tables themselves (GGUF shapes list the row length first)."""
    nomic = meta.arch == "nomic-bert"
    where = f"GGUF {meta.arch} file"
    vocab_kind = meta.fields.get("tokenizer.ggml.model")
    if vocab_kind not in ("bert", "t5", "gpt2") or (nomic and vocab_kind != "bert"):
        raise ValueError(
            f"{where}: tokenizer.ggml.model {vocab_kind!r} is not supported; BERT's WordPiece "
            "('bert'), XLM-R's SentencePiece Unigram ('t5') and RoBERTa's byte-level BPE "
            "('gpt2') are."
        )
    if meta.get("attention.causal", False):
        raise ValueError(f"{where}: {meta.arch}.attention.causal is true; BERT attends both ways.")  # fmt: skip
    if "blk.0.attn_qkv.weight" in meta.tensors and not nomic:
        raise ValueError(f"{where}: a fused attn_qkv is not supported (attn_q/k/v are).")
    pooling = int(meta.get("pooling_type", 0))
    head = {"cls.weight", "cls.output.weight"} & set(meta.tensors)  # a cross-encoder's
    if pooling not in (0, *_POOLING_TYPES) and not (pooling == _RANK and head):
        raise ValueError(
            f"{where}: {meta.arch}.pooling_type {pooling} is not supported (1 mean, 2 cls, 3 "
            "last; 4, rank, with a classifier: cls and cls.output)."
        )
    if head and (len(head) < 2 or vocab_kind == "bert"):
        raise ValueError(
            f"{where}: a classifier is read as (XLM-)RoBERTa's (a 't5' or 'gpt2' vocabulary, "
            "cls the dense layer before tanh and cls.output); llama.cpp's converter drops a "
            "BertForSequenceClassification's pooler (its cls), so such a file cannot score "
            "as the model does (its Hugging Face folder can)."
        )

    def rows(name: str, default: int) -> int:
        t = meta.tensors.get(name)
        return default if t is None else int(t.shape[-1])

    config = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "hidden_size": int(meta.get("embedding_length")),
        "intermediate_size": int(meta.get("feed_forward_length")),
        "num_hidden_layers": int(meta.get("block_count")),
        "num_attention_heads": int(meta.get("attention.head_count")),
        "layer_norm_eps": float(meta.get("attention.layer_norm_epsilon", 1e-12)),
        "hidden_act": "gelu",  # (not written: BERT's, and the BERT family's embedders')
        "vocab_size": rows("token_embd.weight", 0),
        "max_position_embeddings": rows(
            "position_embd.weight", int(meta.get("context_length", 512))
        ),
        "type_vocab_size": rows(
            "token_types.weight", int(meta.fields.get("tokenizer.ggml.token_type_count", 2))
        ),
        "pad_token_id": meta.fields.get("tokenizer.ggml.padding_token_id", 0),
    }
    if nomic:  # rotary positions, SwiGLU
        config.update(
            architectures=["NomicBertModel"],
            model_type="nomic_bert",
            hidden_act="silu",
            max_position_embeddings=int(meta.get("context_length", 2048)),
            rope_parameters={"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 1000.0))},
        )  # fmt: skip
    if vocab_kind in _ROBERTAS:  # its position table was cut to start at 0
        kind, model_type = _ROBERTAS[vocab_kind]
        config.update(architectures=[f"{kind}Model"], model_type=model_type, position_offset=0)
    if head:  # (XLM-)RoBERTa's: cls is its dense layer, cls.output its out_proj
        config["architectures"] = [f"{_ROBERTAS[vocab_kind][0]}ForSequenceClassification"]
        config["num_labels"] = rows("cls.output.weight", 1)
        labels = meta.get("classifier.output_labels")
        if labels and len(labels) == config["num_labels"]:
            config["id2label"] = dict(enumerate(labels))
    if pooling in _POOLING_TYPES:
        config["pooling_method"] = _POOLING_TYPES[pooling]
    return config


def bert_name(name: str, nomic: bool = False) -> str | None:
    """BertModel's (with `nomic`, NomicBertModel's) name for a tensor of llama.cpp's
    BERT, or None (not an encoder's)."""
    stem, _, suffix = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        mapped = (_NOMIC_LAYER if nomic else _BERT_LAYER).get(part)
        layers = "layers" if nomic else "encoder.layer"
        return f"{layers}.{layer}.{mapped}.{suffix}" if mapped else None
    mapped = (_NOMIC_TOP if nomic else _BERT_TOP).get(stem)
    return f"{mapped}.{suffix}" if mapped else None
