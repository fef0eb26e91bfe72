"""deploy/kubernetes/: the manifests validate against Kubernetes' own schemas
(kubernetes-validate, strict: unknown fields fail), their commands parse with
pagoda's CLI, and the names that tie them together agree (Services' selectors and
pods' labels, the router's --discover-dns and the headless Service, the HPA's metric
and prometheus-adapter's rule and the engine's gauge)."""

from __future__ import annotations

import glob
import os
import re

import pytest
import yaml

from tests.helpers import ROOT

KUBERNETES_VERSION = "1.30.0"


def documents() -> list[dict]:
    docs = []
    for path in sorted(glob.glob(os.path.join(ROOT, "deploy", "kubernetes", "*.yaml"))):
        with open(path) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    return docs


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


def test_manifests_validate_against_the_kubernetes_schemas():
    import kubernetes_validate

    docs = documents()
    assert {d["kind"] for d in docs} >= {
        "Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"
    }  # fmt: skip
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    bad = {**docs[0], "spec": {**docs[0]["spec"], "replica": 2}}  # a typo must fail
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_commands_parse_and_names_agree():
    from pagoda.entrypoints.cli import build_parser
    from pagoda.metrics import _GAUGES as GAUGES

    deployments, services = by_kind("Deployment"), by_kind("Service")
    parsed = {}
    for name, d in deployments.items():
        (container,) = d["spec"]["template"]["spec"]["containers"]
        assert container["command"][0] == "pagoda"
        parsed[name] = build_parser().parse_args(container["command"][1:] + container["args"])
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
    replica_labels = deployments["pagoda-replica"]["spec"]["template"]["metadata"]["labels"]
    router_labels = deployments["pagoda-router"]["spec"]["template"]["metadata"]["labels"]
    assert services["pagoda-replicas"]["spec"]["clusterIP"] == "None"
    assert services["pagoda-replicas"]["spec"]["selector"].items() <= replica_labels.items()
    assert services["pagoda"]["spec"]["selector"].items() <= router_labels.items()
    host, port = parsed["pagoda-router"].discover_dns.split(":")
    assert host == "pagoda-replicas"
    assert int(port) == services["pagoda-replicas"]["spec"]["ports"][0]["port"]
    assert parsed["pagoda-replica"].port == int(port)

    (hpa,) = by_kind("HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"]["name"] == "pagoda-replica"
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    config = yaml.safe_load(by_kind("ConfigMap")["prometheus-adapter"]["data"]["config.yaml"])
    (rule,) = [r for r in config["rules"] if r["name"]["as"] == metric]
    series = re.match(r"([\w:]+)\{", rule["seriesQuery"]).group(1)
    assert series in GAUGES  # a gauge every engine exports
    assert re.fullmatch(rule["name"]["matches"], series)
