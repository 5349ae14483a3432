"""Giving one VF to a pod, and taking it back, step by step.

ADD order per VF, and why:

1. PF-side settings (rate, VLAN, ...), originals already in the record: the
   step a driver most often refuses (igb rejects min_tx_rate), so it fails
   before anything moved.
2. The RDMA device into the pod's namespace (when isolation moves it): also
   often refused (shared mode, drivers without disassociate support), and
   doing it before the netdev means a pod never sees a netdev without its
   RDMA device.
3. The netdev into the pod: first marked with the alias ``rdma-cni:<pci>``
   (which lets DEL find it again in any namespace under any name), then moved
   and renamed in one RTM_NEWLINK. The kernel only renames on the way in when
   the current name is taken in the pod, so the pod-side name never collides
   with a host interface and the host name never collides inside the pod.
4. MAC, up; IPAM; addresses and routes.

:func:`release` undoes these in reverse and is idempotent: it is DEL, GC and
ADD's rollback all at once. Given ``progress`` (ADD's in-memory account of
which steps ran) it undoes exactly those; without it (a record left by a
crash) it undoes everything that can still be undone, tolerating steps that
never happened.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rdma_cni.errors import CniError, InvalidEnvironment, KernelError
from rdma_cni.ipam import Ipam
from rdma_cni.netlink import Link, Rtnl
from rdma_cni.nlsock import NetlinkError, NotAPodNetns, host_netns_fd, open_pod_netns
from rdma_cni.record import VfRecord
from rdma_cni.vfcontrol import VfControl

if TYPE_CHECKING:
    from rdma_cni.isolation import RdmaIsolation

log = logging.getLogger("rdma_cni.attach")

ALIAS_PREFIX = "rdma-cni:"
STEPS = ("pf", "rdma", "move", "up", "ipam", "addresses")


def alias_for(pci: str) -> str:
    """The marker a VF netdev carries while it belongs to a pod."""
    return ALIAS_PREFIX + pci


def fallback_name(pci: str) -> str:
    """A host name for a VF whose original name was taken meanwhile (<= 15 chars)."""
    return "rvf" + hashlib.sha1(pci.encode()).hexdigest()[:10]


@dataclass
class Progress:
    """Which steps of ADD ran for each VF (by PCI address)."""

    done: dict[str, set[str]] = field(default_factory=dict)

    def mark(self, pci: str, step: str) -> None:
        self.done.setdefault(pci, set()).add(step)

    def ran(self, pci: str, step: str) -> bool:
        return step in self.done.get(pci, set())


class Netns:
    """A pod's network namespace, opened once: an fd for moves and an Rtnl inside it."""

    def __init__(self, path: str) -> None:
        """Open ``path``: OSError if it cannot be opened, code 4 if it is no pod's network namespace."""
        self.path = path
        try:
            self.fd = open_pod_netns(path)
        except NotAPodNetns as exc:
            raise InvalidEnvironment(f"CNI_NETNS={path!r} is refused: {exc}") from exc
        try:
            self.rtnl = Rtnl(self.fd)
        except OSError:
            os.close(self.fd)
            raise

    @classmethod
    def open_optional(cls, path: str) -> Netns | None:
        """The namespace, or None when it is gone (deleted netns, reboot)."""
        if not path:
            return None
        try:
            return cls(path)
        except OSError as exc:
            log.info(
                "pod netns %s is not available (%s): treating its interfaces as gone", path, exc.strerror
            )
            return None
        except InvalidEnvironment as exc:
            # An unmounted namespace file may stay behind as an empty file: DEL must still succeed.
            log.warning("%s: treating the pod's interfaces as gone", exc.msg)
            return None

    def close(self) -> None:
        self.rtnl.close()
        os.close(self.fd)


def _nl(what: str, exc: NetlinkError) -> KernelError:
    return KernelError(f"{what}: {exc.strerror}", f"errno {exc.errno}")


# -- ADD steps -------------------------------------------------------------


def apply_pf_settings(vfctl: VfControl, vf: VfRecord) -> None:
    if vf.pf_applied:
        vfctl.apply(vf.pf, vf.vf, vf.pf_applied)


def move_in(host: Rtnl, pod: Netns, vf: VfRecord) -> Link:
    """Move the VF netdev into the pod under its pod-side name; return it as seen there."""
    link = host.get_link(name=vf.host_name)
    if link is None:
        raise KernelError(f"VF {vf.pci} netdev {vf.host_name} is not in the host network namespace")
    if pod.rtnl.get_link(name=vf.pod_name) is not None:
        raise KernelError(f"the pod already has an interface named {vf.pod_name}", f"netns {pod.path}")
    try:
        # The kernel moves a device under its current name when that name is
        # free in the target and renames it afterwards, so a failed rename can
        # leave it moved but unrenamed: the alias goes on first, in the host,
        # so that rollback finds it wherever it ended up.
        host.set_link(link.index, alias=alias_for(vf.pci))
        host.set_link(link.index, netns_fd=pod.fd, name=vf.pod_name, mtu=vf.mtu)
    except NetlinkError as exc:
        raise _nl(f"cannot move {vf.host_name} ({vf.pci}) into {pod.path} as {vf.pod_name}", exc) from exc
    moved = pod.rtnl.get_link(name=vf.pod_name)
    if moved is None:
        raise KernelError(f"{vf.pod_name} vanished from {pod.path} right after the move")
    return moved


