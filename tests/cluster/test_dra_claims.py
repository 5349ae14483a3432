"""Claims from ``rdma-cni claim``, allocated by the real kube-scheduler on the slices a real agent publishes.

One simulated node whose two PFs are the DRA network rdma-dra's (simpf0 under
PCIe root pci0000:3a, simpf1 under pci0000:5c, 4 VFs and 25000 Mbit/s each),
its agent run as conf/base/node/daemonset.yaml runs it. Pods ask through the
ResourceClaimTemplates the built ``rdma-cni claim`` prints and are scheduled
by the cluster's default kube-scheduler v1.37.2 (DRA and consumable capacity
on, as they are by default). Where kubelet would prepare a pod's claims, the
test makes kubelet's calls to the agent's own plugin socket (there is no
kubelet in this tier; the node tier has one), then runs ADD and DEL through
the shim and the agent's CNI server, as Multus would.

Needs root (the simulated node's veth VFs).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from rdma_cni.shared.dra import BANDWIDTH, DRIVER, PCIE_ROOT
from rdma_cni.shared.quantity import whole
from tests.cluster.conftest import failed_scheduling, unique, wait_for_service_account
from tests.support.kube.agents import Agent, NodeHost, start_agent, stop_agent
from tests.support.kube.controlplane import ControlPlane
from tests.support.kube.dra import (
    allocation_of,
    claim_pod,
    claim_template,
    devices,
    kubelet_prepare,
    pod_claim,
    wait_allocated,
)
from tests.support.kube.objects import create
from tests.support.shim import build_shim, run_shim
from tests.support.simnode import SimPf, add_netns, del_netns
from tests.support.waiting import wait_for

if os.geteuid() != 0:
    pytest.skip("the simulated nodes need root (veth)", allow_module_level=True)

HOST_LOCAL_DIR = "/usr/lib/cni"
NET = "rdma-dra"
LAYOUT = [
    SimPf("simpf0", 4, 25000, pcie_root="pci0000:3a"),
    SimPf("simpf1", 4, 25000, pcie_root="pci0000:5c"),
]
GPU_DRIVER = "gpu.example.com"


@dataclass
class Node:
    cp: ControlPlane
    agent: Agent
    host: NodeHost
    namespace: str
    shim: str

    def pod(self, name: str, request: str, **kw: Any) -> None:
        template = claim_template(request, name, NET, self.namespace)
        claim_pod(self.cp, self.namespace, name, template, NET, node=self.agent.name, **kw)

    def env(self, pod: str) -> dict[str, str]:
        uid = self.cp.get("pod", pod, "-n", self.namespace)["metadata"]["uid"]
        netns = f"dc{os.getpid() % 100000}{uuid.uuid4().hex[:6]}"
        return {
            "CNI_CONTAINERID": f"ctr{uuid.uuid4().hex[:16]}",
            "CNI_NETNS": add_netns(netns),
            "CNI_IFNAME": "net1",
            "CNI_PATH": HOST_LOCAL_DIR,
            "CNI_ARGS": f"IgnoreUnknown=true;K8S_POD_NAMESPACE={self.namespace};K8S_POD_NAME={pod};"
            f"K8S_POD_INFRA_CONTAINER_ID=x;K8S_POD_UID={uid}",
        }

    def conf(self) -> bytes:
        with open(self.host.network_file(NET)) as f:
            conflist = json.load(f)
        entry = dict(conflist["plugins"][0], cniVersion=conflist["cniVersion"], name=conflist["name"])
        entry.update(kubeconfig=self.host.kubeconfig, lockTimeoutSeconds=60)
        entry["ipam"] = {**entry["ipam"], "dataDir": os.path.join(self.host.directory, "ipam")}
        return json.dumps(entry).encode()

    def verb(self, verb: str, env: dict[str, str]) -> Any:
        out = run_shim(self.shim, self.host.socket, {**env, "CNI_COMMAND": verb}, self.conf(), timeout=120)
        return out

    def prepared(self) -> list[str]:
        d = os.path.join(self.host.directory, "state", "prepared")
        return sorted(n for n in os.listdir(d) if n.endswith(".json")) if os.path.isdir(d) else []

    def rates(self) -> dict[tuple[str, str], list[int]]:
        return {
            (pf, vf): s["rate"]
            for pf, table in self.agent.node.vf_state().get("pfs", {}).items()
            for vf, s in table.items()
            if s.get("rate", [0, 0]) != [0, 0]
        }


@pytest.fixture(scope="module")
def node(applied: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    name = unique("dra-claims")
    base = tmp_path_factory.mktemp("dra-claims")
    agent = start_agent(
        applied,
        str(base / name),
        name,
        LAYOUT,
        f"dc{os.getpid() % 10000:04d}",
        3.0,
        {NET: {"pfs": ["simpf0", "simpf1"], "dra": True}},
    )
    namespace = unique("dra")
    applied.kubectl("create", "namespace", namespace)
    wait_for_service_account(applied, namespace, "default")
    host = NodeHost(agent.node, agent.name, agent.directory, (NET,))
    try:
        wait_for(lambda: len(devices(applied, name)) == 2, 60, "the agent's slices")
        yield Node(applied, agent, host, namespace, build_shim(str(base)))
    finally:
        applied.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        stop_agent(applied, agent)


def consumed(cp: ControlPlane, namespace: str) -> dict[str, int]:
    """Bandwidth the allocated claims of the namespace consume, per device."""
    out: dict[str, int] = {}
    for claim in cp.get("resourceclaims", "-n", namespace)["items"]:
        for r in allocation_of(claim):
            if r["driver"] == DRIVER:
                out[r["device"]] = out.get(r["device"], 0) + (
                    whole(r["consumedCapacity"].get(BANDWIDTH, 0)) or 0
                )
    return out


def test_claims_are_allocated_prepared_and_added_within_each_pf(node: Node) -> None:
    cp, ns = node.cp, node.namespace
    node.pod("a", '[{"min_tx_rate": 15000, "max_tx_rate": 20000}, {}]')
    claim_a = wait_allocated(cp, ns, "a")
    node.pod("b", '[{"min_tx_rate": 15000}]')
    claim_b = wait_allocated(cp, ns, "b")
    node.pod("c", '[{"min_tx_rate": 15000}]')
    # 45000 Mbit/s asked of two PFs of 25000: the third never fits one PF, and DRA has no preemption.
    wait_for(
        lambda: any("cannot allocate all claims" in m for m in failed_scheduling(cp, ns, "c")),
        60,
        "c refused",
    )
    assert not allocation_of(pod_claim(cp, ns, "c"))
    by_device = {d["name"]: d for d in devices(cp, node.agent.name).values()}
    for device, used in consumed(cp, ns).items():
        assert used <= whole(by_device[device]["capacity"][BANDWIDTH]["value"]), (device, used)
    a_results = allocation_of(claim_a)
    assert [(r["request"], whole(r["consumedCapacity"][BANDWIDTH])) for r in a_results] == [
        ("if0", 15000),
        ("if1", 0),
    ]
    assert all(r["shareID"] for r in a_results)

    # kubelet's NodePrepareResources for a and b, then ADD through the shim as Multus would.
    answer = kubelet_prepare(node.host, [claim_a, claim_b])
    assert {uid: a.error for uid, a in answer.items()} == {
        claim_a["metadata"]["uid"]: "",
        claim_b["metadata"]["uid"]: "",
    }
    devices_a = [
        (list(d.request_names), d.pool_name, d.device_name)
        for d in answer[claim_a["metadata"]["uid"]].devices
    ]
    assert devices_a == [
        (["if0"], node.agent.name, a_results[0]["device"]),
        (["if1"], node.agent.name, a_results[1]["device"]),
    ]
    assert len(node.prepared()) == 2
    env_a, env_b = node.env("a"), node.env("b")
    try:
        out = node.verb("ADD", env_a)
        assert out.code == 0, out
        assert [i["name"] for i in out.doc["interfaces"]] == ["net1", "net1-1"]
        out_b = node.verb("ADD", env_b)
        assert out_b.code == 0, out_b
        # The allocated amounts as min rates, the configuration's cap; nothing the pods wrote.
        assert sorted(node.rates().values()) == [[15000, 0], [15000, 20000]]
        # Done with a: DEL, then kubelet's unprepare; the claim goes with the pod, and c fits now.
        assert node.verb("DEL", env_a).code == 0
        unprepared = kubelet_prepare(node.host, [claim_a], unprepare=True)
        assert unprepared[claim_a["metadata"]["uid"]].error == ""
        assert len(node.prepared()) == 1
        cp.kubectl("delete", "pod", "a", "-n", ns, "--grace-period=0", "--force")
        claim_c = wait_allocated(cp, ns, "c", timeout=90)
        assert [whole(r["consumedCapacity"][BANDWIDTH]) for r in allocation_of(claim_c)] == [15000]
        for device, used in consumed(cp, ns).items():
            assert used <= whole(by_device[device]["capacity"][BANDWIDTH]["value"]), (device, used)
    finally:
        for env in (env_a, env_b):
            node.verb("DEL", env)
            del_netns(os.path.basename(env["CNI_NETNS"]))
        for pod in ("b", "c"):
            cp.kubectl("delete", "pod", pod, "-n", ns, "--grace-period=0", "--force", check=False)
    kubelet_prepare(node.host, [claim_b], unprepare=True)
    assert node.prepared() == []


def gpu_slice(node: str) -> dict[str, Any]:
    """A second driver's devices on the node: GPUs under the PCIe roots of simpf0, simpf1 and of no PF."""
    roots = {"gpu-0": "pci0000:3a", "gpu-1": "pci0000:5c", "gpu-2": "pci0000:99"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-gpus"},
        "spec": {
            "driver": GPU_DRIVER,
            "nodeName": node,
            "pool": {"name": f"{node}-gpus", "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {"name": name, "attributes": {"id": {"string": name}, PCIE_ROOT: {"string": root}}}
                for name, root in roots.items()
            ],
        },
    }


