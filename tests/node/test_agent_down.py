"""What kubelet does with an RDMA pod while the agent is not there, and after it comes back.

The DaemonSet is deleted (its agent pod goes, the socket with it), an RDMA pod is created, and
then conf/base/node/daemonset.yaml is applied again as the tier applied it. While the agent is away the
shim answers ADD with code 11 ("try again later") and kubelet keeps the pod ContainerCreating,
retrying its sandbox; each failed sandbox's DEL is spooled by the shim and run by the agent when
it is back. The pod then runs with its VFs, and once deleted nothing is held.
"""

from __future__ import annotations

import time

from tests.node.conftest import wait_at_rest
from tests.support.node import pods
from tests.support.node.node import Node, apply_daemonset, wait_agent_ready
from tests.support.waiting import wait_for


def test_a_pod_waits_for_the_agent_and_runs_once_it_is_back(node: Node, namespace: str) -> None:
    node.kubectl("delete", "daemonset", "rdma-cni", "-n", "kube-system", "--wait=true", "--timeout=120s")
    wait_for(lambda: not node.agent_pods(), 120, "the agent pod gone")
    try:
        pods.create(node, pods.pod_manifest(namespace, "early", "default/rdma-net", [{"min_tx_rate": 1000}]))

        def refused() -> list[str]:
            return [e for e in pods.events(node, namespace, "early") if "try again later" in e]

        wait_for(refused, 120, "kubelet told to try again later")
        time.sleep(5)
        early = node.pod(namespace, "early")
        assert early is not None and early["status"].get("phase") == "Pending", early
        assert not node.records()
    finally:
        apply_daemonset(node)
    wait_agent_ready(node)
    pods.wait_running(node, namespace, ["early"], timeout=300)
    sandbox = node.sandbox(namespace, "early")["status"]["id"]
    assert [r["container_id"] for r in node.record_docs()] == [sandbox]
    pods.delete(node, namespace, "early")
    pods.wait_gone(node, namespace, ["early"])
    wait_at_rest(node)
