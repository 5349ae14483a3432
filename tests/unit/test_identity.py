"""VF identity on real hardware (parent device) and the finder's rules, without a kernel.

The integration tier runs the same finder with the veth-peer identity on real
namespaces; the QEMU tier runs the parent-device identity on igb VFs. These
pin the rules both rely on: a stacked device is not its VF, and two links
claiming one VF prove nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rdma_cni.kernel import identity, sysfs
from rdma_cni.kernel.identity import FAKE_ENV, ParentDevice, VfFinder, kernel_reports_parent
from rdma_cni.kernel.netlink import Link

PCI = "0000:3b:02.1"


def link(index: int, name: str, **kw: object) -> Link:
    return Link(index=index, name=name, mac="", mtu=1500, up=True, **kw)  # type: ignore[arg-type]


class FakeHost:
    def __init__(self, links: list[Link]) -> None:
        self._links = links
        self.dumps = 0

    def links(self) -> list[Link]:
        self.dumps += 1
        return list(self._links)


@pytest.fixture(autouse=True)
def real_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAKE_ENV, raising=False)


def test_parent_device_is_the_identity() -> None:
    ident = ParentDevice(from_rtnetlink=True)
    vf = link(7, "ens1f0v1", parent_dev=PCI, parent_bus="pci")
    assert ident.of(vf, None) == ident.expected(PCI)


@pytest.mark.parametrize(
    "other",
    [
        link(8, "ens1f0v1.10", parent_dev=PCI, parent_bus="pci", link_index=7),  # VLAN / IPoIB child
        link(9, "net1", parent_dev=PCI, parent_bus="usb"),
        link(10, "net1", alias="rdma-cni:" + PCI),  # a decoy with the alias and no parent
    ],
    ids=["stacked", "other-bus", "alias-only"],
)
def test_look_alikes_are_not_the_vf(other: Link) -> None:
    ident = ParentDevice(from_rtnetlink=True)
    assert ident.of(other, None) != ident.expected(PCI)


def test_finder_one_dump_and_no_trust_in_two_claimants() -> None:
    vf = link(7, "ens1f0v1", parent_dev=PCI, parent_bus="pci")
    host = FakeHost([vf, link(3, "eth0", parent_dev="0000:3b:00.0", parent_bus="pci")])
    finder = VfFinder(host)  # type: ignore[arg-type]
    assert finder.in_host(PCI) == vf
    assert finder.find(PCI) == ("host", vf)
    assert finder.in_host("0000:3b:02.2") is None
    assert host.dumps == 1
    twin = link(12, "twin", parent_dev=PCI, parent_bus="pci")
    assert VfFinder(FakeHost([vf, twin])).in_host(PCI) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("release", "reports"),
    [
        ("6.12.107+deb13-amd64", True),
        ("5.16.0", True),
        ("5.15.0-91-generic", False),
        ("4.18.0-513.el8", False),
    ],
)
def test_parent_device_comes_from_rtnetlink_from_linux_5_16(release: str, reports: bool) -> None:
    assert kernel_reports_parent(release) is reports


def test_before_5_16_the_identity_is_ethtool_bus_info(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"ens1f0v1": ("igbvf", PCI), "decoy": ("veth", "")}
    monkeypatch.setattr(identity, "drvinfo", lambda name, fd=None: answers[name])
    old = ParentDevice(from_rtnetlink=False)
    assert old.of(link(7, "ens1f0v1"), None) == old.expected(PCI)
    assert old.of(link(8, "decoy", alias="rdma-cni:" + PCI), None) is None
    assert old.of(link(9, "ens1f0v1", link_index=7), None) is None  # a stacked device


class FakePodRtnl:
    """A pod's rtnetlink answering single-link requests by index or name, counting them."""

    def __init__(self, links: list[Link]) -> None:
        self.links_by_index = {lk.index: lk for lk in links}
        self.asked: list[tuple[str, object]] = []

    def get_link(self, *, name: str | None = None, index: int | None = None) -> Link | None:
        if index is not None:
            self.asked.append(("index", index))
            return self.links_by_index.get(index)
        self.asked.append(("name", name))
        return next((lk for lk in self.links_by_index.values() if lk.name == name), None)


class FakePod:
    path = "/run/netns/pod"
    fd = -1

    def __init__(self, links: list[Link]) -> None:
        self.rtnl = FakePodRtnl(links)


