"""``rdma-cni inventory`` on the simulated node: the original daemon's schema plus what operators need."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.integration.conftest import Cluster, plugin_command
from tests.support.simnode import SimPf

LEGACY_PF_KEYS = {"name", "used_tx_rate", "capacity_tx_rate", "used_vfs", "capacity_vfs", "vfs"}
LEGACY_VF_KEYS = {
    "vf",
    "mac",
    "vlan",
    "min_tx_rate",
    "max_tx_rate",
    "spoof_check",
    "trust",
    "link_state",
    "allocated",
}


def inventory(cluster: Cluster, conf: dict[str, object], *extra: str) -> dict[str, object]:
    path = os.path.join(cluster.tmp, "inventory-conf.json")
    with open(path, "w") as f:
        json.dump(conf, f)
    out = subprocess.run(
        [*plugin_command(), "inventory", "--config", path, *extra],
        env=cluster.env("VERSION"),
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    return json.loads(out.stdout)


@pytest.mark.node([SimPf("simpf0", 3, 25000, numa_node=1, rdma=True), SimPf("simpf1", 2, None)])
def test_inventory_describes_the_node_and_its_owners(cluster: Cluster) -> None:
    # A software RoCE device sitting on VF 1 of simpf1, matched through its parent netdev.
    rxe = os.path.join(cluster.node.sysfs, "class", "infiniband", "rxe0")
    os.makedirs(rxe)
    with open(os.path.join(rxe, "parent"), "w") as f:
        f.write(cluster.node.vf_netdev(1, 1) + "\n")
    conf = cluster.conf()
    pod = cluster.pod([{"min_tx_rate": 4000, "max_tx_rate": 9000}])
    assert cluster.run("ADD", pod, conf).ok

    doc = inventory(cluster, conf)
    pfs = {pf["name"]: pf for pf in doc["pfs"]}
    assert set(pfs) == {"simpf0", "simpf1"}
    for pf in pfs.values():
        assert set(pf) >= LEGACY_PF_KEYS
        for vf in pf["vfs"]:
            assert set(vf) >= LEGACY_VF_KEYS
    fast, unknown = pfs["simpf0"], pfs["simpf1"]
    assert (fast["capacity_tx_rate"], fast["capacity_source"], fast["numa_node"]) == (25000, "speed", 1)
    assert (unknown["capacity_tx_rate"], unknown["capacity_source"]) == (None, "unknown")
    assert fast["pci_address"] == cluster.node.pf_pci(0)
    # The 4000 Mbit/s reservation can only go on the PF of known capacity.
    assert (fast["used_vfs"], fast["used_tx_rate"], fast["capacity_vfs"], fast["free_vfs"]) == (1, 4000, 3, 2)
    taken = [vf for vf in fast["vfs"] if vf["allocated"]]
    assert len(taken) == 1
    owner = taken[0]["owner"]
    assert owner["pod"].startswith("default/pod") and owner["container_id"] == pod["CNI_CONTAINERID"]
    assert (owner["pod_ifname"], owner["reserved_min_tx_rate"], owner["requested_max_tx_rate"]) == (
        "net1",
        4000,
        9000,
    )
    assert taken[0]["netdev"] is None or taken[0]["netdev"] == cluster.node.vf_netdev(0, taken[0]["vf"])
    assert (taken[0]["min_tx_rate"], taken[0]["max_tx_rate"]) == (4000, 9000)
    free = [vf for vf in fast["vfs"] if not vf["allocated"]]
    assert all(
        vf["min_tx_rate"] == 0 and vf["spoof_check"] is True and vf["link_state"] == "auto" for vf in free
    )
    assert [vf["pci_address"] for vf in fast["vfs"]] == [cluster.node.vf_pci(0, i) for i in range(3)]
    assert all(vf["rdma_devices"] == [f"mlx5_{vf['vf']}"] for vf in fast["vfs"])
    assert all(vf["driver"] == "simvf" for vf in fast["vfs"])
    assert unknown["vfs"][1]["rdma_devices"] == ["rxe0"] and unknown["vfs"][0]["rdma_devices"] == []
    # No RDMA stack on this kernel: the mode is unknown and says why.
    assert doc["rdma_netns_mode"] is None and "rdma_error" in doc
    assert cluster.run("DEL", pod, conf).ok


def test_inventory_honours_pfs_and_capacity_overrides(cluster: Cluster) -> None:
    doc = inventory(cluster, cluster.conf(pfs=["simpf1"], capacityMbps={"simpf1": 40000}), "--pretty")
    (pf,) = doc["pfs"]
    assert (pf["name"], pf["capacity_tx_rate"], pf["capacity_source"]) == ("simpf1", 40000, "config")


def test_inventory_reports_a_corrupt_record_and_keeps_going(cluster: Cluster) -> None:
    os.makedirs(os.path.join(cluster.state_dir, "attachments"))
    with open(os.path.join(cluster.state_dir, "attachments", "bad@net1.json"), "w") as f:
        f.write("[")
    doc = inventory(cluster, cluster.conf())
    (problem,) = doc["unreadable_records"]
    assert "bad@net1.json" in problem
    # Reporting changes nothing: the record stays for ADD to set aside.
    assert os.listdir(os.path.join(cluster.state_dir, "attachments")) == ["bad@net1.json"]
    assert all(vf["free"] for pf in doc["pfs"] for vf in pf["vfs"])


def test_inventory_counts_a_vf_left_in_a_pod_without_record_as_not_free(cluster: Cluster) -> None:
    conf = cluster.conf()
    pod = cluster.pod([{}])
    add = cluster.run("ADD", pod, conf)
    assert add.ok and add.doc is not None
    held = add.doc["interfaces"][0]["pciID"]
    (record,) = cluster.records
    os.unlink(os.path.join(cluster.state_dir, "attachments", record))  # a lost record
    doc = inventory(cluster, conf)
    vfs = {vf["pci_address"]: vf for pf in doc["pfs"] for vf in pf["vfs"]}
    # No record holds it, but the kernel does not show it home: as ADD judges it, not free.
    assert vfs[held]["allocated"] is False and vfs[held]["free"] is False
    assert sum(vf["free"] for vf in vfs.values()) == len(vfs) - 1
    assert cluster.run("DEL", pod, conf).ok  # DEL without a record brings it home
    doc = inventory(cluster, conf)
    assert all(vf["free"] for pf in doc["pfs"] for vf in pf["vfs"])


@pytest.mark.node([SimPf("simpf0", 3, 25000), SimPf("simpf1", 2, None)])
def test_doctor_reads_the_simulated_node(cluster: Cluster) -> None:
    """``rdma-cni doctor`` counts each PF's VFs through the inventory and exits with the worst finding."""
    conf = cluster.conf()
    assert cluster.run("ADD", cluster.pod([{}]), conf).ok
    path = os.path.join(cluster.tmp, "doctor-conf.json")
    with open(path, "w") as f:
        json.dump(conf, f)
    cache = os.path.join(cluster.tmp, "doctor-cache")
    out = subprocess.run(
        [
            *plugin_command(),
            "doctor",
            "--json",
            "--config",
            path,
            "--nri-socket",
            "",
            "--kubeconfig",
            os.path.join(cluster.tmp, "no.kubeconfig"),
            "--cache-dir",
            cache,
        ],
        env=cluster.env("VERSION"),
        capture_output=True,
        text=True,
        check=False,
    )
    doc = json.loads(out.stdout)
    checks = {c["check"]: c for c in doc["checks"]}
    assert checks["vfs"]["status"] == "OK", checks["vfs"]
    detail = checks["vfs"]["detail"]
    assert "simpf0: 3 VFs" in detail and "simpf1: 2 VFs" in detail
    assert detail.count("1 used") == 1  # the one pod's VF, on whichever PF placement chose
    assert checks["kubeconfig-token"]["status"] == "FAIL"  # this node has no installer's kubeconfig
    assert checks["nri-socket"]["status"] == "SKIP"
    assert out.returncode == doc["exit_code"] == 2


