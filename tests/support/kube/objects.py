"""Objects the cluster tier creates in the real API server: Ready Nodes without a kubelet, pods, tokens.

A Node is created directly with a Ready condition and capacity; kube-apiserver's
TaintNodesByCondition admission puts ``node.kubernetes.io/not-ready`` on every
new Node, which the node lifecycle controller would lift once the kubelet
reports Ready: there is neither here, so the taint is lifted by hand.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from rdma_cni.kube.client import ApiClient
from tests.support.kube.controlplane import ControlPlane, write_kubeconfig

NOT_READY_TAINT = "node.kubernetes.io/not-ready"


def node_doc(name: str, annotations: dict[str, str] | None = None, cpu: str = "16") -> dict[str, Any]:
    """A Node as a kubelet would register it, Ready, with room for 110 pods."""
    capacity = {"cpu": cpu, "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"},
            "annotations": dict(annotations or {}),
        },
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "tier"}],
        },
    }


def create_node(
    cp: ControlPlane, name: str, annotations: dict[str, str] | None = None, cpu: str = "16"
) -> dict[str, Any]:
    """Create a Ready, untainted Node; returns it as stored."""
    doc = node_doc(name, annotations, cpu)
    cp.kubectl("create", "-f", "-", input=json.dumps(doc))
    # The status given at create is kept for Nodes; set it through the
    # subresource as well, as a kubelet does, in case a version drops it.
    cp.kubectl(
        "patch",
        "node",
        name,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": doc["status"]}),
    )
    cp.kubectl("taint", "node", name, f"{NOT_READY_TAINT}:NoSchedule-", check=False)
    return dict(cp.get("node", name))


def pod_doc(
    namespace: str,
    name: str,
    *,
    annotations: dict[str, str] | None = None,
    scheduler: str | None = None,
    node: str | None = None,
    account: str | None = None,
    priority_class: str | None = None,
    on_node: str | None = None,
    cpu: str = "10m",
) -> dict[str, Any]:
    """A pod that never runs (there is no kubelet): one container, small requests."""
    spec: dict[str, Any] = {
        "containers": [
            {"name": "c", "image": "registry.invalid/none:1", "resources": {"requests": {"cpu": cpu}}}
        ],
        "terminationGracePeriodSeconds": 0,
    }
    if scheduler:
        spec["schedulerName"] = scheduler
    if node:
        spec["nodeName"] = node
    if account:
        spec["serviceAccountName"] = account
    if priority_class:
        spec["priorityClassName"] = priority_class
    if on_node:  # a nodeSelector: the scheduler still decides, among one node
        spec["nodeSelector"] = {"kubernetes.io/hostname": on_node}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": dict(annotations or {})},
        "spec": spec,
    }


def create(cp: ControlPlane, doc: dict[str, Any]) -> None:
    """Create one object as the admin."""
    cp.kubectl("create", "-f", "-", input=json.dumps(doc))


def client_for_token(cp: ControlPlane, token: str, tag: str) -> ApiClient:
    """The project's own API client, authenticated with ``token``."""
    assert cp.pki is not None
    path = write_kubeconfig(cp.path(f"{tag}.kubeconfig"), cp.server, cp.pki.ca, token=token)
    return ApiClient.from_kubeconfig(path)


def token_claims(token: str) -> dict[str, Any]:
    """The (unverified) claims of a service-account JWT, for checking what was issued."""
    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))
