"""GC: release every attachment of this network that the runtime no longer knows.

Also, under the node lock: sets corrupt records aside (logged; not a GC
failure, the node keeps serving), retries this network's pending IPAM
releases (:mod:`rdma_cni.node.ipam_pending`), and removes temporary files that a
killed writer left in the state directories. A release whose IPAM DEL fails
still returns the VFs and drops the record; the IPAM release becomes pending
and GC reports it (108).

:func:`release_previous_boot` is the same release for the records of an
earlier boot (:mod:`rdma_cni.node.boot`), which no runtime would ever GC:
run by the first verb of a boot, of any network, and by the node agent's CNI
server when it starts (``rdma-cni release-previous-boot``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rdma_cni.cni.config import NetConf
from rdma_cni.cni.errors import CniError, GarbageCollectionFailed, InvalidConfig
from rdma_cni.cni.protocol import CniEnv
from rdma_cni.kernel import sysfs
from rdma_cni.kernel.identity import VfFinder
from rdma_cni.kernel.netlink import Rtnl
from rdma_cni.kernel.netns import Netns
from rdma_cni.kernel.vfcontrol import VfControl, vf_control
from rdma_cni.node import boot
from rdma_cni.node import ipam as ipam_module
from rdma_cni.node.attach import Released, release
from rdma_cni.node.ipam import Ipam
from rdma_cni.node.ipam_pending import PendingStore, retry
from rdma_cni.node.isolation import RdmaIsolation
from rdma_cni.node.record import (
    Attachment,
    RecordStore,
    attachment_lock_if_free,
    node_lock,
    remove_orphaned_temporaries,
)
from rdma_cni.verbs.common import describe, ipam_for, release_vfs, settle

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
            with attachment_lock_if_free(conf.lockFile, att.container_id, att.ifname) as free:
                if not free:
                    # Its ADD or DEL is under way (their lock): an ADD the runtime began after it
                    # listed the valid attachments, or a DEL releasing it already.
                    log.info("%s: its ADD or DEL is under way; not released", describe(att))
                    continue
                problem, outcome = _release_unlisted(att, host, vfctl, store, pendings, conf, doc, env)
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


def _release_unlisted(
    att: Attachment,
    host: Rtnl,
    vfctl: VfControl,
    store: RecordStore,
    pendings: PendingStore,
    conf: NetConf,
    doc: dict[str, Any],
    env: CniEnv,
) -> tuple[CniError | None, Released | None]:
    """Release one attachment the runtime no longer lists: the problem to report, and what was released."""
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
    return problem, outcome


# Records of an earlier boot released by one pass, at most: the first verb after a boot (ADD
# included) waits for this many releases (each a few netlink requests and one IPAM DEL per
# interface, under one IPAM time budget), the rest are left to the next verb.
MAX_RELEASES_PER_PASS = 16


@dataclass
class BootSweep:
    """What one pass over the records of earlier boots did (attachments as ``containerID/ifname``)."""

    released: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # kept: a kernel-side step failed; retried
    kept: list[str] = field(default_factory=list)  # not surely of an earlier boot: kept for DEL or GC
    left: int = 0  # beyond this pass's bound: the next verb goes on

    def to_dict(self) -> dict[str, Any]:
        """For ``rdma-cni release-previous-boot``'s answer."""
        return {"released": self.released, "failed": self.failed, "kept": self.kept, "left": self.left}


@dataclass(frozen=True)
class OwnNetwork:
    """The configuration of the verb that runs the pass: IPAM for its network's records without one."""

    conf: NetConf
    doc: dict[str, Any]
    env: CniEnv


