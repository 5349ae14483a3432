"""ADD's VF selection: placement over the inventory, then concrete VFs, and refusals that explain."""

from __future__ import annotations

from typing import Any

import pytest

from rdma_cni.cni.config import load_netconf
from rdma_cni.cni.errors import NoCapacity
from rdma_cni.cni.protocol import CniEnv
from rdma_cni.kernel.netlink import Link, VfInfo
from rdma_cni.node import inventory
from rdma_cni.node.inventory import Node, Owner, Pf, Vf
from rdma_cni.node.ipam_pending import PendingStore
from rdma_cni.node.isolation import RdmaIsolation
from rdma_cni.node.record import Attachment, RecordStore, VfRecord
from rdma_cni.shared import nodestate, placement
from rdma_cni.shared.podrequest import InterfaceRequest, PodRequest
from rdma_cni.verbs import add


def pf(name: str, cap: int | None, vfs: int, taken: dict[int, int] | None = None, rdma: bool = True) -> Pf:
    out = Pf(name=name, pci="", numa_node=None, capacity_mbps=cap, capacity_source="config", total_vfs=vfs)
    for i in range(vfs):
        owner = Owner("c", "net1", "ns/p", "net1", "ready", taken[i], 0) if taken and i in taken else None
        out.vfs.append(
            Vf(
                pf=name,
                index=i,
                pci=f"{name}:{i}",
                netdev=f"{name}v{i}",
                driver="mlx5_core",
                rdma_devices=[f"mlx5_{name}{i}"] if rdma else [],
                settings=None,
                owner=owner,
            )
        )
    return out


def reqs(*rates: tuple[int, int]) -> list[InterfaceRequest]:
    return [InterfaceRequest(min_tx_rate=lo, max_tx_rate=hi) for lo, hi in rates]


def test_picks_lowest_free_vfs_on_the_placed_pfs() -> None:
    node = Node(pfs=[pf("a", 25000, 3, taken={0: 10000}), pf("b", 10000, 2)])
    chosen = add.choose(node, reqs((12000, 0), (0, 0)), RdmaIsolation("off"), "test")
    assert (chosen[0].pf, chosen[0].index) == ("a", 1)
    assert len({v.pci for v in chosen}) == 2


def test_reservations_of_other_pods_count() -> None:
    node = Node(pfs=[pf("a", 25000, 3, taken={0: 20000})])
    with pytest.raises(NoCapacity) as err:
        add.choose(node, reqs((6000, 0)), RdmaIsolation("off"), "pod ns/p annotation x")
    assert err.value.code == 100
    assert "pod ns/p" in err.value.msg and "6000" in err.value.msg + err.value.details
    assert "a: 2 VFs, 5000 of 25000 Mbit/s free" in err.value.details


def test_no_pf_at_all_is_explained() -> None:
    with pytest.raises(NoCapacity, match="no SR-IOV PF"):
        add.choose(Node(pfs=[]), reqs((0, 0)), RdmaIsolation("off"), "test")


def test_required_isolation_skips_vfs_without_rdma_and_says_so() -> None:
    node = Node(pfs=[pf("a", 25000, 2, rdma=False), pf("b", 25000, 1)])
    iso = RdmaIsolation("required")
    assert [v.pf for v in add.choose(node, reqs((0, 0)), iso, "t")] == ["b"]
    with pytest.raises(NoCapacity, match="2 free VF\\(s\\) have no RDMA device"):
        add.choose(node, reqs((0, 0), (0, 0)), iso, "t")


def test_eligibility_is_the_shared_node_state_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    # ADD and the node agent count eligible VFs with one function; ADD must really call it.
    seen: list[dict[str, Any]] = []

    def only_b(**kw: Any) -> bool:
        seen.append(kw)
        return kw["has_rdma_device"] and kw["isolation"] == "auto"

    monkeypatch.setattr(nodestate, "eligible_vf", only_b)
    node = Node(pfs=[pf("a", 25000, 2, rdma=False), pf("b", 25000, 1)])
    assert [v.pf for v in add.choose(node, reqs((0, 0)), RdmaIsolation("auto"), "t")] == ["b"]
    assert {
        "has_netdev": True,
        "userspace_driver": False,
        "has_rdma_device": True,
        "isolation": "auto",
    } in seen


