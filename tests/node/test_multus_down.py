"""A pod deleted while Multus' daemon is down: its DELs never reach rdma-cni, the agent releases it.

Multus' thick shim answers DEL itself, with success, when its daemon does not answer
(multus-cni v4.3.0 ``pkg/server/api/shim.go``, "No error in DEL (as of CNI spec)"). kubelet's
StopPodSandbox and RemovePodSandbox both succeed that way, the sandbox is forgotten, and no
runtime here calls GC. rdma-cni's own shim spools a DEL it cannot hand over; Multus' does not.
What releases the pod in the same boot: the agent's periodic pass (rdma_cni/agent/orphanpass.py,
rdma_cni/node/orphans.py) finds its namespace gone and its VFs back in the host (moved home here
as the kernel moves a real VF) and releases its record, VF, rate and lease as a DEL would. Should
it not, the node is put back at rest as a reboot would (the leaked records marked as an earlier
boot's, the agent restarted) so that the tests after it start clean.
"""

from __future__ import annotations

from typing import Any

import yaml

from tests.node.conftest import held, release_as_a_reboot_would, wait_at_rest
from tests.support.node import multus, pods
from tests.support.node.node import MULTUS_IMAGE, Node
from tests.support.waiting import wait_for


def multus_pods(node: Node) -> list[dict[str, Any]]:
    return list(node.get("pods", "-n", "kube-system", "-l", "app=multus")["items"])


def test_a_pod_deleted_while_multus_is_down_is_released(node: Node, namespace: str) -> None:
    pods.create(node, pods.pod_manifest(namespace, "gone", "default/rdma-net", [{"min_tx_rate": 1000}]))
    pods.wait_running(node, namespace, ["gone"])
    sandbox = node.sandbox(namespace, "gone")["status"]["id"]
    vfs = node.vfs_of(sandbox)
    node.kubectl(
        "delete", "daemonset", "kube-multus-ds", "-n", "kube-system", "--wait=true", "--timeout=120s"
    )
    wait_for(lambda: not multus_pods(node), 120, "Multus' daemon gone")
    try:
        pods.delete(node, namespace, "gone")
        pods.wait_gone(node, namespace, ["gone"])
        # kubelet stopped and removed the sandbox: both through Multus' shim, both "succeeded".
        wait_for(
            lambda: not [s for s in node.containerd.crictl_json("pods")["items"] if s["id"] == sandbox],
            180,
            "kubelet to remove the sandbox",
        )
        node.vfs_back_from_gone_namespaces(vfs, reboot=False)
    finally:
        docs, _ = multus.thick_manifest(MULTUS_IMAGE)
        node.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        wait_for(
            lambda: [p for p in multus_pods(node) if p["status"].get("phase") == "Running"], 180, "Multus"
        )
    try:
        wait_at_rest(node, 60)
    finally:
        if held(node):
            release_as_a_reboot_would(node)
    # By the agent's same-boot pass, which says so (no DEL reached rdma-cni, no reboot came).
    assert f"whose pod namespace is gone though no DEL came: {sandbox}/" in node.agent_log()
