"""Logits -> token ids, batched: a pure function of logits and per-step sampling tensors.

Greedy rows take the argmax. Random rows sample with the exponential race
(argmax of probs / Exp(1) noise), which needs no cumsum or host sync; a row
with a seed draws its noise from a generator seeded by (seed, output index),
so its tokens do not depend on what else shares the batch, nor on preemption.

Before that, in vLLM's order: the grammar's bitmask (structured outputs),
allowed tokens, bad words and min_tokens (masks), logit bias, then
repetition/frequency/presence penalties. Each piece
is built only when some row in the batch asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.core.sched_output import ScheduledRequest

NEG_INF = float("-inf")


@dataclass
class SamplingTensors:
    """One step's sampling parameters, one row per sampling request."""

    temperature: torch.Tensor  # [B] float32; 0 rows are greedy
    top_k: torch.Tensor | None = None  # [B] int64, vocab size where disabled
    top_p: torch.Tensor | None = None  # [B] float32
    min_p: torch.Tensor | None = None  # [B] float32
    all_greedy: bool = True
    seeds: dict[int, int] | None = None  # row -> seed for this draw
    allowed_mask: torch.Tensor | None = None  # [B, V] bool
    banned: tuple[list[int], list[int]] | None = None  # (rows, token ids) set to -inf
    bias: tuple[list[int], list[int], list[float]] | None = None  # (rows, token ids, values)
    presence: torch.Tensor | None = None  # [B] (penalties present: all four set)
    frequency: torch.Tensor | None = None  # [B]
    repetition: torch.Tensor | None = None  # [B]
    # Each row's output and prompt ids, padded with V: small to build and copy; the
    # dense [B, V] counts are made from them on the logits' device.
    output_ids: torch.Tensor | None = None  # [B, W] int64
    prompt_ids: torch.Tensor | None = None  # [B, W'] int64
    # Rows under a grammar, and their token bitmask [rows, ceil(V / 32)] int32.
    grammar: tuple[list[int], torch.Tensor] | None = None

    def to(self, device: torch.device) -> SamplingTensors:
        """The same tensors on `device` (the logits'); built on the host, moved once."""
        if device.type == "cpu":
            return self
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device, non_blocking=True))
        if self.grammar is not None:
            self.grammar = (self.grammar[0], self.grammar[1].to(device, non_blocking=True))
        return self

    @classmethod
    def from_requests(cls, reqs: list[ScheduledRequest], vocab_size: int) -> SamplingTensors:
        params = [r.sampling_params for r in reqs]
        st = cls(temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params]))
        st.all_greedy = all(p.greedy for p in params)
        if not st.all_greedy:
            if any(p.top_k > 0 for p in params):
                st.top_k = torch.tensor(
                    [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
                )
            if any(p.top_p < 1.0 for p in params):
                st.top_p = torch.tensor([p.top_p for p in params])
            if any(p.min_p > 0.0 for p in params):
                st.min_p = torch.tensor([p.min_p for p in params])
            st.seeds = {
                row: _draw_seed(p.seed, r.num_output_tokens)
                for row, (p, r) in enumerate(zip(params, reqs, strict=True))
                if p.seed is not None and not p.greedy
            }
        st._build_masks(reqs, vocab_size)
        if any(
            p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params
        ):
            st._build_penalties(reqs, vocab_size)
        return st

    def _build_masks(self, reqs: list[ScheduledRequest], vocab_size: int) -> None:
        rows, cols = [], []
        bias_rows, bias_cols, bias_vals = [], [], []
        allowed = [(row, r.sampling_params.allowed_token_ids) for row, r in enumerate(reqs)]
        allowed = [(row, ids) for row, ids in allowed if ids is not None]
        for row, r in enumerate(reqs):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                stop_ids = ([] if p.ignore_eos else list(p.eos_token_ids)) + p.stop_token_ids
                rows += [row] * len(stop_ids)
                cols += stop_ids
            for word in p.bad_words_token_ids:
                out = r.output_token_ids or []
                prefix = word[:-1]
                if not prefix or out[len(out) - len(prefix) :] == prefix:
                    rows.append(row)
                    cols.append(word[-1])
            if p.logit_bias:
                for token_id, value in p.logit_bias.items():
                    if 0 <= token_id < vocab_size:
                        bias_rows.append(row)
                        bias_cols.append(token_id)
                        bias_vals.append(value)
        if rows:
            self.banned = (rows, cols)
        if bias_rows:
            self.bias = (bias_rows, bias_cols, bias_vals)
        if allowed:
            mask = torch.ones(len(reqs), vocab_size, dtype=torch.bool)
            for row, ids in allowed:
                mask[row] = False
                mask[row, [t for t in ids if t < vocab_size]] = True
            self.allowed_mask = mask

    def _build_penalties(self, reqs: list[ScheduledRequest], vocab_size: int) -> None:
        params = [r.sampling_params for r in reqs]
        self.presence = torch.tensor([p.presence_penalty for p in params])
        self.frequency = torch.tensor([p.frequency_penalty for p in params])
        self.repetition = torch.tensor([p.repetition_penalty for p in params])
        self.output_ids = _padded([r.output_token_ids or [] for r in reqs], vocab_size)
        self.prompt_ids = _padded([r.prompt_token_ids or [] for r in reqs], vocab_size)


def _padded(token_lists: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    return torch.tensor([t + [pad] * (width - len(t)) for t in token_lists], dtype=torch.int64)


def _counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 occurrence counts of padded ids [B, W] (pad: vocab_size, a dummy
    column dropped afterwards), on their device; one scatter for the whole batch."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _draw_seed(seed: int, output_index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + output_index) % (1 << 63)


_BYTE_BITS = torch.arange(8, dtype=torch.uint8)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """float32 logits (a new tensor) with what each row's grammar forbids at -inf: the
    C++ kernel where it is built (masked stores, 32 tokens at a time), else torch."""
    from pagoda.ops import cpu

    out = logits.to(torch.float32, copy=True)
    kernels = cpu.load() if out.is_cpu else None
    if kernels is not None:
        kernels.apply_token_bitmask(out, torch.tensor(rows, dtype=torch.int64), bitmask)
        return out
    # Little-endian int32 words: byte i holds tokens 8i .. 8i + 7.
    bits = bitmask.view(torch.uint8).unsqueeze(-1) >> _BYTE_BITS.to(out.device, non_blocking=True)
    allowed = (bits & 1).view(len(rows), -1)[:, : out.shape[1]].bool()
    out[rows] = torch.where(allowed, out[rows], float("-inf"))
    return out


def apply_logits_processors(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Masks, bias and penalties; returns logits (a new tensor if anything applied)."""
    if st.grammar is not None:
        logits = apply_bitmask(logits, *st.grammar)
    if st.allowed_mask is not None:
        logits = logits.masked_fill(~st.allowed_mask, NEG_INF)
    if st.banned is not None:
        logits = logits.clone() if st.allowed_mask is None else logits
        logits[st.banned] = NEG_INF
    if st.bias is not None:
        rows, cols, vals = st.bias
        device = logits.device
        logits = logits.index_put(
            (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
            torch.tensor(vals, device=device),
            accumulate=True,
        )
    if st.repetition is not None:
        output_counts = _counts(st.output_ids, logits.shape[1])
        seen = (output_counts > 0) | (_counts(st.prompt_ids, logits.shape[1]) > 0)
        rep = st.repetition.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
        logits = logits - st.frequency.unsqueeze(1) * output_counts
        logits = logits - st.presence.unsqueeze(1) * (output_counts > 0)
    return logits


def sample(logits: torch.Tensor, st: SamplingTensors, generator: torch.Generator) -> torch.Tensor:
    """logits: [B, V] in the model's dtype -> token ids [B] int64."""
    if (
        st.all_greedy
        and st.allowed_mask is None
        and st.banned is None
        and st.bias is None
        and st.repetition is None
        and st.grammar is None
    ):
        # Fast path, no processors. (argmax over float32 is faster here than over bf16.)
        return logits.float().argmax(dim=-1)
    logits = apply_logits_processors(logits.float(), st)
    greedy_ids = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy_ids
    greedy = st.temperature == 0.0
    logits = logits / torch.where(greedy, 1.0, st.temperature).unsqueeze(1)
    if st.top_k is not None or st.top_p is not None:
        logits = apply_top_k_top_p(logits, st.top_k, st.top_p)
    probs = logits.softmax(dim=-1)
    if st.min_p is not None:
        threshold = st.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, seed in (st.seeds or {}).items():
        seeded = torch.Generator(noise.device).manual_seed(seed)
        noise[row].exponential_(generator=seeded)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, greedy_ids, sampled)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask all but the top-k logits and the smallest set whose probability reaches top-p."""
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(min=0).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF)
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    return torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits)


def compute_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, num_top: list[int]
) -> list[tuple[int, dict[int, tuple[float, int]]]]:
    """Per row: (chosen id, {token id: (logprob, rank)}) with the chosen token and the top-N.

    logits [B, V] raw model logits; chosen [B]; num_top[b] = N for row b.
    """
    logprobs = logits.log_softmax(dim=-1)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))  # [B, 1]
    ranks = (logprobs > chosen_lp).sum(dim=1) + 1
    k = max(num_top)
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen[:, None][:, :0])
    chosen_l, chosen_lp_l, ranks_l = chosen.tolist(), chosen_lp.squeeze(1).tolist(), ranks.tolist()
    top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
    out = []
    for b, n in enumerate(num_top):
        entry = {
            tid: (lp, i + 1)
            for i, (tid, lp) in enumerate(zip(top_ids_l[b][:n], top_lp_l[b][:n], strict=True))
        }
        entry[chosen_l[b]] = (chosen_lp_l[b], ranks_l[b])
        out.append((chosen_l[b], entry))
    return out
