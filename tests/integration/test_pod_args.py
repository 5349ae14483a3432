"""The pod CNI_ARGS names, through the plugin process: ADD refuses a name Kubernetes could not have
made before touching anything; DEL releases by container ID whatever CNI_ARGS holds."""

from __future__ import annotations

import pytest

from tests.integration.conftest import Cluster, assert_node_pristine, host_names

# (what replaces the good value, the key the error must name)
BAD_NAMES = [
    ("K8S_POD_NAMESPACE", "Default", "K8S_POD_NAMESPACE"),  # upper case
    ("K8S_POD_NAMESPACE", "a" * 64, "K8S_POD_NAMESPACE"),  # a label is at most 63
    ("K8S_POD_NAMESPACE", "team.a", "K8S_POD_NAMESPACE"),  # a dot: a label, not a subdomain
    ("K8S_POD_NAME", "x" * 254, "K8S_POD_NAME"),  # a subdomain is at most 253
    ("K8S_POD_NAME", "../../nodes/x", "K8S_POD_NAME"),
    ("K8S_POD_NAME", "", "K8S_POD_NAME"),  # a namespace and no pod
    ("K8S_POD_UID", "not-a-uid", "K8S_POD_UID"),
]


def _with(cni_args: str, key: str, value: str) -> str:
    items = [item for item in cni_args.split(";") if not item.startswith(f"{key}=")]
    return ";".join([*items, f"{key}={value}"])


@pytest.mark.parametrize(("key", "value", "named"), BAD_NAMES, ids=lambda v: str(v)[:20])
def test_add_refuses_a_pod_kubernetes_could_not_name(
    cluster: Cluster, key: str, value: str, named: str
) -> None:
    pod = cluster.pod([{"max_tx_rate": 100}])
    bad = {**pod, "CNI_ARGS": _with(pod["CNI_ARGS"], key, value)}
    before = cluster.api.request_count
    out = cluster.run("ADD", bad, cluster.conf())
    assert out.doc is not None and out.doc["code"] == 4, out.doc
    assert named in out.doc["msg"] and len(out.doc["msg"]) < 512, out.doc
    # Nothing changed: no API call, no record, no lease, every VF home at rest.
    assert cluster.api.request_count == before
    assert_node_pristine(cluster)
    # The runtime DELs what it failed to ADD, with the same CNI_ARGS: that must succeed.
    assert cluster.run("DEL", bad, cluster.conf()).ok
    assert_node_pristine(cluster)


def test_del_releases_by_container_id_whatever_the_pod_names(cluster: Cluster) -> None:
    pod = cluster.pod([{"max_tx_rate": 100}, {}])
    conf = cluster.conf()
    add = cluster.run("ADD", pod, conf)
    assert add.ok, add.doc
    assert cluster.records and cluster.ipam_allocations()
    hostile = "IgnoreUnknown=1;K8S_POD_NAMESPACE=Team.A;K8S_POD_NAME=../..;K8S_POD_UID=\x1b[31m"
    out = cluster.run("DEL", {**pod, "CNI_ARGS": hostile}, conf)
    assert out.ok, out.doc
    assert_node_pristine(cluster)
    assert host_names(cluster)
