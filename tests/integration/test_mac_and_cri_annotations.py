"""What real runtimes pass besides the pod's name, through the plugin process on the simulated node.

podman: ``MAC=`` in CNI_ARGS; containerd's CRI: the pod's annotations in
runtimeConfig, which need no API server at all.
"""

from __future__ import annotations

import json
import subprocess

from tests.integration.conftest import Cluster, addresses_in, assert_node_pristine, ns_name

CRI = "io.kubernetes.cri.pod-annotations"


def pod_link(ns: str, name: str) -> dict[str, str]:
    out = subprocess.run(
        ["ip", "-n", ns, "-j", "link", "show", name], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)[0]


def pf_macs(cluster: Cluster) -> dict[str, str]:
    """PF-side MACs that are set (the stand-in lists a VF once it was touched, at rest as zeros)."""
    return {
        f"{pf}/{vf}": s["mac"]
        for pf, table in cluster.node.vf_state().get("pfs", {}).items()
        for vf, s in table.items()
        if s.get("mac", "00:00:00:00:00:00") != "00:00:00:00:00:00"
    }


def test_cni_args_mac_sets_the_first_interface(cluster: Cluster) -> None:
    pod = cluster.pod([{}, {}])
    before = pf_macs(cluster)
    pod["CNI_ARGS"] += ";MAC=02:5A:00:00:13:01"
    conf = cluster.conf()
    add = cluster.run("ADD", pod, conf)
    assert add.ok, add.doc
    assert add.doc is not None and add.doc["interfaces"][0]["mac"] == "02:5a:00:00:13:01"
    assert pod_link(ns_name(pod), "net1")["address"] == "02:5a:00:00:13:01"
    assert pod_link(ns_name(pod), "net1-1")["address"] != "02:5a:00:00:13:01"
    assert "02:5a:00:00:13:01" in pf_macs(cluster).values()  # PF-side too, as a real VF needs
    assert cluster.run("DEL", pod, conf).ok
    assert pf_macs(cluster) == before
    assert_node_pristine(cluster)


def test_bad_mac_from_either_source_is_code_7_and_changes_nothing(cluster: Cluster) -> None:
    pod = cluster.pod([{}])
    bad_args = {**pod, "CNI_ARGS": pod["CNI_ARGS"] + ";MAC=02:00:00:00:01"}
    out = cluster.run("ADD", bad_args, cluster.conf())
    assert out.doc is not None and out.doc["code"] == 7 and "CNI_ARGS MAC" in out.doc["msg"], out.doc
    out = cluster.run("ADD", pod, cluster.conf(runtimeConfig={"mac": "01:00:5e:00:00:01"}))
    assert out.doc is not None and out.doc["code"] == 7 and "runtimeConfig.mac" in out.doc["msg"], out.doc
    assert cluster.api.request_count == 0
    assert_node_pristine(cluster)


def test_cri_annotations_need_no_api_server(cluster: Cluster) -> None:
    """containerd with the capability: the request straight from the runtime, no kubeconfig at all."""
    pod = cluster.pod(None)  # the API stand-in knows the pod without the annotation
    annotations = {"rdma_interfaces_required": json.dumps([{"min_tx_rate": 1000}, {}, {}])}
    conf = cluster.conf(kubeconfig=None, runtimeConfig={CRI: annotations})
    add = cluster.run("ADD", pod, conf)
    assert add.ok, add.doc
    assert add.doc is not None and [i["name"] for i in add.doc["interfaces"]] == ["net1", "net1-1", "net1-2"]
    inside = addresses_in(ns_name(pod))
    assert all(inside[i["name"]] for i in add.doc["interfaces"])
    assert cluster.api.request_count == 0
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def test_cri_null_annotations_get_the_default_without_the_api(cluster: Cluster) -> None:
    pod = cluster.pod([{}, {}, {}])  # what the API would say is not asked
    conf = cluster.conf(kubeconfig=None, defaultRequest=[{}, {}], runtimeConfig={CRI: None})
    add = cluster.run("ADD", pod, conf)
    assert add.ok and add.doc is not None and len(add.doc["interfaces"]) == 2, add.doc
    assert cluster.api.request_count == 0
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)