def test_inventory_shows_a_dra_claims_vfs_as_held(cluster: Cluster) -> None:
    from rdma_cni.node.prepared import Preparation, PreparedStore, PreparedVf

    pci = cluster.node.vf_pci(0, 1)
    store = PreparedStore(cluster.state_dir)
    uid = "0f3c2a9e-6d4b-4c7e-9a1f-2b8d3e4f5a61"
    store.write(
        Preparation(
            "ml",
            "trainer-rdma",
            uid,
            "trainer",
            "pod-uid",
            [PreparedVf("if0", "rdma-dra", "simpf0", "dev", "node-1", "s", 1, pci, 15000, 0)],
        )
    )
    doc = inventory(cluster, cluster.conf())
    (vf,) = [v for pf in doc["pfs"] for v in pf["vfs"] if v["pci_address"] == pci]
    assert vf["allocated"] and not vf["free"]
    assert vf["owner"]["container_id"] == f"dra-claim-{uid}" and vf["owner"]["pod"] == "ml/trainer"
    assert vf["owner"]["reserved_min_tx_rate"] == 15000
    # An unreadable preparation is reported, as an unreadable record is.
    with open(store.path(uid), "w") as f:
        f.write("[")
    doc = inventory(cluster, cluster.conf())
    assert any("DRA preparation" in p for p in doc["unreadable_records"])
