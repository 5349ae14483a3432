"""Smoke test of the QEMU tier: the guest offers real SR-IOV VFs, soft-RoCE and a
working libcni runtime, with the kernel behaviour the plugin's design relies on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from guest import BootFn, GuestRun

pytestmark = pytest.mark.e2e

SCENARIO = Path(__file__).resolve().parent / "scenarios" / "smoke.sh"

# igb VFs: offset 0x80, stride 2 behind the root port's bus 1.
EXPECTED_VFS = ["0000:01:10.0", "0000:01:10.2", "0000:01:10.4", "0000:01:10.6"]


@pytest.fixture(scope="module")
def smoke_run(e2e_boot_module: BootFn) -> GuestRun:
    """One boot shared by all smoke assertions: a boot costs ~20 s of both cores."""
    run = e2e_boot_module(SCENARIO.read_text(), timeout=600.0)
    print(
        f"\nsmoke guest: wall {run.wall_seconds:.1f} s, scenario ran from guest uptime "
        f"{run.guest_times.get('scenario_start')} s to {run.guest_times.get('scenario_end')} s"
    )
    return run


@pytest.fixture
def smoke(smoke_run: GuestRun) -> GuestRun:
    """The smoke run, for tests that read its results: they make no sense if it failed."""
    if not smoke_run.ok:
        pytest.fail("the smoke scenario did not complete: see test_scenario_completed", pytrace=False)
    return smoke_run


def test_scenario_completed(smoke_run: GuestRun) -> None:
    # The one place a failed boot is reported with its console log.
    smoke_run.check()


def _lines(run: GuestRun, name: str) -> list[str]:
    return run.read_text(name).split()


def _vfinfo(run: GuestRun, dump: str) -> list[dict]:
    (pf,) = run.read_json(f"dump-{dump}/pf.json")
    return pf["vfinfo_list"]


def test_four_vfs_at_expected_pci_addresses(smoke: GuestRun) -> None:
    assert _lines(smoke, "vf-pci.txt") == EXPECTED_VFS
    assert len(_lines(smoke, "vf-netdevs.txt")) == 4
    assert int(smoke.read_text("sriov-totalvfs.txt")) == 7


def test_max_tx_rate_is_applied_and_reported(smoke: GuestRun) -> None:
    vfs = _vfinfo(smoke, "after-rate")
    assert [vf["vf"] for vf in vfs] == [0, 1, 2, 3]
    assert vfs[0]["rate"]["max_tx"] == 100
    assert vfs[1]["rate"]["max_tx"] == 0


def test_min_tx_rate_is_rejected_with_einval(smoke: GuestRun) -> None:
    assert smoke.read_text("min-rate.rc").strip() != "0"
    assert "RTNETLINK answers: Invalid argument" in smoke.read_text("min-rate.err")


def test_rxe_devices_on_vfs(smoke: GuestRun) -> None:
    assert smoke.read_text("rxe-loaded.txt").strip() == "1", "rdma_rxe could not be loaded in the guest"
    vf_netdevs = _lines(smoke, "vf-netdevs.txt")
    links = {link["ifname"]: link["netdev"] for link in smoke.read_json("dump-after-rxe/rdma-link.json")}
    assert links == {"rxe0": vf_netdevs[2], "rxe1": vf_netdevs[3]}
    assert smoke.read_text("rxe0-parent.txt").strip() == vf_netdevs[2]


def test_rdma_netns_mode_is_shared(smoke: GuestRun) -> None:
    assert "netns shared" in smoke.read_text("dump-after-rate/rdma-system.txt")


def test_cnirun_moves_a_real_vf_into_a_pod_and_back(smoke: GuestRun) -> None:
    result = smoke.read_json("add.json")
    assert result["cniVersion"] == "1.0.0"
    assert result["interfaces"][0]["name"] == "net1"
    assert result["interfaces"][0]["sandbox"] == "/run/netns/pod1"
    assert result["ips"][0]["address"].startswith("10.56.0.")

    (pod_link,) = smoke.read_json("pod1-net1.json")
    assert any(a["local"] == result["ips"][0]["address"].split("/")[0] for a in pod_link["addr_info"])
    # While in the pod, the VF has no netdev in the host namespace.
    assert smoke.read_text("vf1-host-netdev-during.txt").strip() == ""
    # DEL brought it back under its original name.
    original = _lines(smoke, "vf-netdevs.txt")[1]
    assert smoke.read_text("vf1-host-netdev-after-del.txt").strip() == original


def test_cnirun_reports_errors_as_cni_json(smoke: GuestRun) -> None:
    assert smoke.read_text("error.rc").strip() == "1"
    error = json.loads(smoke.read_text("error.json"))
    assert set(error) == {"code", "msg", "details"}
    assert "failed to find plugin" in error["msg"]


def test_vf_returns_with_pod_name_when_netns_is_deleted(smoke: GuestRun) -> None:
    # The kernel fact behind "DEL finds VFs by PCI address, not by name".
    assert smoke.read_text("vf1-after-netns-del.txt").strip() == "net1"
