"""The node as shipped: kubelet on containerd 2.x; Multus' and rdma-cni's DaemonSets as shipped."""

from __future__ import annotations

import filecmp
import os

import yaml

from tests.support.node import multus
from tests.support.node.node import IMAGE, REPO, Node, shipped_daemonset


def test_the_node_runs_the_shipped_daemonsets(node: Node) -> None:
    doc = node.get("node", node.name)
    conditions = {c["type"]: c["status"] for c in doc["status"]["conditions"]}
    assert conditions["Ready"] == "True", doc["status"]["conditions"]
    info = doc["status"]["nodeInfo"]
    assert info["kubeletVersion"] == node.bins["kubelet"].version
    # The CRI reports the version without its "v".
    assert info["containerRuntimeVersion"] == f"containerd://{node.bins['containerd'].version.lstrip('v')}"
    assert [a for a in doc["status"]["addresses"] if a["type"] == "InternalIP"] == [
        {"type": "InternalIP", "address": node.addresses.node}
    ]

    # conf/base/node/daemonset.yaml as applied differs from the file in its image line only.
    with open(os.path.join(REPO, "conf", "base", "node", "daemonset.yaml")) as f:
        shipped = f.read()
    changed = [
        (a, b) for a, b in zip(shipped.splitlines(), node.daemonset_text.splitlines(), strict=True) if a != b
    ]
    assert changed == [("          image: localhost/rdma-cni:0.1.0", f"          image: {IMAGE}")]
    assert node.daemonset_text == shipped_daemonset(IMAGE)
    (agent,) = node.agent_pods()
    (ds,) = [d for d in yaml.safe_load_all(shipped) if d and d["kind"] == "DaemonSet"]
    want = ds["spec"]["template"]["spec"]["containers"][0]
    got = agent["spec"]["containers"][0]
    assert got["image"] == IMAGE
    assert got["command"] == want["command"]
    assert got["resources"] == want["resources"]
    assert got["securityContext"] == want["securityContext"]

    # The agent put the image's static shim on the node's CNI path, and serves it.
    assert node.image_shim and filecmp.cmp("/opt/cni/bin/rdma-cni", node.image_shim, False)
    assert os.path.exists("/run/rdma-cni/agent/cni.sock")

    # Multus from its own manifest (only its images replaced), thick: its shim installed by its
    # init container, its configuration written by its daemon, the default network delegated.
    assert node.multus_images_replaced == [multus.UPSTREAM_IMAGE] * 2
    assert os.path.exists("/opt/cni/bin/multus-shim") and os.path.exists("/opt/cni/bin/passthru")
    with open("/etc/cni/net.d/00-multus.conf") as f:
        conf = yaml.safe_load(f)
    assert conf["type"] == "multus-shim", conf
