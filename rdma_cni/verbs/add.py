"""ADD: read the request, place it, record the intent, then move each VF into the pod.

Flow: the pod's request is fetched before any lock (network I/O must not
hold other pods up). Then, under the attachment's lock
(:func:`rdma_cni.node.record.attachment_lock`), the node lock is held only
while the record and the node are read, the placement is decided and the
intent record is written, before the first kernel change; the kernel steps
and IPAM run after it is let go, the VFs held by that record. Any failure
releases exactly the steps that ran, in reverse, and drops the record (under
the node lock again); if a kernel-side step of that release fails the record
stays, so the runtime's DEL finishes the job and no VF is lost.
An IPAM DEL that fails during the rollback does not keep the VFs: they go
home, the record goes, and the IPAM release is remembered apart
(:mod:`rdma_cni.node.ipam_pending`). The error reported is always ADD's own.

A VF is free only when no record lists it and its netdev is proven, by
kernel identity, to be home in the host (:mod:`rdma_cni.kernel.identity`): a VF
still in the pod of a lost or set-aside record is never handed out again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from rdma_cni.cni.config import NetConf, first_interface_mac
from rdma_cni.cni.errors import CniError, KernelError, NoCapacity, StateError
from rdma_cni.cni.protocol import CniEnv, Interface, Result, Route
from rdma_cni.kernel.identity import VfFinder
from rdma_cni.kernel.netlink import Rtnl, neutral_vf_settings
from rdma_cni.kernel.netns import Netns
from rdma_cni.kernel.vfcontrol import VfControl, describe, vf_control
from rdma_cni.node import attach, boot
from rdma_cni.node.attach import Progress
from rdma_cni.node.inventory import Node, Owner, Vf, owners_by_pci, reowned, scan
from rdma_cni.node.ipam import Ipam
from rdma_cni.node.ipam_pending import PendingStore, retry
from rdma_cni.node.isolation import RdmaIsolation
from rdma_cni.node.podmeta import pod_side_names, resolve_request
from rdma_cni.node.prepared import holdings
from rdma_cni.node.record import (
    Attachment,
    ParsedRecords,
    PodInfo,
    RecordStore,
    VfRecord,
    attachment_lock,
    ipam_release_conf,
    node_lock,
)
from rdma_cni.shared import placement
from rdma_cni.shared.podrequest import InterfaceRequest, PodRequest
from rdma_cni.verbs import dra
from rdma_cni.verbs.common import ipam_for, release_vfs, settle

log = logging.getLogger("rdma_cni.add")

# The placement search budget. The scheduler extender keeps the module's
# default (about 10 ms; it decides for many nodes per pod); here, under the
# node lock, a pod refused although it fits costs more than a moment of
# search, so the budget is 50x larger (under half a second at most).
PLACEMENT_STEPS = 50_000

# Who holds which VF, by each record's exact bytes: a verb worker runs many ADDs, and parsing every
# record of the node under the node lock each time grew with the pods (node/record.ParsedRecords).
HELD: ParsedRecords[tuple[tuple[str, Owner], ...]] = ParsedRecords(
    lambda att: tuple(owners_by_pci([att]).items())
)

# What a pod can reach (VLAN) and do (trust: MAC changes, promiscuous mode).
# A network that leaves them unset gets the kernel's defaults, never what the
# VF kept from an earlier pod: one whose record was lost could not restore
# them (docs/protocol.md). Not spoofchk: its
# default is the driver's (mlx5 starts with it off).
_RESET_WHEN_UNSET = ("vlan", "trust")


def run(env: CniEnv, conf: NetConf, doc: dict[str, Any]) -> dict[str, Any]:
    """The ADD verb.

    Under the attachment's lock throughout, and the node lock only while the VFs are chosen and
    the intent record written (:func:`reserve`): once that record names them no other verb takes
    them, so the namespace moves and IPAM, most of an ADD's time, leave the node to other pods.
    """
    mac = first_interface_mac(conf, env.args)
    if conf.dra:  # the pod's prepared claims, not its annotation (verbs/dra)
        request, source = dra.prepared_request(env, conf)
    else:
        request, source = resolve_request(env, conf)
    names = pod_side_names(env.ifname, list(request.interfaces), source)
    ipam = ipam_for(conf, doc, env)
    pod = Netns(env.netns)
    store = RecordStore(conf.stateDir)
    pendings = PendingStore(conf.stateDir)
    isolation = RdmaIsolation(conf.rdmaIsolation)
    try:
        with (
            attachment_lock(conf.lockFile, env.container_id, env.ifname, conf.lockTimeoutSeconds),
            Rtnl() as host,
        ):
            vfctl = vf_control(host)
            finder = VfFinder(host, pod)
            finder.trust_sysfs()
            netns_id = pod.identity()
            draft = survey(conf, store)
            with node_lock(conf.lockFile, conf.lockTimeoutSeconds):
                att = reserve(
                    env,
                    conf,
                    doc,
                    store,
                    pendings,
                    finder,
                    request,
                    names,
                    mac,
                    source,
                    netns_id,
                    draft,
                )
            progress = Progress()
            try:
                # The intent record (its content and its name) reaches the disk before the kernel
                # or IPAM changes anything, and outside the node lock: other pods need not wait for
                # a disk flush. Until then only a machine crash can lose it, and nothing had acted
                # on it: its VFs are still in the host and no lease was taken. The PF-side settings
                # join it here too: reading a PF's VF table waits for the RTNL lock, and the record
                # already makes its VFs this attachment's, so nobody else changes them meanwhile.
                pf_settings(att, conf, vfctl)
                store.write(att, new_name=False, flush=False)
                store.flush(att.container_id, att.ifname)
                result = perform(att, env, host, finder, vfctl, ipam, isolation, progress)
                result.dns = merged_dns(conf, att)
                att.state = "ready"
                att.result = result.to_dict(att.cni_version)
                # In place, under the attachment's lock: the record already holds the VFs.
                store.write(att, new_name=False)
            except BaseException:
                finder.forget()
                released = release_vfs(
                    att.vfs, host=host, finder=finder, vfctl=vfctl, ipam=ipam, conf=conf, progress=progress
                )
                try:
                    # Removing the record frees the VFs: under the node lock, as every removal.
                    with node_lock(conf.lockFile, conf.lockTimeoutSeconds):
                        problem = settle(store, pendings, att, released, doc)
                except CniError as exc:  # ADD's own error is the one to report; DEL finishes the job
                    problem = exc
                if problem is not None:
                    log.error("rollback of %s/%s: %s", att.container_id, att.ifname, problem.msg)
                raise
            return att.result
    finally:
        pod.close()


def reserve(
    env: CniEnv,
    conf: NetConf,
    doc: dict[str, Any],
    store: RecordStore,
    pendings: PendingStore,
    finder: VfFinder,
    request: PodRequest,
    names: list[str],
    mac: str,
    source: str,
    netns_id: list[int],
    draft: Node | None = None,
) -> Attachment:
    """Choose the VFs and write the intent record (state ``adding``): the part of ADD under the node lock.

    ``netns_id``: the pod namespace's kernel identity, which tells later in this boot that it is
    gone though no DEL came (:mod:`rdma_cni.node.orphans`). ``draft``: the node as
    :func:`survey` read it before the lock, brought up to date here (None: scanned here).

    From the moment the record is on disk its VFs are this attachment's: no ADD counts them
    free, and DEL, GC and a crash's clean-up find them there, before any kernel change.
    """
    if store.get(env.container_id, env.ifname, set_aside=True) is not None:
        raise StateError(
            f"{env.container_id}/{env.ifname} is already attached: DEL it before adding it again"
        )
    # An older IPAM release of this very attachment must finish first,
    # or its late retry would release the lease this ADD is about to get.
    item = pendings.of_network(env.container_id, env.ifname, conf.name)
    if item is not None:
        retry(pendings, item, doc, env, conf.stateDir)
    isolation = RdmaIsolation(conf.rdmaIsolation)
    # The VFs held are not looked at in detail, and no PF's VF table is read here (pf_settings,
    # after the lock). DRA preparations hold their VFs too, attached or not (node/prepared).
    owners = held_vfs(conf, store, set_aside=True)
    interfaces = list(request.interfaces)

    def pick(node: Node) -> list[Vf]:
        if conf.dra:
            return dra.take(node, env, conf, finder, store, len(interfaces))
        return choose_proven(
            node, interfaces, isolation, source, finder, rails=conf.rails, different_pfs=request.different_pfs
        )

    try:
        chosen = pick(reowned(draft, owners) if draft is not None else _scan(conf, owners))
    except NoCapacity:
        if draft is None:
            raise
        # The survey's free VFs are older than the lock (one freed meanwhile may look still taken):
        # only the node as it is now says that nothing fits.
        chosen = pick(_scan(conf, owners))
    att = plan(env, conf, finder, chosen, names, interfaces, isolation, mac)
    # What releases it without this network's configuration: after a reboot (rdma_cni.node.boot).
    att.boot_id = boot.boot_id()
    att.netns_id = netns_id
    if conf.ipam is not None:
        att.ipam_conf, att.cni_path = ipam_release_conf(doc), list(env.path)
    # Its fsyncs (the file's and its directory's) are the caller's, once the node lock is released
    # (run): every other verb reads it from the page cache at once.
    store.write(att, flush=False)
    return att


def held_vfs(conf: NetConf, store: RecordStore, *, set_aside: bool) -> dict[str, Owner]:
    """Who holds which VF (PCI address): the attachment records and the DRA preparations."""
    owners = {pci: owner for pairs in store.derived(HELD, set_aside=set_aside) for pci, owner in pairs}
    owners.update(owners_by_pci(holdings(conf.stateDir)))
    return owners


def survey(conf: NetConf, store: RecordStore) -> Node | None:
    """The node before the node lock, for :func:`reserve` to bring up to date under it.

    Most of what ADD read under the lock was this (the sysfs of every VF and the records), and
    most of it does not change while another pod holds the lock. None when a record cannot be
    read now: the read under the lock decides what becomes of it (set aside) and scans itself.
    """
    try:
        return _scan(conf, held_vfs(conf, store, set_aside=False))
    except CniError as exc:
        log.debug("no survey before the node lock: %s", exc.msg)
        return None


def _scan(conf: NetConf, owners: Mapping[str, Owner]) -> Node:
    return scan(pfs=conf.pfs, capacity=conf.capacityMbps, owners=owners, vfctl=None, held_details=False)


def choose_proven(
    node: Node,
    request: list[InterfaceRequest],
    isolation: RdmaIsolation,
    source: str,
    finder: VfFinder,
    *,
    rails: Mapping[str, str] | None = None,
    different_pfs: bool = False,
) -> list[Vf]:
    """:func:`choose`, keeping only VFs the kernel proves to be home in the host.

    A VF no record lists is free only if its netdev is in the host: one left
    in a pod by a lost or set-aside record is not. Checking just the chosen
    VFs (and choosing again without any that fail) costs a lookup or two per
    interface instead of one per VF of the node.
    """
    while True:
        chosen = choose(node, request, isolation, source, rails=rails, different_pfs=different_pfs)
        unproven = [vf for vf in chosen if finder.in_host(vf.pci, vf.netdev) is None]
        if not unproven:
            return chosen
        for vf in unproven:
            log.warning(
                "VF %s is listed by no record but its netdev is not proven to be in the host (still in a "
                "pod whose record was lost or set aside?): not giving it out",
                vf.pci,
            )
            vf.netdev = None  # no longer free: the next choice cannot pick it


def choose(
    node: Node,
    request: list[InterfaceRequest],
    isolation: RdmaIsolation,
    source: str,
    *,
    rails: Mapping[str, str] | None = None,
    different_pfs: bool = False,
) -> list[Vf]:
    """Place the request and pick concrete VFs (lowest free index on each chosen PF).

    ``rails`` labels the network's PFs (its ``pfs`` entries' ``rail``) for
    requests that name a rail; ``different_pfs`` puts each interface on its own PF.
    """
    rails = rails or {}

    def eligible(vf: Vf) -> bool:
        # The node agent counts capacity_vfs with the same method (rdma_cni.agent.snapshot).
        return vf.available(isolation.mode)

    pools = {pf.name: [v for v in pf.vfs if eligible(v)] for pf in node.pfs}
    states = [
        placement.PfState(
            name=pf.name,
            free_vfs=len(pools[pf.name]),
            capacity_mbps=pf.capacity_mbps,
            reserved_mbps=pf.reserved_mbps,
            numa_node=pf.numa_node,
            rail=rails.get(pf.name),
        )
        for pf in node.pfs
    ]
    asked = ", ".join(f"[min {r.min_tx_rate}, max {r.max_tx_rate}{_where(r)}]" for r in request)
    if not states:
        raise NoCapacity(
            f"{source} asks for {len(request)} interface(s) ({asked} Mbit/s) but this node has no "
            "SR-IOV PF with VFs enabled (check the config's pfs and the PFs' sriov_numvfs)"
        )
    try:
        placed = placement.place(
            [placement.Request(r.min_tx_rate, r.max_tx_rate, r.pf, r.rail) for r in request],
            states,
            max_steps=PLACEMENT_STEPS,
            different_pfs=different_pfs,
        )
    except placement.NoFit as exc:
        excluded = sum(1 for pf in node.pfs for v in pf.vfs if v.available() and not eligible(v))
        note = (
            f"; {excluded} free VF(s) have no RDMA device, which rdmaIsolation required excludes"
            if excluded
            else ""
        )
        raise NoCapacity(
            f"{source} does not fit on this node: {exc}{note}",
            f"asked: {asked}; free: " + placement.free_summary(states),
        ) from exc
    return [pools[pf_name].pop(0) for pf_name in placed.pfs]


def _where(r: InterfaceRequest) -> str:
    if r.pf is not None:
        return f", pf {r.pf}"
    if r.rail is not None:
        return f", rail {r.rail}"
    return ""


def plan(
    env: CniEnv,
    conf: NetConf,
    finder: VfFinder,
    chosen: list[Vf],
    names: list[str],
    requests: list[InterfaceRequest],
    isolation: RdmaIsolation,
    mac: str = "",
) -> Attachment:
    """The intent record: which VFs, their host identity, names and rates.

    ``mac``, when set, is the first interface's MAC (see :func:`first_interface_mac`). The PF-side
    settings are left to :func:`pf_settings`, after the node lock: until then the record says
    none is changed, which is true.
    """
    pod_ref = env.pod
    att = Attachment(
        container_id=env.container_id,
        ifname=env.ifname,
        network=conf.name,
        netns=env.netns,
        cni_version=conf.cniVersion,
        state="adding",
        created_at=time.time(),
        pod=PodInfo(pod_ref.namespace, pod_ref.name, pod_ref.uid) if pod_ref else None,
    )
    for i, (vf, name, req) in enumerate(zip(chosen, names, requests, strict=True)):
        assert vf.netdev is not None  # guaranteed by Vf.available
        pf_name = vf.pf
        link = finder.in_host(vf.pci, vf.netdev)
        if link is None:  # choose_proven() keeps only VFs proven home
            raise KernelError(f"VF {vf.pci} netdev {vf.netdev} is not proven to be in the host namespace")
        device, action = isolation.decide(vf.pci, vf.rdma_devices)
        att.vfs.append(
            VfRecord(
                pf=pf_name,
                vf=vf.index,
                pci=vf.pci,
                host_name=link.name,
                host_mac=link.mac,
                host_mtu=link.mtu,
                pod_name=name,
                min_tx_rate=req.min_tx_rate,
                max_tx_rate=req.max_tx_rate,
                mac=mac if i == 0 else "",
                mtu=conf.mtu,
                rdma_device=device,
                rdma_action="moved" if action == "move" else action,
            )
        )
    return att


def pf_settings(att: Attachment, conf: NetConf, vfctl: VfControl) -> None:
    """Each VF's PF-side settings to apply (rates, the config's, resets, the MAC), with their values now.

    The values now are what DEL and a rollback restore. Read once the record holds the VFs, so no
    other verb changes them in between.
    """
    tables = {pf: vfctl.read(pf) for pf in {rec.pf for rec in att.vfs}}
    # What a setting the driver does not report is taken to be.
    neutral = neutral_vf_settings()
    for rec in att.vfs:
        info = (tables[rec.pf] or {}).get(rec.vf)
        current = info.settings() if info else {}
        applied: dict[str, Any] = {}
        if rec.min_tx_rate or rec.max_tx_rate or any(current.get("rate", [0, 0])):
            applied["rate"] = [rec.min_tx_rate, rec.max_tx_rate]
        applied.update(conf.vf_settings())
        for key in _RESET_WHEN_UNSET:
            if key not in applied and current.get(key, neutral[key]) != neutral[key]:
                applied[key] = neutral[key]
        if rec.mac:  # the first interface's, when the runtime gave one
            applied["mac"] = rec.mac
        rec.pf_applied = applied
        rec.pf_original = {k: current.get(k, neutral[k]) for k in applied}
        if applied:
            log.info("VF %s (%s/%d) -> %s: %s", rec.pci, rec.pf, rec.vf, rec.pod_name, describe(applied))


def perform(
    att: Attachment,
    env: CniEnv,
    host: Rtnl,
    finder: VfFinder,
    vfctl: VfControl,
    ipam: Ipam | None,
    isolation: RdmaIsolation,
    progress: Progress,
) -> Result:
    """Run every ADD step (:data:`rdma_cni.node.attach.STEPS`) for every VF, then assemble the result.

    ``progress`` says which steps ran, for the rollback.
    """
    result = Result()
    ctx = attach.Context(host=host, finder=finder, vfctl=vfctl, ipam=ipam, rdma=isolation)
    for rec in att.vfs:
        link = attach.perform(ctx, rec, progress)
        index = len(result.interfaces)
        result.interfaces.append(
            Interface(
                name=rec.pod_name,
                mac=rec.mac or link.mac,
                sandbox=env.netns,
                mtu=rec.mtu or link.mtu,
                pci_id=rec.pci,
            )
        )
        if rec.ipam is None:
            continue
        sub = Result.from_dict(rec.ipam)
        for ip in sub.ips:
            ip.interface = index
            result.ips.append(ip)
        for route in sub.routes:
            if all((r.dst, r.gw) != (route.dst, route.gw) for r in result.routes):
                result.routes.append(Route(**vars(route)))
    return result


def merged_dns(conf: NetConf, att: Attachment) -> dict[str, Any]:
    """The config's dns, else the first IPAM result's."""
    dns = conf.dns.model_dump(exclude_defaults=True)
    if dns:
        return dns
    for rec in att.vfs:
        if rec.ipam and rec.ipam.get("dns"):
            return dict(rec.ipam["dns"])
    return {}
