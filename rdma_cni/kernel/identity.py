"""Which netdev is which VF: decided only by what the kernel reports and a pod cannot change.

A pod with CAP_NET_ADMIN in its namespace can rename its interfaces, rewrite
their aliases and create new ones (a veth named and labelled like its VF), so
names and aliases prove nothing. What it cannot change:

- on real hardware, the netdev's parent device as rtnetlink reports it
  (``IFLA_PARENT_DEV_NAME`` = the VF's PCI address on bus
  ``IFLA_PARENT_DEV_BUS_NAME`` = ``pci``; kernels before 5.16 do not report
  it, and there ethtool's driver info, bus-info, is asked instead); a stacked
  device (VLAN, IPoIB child) names a lower link in ``IFLA_LINK`` and is
  refused;
- on the simulated node (tests, demo), whose VFs are veths: the kernel-reported
  peer of the pod-side end (``IFLA_LINK`` ifindex in the namespace
  ``IFLA_LINK_NETNSID``), which must be the VF's "wire" in the host. The fake
  sysfs tree names each VF's wire in ``bus/pci/devices/<pci>/rdma_cni_sim_wire``,
  read only when ``RDMA_CNI_FAKE_VF_IDENTITY`` is set (the integration tier's
  seam, announced in the log).

The lookup (:class:`VfFinder`) is one code path for both; only
:meth:`Identity.of` and :meth:`Identity.expected` differ. A netdev is moved
into the host, or a VF counted as free, only when its identity matches; two
links claiming one identity prove nothing and neither is used.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from rdma_cni.kernel import linkscan, sysfs
from rdma_cni.kernel.netlink import Link, Rtnl

if TYPE_CHECKING:
    from rdma_cni.kernel.netns import Netns

log = logging.getLogger("rdma_cni.identity")

FAKE_ENV = "RDMA_CNI_FAKE_VF_IDENTITY"
WIRE_FILE = "rdma_cni_sim_wire"


class Identity(Protocol):
    def expected(self, pci: str) -> str | None:
        """The identity VF ``pci``'s netdev shows, or None when it cannot be known now."""
        ...

    def of(self, link: Link, pod: Netns | None) -> str | None:
        """The identity of ``link`` as dumped in ``pod`` (None: the host), or None for a non-VF."""
        ...

    def home_in_sysfs(self, pci: str, name: str) -> Link | None:
        """VF ``pci``'s netdev under ``name``, proven in the host by sysfs alone, or None: not proven so.

        Only once :func:`sysfs_shows` has said the real sysfs is this namespace's view.
        """
        ...


# rtnetlink reports a netdev's parent device from Linux 5.16 on; older kernels
# answer the same question through ethtool's driver info (bus-info).
PARENT_DEV_KERNEL = (5, 16)
SIOCETHTOOL = 0x8946
ETHTOOL_GDRVINFO = 0x00000003
_DRVINFO_SIZE = 196  # struct ethtool_drvinfo
_BUS_INFO = slice(4 + 3 * 32, 4 + 4 * 32)  # after cmd, driver, version, fw_version


def kernel_reports_parent(release: str | None = None) -> bool:
    """Does this kernel put IFLA_PARENT_DEV_NAME in link dumps?"""
    parts = (release or os.uname().release).split(".")
    try:
        return (int(parts[0]), int(parts[1].split("-")[0])) >= PARENT_DEV_KERNEL
    except (IndexError, ValueError):
        return True


def drvinfo(ifname: str, netns_fd: int | None = None) -> tuple[str, str]:
    """(driver, bus-info) of a netdev from ethtool's GDRVINFO, in ``netns_fd`` (None: this namespace)."""
    import array
    import fcntl
    import socket
    import struct

    from rdma_cni.kernel.netns import in_netns

    buf = array.array("B", struct.pack("=I", ETHTOOL_GDRVINFO) + bytes(_DRVINFO_SIZE - 4))
    ifreq = struct.pack("16sP", ifname.encode()[:15], buf.buffer_info()[0]).ljust(40, b"\0")
    if netns_fd is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    else:
        with in_netns(netns_fd):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    with sock:
        fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifreq)
    raw = bytes(buf)

    def text(field: bytes) -> str:
        return field.split(b"\0")[0].decode(errors="replace")

    return text(raw[4:36]), text(raw[_BUS_INFO])


