"""deploy/: the Grafana dashboard and the Prometheus alert rules name only metrics a
real server exports, parse as PromQL (`promtool`), and the alerts fire when their
condition holds, the KV-cache one on a real server whose tiny pool is filled."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time

import httpx
import pytest
import yaml

from tests.helpers import ROOT, RemoteServer

DEPLOY = os.path.join(ROOT, "deploy")
ALERTS = os.path.join(DEPLOY, "prometheus", "alerts.yml")
ALERTS_TEST = os.path.join(DEPLOY, "prometheus", "alerts_test.yml")
GRAFANA = os.path.join(DEPLOY, "grafana", "pagoda.json")
PROMTOOL = shutil.which("promtool")
METRIC = re.compile(r"\bpagoda:[A-Za-z0-9_:]+")
PROMETHEUS_OWN = {"up"}  # series Prometheus makes itself, not the server


def _promtool(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    if PROMTOOL is None:
        if os.environ.get("PAGODA_REQUIRE_PROMTOOL") == "1":
            pytest.fail("PAGODA_REQUIRE_PROMTOOL=1 but no promtool on PATH")
        pytest.skip("no promtool on PATH (apt-get install prometheus)")
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, cwd=cwd, timeout=120, check=False
    )


def _scrape(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def _sample_names(text: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture(scope="module")
def exported(tiny_llama) -> set[str]:
    """Every sample name a server exports once it has served requests (speculative
    decoding on, so its metrics are there too)."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    with RemoteServer(tiny_llama, "--speculative-config", spec) as s:
        client = s.client()
        for prompt in ("one two three one two three one two", "hello"):
            client.completions.create(model=tiny_llama, prompt=prompt, max_tokens=8)
        s.wait_idle()
        return _sample_names(_scrape(s.url))


def _alert_rules() -> list[dict]:
    with open(ALERTS) as f:
        groups = yaml.safe_load(f)["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _grafana_targets() -> list[tuple[str, str]]:
    with open(GRAFANA) as f:
        dashboard = json.load(f)
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def _names_in(expr: str) -> set[str]:
    return set(METRIC.findall(expr)) | {n for n in PROMETHEUS_OWN if re.search(rf"\b{n}\{{", expr)}


def test_alert_rules_name_exported_metrics(exported):
    rules = _alert_rules()
    assert {r["alert"] for r in rules} == {
        "PagodaDown",
        "PagodaKVCacheNearlyFull",
        "PagodaKVCacheFragmented",
        "PagodaPreemptionRateHigh",
        "PagodaWaitingQueueGrowing",
        "PagodaTTFTAboveSLO",
    }
    for rule in rules:
        names = _names_in(rule["expr"])
        assert names, rule["alert"]
        assert names <= exported | PROMETHEUS_OWN, (rule["alert"], names - exported)
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert re.fullmatch(r"\d+m", rule["for"])


def test_grafana_dashboard_names_exported_metrics(exported):
    with open(GRAFANA) as f:
        dashboard = json.load(f)
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels) >= 12
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):  # panels must not overlap
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, p["title"]
                cells.add((x, y))
        assert p["targets"], p["title"]
        for t in p["targets"]:
            names = _names_in(t["expr"])
            assert names and names <= exported, (p["title"], names - exported)
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval"}
            assert used <= variables, (p["title"], used - variables)
    # What the dashboard shows of each capability (not just any metric).
    shown = set().union(*(_names_in(e) for _, e in _grafana_targets()))
    for name in (
        "pagoda:kv_cache_usage_perc",
        "pagoda:kv_cache_fragmentation_perc",
        "pagoda:num_preemptions_total",
        "pagoda:time_to_first_token_seconds_bucket",
        "pagoda:request_time_per_output_token_seconds_bucket",
        "pagoda:generation_tokens_total",
        "pagoda:num_requests_waiting",
        "pagoda:prefix_cache_hits_total",
    ):
        assert name in shown, name


