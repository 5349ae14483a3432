"""CHECK: is everything ADD made still there, as ADD made it?

Each pod-side interface must be the VF the record names by kernel identity
(:mod:`rdma_cni.kernel.identity`), not by name or alias, which the pod controls.
Each ADD step checks its own work (:data:`rdma_cni.node.attach.STEPS`).
"""

from __future__ import annotations

from typing import Any

from rdma_cni.cni.config import NetConf
from rdma_cni.cni.errors import CheckFailed, InvalidConfig
from rdma_cni.cni.protocol import CniEnv, Result
from rdma_cni.kernel.identity import VfFinder
from rdma_cni.kernel.netlink import Rtnl
from rdma_cni.kernel.netns import Netns
from rdma_cni.kernel.vfcontrol import vf_control
from rdma_cni.node.attach import Context, check
from rdma_cni.node.isolation import RdmaIsolation
from rdma_cni.node.record import RecordStore, node_lock
from rdma_cni.verbs.common import ipam_for


def run(env: CniEnv, conf: NetConf, doc: dict[str, Any]) -> None:
    """The CHECK verb: raises CheckFailed naming the first thing that is wrong."""
    if conf.prevResult is None:
        raise InvalidConfig("CHECK needs prevResult in the network configuration")
    prev = Result.from_dict(conf.prevResult)
    store = RecordStore(conf.stateDir)
    with node_lock(conf.lockFile, conf.lockTimeoutSeconds):
        att = store.get(env.container_id, env.ifname)
    where = f"{env.container_id}/{env.ifname}"
    if att is None:
        raise CheckFailed(f"no rdma-cni attachment is recorded for {where}")
    if att.state != "ready":
        raise CheckFailed(f"the ADD of {where} did not finish (record state {att.state})")
    pod = Netns(env.netns)
    ipam = ipam_for(conf, doc, env)
    isolation = RdmaIsolation(conf.rdmaIsolation)
    try:
        with Rtnl() as host:
            ctx = Context(
                host=host,
                finder=VfFinder(host, pod),
                vfctl=vf_control(host),
                ipam=ipam,
                rdma=isolation,
                prev=prev,
            )
            for rec in att.vfs:
                check(ctx, rec)
    finally:
        pod.close()
    return None
