"""conf/monitoring/prometheus-rules.yaml: the alerts docs/operations.md describes, on metrics that exist.

There is no PromQL parser here, so each expression is checked for what can go wrong without
one: every metric it names is one the agent or the extender exports (with a histogram's or a
counter's suffixes), its brackets balance, and its thresholds are conf/'s own settings.
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


def exported_metrics() -> set[str]:
    """Every sample name the agent and the extender can expose."""
    source = "".join((ROOT / "rdma_cni" / f).read_text() for f in ("agent/metrics.py", "extender/metrics.py"))
    names = set()
    for kind, name in re.findall(r'(\w+)\(\s*"(rdma_cni_\w+)"', source):
        if kind.startswith("Counter"):
            names |= {f"{name.removesuffix('_total')}_total"}
        elif kind.startswith("Histogram"):
            names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
        else:
            names.add(name)
    return names


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


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_expressions_name_only_exported_metrics(rule: dict[str, Any]) -> None:
    expr = rule["expr"]
    named = set(re.findall(r"\brdma_cni_\w+", expr))
    assert named and named <= exported_metrics(), sorted(named - exported_metrics())
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
    conf = [d for d in yaml.safe_load_all((ROOT / "conf" / "scheduler-extender.yaml").read_text()) if d]
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