class ParentDevice:
    """Real hardware: the netdev's parent PCI device (rtnetlink; ethtool bus-info before Linux 5.16)."""

    def __init__(self, from_rtnetlink: bool | None = None) -> None:
        self.from_rtnetlink = kernel_reports_parent() if from_rtnetlink is None else from_rtnetlink

    def expected(self, pci: str) -> str | None:
        return "pci:" + pci

    def of(self, link: Link, pod: Netns | None) -> str | None:
        # A VF's own netdev has no lower link; VLAN or IPoIB children of it
        # share its parent device but name it in IFLA_LINK.
        if link.link_index not in (0, link.index):
            return None
        if self.from_rtnetlink:
            if link.parent_bus != "pci" or not link.parent_dev:
                return None
            return "pci:" + link.parent_dev
        try:
            _driver, bus = drvinfo(link.name, pod.fd if pod is not None else None)
        except OSError:
            return None  # no ethtool driver info (loopback, some virtual devices): not a VF
        return "pci:" + bus if bus else None

    def home_in_sysfs(self, pci: str, name: str) -> Link | None:
        # The kernel files a netdev under its parent device's directory, and sysfs lists only the
        # netdevs of the namespace it was mounted in: a VF's netdev there is home, whatever kernel.
        files = sysfs.pci_netdev(pci, name)
        if files is None or files.iflink != files.ifindex:  # a stacked child (IPoIB) is not the VF
            return None
        return _link(name, files, parent_dev=pci, parent_bus="pci")


class VethPeer:
    """The simulated node: the veth's peer, which must be the VF's wire in the host."""

    def __init__(self, host_link: HostLinks) -> None:
        self._host_link = host_link
        log.warning("VF identity is simulated by veth peers (%s is set): not for production", FAKE_ENV)

    def expected(self, pci: str) -> str | None:
        try:
            with open(os.path.join(sysfs.pci_dir(pci), WIRE_FILE), encoding="ascii") as f:
                wire = f.read().strip()
        except OSError:
            return None
        # sysfs answers without the RTNL lock, which every other pod's namespace move holds while
        # this runs under the node lock (a burst's proofs took ~15 ms each instead of ~1.5 over
        # rtnetlink: docs/performance.md); rtnetlink only when the host's sysfs does not show it.
        index = sysfs.host_ifindex(wire)
        if index is None:
            link = self._host_link(wire)
            index = link.index if link is not None else None
        return f"peer:{index}" if index is not None else None

    def of(self, link: Link, pod: Netns | None) -> str | None:
        if not link.link_index:
            return None
        if pod is None:
            # In the host, the wire is in the same namespace: no netnsid.
            proven = link.link_netnsid is None
        else:
            proven = link.link_netnsid is not None and link.link_netnsid == pod.host_nsid()
        return f"peer:{link.link_index}" if proven else None

    def home_in_sysfs(self, pci: str, name: str) -> Link | None:
        # The host's sysfs shows the link, so it is in the host; a veth's iflink is its peer. That
        # the peer is in the host too, which rtnetlink's netnsid says, sysfs cannot: the wire never
        # leaves it, and only the host, never a pod, can put a link with that peer there.
        files = sysfs.host_netdev(name)
        if files is None or files.iflink in (0, files.ifindex):
            return None
        if self.expected(pci) != f"peer:{files.iflink}":
            return None
        return _link(name, files, link_index=files.iflink)


class HostLinks(Protocol):
    def __call__(self, name: str) -> Link | None: ...


def _link(name: str, files: sysfs.NetdevFiles, **kw: Any) -> Link:
    up = bool(files.flags & 1)  # IFF_UP
    return Link(index=files.ifindex, name=name, mac=files.address, mtu=files.mtu, up=up, **kw)


# (this thread's network namespace, the real sysfs's device) pairs proven one view: the check is a
# dump, once per process and pair; a pair that failed is tried again by the next verb.
_VIEWS_PROVEN: set[tuple[int, int]] = set()
_VIEW_ATTEMPTS = 3


