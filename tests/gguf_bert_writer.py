"""GGUF files of tiny encoder folders, written with the `gguf` package the way llama.cpp's
convert_hf_to_gguf.py does (its conversion/bert.py): BERT embedding models and
cross-encoders as BertModel writes them (the WordPiece vocabulary respelled as a "bert"
one; the pooler dropped), Nomic BERT as its subclass does, XLM-R as XLMRobertaModel does
(SentencePiece's Unigram as a "t5" vocabulary with its precompiled map, the position
table cut to start after the padding id, the classifier head as cls and cls.output),
RoBERTa as RobertaModel does (the same, its byte-level BPE as a "gpt2" vocabulary with
its merges).
"""

from __future__ import annotations

import base64
import json
import os

import numpy as np

_POOLING_TYPES = {"mean": 1, "mean_tokens": 1, "cls": 2, "cls_token": 2, "lasttoken": 3}


def _bert_pooling(folder: str) -> int | None:
    """llama.cpp's pooling_type from a sentence-transformers folder's Pooling module (its
    mode as sentence-transformers 5+ writes it, or the older flags), None without one."""
    modules = os.path.join(folder, "modules.json")
    if not os.path.isfile(modules):
        return None
    with open(modules) as f:
        paths = [m["path"] for m in json.load(f) if m["type"].endswith("Pooling")]
    if not paths:
        return None
    with open(os.path.join(folder, paths[0], "config.json")) as f:
        config = json.load(f)
    mode = config.get("pooling_mode") or next(
        k.removeprefix("pooling_mode_") for k, on in config.items() if k.startswith("pooling_mode_") and on
    )  # fmt: skip
    return _POOLING_TYPES[mode]


