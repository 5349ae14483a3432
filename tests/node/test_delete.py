"""Pods leave nothing behind: deleted, force-deleted while kubelet is down, and while the agent is rolled.

Whatever way a pod goes, every VF comes home, every record and lease goes, and the PF-side
rates are reset (:func:`tests.node.conftest.held` is empty again).
"""

from __future__ import annotations

import threading
import time

from tests.node.conftest import held, wait_at_rest
from tests.support.node import pods
from tests.support.node.node import Node, wait_agent_ready
from tests.support.waiting import wait_for

ONE = [{"min_tx_rate": 2000, "max_tx_rate": 5000}]


def test_a_pod_force_deleted_while_kubelet_is_down_is_released_when_kubelet_returns(
    node: Node, namespace: str
) -> None:
    assert node.kubelet is not None
    pods.create(node, pods.pod_manifest(namespace, "orphan", "default/rdma-net", ONE))
    pods.wait_running(node, namespace, ["orphan"])
    sandbox = node.sandbox(namespace, "orphan")["status"]["id"]
    assert [r["container_id"] for r in node.record_docs()] == [sandbox]

    node.kubelet.stop()
    try:
        # The API forgets the pod at once; its sandbox and VF stay, with nobody to release them.
        pods.delete(node, namespace, "orphan", force=True)
        pods.wait_gone(node, namespace, ["orphan"], timeout=30)
        time.sleep(2)
        assert [r["container_id"] for r in node.record_docs()] == [sandbox]
    finally:
        node.kubelet.start()
    # kubelet finds a running pod the API no longer has, kills it and stops its sandbox: the DEL.
    wait_at_rest(node, 120)
    # Stopped (kubelet's garbage collection removes it later).
    assert not [
        s
        for s in node.containerd.crictl_json("pods")["items"]
        if s["id"] == sandbox and s["state"] == "SANDBOX_READY"
    ]


def test_pods_come_and_go_while_the_agent_is_rolled(node: Node, namespace: str) -> None:
    """``kubectl rollout restart`` of the DaemonSet (maxSurge 1: the new agent beside the old one
    until Ready) while pods are created and deleted two at a time: none lost, none stuck."""
    (before,) = node.agent_pods()
    errors: list[str] = []
    done = threading.Event()
    cycles: list[float] = []

    def churn() -> None:
        n = 0
        while not done.is_set() and not errors:
            names = [f"churn-{n}", f"churn-{n + 1}"]
            n += 2
            start = time.monotonic()
            try:
                pods.create(node, *(pods.pod_manifest(namespace, x, "default/rdma-net", ONE) for x in names))
                pods.wait_running(node, namespace, names, timeout=150)
                pods.delete(node, namespace, *names)
                pods.wait_gone(node, namespace, names, timeout=150)
            except AssertionError as exc:
                errors.append(f"{names}: {exc}")
            cycles.append(time.monotonic() - start)

    worker = threading.Thread(target=churn, name="churn", daemon=True)
    worker.start()
    try:
        wait_for(lambda: cycles or errors, 180, "a first create/delete cycle")
        node.kubectl("rollout", "restart", "daemonset/rdma-cni", "-n", "kube-system")
        node.kubectl("rollout", "status", "daemonset/rdma-cni", "-n", "kube-system", "--timeout=300s")
        rolled = len(cycles)
        # Keep churning on the new agent for two more cycles.
        wait_for(lambda: len(cycles) >= rolled + 2 or errors, 300, "two cycles on the new agent")
    finally:
        done.set()
        worker.join(400)
    assert not errors, errors
    wait_for(lambda: len(node.agent_pods()) == 1, 60, "the old agent pod gone")
    (after,) = node.agent_pods()
    assert after["metadata"]["uid"] != before["metadata"]["uid"]
    wait_agent_ready(node)
    wait_at_rest(node, 120)
    assert len(cycles) >= 3, cycles
    assert not held(node)