def sysfs_shows(host: Rtnl) -> bool:
    """Does the real sysfs show the network namespace ``host`` speaks to, the one the verb runs in?

    sysfs lists the links of the namespace it was mounted in, which a plugin run outside the host's
    (or an agent without the host's network) would not be. Proven by one rtnetlink dump: every link
    the dump has and sysfs shows under its name has its ifindex and MAC there, and sysfs shows at
    least half of them (links come and go meanwhile), at least one besides ``lo``; tried
    :data:`_VIEW_ATTEMPTS` times. Until proven, ADD proves VFs over rtnetlink as before.
    """
    try:
        key = (os.stat("/proc/thread-self/ns/net").st_ino, os.stat(sysfs.HOST_NET_CLASS).st_dev)
    except OSError:
        return False
    if key in _VIEWS_PROVEN:
        return True
    for _ in range(_VIEW_ATTEMPTS):
        if _one_view(host.links()):
            _VIEWS_PROVEN.add(key)
            return True
    log.warning(
        "the links %s shows are not those of this network namespace: VFs are proven over rtnetlink "
        "(slower under the node lock)",
        sysfs.HOST_NET_CLASS,
    )
    return False


def _one_view(links: Iterable[Link]) -> bool:
    dumped = shown = 0
    for link in links:
        if link.name == "lo":
            continue
        dumped += 1
        files = sysfs.host_netdev(link.name)
        if files is None:
            continue  # gone or renamed since the dump
        if files.ifindex != link.index:
            return False
        if len(link.mac) == 17 and files.address.lower() != link.mac.lower():
            return False
        shown += 1
    return shown > 0 and 2 * shown >= dumped


def identity_for(host_link: HostLinks) -> Identity:
    """The identity in force: parent devices, unless the simulation seam is on."""
    if os.environ.get(FAKE_ENV):
        return VethPeer(host_link)
    return ParentDevice()


