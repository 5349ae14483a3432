"""What each DRA network may promise on each of its PFs, read as ADD reads the node.

Per DRA network (its ``pfs``, ``capacityMbps``, ``rdmaIsolation``,
``stateDir`` and ``lockFile``), under its node lock: the allocation records
and the DRA preparations (node/prepared), then :func:`rdma_cni.node.inventory.scan`
with VFs no record holds counted free only when proven home. Per PF:

- ``vfs``: the VFs ADD could hand out now (:meth:`~rdma_cni.node.inventory.Vf.available`)
  plus those DRA preparations hold. kube-scheduler counts the claims it
  allocated against this total, so free for it is exactly what nobody holds,
  less the claims allocated and not yet prepared.
- ``bandwidth``: the PF's capacity less the ``min_tx_rate`` of VFs held by
  anything else than a preparation (a cnitool record, a pod of the other
  path attached before the PF became DRA's), for the same reason; None when
  the capacity is unknown.

A PF belongs to one path only (docs/dra.md, "Sharing a node"): the agent
refuses at start a configuration where a DRA network's PF is in any other
network (:func:`check_paths`), so the node state never lists these PFs and
the extender never promises them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from rdma_cni.agent.snapshot import LOCK_TIMEOUT, NetworkView
from rdma_cni.shared.dra.slices import DraDevice

log = logging.getLogger("rdma_cni.agent")

__all__ = ["check_paths", "read_devices"]


def check_paths(views: Sequence[NetworkView]) -> None:
    """ValueError unless every PF of a DRA network is in that network alone.

    A PF in two DRA networks would be two devices, each promising the whole
    PF; a PF in a DRA network and another would be promised by both
    kube-scheduler's allocator and the extender. A network without ``pfs``
    (every PF) beside a DRA network is refused for the same reason.
    """
    dra = [v for v in views if v.dra]
    for view in dra:
        assert view.pfs is not None  # the config model refuses a DRA network without pfs
        for other in views:
            if other is view:
                continue
            if other.pfs is None:
                raise ValueError(
                    f"network {other.name} lists no pfs (every PF) beside DRA network {view.name}: "
                    "with a DRA "
                    "network, every network must list its PFs, and no PF may be in a DRA network and another"
                )
            shared = sorted(set(view.pfs) & set(other.pfs))
            if shared:
                raise ValueError(
                    f"PF {shared[0]} is in DRA network {view.name} and in network {other.name}: a PF "
                    "belongs to "
                    "one path only (docs/dra.md): list it in one of them"
                )


def read_devices(views: Sequence[NetworkView]) -> list[DraDevice]:
    """The DRA devices of ``views`` (DRA networks), one per network and PF with VFs enabled.

    Raises TryAgainLater when a node lock is busy and IOFailure when records
    or preparations cannot be read, as the node-state snapshot does.
    """
    from rdma_cni.kernel import sysfs
    from rdma_cni.kernel.identity import VfFinder
    from rdma_cni.kernel.netlink import Rtnl
    from rdma_cni.kernel.vfcontrol import vf_control
    from rdma_cni.node.inventory import scan
    from rdma_cni.node.prepared import PreparedStore
    from rdma_cni.node.record import RecordStore, node_lock

    out: list[DraDevice] = []
    with Rtnl() as host:
        vfctl = vf_control(host)
        finder = VfFinder(host)
        for view in views:
            store = RecordStore(view.state_dir)
            unreadable: list[str] = []
            with node_lock(view.lock_file, LOCK_TIMEOUT):
                records = store.all(unreadable)
                preparations = PreparedStore(view.state_dir).all()
                node = scan(
                    pfs=list(view.pfs or ()),
                    capacity=view.capacity,
                    attachments=records + [p.holding() for p in preparations],
                    vfctl=vfctl,
                    home=finder.in_host,
                )
            for problem in unreadable:
                log.warning("DRA devices: %s; its VFs count as free only once back in the host", problem)
            prepared = {v.pci for p in preparations for v in p.vfs}
            for pf in node.pfs:
                pool = sum(1 for v in pf.vfs if v.available(view.isolation))
                held = sum(1 for v in pf.vfs if v.pci in prepared)
                others = sum(
                    v.owner.min_tx_rate for v in pf.vfs if v.owner is not None and v.pci not in prepared
                )
                cap = pf.capacity_mbps
                out.append(
                    DraDevice(
                        network=view.name,
                        pf=pf.name,
                        vfs=pool + held,
                        bandwidth=None if cap is None else max(0, cap - others),
                        max_tx_rate=cap,
                        link_speed=sysfs.speed_mbps(pf.name),
                        rail=view.rails.get(pf.name),
                        pcie_root=sysfs.pcie_root(pf.pci) if pf.pci else None,
                        numa_node=pf.numa_node,
                    )
                )
    return out