def aligned(node: Node, name: str, gpu: str, request: str) -> dict[str, Any]:
    """``rdma-cni claim``'s template with a GPU request of the other driver, and the PCIe roots matched."""
    template = claim_template(request, name, NET, node.namespace)
    devs = template["spec"]["spec"]["devices"]
    devs["requests"].insert(
        0,
        {
            "name": "gpu",
            "exactly": {
                "deviceClassName": GPU_DRIVER,
                "selectors": [{"cel": {"expression": f'device.attributes["{GPU_DRIVER}"].id == "{gpu}"'}}],
            },
        },
    )
    devs.setdefault("constraints", []).append({"matchAttribute": PCIE_ROOT, "requests": ["gpu", "if0"]})
    return template


def test_a_claim_aligned_with_a_gpu_gets_vfs_on_the_pf_under_its_root(node: Node) -> None:
    cp, ns = node.cp, node.namespace
    create(
        cp,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": GPU_DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{GPU_DRIVER}"'}}]},
        },
    )
    create(cp, gpu_slice(node.agent.name))
    try:
        # gpu-1 sits under pci0000:5c, simpf1's root: the VF must be simpf1's although simpf0 comes first.
        claim_pod(
            cp, ns, "g1", aligned(node, "g1", "gpu-1", '[{"min_tx_rate": 1000}]'), NET, node=node.agent.name
        )
        results = {r["request"]: r for r in allocation_of(wait_allocated(cp, ns, "g1"))}
        simpf1 = devices(cp, node.agent.name)["simpf1"]["name"]
        assert results["gpu"]["device"] == "gpu-1" and results["if0"]["device"] == simpf1
        # gpu-2's root has no PF of ours: no VF can be aligned with it, and the pod waits.
        claim_pod(cp, ns, "g2", aligned(node, "g2", "gpu-2", "[{}]"), NET, node=node.agent.name)
        wait_for(
            lambda: any("cannot allocate all claims" in m for m in failed_scheduling(cp, ns, "g2")),
            60,
            "g2 refused",
        )
        assert not allocation_of(pod_claim(cp, ns, "g2"))
    finally:
        cp.kubectl("delete", "pod", "g1", "g2", "-n", ns, "--grace-period=0", "--force", check=False)
        cp.kubectl("delete", "resourceslice", f"{node.agent.name}-gpus", check=False)
        cp.kubectl("delete", "deviceclass", GPU_DRIVER, check=False)