class VfFinder:
    """Finds VF netdevs in the host and in one pod by identity.

    Few kernel round trips, and none a pod can multiply. In the pod, a VF
    is asked for by the ifindex it got there (recorded by ADD; a pod can
    rename a link but not change its index without moving it away), then
    under its pod-side name: one small request each, and the link the
    kernel answers with is the VF only if its identity says so. Only when
    both miss (records without the index, a VF the pod moved away) are the
    pod's links walked, once per finder, within a bound
    (:mod:`rdma_cni.kernel.linkscan`): a VF beyond it is not found, which
    every caller treats as "not proven here". In the host a VF is first
    looked up under the name sysfs gives, and the host's links are dumped
    only when that fails (a renamed VF, a look-alike under its name, a VF
    that came back from a deleted namespace).
    """

    def __init__(self, host: Rtnl, pod: Netns | None = None, bound: linkscan.Bound | None = None) -> None:
        self.host = host
        self.pod = pod
        self.bound = bound or linkscan.Bound()
        self._host_links: list[Link] | None = None
        self._by_name: dict[str, Link | None] = {}
        self._by_identity: dict[str, dict[str, list[Link]]] = {}
        self._home: dict[str, Link | None] = {}
        self._in_pod: dict[str, Link | None] = {}
        self._sysfs = False
        self.identity = identity_for(self._host_link)

    def trust_sysfs(self) -> bool:
        """Let :meth:`in_host` prove a VF by sysfs first, if sysfs shows this namespace (:func:`sysfs_shows`).

        ADD calls it before the node lock: under the lock a proof over rtnetlink waits for the
        RTNL lock, which every other pod's namespace move holds.
        """
        self._sysfs = sysfs_shows(self.host)
        return self._sysfs

    def _host_link(self, name: str) -> Link | None:
        if self._host_links is not None:
            return next((link for link in self._host_links if link.name == name), None)
        if name not in self._by_name:
            self._by_name[name] = self.host.get_link(name=name)
        return self._by_name[name]

    def _index(self, where: str) -> dict[str, list[Link]]:
        if where not in self._by_identity:
            if where == "pod":
                assert self.pod is not None
                view = self.pod
                links = self._walk_pod(view)
            else:
                if self._host_links is None:
                    self._host_links = self.host.links()
                links, view = self._host_links, None
            table: dict[str, list[Link]] = {}
            for link in links:
                ident = self.identity.of(link, view)
                if ident is not None:
                    table.setdefault(ident, []).append(link)
            self._by_identity[where] = table
        return self._by_identity[where]

    def _walk_pod(self, pod: Netns) -> list[Link]:
        """The pod's links with a VF identity, from a walk within :attr:`bound`."""

        def has_vf_identity(link: Link) -> bool:
            return self.identity.of(link, pod) is not None

        walked = linkscan.walk(pod.fd, has_vf_identity, self.bound)
        if not walked.complete:
            log.warning(
                "the links of %s were walked only in part (%s, %d examined): a VF beyond them is not "
                "found here (it returns to the host when the namespace is deleted)",
                pod.path,
                walked.stopped,
                walked.examined,
            )
        return walked.kept

    def _match(self, where: str, pci: str) -> Link | None:
        want = self.identity.expected(pci)
        if want is None:
            return None
        found = self._index(where).get(want, [])
        if len(found) > 1:
            log.error(
                "%d links in the %s claim to be VF %s (%s); trusting none of them",
                len(found),
                where,
                pci,
                ", ".join(link.name for link in found),
            )
            return None
        return found[0] if found else None

    def in_host(self, pci: str, name: str | None = None) -> Link | None:
        """VF ``pci``'s netdev if it is proven to be in the host; ``name``: where it probably is.

        By sysfs alone when :meth:`trust_sysfs` allowed it and ``name`` is right, else over rtnetlink.
        """
        if pci not in self._home:
            if self._sysfs and name:
                link = self.identity.home_in_sysfs(pci, name)
                if link is not None:
                    self._home[pci] = link
                    return link
            link = self._host_link(name) if name else None
            if link is None or self.identity.of(link, None) != self.identity.expected(pci):
                link = self._match("host", pci)
            self._home[pci] = link
        return self._home[pci]

    def asked_in_pod(self, pci: str, index: int, name: str) -> Link | None:
        """The pod's link at ``index``, else under ``name``, if the kernel shows it is VF ``pci``.

        Two small requests at most, never a walk, nothing cached.
        """
        if self.pod is None:
            return None
        want = self.identity.expected(pci)
        if want is None:
            return None
        if index:
            link = self.pod.rtnl.get_link(index=index)
            if link is not None and self.identity.of(link, self.pod) == want:
                return link
        if name:
            link = self.pod.rtnl.get_link(name=name)
            if link is not None and self.identity.of(link, self.pod) == want:
                return link
        return None

    def in_pod(self, pci: str, index: int = 0, name: str = "") -> Link | None:
        """VF ``pci``'s netdev if it is proven to be in the pod.

        ``index`` and ``name`` are where ADD left it (its ifindex and name in
        the pod): hints asked first, each proven by identity; the bounded
        walk of the pod's links comes only after both missed.
        """
        if self.pod is None:
            return None
        if pci not in self._in_pod:
            link = self.asked_in_pod(pci, index, name)
            self._in_pod[pci] = link if link is not None else self._match("pod", pci)
        return self._in_pod[pci]

    def find(
        self, pci: str, name: str | None = None, *, pod_index: int = 0, pod_name: str = ""
    ) -> tuple[str, Link] | None:
        """Where VF ``pci``'s netdev is: ("pod"|"host", link), or None when not proven anywhere.

        ``name``: its probable host name; ``pod_index``, ``pod_name``: where
        ADD left it in the pod.
        """
        link = self.in_pod(pci, pod_index, pod_name)
        if link is not None:
            return "pod", link
        link = self.in_host(pci, name)
        return ("host", link) if link is not None else None

    def forget(self) -> None:
        """Drop what was read (after links moved), so later lookups see the kernel anew."""
        self._host_links = None
        self._by_name.clear()
        self._by_identity.clear()
        self._home.clear()
        self._in_pod.clear()

    def unexplained_in_pod(self, pcis: Iterable[str]) -> bool:
        """Does the pod hold a link with a VF identity that is none of ``pcis``?

        Answered from the bounded walk: a VF beyond the bound is not seen.
        """
        if self.pod is None:
            return False
        known = {self.identity.expected(pci) for pci in pcis}
        return any(ident not in known for ident in self._index("pod"))

    def vfs_in_pod(
        self, pcis: Iterable[str], hints: Mapping[str, tuple[int, str]] | None = None
    ) -> dict[str, Link]:
        """Of ``pcis``, the VFs proven to sit in the pod, with their links there.

        ``hints``: PCI address -> (ifindex, name) where ADD left that VF.
        """
        if self.pod is None:
            return {}
        hints = hints or {}
        out = {}
        for pci in pcis:
            link = self.in_pod(pci, *hints.get(pci, (0, "")))
            if link is not None:
                out[pci] = link
        return out

    def check(self, link: Link, pci: str) -> bool:
        """Is ``link`` (dumped in the pod) VF ``pci``'s netdev?"""
        want = self.identity.expected(pci)
        return want is not None and self.identity.of(link, self.pod) == want