def release_previous_boot(
    state_dir: str,
    lock_file: str,
    lock_timeout: float,
    *,
    own: OwnNetwork | None = None,
    limit: int = MAX_RELEASES_PER_PASS,
    environ: Mapping[str, str] | None = None,
) -> BootSweep | None:
    """Release the records of ``state_dir`` that an earlier boot wrote; None when this boot's were checked.

    Under the node lock, each as GC releases a record whose namespace is gone:
    its VFs found by kernel identity in the host (never through the recorded
    namespace path, which may name something else after a reboot), names,
    MACs, MTUs and PF-side settings restored, IPAM released with the
    configuration the record kept, the record removed. A VF whose PCI device
    no longer exists (VFs not created again yet) has nothing to give back.
    Once no record of an earlier boot is left, the state directory remembers
    this boot and later verbs pay two small reads.
    """
    this_boot = boot.boot_id()
    if boot.checked(state_dir, this_boot):
        return None
    store = RecordStore(state_dir)
    if not os.path.isdir(store.dir):
        return None  # nothing ever recorded; the verb that makes the directory notes this boot
    sweep = BootSweep()
    with node_lock(lock_file, lock_timeout):
        if boot.checked(state_dir, this_boot):
            return None  # another verb did it while this one waited
        now = boot.current(time.time())
        corrupt: list[str] = []
        records = store.all(corrupt, set_aside=True)
        ipam_module.start_verb()  # one IPAM time budget for the pass; the verb gets its own after
        with Rtnl() as host:
            finder = VfFinder(host, None)
            vfctl = vf_control(host)
            for att in records:
                verdict, how = boot.judge(att.boot_id, att.created_at, now)
                key = f"{att.container_id}/{att.ifname}"
                if verdict == "previous" and how == "fallback" and _in_use_elsewhere(att, finder):
                    verdict = "doubt"
                if verdict == "current":
                    continue
                if verdict == "doubt":
                    log.warning(
                        "%s: not surely of an earlier boot (%s); kept: DEL or GC releases it",
                        describe(att),
                        _why_kept(att, now),
                    )
                    sweep.kept.append(key)
                    continue
                if len(sweep.released) + len(sweep.failed) >= limit:
                    sweep.left += 1
                    continue
                with attachment_lock_if_free(lock_file, att.container_id, att.ifname) as free:
                    if not free:
                        # A DEL of it is under way (a runtime's after the reboot): it releases it.
                        log.info("%s: a DEL of it is under way; left to it", describe(att))
                        sweep.left += 1
                        continue
                    log.info("releasing %s: recorded in an earlier boot (%s)", describe(att), how)
                    problem = _release(att, state_dir, store, host, finder, vfctl, own, environ)
                if problem is None:
                    sweep.released.append(key)
                else:
                    log.error(
                        "%s: %s%s", key, problem.msg, f" ({problem.details})" if problem.details else ""
                    )
                    (sweep.failed if problem.code != 104 else sweep.released).append(key)
        if not sweep.failed and not sweep.left:
            boot.mark_checked(state_dir, now)
    if sweep.released or sweep.failed or sweep.left:
        log.info(
            "records of earlier boots in %s: %d released, %d failed, %d left for the next verb",
            state_dir,
            len(sweep.released),
            len(sweep.failed),
            sweep.left,
        )
    return sweep


# Records released by one same-boot pass, at most: each costs a few netlink requests and an IPAM
# DEL under the node lock, which every ADD waits for; the next pass (seconds later) goes on.
MAX_ORPHANS_PER_PASS = 4
# How long a pass waits for the node lock: a verb holding it is served first, the pass comes again.
ORPHAN_LOCK_SECONDS = 1.0


@dataclass
class OrphanSweep:
    """What one same-boot pass did (attachments as ``containerID/ifname``)."""

    released: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # a kernel-side step failed: the record stays
    kept: dict[str, str] = field(default_factory=dict)  # why each other record was not released
    unreadable: int = 0  # records that could not be read: never judged, their VFs stay held
    left: int = 0  # releasable beyond this pass's bound
    busy: bool = False  # the node lock was held by a verb: no record was judged

    def to_dict(self) -> dict[str, Any]:
        """For ``rdma-cni release-orphans``' answer."""
        return {
            "released": self.released,
            "failed": self.failed,
            "kept": self.kept,
            "unreadable": self.unreadable,
            "left": self.left,
            "busy": self.busy,
        }


def release_orphans(
    state_dir: str,
    lock_file: str,
    *,
    lock_timeout: float = ORPHAN_LOCK_SECONDS,
    limit: int = MAX_ORPHANS_PER_PASS,
    environ: Mapping[str, str] | None = None,
) -> OrphanSweep:
    """Release, in this boot, the records of ``state_dir`` whose pod network namespace is gone.

    The decision is :func:`rdma_cni.node.orphans.judge`'s (namespace gone by
    kernel identity, every VF proven home, no verb under way: the node lock is
    held here); the release is the one the boot release makes, a DEL without
    ``CNI_NETNS`` with the record's own IPAM configuration (:func:`_release`):
    VFs home by identity, names, MACs, MTUs and PF-side settings (the rate
    included) restored, IPAM released, the record removed. A node lock held by
    a verb for longer than ``lock_timeout`` makes the pass give way (``busy``).
    """
    from rdma_cni.cni.errors import TryAgainLater
    from rdma_cni.kernel.rdma import RdmaClient
    from rdma_cni.node import orphans

    sweep = OrphanSweep()
    store = RecordStore(state_dir)
    if not os.path.isdir(store.dir):
        return sweep
    seen: list[set[int]] = []

    def live() -> set[int]:
        if not seen:
            seen.append(orphans.live_namespaces())
        return seen[0]

    def rdma_home(device: str) -> bool:
        try:
            with RdmaClient() as client:
                return client.find_by_name(device) is not None
        except OSError:  # no RDMA netlink here: it cannot be seen home
            return False

    try:
        with node_lock(lock_file, lock_timeout):
            unreadable: list[str] = []
            records = store.all(unreadable)
            sweep.unreadable = len(unreadable)
            now = boot.current(time.time())
            ipam_module.start_verb()
            with Rtnl() as host:
                finder = VfFinder(host, None)
                vfctl = vf_control(host)
                for att in records:
                    key = f"{att.container_id}/{att.ifname}"
                    why = orphans.judge(
                        att,
                        vf_home=lambda pci, name: finder.in_host(pci, name) is not None,
                        rdma_home=rdma_home,
                        live=live,
                        now=now,
                    )
                    if why is not None:
                        sweep.kept[key] = why
                        continue
                    if len(sweep.released) + len(sweep.failed) >= limit:
                        sweep.left += 1
                        continue
                    log.info(
                        "releasing %s: its network namespace %s is gone and its VFs are back in the host, "
                        "but no DEL came",
                        describe(att),
                        att.netns,
                    )
                    problem = _release(att, state_dir, store, host, finder, vfctl, None, environ)
                    if problem is None or problem.code == 104:
                        sweep.released.append(key)
                    else:
                        sweep.failed.append(key)
                    if problem is not None:
                        log.error(
                            "%s: %s%s", key, problem.msg, f" ({problem.details})" if problem.details else ""
                        )
    except TryAgainLater:
        sweep.busy = True
    if sweep.unreadable:
        log.warning(
            "%d record(s) in %s cannot be read: not judged, their VFs stay held", sweep.unreadable, state_dir
        )
    return sweep