def bring_up(pod: Netns, link: Link, vf: VfRecord) -> None:
    try:
        pod.rtnl.set_link(link.index, mac=vf.mac or None, up=True)
    except NetlinkError as exc:
        raise _nl(f"cannot configure {vf.pod_name} in {pod.path}", exc) from exc


def apply_addresses(pod: Netns, link: Link, ipam_result: dict[str, Any]) -> None:
    """Addresses and routes of one interface's IPAM result, inside the pod."""
    from rdma_cni.protocol import Result

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


def find_netdev(host: Rtnl, pod: Netns | None, vf: VfRecord) -> tuple[str, Link] | None:
    """Where the VF's netdev is now: ("host"|"pod", link), or None if it is nowhere to be seen."""
    from rdma_cni import sysfs

    marker = alias_for(vf.pci)
    for name in sysfs.pci_netdevs(vf.pci):
        link = host.get_link(name=name)
        if link is not None and (link.alias in ("", marker)):
            return "host", link
    if pod is not None:
        for link in pod.rtnl.links():
            if link.alias == marker:
                return "pod", link
    # A VF whose netns was deleted comes back to the host still named as in
    # the pod; sysfs finds it on real hardware, the alias finds it anywhere.
    for link in host.links():
        if link.alias == marker:
            return "host", link
    return None


def _restore_netdev(host: Rtnl, pod: Netns | None, vf: VfRecord) -> None:
    found = find_netdev(host, pod, vf)
    if found is None:
        log.warning(
            "VF %s (%s) has no netdev in the host%s: nothing to move back",
            vf.pci,
            vf.host_name,
            " or the pod" if pod else "",
        )
        return
    where, link = found
    rtnl = pod.rtnl if where == "pod" and pod else host
    hostfd = host_netns_fd() if where == "pod" else None
    try:
        with contextlib.suppress(NetlinkError):
            rtnl.set_link(link.index, up=False)
        mac = vf.host_mac if vf.mac and vf.host_mac else None
        mtu = vf.host_mtu if vf.mtu and vf.host_mtu else None
        name = vf.host_name if link.name != vf.host_name or where == "pod" else None
        try:
            rtnl.set_link(link.index, netns_fd=hostfd, name=name, mac=mac, mtu=mtu, alias="")
        except NetlinkError as exc:
            if exc.errno != errno.EEXIST:
                raise
            spare = fallback_name(vf.pci)
            log.warning("host name %s of VF %s is taken; naming it %s", vf.host_name, vf.pci, spare)
            rtnl.set_link(link.index, netns_fd=hostfd, name=spare, mac=mac, mtu=mtu, alias="")
    except NetlinkError as exc:
        raise _nl(f"cannot return VF {vf.pci} ({link.name}) to the host as {vf.host_name}", exc) from exc
    finally:
        if hostfd is not None:
            os.close(hostfd)


def release(
    vfs: list[VfRecord],
    *,
    host: Rtnl,
    pod: Netns | None,
    vfctl: VfControl,
    ipam: Ipam | None,
    progress: Progress | None,
    rdma: RdmaIsolation | None = None,
) -> list[str]:
    """Undo ADD for ``vfs``, last VF first; returns the errors (it keeps going past them)."""
    errors: list[str] = []

    def attempt(what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except (CniError, OSError) as exc:
            text = exc.msg if isinstance(exc, CniError) else str(exc)
            log.error("%s: %s", what, text)
            errors.append(f"{what}: {text}")

    def ran(pci: str, step: str) -> bool:
        return progress is None or progress.ran(pci, step)

    for vf in reversed(vfs):
        if ipam is not None and ran(vf.pci, "ipam"):
            attempt(f"IPAM DEL for {vf.pod_name}", ipam.delete, vf.pod_name)
        if ran(vf.pci, "move"):
            attempt(f"returning VF {vf.pci}", _restore_netdev, host, pod, vf)
        if rdma is not None and vf.rdma_action == "moved" and ran(vf.pci, "rdma"):
            attempt(f"returning RDMA device {vf.rdma_device}", rdma.move_out, vf.rdma_device, pod)
        if vf.pf_applied and ran(vf.pci, "pf"):
            attempt(f"restoring PF {vf.pf} VF {vf.vf} settings", vfctl.apply, vf.pf, vf.vf, vf.pf_original)
    return errors
