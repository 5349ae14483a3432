"""The node's SR-IOV state: PFs, their VFs, capacities, and who holds what.

Read-only. Topology comes from sysfs (:mod:`rdma_cni.kernel.sysfs`), VF settings from
the PF over netlink (:mod:`rdma_cni.kernel.vfcontrol`), and ownership from the
allocation record, passed in by the caller so the data path and the
``inventory`` subcommand see the same truth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rdma_cni.kernel import sysfs
from rdma_cni.kernel.netlink import Link, VfInfo
from rdma_cni.kernel.vfcontrol import VfControl
from rdma_cni.node.record import Attachment
from rdma_cni.shared import nodestate

# VFs bound to these drivers have no netdev to hand to a pod (one list, shared with the node state).
USERSPACE_DRIVERS = nodestate.USERSPACE_DRIVERS


@dataclass(frozen=True)
class Owner:
    """The attachment holding a VF, from the allocation record."""

    container_id: str
    ifname: str
    pod: str  # "namespace/name", or "" outside Kubernetes
    pod_ifname: str
    state: str
    min_tx_rate: int
    max_tx_rate: int
    rdma_action: str = ""
    rdma_device: str = ""


@dataclass
class Vf:
    pf: str
    index: int
    pci: str
    netdev: str | None
    driver: str
    rdma_devices: list[str]
    settings: VfInfo | None
    owner: Owner | None = None

    def available(self, isolation: str = "auto") -> bool:
        """ADD may hand it out under the ``rdmaIsolation`` policy: nobody holds it and it is eligible.

        The one "free VF" rule, shared by ADD's choice, the node agent's
        ``capacity_vfs`` and the inventory report (which knows no network:
        ``auto``, any VF with a host netdev and a kernel driver).
        """
        return self.owner is None and nodestate.eligible_vf(
            has_netdev=bool(self.netdev),
            userspace_driver=self.driver in USERSPACE_DRIVERS,
            has_rdma_device=bool(self.rdma_devices),
            isolation=isolation,
        )


@dataclass
class Pf:
    name: str
    pci: str
    numa_node: int | None
    capacity_mbps: int | None
    capacity_source: str  # "config", "speed" or "unknown"
    total_vfs: int
    vfs: list[Vf] = field(default_factory=list)

    @property
    def reserved_mbps(self) -> int:
        return sum(v.owner.min_tx_rate for v in self.vfs if v.owner)

    @property
    def free_vfs(self) -> list[Vf]:
        """The VFs any pod could get (:meth:`Vf.available` under ``auto``)."""
        return [v for v in self.vfs if v.available()]

    def summary(self, isolation: str) -> nodestate.PfSummary:
        """This PF as the node state publishes it: capacity and use as ADD under ``isolation`` counts them."""
        used = sum(1 for v in self.vfs if v.owner is not None)
        pool = sum(1 for v in self.vfs if v.available(isolation))
        return nodestate.PfSummary(
            name=self.name,
            capacity_tx_rate=self.capacity_mbps,
            used_tx_rate=self.reserved_mbps,
            capacity_vfs=used + pool,
            used_vfs=used,
            numa_node=self.numa_node,
        )


@dataclass
class Node:
    pfs: list[Pf]
    rdma_netns_mode: str | None = None  # "exclusive", "shared", or None when unknown
    foreign: list[Owner] = field(default_factory=list)  # records whose VF no PF here lists

    def pf(self, name: str) -> Pf | None:
        return next((p for p in self.pfs if p.name == name), None)


def owners_by_pci(attachments: Iterable[Attachment]) -> dict[str, Owner]:
    """Map each held VF's PCI address to its owner."""
    out: dict[str, Owner] = {}
    for att in attachments:
        pod = f"{att.pod.namespace}/{att.pod.name}" if att.pod else ""
        for v in att.vfs:
            out[v.pci] = Owner(
                att.container_id,
                att.ifname,
                pod,
                v.pod_name,
                att.state,
                v.min_tx_rate,
                v.max_tx_rate,
                v.rdma_action,
                v.rdma_device,
            )
    return out


def _software_rdma_by_netdev() -> dict[str, list[str]]:
    """rxe/siw devices are not PCI functions: map them by the netdev they sit on."""
    out: dict[str, list[str]] = {}
    for dev in sysfs.rdma_devices():
        parent = sysfs.rdma_parent_netdev(dev)
        if parent:
            out.setdefault(parent, []).append(dev)
    return out


