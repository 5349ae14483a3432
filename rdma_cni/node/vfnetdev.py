"""What the steps do to a VF's netdev: move it into a pod, send it home by identity, bring it up, address it.

The kernel operations :mod:`rdma_cni.node.attach`'s steps are made of, one
RTM_NEWLINK where one will do. Nothing here finds a netdev by name or alias
alone (a pod can give anything those): :func:`move_out` asks
:class:`~rdma_cni.kernel.identity.VfFinder` for the netdev proven to be the VF.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from typing import Any

from rdma_cni.cni.errors import KernelError
from rdma_cni.kernel.identity import VfFinder
from rdma_cni.kernel.netlink import Link, Rtnl
from rdma_cni.kernel.netns import Netns, host_netns_fd
from rdma_cni.kernel.nlsock import NetlinkError
from rdma_cni.node.record import VfRecord

# The logger these operations had in attach.py before the split (log configurations name it).
log = logging.getLogger("rdma_cni.attach")

ALIAS_PREFIX = "rdma-cni:"


def alias_for(pci: str) -> str:
    """The marker a VF netdev carries while it belongs to a pod."""
    return ALIAS_PREFIX + pci


def fallback_name(pci: str) -> str:
    """A host name for a VF whose original name was taken meanwhile (<= 15 chars)."""
    import hashlib  # here: rarely needed, and its OpenSSL set-up costs every cold start ~2 ms

    return "rvf" + hashlib.sha1(pci.encode()).hexdigest()[:10]


def netlink_failure(what: str, exc: NetlinkError) -> KernelError:
    """The KernelError for a refused netlink request: what failed, the kernel's reason and errno."""
    return KernelError(f"{what}: {exc.strerror}", f"errno {exc.errno}")


def move_in(host: Rtnl, finder: VfFinder, vf: VfRecord, link: Link) -> Link:
    """Move the VF netdev ``link`` (proven to be VF ``vf.pci``) into the pod under its pod-side name, up.

    One request: the kernel moves it, then renames it and applies its MTU, alias, MAC and up in
    the pod. Each request takes the RTNL lock, which every other pod's namespace move holds for
    milliseconds, so a burst of pods waits less the fewer there are. A pod that already has the
    name refuses it (EEXIST) after the move, with the VF in the pod under its host name: the
    rollback finds it there by identity, as after any half-done move.

    Returns its link in the pod, proven by identity, and keeps its ifindex
    there in ``vf.pod_index``: where DEL and NRI ask for it, instead of
    walking every link the pod made. The kernel keeps the index across the
    move unless the pod already uses it, so that is asked first, then the
    pod-side name.
    """
    pod = finder.pod
    assert pod is not None
    try:
        host.set_link(
            link.index,
            netns_fd=pod.fd,
            name=vf.pod_name,
            mtu=vf.mtu,
            alias=alias_for(vf.pci),
            mac=vf.mac or None,
            up=True,
        )
    except NetlinkError as exc:
        # Where the rollback asks first if the kernel moved it before it refused the rest (the
        # index is kept across a move unless the pod uses it; identity still decides): no walk
        # of the pod's links, however many it made.
        vf.pod_index = link.index
        if exc.errno == errno.EEXIST:
            raise KernelError(
                f"the pod already has an interface named {vf.pod_name}", f"netns {pod.path}"
            ) from exc
        raise netlink_failure(
            f"cannot move {link.name} ({vf.pci}) into {pod.path} as {vf.pod_name}", exc
        ) from exc
    moved = finder.asked_in_pod(vf.pci, link.index, vf.pod_name)
    if moved is None:
        raise KernelError(f"VF {vf.pci} is not proven to be in {pod.path} right after the move")
    vf.pod_index = moved.index
    return moved


def move_out(host: Rtnl, finder: VfFinder, vf: VfRecord) -> None:
    """Undo :func:`move_in`: the netdev proven to be VF ``vf.pci``, wherever it is, back home.

    Never by name or alias: a pod can give anything those. A real VF whose
    netns was deleted is back in the host under its pod-side name; identity
    finds it there too.
    """
    for fallback in (False, True):
        found = finder.find(vf.pci, vf.host_name, pod_index=vf.pod_index, pod_name=vf.pod_name)
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
            _send_home(
                host, finder, where, link, name=fallback_name(vf.pci) if fallback else name, mac=mac, mtu=mtu
            )
            return
        except NetlinkError as exc:
            if exc.errno != errno.EEXIST or fallback:
                raise netlink_failure(
                    f"cannot return VF {vf.pci} ({link.name}) to the host as {vf.host_name}", exc
                ) from exc
            # The host name is taken. A move with a name is not atomic: the
            # kernel may have moved the link under its pod-side name and then
            # refused the rename, and its old index in the pod may by now be
            # a device the pod made. So the next try finds the VF again, by
            # identity, wherever it is.
            log.warning(
                "host name %s of VF %s is taken; naming it %s", vf.host_name, vf.pci, fallback_name(vf.pci)
            )
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
        raise netlink_failure(f"cannot add addresses or routes to {link.name}", exc) from exc
