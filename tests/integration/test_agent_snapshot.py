"""The node agent's snapshot on the simulated node: what it publishes is what ADD sees."""

from __future__ import annotations

import json
import os
import threading

import pytest

from rdma_cni.agent import snapshot
from rdma_cni.cni.errors import IOFailure, TryAgainLater
from rdma_cni.node.record import node_lock
from rdma_cni.shared import nodestate
from tests.integration.conftest import Cluster
from tests.integration.test_inventory import inventory
from tests.support.simnode import SimPf


def view_of(cluster: Cluster, **overrides: object) -> snapshot.NetworkView:
    path = os.path.join(cluster.tmp, "agent-conf.json")
    with open(path, "w") as f:
        json.dump(cluster.conf(**overrides), f)
    return snapshot.load_view(path)


def test_snapshot_matches_the_node_and_follows_add_and_del(cluster: Cluster) -> None:
    conf = cluster.conf()
    view = view_of(cluster)
    empty = snapshot.snapshot([view])
    assert empty.allocations == ()
    assert [
        (p.name, p.capacity_tx_rate, p.used_tx_rate, p.capacity_vfs, p.used_vfs, p.numa_node)
        for p in empty.pfs
    ] == [
        ("simpf0", 25000, 0, 4, 0, 0),
        ("simpf1", 10000, 0, 4, 0, 0),
    ]

    a = cluster.pod([{"min_tx_rate": 15000, "max_tx_rate": 20000}, {"min_tx_rate": 5000}], name="alpha")
    b = cluster.pod([{}], name="beta")
    assert cluster.run("ADD", a, conf).ok
    assert cluster.run("ADD", b, conf).ok
    state = snapshot.snapshot([view])

    # The inventory report (another reading of the same node) agrees PF by PF.
    report = {pf["name"]: pf for pf in inventory(cluster, conf)["pfs"]}
    for pf in state.pfs:
        r = report[pf.name]
        assert (pf.used_vfs, pf.used_tx_rate, pf.capacity_tx_rate) == (
            r["used_vfs"],
            r["used_tx_rate"],
            r["capacity_tx_rate"],
        )
        assert pf.free_vfs == r["free_vfs"]
    assert sum(p.used_vfs for p in state.pfs) == 3
    assert sum(p.used_tx_rate for p in state.pfs) == 20000

    def uid(pod_env: dict[str, str]) -> str:
        return pod_env["CNI_ARGS"].rsplit("K8S_POD_UID=", 1)[1]

    assert [(x.namespace, x.name, x.uid) for x in state.allocations] == [
        ("default", "alpha", uid(a)),
        ("default", "beta", uid(b)),
    ]
    alpha = next(x for x in state.allocations if x.name == "alpha")
    assert [(i.min_tx_rate, i.max_tx_rate) for i in alpha.interfaces] == [(15000, 20000), (5000, 0)]
    # Each interface's PF is where the record put its VF.
    assert {i.pf for i in alpha.interfaces} <= {"simpf0", "simpf1"}
    # It is a valid annotation.
    assert nodestate.decode(nodestate.encode(_stamped(state))) == _stamped(state)

    assert cluster.run("DEL", a, conf).ok
    assert cluster.run("DEL", b, conf).ok
    assert nodestate.same_content(snapshot.snapshot([view]), empty)


def _stamped(state: nodestate.NodeState) -> nodestate.NodeState:
    import dataclasses

    return dataclasses.replace(state, generation=1, updated="2026-01-01T00:00:00Z")


@pytest.mark.node([SimPf("simpf0", 3, 25000, rdma=True), SimPf("simpf1", 2, 10000)])
def test_required_isolation_counts_only_vfs_with_an_rdma_device(cluster: Cluster) -> None:
    auto = snapshot.snapshot([view_of(cluster)])
    required = snapshot.snapshot([view_of(cluster, rdmaIsolation="required")])
    assert [p.capacity_vfs for p in auto.pfs] == [3, 2]
    assert [p.capacity_vfs for p in required.pfs] == [3, 0]
    # Both networks on one node: one entry per PF, the cautious view.
    both = snapshot.snapshot([view_of(cluster), view_of(cluster, rdmaIsolation="required")])
    assert [(p.name, p.capacity_vfs) for p in both.pfs] == [("simpf0", 3), ("simpf1", 0)]


