"""GGUF files of tiny Hugging Face folders, written with the `gguf` package the way
llama.cpp's convert_hf_to_gguf.py names and lays them out (its conversion/ modules:
llama.py, qwen.py, gemma.py, phi.py, granite.py; keys, tensor names, q/k permutation,
Gemma's +1 norms, Phi-3's fused tensors, F32 norms and biases), with the folder's own
byte-level BPE tokenizer as a "gpt2" vocabulary. What the converter leaves out (Gemma's
query_pre_attn_scalar and window pattern, SmolLM3's NoPE layers) is left out here too.
Encoders (BERT, Nomic BERT, XLM-R): tests/gguf_bert_writer.py.
"""

from __future__ import annotations

import json
import os

import numpy as np

# Hugging Face model_type -> llama.cpp's general.architecture.
GGUF_ARCH = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "granite": "granite",
    "smollm3": "smollm3",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
}
PERMUTED = ("llama", "granite", "smollm3")  # NORM rope: q/k rows interleaved
GEMMA = ("gemma2", "gemma3")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """LlamaModel.permute: each head's rotary halves interleaved into pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def copy_fields(writer, source: str, skip=lambda key: False, replace: dict | None = None):
    """Every metadata field of the GGUF file `source` into `writer`, but its
    architecture and those `skip` names; `replace`: other values for some keys. Read with
    pagoda's reader (the gguf package's takes seconds over a 49,152-token vocabulary);
    scalars written as uint32/int32, float32, bool or string, arrays by their items'
    kind (token types int32, scores float32). Returns the source's fields."""
    from gguf import GGUFValueType as T

    from pagoda.model_executor.gguf_file import GGUFFile

    def kind(value) -> T:
        if isinstance(value, str):
            return T.STRING
        if isinstance(value, bool):
            return T.BOOL
        if isinstance(value, float):
            return T.FLOAT32
        return T.UINT32 if value >= 0 else T.INT32

    fields = GGUFFile(source).fields
    for key, value in fields.items():
        if key == "general.architecture" or skip(key):
            continue
        value = (replace or {}).get(key, value)
        if isinstance(value, list):
            item = kind(value[0]) if value else T.STRING
            writer.add_key_value(key, value, T.ARRAY, T.INT32 if item == T.UINT32 else item)
        else:
            writer.add_key_value(key, value, kind(value))
    return fields


