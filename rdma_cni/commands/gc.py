"""GC: release every attachment of this network that the runtime no longer knows."""

from __future__ import annotations

import logging
from typing import Any

from rdma_cni.commands.common import ipam_for, release_attachment
from rdma_cni.config import NetConf
from rdma_cni.errors import CniError, GarbageCollectionFailed, InvalidConfig
from rdma_cni.netlink import Rtnl
from rdma_cni.protocol import CniEnv
from rdma_cni.record import RecordStore, node_lock
from rdma_cni.vfcontrol import vf_control

log = logging.getLogger("rdma_cni.gc")


def valid_attachments(doc: dict[str, Any]) -> set[tuple[str, str]]:
    """``cni.dev/valid-attachments`` (or the older ``cni.dev/attachments``) as (containerID, ifname) pairs."""
    key = "cni.dev/valid-attachments" if "cni.dev/valid-attachments" in doc else "cni.dev/attachments"
    raw = doc.get(key, [])
    if not isinstance(raw, list):
        raise InvalidConfig(f"{key} must be a list of {{containerID, ifname}} objects")
    out = set()
    for i, item in enumerate(raw):
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("containerID"), str)
            or not isinstance(item.get("ifname"), str)
        ):
            raise InvalidConfig(f"{key}[{i}] must be an object with string containerID and ifname")
        out.add((item["containerID"], item["ifname"]))
    return out


def run(env: CniEnv, conf: NetConf, doc: dict[str, Any]) -> None:
    """The GC verb: keeps going past individual failures and reports them all."""
    valid = valid_attachments(doc)
    store = RecordStore(conf.stateDir)
    failures: list[str] = []
    released = 0
    with node_lock(conf.lockFile, conf.lockTimeoutSeconds), Rtnl() as host:
        vfctl = vf_control(host)
        for att in store.all(failures):
            if att.network != conf.name or att.key in valid:
                continue
            try:
                errors = release_attachment(
                    att,
                    host=host,
                    vfctl=vfctl,
                    conf=conf,
                    ipam=ipam_for(conf, doc, env, att.container_id, att.netns),
                )
            except CniError as exc:
                errors = [exc.msg]
            if errors:
                failures.append(f"{att.container_id}/{att.ifname}: " + "; ".join(errors))
                continue
            store.delete(att.container_id, att.ifname)
            released += 1
        ipam = ipam_for(conf, doc, env)
        if ipam is not None:
            try:
                if not ipam.gc([{"containerID": c, "ifname": i} for c, i in sorted(valid)]):
                    log.info("IPAM plugin %s does not support GC; not forwarded", ipam.type)
            except CniError as exc:
                failures.append(f"IPAM GC: {exc.msg}")
    log.info("GC released %d attachment(s)", released)
    if failures:
        raise GarbageCollectionFailed(f"GC could not release {len(failures)} item(s)", " | ".join(failures))
    return None
