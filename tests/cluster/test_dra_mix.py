"""Claim pods and annotation pods on one node: each PF promised by one path only, never over-committed.

One simulated node, its agent run as conf/base/node/daemonset.yaml runs it, with two
networks: rdma-net on simpf0 (the annotation, judged by rdma-scheduler and
its extender from the node state) and the DRA network rdma-dra on simpf1 and
simpf2 (ResourceSlices, allocated by the default kube-scheduler). Pods of
both kinds are created interleaved, more than the node holds; then what
kubelet and Multus would do runs on the node: each bound annotation pod's
ADD, each allocated claim prepared (kubelet's calls to the agent's plugin)
and ADDed. Every ADD succeeds, every pod's VFs are on its own path's PFs,
and no PF holds more than its capacity (docs/dra.md, "Sharing a node").

Needs root (the simulated node's veth VFs).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator

import pytest

from rdma_cni.node.prepared import PreparedStore
from rdma_cni.node.record import RecordStore
from rdma_cni.shared import nodestate
from tests.cluster.conftest import failed_scheduling, strays_deleted, unique, wait_for_service_account
from tests.support.kube.agents import Agent, NodeHost, start_agent, stop_agent
from tests.support.kube.controlplane import ControlPlane
from tests.support.kube.dra import (
    allocation_of,
    claim_pod,
    claim_template,
    devices,
    kubelet_prepare,
    pod_claim,
)
from tests.support.kube.objects import create, pod_doc
from tests.support.kube.rdmascheduler import RdmaScheduler
from tests.support.shim import build_shim, run_shim
from tests.support.simnode import SimPf, add_netns, del_netns
from tests.support.waiting import wait_for

if os.geteuid() != 0:
    pytest.skip("the simulated nodes need root (veth)", allow_module_level=True)

HOST_LOCAL_DIR = "/usr/lib/cni"
LAYOUT = [SimPf("simpf0", 4, 25000), SimPf("simpf1", 4, 25000), SimPf("simpf2", 4, 25000)]
NETWORKS: dict[str, dict[str, object]] = {
    "rdma-net": {"pfs": ["simpf0"]},
    "rdma-dra": {"pfs": ["simpf1", "simpf2"], "dra": True},
}
CAPACITY = {"simpf0": 25000, "simpf1": 25000, "simpf2": 25000}


@pytest.fixture(scope="module")
def mixed(
    applied: ControlPlane, rdma_scheduler: RdmaScheduler, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, NodeHost, str, str]]:
    strays_deleted(applied)
    name = unique("dra-mix")
    base = tmp_path_factory.mktemp("dra-mix")
    agent = start_agent(
        applied, str(base / name), name, LAYOUT, f"dm{os.getpid() % 10000:04d}", 3.0, NETWORKS
    )
    namespace = unique("mix")
    applied.kubectl("create", "namespace", namespace)
    wait_for_service_account(applied, namespace, "default")
    try:
        wait_for(lambda: len(devices(applied, name)) == 2, 60, "the agent's slices")
        # And its node state: an annotation pod filtered before it is refused for want of one,
        # and waits for a retry while the others take the room.
        wait_for(lambda: published_pfs(applied, name) == ["simpf0"], 60, "the agent's node state")
        yield (
            agent,
            NodeHost(agent.node, agent.name, agent.directory, tuple(NETWORKS)),
            namespace,
            build_shim(str(base)),
        )
    finally:
        applied.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        stop_agent(applied, agent)


def published_pfs(cp: ControlPlane, node: str) -> list[str]:
    """The PFs of ``node``'s published node state (none before the agent's first publication)."""
    text = cp.get("node", node)["metadata"].get("annotations", {}).get(nodestate.ANNOTATION)
    return [p.name for p in nodestate.decode(text).pfs] if text else []


def annotation_pod(cp: ControlPlane, namespace: str, name: str, node: str, rate: int) -> None:
    annotations = {
        "k8s.v1.cni.cncf.io/networks": "default/rdma-net",
        "rdma_interfaces_required": json.dumps([{"min_tx_rate": rate}]),
    }
    create(cp, pod_doc(namespace, name, annotations=annotations, scheduler="rdma-scheduler", on_node=node))


def conf(host: NodeHost, network: str) -> bytes:
    with open(host.network_file(network)) as f:
        conflist = json.load(f)
    entry = dict(conflist["plugins"][0], cniVersion=conflist["cniVersion"], name=conflist["name"])
    entry.update(kubeconfig=host.kubeconfig, lockTimeoutSeconds=60)
    entry["ipam"] = {**entry["ipam"], "dataDir": os.path.join(host.directory, "ipam")}
    return json.dumps(entry).encode()


def test_claim_pods_and_annotation_pods_share_a_node_without_over_commit(
    applied: ControlPlane, mixed: tuple[Agent, NodeHost, str, str]
) -> None:
    agent, host, ns, shim = mixed
    cp = applied
    # Interleaved, 10000 Mbit/s each: 3 annotation pods for simpf0's 25000, 5 claim pods for 2 x 25000.
    kinds: dict[str, str] = {}
    for k in range(5):
        if k < 3:
            annotation_pod(cp, ns, f"ann-{k}", agent.name, 10000)
            kinds[f"ann-{k}"] = "annotation"
        template = claim_template('[{"min_tx_rate": 10000}]', f"dra-{k}", "rdma-dra", ns)
        claim_pod(cp, ns, f"dra-{k}", template, "rdma-dra", node=agent.name)
        kinds[f"dra-{k}"] = "claim"

    def settled() -> dict[str, str] | None:
        pods = {p["metadata"]["name"]: p for p in cp.get("pods", "-n", ns)["items"]}
        bound = {n: p["spec"]["nodeName"] for n, p in pods.items() if p["spec"].get("nodeName")}
        refused = {n for n in pods if n not in bound and failed_scheduling(cp, ns, n)}
        return bound if len(bound) + len(refused) == len(kinds) else None

    bound = wait_for(settled, 120, "every pod bound or refused")
    # What fits, whichever pods of a kind got there first (kube-scheduler's queue order is not
    # the order of creation once one has been retried): 2 x 10000 of simpf0's 25000, 2 x 2 of
    # simpf1's and simpf2's.
    assert len([n for n in bound if kinds[n] == "annotation"]) == 2, bound
    assert len([n for n in bound if kinds[n] == "claim"]) == 4, bound
    assert set(bound.values()) == {agent.name}
    # The extender saw simpf0 only, and kube-scheduler's allocator simpf1 and simpf2 only.
    state = nodestate.decode(cp.get("node", agent.name)["metadata"]["annotations"][nodestate.ANNOTATION])
    assert [p.name for p in state.pfs] == ["simpf0"]
    dra_devices = {d["name"]: pf for pf, d in devices(cp, agent.name).items()}
    assert set(dra_devices.values()) == {"simpf1", "simpf2"}
    claims = {n: pod_claim(cp, ns, n) for n in bound if kinds[n] == "claim"}
    for claim in claims.values():
        assert {dra_devices[r["device"]] for r in allocation_of(claim)} <= {"simpf1", "simpf2"}

    # On the node, as kubelet and Multus would: prepare the claims, then every pod's ADD.
    answer = kubelet_prepare(host, [c for c in claims.values() if c is not None])
    assert all(a.error == "" for a in answer.values()), {u: a.error for u, a in answer.items()}
    envs = []
    try:
        for pod, node_name in sorted(bound.items()):
            assert node_name == agent.name
            uid = cp.get("pod", pod, "-n", ns)["metadata"]["uid"]
            netns = f"mx{os.getpid() % 100000}{uuid.uuid4().hex[:6]}"
            env = {
                "CNI_CONTAINERID": f"ctr{uuid.uuid4().hex[:16]}",
                "CNI_NETNS": add_netns(netns),
                "CNI_IFNAME": "net1",
                "CNI_PATH": HOST_LOCAL_DIR,
                "CNI_ARGS": f"IgnoreUnknown=true;K8S_POD_NAMESPACE={ns};K8S_POD_NAME={pod};"
                f"K8S_POD_INFRA_CONTAINER_ID=x;K8S_POD_UID={uid}",
            }
            network = "rdma-net" if kinds[pod] == "annotation" else "rdma-dra"
            envs.append((env, network))
            out = run_shim(shim, host.socket, {**env, "CNI_COMMAND": "ADD"}, conf(host, network), timeout=120)
            assert out.code == 0, (pod, out)

        # What the node holds: per PF, the records' guaranteed rates never over the capacity.
        state_dir = os.path.join(host.directory, "state")
        records = RecordStore(state_dir).all()
        held: dict[str, int] = {}
        path_of: dict[str, set[str]] = {}
        for att in records:
            assert att.pod is not None
            for vf in att.vfs:
                held[vf.pf] = held.get(vf.pf, 0) + vf.min_tx_rate
                path_of.setdefault(vf.pf, set()).add(kinds[att.pod.name])
        assert held == {"simpf0": 20000, "simpf1": 20000, "simpf2": 20000}
        assert path_of == {"simpf0": {"annotation"}, "simpf1": {"claim"}, "simpf2": {"claim"}}
        assert all(held[pf] <= CAPACITY[pf] for pf in held)
        assert len(PreparedStore(state_dir).all()) == 4
        # The agent publishes each side's use where that side looks: simpf0's in the node state.
        wait_for(
            lambda: (
                next(
                    p
                    for p in nodestate.decode(
                        cp.get("node", agent.name)["metadata"]["annotations"][nodestate.ANNOTATION]
                    ).pfs
                ).used_tx_rate
                == 20000
            ),
            30,
            "simpf0's use published",
        )
    finally:
        for env, network in envs:
            run_shim(shim, host.socket, {**env, "CNI_COMMAND": "DEL"}, conf(host, network), timeout=120)
            del_netns(os.path.basename(env["CNI_NETNS"]))
        kubelet_prepare(host, [c for c in claims.values() if c is not None], unprepare=True)
    assert RecordStore(os.path.join(host.directory, "state")).all() == []
    assert PreparedStore(os.path.join(host.directory, "state")).all() == []


def test_the_refused_pods_say_why(applied: ControlPlane, mixed: tuple[Agent, NodeHost, str, str]) -> None:
    _, _, ns, _ = mixed
    # Whichever pod of each kind was left out (the extender may bind it since, once the first
    # test's DELs published room): its FailedScheduling events stay.
    ann = [m for k in range(3) for m in failed_scheduling(applied, ns, f"ann-{k}")]
    dra = [m for k in range(5) for m in failed_scheduling(applied, ns, f"dra-{k}")]
    assert any("rdma-cni" in m for m in ann), ann  # the extender's reason
    assert any("cannot allocate all claims" in m for m in dra), dra  # kube-scheduler's allocator's
