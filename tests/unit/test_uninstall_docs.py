"""docs/deploy.md's uninstall names every object conf/ installs, so that a manifest added later is not left.

The cluster tier runs the sequence and scans every listable kind for what is left
(tests/cluster/test_uninstall_cluster.py); this catches the omission without a cluster.
"""

from __future__ import annotations

import re

import yaml

from tests.support.docblocks import ROOT, blocks
from tests.support.kube.applyconf import manifests

DEPLOY = ROOT / "docs" / "deploy.md"


def uninstall_text() -> str:
    text = DEPLOY.read_text()
    begin = text.index("## Uninstall")
    start = text[:begin].count("\n") + 1
    end = text[: text.index("\n## ", begin + 1)].count("\n") + 1
    return "\n".join(b.text for b in blocks(DEPLOY) if start <= b.line <= end and b.is_shell)


def test_every_conf_manifest_is_deleted() -> None:
    deleted = set(re.findall(r"-f conf/([\w./-]+\.yaml)", uninstall_text()))
    assert set(manifests()) - {"base/node/daemonset.yaml"} <= deleted, sorted(set(manifests()) - deleted)
    # The DaemonSet and both extenders' Deployments by name, before anything else of theirs.
    text = uninstall_text()
    for workload in (
        "daemonset/rdma-cni",
        "deployment/rdma-scheduler",
        "deployment/rdma-cni-scheduler-extender",
    ):
        assert workload in text
    assert text.index("daemonset/rdma-cni") < text.index("-f conf/base/node/rbac.yaml")


def test_what_the_operator_made_by_hand_and_the_lease_are_deleted() -> None:
    """The Secret and ConfigMap of the mutual-TLS steps, and rdma-scheduler's leader-election lease."""
    text = uninstall_text()
    for obj in (
        "secret/rdma-cni-scheduler-extender-tls",
        "configmap/rdma-cni-scheduler-extender-client-ca",
        "lease/rdma-scheduler",
    ):
        assert obj in text
    lease = [
        d
        for d in yaml.safe_load_all((ROOT / "conf" / "base/extender/scheduler-extender.yaml").read_text())
        if d and d["kind"] == "Role"
    ]
    assert any("rdma-scheduler" in r.get("resourceNames", []) for role in lease for r in role["rules"])


def test_the_node_status_keys_are_the_agents() -> None:
    from rdma_cni.shared import nodestate

    text = uninstall_text()
    for key in (nodestate.VF_RESOURCE, nodestate.BANDWIDTH_RESOURCE):
        assert text.count(f'"{key}":null') == 2  # capacity and allocatable
    assert f"{nodestate.ANNOTATION}-" in text
