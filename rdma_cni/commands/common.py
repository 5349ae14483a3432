"""Pieces the verbs share: opening the host side, and releasing an attachment."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from rdma_cni.attach import Netns, Progress, release
from rdma_cni.config import NetConf
from rdma_cni.ipam import Ipam
from rdma_cni.isolation import RdmaIsolation
from rdma_cni.netlink import Rtnl
from rdma_cni.protocol import CniEnv
from rdma_cni.record import Attachment, VfRecord
from rdma_cni.vfcontrol import VfControl

log = logging.getLogger("rdma_cni.commands")


def ipam_for(
    conf: NetConf, doc: dict[str, Any], env: CniEnv, container_id: str = "", netns: str = ""
) -> Ipam | None:
    """The IPAM delegate, acting for ``container_id`` (GC acts for attachments other than its own)."""
    if conf.ipam is None:
        return None
    if container_id:
        environ = {**env.environ, "CNI_CONTAINERID": container_id, "CNI_NETNS": netns}
        env = dataclasses.replace(env, container_id=container_id, netns=netns, environ=environ)
    return Ipam(doc, env, conf.stateDir, conf.ipamTimeoutSeconds)


def release_vfs(
    vfs: list[VfRecord],
    *,
    netns_path: str,
    host: Rtnl,
    vfctl: VfControl,
    ipam: Ipam | None,
    conf: NetConf,
    progress: Progress | None = None,
) -> list[str]:
    """Give VFs back to the host (see :func:`rdma_cni.attach.release`); returns the errors."""
    pod = Netns.open_optional(netns_path)
    try:
        return release(
            vfs,
            host=host,
            pod=pod,
            vfctl=vfctl,
            ipam=ipam,
            progress=progress,
            rdma=RdmaIsolation(conf.rdmaIsolation),
        )
    finally:
        if pod is not None:
            pod.close()


def release_attachment(att: Attachment, **kwargs: Any) -> list[str]:
    """Release every VF of a recorded attachment."""
    log.info(
        "releasing %s/%s (%s, pod %s): VFs %s",
        att.container_id,
        att.ifname,
        att.state,
        f"{att.pod.namespace}/{att.pod.name}" if att.pod else "-",
        ", ".join(v.pci for v in att.vfs),
    )
    return release_vfs(att.vfs, netns_path=att.netns, **kwargs)
