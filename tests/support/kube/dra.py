"""The DRA side of the cluster tier: claim pods, their allocations, the node's slices, kubelet's calls.

There is no kubelet in the cluster tier (the node tier has one): where kubelet
would prepare a pod's claims, :func:`kubelet_prepare` makes kubelet's calls to
the agent's own plugin, found as kubelet finds it (its registration socket in
the registry directory, then ``GetInfo``'s endpoint), with the requests
kubelet builds, serialized to the bytes the real kubelet sends (the node tier's
recording, tests/unit/data/kubelet-dra-wire.json: test_dra_kubelet checks the
same messages serialize to its bytes); ADD then goes through the shim as the
runtime's would.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any

import grpc

from tests.support.drawire import DRA, REGISTRATION
from tests.support.kube.agents import NodeHost
from tests.support.kube.controlplane import ControlPlane
from tests.support.kube.objects import create, pod_doc
from tests.support.kube.rdmascheduler import plugin_command
from tests.support.waiting import wait_for

NETWORKS = "k8s.v1.cni.cncf.io/networks"


def claim_template(request: str, name: str, network: str, namespace: str) -> dict[str, Any]:
    """What ``rdma-cni claim`` (the binary under test) prints for ``request``."""
    out = subprocess.run(
        [*plugin_command(), "claim", "--name", name, "--network", network, "--namespace", namespace, request],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return dict(json.loads(out.stdout))


def claim_pod(
    cp: ControlPlane,
    namespace: str,
    name: str,
    template: dict[str, Any],
    network: str,
    *,
    node: str | None = None,
    create_template: bool = True,
) -> None:
    """A pod (default scheduler) asking for its VFs through ``template``, attaching ``network`` (Multus)."""
    if create_template:
        create(cp, template)
    doc = pod_doc(namespace, name, annotations={NETWORKS: network}, on_node=node)
    doc["spec"]["resourceClaims"] = [
        {"name": "rdma", "resourceClaimTemplateName": template["metadata"]["name"]}
    ]
    doc["spec"]["containers"][0]["resources"]["claims"] = [{"name": "rdma"}]
    create(cp, doc)


def pod_claim(cp: ControlPlane, namespace: str, pod: str) -> dict[str, Any] | None:
    """The pod's generated ResourceClaim, once the claim controller made it."""
    status = cp.get("pod", pod, "-n", namespace).get("status", {})
    names = [
        s.get("resourceClaimName")
        for s in status.get("resourceClaimStatuses", [])
        if s.get("resourceClaimName")
    ]
    if not names:
        return None
    return dict(cp.get("resourceclaim", names[0], "-n", namespace))


def allocation_of(claim: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The claim's allocation results (empty when not allocated)."""
    if claim is None:
        return []
    return list(((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or [])


def wait_allocated(cp: ControlPlane, namespace: str, pod: str, timeout: float = 60) -> dict[str, Any]:
    """The pod's claim once allocated and the pod bound."""

    def done() -> dict[str, Any] | None:
        claim = pod_claim(cp, namespace, pod)
        bound = cp.get("pod", pod, "-n", namespace)["spec"].get("nodeName")
        return claim if allocation_of(claim) and bound else None

    return wait_for(done, timeout, f"pod {namespace}/{pod}'s claim allocated")


def slices(cp: ControlPlane, node: str, driver: str = "rdma-cni.io") -> list[dict[str, Any]]:
    """The node's ResourceSlices of ``driver``."""
    items = cp.get("resourceslices", f"--field-selector=spec.nodeName={node},spec.driver={driver}")["items"]
    return list(items)


def devices(cp: ControlPlane, node: str) -> dict[str, dict[str, Any]]:
    """The node's rdma-cni devices, by PF, from the highest generation of its pool."""
    found = slices(cp, node)
    top = max((s["spec"]["pool"]["generation"] for s in found), default=0)
    return {
        d["attributes"]["pf"]["string"]: d
        for s in found
        if s["spec"]["pool"]["generation"] == top
        for d in s["spec"]["devices"]
    }


def _endpoint(host: NodeHost) -> str:
    """The agent's DRA endpoint, as kubelet learns it: the registration socket's GetInfo."""
    from rdma_cni.agent.dra import registration_v1_pb2 as reg_pb

    def socket() -> str | None:
        names = (
            [n for n in os.listdir(host.registry_dir) if n.endswith("-reg.sock")]
            if os.path.isdir(host.registry_dir)
            else []
        )
        return os.path.join(host.registry_dir, names[0]) if len(names) == 1 else None

    path = wait_for(socket, 60, "the agent's registration socket")
    with grpc.insecure_channel(f"unix:{path}", options=[("grpc.default_authority", path)]) as channel:
        info = reg_pb.PluginInfo.FromString(channel.unary_unary(REGISTRATION + "GetInfo")(b"", timeout=5))
        status = reg_pb.RegistrationStatus(plugin_registered=True)
        channel.unary_unary(REGISTRATION + "NotifyRegistrationStatus")(status.SerializeToString(), timeout=5)
    assert info.type == "DRAPlugin" and "v1.DRAPlugin" in info.supported_versions
    return str(info.endpoint)


def kubelet_prepare(host: NodeHost, claims: list[dict[str, Any]], unprepare: bool = False) -> dict[str, Any]:
    """kubelet's NodePrepareResources (or Unprepare) for ``claims`` to the node's agent; the answer by uid."""
    from rdma_cni.agent.dra import dra_v1_pb2 as dra_pb

    refs = [
        dra_pb.Claim(
            namespace=c["metadata"]["namespace"], uid=c["metadata"]["uid"], name=c["metadata"]["name"]
        )
        for c in claims
    ]
    endpoint = _endpoint(host)
    method, request, response = (
        (
            "NodeUnprepareResources",
            dra_pb.NodeUnprepareResourcesRequest,
            dra_pb.NodeUnprepareResourcesResponse,
        )
        if unprepare
        else ("NodePrepareResources", dra_pb.NodePrepareResourcesRequest, dra_pb.NodePrepareResourcesResponse)
    )
    started = time.monotonic()
    with grpc.insecure_channel(f"unix:{endpoint}") as channel:
        raw = channel.unary_unary(DRA + method)(request(claims=refs).SerializeToString(), timeout=45)
    answer = response.FromString(raw)
    assert time.monotonic() - started < 45
    return dict(answer.claims)
