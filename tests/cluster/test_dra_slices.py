"""The node agent publishes its DRA networks' PFs as ResourceSlices on the real API server, kept true.

One simulated node, its agent run with conf/base/node/daemonset.yaml's args and a token
bound to its DaemonSet pod (so conf/dra.yaml's admission policy judges every
write), two networks: rdma-net on simpf0 (the extender's path) and the DRA
network rdma-dra on simpf1 and simpf2. The slices hold only the DRA network's
PFs and the node state only the other's; VFs enabled or disabled and a link
renegotiated are published within seconds (``--node-state-period=1``).

Needs root (the simulated node's veth VFs).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from rdma_cni.kube.client import ApiError
from rdma_cni.shared import nodestate
from rdma_cni.shared.dra import BANDWIDTH, NUMA_NODE, PCIE_ROOT, VFS
from rdma_cni.shared.dra.slices import DraDevice, render_slices
from tests.cluster.conftest import unique
from tests.support.kube.agents import NAMESPACE, Agent, agent_pod, prepare_node, start_agent, stop_agent
from tests.support.kube.controlplane import ControlPlane
from tests.support.kube.dra import devices, slices
from tests.support.kube.objects import client_for_token
from tests.support.simnode import SimPf
from tests.support.waiting import wait_for

if os.geteuid() != 0:
    pytest.skip("the simulated nodes need root (veth)", allow_module_level=True)

LAYOUT = [
    SimPf("simpf0", 4, 25000),
    SimPf("simpf1", 4, 25000, numa_node=0, pcie_root="pci0000:3a"),
    SimPf("simpf2", 2, 10000, numa_node=1, pcie_root="pci0000:5c"),
]
NETWORKS: dict[str, dict[str, object]] = {
    "rdma-net": {"pfs": ["simpf0"]},
    "rdma-dra": {"pfs": ["simpf1", {"name": "simpf2", "rail": "rail-1"}], "dra": True},
}


@pytest.fixture(scope="module")
def agent(applied: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    name = unique("dra-slices")
    prefix = f"ds{os.getpid() % 10000:04d}"
    started = start_agent(
        applied, str(tmp_path_factory.mktemp("dra-slices") / name), name, LAYOUT, prefix, 3.0, NETWORKS
    )
    try:
        yield started
    finally:
        stop_agent(applied, started)


def capacity(dev: dict[str, Any], name: str) -> str | None:
    return dev["capacity"].get(name, {}).get("value")


def test_the_dra_networks_pfs_are_published_as_slices(applied: ControlPlane, agent: Agent) -> None:
    found = wait_for(
        lambda: (d := devices(applied, agent.name)) and len(d) == 2 and d, 60, "the agent's slices"
    )
    assert set(found) == {"simpf1", "simpf2"}
    one, two = found["simpf1"], found["simpf2"]
    assert one["allowMultipleAllocations"] is True
    assert (capacity(one, BANDWIDTH), capacity(one, VFS)) == ("25k", "4")
    assert (capacity(two, BANDWIDTH), capacity(two, VFS)) == ("10k", "2")
    assert one["capacity"][BANDWIDTH]["requestPolicy"] == {"default": "0"}
    assert one["attributes"][PCIE_ROOT] == {"string": "pci0000:3a"} and one["attributes"][NUMA_NODE] == {
        "int": 0
    }
    assert two["attributes"]["rail"] == {"string": "rail-1"} and two["attributes"][NUMA_NODE] == {"int": 1}
    assert two["attributes"]["network"] == {"string": "rdma-dra"} and two["attributes"]["linkSpeed"] == {
        "int": 10000
    }
    (pool,) = slices(applied, agent.name)
    owner = pool["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("Node", agent.name)
    assert owner["uid"] == applied.get("node", agent.name)["metadata"]["uid"]
    # The node state, the extender's, holds the other path's PF only.
    text = applied.get("node", agent.name)["metadata"]["annotations"][nodestate.ANNOTATION]
    state = nodestate.decode(text)
    assert [p.name for p in state.pfs] == ["simpf0"]
    assert [n.name for n in state.networks] == ["rdma-net"]


def test_slices_follow_vfs_and_link_speed(applied: ControlPlane, agent: Agent) -> None:
    wait_for(lambda: len(devices(applied, agent.name)) == 2, 60, "the agent's slices")
    first = slices(applied, agent.name)[0]["spec"]["pool"]["generation"]
    pf1, pf2 = 1, 2  # simpf1, simpf2
    try:
        agent.node.set_num_vfs(pf1, 2)
        wait_for(lambda: capacity(devices(applied, agent.name)["simpf1"], VFS) == "2", 30, "2 VFs published")
        agent.node.set_speed(pf2, 40000)
        wait_for(
            lambda: capacity(devices(applied, agent.name)["simpf2"], BANDWIDTH) == "40k",
            30,
            "40000 Mbit/s published",
        )
        assert devices(applied, agent.name)["simpf2"]["attributes"]["maxTxRate"] == {"int": 40000}
        # A link of unknown speed publishes no bandwidth (only zero-minimum requests fit it).
        agent.node.set_speed(pf2, None)
        wait_for(
            lambda: BANDWIDTH not in devices(applied, agent.name)["simpf2"]["capacity"], 30, "no bandwidth"
        )
        assert "maxTxRate" not in devices(applied, agent.name)["simpf2"]["attributes"]
        # No VF at all: no device.
        agent.node.set_num_vfs(pf1, 0)
        wait_for(lambda: set(devices(applied, agent.name)) == {"simpf2"}, 30, "simpf1 gone")
    finally:
        agent.node.set_num_vfs(pf1, 4)
        agent.node.set_speed(pf2, 10000)
    wait_for(
        lambda: capacity(devices(applied, agent.name).get("simpf1", {"capacity": {}}), VFS) == "4", 30, "back"
    )
    assert slices(applied, agent.name)[0]["spec"]["pool"]["generation"] > first
    assert agent.process.alive()


def test_the_policy_keeps_each_agent_to_its_own_nodes_slices(
    applied: ControlPlane, agent: Agent, tmp_path: Any
) -> None:
    # Another node's agent: a token bound to a DaemonSet pod on that node.
    other = unique("dra-other")
    host = prepare_node(
        applied, str(tmp_path / other), other, [SimPf("simpf0", 1)], f"do{os.getpid() % 10000:04d}"
    )
    try:
        token = agent_pod(applied, host, f"rdma-cni-{other}")
        client = client_for_token(applied, token, f"dra-{other}")
        mine = render_slices(other, [DraDevice("rdma-dra", "simpf0", 1, 1000)], 1)[0]
        theirs = render_slices(agent.name, [DraDevice("rdma-dra", "simpf0", 1, 1000)], 1)[0]
        made = client.post("/apis/resource.k8s.io/v1/resourceslices", mine)  # its own node: allowed
        with pytest.raises(ApiError) as exc:
            client.post("/apis/resource.k8s.io/v1/resourceslices", theirs)
        # An admission policy's denial is 422 Invalid, with the policy's message.
        assert exc.value.status == 422
        assert "rdma-cni may only publish the ResourceSlices of the node its own pod runs on" in str(
            exc.value
        )
        foreign = json.loads(json.dumps(mine))
        foreign["spec"]["driver"] = "gpu.example.com"
        with pytest.raises(ApiError) as exc:
            client.post("/apis/resource.k8s.io/v1/resourceslices", foreign)
        assert "rdma-cni may only publish ResourceSlices of the rdma-cni.io driver" in str(exc.value)
        # Its own slice moved to another node: refused too.
        moved = dict(made, spec={**made["spec"], "nodeName": agent.name})
        with pytest.raises(ApiError) as exc:
            client.put(f"/apis/resource.k8s.io/v1/resourceslices/{made['metadata']['name']}", moved)
        # Refused by the API server's own validation before the policy sees it (nodeName is immutable).
        assert exc.value.status == 422
        client.delete(f"/apis/resource.k8s.io/v1/resourceslices/{made['metadata']['name']}")
        # The real agent's slices stay its own: another node's token cannot delete them.
        (real,) = slices(applied, agent.name)
        with pytest.raises(ApiError) as exc:
            client.delete(f"/apis/resource.k8s.io/v1/resourceslices/{real['metadata']['name']}")
        assert exc.value.status == 422 and "of the node its own pod runs on" in str(exc.value)
    finally:
        host.node.down()
        applied.kubectl("delete", "node", other, "--wait=false", check=False)
        applied.kubectl("delete", "pod", f"rdma-cni-{other}", "-n", NAMESPACE, "--wait=false", check=False)


def test_slices_go_with_their_node(applied: ControlPlane, tmp_path: Any) -> None:
    name = unique("dra-gone")
    started = start_agent(
        applied, str(tmp_path / name), name, LAYOUT, f"dg{os.getpid() % 10000:04d}", 3.0, NETWORKS
    )
    try:
        wait_for(lambda: len(devices(applied, name)) == 2, 60, "the agent's slices")
    finally:
        stop_agent(applied, started)
    # The Node owns them: the garbage collector removes them with it.
    wait_for(lambda: not slices(applied, name), 60, "the slices deleted with their Node")
