"""DEL: give back every VF of the attachment, from whatever state the node is in.

Works without the pod's netns (deleted, rebooted), after a crashed ADD (a
record in state ``adding``), and without a usable record: when the record is
missing, corrupt (set aside), lists no VFs or the wrong ones, the VFs of the
configured PFs proven by kernel identity to sit in the pod's namespace, and
held by no other record, are returned too, and IPAM is released for the
pod-side names found (or ``CNI_IFNAME``). If a kernel-side step fails the
record stays and DEL reports it (103), so the runtime's retry can finish the
job. An IPAM DEL that fails does not hold the VFs: they go home, the record
goes, the IPAM release is remembered apart and retried by the next DEL of
this attachment and by GC, and DEL reports 104.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from rdma_cni.cni.config import NetConf
from rdma_cni.cni.errors import CniError
from rdma_cni.cni.protocol import CniEnv
from rdma_cni.kernel.identity import VfFinder
from rdma_cni.kernel.netlink import Rtnl
from rdma_cni.kernel.netns import Netns, NotAPodNetns, open_pod_netns
from rdma_cni.kernel.vfcontrol import vf_control
from rdma_cni.node.attach import Released
from rdma_cni.node.ipam import Ipam
from rdma_cni.node.ipam_pending import PendingStore, retry
from rdma_cni.node.record import Attachment, RecordStore, attachment_lock, node_lock
from rdma_cni.verbs.common import ipam_for, release_vfs, settle, stray_vfs

log = logging.getLogger("rdma_cni.delete")


def _is_pod_netns(path: str) -> bool:
    try:
        os.close(open_pod_netns(path))
    except (OSError, NotAPodNetns):
        return False
    return True


@contextlib.contextmanager
def _optional_netns(path: str) -> Iterator[Netns | None]:
    pod = Netns.open_optional(path)
    if pod is not None and pod.is_host():
        # Every VF at home would look "in the pod": the host is nobody's pod.
        log.warning("CNI_NETNS %s is the host's own network namespace: not looking for VFs in it", path)
        pod.close()
        pod = None
    try:
        yield pod
    finally:
        if pod is not None:
            pod.close()


def run(env: CniEnv, conf: NetConf, doc: dict[str, Any]) -> None:
    """The DEL verb.

    Under the attachment's lock throughout. The node lock is held while the record is read and
    the pod is looked at for VFs no record lists; when the record accounts for every VF (the
    usual DEL) they are sent home after it is let go, still held by the record, and the node
    lock is taken again to remove it. VFs no record lists are returned under the node lock
    throughout: nothing holds them while they move, so no ADD may look at them meanwhile.
    """
    store = RecordStore(conf.stateDir)
    pendings = PendingStore(conf.stateDir)
    with (
        attachment_lock(conf.lockFile, env.container_id, env.ifname, conf.lockTimeoutSeconds),
        contextlib.ExitStack() as stack,
    ):
        with node_lock(conf.lockFile, conf.lockTimeoutSeconds):
            att = store.get(env.container_id, env.ifname, set_aside=True)
            if att is not None and env.netns and env.netns != att.netns:
                if _is_pod_netns(env.netns):
                    log.info(
                        "CNI_NETNS %s differs from the recorded %s; using CNI_NETNS", env.netns, att.netns
                    )
                    att.netns = env.netns
                else:
                    # Trusting it would find no VF there and drop the record of VFs
                    # still in the pod: the recorded namespace is the better guess.
                    log.warning(
                        "CNI_NETNS %s is no pod's network namespace; using the recorded %s",
                        env.netns,
                        att.netns,
                    )
            # A record listing no VFs is no usable account of the attachment.
            unusable = att is not None and not att.vfs
            netns = att.netns if att else env.netns
            ipam = ipam_for(conf, doc, env)
            host = stack.enter_context(Rtnl())
            pod = stack.enter_context(_optional_netns(netns))
            finder = VfFinder(host, pod)
            strays = stray_vfs(finder, conf, store, att)
            if att is None or unusable or strays:
                if att is None and not strays and pod is None:
                    log.info("nothing recorded for %s/%s and no pod namespace", env.container_id, env.ifname)
                vfs = (att.vfs if att else []) + strays
                released = release_vfs(
                    vfs, host=host, finder=finder, vfctl=vf_control(host), ipam=ipam, conf=conf
                )
                if ipam is not None and env.ifname not in {v.pod_name for v in vfs} and (unusable or strays):
                    # Without a usable record, the first interface is the one name known for sure.
                    # (No record and nothing found: an earlier DEL released it all; IPAM is not asked again.)
                    _ipam_del(ipam, env.ifname, released)
                error = _finish(env, conf, doc, store, pendings, att, netns, released)
                if error is not None:
                    raise error
                return None
        # The record lists every VF: they stay held by it while they go home.
        released = release_vfs(
            att.vfs, host=host, finder=finder, vfctl=vf_control(host), ipam=ipam, conf=conf
        )
        with node_lock(conf.lockFile, conf.lockTimeoutSeconds):
            error = _finish(env, conf, doc, store, pendings, att, netns, released)
    if error is not None:
        raise error
    return None


def _finish(
    env: CniEnv,
    conf: NetConf,
    doc: dict[str, Any],
    store: RecordStore,
    pendings: PendingStore,
    att: Attachment | None,
    netns: str,
    released: Released,
) -> CniError | None:
    """Retry a pending IPAM release of the attachment and settle its record (under the node lock)."""
    pending_error: CniError | None = None
    item = pendings.of_network(env.container_id, env.ifname, conf.name)
    if item is not None:
        try:
            retry(pendings, item, doc, env, conf.stateDir)
        except CniError as exc:
            pending_error = exc
    subject = att or Attachment(
        container_id=env.container_id,
        ifname=env.ifname,
        network=conf.name,
        netns=netns,
        cni_version=conf.cniVersion,
    )
    return settle(store, pendings, subject, released, doc) or pending_error


def _ipam_del(ipam: Ipam, name: str, released: Released) -> None:
    try:
        ipam.delete(name)
    except CniError as exc:
        log.error("IPAM DEL for %s: %s", name, exc.msg)
        released.ipam_failed.append(name)
        released.ipam_errors.append(f"IPAM DEL for {name}: {exc.msg}")