def scan(
    *,
    pfs: list[str] | None,
    capacity: Mapping[str, int],
    attachments: Iterable[Attachment] = (),
    vfctl: VfControl | None,
    home: Callable[[str], Link | None] | None = None,
    held_details: bool = True,
    owners: Mapping[str, Owner] | None = None,
) -> Node:
    """Read the node. ``pfs`` limits the PFs considered (None: every SR-IOV PF).

    ``held_details=False`` (ADD, under the node lock) leaves out the netdev, driver and RDMA
    devices of VFs a record holds: they are not free whatever those are, and on a node full of
    pods reading them was most of the scan.

    ``home`` (the node agent) gives a VF's netdev when the kernel proves it is
    in the host (:meth:`rdma_cni.kernel.identity.VfFinder.in_host`): a VF no record
    holds then counts as free only if it is home, as ADD's choice of VFs
    judges it (:func:`rdma_cni.verbs.add.choose_proven`, which proves only
    the VFs it picks).

    ``owners``, when given, is who holds which VF (:func:`owners_by_pci` of every record) and
    ``attachments`` is not read: ADD's, derived from records it has seen before without parsing
    them again (:class:`rdma_cni.node.record.ParsedRecords`).
    """
    if owners is None:
        owners = owners_by_pci(attachments)
    software_rdma = _software_rdma_by_netdev()
    names = pfs if pfs is not None else sysfs.net_devices()
    node = Node(pfs=[])
    seen: set[str] = set()
    for name in names:
        numvfs = sysfs.num_vfs(name)
        if numvfs <= 0:
            continue
        if name in capacity:
            cap: int | None = capacity[name]
            source = "config"
        else:
            cap = sysfs.speed_mbps(name)
            source = "speed" if cap is not None else "unknown"
        pf = Pf(
            name=name,
            pci=sysfs.pci_address(sysfs.pf_device_dir(name)),
            numa_node=sysfs.numa_node(name),
            capacity_mbps=cap,
            capacity_source=source,
            total_vfs=sysfs.total_vfs(name),
        )
        table = vfctl.read(name) if vfctl is not None else None
        for i in range(numvfs):
            pci = sysfs.vf_pci(name, i)
            if not pci:
                continue
            owner = owners.get(pci)
            if owner is not None and not held_details:
                pf.vfs.append(Vf(name, i, pci, None, "", [], (table or {}).get(i), owner))
                seen.add(pci)
                continue
            pf.vfs.append(_read_vf(name, i, pci, (table or {}).get(i), owner, software_rdma, home))
            seen.add(pci)
        node.pfs.append(pf)
    node.foreign = [o for pci, o in owners.items() if pci not in seen]
    return node


def _read_vf(
    pf: str,
    index: int,
    pci: str,
    settings: VfInfo | None,
    owner: Owner | None,
    software_rdma: Mapping[str, list[str]],
    home: Callable[[str], Link | None] | None = None,
) -> Vf:
    if home is not None and owner is None:
        link = home(pci)
        netdev = link.name if link is not None else None
    else:
        netdevs = sysfs.pci_netdevs(pci)
        netdev = netdevs[0] if netdevs else None
    rdma = sysfs.pci_rdma_devices(pci) + (software_rdma.get(netdev, []) if netdev else [])
    return Vf(pf, index, pci, netdev, sysfs.pci_driver(pci), rdma, settings, owner)


def reowned(node: Node, owners: Mapping[str, Owner]) -> Node:
    """``node``, scanned with ``held_details=False`` and older owners, brought up to ``owners``.

    ADD scans before it takes the node lock and, under it, only this: a VF taken since gets its
    holder, and one freed since (its details left out then) is read now. The free VFs' details
    may be older than the lock, which is why ADD proves the VFs it picks and, if nothing fits,
    scans again under the lock before it says so.
    """
    software_rdma: dict[str, list[str]] | None = None
    seen: set[str] = set()
    for pf in node.pfs:
        for i, vf in enumerate(pf.vfs):
            owner = owners.get(vf.pci)
            if vf.owner is not None and owner is None:
                if software_rdma is None:
                    software_rdma = _software_rdma_by_netdev()
                pf.vfs[i] = _read_vf(pf.name, vf.index, vf.pci, vf.settings, None, software_rdma)
            else:
                vf.owner = owner
            seen.add(vf.pci)
    node.foreign = [o for pci, o in owners.items() if pci not in seen]
    return node


def report(node: Node) -> dict[str, Any]:
    """The ``rdma-cni inventory`` document.

    A superset of the original system's daemon schema: each PF has ``name``,
    ``used_tx_rate``, ``capacity_tx_rate``, ``used_vfs``, ``capacity_vfs`` and
    ``vfs`` with ``vf``, ``mac``, ``vlan``, ``min_tx_rate``, ``max_tx_rate``,
    ``spoof_check``, ``trust``, ``link_state``, ``allocated``.
    """
    out_pfs = []
    for pf in node.pfs:
        vfs = []
        for v in pf.vfs:
            s = v.settings
            entry: dict[str, Any] = {
                "vf": v.index,
                "mac": s.mac if s else None,
                "vlan": s.vlan if s else None,
                "min_tx_rate": s.min_tx_rate if s else None,
                "max_tx_rate": s.max_tx_rate if s else None,
                "spoof_check": s.spoofchk if s else None,
                "trust": s.trust if s else None,
                "link_state": s.link_state if s else None,
                "allocated": v.owner is not None,
                "pci_address": v.pci,
                "netdev": v.netdev,
                "driver": v.driver,
                "rdma_devices": v.rdma_devices,
                "free": v.available(),
            }
            if v.owner:
                entry["owner"] = {
                    "container_id": v.owner.container_id,
                    "ifname": v.owner.ifname,
                    "pod": v.owner.pod,
                    "pod_ifname": v.owner.pod_ifname,
                    "state": v.owner.state,
                    "reserved_min_tx_rate": v.owner.min_tx_rate,
                    "requested_max_tx_rate": v.owner.max_tx_rate,
                    "rdma": v.owner.rdma_action or "none",
                    "rdma_device": v.owner.rdma_device,
                }
            vfs.append(entry)
        out_pfs.append(
            {
                "name": pf.name,
                "used_tx_rate": pf.reserved_mbps,
                "capacity_tx_rate": pf.capacity_mbps,
                "used_vfs": sum(1 for v in pf.vfs if v.owner),
                "capacity_vfs": len(pf.vfs),
                "free_vfs": len(pf.free_vfs),
                "pci_address": pf.pci,
                "numa_node": pf.numa_node,
                "capacity_source": pf.capacity_source,
                "total_vfs": pf.total_vfs,
                "vfs": vfs,
            }
        )
    doc: dict[str, Any] = {"pfs": out_pfs, "rdma_netns_mode": node.rdma_netns_mode}
    if node.foreign:
        doc["unmatched_allocations"] = [
            {"container_id": o.container_id, "ifname": o.ifname, "pod": o.pod} for o in node.foreign
        ]
    return doc