def walked(monkeypatch: pytest.MonkeyPatch, links: list[Link], *, complete: bool = True) -> list[int]:
    """Replace the bounded walk with one over ``links``; returns a list that counts the walks."""
    from rdma_cni.kernel import linkscan

    walks: list[int] = []

    def walk(netns: object, keep: object, bound: object = None) -> linkscan.Scan:
        walks.append(1)
        kept = [lk for lk in links if keep(lk)]  # type: ignore[operator]
        return linkscan.Scan(kept, len(links), complete, "" if complete else "4096 links examined")

    monkeypatch.setattr(linkscan, "walk", walk)
    return walks


def test_a_pods_vf_is_asked_for_at_its_recorded_index_and_nothing_is_walked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    vf = link(40, "renamed", parent_dev=PCI, parent_bus="pci")
    pod = FakePod([vf, link(2, "net1")])  # a decoy under the recorded name
    walks = walked(monkeypatch, [vf])
    finder = VfFinder(FakeHost([]), pod)  # type: ignore[arg-type]
    assert finder.find(PCI, pod_index=40, pod_name="net1") == ("pod", vf)
    assert pod.rtnl.asked == [("index", 40)] and walks == []


def test_what_sits_at_the_index_or_under_the_name_is_taken_only_with_the_vfs_identity(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    vf = link(77, "elsewhere", parent_dev=PCI, parent_bus="pci")
    decoys = [
        link(40, "x", alias="rdma-cni:" + PCI),
        link(2, "net1", parent_dev=PCI, parent_bus="pci", link_index=9),
    ]
    pod = FakePod([*decoys, vf])
    walks = walked(monkeypatch, [*decoys, vf], complete=False)
    finder = VfFinder(FakeHost([]), pod)  # type: ignore[arg-type]
    assert finder.in_pod(PCI, 40, "net1") == vf  # neither decoy: the walk found it
    assert pod.rtnl.asked == [("index", 40), ("name", "net1")]
    assert finder.vfs_in_pod([PCI, "0000:3b:02.2"], {PCI: (40, "net1")}) == {PCI: vf}
    assert walks == [1]  # once per finder
    assert "walked only in part (4096 links examined" in caplog.text
    assert finder.asked_in_pod(PCI, 40, "net1") is None  # the asking alone never walks


def test_a_record_without_an_index_asks_by_name_then_walks(monkeypatch: pytest.MonkeyPatch) -> None:
    vf = link(5, "net1", parent_dev=PCI, parent_bus="pci")
    pod = FakePod([vf])
    walks = walked(monkeypatch, [vf])
    assert VfFinder(FakeHost([]), pod).in_pod(PCI, 0, "net1") == vf  # type: ignore[arg-type]
    assert pod.rtnl.asked == [("name", "net1")] and walks == []
    assert VfFinder(FakeHost([]), pod).in_pod(PCI) == vf  # type: ignore[arg-type]
    assert walks == [1]
    assert VfFinder(FakeHost([])).in_pod(PCI) is None  # type: ignore[arg-type]
    assert VfFinder(FakeHost([])).asked_in_pod(PCI, 5, "net1") is None  # type: ignore[arg-type]


def test_the_simulations_wire_is_read_from_sysfs_without_rtnetlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fake tree names the VF's wire; the host's sysfs gives its ifindex, so proving a VF home
    # under the node lock does not wait for the RTNL lock for it (another pod's namespace move).
    fake = tmp_path / "fake"
    (fake / "bus" / "pci" / "devices" / PCI).mkdir(parents=True)
    (fake / "bus" / "pci" / "devices" / PCI / identity.WIRE_FILE).write_text("sv0w1\n")
    host = tmp_path / "host-net"
    (host / "sv0w1").mkdir(parents=True)
    (host / "sv0w1" / "ifindex").write_text("41\n")
    monkeypatch.setenv("RDMA_CNI_SYSFS_ROOT", str(fake))
    monkeypatch.setattr(sysfs, "HOST_NET_CLASS", str(host))
    asked: list[str] = []

    def over_rtnetlink(name: str) -> Link | None:
        asked.append(name)
        return link(57, name)

    peer = identity.VethPeer(over_rtnetlink)
    assert peer.expected(PCI) == "peer:41"
    assert asked == []
    # Not in this sysfs (another namespace's view, a sysfs without it): rtnetlink answers.
    (host / "sv0w1" / "ifindex").unlink()
    assert peer.expected(PCI) == "peer:57"
    assert asked == ["sv0w1"]
