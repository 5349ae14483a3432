"""A pod with a ResourceClaim, prepared by the real kubelet through the agent's DRA plugin.

The DRA path end to end on a real node (docs/dra.md): the agent, conf/base/node/daemonset.yaml as shipped
but for the network configurations an operator adds (a ConfigMap and ``--network-config``, as
the manifest's comment says: conf/'s ``rdma-net`` on the first PF, a DRA network on the second),
publishes the second PF as a ResourceSlice through conf/dra.yaml's rights; the pod refers to the
ResourceClaimTemplate the built ``rdma-cni claim`` prints; the default kube-scheduler v1.37.2
allocates the claim; kubelet v1.37.2 finds the agent's plugin in its plugin registry (the
DaemonSet's hostPath mounts), calls NodePrepareResources before the sandbox, and Multus' ADD
through the shim applies the allocated bandwidth as the VF's guaranteed rate. Deleting the pod
runs DEL and kubelet's NodeUnprepareResources: nothing is left held or prepared. The node is put
back as the other tests expect it (the shipped DaemonSet, no DRA objects).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.node.conftest import wait_at_rest
from tests.support.kube.controlplane import REPO
from tests.support.kube.dra import allocation_of, claim_template, devices, pod_claim
from tests.support.node import pods
from tests.support.node.node import STATE_DIR, Node, apply_daemonset, second_network, wait_agent_ready
from tests.support.waiting import wait_for

DRA_NETWORK = "rdma-dra"
DRA_SUBNET = "192.168.176.0/20"
CONFIGMAP = "rdma-cni-networks"
MOUNT = "/etc/rdma-cni/network"
PREPARED = os.path.join(STATE_DIR, "prepared")
REQUEST = [{"min_tx_rate": 15000, "max_tx_rate": 20000}]


def network_configs(node: Node) -> dict[str, dict[str, Any]]:
    """The agent's two networks: conf/'s rdma-net on the first PF, the DRA network on the second
    (a PF belongs to one path: docs/dra.md#sharing-a-node)."""
    first, second = (pf.name for pf in node.sim.pfs)
    rdma_net = json.loads(second_network("rdma-net", "192.168.128.0/20")["spec"]["config"])
    rdma_net["pfs"] = [first]
    dra = json.loads(second_network(DRA_NETWORK, DRA_SUBNET)["spec"]["config"])
    dra.update({"dra": True, "pfs": [second]})
    return {"rdma-net.json": rdma_net, f"{DRA_NETWORK}.json": dra}


def daemonset_with_networks(text: str, files: list[str]) -> str:
    """conf/base/node/daemonset.yaml (as the tier applies it) with the network configurations mounted from
    the ConfigMap and named by ``--network-config``, as its comment tells an operator to."""
    doc = yaml.safe_load(text)
    spec = doc["spec"]["template"]["spec"]
    (container,) = [c for c in spec["containers"] if c["name"] == "install"]
    container["command"] += [f"--network-config={MOUNT}/{name}" for name in files]
    container["volumeMounts"].append({"name": "network-config", "mountPath": MOUNT, "readOnly": True})
    spec["volumes"].append({"name": "network-config", "configMap": {"name": CONFIGMAP}})
    return str(yaml.safe_dump(doc))


def conf_dra() -> str:
    with open(os.path.join(REPO, "conf", "dra.yaml")) as f:
        return f.read()


def rollout(node: Node) -> None:
    """The DaemonSet's new agent Ready and the old one gone (maxSurge 1: both run for a while)."""
    node.kubectl("rollout", "status", "daemonset/rdma-cni", "-n", "kube-system", "--timeout=300s")
    wait_agent_ready(node, 240)
    wait_for(lambda: len(node.agent_pods()) == 1, 120, "the old agent pod gone")


@pytest.fixture
def dra_node(node: Node) -> Iterator[Node]:
    """The node's agent with a DRA network; the shipped DaemonSet and no DRA object after."""
    configs = network_configs(node)
    node.kubectl("apply", "-f", "-", input=conf_dra())
    nad = second_network(DRA_NETWORK, DRA_SUBNET)
    nad["spec"]["config"] = json.dumps(configs[f"{DRA_NETWORK}.json"])
    node.kubectl("apply", "-f", "-", input=json.dumps(nad))
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONFIGMAP, "namespace": "kube-system"},
        "data": {name: json.dumps(config) for name, config in configs.items()},
    }
    node.kubectl("apply", "-f", "-", input=json.dumps(configmap))
    text = daemonset_with_networks(node.daemonset_text, sorted(configs))
    node.kubectl("apply", "--server-side", "--field-manager=rdma-cni-operator", "-f", "-", input=text)
    try:
        rollout(node)
        yield node
    finally:
        apply_daemonset(node)  # the shipped one again
        rollout(node)
        node.kubectl("delete", "--ignore-not-found", "configmap", CONFIGMAP, "-n", "kube-system")
        node.kubectl("delete", "--ignore-not-found", "network-attachment-definition", DRA_NETWORK)
        node.kubectl("delete", "resourceslices", "--field-selector=spec.driver=rdma-cni.io")
        node.kubectl("delete", "--ignore-not-found", "-f", "-", input=conf_dra())


