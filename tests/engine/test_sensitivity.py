"""`pagoda quantize analyze` on a tiny model: every group measured alone, ranked, and a
--keep-full-precision suggestion that, measured, keeps the perplexity within target."""

from __future__ import annotations

import json

import pytest

from pagoda.entrypoints.cli import main
from pagoda.eval.perplexity import HELDOUT_TEXT
from pagoda.eval.sensitivity import KINDS, analyze, format_report, groups


def test_groups_keep_fused_parts_and_tied_tables_together():
    by_kind = groups({"num_hidden_layers": 2}, "kind")
    assert by_kind == KINDS
    assert len(by_kind["attn.qkv"]) == 3 and len(by_kind["mlp.gate_up"]) == 2
    tied = groups({"num_hidden_layers": 2, "tie_word_embeddings": True}, "layer")
    assert list(tied) == ["layers.0", "layers.1", "embed_tokens"]
    assert tied["embed_tokens"] == ["embed_tokens", "lm_head"]
    with pytest.raises(ValueError, match="by"):
        groups({"num_hidden_layers": 2}, "head")


def _text() -> str:
    with open(HELDOUT_TEXT, encoding="utf-8") as f:
        return f.read()[:2500]


def test_analyze_ranks_groups_and_its_suggestion_holds(tiny_llama):
    kwargs = dict(model=tiny_llama, dtype="float32", quantization="q4_0",
                  kv_cache_memory_bytes=1 << 24)  # fmt: skip
    report = analyze(kwargs, _text(), "kind", 0.002, context=64, stride=32, progress=lambda _: None)
    assert [r.group for r in report.groups] != [] and len(report.groups) == len(KINDS)
    deltas = [r.delta for r in report.groups]
    assert deltas == sorted(deltas, reverse=True)  # worst first
    assert report.all_quantized != report.baseline  # 4 bits move a random model
    if report.suggested_keep:
        # Keeping the suggested groups must land within the target (or as close as the
        # groups allow: then every group is kept and nothing is quantized).
        everything = [p for r in report.groups for p in r.patterns]
        assert report.suggested_delta <= report.target + 1e-9 or len(report.suggested_keep) == len(
            everything
        )
    assert "perplexity" in format_report(report)
    with pytest.raises(ValueError, match="none"):
        analyze({**kwargs, "quantization": "none"}, _text())


def test_quantize_analyze_command(tiny_llama, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(_text(), encoding="utf-8")
    args = ["quantize", "analyze", tiny_llama, "--file", str(text), "--by", "layer"]
    args += ["--context", "64", "--stride", "32", "--dtype", "float32", "--quantization", "int4"]
    args += ["--plot", str(tmp_path / "s.png"), "--output-json", str(tmp_path / "s.json")]
    args += ["--kv-cache-memory-bytes", str(1 << 24)]
    assert main(args) == 0
    record = json.loads((tmp_path / "s.json").read_text())
    assert [g["group"] for g in record["groups"]].count("layers.0") == 1
    assert (tmp_path / "s.png").stat().st_size > 1000
