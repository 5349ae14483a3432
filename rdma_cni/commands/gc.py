"""GC: release every attachment of this network that the runtime no longer knows.

Also, under the node lock: sets corrupt records aside (logged; not a GC
failure, the node keeps serving), retries this network's pending IPAM
releases (:mod:`rdma_cni.node.ipam_pending`), and removes temporary files that a
killed writer left in the state directories. A release whose IPAM DEL fails
still returns the VFs and drops the record; the IPAM release becomes pending
and GC reports it (108).
"""

from __future__ import annotations

import logging
from typing import Any

from rdma_cni.cni.config import NetConf
from rdma_cni.cni.errors import CniError, GarbageCollectionFailed, InvalidConfig
from rdma_cni.cni.protocol import CniEnv
from rdma_cni.commands.common import describe, ipam_for, release_vfs, settle
from rdma_cni.kernel.identity import VfFinder
from rdma_cni.kernel.netlink import Rtnl
from rdma_cni.kernel.netns import Netns
from rdma_cni.kernel.vfcontrol import vf_control
from rdma_cni.node.ipam_pending import PendingStore, retry
from rdma_cni.node.record import RecordStore, node_lock, remove_orphaned_temporaries

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
    pendings = PendingStore(conf.stateDir)
    failures: list[str] = []
    released = 0
    with node_lock(conf.lockFile, conf.lockTimeoutSeconds), Rtnl() as host:
        for directory in (store.dir, pendings.dir):
            try:
                remove_orphaned_temporaries(directory)
            except CniError as exc:
                failures.append(exc.msg)
        pending_errors: list[str] = []
        for item in pendings.all(pending_errors):
            if item.network != conf.name:
                continue
            try:
                retry(pendings, item, doc, env, conf.stateDir)
            except CniError as exc:
                failures.append(exc.msg)
        failures.extend(pending_errors)
        set_aside: list[str] = []
        vfctl = vf_control(host)
        for att in store.all(set_aside, set_aside=True):
            if att.network != conf.name or att.key in valid:
                continue
            log.info("releasing %s", describe(att))
            pod = Netns.open_optional(att.netns)
            outcome = None
            try:
                outcome = release_vfs(
                    att.vfs,
                    host=host,
                    finder=VfFinder(host, pod),
                    vfctl=vfctl,
                    conf=conf,
                    ipam=ipam_for(conf, doc, env, att.container_id, att.netns),
                )
                problem = settle(store, pendings, att, outcome, doc)
            except CniError as exc:
                problem = exc
            finally:
                if pod is not None:
                    pod.close()
            if problem is not None:
                failures.append(f"{att.container_id}/{att.ifname}: {problem.msg}")
            if outcome is not None and not outcome.errors:
                released += 1
        ipam = ipam_for(conf, doc, env)
        if ipam is not None:
            try:
                if not ipam.gc([{"containerID": c, "ifname": i} for c, i in sorted(valid)]):
                    log.info("IPAM plugin %s does not support GC; not forwarded", ipam.type)
            except CniError as exc:
                failures.append(f"IPAM GC: {exc.msg}")
    if set_aside:
        log.error("GC set %d corrupt record(s) aside: %s", len(set_aside), " | ".join(set_aside))
    log.info("GC released %d attachment(s)", released)
    if failures:
        raise GarbageCollectionFailed(f"GC could not release {len(failures)} item(s)", " | ".join(failures))
    return None