def test_rules_and_dashboard_are_valid_promql(tmp_path):
    result = _promtool("check", "rules", ALERTS)
    assert result.returncode == 0, result.stdout + result.stderr
    # The dashboard's queries as recording rules, with Grafana's variables filled in,
    # so promtool parses each one.
    rules = []
    for i, (title, expr) in enumerate(_grafana_targets()):
        expr = expr.replace("$__rate_interval", "5m")
        expr = re.sub(r"\$\w+", ".*", expr)
        rules.append({"record": f"grafana:panel_{i}", "expr": expr, "labels": {"title": title}})
    path = tmp_path / "grafana_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "grafana", "rules": rules}]}))
    result = _promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_unit_tests():
    """deploy/prometheus/alerts_test.yml: each alert fires on its condition, held for
    its `for:` time, and not on series that miss it."""
    result = _promtool("test", "rules", os.path.basename(ALERTS_TEST), cwd=os.path.dirname(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def _kv_alert_test(tmp_path, scrape: str, instance: str, expect_firing: bool) -> str:
    """A promtool unit test that holds the scraped KV usage for 10 minutes and expects
    PagodaKVCacheNearlyFull to fire (or not); returns the usage it saw."""
    from prometheus_client.parser import text_string_to_metric_families

    (usage,) = [
        s
        for f in text_string_to_metric_families(scrape)
        for s in f.samples
        if s.name == "pagoda:kv_cache_usage_perc"
    ]
    labels = {**usage.labels, "job": "pagoda", "instance": instance}
    series = "pagoda:kv_cache_usage_perc{" + ", ".join(f'{k}="{v}"' for k, v in labels.items())
    expected = []
    if expect_firing:  # labels and annotations both checked
        (rule,) = [r for r in _alert_rules() if r["alert"] == "PagodaKVCacheNearlyFull"]
        description = rule["annotations"]["description"]
        expected = [
            {
                "exp_labels": {**labels, "severity": "warning"},
                "exp_annotations": {
                    "summary": f"KV cache {_humanize_percentage(usage.value)} full on {instance}",
                    "description": description.replace(
                        "{{ $labels.model_name }}", usage.labels["model_name"]
                    ),
                },
            }
        ]
    test = {
        "rule_files": [ALERTS],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": series + "}", "values": f"{usage.value}x10"}],
                "alert_rule_test": [
                    {
                        "eval_time": "6m",
                        "alertname": "PagodaKVCacheNearlyFull",
                        "exp_alerts": expected,
                    }  # fmt: skip
                ],
            }
        ],
    }
    path = tmp_path / f"kv_{instance.replace(':', '_')}.yml"
    path.write_text(yaml.safe_dump(test))
    result = _promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    return usage.value


def _humanize_percentage(fraction: float) -> str:
    """Prometheus's humanizePercentage: 4 significant digits, trailing zeros dropped."""
    return f"{100 * fraction:.4g}%"


def test_kv_alert_fires_on_a_filled_server(tiny_llama, tmp_path):
    """A 12-block pool, filled by long requests: its scraped KV usage, held, fires the
    alert; the same server idle does not."""
    _promtool("--version")  # skip early without promtool
    args = ["--kv-cache-memory-bytes", str(12 * 8192), "--max-num-seqs", "4"]
    with RemoteServer(tiny_llama, *args) as s:
        idle = _scrape(s.url)
        client = s.client()
        threads = [
            threading.Thread(
                target=client.completions.create,
                kwargs={"model": tiny_llama, "prompt": f"fill the cache {i} " * 3,
                        "max_tokens": 150, "extra_body": {"ignore_eos": True}},
            )
            for i in range(4)
        ]  # fmt: skip
        for t in threads:
            t.start()
        full = None
        deadline = time.monotonic() + 60
        while full is None and time.monotonic() < deadline:
            text = _scrape(s.url)
            match = re.search(r"^pagoda:kv_cache_usage_perc\{.*\} (\S+)$", text, re.M)
            if float(match.group(1)) > 0.9:
                full = text
        for t in threads:
            t.join()
    assert full is not None, "the pool never passed 90%"
    assert _kv_alert_test(tmp_path, full, "full:8000", expect_firing=True) > 0.9
    assert _kv_alert_test(tmp_path, idle, "idle:8000", expect_firing=False) == 0