def preparations() -> dict[str, dict[str, Any]]:
    """The node's DRA preparations (``<stateDir>/prepared``), by claim uid."""
    if not os.path.isdir(PREPARED):
        return {}
    out = {}
    for name in os.listdir(PREPARED):
        if name.endswith(".json"):
            with open(os.path.join(PREPARED, name)) as f:
                out[name.removesuffix(".json")] = json.load(f)
    return out


def test_kubelet_prepares_a_claim_and_add_applies_the_allocated_rate(dra_node: Node, namespace: str) -> None:
    node = dra_node
    first, second = (pf.name for pf in node.sim.pfs)
    # The agent publishes the DRA network's PF, and only that one, as a device of its node.
    published = wait_for(lambda: devices(node.cp, node.name) or None, 120, "the agent's ResourceSlice")
    assert sorted(published) == [second], published
    assert published[second]["capacity"]["bandwidth"]["value"] in ("100k", "100000")

    template = claim_template(json.dumps(REQUEST), "trainer", DRA_NETWORK, namespace)
    node.kubectl("create", "-f", "-", input=json.dumps(template))
    pod = pods.pod_manifest(namespace, "dra-pod", f"default/{DRA_NETWORK}")
    pod["spec"].pop("schedulerName")  # the default kube-scheduler: its DRA allocator
    pod["spec"]["resourceClaims"] = [{"name": "rdma", "resourceClaimTemplateName": "trainer"}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "rdma"}]}
    pods.create(node, pod)
    running = pods.wait_running(node, namespace, ["dra-pod"], timeout=240)["dra-pod"]
    assert running["spec"]["nodeName"] == node.name

    # kube-scheduler allocated a 15000 Mbit/s share of the DRA PF's device.
    claim = pod_claim(node.cp, namespace, "dra-pod")
    assert claim is not None
    (result,) = allocation_of(claim)
    assert result["driver"] == "rdma-cni.io" and result["pool"] == node.name
    assert result["device"] == published[second]["name"]
    assert result["consumedCapacity"]["bandwidth"] in ("15k", "15000"), result
    assert [r["uid"] for r in claim["status"]["reservedFor"]] == [running["metadata"]["uid"]]

    # kubelet registered the agent's plugin and called NodePrepareResources (the only writer of a
    # preparation): the claim's VF chosen on that PF for this pod.
    log = node.agent_log()
    assert "DRA: kubelet registered the rdma-cni.io plugin" in log, log[-3000:]
    prepared = preparations()
    assert list(prepared) == [claim["metadata"]["uid"]], prepared
    (vf,) = prepared[claim["metadata"]["uid"]]["vfs"]
    assert (vf["pf"], vf["min_tx_rate"], vf["max_tx_rate"]) == (second, 15000, 20000), vf
    assert prepared[claim["metadata"]["uid"]]["pod_uid"] == running["metadata"]["uid"]

    # Multus' ADD through the shim took exactly that VF, at the allocated rate and the cap.
    sandbox = node.sandbox(namespace, "dra-pod")["status"]["id"]
    (record,) = [r for r in node.record_docs() if r["container_id"] == sandbox]
    assert record["network"] == DRA_NETWORK
    assert [(v["pf"], int(v["vf"]), v["min_tx_rate"], v["max_tx_rate"]) for v in record["vfs"]] == [
        (second, int(vf["vf"]), 15000, 20000)
    ]
    assert node.pf_settings()[f"{second}/{vf['vf']}"]["rate"] == [15000, 20000]
    settings = node.pf_settings()
    assert not [
        k for k, s in settings.items() if k.startswith(f"{first}/") and s.get("rate", [0, 0]) != [0, 0]
    ]
    status = pods.network_status(node.pod(namespace, "dra-pod") or running)
    assert [(s["name"], s["interface"]) for s in status][1:] == [(f"default/{DRA_NETWORK}", "net1")], status
    seen = node.exec(namespace, "dra-pod", "c", "ip", "-o", "link")
    assert re.search(r"^\d+: net1[@:]", seen, re.M), seen  # busybox: "29606: net1@if29605: <...>"

    # Deleted: DEL gives the VF back, kubelet's NodeUnprepareResources drops the preparation.
    pods.delete(node, namespace, "dra-pod")
    pods.wait_gone(node, namespace, ["dra-pod"])
    wait_at_rest(node)
    wait_for(lambda: not preparations(), 120, "the claim unprepared")
