"""Kubernetes objects and extender requests shaped as kube-scheduler sends them, for the extender's tests."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from rdma_cni.shared import nodestate
from rdma_cni.shared.nodestate import Allocation, InterfaceUse, NodeState, PfSummary

PodUse = tuple[str, list[tuple[str, int, int]]]  # uid, [(pf, min, max)]


def stamp(age: float = 0.0) -> str:
    """RFC 3339 time ``age`` seconds ago."""
    return datetime.fromtimestamp(time.time() - age, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def state(
    pfs: list[tuple[str, int | None, int]],
    pods: list[PodUse] = (),  # type: ignore[assignment]
    *,
    age: float = 0.0,
    generation: int = 1,
    numa: int | None = 0,
) -> NodeState:
    """A node state from PFs ``(name, capacity Mbit/s, eligible VFs)`` and pods' interfaces."""
    used: dict[str, list[int]] = {name: [0, 0] for name, _, _ in pfs}
    allocations = []
    for i, (uid, uses) in enumerate(pods):
        for pf, lo, _ in uses:
            used[pf][0] += 1
            used[pf][1] += lo
        allocations.append(
            Allocation("team-a", f"pod-{i}", uid, tuple(InterfaceUse(pf, lo, hi) for pf, lo, hi in uses))
        )
    return NodeState(
        version=1,
        generation=generation,
        updated=stamp(age),
        pfs=tuple(
            PfSummary(
                n,
                capacity_tx_rate=cap,
                used_tx_rate=used[n][1],
                capacity_vfs=vfs,
                used_vfs=used[n][0],
                numa_node=numa,
            )
            for n, cap, vfs in pfs
        ),
        allocations=tuple(allocations),
    )


def node(name: str, text: str | None, *, images: int = 40) -> dict[str, Any]:
    """A Node as the API server returns it (labels, conditions, ~40 images), with our annotation."""
    annotations = {
        "node.alpha.kubernetes.io/ttl": "0",
        "volumes.kubernetes.io/controller-managed-attach-detach": "true",
    }
    if text is not None:
        annotations[nodestate.ANNOTATION] = text
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-node-{name}",
            "resourceVersion": "1234",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": "gpu-rdma-8x",
                "topology.kubernetes.io/zone": "zone-a",
            },
            "annotations": annotations,
        },
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]},
        "status": {
            "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110"},
            "allocatable": {"cpu": "63", "memory": "500Gi", "pods": "110"},
            "conditions": [
                {
                    "type": kind,
                    "status": "True" if kind == "Ready" else "False",
                    "lastHeartbeatTime": "2026-11-22T20:00:00Z",
                    "lastTransitionTime": "2026-11-01T00:00:00Z",
                    "reason": f"Kubelet{kind}",
                    "message": f"kubelet reports {kind}",
                }
                for kind in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
            ],
            "addresses": [
                {"type": "InternalIP", "address": "10.0.0.7"},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {"kubeletVersion": "v1.34.1", "containerRuntimeVersion": "containerd://1.7.2"},
            "images": [
                {
                    "names": [
                        f"registry.example.com/team/image-{i}@sha256:{i:064x}",
                        f"registry.example.com/team/image-{i}:v1.{i}",
                    ],
                    "sizeBytes": 100_000_000 + i,
                }
                for i in range(images)
            ],
        },
    }


def pod(
    name: str,
    annotations: dict[str, str] | None = None,
    *,
    namespace: str = "team-a",
    uid: str | None = None,
) -> dict[str, Any]:
    """A Pod as kube-scheduler holds it when it calls the extender."""
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"uid-{namespace}-{name}",
            "resourceVersion": "99",
            "annotations": dict(annotations or {}),
            "labels": {"app": "trainer"},
        },
        "spec": {
            "schedulerName": "rdma-scheduler",
            "containers": [{"name": "main", "image": "registry.example.com/team/trainer:1", "resources": {}}],
        },
        "status": {"phase": "Pending"},
    }


def rdma_pod(name: str, rates: list[tuple[int, int]], **kw: Any) -> dict[str, Any]:
    """A pod asking for interfaces with ``(min_tx_rate, max_tx_rate)``."""
    value = json.dumps([{"min_tx_rate": lo, "max_tx_rate": hi} for lo, hi in rates])
    return pod(name, {"rdma_interfaces_required": value}, **kw)


def args_nodes(the_pod: dict[str, Any], nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """ExtenderArgs with full Nodes (nodeCacheCapable: false), keys as Go marshals them."""
    return {"Pod": the_pod, "Nodes": {"metadata": {}, "items": nodes}, "NodeNames": None}


def args_names(the_pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """ExtenderArgs with NodeNames (nodeCacheCapable: true)."""
    return {"Pod": the_pod, "Nodes": None, "NodeNames": names}
