"""The node agent's pure parts: capacity as ADD counts it, merging networks, allocations, config, size."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from rdma_cni.agent import publish, snapshot
from rdma_cni.cni.errors import InvalidConfig
from rdma_cni.node import inventory
from rdma_cni.node.inventory import Node, Owner, Pf, Vf
from rdma_cni.node.record import Attachment, PodInfo, VfRecord
from rdma_cni.shared import nodestate
from rdma_cni.shared.nodestate import PfSummary


def vf(
    pf: str,
    i: int,
    *,
    owner_rate: int | None = None,
    netdev: bool = True,
    driver: str = "mlx5_core",
    rdma: bool = True,
) -> Vf:
    owner = Owner("c", "net1", "ns/p", "net1", "ready", owner_rate, 0) if owner_rate is not None else None
    return Vf(
        pf=pf,
        index=i,
        pci=f"{pf}:{i}",
        netdev=f"{pf}v{i}" if netdev else None,
        driver=driver,
        rdma_devices=[f"mlx5_{pf}{i}"] if rdma else [],
        settings=None,
        owner=owner,
    )


def node_with(*vfs_per_pf: tuple[str, int | None, list[Vf]]) -> Node:
    pfs = []
    for name, cap, vfs in vfs_per_pf:
        pf = Pf(
            name=name, pci="", numa_node=1, capacity_mbps=cap, capacity_source="config", total_vfs=len(vfs)
        )
        pf.vfs = vfs
        pfs.append(pf)
    return Node(pfs=pfs)


def test_capacity_counts_what_add_could_hand_out_plus_what_records_hold() -> None:
    node = node_with(
        (
            "pf0",
            25000,
            [
                vf("pf0", 0, owner_rate=5000),  # held: used and in capacity
                vf("pf0", 1),  # free
                vf("pf0", 2, rdma=False),  # free, but no RDMA device
                vf("pf0", 3, netdev=False),  # no netdev: neither free nor used
                vf("pf0", 4, driver="vfio-pci"),  # userspace driver: neither
            ],
        ),
    )
    auto = snapshot.pf_views(node, "auto")[0]
    assert (auto.capacity_vfs, auto.used_vfs, auto.used_tx_rate, auto.capacity_tx_rate) == (3, 1, 5000, 25000)
    required = snapshot.pf_views(node, "required")[0]
    assert (required.capacity_vfs, required.used_vfs) == (2, 1)
    # The same VFs ADD's choice takes (the shared Vf.available rule).
    assert [v.index for v in node.pfs[0].vfs if v.available("required")] == [1]
    # The inventory report, which knows no network, says "free" by the same rule (under auto).
    doc = inventory.report(node)["pfs"][0]
    assert [v["free"] for v in doc["vfs"]] == [False, True, True, False, False]
    assert doc["free_vfs"] == len(node.pfs[0].free_vfs) == 2


def test_a_network_view_without_paths_takes_the_plugins_defaults(tmp_path: Any) -> None:
    """One definition of the default stateDir and lockFile: the config's."""
    from rdma_cni.cni.config import NetConf

    path = tmp_path / "net.conf"
    path.write_text(json.dumps({"cniVersion": "1.0.0", "name": "n", "type": "rdma-cni"}))
    view = snapshot.load_view(str(path))
    assert (view.state_dir, view.lock_file) == (
        snapshot.NetworkView("n").state_dir,
        snapshot.NetworkView("n").lock_file,
    )
    assert (view.state_dir, view.lock_file) == (
        NetConf.model_fields["stateDir"].default,
        NetConf.model_fields["lockFile"].default,
    )
    assert snapshot.default_view() == snapshot.NetworkView(name="rdma-net")


def test_a_pf_in_two_networks_gets_the_most_cautious_view() -> None:
    a = nodestate.cautious(
        PfSummary("pf0", capacity_tx_rate=25000, used_tx_rate=1000, capacity_vfs=8, used_vfs=2, numa_node=0),
        PfSummary("pf0", capacity_tx_rate=10000, used_tx_rate=3000, capacity_vfs=6, used_vfs=3, numa_node=0),
    )
    assert (a.capacity_tx_rate, a.used_tx_rate, a.capacity_vfs, a.used_vfs) == (10000, 3000, 6, 3)
    b = nodestate.cautious(
        PfSummary("pf0", capacity_tx_rate=25000, used_tx_rate=0, capacity_vfs=2, used_vfs=2, numa_node=0),
        PfSummary("pf0", capacity_tx_rate=None, used_tx_rate=0, capacity_vfs=1, used_vfs=1, numa_node=0),
    )
    # Unknown capacity wins (only rate-less interfaces fit); capacity never below use.
    assert (b.capacity_tx_rate, b.capacity_vfs, b.used_vfs) == (None, 2, 2)


