"""conf/prometheusrule.yaml: a PrometheusRule whose expressions name only exported metrics."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULE = ROOT / "conf" / "prometheusrule.yaml"

# How prometheus_client exposes a family's samples, by its type.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exposed_names(registry: Any) -> set[str]:
    """Every sample name ``registry`` serves, labelled families included even before a first sample."""
    return {f.name + suffix for f in registry.collect() for suffix in SUFFIXES[f.type]}


def exported() -> set[str]:
    """What the agent's and the extender's /metrics serve, their scrape-time collectors watched."""
    from rdma_cni.agent import metrics as agent
    from rdma_cni.extender import metrics as extender

    pf = SimpleNamespace(name="pf0", capacity_tx_rate=100, used_tx_rate=0, capacity_vfs=4, used_vfs=0)
    agent.watch(SimpleNamespace(published=SimpleNamespace(pfs=[pf]), node="n1"))
    extender.watch(
        SimpleNamespace(
            cache=SimpleNamespace(views={}, reconnects=0, relists=0),
            reservations={},
            extender=SimpleNamespace(ready=threading.Event()),
        )
    )
    return exposed_names(agent.REGISTRY) | exposed_names(extender.REGISTRY)


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULE.read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    return [rule for group in doc["spec"]["groups"] for rule in group["rules"]]


def test_every_expression_names_only_exported_metrics() -> None:
    names = exported()
    assert "rdma_cni_extender_ready" in names and "rdma_cni_agent_publishes_total" in names
    for rule in rules():
        used = set(re.findall(r"\brdma_cni_\w+", rule["expr"]))
        assert used, rule["alert"]
        assert used <= names, (rule["alert"], used - names)


def test_the_check_catches_a_metric_nobody_exports() -> None:
    assert "rdma_cni_extender_ready_total" not in exported()
    assert "rdma_cni_agent_publishes" not in exported()  # a counter is only served as _total


def test_the_alerts_the_docs_describe() -> None:
    alerts = {rule["alert"]: rule for rule in rules()}
    assert set(alerts) == {
        "RdmaCniExtenderNotReady",
        "RdmaCniBindRefusals",
        "RdmaCniNodeStateStale",
        "RdmaCniExtenderWatchRestarts",
        "RdmaCniAgentNotPublishing",
        "RdmaCniVfsNearlyExhausted",
    }
    for rule in alerts.values():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"]
    assert 'reason!="no_fit"' in alerts["RdmaCniBindRefusals"]["expr"]
    docs = (ROOT / "docs" / "operations.md").read_text()
    assert "conf/prometheusrule.yaml" in docs
    for name in alerts:
        assert f"`{name}`" in docs, name
