"""Giving one VF to a pod, and taking it back, step by step.

ADD order per VF, and why:

1. PF-side settings (rate, VLAN, ...), originals already in the record: the
   step a driver most often refuses (igb rejects min_tx_rate), so it fails
   before anything moved.
2. The RDMA device into the pod's namespace (when isolation moves it): also
   often refused (shared mode, drivers without disassociate support), and
   doing it before the netdev means a pod never sees a netdev without its
   RDMA device.
3. The netdev into the pod: the one proven to be the VF by its kernel
   identity (:mod:`rdma_cni.kernel.identity`), moved, renamed and labelled with the
   alias ``rdma-cni:<pci>`` (for operators only: a pod can rewrite it, so
   nothing trusts it) in one RTM_NEWLINK. The kernel only renames on the way
   in when the current name is taken in the pod, so the pod-side name never
   collides with a host interface and the host name never collides inside
   the pod.
4. MAC, up; IPAM; addresses and routes. An IPAM type that never looks at
   the pod's interface (host-local, static) is started before step 3 and
   waited for after it, so its fork and exec overlap the namespace move,
   which is mostly the kernel waiting; release does the same with IPAM DEL
   and the move home. Every other type keeps CNI's order.

:func:`release` undoes these in reverse and is idempotent: it is DEL, GC and
ADD's rollback all at once. Given ``progress`` (ADD's in-memory account of
which steps ran) it undoes exactly those; without it (a record left by a
crash) it undoes everything that can still be undone, tolerating steps that
never happened. A netdev goes back to the host only when its kernel identity
proves it is the VF, wherever it sits and whatever it is called. An IPAM DEL
that fails does not keep the VF: release reports it apart
(:class:`Released`), and the caller remembers it (:mod:`rdma_cni.node.ipam_pending`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rdma_cni.cni.errors import CniError, KernelError
from rdma_cni.kernel.identity import VfFinder
from rdma_cni.kernel.netlink import Link, Rtnl
from rdma_cni.kernel.netns import Netns, host_netns_fd
from rdma_cni.kernel.nlsock import NetlinkError
from rdma_cni.kernel.vfcontrol import VfControl
from rdma_cni.node.ipam import Ipam, IpamCall
from rdma_cni.node.record import VfRecord

if TYPE_CHECKING:
    from rdma_cni.node.isolation import RdmaIsolation

log = logging.getLogger("rdma_cni.attach")

ALIAS_PREFIX = "rdma-cni:"
STEPS = ("pf", "rdma", "move", "up", "ipam", "addresses")


def alias_for(pci: str) -> str:
    """The marker a VF netdev carries while it belongs to a pod."""
    return ALIAS_PREFIX + pci


def fallback_name(pci: str) -> str:
    """A host name for a VF whose original name was taken meanwhile (<= 15 chars)."""
    import hashlib  # here: rarely needed, and its OpenSSL set-up costs every cold start ~2 ms

    return "rvf" + hashlib.sha1(pci.encode()).hexdigest()[:10]


@dataclass
class Progress:
    """Which steps of ADD ran for each VF (by PCI address)."""

    done: dict[str, set[str]] = field(default_factory=dict)

    def mark(self, pci: str, step: str) -> None:
        self.done.setdefault(pci, set()).add(step)

    def ran(self, pci: str, step: str) -> bool:
        return step in self.done.get(pci, set())


def _nl(what: str, exc: NetlinkError) -> KernelError:
    return KernelError(f"{what}: {exc.strerror}", f"errno {exc.errno}")


# -- ADD steps -------------------------------------------------------------


def apply_pf_settings(vfctl: VfControl, vf: VfRecord) -> None:
    if vf.pf_applied:
        vfctl.apply(vf.pf, vf.vf, vf.pf_applied)


def move_in(host: Rtnl, pod: Netns, vf: VfRecord, link: Link) -> Link:
    """Move the VF netdev ``link`` (proven to be VF ``vf.pci``) into the pod under its pod-side name."""
    if pod.rtnl.get_link(name=vf.pod_name) is not None:
        raise KernelError(f"the pod already has an interface named {vf.pod_name}", f"netns {pod.path}")
    try:
        host.set_link(link.index, netns_fd=pod.fd, name=vf.pod_name, mtu=vf.mtu, alias=alias_for(vf.pci))
    except NetlinkError as exc:
        raise _nl(f"cannot move {link.name} ({vf.pci}) into {pod.path} as {vf.pod_name}", exc) from exc
    moved = pod.rtnl.get_link(name=vf.pod_name)
    if moved is None:
        raise KernelError(f"{vf.pod_name} vanished from {pod.path} right after the move")
    return moved


def move_out(host: Rtnl, finder: VfFinder, vf: VfRecord) -> None:
    """Undo :func:`move_in`: the netdev proven to be VF ``vf.pci``, wherever it is, back home.

    Never by name or alias: a pod can give anything those. A real VF whose
    netns was deleted is back in the host under its pod-side name; identity
    finds it there too.
    """
    spare = fallback_name(vf.pci)
    for fallback in (False, True):
        found = finder.find(vf.pci, vf.host_name)
        if found is None:
            log.warning(
                "VF %s (%s) has no netdev proven to be it in the host%s: nothing to move back",
                vf.pci,
                vf.host_name,
                " or the pod" if finder.pod else "",
            )
            return
        where, link = found
        mac = vf.host_mac if vf.mac and vf.host_mac else None
        mtu = vf.host_mtu if vf.mtu and vf.host_mtu else None
        name = vf.host_name if link.name != vf.host_name or where == "pod" else None
        try:
            _send_home(host, finder, where, link, name=spare if fallback else name, mac=mac, mtu=mtu)
            return
        except NetlinkError as exc:
            if exc.errno != errno.EEXIST or fallback:
                raise _nl(
                    f"cannot return VF {vf.pci} ({link.name}) to the host as {vf.host_name}", exc
                ) from exc
            # The host name is taken. A move with a name is not atomic: the
            # kernel may have moved the link under its pod-side name and then
            # refused the rename, and its old index in the pod may by now be
            # a device the pod made. So the next try finds the VF again, by
            # identity, wherever it is.
            log.warning("host name %s of VF %s is taken; naming it %s", vf.host_name, vf.pci, spare)
            finder.forget()


def _send_home(
    host: Rtnl,
    finder: VfFinder,
    where: str,
    link: Link,
    *,
    name: str | None,
    mac: str | None,
    mtu: int | None,
) -> None:
    """One RTM_NEWLINK that moves ``link`` (found ``where``) home, renamed; alias cleared."""
    pod = finder.pod
    if where == "pod" and pod is not None:
        hostfd = host_netns_fd()
        try:
            pod.rtnl.set_link(link.index, netns_fd=hostfd, name=name, mac=mac, mtu=mtu, alias="")
        finally:
            os.close(hostfd)
        return
    # A move takes the link down itself (the kernel closes a netdev before
    # it changes namespace); a rename in place needs it down.
    with contextlib.suppress(NetlinkError):
        host.set_link(link.index, up=False)
    host.set_link(link.index, name=name, mac=mac, mtu=mtu, alias="")


def bring_up(pod: Netns, link: Link, vf: VfRecord) -> None:
    try:
        pod.rtnl.set_link(link.index, mac=vf.mac or None, up=True)
    except NetlinkError as exc:
        raise _nl(f"cannot configure {vf.pod_name} in {pod.path}", exc) from exc


def apply_addresses(pod: Netns, link: Link, ipam_result: dict[str, Any]) -> None:
    """Addresses and routes of one interface's IPAM result, inside the pod."""
    from rdma_cni.cni.protocol import Result

    res = Result.from_dict(ipam_result)
    try:
        for ip in res.ips:
            pod.rtnl.add_address(link.index, ip.address)
        for route in res.routes:
            if not pod.rtnl.add_route(link.index, route.dst, route.gw, route.priority, route.table):
                # Several interfaces from one IPAM range all get the same default
                # route; the first interface keeps it.
                log.info(
                    "route %s via %s already present in the pod; not adding it for %s",
                    route.dst,
                    route.gw or "link",
                    link.name,
                )
    except NetlinkError as exc:
        raise _nl(f"cannot add addresses or routes to {link.name}", exc) from exc


