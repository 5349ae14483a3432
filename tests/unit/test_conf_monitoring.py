"""conf/monitoring/: the alerts docs/operations.md describes, on metrics that exist, scraped where they are.

There is no PromQL parser here, so each expression is checked for what can go wrong without
one: every metric it names is one the agent's or the extender's prometheus_client registry
exposes (collected from the registries themselves, each collector fed a running object's
stand-in, so a metric renamed in the code fails here), or one of the few named in
:data:`EXTERNAL` with whose exporter; its brackets balance; its thresholds are conf/'s own
settings; the job labels it names are the metrics Services' names, which the ServiceMonitors
select.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rdma_cni.extender.options import parser as extender_parser
from rdma_cni.install import command as install_command

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "conf" / "monitoring" / "prometheus-rules.yaml"
_DURATION = re.compile(r"\d+[smhdw]")


MONITORS = ROOT / "conf" / "monitoring" / "servicemonitors.yaml"
# Names the rules use that rdma-cni does not export, and who does.
EXTERNAL = {
    "up": "Prometheus itself, per scraped target",
    "kube_daemonset_status_number_unavailable": "kube-state-metrics (kube-prometheus ships it)",
}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exported_metrics() -> set[str]:
    """Every sample name the agent's and the extender's registries expose, read from the registries.

    The collectors that read a running object at scrape time (the extender's service, the agent's
    publisher and NRI plugin) are fed stand-ins of those objects, so that they yield their families.
    """
    import threading
    from types import SimpleNamespace

    from rdma_cni.agent import metrics as agent
    from rdma_cni.extender import metrics as extender

    class Retrier(list):  # type: ignore[type-arg]
        outcomes: dict[str, int] = {}

    extender.watch(
        SimpleNamespace(
            cache=SimpleNamespace(views={}, reconnects=0, relists=0),
            reservations=[],
            retrier=Retrier(),
            extender=SimpleNamespace(ready=threading.Event()),
            serving_tls=SimpleNamespace(expiry={}, reloads={}, failing=False),
        )
    )
    agent.watch(SimpleNamespace(published=None, node="n"))
    agent.watch_nri(SimpleNamespace(state=""))
    names = set()
    for registry in (agent.REGISTRY, extender.REGISTRY):
        for family in registry.collect():
            names |= {family.name + suffix for suffix in _SUFFIXES[family.type]}
    return names


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label matchers, range
    selectors, grouping lists, functions, keywords and numbers are taken out."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    keywords = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
    return {
        name
        for name, call in re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b\s*(\(?)", text)
        if not call and name not in keywords
    }


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"} and set(doc["spec"]) == {"groups"}
    return [rule for group in doc["spec"]["groups"] for rule in group["rules"]]


def test_every_rule_is_a_complete_alert() -> None:
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names)) >= 5
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert {"summary", "description"} <= set(rule["annotations"])
        assert "for" not in rule or _DURATION.fullmatch(rule["for"]), rule


def test_the_registries_are_read_not_guessed() -> None:
    """A metric renamed in the code is a name the rules no longer find: the set is the code's."""
    names = exported_metrics()
    assert {"rdma_cni_extender_ready", "rdma_cni_agent_serving", "rdma_cni_agent_nri_registered"} <= names
    assert "rdma_cni_extender_certificate_expiry_timestamp_seconds" in names
    assert "rdma_cni_extender_decisions_total" in names and "rdma_cni_agent_publish_seconds_count" in names
    assert promql_metric_names('sum by (reason) (increase(a_total{reason!="x"}[15m])) > 0') == {"a_total"}
    assert promql_metric_names('absent(up{job="j"} == 1) or time() - b > 30 * 86400') == {"up", "b"}


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_expressions_name_only_exported_metrics(rule: dict[str, Any]) -> None:
    expr = rule["expr"]
    named = promql_metric_names(expr)
    assert named and named <= exported_metrics() | set(EXTERNAL), sorted(named - exported_metrics())
    for opening, closing in ("()", "[]", "{}"):
        depth = 0
        for ch in expr:
            depth += (ch == opening) - (ch == closing)
            assert depth >= 0, expr
        assert depth == 0, expr


