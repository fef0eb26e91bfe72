"""Which layers does quantization hurt? `pagoda quantize analyze`.

Quantizes one group of layers at a time (every other one kept in full precision
with `keep_full_precision`), measures the perplexity of each against the model
with nothing quantized, and suggests the groups to keep in full precision so
that the whole model's perplexity rises by at most `target`:

    baseline    nothing quantized (every group kept)
    group g     only g quantized          delta_g = ppl_g / baseline - 1
    all         everything quantized
    suggestion  keep the worst groups until (all - their deltas) <= target, then
                measure that configuration to confirm

Groups are the kinds of layer (fused q/k/v together, gate/up together, o, down,
the embedding, the lm_head) or single decoder layers (`by="layer"`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pagoda.eval.perplexity import perplexity
from pagoda.model_executor.model_loader import QUANTIZE_AT_LOAD

# kind -> module-name patterns (fused parts together: a fused weight is kept whole)
KINDS = {
    "attn.qkv": ["layers.*.self_attn.q_proj", "layers.*.self_attn.k_proj", "layers.*.self_attn.v_proj"],
    "attn.o": ["layers.*.self_attn.o_proj"],
    "mlp.gate_up": ["layers.*.mlp.gate_proj", "layers.*.mlp.up_proj"],
    "mlp.down": ["layers.*.mlp.down_proj"],
    "embed_tokens": ["embed_tokens"],
    "lm_head": ["lm_head"],
}  # fmt: skip


@dataclass
class GroupResult:
    group: str
    patterns: list[str]
    perplexity: float
    delta: float  # relative to the baseline


@dataclass
class SensitivityReport:
    quantization: str
    baseline: float  # nothing quantized
    all_quantized: float
    groups: list[GroupResult]  # worst first
    target: float
    suggested_keep: list[str] = field(default_factory=list)  # patterns
    suggested_perplexity: float | None = None

    @property
    def all_delta(self) -> float:
        return self.all_quantized / self.baseline - 1

    @property
    def suggested_delta(self) -> float | None:
        if self.suggested_perplexity is None:
            return None
        return self.suggested_perplexity / self.baseline - 1


def groups(hf_config: dict[str, Any], by: str) -> dict[str, list[str]]:
    if by == "kind":
        out = dict(KINDS)
    elif by == "layer":
        out = {f"layers.{i}": [f"layers.{i}.*"] for i in range(hf_config["num_hidden_layers"])}
        out["embed_tokens"], out["lm_head"] = ["embed_tokens"], ["lm_head"]
    else:
        raise ValueError(f"by must be 'kind' or 'layer', got {by!r}.")
    if hf_config.get("tie_word_embeddings"):
        del out["lm_head"]  # it is the embedding's table: one group
        out["embed_tokens"] = ["embed_tokens", "lm_head"]
    return out


def analyze(
    engine_kwargs: dict[str, Any],
    text: str,
    by: str = "kind",
    target: float = 0.01,
    context: int = 512,
    stride: int = 256,
    progress=print,
) -> SensitivityReport:
    from pagoda.engine_args import EngineArgs

    quantization = engine_kwargs.get("quantization", "auto")
    model_config = EngineArgs(**engine_kwargs).create_model_config()
    if quantization not in QUANTIZE_AT_LOAD:
        raise ValueError(
            f"quantization {quantization!r}: name the format to analyze (q8_0, q4_0, q4_1, "
            "int8, int4). A GGUF file's own blocks (auto) are what its float weights were "
            "lost to: kept or dequantized they compute the same products."
        )
    hf_config = model_config.hf_config
    by_group = groups(hf_config, by)
    every = [p for patterns in by_group.values() for p in patterns]

    def ppl(keep: list[str], label: str) -> float:
        kwargs = {**engine_kwargs, "keep_full_precision": tuple(keep)}
        value = perplexity(kwargs, text, context, stride, use_tqdm=False).perplexity
        progress(f"  {label:<28} perplexity {value:.4f}")
        return value

    baseline = ppl(every, "nothing quantized")
    all_quantized = ppl([], "everything quantized")
    results = []
    for name, patterns in by_group.items():
        value = ppl([p for p in every if p not in patterns], f"only {name}")
        results.append(GroupResult(name, patterns, value, value / baseline - 1))
    results.sort(key=lambda r: r.delta, reverse=True)
    report = SensitivityReport(quantization, baseline, all_quantized, results, target)
    predicted = report.all_delta
    for r in results:
        if predicted <= target:
            break
        report.suggested_keep += r.patterns
        predicted -= max(r.delta, 0.0)
    if report.suggested_keep:
        report.suggested_perplexity = ppl(report.suggested_keep, "suggested")
    return report


def format_report(report: SensitivityReport) -> str:
    lines = [
        f"quantization {report.quantization}: perplexity {report.baseline:.4f} with nothing "
        f"quantized, {report.all_quantized:.4f} with everything ({report.all_delta:+.2%})",
        "",
        f"{'group quantized alone':<24}{'perplexity':>12}{'change':>10}",
        "-" * 46,
    ]
    lines += [f"{r.group:<24}{r.perplexity:>12.4f}{r.delta:>+10.2%}" for r in report.groups]
    lines.append("")
    if not report.suggested_keep:
        lines.append(f"everything quantized is within {report.target:.2%}: keep nothing")
    else:
        flags = " ".join(f"'{p}'" for p in report.suggested_keep)
        lines.append(
            f"to stay within {report.target:.2%}: --keep-full-precision {flags}\n"
            f"  measured: perplexity {report.suggested_perplexity:.4f} "
            f"({report.suggested_delta:+.2%})"
        )
    return "\n".join(lines)


def plot_report(report: SensitivityReport, path: str) -> None:
    from pagoda.bench.report import _pyplot, _save

    plt = _pyplot()
    names = [r.group for r in report.groups][::-1]
    deltas = [100 * r.delta for r in report.groups][::-1]
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(names) + 1.5))
    ax.barh(names, deltas)
    ax.axvline(100 * report.target, linestyle="--", color="gray", label="target (whole model)")
    ax.set_xlabel("perplexity change when only this group is quantized (%)")
    ax.legend(loc="lower right")
    _save(plt, fig, path, f"sensitivity to {report.quantization} quantization")


def as_record(report: SensitivityReport, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    return {"engine": engine_kwargs, **asdict(report), "all_delta": report.all_delta}