def _in_use_elsewhere(att: Attachment, finder: VfFinder) -> bool:
    """Whether a VF of ``att`` exists and is not proven home in the host (it may sit in a live pod)."""
    return any(
        os.path.exists(sysfs.pci_dir(vf.pci)) and finder.in_host(vf.pci, vf.host_name) is None
        for vf in att.vfs
    )


def _why_kept(att: Attachment, now: boot.Boot) -> str:
    if not att.boot_id and att.created_at > 0 and now.time is not None and att.created_at < now.time:
        return "created before this boot by the clock, but a VF of it is not home in the host"
    return f"created at {att.created_at:.0f}, boot at {now.time}, no boot id in the record"


def _release(
    att: Attachment,
    state_dir: str,
    store: RecordStore,
    host: Rtnl,
    finder: VfFinder,
    vfctl: VfControl,
    own: OwnNetwork | None,
    environ: Mapping[str, str] | None,
) -> CniError | None:
    """Release one record of an earlier boot; the error to report, if any (104: only IPAM is pending)."""
    present = [vf for vf in att.vfs if os.path.exists(sysfs.pci_dir(vf.pci))]
    absent = [vf for vf in att.vfs if vf not in present]
    for vf in absent:
        log.info("VF %s of %s no longer exists: only its IPAM lease to release", vf.pci, att.container_id)
    doc: dict[str, Any] = dict(att.ipam_conf or {})
    pending_names = [vf.pod_name for vf in att.vfs if vf.ipam is not None]
    ipam: Ipam | None = None
    ipam_problem = ""
    try:
        if att.ipam_conf is not None:
            ipam = Ipam(att.ipam_conf, _ipam_env(att, environ), state_dir)
        elif own is not None and own.conf.name == att.network and own.conf.ipam is not None:
            doc = own.doc
            ipam = ipam_for(own.conf, own.doc, own.env, att.container_id, "")
        elif pending_names:
            ipam_problem = "the record keeps no IPAM configuration (written by an earlier version)"
    except CniError as exc:
        ipam_problem = exc.msg
    try:
        outcome = release(
            present,
            host=host,
            finder=finder,
            vfctl=vfctl,
            ipam=ipam,
            progress=None,
            rdma=RdmaIsolation("auto"),
        )
        for vf in absent if ipam is not None else []:
            try:
                ipam.delete(vf.pod_name)
            except CniError as exc:
                outcome.ipam_failed.append(vf.pod_name)
                outcome.ipam_errors.append(f"IPAM DEL for {vf.pod_name}: {exc.msg}")
        if ipam is None and ipam_problem:
            outcome = Released(
                errors=outcome.errors,
                ipam_failed=[*outcome.ipam_failed, *pending_names],
                ipam_errors=[*outcome.ipam_errors, f"IPAM DEL not run: {ipam_problem}"],
            )
        return settle(store, PendingStore(state_dir), att, outcome, doc)
    except CniError as exc:
        return exc


def _ipam_env(att: Attachment, environ: Mapping[str, str] | None) -> CniEnv:
    """The environment IPAM DEL gets for a record of an earlier boot: its attachment, no namespace."""
    base = {k: v for k, v in (os.environ if environ is None else environ).items() if not k.startswith("CNI_")}
    args = "IgnoreUnknown=true"
    if att.pod is not None and not any(c in f"{att.pod.namespace}{att.pod.name}{att.pod.uid}" for c in ";="):
        args += f";K8S_POD_NAMESPACE={att.pod.namespace};K8S_POD_NAME={att.pod.name}"
        if att.pod.uid:
            args += f";K8S_POD_UID={att.pod.uid}"
    variables = {
        "CNI_COMMAND": "DEL",
        "CNI_CONTAINERID": att.container_id,
        "CNI_NETNS": "",
        "CNI_IFNAME": att.ifname,
        "CNI_PATH": ":".join(att.cni_path),
        "CNI_ARGS": args,
    }
    return CniEnv(
        command="DEL",
        container_id=att.container_id,
        ifname=att.ifname,
        path=tuple(att.cni_path),
        environ={**base, **variables},
    )