def test_every_pf_field_says_how_two_views_merge() -> None:
    """A new PfSummary field merges as it declares, or cautious refuses it: never one view's value kept."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class WithLink(PfSummary):
        link_up: bool = nodestate._merged(lambda a, b: a and b, default=True)  # down on either view: down

    def pf(link: bool, used: int) -> Any:
        return WithLink(
            "pf0",
            capacity_tx_rate=1,
            used_tx_rate=0,
            capacity_vfs=4,
            used_vfs=used,
            numa_node=0,
            link_up=link,
        )

    merged = nodestate.cautious(pf(True, 1), pf(False, 2))
    assert type(merged) is WithLink and not merged.link_up and merged.used_vfs == 2
    assert WithLink(
        "pf0", capacity_tx_rate=1, used_tx_rate=0, capacity_vfs=4, used_vfs=0, numa_node=0
    ).link_up

    @dataclasses.dataclass(frozen=True)
    class Forgotten(PfSummary):
        link_up: bool = True

    def bare(link: bool) -> Any:
        return Forgotten(
            "pf0", capacity_tx_rate=1, used_tx_rate=0, capacity_vfs=4, used_vfs=0, numa_node=0, link_up=link
        )

    with pytest.raises(TypeError, match=r"Forgotten\.link_up does not say how two views of a PF merge"):
        nodestate.cautious(bare(True), bare(False))
    # Every field of the real one says it.
    assert all("cautious" in f.metadata for f in dataclasses.fields(PfSummary))
    # And a field after the name is given by keyword: a positional call cannot shift values.
    with pytest.raises(TypeError):
        PfSummary("pf0", 1, 0, 4, 0, 0)  # type: ignore[misc]


def record(cid: str, ifname: str, pod: PodInfo | None, *rates: tuple[str, int, int]) -> Attachment:
    att = Attachment(container_id=cid, ifname=ifname, network="n", netns="", cni_version="1.1.0", pod=pod)
    for i, (pf, lo, hi) in enumerate(rates):
        att.vfs.append(VfRecord(pf, i, f"{pf}:{i}", "h", "m", 1500, f"net{i}", lo, hi))
    return att


def test_allocations_keep_only_the_published_pfs() -> None:
    """A DRA network's records share the state directory; their PFs are not the node state's."""
    p1, p2 = PodInfo("ns", "a", "uid-a"), PodInfo("ns", "d", "uid-d")
    got = snapshot.allocations(
        [
            record("c1", "net1", p1, ("pf0", 5000, 6000), ("dra-pf", 7000, 0)),
            record("c2", "net1", p2, ("dra-pf", 3000, 0)),  # a claim pod: no entry
        ],
        published={"pf0"},
    )
    assert got == [nodestate.Allocation("ns", "a", "uid-a", (nodestate.InterfaceUse("pf0", 5000, 6000),))]
    state = nodestate.NodeState(
        version=nodestate.VERSION_2,
        generation=0,
        updated="2026-11-28T10:00:00Z",
        networks=(nodestate.Network("n", ("pf0",), (None,)),),
        pfs=(
            PfSummary(
                "pf0", capacity_tx_rate=100000, used_tx_rate=5000, capacity_vfs=4, used_vfs=1, numa_node=None
            ),
        ),
        allocations=tuple(got),
    )
    assert nodestate.decode(nodestate.encode(state)).allocations == state.allocations


def test_allocations_one_per_pod_in_record_order_without_podless_records() -> None:
    p1 = PodInfo("ns", "a", "uid-a")
    got = snapshot.allocations(
        [
            record("c2", "net1", PodInfo("ns", "b", "uid-b"), ("pf1", 0, 0)),
            record("c1", "net1", p1, ("pf0", 5000, 6000), ("pf1", 0, 0)),
            record("c1", "net2", p1, ("pf0", 1, 2)),  # a second network of the same pod
            record("c3", "net1", None, ("pf0", 7, 7)),  # cnitool: no pod
            record("c4", "net1", PodInfo("ns", "c", "uid-c")),  # holds nothing
        ]
    )
    assert got == [
        nodestate.Allocation(
            "ns",
            "a",
            "uid-a",
            (
                nodestate.InterfaceUse("pf0", 5000, 6000),
                nodestate.InterfaceUse("pf1", 0, 0),
                nodestate.InterfaceUse("pf0", 1, 2),
            ),
        ),
        nodestate.Allocation("ns", "b", "uid-b", (nodestate.InterfaceUse("pf1", 0, 0),)),
    ]


def write(tmp_path: Any, name: str, doc: Any) -> str:
    path = os.path.join(str(tmp_path), name)
    with open(path, "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))
    return path


ENTRY = {
    "type": "rdma-cni",
    "pfs": ["ens1f0"],
    "capacityMbps": {"ens1f0": 100000},
    "rdmaIsolation": "required",
    "stateDir": "/var/lib/x",
    "lockFile": "/run/x.lock",
}


def test_network_view_from_a_conflist_and_from_an_entry(tmp_path: Any) -> None:
    conflist = {"cniVersion": "1.0.0", "name": "net-a", "plugins": [{"type": "tuning"}, ENTRY]}
    view = snapshot.load_view(write(tmp_path, "a.conflist", conflist))
    assert view == snapshot.NetworkView(
        name="net-a",
        pfs=("ens1f0",),
        capacity={"ens1f0": 100000},
        isolation="required",
        state_dir="/var/lib/x",
        lock_file="/run/x.lock",
    )
    entry = {"cniVersion": "1.0.0", "name": "net-b", "type": "rdma-cni"}
    view = snapshot.load_view(write(tmp_path, "b.conf", entry))
    assert (view.name, view.pfs, view.isolation, view.state_dir) == (
        "net-b",
        None,
        "auto",
        "/var/lib/cni/rdma-cni",
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not JSON"),
        ([1], "is not a JSON object"),
        ({"cniVersion": "1.0.0", "name": "x", "type": "bridge"}, "type is 'bridge', not 'rdma-cni'"),
        ({"cniVersion": "1.0.0", "name": "x", "plugins": [ENTRY, ENTRY]}, "found 2"),
        ({"cniVersion": "1.0.0", "name": "x", "plugins": "no"}, "found 0"),
        (
            {"cniVersion": "1.0.0", "name": "x", "type": "rdma-cni", "rdmaIsolation": "sometimes"},
            "rdmaIsolation",
        ),
    ],
)
def test_bad_network_config_names_the_file_and_the_problem(tmp_path: Any, content: Any, message: str) -> None:
    path = write(tmp_path, "bad.conf", content)
    with pytest.raises(InvalidConfig) as info:
        snapshot.load_view(path)
    assert path in info.value.msg
    assert message in info.value.msg


def test_missing_network_config(tmp_path: Any) -> None:
    with pytest.raises(InvalidConfig, match=r"cannot read network config .*nope\.conf"):
        snapshot.load_view(os.path.join(str(tmp_path), "nope.conf"))


@pytest.mark.parametrize("name", ["", "Node-1", "a/b", "x" * 254, "-a", "a..b", "../etc"])
def test_node_name_is_validated(name: str) -> None:
    with pytest.raises(ValueError, match="NODE_NAME"):
        publish.check_node_name(name)


def test_node_name_accepted() -> None:
    assert publish.check_node_name("worker-1.example.com") == "worker-1.example.com"


def big_state(pods: int, interfaces: int) -> nodestate.NodeState:
    """16 PFs x 128 VFs, long realistic names, every pod with ``interfaces`` rate-limited interfaces."""
    pfs = tuple(
        nodestate.PfSummary(
            f"ens{k:02d}f0np0",
            capacity_tx_rate=200000,
            used_tx_rate=199999,
            capacity_vfs=128,
            used_vfs=128,
            numa_node=k % 2,
        )
        for k in range(16)
    )
    allocs = []
    for p in range(pods):
        uses = tuple(
            nodestate.InterfaceUse(pfs[(p * interfaces + i) % 16].name, 15000, 20000)
            for i in range(interfaces)
        )
        allocs.append(
            nodestate.Allocation(
                "team-ml-training-prod",
                f"pytorch-worker-{p:05d}-7f9c8d6b5",
                f"0f8e0c7a-1d2b-4c3d-9e8f-{p:012d}",
                uses,
            )
        )
    return nodestate.NodeState(nodestate.VERSION, 2**40, "2026-11-22T20:48:33Z", pfs, tuple(allocs))


@pytest.mark.parametrize(
    ("pods", "interfaces", "at_most"),
    [
        (256, 1, 53_000),  # one interface per pod
        (256, 8, 161_000),  # every one of the 2,048 VFs held: the largest state such a node can have
        (64, 32, 134_000),  # fewer pods, each at the 32-interface limit
    ],
)
def test_encoded_size_of_a_full_node(pods: int, interfaces: int, at_most: int) -> None:
    state = big_state(pods, interfaces)
    size = len(nodestate.encode(state))
    assert size <= at_most
    assert size <= publish.MAX_STATE_BYTES
    assert publish.fit(state) is state
    # A reader takes it back whole.
    assert nodestate.decode(nodestate.encode(state)) == state


def test_a_state_over_budget_is_published_without_allocations() -> None:
    # 256 pods x 32 interfaces: more interfaces than the node has VFs, but
    # records could say so (a corrupt state dir): the PF totals still go out.
    state = big_state(256, 32)
    assert len(nodestate.encode(state)) > publish.MAX_STATE_BYTES
    fitted = publish.fit(state)
    assert fitted.allocations == () and fitted.pfs == state.pfs
    assert len(nodestate.encode(fitted)) < 4096


def test_rfc3339() -> None:
    assert publish.rfc3339(0) == "1970-01-01T00:00:00Z"


def test_the_shipped_daemonset_needs_no_network_config_for_the_shipped_network(tmp_path: Any) -> None:
    # conf/base/node/daemonset.yaml runs the agent without --network-config: the plugin's
    # defaults must then describe the sample network exactly, its name included.
    import yaml

    conf = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
    with open(os.path.join(conf, "network-attachment-definition.yaml")) as f:
        nad = next(d for d in yaml.safe_load_all(f) if d and d.get("kind") == "NetworkAttachmentDefinition")
    view = snapshot.load_view(write(tmp_path, "nad.conf", nad["spec"]["config"]))
    default = snapshot.default_view()
    assert (view.name, view.pfs, dict(view.capacity), view.isolation, view.state_dir, view.lock_file) == (
        default.name,
        default.pfs,
        dict(default.capacity),
        default.isolation,
        default.state_dir,
        default.lock_file,
    )
    with open(os.path.join(conf, "base/node/daemonset.yaml")) as f:
        ds = next(d for d in yaml.safe_load_all(f) if d and d.get("kind") == "DaemonSet")
    command = ds["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--node-state" in command and not any(a.startswith("--network-config") for a in command)


def test_the_defaults_state_is_one_readers_accept() -> None:
    """The agent without --network-config publishes a state that decodes (a network name readers
    accept): it once named its network "(defaults)", which every reader refused."""
    view = snapshot.default_view()
    state = nodestate.NodeState(
        version=2,
        generation=1,
        updated="2026-11-26T07:00:00Z",
        pfs=(),
        allocations=(),
        networks=(nodestate.Network(view.name, (), ()),),
    )
    assert nodestate.decode(nodestate.encode(state)).networks[0].name == view.name


def test_a_v2_state_with_railed_networks_at_256_pods_by_8_interfaces_stays_well_inside_128_kib() -> None:
    """Every allocation kept, 16 PFs in 8 two-PF rail networks and one network of all 16 (every PF railed)."""
    import dataclasses

    state = big_state(256, 8)
    names = [pf.name for pf in state.pfs]
    rails = [
        nodestate.Network(f"rdma-rail-{r}", tuple(names[2 * r : 2 * r + 2]), (f"rail-{r}",) * 2)
        for r in range(8)
    ]
    everything = nodestate.Network("rdma-all", tuple(names), tuple(f"rail-{k // 2}" for k in range(16)))
    networks = (*rails, everything)
    v2 = dataclasses.replace(state, version=nodestate.VERSION_2, networks=networks)
    text = nodestate.encode(v2)
    assert len(text) <= 57_000  # 56,361 bytes when written: 55 KiB
    assert publish.fit(v2) is v2
    assert nodestate.decode(text) == v2
