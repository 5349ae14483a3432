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


@pytest.fixture
def sim_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The simulated node's fake tree naming VF ``PCI``'s wire ``sv0w1``; returns the host's class/net."""
    fake = tmp_path / "fake"
    (fake / "bus" / "pci" / "devices" / PCI).mkdir(parents=True)
    (fake / "bus" / "pci" / "devices" / PCI / identity.WIRE_FILE).write_text("sv0w1\n")
    host = tmp_path / "host-net"
    host.mkdir()
    monkeypatch.setenv("RDMA_CNI_SYSFS_ROOT", str(fake))
    monkeypatch.setattr(sysfs, "HOST_NET_CLASS", str(host))
    return host


def test_the_simulations_wire_is_read_from_sysfs_without_rtnetlink(sim_host: Path) -> None:
    # The fake tree names the VF's wire; the host's sysfs gives its ifindex, so proving a VF home
    # under the node lock does not wait for the RTNL lock for it (another pod's namespace move).
    host = sim_host
    (host / "sv0w1").mkdir(parents=True)
    (host / "sv0w1" / "ifindex").write_text("41\n")
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


def netdev_dir(
    path: Path, ifindex: int, iflink: int, mac: str = "02:00:00:00:00:07", flags: str = "0x1003"
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, value in (
        ("ifindex", ifindex),
        ("iflink", iflink),
        ("address", mac),
        ("mtu", 1500),
        ("flags", flags),
    ):
        (path / name).write_text(f"{value}\n")
    return path


class ViewHost(FakeHost):
    """A host whose only rtnetlink request may be the dump: what sysfs proves must not need one."""

    def get_link(self, **kw: object) -> Link | None:
        raise AssertionError(f"rtnetlink asked for {kw}")


def test_sysfs_files_of_a_netdev(tmp_path: Path) -> None:
    d = netdev_dir(tmp_path / "eth7", 7, 7)
    assert sysfs.netdev_files(str(d)) == sysfs.NetdevFiles(7, 7, "02:00:00:00:00:07", 1500, 0x1003)
    (d / "flags").write_text("up\n")
    assert sysfs.netdev_files(str(d)) is None  # not whole: not proven
    (d / "flags").write_text("0x1002\n")
    (d / "mtu").unlink()
    assert sysfs.netdev_files(str(d)) is None
    assert sysfs.netdev_files(str(tmp_path / "gone")) is None


def test_a_netdev_replaced_while_read_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = netdev_dir(tmp_path / "eth7", 7, 7)
    indexes = iter([7, 9])
    real = sysfs._read_int
    monkeypatch.setattr(sysfs, "_read_int", lambda p: next(indexes) if p.endswith("/ifindex") else real(p))
    assert sysfs.netdev_files(str(d)) is None


@pytest.mark.parametrize("name", ["", ".", "..", "../eth0", "a/b"])
def test_a_name_is_never_a_path(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    netdev_dir(tmp_path / "net" / "x", 7, 7)
    monkeypatch.setattr(sysfs, "HOST_NET_CLASS", str(tmp_path / "net" / "x"))
    assert sysfs.host_netdev(name) is None
    assert sysfs.pci_netdev(name, "x") is None


def test_parent_device_proves_a_vf_home_by_its_pci_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RDMA_CNI_SYSFS_ROOT", str(tmp_path))
    vf_net = tmp_path / "bus" / "pci" / "devices" / PCI / "net"
    netdev_dir(vf_net / "ens1f0v1", 7, 7)
    ident = ParentDevice(from_rtnetlink=True)
    home = ident.home_in_sysfs(PCI, "ens1f0v1")
    assert home is not None and (home.index, home.name, home.mac, home.mtu, home.up) == (
        7,
        "ens1f0v1",
        "02:00:00:00:00:07",
        1500,
        True,
    )
    assert ident.of(home, None) == ident.expected(PCI)
    assert ident.home_in_sysfs(PCI, "ens1f0v2") is None  # not under this device (or in a pod)
    assert ident.home_in_sysfs("0000:3b:02.2", "ens1f0v1") is None
    netdev_dir(vf_net / "ib0.8001", 9, 7)  # an IPoIB child shares the parent, not the identity
    assert ident.home_in_sysfs(PCI, "ib0.8001") is None


def test_the_simulations_vf_is_home_when_the_hosts_sysfs_shows_it_beside_its_wire(sim_host: Path) -> None:
    host = sim_host
    netdev_dir(host / "sv0w1", 41, 40)
    netdev_dir(host / "sv0v1", 40, 41)
    netdev_dir(host / "decoy", 50, 51)
    netdev_dir(host / "solo", 52, 52)
    peer = identity.VethPeer(ViewHost([]).get_link)  # type: ignore[arg-type]
    home = peer.home_in_sysfs(PCI, "sv0v1")
    assert home is not None and (home.index, home.link_index) == (40, 41)
    assert peer.of(home, None) == peer.expected(PCI)
    for other in ("decoy", "solo", "elsewhere"):  # another peer, no peer, not in this sysfs
        assert peer.home_in_sysfs(PCI, other) is None


@pytest.fixture
def host_net(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    net = tmp_path / "class-net"
    net.mkdir()
    monkeypatch.setattr(sysfs, "HOST_NET_CLASS", str(net))
    monkeypatch.setattr(identity, "_VIEWS_PROVEN", set())
    return net


def test_sysfs_is_trusted_once_it_shows_this_namespaces_links(host_net: Path) -> None:
    netdev_dir(host_net / "lo", 1, 1, mac="00:00:00:00:00:00")
    netdev_dir(host_net / "eth0", 2, 2, mac="52:54:00:12:34:56")
    links = [link(1, "lo"), Link(2, "eth0", "52:54:00:12:34:56", 1500, True), link(3, "gone-meanwhile")]
    host = ViewHost(links)
    assert identity.sysfs_shows(host)  # type: ignore[arg-type]
    assert identity.sysfs_shows(host)  # type: ignore[arg-type]
    assert host.dumps == 1  # once per process and view


@pytest.mark.parametrize(
    "dumped",
    [
        [Link(2, "eth0", "52:54:00:aa:bb:cc", 1500, True)],  # same name and index, another MAC
        [Link(5, "eth0", "52:54:00:12:34:56", 1500, True)],  # another index
        [link(1, "lo")],  # nothing but lo to compare
        [Link(2, "eth0", "52:54:00:12:34:56", 1500, True), link(3, "a"), link(4, "b")],  # most unseen
    ],
    ids=["mac", "index", "only-lo", "most-unseen"],
)
def test_sysfs_of_another_namespace_is_not_trusted(
    dumped: list[Link], host_net: Path, caplog: pytest.LogCaptureFixture
) -> None:
    netdev_dir(host_net / "lo", 1, 1, mac="00:00:00:00:00:00")
    netdev_dir(host_net / "eth0", 2, 2, mac="52:54:00:12:34:56")
    host = ViewHost(dumped)
    assert not identity.sysfs_shows(host)  # type: ignore[arg-type]
    assert host.dumps == identity._VIEW_ATTEMPTS
    assert "are not those of this network namespace" in caplog.text
    finder = VfFinder(host)  # type: ignore[arg-type]
    assert not finder.trust_sysfs()


def test_the_finder_proves_by_sysfs_only_when_trusted(
    host_net: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    netdev_dir(host_net / "eth0", 2, 2, mac="52:54:00:12:34:56")
    root = tmp_path / "root"
    netdev_dir(root / "bus" / "pci" / "devices" / PCI / "net" / "ens1f0v1", 7, 7)
    monkeypatch.setenv("RDMA_CNI_SYSFS_ROOT", str(root))
    vf = link(7, "ens1f0v1", parent_dev=PCI, parent_bus="pci")
    eth0 = Link(2, "eth0", "52:54:00:12:34:56", 1500, True)

    class Host(FakeHost):
        def __init__(self, links: list[Link]) -> None:
            super().__init__(links)
            self.asked: list[str] = []

        def get_link(self, *, name: str | None = None, index: int | None = None) -> Link | None:
            self.asked.append(str(name))
            return vf if name == "ens1f0v1" else None

    monkeypatch.setattr(identity, "kernel_reports_parent", lambda release=None: True)
    untrusted = Host([eth0, vf])
    assert VfFinder(untrusted).in_host(PCI, "ens1f0v1") == vf  # type: ignore[arg-type]
    assert untrusted.asked == ["ens1f0v1"]
    trusted = Host([eth0, vf])
    finder = VfFinder(trusted)  # type: ignore[arg-type]
    assert finder.trust_sysfs()
    home = finder.in_host(PCI, "ens1f0v1")
    assert home is not None and home.index == 7 and trusted.asked == []
    # Not shown there (in a pod, under another name): rtnetlink decides, as before.
    assert finder.in_host("0000:3b:02.2", "ens1f0v2") is None
    assert trusted.asked == ["ens1f0v2"]