def test_userspace_bound_vfs_are_never_chosen() -> None:
    node = Node(pfs=[pf("a", 25000, 2), pf("b", 25000, 1)])
    node.pfs[0].vfs[0].driver = "vfio-pci"
    node.pfs[0].vfs[1].netdev = None
    assert [v.pf for v in add.choose(node, reqs((0, 0)), RdmaIsolation("off"), "t")] == ["b"]


def test_plugin_searches_with_its_larger_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    real = placement.place

    def spy(*args: Any, **kwargs: Any) -> placement.Placement:
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(placement, "place", spy)
    add.choose(Node(pfs=[pf("a", 1000, 1)]), reqs((0, 0)), RdmaIsolation("off"), "t")
    assert seen["max_steps"] == add.PLACEMENT_STEPS > placement.DEFAULT_MAX_STEPS


def test_rails_of_the_config_and_the_requests_constraints_reach_placement() -> None:
    node = Node(pfs=[pf("a", 25000, 3), pf("b", 25000, 3), pf("c", 25000, 3)])
    rails = {"a": "rail-0", "b": "rail-1", "c": "rail-1"}
    request = [InterfaceRequest(rail="rail-1"), InterfaceRequest(rail="rail-0"), InterfaceRequest(pf="c")]
    chosen = add.choose(node, request, RdmaIsolation("off"), "test", rails=rails)
    assert [v.pf for v in chosen] in (["b", "a", "c"], ["c", "a", "c"])
    spread = add.choose(
        node,
        [InterfaceRequest(rail="rail-1")] * 2,
        RdmaIsolation("off"),
        "test",
        rails=rails,
        different_pfs=True,
    )
    assert sorted(v.pf for v in spread) == ["b", "c"]
    with pytest.raises(NoCapacity) as err:
        add.choose(
            node,
            [InterfaceRequest(rail="rail-0")] * 2,
            RdmaIsolation("off"),
            "t",
            rails=rails,
            different_pfs=True,
        )
    assert err.value.code == 100 and "each on a different PF" in err.value.msg
    with pytest.raises(NoCapacity) as err:
        add.choose(node, [InterfaceRequest(rail="rail-9")], RdmaIsolation("off"), "pod ns/p", rails=rails)
    assert "entry 0.rail: no PF of the network here has rail 'rail-9'" in err.value.msg
    assert "rail rail-9" in err.value.details  # what was asked, with its constraint
    # Without the config's rails, a rail request fits nowhere.
    with pytest.raises(NoCapacity):
        add.choose(node, [InterfaceRequest(rail="rail-0")], RdmaIsolation("off"), "t")