def _threshold(alert: str) -> float:
    (rule,) = [r for r in rules() if r["alert"] == alert]
    return float(re.search(r">\s*(\d+)\s*$", rule["expr"]).group(1))  # type: ignore[union-attr]


def test_thresholds_are_conf_s_own_settings() -> None:
    """Stale means what the shipped extender's --max-state-age means; not publishing, three heartbeats."""
    conf = [
        d
        for d in yaml.safe_load_all((ROOT / "conf" / "base/extender/scheduler-extender.yaml").read_text())
        if d
    ]
    (deployment,) = [d for d in conf if d["kind"] == "Deployment"]
    (extender,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "extender"]
    max_age = extender_parser().parse_args(extender["command"][2:]).max_state_age
    assert _threshold("RdmaCniNodeStateStale") == max_age
    heartbeat = install_command._parser().parse_args(["--watch"]).node_state_heartbeat
    assert _threshold("RdmaCniAgentNotPublishing") == 3 * heartbeat


def test_operations_md_lists_the_rules() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    assert "conf/monitoring/prometheus-rules.yaml" in text
    assert all(f"`{r['alert']}`" in text for r in rules())


def _services() -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d
        for d in yaml.safe_load_all((ROOT / "conf" / "base/node/metrics.yaml").read_text())
        if d
    }


def test_the_service_monitors_select_the_metrics_services() -> None:
    """Each metrics Service of conf/base/node/metrics.yaml has one ServiceMonitor, by its port's name."""
    monitors = [d for d in yaml.safe_load_all(MONITORS.read_text()) if d]
    assert {(m["apiVersion"], m["kind"]) for m in monitors} == {
        ("monitoring.coreos.com/v1", "ServiceMonitor")
    }
    services = _services()
    for name, service in services.items():
        (monitor,) = [
            m
            for m in monitors
            if m["metadata"]["namespace"] == service["metadata"]["namespace"]
            and m["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        ]
        ports = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports, name
        assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])


def test_jobs_the_rules_name_are_the_scraped_services() -> None:
    """The Prometheus Operator labels a ServiceMonitor's targets job=<the Service's name>."""
    jobs = {job for r in rules() for job in re.findall(r'job="([^"]+)"', r["expr"])}
    assert jobs and jobs <= set(_services())


def test_the_rule_carries_labels_a_rule_selector_matches() -> None:
    labels = yaml.safe_load(RULES.read_text())["metadata"]["labels"]
    # kube-prometheus' ruleSelector; the chart's release label is the operator's to add.
    assert labels["role"] == "alert-rules" and labels["prometheus"] == "k8s"


def test_absent_alerts_cover_the_extender_and_the_agents() -> None:
    """An extender or agents that crash-loop, cannot be pulled or are not scheduled export nothing:
    only absent() (or kube-state-metrics' view of the DaemonSet) sees them."""
    by_name = {r["alert"]: r["expr"] for r in rules()}
    assert by_name["RdmaCniExtenderDown"].startswith("absent(rdma_cni_extender_ready")
    assert by_name["RdmaCniAgentsAbsent"].startswith('absent(up{job="rdma-cni-agent-metrics"}')
    assert "kube_daemonset_status_number_unavailable" in by_name["RdmaCniAgentUnavailable"]
    assert 'rdma_cni_agent_serving{part="cni"}' in by_name["RdmaCniAgentNotServingCni"]
    assert "rdma_cni_agent_nri_registered" in by_name["RdmaCniAgentNriNotRegistered"]
    assert (
        "rdma_cni_extender_certificate_expiry_timestamp_seconds"
        in by_name["RdmaCniExtenderCertificateExpiring"]
    )
