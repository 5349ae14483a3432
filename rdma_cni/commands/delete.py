"""DEL: give back every VF of the attachment, from whatever state the node is in.

Works without the pod's netns (deleted, rebooted), after a crashed ADD (a
record in state ``adding``), and with no record at all (nothing to do). If
some step fails the record stays and DEL reports the error, so the runtime's
retry can finish the job: a VF is never forgotten while still configured.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from rdma_cni.commands.common import ipam_for, release_attachment
from rdma_cni.config import NetConf
from rdma_cni.errors import KernelError
from rdma_cni.netlink import Rtnl
from rdma_cni.nlsock import NotAPodNetns, open_pod_netns
from rdma_cni.protocol import CniEnv
from rdma_cni.record import RecordStore, node_lock
from rdma_cni.vfcontrol import vf_control

log = logging.getLogger("rdma_cni.delete")


def _is_pod_netns(path: str) -> bool:
    try:
        os.close(open_pod_netns(path))
    except (OSError, NotAPodNetns):
        return False
    return True


def run(env: CniEnv, conf: NetConf, doc: dict[str, Any]) -> None:
    """The DEL verb."""
    store = RecordStore(conf.stateDir)
    with node_lock(conf.lockFile, conf.lockTimeoutSeconds):
        att = store.get(env.container_id, env.ifname)
        if att is None:
            log.info("nothing recorded for %s/%s: already deleted", env.container_id, env.ifname)
            return None
        if env.netns and env.netns != att.netns:
            if _is_pod_netns(env.netns):
                log.info("CNI_NETNS %s differs from the recorded %s; using CNI_NETNS", env.netns, att.netns)
                att.netns = env.netns
            else:
                # Trusting it would find no VF there and drop the record of VFs
                # still in the pod: the recorded namespace is the better guess.
                log.warning(
                    "CNI_NETNS %s is not a pod's network namespace; using the recorded %s",
                    env.netns,
                    att.netns,
                )
        with Rtnl() as host:
            errors = release_attachment(
                att, host=host, vfctl=vf_control(host), ipam=ipam_for(conf, doc, env), conf=conf
            )
        if errors:
            raise KernelError(
                f"DEL could not release everything for {env.container_id}/{env.ifname}; the record "
                "is kept so a retry can finish",
                "; ".join(errors),
            )
        store.delete(env.container_id, env.ifname)
    return None