# -- release (DEL, GC, rollback) ------------------------------------------


@dataclass
class Released:
    """What :func:`release` could not undo.

    ``errors``: kernel-side steps that failed (the VFs concerned may not be
    home: the record must stay). ``ipam_failed``: pod-side names whose IPAM
    DEL failed, with ``ipam_errors`` saying why; these hold no VF.
    """

    errors: list[str] = field(default_factory=list)
    ipam_failed: list[str] = field(default_factory=list)
    ipam_errors: list[str] = field(default_factory=list)


def release(
    vfs: list[VfRecord],
    *,
    host: Rtnl,
    finder: VfFinder,
    vfctl: VfControl,
    ipam: Ipam | None,
    progress: Progress | None,
    rdma: RdmaIsolation | None = None,
) -> Released:
    """Undo ADD for ``vfs``, last VF first; keeps going past failures and reports them."""
    out = Released()

    def attempt(what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except (CniError, OSError) as exc:
            text = exc.msg if isinstance(exc, CniError) else str(exc)
            log.error("%s: %s", what, text)
            out.errors.append(f"{what}: {text}")

    def ran(pci: str, step: str) -> bool:
        return progress is None or progress.ran(pci, step)

    def ipam_failed(name: str, exc: CniError) -> None:
        log.error("IPAM DEL for %s: %s", name, exc.msg)
        out.ipam_failed.append(name)
        out.ipam_errors.append(f"IPAM DEL for {name}: {exc.msg}")

    for vf in reversed(vfs):
        call: IpamCall | None = None
        try:
            if ipam is not None and ran(vf.pci, "ipam"):
                try:
                    if ipam.interface_blind and ran(vf.pci, "move"):
                        call = ipam.start("DEL", vf.pod_name)  # released while the netdev moves home
                    else:
                        ipam.delete(vf.pod_name)
                except CniError as exc:
                    ipam_failed(vf.pod_name, exc)
            if ran(vf.pci, "move"):
                attempt(f"returning VF {vf.pci}", move_out, host, finder, vf)
            if ipam is not None and call is not None:
                try:
                    ipam.finish_delete(call)
                except CniError as exc:
                    ipam_failed(vf.pod_name, exc)
        finally:
            if call is not None:
                call.wait()
        if rdma is not None and vf.rdma_action == "moved" and ran(vf.pci, "rdma"):
            attempt(f"returning RDMA device {vf.rdma_device}", rdma.move_out, vf.rdma_device, finder.pod)
        if vf.pf_applied and ran(vf.pci, "pf"):
            attempt(f"restoring PF {vf.pf} VF {vf.vf} settings", vfctl.apply, vf.pf, vf.vf, vf.pf_original)
    return out
