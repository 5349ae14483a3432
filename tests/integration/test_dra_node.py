"""The DRA path on the simulated node: what a network may promise, a claim proven and prepared, ADD.

The preparer (agent/dra/prepare) reads claims shaped as the real kube-scheduler
allocates them (tests/support/draclaims.py) from a stand-in client; the node
is real (veth VFs, netlink, the records, the node lock), and ADD and DEL run
the plugin as a runtime does. The cluster tier runs the same against the real
kube-apiserver and kube-scheduler.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from typing import Any

import pytest

from rdma_cni.agent.dra.devices import check_paths, read_devices
from rdma_cni.agent.dra.prepare import ClaimRef, Preparer
from rdma_cni.agent.snapshot import NetworkView, snapshot
from rdma_cni.kube.client import Unavailable
from rdma_cni.node.prepared import PreparedStore
from rdma_cni.shared import nodestate
from tests.integration.conftest import Cluster, assert_node_pristine, host_names
from tests.support.draclaims import ClaimApi, allocated_claim
from tests.support.simnode import SimPf

NET = "rdma-dra"
NODE = "node-1"


def view(cluster: Cluster, **kw: Any) -> NetworkView:
    conf = cluster.conf()
    base: dict[str, Any] = {
        "name": NET,
        "pfs": ("simpf0", "simpf1"),
        "state_dir": conf["stateDir"],
        "lock_file": conf["lockFile"],
        "dra": True,
    }
    base.update(kw)
    return NetworkView(**base)


def dra_conf(cluster: Cluster) -> dict[str, Any]:
    return cluster.conf(name=NET, dra=True, pfs=["simpf0", "simpf1"])


def uid_of(pod_env: dict[str, str]) -> str:
    return pod_env["CNI_ARGS"].rsplit("K8S_POD_UID=", 1)[1]


def pod_name(pod_env: dict[str, str]) -> str:
    return pod_env["CNI_ARGS"].split("K8S_POD_NAME=", 1)[1].split(";", 1)[0]


class Setup:
    def __init__(self, cluster: Cluster, **kw: Any) -> None:
        self.cluster = cluster
        self.api = ClaimApi()
        self.view = view(cluster, **kw)
        self.preparer = Preparer([self.view], NODE, lambda: self.api)  # type: ignore[arg-type,return-value]

    def claim(
        self, pod_env: dict[str, str], results: list[tuple[str, str, int | None]], **kw: Any
    ) -> ClaimRef:
        name = kw.pop("name", f"{pod_name(pod_env)}-rdma")
        doc = allocated_claim(
            name, (pod_name(pod_env), uid_of(pod_env)), [(r, NET, pf, bw) for r, pf, bw in results], **kw
        )
        self.api.add(doc)
        return ClaimRef(doc["metadata"]["namespace"], doc["metadata"]["uid"], name)

    def prepare(self, ref: ClaimRef) -> Any:
        return self.preparer.prepare([ref])[ref.uid]

    def preparations(self) -> list[Any]:
        return PreparedStore(self.view.state_dir).all()


def rates(cluster: Cluster) -> dict[tuple[str, str], list[int]]:
    return {
        (pf, vf): s["rate"]
        for pf, table in cluster.node.vf_state().get("pfs", {}).items()
        for vf, s in table.items()
        if s.get("rate", [0, 0]) != [0, 0]
    }


def test_a_claim_is_proven_prepared_and_added_at_its_allocated_rates(cluster: Cluster) -> None:
    s = Setup(cluster)
    pod = cluster.pod(annotation=[{"min_tx_rate": 1, "max_tx_rate": 99}])  # what the pod wrote: never read
    ref = s.claim(
        pod, [("if0", "simpf0", 15000), ("if1", "simpf0", 0)], caps={"if0": 20000}, names={"if1": "data"}
    )
    done = s.prepare(ref)
    assert done.error == ""
    assert [(d.requests, d.pool) for d in done.devices] == [(("if0",), NODE), (("if1",), NODE)]
    (prep,) = s.preparations()
    assert [(v.request, v.pf, v.vf, v.min_tx_rate, v.max_tx_rate, v.name) for v in prep.vfs] == [
        ("if0", "simpf0", 0, 15000, 20000, None),
        ("if1", "simpf0", 1, 0, 0, "data"),
    ]
    assert (prep.pod_name, prep.pod_uid) == (pod_name(pod), uid_of(pod))
    path = PreparedStore(s.view.state_dir).path(ref.uid)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    # Prepared again (kubelet restarted): the same answer, nothing rewritten.
    mtime = os.stat(path).st_mtime_ns
    assert [d.device for d in s.prepare(ref).devices] == [d.device for d in done.devices]
    assert os.stat(path).st_mtime_ns == mtime

    out = cluster.run("ADD", pod, dra_conf(cluster))
    assert out.ok, out.doc
    assert [i["name"] for i in out.doc["interfaces"]] == ["net1", "data"]
    assert [i["pciID"] for i in out.doc["interfaces"]] == [
        cluster.node.vf_pci(0, 0),
        cluster.node.vf_pci(0, 1),
    ]
    assert rates(cluster) == {("simpf0", "0"): [15000, 20000]}

    # DEL gives the VFs back; the preparation stays (a sandbox made again gets the same VFs).
    assert cluster.run("DEL", pod, dra_conf(cluster)).ok
    assert len(s.preparations()) == 1 and rates(cluster) == {}
    again = cluster.run("ADD", pod, dra_conf(cluster))
    assert again.ok and [i["pciID"] for i in again.doc["interfaces"]] == [
        i["pciID"] for i in out.doc["interfaces"]
    ]
    assert cluster.run("DEL", pod, dra_conf(cluster)).ok
    assert s.preparer.unprepare([ref]) == {ref.uid: ""}
    assert s.preparations() == []
    assert s.preparer.unprepare([ref]) == {ref.uid: ""}  # none is fine
    assert_node_pristine(cluster)


def test_what_a_dra_network_may_promise(cluster: Cluster) -> None:
    s = Setup(cluster)
    devices = {d.pf: d for d in read_devices([s.view])}
    assert (devices["simpf0"].vfs, devices["simpf0"].bandwidth, devices["simpf0"].max_tx_rate) == (
        4,
        25000,
        25000,
    )
    assert (devices["simpf1"].vfs, devices["simpf1"].bandwidth) == (4, 10000)
    # A pod of another network holds a VF and 5000 Mbit/s on simpf1 (attached before the PF became DRA's):
    # the DRA path may promise that much less. A prepared claim's VFs stay the DRA path's.
    other = cluster.pod([{"min_tx_rate": 5000}])
    assert cluster.run("ADD", other, cluster.conf(name="old", pfs=["simpf1"])).ok
    pod = cluster.pod()
    assert s.prepare(s.claim(pod, [("if0", "simpf0", 10000)])).error == ""
    devices = {d.pf: d for d in read_devices([s.view])}
    assert (devices["simpf1"].vfs, devices["simpf1"].bandwidth) == (3, 5000)
    assert (devices["simpf0"].vfs, devices["simpf0"].bandwidth) == (4, 25000)
    # Link speed unknown: no bandwidth, no largest cap; fewer VFs enabled: fewer to promise.
    cluster.node.set_speed(1, None)
    cluster.node.set_num_vfs(0, 2)
    devices = {d.pf: d for d in read_devices([s.view])}
    assert (devices["simpf1"].bandwidth, devices["simpf1"].max_tx_rate, devices["simpf1"].link_speed) == (
        None,
        None,
        None,
    )
    assert devices["simpf0"].vfs == 2


@pytest.mark.node([SimPf("simpf0", 2, 25000, pcie_root="pci0000:3a"), SimPf("simpf1", 2, 10000, numa_node=1)])
def test_the_pcie_root_comes_from_sysfs(cluster: Cluster) -> None:
    devices = {d.pf: d for d in read_devices([view(cluster)])}
    assert devices["simpf0"].pcie_root == "pci0000:3a" and devices["simpf0"].numa_node == 0
    assert devices["simpf1"].pcie_root is None and devices["simpf1"].numa_node == 1


def test_the_node_state_and_a_dra_network_never_share_a_pf(cluster: Cluster) -> None:
    dra = view(cluster, pfs=("simpf1",))
    ok = NetworkView("rdma-net", pfs=("simpf0",), state_dir=dra.state_dir, lock_file=dra.lock_file)
    check_paths([ok, dra])
    with pytest.raises(ValueError, match="PF simpf1 is in DRA network rdma-dra and in network rdma-net"):
        check_paths([NetworkView("rdma-net", pfs=("simpf0", "simpf1")), dra])
    with pytest.raises(ValueError, match="lists no pfs"):
        check_paths([NetworkView("rdma-net"), dra])
    with pytest.raises(ValueError, match="in DRA network rdma-dra and in network b"):
        check_paths([dra, NetworkView("b", pfs=("simpf1",), dra=True)])
    # A prepared claim's VFs are held for every network's ADD and snapshot (a misconfigured overlap included).
    s = Setup(cluster)
    assert s.prepare(s.claim(cluster.pod(), [("if0", "simpf1", 10000)])).error == ""
    state = snapshot(
        [ok, NetworkView("overlap", pfs=("simpf1",), state_dir=dra.state_dir, lock_file=dra.lock_file)]
    )
    simpf1 = next(p for p in state.pfs if p.name == "simpf1")
    assert (simpf1.used_vfs, simpf1.used_tx_rate) == (1, 10000)
    refused = cluster.run(
        "ADD", cluster.pod([{"min_tx_rate": 1}]), cluster.conf(name="overlap", pfs=["simpf1"])
    )
    assert refused.doc["code"] == 100, refused.doc


def test_two_claims_never_share_bandwidth_beyond_the_pf(cluster: Cluster) -> None:
    s = Setup(cluster)
    first = s.claim(cluster.pod(), [("if0", "simpf0", 15000)])
    assert s.prepare(first).error == ""
    before = os.listdir(os.path.join(s.view.state_dir, "prepared"))
    second = s.claim(cluster.pod(), [("if0", "simpf0", 15000)])
    refused = s.prepare(second)
    assert refused.devices == []
    assert refused.error == (
        f"rdma-cni: claim default/{second.name}: PF simpf0 has 10000 of 25000 Mbit/s unreserved, "
        "this claim was "
        "allocated 15000 there (the node changed since the allocation): nothing prepared"
    )
    assert os.listdir(os.path.join(s.view.state_dir, "prepared")) == before


def claim_doc(s: Setup, ref: ClaimRef) -> dict[str, Any]:
    return s.api.claims[(ref.namespace, ref.name)]


BAD = {
    "not allocated": (lambda c: c["status"].pop("allocation"), "it is not allocated"),
    "two pods": (
        lambda c: c["status"]["reservedFor"].append({"resource": "pods", "name": "x", "uid": "y"}),
        "it is reserved for 2 pods; its VFs go to one pod",
    ),
    "another pool": (
        lambda c: c["status"]["allocation"]["devices"]["results"][0].update(pool="node-2"),
        "allocated in pool 'node-2', not this node's (node-1)",
    ),
    "not our device": (
        lambda c: c["status"]["allocation"]["devices"]["results"][0].update(device="gpu-0"),
        "device 'gpu-0' is none of this node's DRA devices",
    ),
    "no such request": (
        lambda c: c["status"]["allocation"]["devices"]["results"][0].update(request="if9"),
        "result 0 (request 'if9'): names no request of the claim",
    ),
    "admin access": (
        lambda c: c["status"]["allocation"]["devices"]["results"][0].update(adminAccess=True),
        "admin access to a VF is not supported",
    ),
    "allocated whole": (
        lambda c: c["status"]["allocation"]["devices"]["results"][0].pop("shareID"),
        "device allocated whole, not as a share: DRAConsumableCapacity must be on",
    ),
    "a fraction": (
        lambda c: c["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"].update(
            bandwidth="1500m"
        ),
        "consumed bandwidth '1500m' is no whole Mbit/s",
    ),
    "two VFs": (
        lambda c: c["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"].update(vfs="2"),
        "consumed '2' VFs, not 1",
    ),
    "cap below": (
        lambda c: c["status"]["allocation"]["devices"]["config"].append(
            {
                "source": "FromClaim",
                "requests": ["if0"],
                "opaque": {
                    "driver": "rdma-cni.io",
                    "parameters": {
                        "apiVersion": "rdma-cni.io/v1alpha1",
                        "kind": "VfConfig",
                        "max_tx_rate": 100,
                    },
                },
            }
        ),
        "its configuration's max_tx_rate 100 is below the bandwidth allocated to it (5000 Mbit/s)",
    ),
    "bad config": (
        lambda c: c["status"]["allocation"]["devices"]["config"].append(
            {
                "source": "FromClaim",
                "opaque": {
                    "driver": "rdma-cni.io",
                    "parameters": {"apiVersion": "rdma-cni.io/v1alpha1", "kind": "VfConfig", "rate": 1},
                },
            }
        ),
        "its configuration: config[0] (FromClaim): rate: Extra inputs are not permitted (code 101)",
    ),
    "cap above the pf": (
        lambda c: c["status"]["allocation"]["devices"]["config"].append(
            {
                "source": "FromClaim",
                "opaque": {
                    "driver": "rdma-cni.io",
                    "parameters": {
                        "apiVersion": "rdma-cni.io/v1alpha1",
                        "kind": "VfConfig",
                        "max_tx_rate": 30000,
                    },
                },
            }
        ),
        "request if0: max_tx_rate 30000 is above PF simpf0's capacity (25000 Mbit/s)",
    ),
    "replaced": (lambda c: c["metadata"].update(uid="another"), "it was replaced"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_claim_the_node_cannot_honour_says_why_and_leaves_nothing(cluster: Cluster, case: str) -> None:
    s = Setup(cluster)
    ref = s.claim(cluster.pod(), [("if0", "simpf0", 5000)])
    change, says = BAD[case]
    change(claim_doc(s, ref))
    done = s.prepare(ref)
    assert done.devices == [] and done.error.startswith(f"rdma-cni: claim default/{ref.name}: ")
    assert says in done.error, done.error
    assert s.preparations() == []
    assert s.preparer.refused == 1


def test_a_node_changed_since_the_allocation_fails_preparation(cluster: Cluster) -> None:
    s = Setup(cluster)
    # Fewer VFs enabled than the claim was allocated on simpf1.
    cluster.node.set_num_vfs(1, 1)
    ref = s.claim(cluster.pod(), [("if0", "simpf1", 0), ("if1", "simpf1", 0)])
    assert (
        "PF simpf1 has 1 free VF(s) for this claim's 2 (the node changed since the allocation"
        in s.prepare(ref).error
    )
    # The link dropped to an unknown speed: no bandwidth to guarantee.
    cluster.node.set_speed(0, None)
    ref = s.claim(cluster.pod(), [("if0", "simpf0", 1000)])
    assert "PF simpf0's capacity is unknown now (link speed)" in s.prepare(ref).error
    # VFs disabled altogether.
    cluster.node.set_num_vfs(1, 0)
    ref = s.claim(cluster.pod(), [("if0", "simpf1", 0)])
    assert "PF simpf1 of network rdma-dra has no VFs enabled on this node now" in s.prepare(ref).error
    assert s.preparations() == []


def test_an_unreachable_api_server(cluster: Cluster) -> None:
    s = Setup(cluster)
    ref = s.claim(cluster.pod(), [("if0", "simpf0", 5000)])
    s.api.error = Unavailable(503, "ServiceUnavailable", "down")
    assert "cannot read the claim from the API server" in s.prepare(ref).error
    s.api.error = None
    assert s.prepare(ref).error == ""
    # Prepared already: kubelet's second call is answered from the node (it was proven when made).
    s.api.error = Unavailable(503, "ServiceUnavailable", "down")
    assert len(s.prepare(ref).devices) == 1


def test_a_claim_allocated_anew_replaces_its_old_preparation(cluster: Cluster) -> None:
    s = Setup(cluster)
    pod = cluster.pod()
    ref = s.claim(pod, [("if0", "simpf0", 20000)])
    assert s.prepare(ref).error == ""
    # Deallocated and allocated again (its unprepare never came): the old room is not counted against it.
    fresh = allocated_claim(
        ref.name, (pod_name(pod), uid_of(pod)), [("if0", NET, "simpf0", 25000)], uid=ref.uid
    )
    s.api.add(fresh)
    assert s.prepare(ref).error == ""
    (prep,) = s.preparations()
    assert prep.vfs[0].min_tx_rate == 25000


def test_a_failed_write_leaves_the_node_as_it_was(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Setup(cluster)
    ref = s.claim(cluster.pod(), [("if0", "simpf0", 5000)])

    def full(self: PreparedStore, prep: Any) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(PreparedStore, "write", full)
        assert s.prepare(ref).error == f"rdma-cni: claim default/{ref.name}: No space left on device"
    assert s.preparations() == []


def test_add_on_a_dra_network(cluster: Cluster) -> None:
    s = Setup(cluster)
    # No prepared claim: code 101, nothing done.
    lonely = cluster.pod()
    out = cluster.run("ADD", lonely, dra_conf(cluster))
    assert out.doc["code"] == 101 and "has no prepared DRA claim on network rdma-dra" in out.doc["msg"]
    assert cluster.records == []
    # The claim's VF already attached (another sandbox of the pod not DELed): code 107.
    pod = cluster.pod()
    assert s.prepare(s.claim(pod, [("if0", "simpf1", 0)])).error == ""
    assert cluster.run("ADD", pod, dra_conf(cluster)).ok
    # The other path's node state, read from the same state directory, leaves the attachment on
    # the DRA PF out and still encodes (its KeyError once stopped the agent's publishing).
    other_path = view(cluster, name="rdma-net", pfs=("simpf0",), dra=False)
    state = snapshot([other_path])
    assert [p.name for p in state.pfs] == ["simpf0"] and state.allocations == ()
    published = dataclasses.replace(state, updated="2026-11-28T10:00:00Z")  # as the publisher stamps it
    assert nodestate.decode(nodestate.encode(published)).allocations == ()
    second = {**pod, "CNI_CONTAINERID": pod["CNI_CONTAINERID"] + "b"}
    out = cluster.run("ADD", second, dra_conf(cluster))
    assert out.doc["code"] == 107 and "is attached to" in out.doc["msg"]
    # A pod of an annotation network on the same PFs gets other VFs: prepared ones are held.
    names_before = host_names(cluster)
    other = cluster.pod([{}, {}, {}])
    added = cluster.run("ADD", other, cluster.conf(name="plain", pfs=["simpf1"]))
    assert added.ok and cluster.node.vf_pci(1, 0) not in [i["pciID"] for i in added.doc["interfaces"]]
    assert len(host_names(cluster)) == len(names_before) - 3
    # The pod named by its namespace and name when the runtime passes no uid.
    nouid = dict(pod, CNI_CONTAINERID="nouid0001", CNI_ARGS=pod["CNI_ARGS"].rsplit(";K8S_POD_UID=", 1)[0])
    assert cluster.run("DEL", pod, dra_conf(cluster)).ok
    out = cluster.run("ADD", nouid, dra_conf(cluster))
    assert out.ok and out.doc["interfaces"][0]["pciID"] == cluster.node.vf_pci(1, 0)


def test_an_unreadable_preparation_stops_every_add_of_its_state_dir(cluster: Cluster) -> None:
    s = Setup(cluster)
    assert s.prepare(s.claim(cluster.pod(), [("if0", "simpf0", 0)])).error == ""
    (name,) = os.listdir(os.path.join(s.view.state_dir, "prepared"))
    with open(os.path.join(s.view.state_dir, "prepared", name), "w") as f:
        json.dump({"schema": 1, "claim_uid": "x"}, f)
    out = cluster.run("ADD", cluster.pod([{}]), cluster.conf())
    assert out.doc["code"] == 5 and "DRA preparation" in out.doc["msg"] and "is corrupt" in out.doc["msg"]


def test_what_kubelet_or_the_allocation_could_send_that_is_no_claim(cluster: Cluster) -> None:
    s = Setup(cluster)
    bogus = ClaimRef("default", "../etc", "x")
    assert "'../etc' is not a claim uid" in s.prepare(bogus).error
    assert "is not a claim uid" in s.preparer.unprepare([bogus])[bogus.uid]
    ref = s.claim(cluster.pod(), [("if0", "simpf0", 0)])
    doc = claim_doc(s, ref)
    results = doc["status"]["allocation"]["devices"]["results"]
    results[0]["consumedCapacity"] = "15k"
    assert "consumedCapacity is not an object" in s.prepare(ref).error
    doc["status"]["allocation"]["devices"]["results"] = results * 33
    assert "33 devices of rdma-cni.io allocated; a pod may have at most 32" in s.prepare(ref).error
    assert s.preparations() == []


def test_a_claim_over_two_state_directories_is_written_whole_or_not_at_all(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two DRA networks with state directories of their own: one preparation in each, or none.
    first = view(cluster, pfs=("simpf0",))
    other_dir = os.path.join(cluster.tmp, "state-b")
    second = view(cluster, name="rdma-dra-b", pfs=("simpf1",), state_dir=other_dir)
    api = ClaimApi()
    preparer = Preparer([first, second], NODE, lambda: api)  # type: ignore[arg-type,return-value]
    pod = cluster.pod()
    doc = allocated_claim(
        "two",
        (pod_name(pod), uid_of(pod)),
        [("if0", NET, "simpf0", 1000), ("if1", "rdma-dra-b", "simpf1", 1000)],
    )
    api.add(doc)
    ref = ClaimRef("default", doc["metadata"]["uid"], "two")
    writes = []
    real = PreparedStore.write

    def second_fails(self: PreparedStore, prep: Any) -> None:
        writes.append(self.state_dir)
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        real(self, prep)

    with monkeypatch.context() as patch:  # not undo(): the fixture's environment is the same monkeypatch
        patch.setattr(PreparedStore, "write", second_fails)
        assert "No space left on device" in preparer.prepare([ref])[ref.uid].error
    assert PreparedStore(first.state_dir).all() == [] and PreparedStore(other_dir).all() == []
    done = preparer.prepare([ref])[ref.uid]
    assert done.error == "" and len(done.devices) == 2
    assert [len(PreparedStore(d).all()) for d in (first.state_dir, other_dir)] == [1, 1]
    assert preparer.unprepare([ref]) == {ref.uid: ""}
    assert PreparedStore(first.state_dir).all() == [] and PreparedStore(other_dir).all() == []


def test_a_corrupt_record_still_lets_the_devices_be_read(cluster: Cluster) -> None:
    s = Setup(cluster)
    attachments = os.path.join(s.view.state_dir, "attachments")
    os.makedirs(attachments, mode=0o700, exist_ok=True)
    os.chmod(s.view.state_dir, 0o700)
    with open(os.path.join(attachments, "ctr9@net1.json"), "w") as f:
        f.write("{corrupt")
    # Its VFs are unknown; one still in a pod would not be proven home. Here all are home: all count.
    devices = {d.pf: d for d in read_devices([s.view])}
    assert devices["simpf0"].vfs == 4