def test_networks_with_different_pfs_publish_the_union(cluster: Cluster) -> None:
    only0 = view_of(cluster, pfs=["simpf0"], capacityMbps={"simpf0": 40000})
    only1 = view_of(cluster, pfs=["simpf1"])
    state = snapshot.snapshot([only0, only1])
    assert [(p.name, p.capacity_tx_rate) for p in state.pfs] == [("simpf0", 40000), ("simpf1", 10000)]


def test_a_vf_held_by_a_record_of_another_network_is_used(cluster: Cluster) -> None:
    pod = cluster.pod([{"min_tx_rate": 1000}])
    assert cluster.run("ADD", pod, cluster.conf(name="other-net", pfs=["simpf1"])).ok
    state = snapshot.snapshot([view_of(cluster)])
    pf1 = next(p for p in state.pfs if p.name == "simpf1")
    assert (pf1.used_vfs, pf1.used_tx_rate, pf1.free_vfs) == (1, 1000, 3)
    assert cluster.run("DEL", pod, cluster.conf(name="other-net", pfs=["simpf1"])).ok


def test_a_corrupt_records_vf_stays_out_of_the_pool_while_in_the_pod(cluster: Cluster) -> None:
    conf = cluster.conf()
    view = view_of(cluster)
    pod = cluster.pod([{"min_tx_rate": 1000}])
    assert cluster.run("ADD", pod, conf).ok
    (name,) = cluster.records
    with open(os.path.join(cluster.state_dir, "attachments", name), "w") as f:
        f.write("{")
    state = snapshot.snapshot([view])
    # Nobody's (the record is unreadable) and not free (its netdev is in the pod): in neither count.
    assert sum(p.used_vfs for p in state.pfs) == 0 and state.allocations == ()
    assert sorted(p.capacity_vfs for p in state.pfs) == [3, 4]
    # The agent only reads: the file is still there for ADD to set aside.
    assert cluster.records == [name]


def test_unlistable_records_raise_like_add(cluster: Cluster) -> None:
    os.makedirs(cluster.state_dir)
    with open(os.path.join(cluster.state_dir, "attachments"), "w") as f:
        f.write("not a directory")
    with pytest.raises(IOFailure, match=r"state directory .*attachments"):
        snapshot.snapshot([view_of(cluster)])
    pod = cluster.pod([{}])
    assert cluster.run("ADD", pod, cluster.conf()).doc["code"] == 5


def test_busy_node_lock_is_try_again(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot, "LOCK_TIMEOUT", 0.2)
    view = view_of(cluster)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with node_lock(view.lock_file, 5):
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    try:
        held.wait(5)
        with pytest.raises(TryAgainLater):
            snapshot.snapshot([view])
    finally:
        release.set()
        t.join()
    assert snapshot.snapshot([view]).pfs


def test_the_state_lists_each_networks_pfs(cluster: Cluster) -> None:
    """Version 2: every PF once in pfs, and per network its PFs for the per-network verdict."""
    only0 = view_of(cluster, name="rail-0", pfs=["simpf0"])
    both = view_of(cluster, name="all")
    state = snapshot.snapshot([only0, both])
    assert state.version == nodestate.VERSION_2
    assert [(n.name, n.pfs) for n in state.networks] == [
        ("rail-0", ("simpf0",)),
        ("all", ("simpf0", "simpf1")),
    ]
    assert nodestate.decode(nodestate.encode(_stamped(state))) == _stamped(state)


def test_the_state_carries_each_networks_rails(cluster: Cluster) -> None:
    """The rails of a network's pfs entries go into its PF list; a PF may have another rail elsewhere."""
    railed = view_of(cluster, name="rails", pfs=[{"name": "simpf0", "rail": "rail-0"}, "simpf1"])
    other = view_of(cluster, name="other", pfs=[{"name": "simpf1", "rail": "east"}])
    assert railed.rails == {"simpf0": "rail-0"}
    state = snapshot.snapshot([railed, other])
    assert [(n.name, n.pfs, n.rails) for n in state.networks] == [
        ("rails", ("simpf0", "simpf1"), ("rail-0", None)),
        ("other", ("simpf1",), ("east",)),
    ]
    assert nodestate.decode(nodestate.encode(_stamped(state))) == _stamped(state)