def _tokenizer(writer, folder: str) -> None:
    with open(os.path.join(folder, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"] for t in tok["added_tokens"] if t.get("special")}
    for t in tok["added_tokens"]:
        vocab[t["content"]] = t["id"]
    tokens = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        config = json.load(f)
    ids = {t: i for i, t in enumerate(tokens)}
    writer.add_bos_token_id(ids[config["bos_token"]])
    writer.add_eos_token_id(ids[config["eos_token"]])
    template = config.get("chat_template")
    if template is None and os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        with open(os.path.join(folder, "chat_template.jinja")) as f:
            template = f.read()
    if template:
        writer.add_chat_template(template)


def _keys(writer, arch: str, cfg: dict) -> None:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch == "gemma2":  # Gemma2Model writes its own keys only
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_float32("gemma2.attn_logit_softcapping", cfg["attn_logit_softcapping"])
        writer.add_float32("gemma2.final_logit_softcapping", cfg["final_logit_softcapping"])
        writer.add_sliding_window(cfg["sliding_window"])
        return
    if arch == "phi3":
        original = cfg["original_max_position_embeddings"]
        rot = int(full.get("partial_rotary_factor", 1.0) * hidden) // heads
        writer.add_rope_dimension_count(rot)
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_uint32("phi3.rope.scaling.original_context_length", original)
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
        if full.get("long_factor"):
            scale = cfg["max_position_embeddings"] / original
            factor = 1.0 if scale <= 1 else np.sqrt(1 + np.log(scale) / np.log(original))
            writer.add_float32("phi3.rope.scaling.attn_factor", float(factor))
        return
    writer.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in rope:
        writer.add_float32(f"{arch}.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
    if full.get("rope_type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", full["factor"])
    if cfg.get("head_dim") and arch not in ("granite", "deepseek2"):  # Granite's drops it
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in PERMUTED:
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(head_dim if arch != "granite" else hidden // heads)
    if arch == "gemma3":
        writer.add_sliding_window(cfg["sliding_window"])
        if cfg.get("final_logit_softcapping"):
            writer.add_float32("gemma3.final_logit_softcapping", cfg["final_logit_softcapping"])
    if arch == "granite":
        writer.add_float32("granite.attention.scale", cfg["attention_multiplier"])
        writer.add_float32("granite.embedding_scale", cfg["embedding_multiplier"])
        writer.add_float32("granite.residual_scale", cfg["residual_multiplier"])
        writer.add_float32("granite.logit_scale", cfg["logits_scaling"])
    if arch == "qwen3moe":
        writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "deepseek2":
        _deepseek_keys(writer, cfg)


def _deepseek_keys(writer, cfg: dict) -> None:
    """DeepseekV2Model.set_gguf_parameters: MLA written as one KV head of the latent
    (key_length kv_lora + rope, value_length kv_lora) and its real sizes as *_mla."""
    rope, lora = cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
    a = "deepseek2"
    writer.add_uint32(f"{a}.attention.head_count_kv", 1)  # (the base's was written first)
    writer.add_uint32(f"{a}.leading_dense_block_count", cfg["first_k_dense_replace"])
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank"):
        writer.add_uint32(f"{a}.attention.q_lora_rank", cfg["q_lora_rank"])
    writer.add_uint32(f"{a}.attention.kv_lora_rank", lora)
    writer.add_uint32(f"{a}.attention.key_length", lora + rope)
    writer.add_uint32(f"{a}.attention.value_length", lora)
    writer.add_uint32(f"{a}.attention.key_length_mla", cfg["qk_nope_head_dim"] + rope)
    writer.add_uint32(f"{a}.attention.value_length_mla", cfg["v_head_dim"])
    writer.add_uint32(f"{a}.expert_feed_forward_length", cfg["moe_intermediate_size"])
    writer.add_uint32(f"{a}.expert_count", cfg["n_routed_experts"])
    writer.add_uint32(f"{a}.expert_used_count", cfg["num_experts_per_tok"])
    writer.add_uint32(f"{a}.expert_shared_count", cfg["n_shared_experts"])
    writer.add_float32(f"{a}.expert_weights_scale", cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        writer.add_bool(f"{a}.expert_weights_norm", True)
    writer.add_uint32(f"{a}.expert_group_count", cfg.get("n_group") or 1)
    writer.add_uint32(f"{a}.expert_group_used_count", cfg.get("topk_group") or 1)
    sigmoid = cfg["model_type"] == "deepseek_v3"
    writer.add_uint32(f"{a}.expert_gating_func", 2 if sigmoid else 1)
    writer.add_uint32(f"{a}.rope.dimension_count", rope)
    rp = cfg.get("rope_parameters") or {}
    if rp.get("rope_type") == "yarn":
        writer.add_string(f"{a}.rope.scaling.type", "yarn")
        writer.add_float32(f"{a}.rope.scaling.factor", rp["factor"])
        writer.add_uint32(
            f"{a}.rope.scaling.original_context_length", rp["original_max_position_embeddings"]
        )
        writer.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", 0.1 * rp["mscale_all_dim"])


def write_gguf(
    path: str,
    folder: str,
    qtype: str | None = None,
    fuse_qkv: bool = False,
    reranker: tuple[int, int, str] | None = None,
) -> str:
    """The HF folder's tiny model as llama.cpp's converter would write it; 2-D weights
    in `qtype` (a GGUF block type such as "Q8_0") where their rows fit its blocks;
    `fuse_qkv`: q, k and v as one attn_qkv (--fuse-qkv: after q/k are permuted).
    `reranker` (the ids of "yes" and "no", the prompt template): a Qwen3-Reranker as
    the converter writes one (conversion/qwen.py): the LM head cut to those two rows
    as cls.output, rank pooling, the labels, and the template as "rerank"."""
    from gguf import GGMLQuantizationType, GGUFWriter, PoolingType
    from gguf.quants import quantize
    from safetensors.torch import load_file

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    arch = GGUF_ARCH[cfg["model_type"]]
    w = {
        k: v.float().numpy()
        for k, v in load_file(os.path.join(folder, "model.safetensors")).items()
    }
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    num_experts = (
        cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    )
    writer = GGUFWriter(path, arch)
    _tokenizer(writer, folder)
    _keys(writer, arch, cfg)

    def add(name: str, x: np.ndarray, hf_name: str) -> None:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if arch in GEMMA and hf_name.endswith("norm.weight"):
            x = x + 1  # Gemma's norms: the runtime multiplies by the weight alone
        small = x.ndim < 2 or hf_name.endswith("norm.weight") or "ffn_gate_inp" in name
        if qtype is None or small or x.shape[-1] % 32:
            writer.add_tensor(name, x)
        else:
            t = GGMLQuantizationType[qtype]
            writer.add_tensor(name, quantize(x, t), raw_dtype=t)

    add("token_embd.weight", w["model.embed_tokens.weight"], "model.embed_tokens.weight")
    add("output_norm.weight", w["model.norm.weight"], "model.norm.weight")
    if reranker is not None:
        yes, no, template = reranker
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        add("cls.output.weight", head[[yes, no]], "score.weight")
        writer.add_pooling_type(PoolingType.RANK)
        writer.add_classifier_output_labels(["yes", "no"])
        writer.add_chat_template([{"name": "rerank", "template": template}])
    elif "lm_head.weight" in w and arch != "gemma2":
        add("output.weight", w["lm_head.weight"], "lm_head.weight")
    rope = cfg.get("rope_parameters") or {}
    if arch == "phi3" and rope.get("long_factor"):
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    if arch in GEMMA:
        norms = {
            "input_layernorm": "attn_norm",
            "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm",
        }
    parts = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "qkv_proj": "attn_qkv"}  # fmt: skip
    mlp = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
           "gate_up_proj": "ffn_up", "gate": "ffn_gate_inp"}  # fmt: skip
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf, gg in norms.items():
            add(f"blk.{i}.{gg}.weight", w[f"{p}{hf}.weight"], f"{p}{hf}.weight")
        fused: dict[str, dict[str, np.ndarray]] = {}  # kind -> q/k/v, for attn_qkv
        for key, x in w.items():
            if not key.startswith(p) or "experts." in key:
                continue
            module, kind = key[len(p) :].rsplit(".", 1)  # self_attn.q_proj, weight
            if "." not in module or kind not in ("weight", "bias"):  # norms: written above
                continue
            group, part = module.split(".", 1)
            if group == "self_attn" and part in parts:
                if arch in PERMUTED and part in ("q_proj", "k_proj"):
                    x = _permute(x, heads if part == "q_proj" else kv_heads)
                if fuse_qkv and part in ("q_proj", "k_proj", "v_proj"):
                    fused.setdefault(kind, {})[part] = x
                    continue
                add(f"blk.{i}.{parts[part]}.{kind}", x, key)
            elif group == "mlp" and part in mlp:
                add(f"blk.{i}.{mlp[part]}.{kind}", x, key)
        for kind, qkv in fused.items():
            x = np.concatenate([qkv["q_proj"], qkv["k_proj"], qkv["v_proj"]])
            add(f"blk.{i}.attn_qkv.{kind}", x, f"{p}self_attn.qkv_proj.{kind}")
        if f"{p}mlp.experts.0.gate_proj.weight" in w:
            for gg, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                stacked = np.stack(
                    [w[f"{p}mlp.experts.{e}.{hf}.weight"] for e in range(num_experts)]
                )
                add(f"blk.{i}.ffn_{gg}_exps.weight", stacked, f"{p}mlp.experts.{hf}")
        if arch == "deepseek2":
            _deepseek_layer(add, w, p, i, cfg)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _deepseek_layer(add, w: dict, p: str, i: int, cfg: dict) -> None:
    """MLA's tensors (kv_b_proj split into k_b, transposed, and v_b: deepseek.py ~434),
    the router's bias, the shared experts."""
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    names = {"q_a_proj": "attn_q_a", "q_a_layernorm": "attn_q_a_norm", "q_b_proj": "attn_q_b",
             "kv_a_proj_with_mqa": "attn_kv_a_mqa",
             "kv_a_layernorm": "attn_kv_a_norm"}  # fmt: skip
    for hf, gg in names.items():
        if f"{p}self_attn.{hf}.weight" in w:
            add(f"blk.{i}.{gg}.weight", w[f"{p}self_attn.{hf}.weight"], f"{p}self_attn.{hf}.weight")
    kv_b = w[f"{p}self_attn.kv_b_proj.weight"].reshape(heads, nope + v, -1)
    add(f"blk.{i}.attn_k_b.weight", kv_b[:, :nope].transpose(0, 2, 1), "k_b")
    add(f"blk.{i}.attn_v_b.weight", kv_b[:, nope:], "v_b")
    if f"{p}mlp.gate.e_score_correction_bias" in w:
        add(f"blk.{i}.exp_probs_b.bias", w[f"{p}mlp.gate.e_score_correction_bias"], "bias")
    for hf, gg in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
        key = f"{p}mlp.shared_experts.{hf}.weight"
        if key in w:
            add(f"blk.{i}.ffn_{gg}_shexp.weight", w[key], key)
