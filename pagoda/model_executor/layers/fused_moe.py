"""Mixture of experts: the router's top-k, then each expert over its own tokens only.

    x [T, H] ── gate ──▶ logits [T, E]
    ops.moe_group: softmax (float32), top-k; the T*k (token, expert) pairs sorted by
                   expert, x's rows gathered so: one contiguous segment per expert
    for each expert with tokens:  seg [n, H] ── w13[e] ──▶ silu(gate) * up ── w2[e] ──▶ [n, H]
    ops.moe_combine: each pair's output times its routing weight, summed into its token

Sorting replaces any loop over tokens; the loop is over experts, and only those a
token chose (at batch 1, k of them). Each expert's two products go through the
kernel layer's `linear`, so a short segment in bf16 takes the small-batch kernel.
The grouping and the combine are one C++ pass each on the CPU backend (their
PyTorch twins are about ten ops), measured in benchmarks/moe.py.

`expert_map` is the seam for expert parallelism: which experts this rank holds
(all of them, today). With experts sharded, the tokens routed to another rank's
experts would go there in an all-to-all after the sort and come back before the
index_add.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed import SINGLE, ParallelContext
from pagoda.model_executor.layers.linear import Linear
from pagoda.model_executor.layers.mlp import GatedMLP, MLPConfig
from pagoda.model_executor.quantization import QuantizedWeight
from pagoda.ops import Ops


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        ops: Ops,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}.")
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize  # the top-k weights sum to 1 (norm_topk_prob)
        self.ops = ops
        # Experts' weights stacked, gate and up fused: as each expert's Linear holds them.
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )
        # Quantized experts (set_quantized): one QuantizedWeight per expert in place of
        # the stacked tensor, multiplied by the kernel layer's quant_linear.
        self.q13: list[QuantizedWeight] | None = None
        self.q2: list[QuantizedWeight] | None = None
        # Expert id -> where it runs; every expert here, for now (see the module doc).
        self.expert_map = list(range(num_experts))

    @property
    def quantized(self) -> bool:
        return self.q13 is not None or self.q2 is not None

    def set_quantized(self, name: str, weights: list[QuantizedWeight]) -> None:
        """Keep the experts' `name` ("w13" or "w2") quantized, one weight per expert."""
        if len(weights) != self.num_experts:
            raise ValueError(
                f"{name}: {len(weights)} experts' weights, expected {self.num_experts}"
            )
        setattr(self, "q13" if name == "w13" else "q2", weights)
        self.register_parameter(name, None)  # no stacked tensor

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        xs, token_of, pair_weights, counts = self.ops.moe_group(
            x, router_logits, self.top_k, self.renormalize
        )
        return self._experts(xs, token_of, pair_weights, counts, x.shape[0])

    def forward_routed(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The experts for a routing made elsewhere (DeepSeek's grouped, biased choice):
        expert_ids [T, k], weights [T, k] float32."""
        flat = expert_ids.reshape(-1)  # pair p is token p // k
        order = torch.argsort(flat, stable=True)
        token_of = order // expert_ids.shape[1]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        pair_weights = weights.reshape(-1)[order]
        return self._experts(
            x.index_select(0, token_of), token_of, pair_weights, counts, x.shape[0]
        )

    def _experts(self, xs, token_of, pair_weights, counts, num_tokens: int) -> torch.Tensor:
        """Each chosen expert over its segment of the grouped rows, then each token's
        pairs weighted and summed."""
        out = torch.empty_like(xs)
        ops = self.ops
        w13, linear13 = (self.q13, ops.quant_linear) if self.q13 else (self.w13, ops.linear)
        w2, linear2 = (self.q2, ops.quant_linear) if self.q2 else (self.w2, ops.linear)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            seg = xs[start : start + n]
            gate, up = linear13(seg, w13[expert], None).chunk(2, dim=-1)
            out[start : start + n] = linear2(F.silu(gate) * up, w2[expert], None)
            start += n
        return self.ops.moe_combine(out, token_of, pair_weights, num_tokens)


@dataclass(frozen=True)
class MoEConfig:
    """A layer of routed experts (Mixtral, Qwen2/3-MoE, OLMoE): softmax top-k."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool  # the top-k weights sum to 1 (norm_topk_prob)
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert, behind a sigmoid gate

    def build(self, hidden_size: int, ops: Ops, parallel: ParallelContext = SINGLE):
        # Experts are not split: each rank runs them all on the whole hidden state.
        return SparseMoeBlock(hidden_size, self, ops)


class SparseMoeBlock(nn.Module):
    """A mixture-of-experts MLP: the router (`gate`), the routed experts, and for
    Qwen2-MoE a shared expert every token goes through, scaled by a sigmoid gate."""

    def __init__(self, hidden_size: int, cfg: MoEConfig, ops: Ops) -> None:
        super().__init__()
        self.gate = Linear(hidden_size, cfg.num_experts, False, ops)
        self.experts = FusedMoE(
            cfg.num_experts,
            cfg.top_k,
            hidden_size,
            cfg.intermediate_size,
            renormalize=cfg.renormalize,
            ops=ops,
        )
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, MLPConfig(cfg.shared_intermediate_size), ops)
            self.shared_expert_gate = Linear(hidden_size, 1, False, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y
