"""Pieces the verbs share: the IPAM delegate, releasing an attachment, and settling its record."""

from __future__ import annotations

import logging
from typing import Any

from rdma_cni.cni.config import NetConf
from rdma_cni.cni.errors import CniError, IpamError, KernelError
from rdma_cni.cni.protocol import CniEnv
from rdma_cni.kernel import sysfs
from rdma_cni.kernel.identity import VfFinder
from rdma_cni.kernel.netlink import Rtnl
from rdma_cni.kernel.vfcontrol import VfControl
from rdma_cni.node.attach import Progress, Released, release
from rdma_cni.node.ipam import Ipam
from rdma_cni.node.ipam_pending import PendingStore, ipam_acting_for, remember
from rdma_cni.node.isolation import RdmaIsolation
from rdma_cni.node.record import Attachment, RecordStore, VfRecord
from rdma_cni.node.vfnetdev import fallback_name

log = logging.getLogger("rdma_cni.commands")


def ipam_for(
    conf: NetConf, doc: dict[str, Any], env: CniEnv, container_id: str = "", netns: str = ""
) -> Ipam | None:
    """The IPAM delegate, acting for ``container_id`` (GC acts for attachments other than its own)."""
    if conf.ipam is None:
        return None
    if container_id:
        return ipam_acting_for(doc, env, conf.stateDir, container_id, netns)
    return Ipam(doc, env, conf.stateDir)


def release_vfs(
    vfs: list[VfRecord],
    *,
    host: Rtnl,
    finder: VfFinder,
    vfctl: VfControl,
    ipam: Ipam | None,
    conf: NetConf,
    progress: Progress | None = None,
) -> Released:
    """Give VFs back to the host (see :func:`rdma_cni.node.attach.release`)."""
    return release(
        vfs,
        host=host,
        finder=finder,
        vfctl=vfctl,
        ipam=ipam,
        progress=progress,
        rdma=RdmaIsolation(conf.rdmaIsolation),
    )


def describe(att: Attachment) -> str:
    """One line naming an attachment, its pod and its VFs, for the log."""
    pod = f"{att.pod.namespace}/{att.pod.name}" if att.pod else "-"
    return (
        f"{att.container_id}/{att.ifname} ({att.state}, pod {pod}): VFs {', '.join(v.pci for v in att.vfs)}"
    )


def configured_vfs(conf: NetConf) -> list[tuple[str, int, str]]:
    """(PF, VF index, PCI address) of every VF of the configured PFs (``pfs``, else every SR-IOV PF)."""
    out = []
    for pf in conf.pfs if conf.pfs is not None else sysfs.net_devices():
        for i in range(sysfs.num_vfs(pf)):
            pci = sysfs.vf_pci(pf, i)
            if pci:
                out.append((pf, i, pci))
    return out


def stray_vfs(finder: VfFinder, conf: NetConf, store: RecordStore, att: Attachment | None) -> list[VfRecord]:
    """VFs proven (by kernel identity) to sit in the pod that ``att`` does not list and no other record holds.

    These are what DEL returns when the record is lost, lists no VFs or the
    wrong ones. Their original host name, MAC, MTU and PF-side settings are
    unknown: the netdev goes home under the name sysfs still shows for it, or
    the stable fallback name, and PF-side settings are left as they are.
    """
    if finder.pod is None:
        return []
    listed = {v.pci for v in att.vfs} if att else set()
    if not finder.unexplained_in_pod(listed):
        return []  # the usual DEL: every VF in the pod is one the record lists
    everything = configured_vfs(conf)
    in_pod = finder.vfs_in_pod(pci for _, _, pci in everything if pci not in listed)
    if not in_pod:
        return []
    own = att.key if att else None
    held = {v.pci: a for a in store.all(set_aside=True) if a.key != own for v in a.vfs}
    isolation = RdmaIsolation(conf.rdmaIsolation)
    out = []
    for pf, index, pci in everything:
        link = in_pod.get(pci)
        if link is None:
            continue
        if pci in held:
            log.info("VF %s in %s belongs to %s; leaving it", pci, finder.pod.path, describe(held[pci]))
            continue
        devices = sysfs.pci_rdma_devices(pci)
        moved = bool(devices) and conf.rdmaIsolation != "off" and isolation.system_mode() == "exclusive"
        names = sysfs.pci_netdevs(pci)
        out.append(
            VfRecord(
                pf=pf,
                vf=index,
                pci=pci,
                host_name=names[0] if names else fallback_name(pci),
                host_mac="",
                host_mtu=0,
                pod_name=link.name,
                rdma_device=devices[0] if moved else "",
                rdma_action="moved" if moved else "",
            )
        )
        log.warning(
            "VF %s sits in %s as %s but no record lists it: returning it (PF-side settings unknown, left as "
            "they are)",
            pci,
            finder.pod.path,
            link.name,
        )
    return out


def settle(
    store: RecordStore,
    pendings: PendingStore,
    att: Attachment,
    released: Released,
    doc: dict[str, Any],
) -> CniError | None:
    """Act on a release's outcome; returns the error to report, if any.

    A kernel-side failure keeps the record (the VFs may not be home; a retry
    finishes). Otherwise the record goes, and the VFs with it; IPAM DELs that
    failed are remembered on their own (code 104), never holding a VF.
    """
    key = f"{att.container_id}/{att.ifname}"
    if released.errors:
        return KernelError(
            f"could not release everything for {key}; the record is kept so a retry can finish",
            "; ".join(released.errors + released.ipam_errors),
        )
    if released.ipam_failed:
        remember(
            pendings,
            container_id=att.container_id,
            ifname=att.ifname,
            network=att.network,
            netns=att.netns,
            interfaces=released.ipam_failed,
            doc=doc,
            error="; ".join(released.ipam_errors),
        )
    store.delete(att.container_id, att.ifname)
    if released.ipam_failed:
        return IpamError(
            f"IPAM could not release {', '.join(released.ipam_failed)} of {key}; its VFs are back in the "
            "host, and DEL of this attachment or GC retries the IPAM release",
            "; ".join(released.ipam_errors),
        )
    return None
