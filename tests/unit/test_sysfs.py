"""sysfs names read from links: a device's PCI address, a VF's, a bound driver's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rdma_cni.kernel import sysfs

PCI = "0000:3b:02.1"


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small sysfs: a PF whose links are relative, as the kernel makes them."""
    monkeypatch.setenv("RDMA_CNI_SYSFS_ROOT", str(tmp_path))
    devices = tmp_path / "devices" / "pci0000:3a" / "0000:3a:00.0"
    pf, vf = devices / "0000:3b:00.0", devices / PCI
    drivers = tmp_path / "bus" / "pci" / "drivers" / "mlx5_core"
    for d in (pf, vf, drivers, tmp_path / "class" / "net" / "ens1f0", tmp_path / "bus" / "pci" / "devices"):
        d.mkdir(parents=True)
    (tmp_path / "class" / "net" / "ens1f0" / "device").symlink_to(
        os.path.relpath(pf, tmp_path / "class/net/ens1f0")
    )
    (pf / "virtfn0").symlink_to(f"../{PCI}")
    (tmp_path / "bus" / "pci" / "devices" / PCI).symlink_to(os.path.relpath(vf, tmp_path / "bus/pci/devices"))
    (vf / "driver").symlink_to(os.path.relpath(drivers, vf))
    return tmp_path


def test_addresses_and_driver_come_from_the_links(tree: Path) -> None:
    assert sysfs.pci_address(sysfs.pf_device_dir("ens1f0")) == "0000:3b:00.0"
    assert sysfs.vf_pci("ens1f0", 0) == PCI
    assert sysfs.pci_driver(PCI) == "mlx5_core"


def test_a_link_that_does_not_end_in_its_directory_is_resolved_in_full(tree: Path) -> None:
    pf = tree / "class" / "net" / "ens1f0" / "device"
    (pf / "virtfn1").symlink_to(f"../{PCI}/driver/..")  # ends in "..": the drivers directory
    (pf / "virtfn2").symlink_to("virtfn0")  # ends in another link: the VF
    for i in (0, 1, 2):
        link = str(pf / f"virtfn{i}")
        assert sysfs._target_name(link) == os.path.basename(os.path.realpath(link))
    assert sysfs.vf_pci("ens1f0", 1) == ""
    assert sysfs.vf_pci("ens1f0", 2) == PCI


def test_missing_and_non_link_paths(tree: Path) -> None:
    assert sysfs.vf_pci("ens1f0", 7) == ""  # no such VF: no link
    assert sysfs.pci_address(str(tree / "devices" / "pci0000:3a" / "0000:3a:00.0")) == "0000:3a:00.0"
    assert sysfs.pci_driver("0000:00:00.0") == ""