def _bert_vocab(writer, folder: str, type_vocab_size: int) -> int:
    """The WordPiece vocabulary as BertModel.set_vocab writes it: control tokens (the
    special ones) as they are, every other token respelled for llama.cpp's phantom-space
    matcher ("##" continuations lose their "##", word starts gain "▁"); the special
    ids by the gguf package's SpecialVocab, as the converter sets them."""
    from gguf import SpecialVocab, TokenType

    with open(os.path.join(folder, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = dict(tok["model"]["vocab"])
    kinds = {}
    for t in tok["added_tokens"]:
        vocab[t["content"]] = t["id"]
        kinds[t["id"]] = TokenType.CONTROL if t.get("special") else TokenType.USER_DEFINED
    tokens = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    types = [kinds.get(i, TokenType.NORMAL) for i in range(len(tokens))]
    spelled = [
        t if kind == TokenType.CONTROL else (t[2:] if t.startswith("##") else "\u2581" + t)
        for t, kind in zip(tokens, types, strict=True)
    ]
    writer.add_token_type_count(type_vocab_size)
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(spelled)
    writer.add_token_types(types)
    SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    return len(tokens)


def _xlmr_vocab(writer, folder: str, type_vocab_size: int, vocab_size: int) -> None:
    """XLM-R's SentencePiece vocabulary as _xlmroberta_set_vocab writes it from a
    tokenizer.json: each id's piece and score, the unknown token UNKNOWN, the special
    ones CONTROL, ids past the tokenizer's up to the embedding's "[PAD<i>]" (UNUSED,
    score -10000); the precompiled map, add_space_prefix, the special ids."""
    from gguf import SpecialVocab, TokenType

    with open(os.path.join(folder, "tokenizer.json")) as f:
        tok = json.load(f)
    pieces = tok["model"]["vocab"]
    special = {t["id"] for t in tok["added_tokens"] if t.get("special")}
    tokens = [f"[PAD{i}]" for i in range(max(vocab_size, len(pieces)))]
    scores, types = [-10000.0] * len(tokens), [TokenType.UNUSED] * len(tokens)
    for i, (piece, score) in enumerate(pieces):
        tokens[i], scores[i] = piece, score
        types[i] = (TokenType.UNKNOWN if i == tok["model"]["unk_id"]
                    else TokenType.CONTROL if i in special else TokenType.NORMAL)  # fmt: skip
    writer.add_tokenizer_model("t5")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(True)
    writer.add_token_type_count(type_vocab_size)
    writer.add_remove_extra_whitespaces(False)
    writer.add_precompiled_charsmap(base64.b64decode(tok["normalizer"]["precompiled_charsmap"]))
    SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def _gpt2_vocab(writer, folder: str, type_vocab_size: int, vocab_size: int) -> None:
    """RoBERTa's byte-level BPE as _set_vocab_gpt2 writes it (get_vocab_base): each id's
    token as the tokenizer spells it, the special ones CONTROL, other added ones
    USER_DEFINED, ids it lacks "[PAD<i>]" (UNUSED); the merges and special ids by
    SpecialVocab; the pre-tokenizer's name as the converter's hash finds RoBERTa's."""
    from gguf import SpecialVocab, TokenType
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [TokenType.UNUSED if i not in by_id
             else (TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED) if i in added
             else TokenType.NORMAL for i in range(vocab_size)]  # fmt: skip
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("roberta-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    SpecialVocab(folder, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)
    writer.add_token_type_count(type_vocab_size)


def write_bert_vocab_gguf(path: str, folder: str) -> str:
    """Only a BERT tokenizer folder's vocabulary (the converter's --vocab-only)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(path, "bert")
    _bert_vocab(writer, folder, 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def write_bert_gguf(
    path: str, folder: str, qtype: str | None = None, pooling: int | None = None
) -> str:
    """A BERT folder (plain or sentence-transformers) as llama.cpp's converter writes it:
    general.architecture "bert", its keys (causal attention off, the Pooling module's
    pooling_type, or `pooling`), tensors under gguf-py's BERT names (its TensorNameMap,
    as the converter maps them; no pooler), 1-D tensors, norms, the position and
    token-type tables in F32, the other matrices in `qtype` ("F16", or a GGUF block
    type such as "Q8_0"). An XLM-R or RoBERTa folder (or its cross-encoder) as
    XLMRobertaModel or RobertaModel writes it (see the module's doc); a BERT cross-encoder without its pooler, its
    classifier as cls.output. A Nomic BERT folder in Nomic's original spelling (see
    nomic_folder(..., "original"); the converter reads that one) as "nomic-bert": n_ctx 2048
    and the rotary base added, q/k/v fused as Wqkv is."""
    from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
    from gguf.quants import quantize
    from safetensors.torch import load_file

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    nomic = "n_embd" in cfg
    if nomic:
        cfg = {"max_position_embeddings": 2048, "hidden_size": cfg["n_embd"],
               "intermediate_size": cfg["n_inner"], "num_hidden_layers": cfg["n_layer"],
               "num_attention_heads": cfg["n_head"], "layer_norm_eps": cfg["layer_norm_epsilon"],
               "type_vocab_size": cfg["type_vocab_size"], "rope_theta": cfg["rotary_emb_base"]}  # fmt: skip
    weights = load_file(os.path.join(folder, "model.safetensors"))
    writer = GGUFWriter(path, "nomic-bert" if nomic else "bert")
    # (XLM-)RoBERTa: positions start after the padding id's row; the table is cut to start there.
    xlmr, roberta = cfg.get("model_type") == "xlm-roberta", cfg.get("model_type") == "roberta"
    cut = cfg["pad_token_id"] + 1 if xlmr or roberta else 0
    writer.add_context_length(cfg["max_position_embeddings"] - cut)
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_layer_norm_eps(cfg["layer_norm_eps"])
    writer.add_causal_attention(False)
    if nomic:
        writer.add_rope_freq_base(cfg["rope_theta"])
    pooling = _bert_pooling(folder) if pooling is None else pooling
    if pooling is not None:
        writer.add_uint32(f"{writer.arch}.pooling_type", pooling)
    labels = [v for _, v in sorted((cfg.get("id2label") or {}).items())]
    if labels == ["LABEL_0", "LABEL_1"]:
        labels = []  # (AutoConfig's stand-ins: the converter drops them)
    if labels:
        writer.add_classifier_output_labels(labels)
    if xlmr:
        _xlmr_vocab(writer, folder, cfg.get("type_vocab_size", 1), cfg["vocab_size"])
    elif roberta:
        _gpt2_vocab(writer, folder, cfg.get("type_vocab_size", 1), cfg["vocab_size"])
    else:
        _bert_vocab(writer, folder, cfg.get("type_vocab_size", 1))
    arch = MODEL_ARCH.NOMIC_BERT if nomic else MODEL_ARCH.BERT
    names = get_tensor_name_map(arch, cfg["num_hidden_layers"])
    for hf_name, tensor in weights.items():
        hf_name = hf_name.removeprefix("bert.").removeprefix("roberta.")
        if hf_name.startswith("pooler.") or hf_name.endswith("position_ids"):
            continue  # (a BERT cross-encoder's pooler too: the converter drops it)
        if labels and hf_name in ("classifier.weight", "classifier.bias"):  # BERT's one layer
            hf_name = hf_name.replace("classifier.", "classifier.out_proj.")
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        x = np.ascontiguousarray(tensor.float().numpy())
        if name == "position_embd.weight":
            x = x[cut:]
        f32 = (
            x.ndim < 2
            or name.endswith("_norm.weight")
            or name.startswith(("position_embd.", "token_types."))
        )
        if qtype is None or f32:
            writer.add_tensor(name, x)
        elif qtype == "F16" or x.shape[-1] % 32:  # (rows that fit no block: F16)
            writer.add_tensor(name, x.astype(np.float16))
        else:
            t = GGMLQuantizationType[qtype]
            writer.add_tensor(name, quantize(x, t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# transformers' NomicBertModel names -> Nomic's original ones (transformers'
# conversion_mapping for nomic_bert, backwards); q/k/v are joined into Wqkv.
_NOMIC_ORIGINAL = (
    ("layers.", "encoder.layers."),
    ("embeddings.LayerNorm.", "emb_ln."),
    ("self_attn.o_proj.", "attn.out_proj."),
    ("mlp.up_proj.", "mlp.fc11."),
    ("mlp.gate_proj.", "mlp.fc12."),
    ("mlp.down_proj.", "mlp.fc2."),
    ("post_attention_layernorm.", "norm1."),
    ("post_mlp_layernorm.", "norm2."),
)


def nomic_folder(folder: str, out: str, spelling: str) -> str:
    """A copy of a Nomic BERT folder (sentence-transformers modules and all) with its
    weights spelled `spelling`: "original", Nomic's as the Hub's nomic-embed-text holds
    them (GPT-2's config names and its settings, Wqkv, fc11/fc12/fc2, norm1/norm2,
    emb_ln; what transformers 5 itself saves, but with its config in transformers'
    names), or "transformers", NomicBertModel's module names (q/k/v_proj, ...)."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModel

    weights = dict(AutoModel.from_pretrained(folder).state_dict())  # (transformers' names)
    shutil.copytree(folder, out)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    if spelling == "original":
        cfg = {
            "architectures": ["NomicBertModel"], "model_type": "nomic_bert",
            "auto_map": {"AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
            "n_embd": cfg["hidden_size"], "n_layer": cfg["num_hidden_layers"],
            "n_head": cfg["num_attention_heads"], "n_inner": cfg["intermediate_size"],
            "n_positions": 8192, "max_trained_positions": 2048,  # (v1.5's, as llama.cpp expects)
            "layer_norm_epsilon": cfg["layer_norm_eps"],
            "rotary_emb_base": cfg["rope_parameters"]["rope_theta"], "vocab_size": cfg["vocab_size"],
            "type_vocab_size": cfg["type_vocab_size"], "pad_token_id": cfg.get("pad_token_id"),
            "activation_function": "swiglu", "prenorm": False, "causal": False,
            "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "rotary_emb_scale_base": None,
            "rotary_scaling_factor": None, "qkv_proj_bias": False, "mlp_fc1_bias": False,
            "mlp_fc2_bias": False, "use_rms_norm": False, "parallel_block": False,
        }  # fmt: skip
        renamed, qkv = {}, {}
        for name, w in weights.items():
            for new, old in _NOMIC_ORIGINAL:  # (whole fragments: "layers." at a dot)
                if name.startswith(new) or f".{new}" in name:
                    name = name.replace(new, old, 1)
            stem, found, part = name.rpartition(".self_attn.")
            if found:
                qkv.setdefault(stem, {})[part.split(".")[0]] = w
            else:
                renamed[name] = w
        for stem, parts in qkv.items():
            renamed[f"{stem}.attn.Wqkv.weight"] = torch.cat([parts[p] for p in ("q_proj", "k_proj", "v_proj")])  # fmt: skip
        weights = renamed
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "model.safetensors"))  # fmt: skip
    return out