def test_a_surveyed_node_is_brought_up_to_the_records_read_under_the_lock(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RDMA_CNI_SYSFS_ROOT", str(tmp_path))
    (tmp_path / "bus" / "pci" / "devices" / "a:0" / "net" / "av0").mkdir(parents=True)
    held = Owner("c0", "net1", "ns/p0", "net1", "ready", 5000, 0)
    # As the survey leaves a held VF: without its details.
    node = Node(pfs=[pf("a", 25000, 2)])
    node.pfs[0].vfs[0] = Vf("a", 0, "a:0", None, "", [], None, held)
    taker = Owner("c1", "net1", "ns/p1", "net1", "adding", 7000, 0)
    elsewhere = Owner("c2", "net1", "ns/p2", "net1", "ready", 0, 0)
    inventory.reowned(node, {"a:1": taker, "b:0": elsewhere})
    freed, taken = node.pfs[0].vfs
    assert (freed.owner, freed.netdev) == (None, "av0") and freed.available("off")  # read now
    assert taken.owner == taker and not taken.available("off")
    assert node.pfs[0].reserved_mbps == 7000
    assert node.foreign == [elsewhere]


def test_a_survey_where_nothing_fits_is_not_the_last_word(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The survey saw VF 1 not home (it was on its way back from a pod); under the lock it is.
    held = Owner("c0", "net1", "ns/p0", "net1", "ready", 0, 0)
    draft = Node(pfs=[pf("a", 25000, 2, taken={0: 0})])
    draft.pfs[0].vfs[1].netdev = None
    scans: list[dict[str, Any]] = []

    def scan(**kw: Any) -> Node:  # the node as it is: both VFs home, held as the owners say
        scans.append(kw)
        return Node(pfs=[pf("a", 25000, 2, taken={int(pci[2:]): 0 for pci in kw["owners"]})])

    class Finder:
        def in_host(self, pci: str, name: str | None = None) -> Link:
            return Link(index=9, name=str(name), mac="02:00:00:00:00:09", mtu=1500, up=False)

    monkeypatch.setattr(add, "scan", scan)
    monkeypatch.setattr(add, "held_vfs", lambda conf, store, set_aside: {"a:0": held})
    conf = load_netconf(
        {
            "cniVersion": "1.0.0",
            "name": "n",
            "type": "rdma-cni",
            "stateDir": str(tmp_path / "state"),
            "lockFile": str(tmp_path / "lock"),
            "rdmaIsolation": "off",
        }
    )
    env = CniEnv(command="ADD", container_id="c1", netns="/proc/self/ns/net", ifname="net1")
    request = PodRequest(interfaces=[InterfaceRequest()])
    store = RecordStore(conf.stateDir)

    def reserve(draft: Node | None) -> Any:
        return add.reserve(
            env, conf, {}, store, PendingStore(conf.stateDir), Finder(), request, ["net1"], "",
            "test", [1, 2], draft,
        )  # fmt: skip

    att = reserve(draft)
    assert [(v.pci, v.host_name) for v in att.vfs] == [("a:1", "av1")]
    assert len(scans) == 1  # the survey's "no", then the node read under the lock: a yes
    store.delete("c1", "net1")
    scans.clear()
    # Nothing free under the lock either: the answer of that read, once.
    monkeypatch.setattr(add, "held_vfs", lambda conf, store, set_aside: {"a:0": held, "a:1": held})
    with pytest.raises(NoCapacity, match="does not fit"):
        reserve(draft)
    assert len(scans) == 1


def test_pf_settings_are_chosen_from_the_vf_tables_read_after_the_lock() -> None:
    def rec(vf: int, rates: tuple[int, int], mac: str = "") -> VfRecord:
        return VfRecord("a", vf, f"a:{vf}", f"av{vf}", "", 1500, f"net{vf}", *rates, mac=mac)

    att = Attachment("c1", "net1", "n", "/proc/self/ns/net", "1.0.0")
    att.vfs = [rec(0, (1000, 2000), mac="02:00:00:00:00:aa"), rec(1, (0, 0)), rec(2, (0, 0))]
    reads: list[str] = []

    class VfCtl:
        def read(self, pf: str) -> dict[int, VfInfo]:
            reads.append(pf)
            # VF 0 as the last pod left it; VF 1 rate-capped by someone; VF 2 not reported.
            return {0: VfInfo(0, vlan=12, qos=0, trust=True), 1: VfInfo(1, min_tx_rate=0, max_tx_rate=300)}

    conf = load_netconf({"cniVersion": "1.0.0", "name": "n", "type": "rdma-cni", "spoofchk": False})
    add.pf_settings(att, conf, VfCtl())  # type: ignore[arg-type]
    assert reads == ["a"]  # one table per PF
    first, second, third = att.vfs
    assert first.pf_applied == {
        "rate": [1000, 2000],
        "spoofchk": False,
        "vlan": [0, 0],
        "trust": False,
        "mac": "02:00:00:00:00:aa",
    }
    assert first.pf_original == {
        "rate": [0, 0],
        "spoofchk": True,
        "vlan": [12, 0],
        "trust": True,
        "mac": "00:00:00:00:00:00",
    }
    assert second.pf_applied == {"rate": [0, 0], "spoofchk": False}  # its cap lifted, and restored
    assert second.pf_original == {"rate": [0, 300], "spoofchk": True}
    assert third.pf_applied == {"spoofchk": False} and third.pf_original == {"spoofchk": True}
