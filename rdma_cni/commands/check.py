"""CHECK: is everything ADD made still there, as ADD made it?

Each pod-side interface must be the VF the record names by kernel identity
(:mod:`rdma_cni.kernel.identity`), not by name or alias, which the pod controls.
"""

from __future__ import annotations

from typing import Any

from rdma_cni.cni.config import NetConf
from rdma_cni.cni.errors import CheckFailed, InvalidConfig
from rdma_cni.cni.protocol import CniEnv, Result
from rdma_cni.commands.common import ipam_for
from rdma_cni.kernel.identity import VfFinder
from rdma_cni.kernel.netlink import Rtnl
from rdma_cni.kernel.netns import Netns
from rdma_cni.kernel.vfcontrol import vf_control
from rdma_cni.node.isolation import RdmaIsolation
from rdma_cni.node.record import RecordStore, node_lock


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
    prev_by_name = {i.name: (n, i) for n, i in enumerate(prev.interfaces)}
    try:
        with Rtnl() as host:
            vfctl = vf_control(host)
            finder = VfFinder(host, pod)
            tables: dict[str, Any] = {}
            for rec in att.vfs:
                link = pod.rtnl.get_link(name=rec.pod_name)
                if link is None:
                    raise CheckFailed(f"interface {rec.pod_name} (VF {rec.pci}) is missing from {env.netns}")
                if not finder.check(link, rec.pci):
                    raise CheckFailed(
                        f"interface {rec.pod_name} in {env.netns} is not VF {rec.pci} (the kernel does "
                        "not report it as that VF's netdev, whatever its name or alias say)"
                    )
                if rec.pod_name not in prev_by_name:
                    raise CheckFailed(f"prevResult does not list interface {rec.pod_name}")
                index, itf = prev_by_name[rec.pod_name]
                if itf.mac and itf.mac.lower() != link.mac.lower():
                    raise CheckFailed(f"{rec.pod_name} has MAC {link.mac}, prevResult says {itf.mac}")
                if not link.up:
                    raise CheckFailed(f"{rec.pod_name} is down")
                have = set(pod.rtnl.addresses(link.index))
                for ip in prev.ips:
                    if ip.interface == index and ip.address not in have:
                        raise CheckFailed(
                            f"{rec.pod_name} lacks address {ip.address} (has {sorted(have) or 'none'})"
                        )
                rate = rec.pf_applied.get("rate")
                if rate is not None:
                    if rec.pf not in tables:
                        tables[rec.pf] = vfctl.read(rec.pf)
                    info = (tables[rec.pf] or {}).get(rec.vf)
                    if (
                        info is not None
                        and info.max_tx_rate is not None
                        and [info.min_tx_rate or 0, info.max_tx_rate] != list(rate)
                    ):
                        raise CheckFailed(
                            f"PF {rec.pf} VF {rec.vf} rate is min {info.min_tx_rate} max "
                            f"{info.max_tx_rate} Mbit/s, ADD applied min {rate[0]} max {rate[1]}"
                        )
                if rec.rdma_action == "moved":
                    seen = isolation.where(rec.rdma_device, pod)
                    if seen != "pod":
                        raise CheckFailed(
                            f"RDMA device {rec.rdma_device} of {rec.pod_name} is "
                            f"{'in the host' if seen == 'host' else 'missing'}, not in the pod"
                        )
                if ipam is not None and rec.ipam is not None:
                    ipam.check(rec.pod_name, rec.ipam)
    finally:
        pod.close()
    return None