def test_a_claim_the_node_cannot_honour_fails_preparation_and_leaves_nothing(node: Node) -> None:
    cp, ns = node.cp, node.namespace
    node.pod("d", '[{"min_tx_rate": 1000}, {"min_tx_rate": 1000}]')
    claim = wait_allocated(cp, ns, "d")
    pfs = {devices(cp, node.agent.name)[pf]["name"]: k for k, pf in enumerate(("simpf0", "simpf1"))}
    k = pfs[allocation_of(claim)[0]["device"]]
    before = node.prepared()
    try:
        # The node changed since the allocation: the PF's VFs were disabled.
        node.agent.node.set_num_vfs(k, 0)
        answer = kubelet_prepare(node.host, [claim])
        error = answer[claim["metadata"]["uid"]].error
        assert error.startswith(
            f"rdma-cni: claim {ns}/{claim['metadata']['name']}: PF simpf{k} of network rdma-dra "
        )
        assert "has no VFs enabled on this node now (the node changed since the allocation)" in error
        assert not answer[claim["metadata"]["uid"]].devices
        assert node.prepared() == before
    finally:
        node.agent.node.set_num_vfs(k, 4)
        cp.kubectl("delete", "pod", "d", "-n", ns, "--grace-period=0", "--force", check=False)
    assert node.prepared() == before
