"""Pods on the node tier's node: made as a user would write them, awaited through the API.

A pod here is real: rdma-scheduler places it, kubelet runs it on containerd 2.x, Multus runs
its networks' ADDs, the busybox container lists its interfaces. Helpers wait on what the API
says (phase, Ready, the pod gone) and fail with the pod's events when it never comes.
"""

from __future__ import annotations

import json
import time
from typing import Any

from tests.support.node.images import BUSYBOX_IMAGE
from tests.support.node.node import Node

SCHEDULER = "rdma-scheduler"
NETWORKS = "k8s.v1.cni.cncf.io/networks"
NETWORK_STATUS = "k8s.v1.cni.cncf.io/network-status"
REQUEST = "rdma_interfaces_required"


def pod_manifest(
    namespace: str,
    name: str,
    networks: list[dict[str, Any]] | str | None,
    request: list[dict[str, Any]] | None = None,
    *,
    command: str = "ip -o addr; exec sleep 3600",
) -> dict[str, Any]:
    """A busybox pod for rdma-scheduler selecting ``networks`` (the JSON list form, or a name
    list as written), asking ``request`` in the pod-wide annotation."""
    annotations = {}
    if networks is not None:
        annotations[NETWORKS] = networks if isinstance(networks, str) else json.dumps(networks)
    if request is not None:
        annotations[REQUEST] = json.dumps(request)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
        "spec": {
            "schedulerName": SCHEDULER,
            # busybox's sh as pid 1 ignores SIGTERM: no grace to wait out.
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "c",
                    "image": BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", command],
                }
            ],
        },
    }


def create(node: Node, *docs: dict[str, Any]) -> None:
    """Create pods (one kubectl call for all of them: as close together as the API takes them)."""
    node.kubectl("create", "-f", "-", input="\n".join(json.dumps(d) for d in docs))


def events(node: Node, namespace: str, name: str) -> list[str]:
    """The pod's events, as ``reason: message`` lines (for failure messages)."""
    got = node.get("events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")
    return [f"{e.get('reason')}: {e.get('message') or e.get('note') or ''}" for e in got["items"]]


def running(node: Node, namespace: str, name: str) -> dict[str, Any] | None:
    """The pod when it runs Ready, else None."""
    pod = node.pod(namespace, name)
    if pod is None or pod.get("status", {}).get("phase") != "Running":
        return None
    conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
    return pod if conditions.get("Ready") == "True" else None


def wait_running(
    node: Node, namespace: str, names: list[str], timeout: float = 180
) -> dict[str, dict[str, Any]]:
    """Wait until every pod of ``names`` runs Ready; returns them by name."""
    deadline = time.monotonic() + timeout
    done: dict[str, dict[str, Any]] = {}
    while True:
        for name in names:
            if name not in done and (pod := running(node, namespace, name)) is not None:
                done[name] = pod
        if len(done) == len(names):
            return done
        if time.monotonic() > deadline:
            stuck = [n for n in names if n not in done]
            detail = {n: events(node, namespace, n)[-6:] for n in stuck[:3]}
            raise AssertionError(f"pods not Running after {timeout:.0f} s: {stuck}; events: {detail}")
        time.sleep(1)


def wait_gone(node: Node, namespace: str, names: list[str], timeout: float = 180) -> None:
    """Wait until the API has none of ``names`` (kubelet confirmed each pod's end)."""
    deadline = time.monotonic() + timeout
    while True:
        items = node.get("pods", "-n", namespace)["items"]
        left = sorted({p["metadata"]["name"] for p in items} & set(names))
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pods still there after {timeout:.0f} s: {left}")
        time.sleep(1)


def delete(node: Node, namespace: str, *names: str, force: bool = False) -> None:
    """``kubectl delete pod`` without waiting (``force``: ``--force --grace-period=0``)."""
    extra = ["--force", "--grace-period=0"] if force else []
    node.kubectl("delete", "pod", *names, "-n", namespace, "--wait=false", *extra)


def network_status(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``k8s.v1.cni.cncf.io/network-status`` annotation Multus wrote, decoded."""
    text = (pod["metadata"].get("annotations") or {}).get(NETWORK_STATUS)
    assert text, f"no {NETWORK_STATUS} on {pod['metadata']['name']}"
    return list(json.loads(text))
