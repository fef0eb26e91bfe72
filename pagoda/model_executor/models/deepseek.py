"""DeepSeek V2 and V3: multi-head latent attention (layers/mla.py) and a mixture of
experts with shared experts beside the routed ones, after `first_k_dense_replace`
dense layers.

Routing, as transformers computes it (the router in float32):
- V2: softmax scores; top-k over all experts ("greedy"), or within the top
  `topk_group` of `n_group` groups ranked by their best score
  ("group_limited_greedy"); weights times routed_scaling_factor.
- V3 ("noaux_tc"): sigmoid scores; each expert's choice score adds a learned bias
  (e_score_correction_bias); groups ranked by the sum of their two best choice
  scores; weights are the unbiased scores, renormalized (norm_topk_prob) and times
  routed_scaling_factor.

Rope: DeepSeek's checkpoints keep each rope pair interleaved (x0, x1), (x2, x3), ...;
`adapt_weight` reorders those rows of q and of the shared rope key into the
rotate-half layout, so the usual kernels turn them (the dot products do not change).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.distributed import SINGLE, ParallelContext
from pagoda.model_executor.layers.fused_moe import FusedMoE
from pagoda.model_executor.layers.mla import MLAConfig
from pagoda.model_executor.layers.mlp import GatedMLP, MLPConfig
from pagoda.model_executor.layers.rotary import yarn_mscale
from pagoda.model_executor.models.transformer import (
    DecoderConfig,
    DecoderForCausalLM,
    LayerConfig,
    rope_parameters,
)
from pagoda.model_executor.quantization import QuantizedWeight
from pagoda.model_executor.weight_loader import GATE_UP, WeightNames
from pagoda.ops import Ops

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class DeepseekMoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    def build(self, hidden_size: int, ops: Ops, parallel: ParallelContext = SINGLE):
        return DeepseekMoE(hidden_size, self, ops)


class DeepseekRouter(nn.Module):
    """The router's weight (and V3's choice bias), kept and applied in float32."""

    keep_float32 = True

    def __init__(self, hidden_size: int, cfg: DeepseekMoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        E = cfg.num_experts
        self.weight = nn.Parameter(torch.empty(E, hidden_size), requires_grad=False)
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(E), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, k], weights [T, k] float32)."""
        cfg = self.cfg
        logits = torch.nn.functional.linear(x.float(), self.weight.float())  # [T, E]
        T, E = logits.shape
        if cfg.topk_method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            groups = choice.view(T, cfg.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        else:
            scores = choice = logits.softmax(dim=-1, dtype=torch.float32)
            groups = scores.view(T, cfg.n_group, -1).max(dim=-1).values
        if cfg.topk_method != "greedy":
            top_groups = torch.topk(groups, k=cfg.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(groups).scatter_(1, top_groups, 1).bool()  # [T, groups]
            keep = keep.unsqueeze(-1).expand(T, cfg.n_group, E // cfg.n_group).reshape(T, E)
            fill = float("-inf") if cfg.topk_method == "noaux_tc" else 0.0
            choice = choice.masked_fill(~keep, fill)
        ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if cfg.topk_method == "noaux_tc" and cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * cfg.routed_scaling_factor


class DeepseekMoE(nn.Module):
    def __init__(self, hidden_size: int, cfg: DeepseekMoEConfig, ops: Ops) -> None:
        super().__init__()
        self.gate = DeepseekRouter(hidden_size, cfg)
        self.experts = FusedMoE(
            cfg.num_experts, cfg.top_k, hidden_size, cfg.intermediate_size, False, ops
        )
        self.shared_experts = None
        if cfg.num_shared_experts:
            shared = MLPConfig(cfg.intermediate_size * cfg.num_shared_experts)
            self.shared_experts = GatedMLP(hidden_size, shared, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        y = self.experts.forward_routed(x, ids, weights)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    # q_proj, kv_a_proj_with_mqa and kv_b_proj stay apart (MLA); V3's multi-token-
    # prediction layers (past num_hidden_layers) are not loaded.
    weight_names = WeightNames(
        stacked={".gate_proj.": (GATE_UP, 0), ".up_proj.": (GATE_UP, 1)},
        skip_extra_layers=True,
    )

    @classmethod
    def decoder_config(cls, cfg: dict[str, Any]) -> DecoderConfig:
        rope = rope_parameters(cfg)
        nope, rope_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        scale = (nope + rope_dim) ** -0.5
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            factor = rope.get("factor") or 1.0
            scale *= yarn_mscale(factor, rope["mscale_all_dim"]) ** 2
        mla = MLAConfig(
            num_heads=cfg["num_attention_heads"],
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=cfg["v_head_dim"],
            scale=scale,
            bias=bool(cfg.get("attention_bias", False)),
        )
        num_experts = cfg.get("n_routed_experts") or 0
        method = cfg.get("topk_method") or (
            "noaux_tc" if cls is DeepseekV3ForCausalLM else "greedy"
        )
        if method not in TOPK_METHODS:
            raise ValueError(f"topk_method {method!r} is not supported; supported: {TOPK_METHODS}.")
        moe = DeepseekMoEConfig(
            num_experts=num_experts,
            top_k=cfg.get("num_experts_per_tok") or 1,
            intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
            num_shared_experts=cfg.get("n_shared_experts") or 0,
            topk_method=method,
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        )
        dense = MLPConfig(cfg["intermediate_size"], cfg.get("hidden_act", "silu"))
        first_moe = cfg.get("first_k_dense_replace") or 0
        layers = tuple(
            LayerConfig(mla, moe if num_experts and i >= first_moe else dense)
            for i in range(cfg["num_hidden_layers"])
        )
        max_positions = int(cfg.get("max_position_embeddings") or 2048)
        return DecoderConfig(
            hidden_size=cfg["hidden_size"],
            vocab_size=cfg["vocab_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            layers=layers,
            ropes={"default": rope},
            max_position_embeddings=max_positions,
            num_positions=int(cfg.get("max_model_len") or max_positions),
            rope_head_dim=rope_dim,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    def adapt_weight(self, name: str, w: torch.Tensor | QuantizedWeight):
        """The rope rows of q (each head's last qk_rope_head_dim) and of the shared key
        (kv_a_proj_with_mqa's last ones), de-interleaved: (x0, x2, ..., x1, x3, ...)."""
        parts = name.rsplit(".", 2)
        if len(parts) < 3 or parts[-2] not in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa"):
            return w
        cfg = self.config
        if not cfg.get("rope_interleave", True) and isinstance(self, DeepseekV3ForCausalLM):
            return w  # already rotate-half (V2's rope is always interleaved)
        rope = cfg["qk_rope_head_dim"]
        deinterleave = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        if parts[-2] == "kv_a_proj_with_mqa":
            lora = cfg["kv_lora_rank"]
            order = torch.cat([torch.arange(lora), lora + deinterleave])
        else:
            per_head = cfg["qk_nope_head_dim"] + rope
            head = torch.cat([torch.arange(per_head - rope), per_head - rope + deinterleave])
            order = (torch.arange(cfg["num_attention_heads"])[:, None] * per_head + head).reshape(
                -1
            )
        if isinstance(w, QuantizedWeight):
            return w.rows(order)
        return w[order]


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
