"""Which netdev is which VF: decided only by what the kernel reports and a pod cannot change.

A pod with CAP_NET_ADMIN in its namespace can rename its interfaces, rewrite
their aliases and create new ones (a veth named and labelled like its VF), so
names and aliases prove nothing. What it cannot change:

- on real hardware, the netdev's parent device as rtnetlink reports it
  (``IFLA_PARENT_DEV_NAME`` = the VF's PCI address on bus
  ``IFLA_PARENT_DEV_BUS_NAME`` = ``pci``); a stacked device (VLAN, IPoIB
  child) names a lower link in ``IFLA_LINK`` and is refused;
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
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from rdma_cni import sysfs
from rdma_cni.netlink import Link, Rtnl

if TYPE_CHECKING:
    from rdma_cni.netns import Netns

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


class ParentDevice:
    """Real hardware: the netdev's parent PCI device."""

    def expected(self, pci: str) -> str | None:
        return "pci:" + pci

    def of(self, link: Link, pod: Netns | None) -> str | None:
        if link.parent_bus != "pci" or not link.parent_dev:
            return None
        # A VF's own netdev has no lower link; VLAN or IPoIB children of it
        # share its parent device but name it in IFLA_LINK.
        if link.link_index not in (0, link.index):
            return None
        return "pci:" + link.parent_dev


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
        link = self._host_link(wire)
        return f"peer:{link.index}" if link is not None else None

    def of(self, link: Link, pod: Netns | None) -> str | None:
        if not link.link_index:
            return None
        if pod is None:
            # In the host, the wire is in the same namespace: no netnsid.
            proven = link.link_netnsid is None
        else:
            proven = link.link_netnsid is not None and link.link_netnsid == pod.host_nsid()
        return f"peer:{link.link_index}" if proven else None


class HostLinks(Protocol):
    def __call__(self, name: str) -> Link | None: ...


def identity_for(host_link: HostLinks) -> Identity:
    """The identity in force: parent devices, unless the simulation seam is on."""
    if os.environ.get(FAKE_ENV):
        return VethPeer(host_link)
    return ParentDevice()


class VfFinder:
    """Finds VF netdevs in the host and in one pod by identity; one link dump per namespace."""

    def __init__(self, host: Rtnl, pod: Netns | None = None) -> None:
        self.host = host
        self.pod = pod
        self._host_links: list[Link] | None = None
        self._by_identity: dict[str, dict[str, list[Link]]] = {}
        self.identity = identity_for(self._host_link)

    def _host_link(self, name: str) -> Link | None:
        return next((link for link in self.host_dump() if link.name == name), None)

    def host_dump(self) -> list[Link]:
        """The host's links (dumped once)."""
        if self._host_links is None:
            self._host_links = self.host.links()
        return self._host_links

    def _index(self, where: str) -> dict[str, list[Link]]:
        if where not in self._by_identity:
            if where == "pod":
                assert self.pod is not None
                links = self.pod.rtnl.links()
                view = self.pod
            else:
                links, view = self.host_dump(), None
            table: dict[str, list[Link]] = {}
            for link in links:
                ident = self.identity.of(link, view)
                if ident is not None:
                    table.setdefault(ident, []).append(link)
            self._by_identity[where] = table
        return self._by_identity[where]

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

    def in_host(self, pci: str) -> Link | None:
        """VF ``pci``'s netdev if it is proven to be in the host."""
        return self._match("host", pci)

    def in_pod(self, pci: str) -> Link | None:
        """VF ``pci``'s netdev if it is proven to be in the pod."""
        return self._match("pod", pci) if self.pod is not None else None

    def find(self, pci: str) -> tuple[str, Link] | None:
        """Where VF ``pci``'s netdev is: ("pod"|"host", link), or None when not proven anywhere."""
        link = self.in_pod(pci)
        if link is not None:
            return "pod", link
        link = self.in_host(pci)
        return ("host", link) if link is not None else None

    def forget(self) -> None:
        """Drop the dumps (after links moved), so later lookups see the kernel anew."""
        self._host_links = None
        self._by_identity.clear()

    def vfs_in_pod(self, pcis: Iterable[str]) -> dict[str, Link]:
        """Of ``pcis``, the VFs proven to sit in the pod, with their links there."""
        if self.pod is None or not self._index("pod"):
            return {}
        out = {}
        for pci in pcis:
            link = self.in_pod(pci)
            if link is not None:
                out[pci] = link
        return out

    def check(self, link: Link, pci: str) -> bool:
        """Is ``link`` (dumped in the pod) VF ``pci``'s netdev?"""
        want = self.identity.expected(pci)
        return want is not None and self.identity.of(link, self.pod) == want
