"""This node's state as the extender sees it, computed by the code ADD uses.

For every network the agent is told about (its ``pfs``, ``capacityMbps``,
``rdmaIsolation``, ``stateDir`` and ``lockFile``), the node is read exactly
as ADD reads it: the allocation records, then :func:`rdma_cni.node.inventory.scan`,
under the node lock so the records and the kernel are seen at one instant.
Per PF:

- ``used_vfs`` / ``used_tx_rate``: VFs some readable record holds and the sum of their
  ``min_tx_rate`` (what ADD counts as reserved);
- ``capacity_vfs``: ``used_vfs`` plus the VFs ADD could hand out now under the
  network's ``rdmaIsolation`` (:meth:`rdma_cni.node.inventory.Vf.available`, the
  very method ADD's choice calls; the PF's summary is
  :meth:`rdma_cni.node.inventory.Pf.summary`), so
  ``capacity_vfs - used_vfs`` is exactly ADD's pool. A VF in neither set
  counts in neither: no netdev, a userspace driver, no RDMA device under
  ``required``, or, held by no readable record, not proven home in the host
  (a corrupt record's VF still in a pod).

Several networks on one node share the one annotation. A PF named by several
networks is published once, with the most cautious of their views (smallest
capacity and pool, largest use: :func:`rdma_cni.shared.nodestate.cautious`,
each field as it declares), so the extender never sees room that one of them
lacks. The state (version 2) also lists each network's PFs, so the extender
can judge each of a pod's attachments on its own network's PFs; see
docs/node-state.md.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rdma_cni.cni.config import DEFAULT_LOCK_FILE, DEFAULT_NETWORK_NAME, DEFAULT_STATE_DIR
from rdma_cni.cni.errors import InvalidConfig
from rdma_cni.shared import nodestate

if TYPE_CHECKING:
    from rdma_cni.node.inventory import Node
    from rdma_cni.node.record import Attachment

log = logging.getLogger("rdma_cni.agent")

# Waiting for the node lock longer than this means an ADD or DEL is busy:
# the agent tries again on its next pass rather than queue behind kubelet.
LOCK_TIMEOUT = 5.0


@dataclass(frozen=True)
class NetworkView:
    """The settings of one network that decide what its ADD can hand out."""

    name: str
    pfs: tuple[str, ...] | None = None  # None: every SR-IOV PF
    capacity: Mapping[str, int] = field(default_factory=dict)
    isolation: str = "auto"
    state_dir: str = DEFAULT_STATE_DIR
    lock_file: str = DEFAULT_LOCK_FILE
    # PF name -> the operator's rail label (the config's pfs entries written as objects).
    rails: Mapping[str, str] = field(default_factory=dict)
    # A DRA network: its PFs are published as ResourceSlices (agent/dra), not in the node state.
    dra: bool = False


def default_view() -> NetworkView:
    """The plugin's defaults: every SR-IOV PF, link speed as capacity, ``auto``, under the built-in
    network's name (a valid network name: readers refuse a state naming anything else)."""
    return NetworkView(name=DEFAULT_NETWORK_NAME)


def load_view(path: str) -> NetworkView:
    """A :class:`NetworkView` from a network configuration file.

    Accepts a plugin entry (``.conf``/``.json``), a conflist (the ``rdma-cni``
    entry in it, with the list's ``cniVersion`` and ``name`` as libcni passes
    them), or a NetworkAttachmentDefinition's ``spec.config`` string already
    saved as either. Validated by the plugin's own config model, so a value
    ADD would refuse is refused here too (InvalidConfig naming the file).
    """
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
    except OSError as exc:
        raise InvalidConfig(f"cannot read network config {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise InvalidConfig(f"network config {path} is not JSON: {exc}") from exc
    entry = _plugin_entry(doc, path)
    from rdma_cni.cni.config import load_netconf

    try:
        conf = load_netconf(entry)
    except InvalidConfig as exc:
        raise InvalidConfig(f"network config {path}: {exc.msg}", exc.details) from exc
    return NetworkView(
        name=conf.name,
        pfs=tuple(conf.pfs) if conf.pfs is not None else None,
        capacity=dict(conf.capacityMbps),
        isolation=conf.rdmaIsolation,
        state_dir=conf.stateDir,
        lock_file=conf.lockFile,
        rails=conf.rails,
        dra=conf.dra,
    )


def _plugin_entry(doc: Any, path: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise InvalidConfig(f"network config {path} is not a JSON object")
    if "plugins" not in doc:
        if doc.get("type") != "rdma-cni":
            raise InvalidConfig(f"network config {path}: type is {doc.get('type')!r}, not 'rdma-cni'")
        return doc
    plugins = doc["plugins"]
    entries = (
        [p for p in plugins if isinstance(p, dict) and p.get("type") == "rdma-cni"]
        if isinstance(plugins, list)
        else []
    )
    if len(entries) != 1:
        raise InvalidConfig(
            f"network config {path}: expected exactly one plugin of type 'rdma-cni' in 'plugins', "
            f"found {len(entries)}"
        )
    return {"cniVersion": doc.get("cniVersion"), "name": doc.get("name"), **entries[0]}


def pf_views(node: Node, isolation: str) -> list[nodestate.PfSummary]:
    """Per PF of a scanned node: capacity and use as ADD under ``isolation`` would count them."""
    return [pf.summary(isolation) for pf in node.pfs]


def allocations(
    attachments: Sequence[Attachment], published: Container[str] | None = None
) -> list[nodestate.Allocation]:
    """One entry per pod (by uid) holding VFs, its interfaces in record order.

    Records without a pod (cnitool, manual runs) hold VFs, which the PF
    counts show, but belong to no pod the scheduler knows. With ``published``
    (the node state's PFs), only interfaces on those PFs: a DRA network's
    records share the state directory but their PFs are the slices', not the
    node state's (docs/dra.md#sharing-a-node), and a pod left with none is no
    entry.
    """
    by_pod: dict[tuple[str, str, str], list[nodestate.InterfaceUse]] = {}
    for att in attachments:
        if att.pod is None:
            continue
        vfs = [v for v in att.vfs if published is None or v.pf in published]
        if not vfs:
            continue
        key = (att.pod.namespace, att.pod.name, att.pod.uid)
        uses = by_pod.setdefault(key, [])
        uses.extend(nodestate.InterfaceUse(v.pf, v.min_tx_rate, v.max_tx_rate) for v in vfs)
    return [
        nodestate.Allocation(namespace=ns, name=name, uid=uid, interfaces=tuple(uses))
        for (ns, name, uid), uses in sorted(by_pod.items())
    ]


def snapshot(views: Sequence[NetworkView]) -> nodestate.NodeState:
    """Read the node for every network and return its state (generation 0, ``updated`` empty).

    Raises TryAgainLater when a node lock is busy, IOFailure when the
    records cannot be listed (ADD refuses every pod then, and so must the
    state: see :func:`unusable`), and other CniErrors or OSErrors from the scan.
    """
    from rdma_cni.kernel.identity import VfFinder
    from rdma_cni.kernel.netlink import Rtnl
    from rdma_cni.kernel.vfcontrol import vf_control
    from rdma_cni.node.inventory import scan
    from rdma_cni.node.prepared import holdings
    from rdma_cni.node.record import RecordStore, node_lock

    pfs: dict[str, nodestate.PfSummary] = {}
    # Per network (by name), its PFs as ADD scans them: the extender judges each selected
    # network's interfaces on these (version 2). Dicts keep the order and drop repeats.
    networks: dict[str, dict[str, None]] = {}
    rails: dict[str, dict[str, str]] = {}
    seen: dict[tuple[str, str, str], Attachment] = {}
    with Rtnl() as host:
        vfctl = vf_control(host)
        for view in views:
            store = RecordStore(view.state_dir)
            unreadable: list[str] = []
            # Held only while reading: the API call happens after, lock-free.
            with node_lock(view.lock_file, LOCK_TIMEOUT):
                # As ADD reads the node: a corrupt record holds nothing (ADD sets
                # it aside; the agent, which only reads, leaves it), and a VF no
                # record holds is free only when the kernel shows it home.
                records = store.all(unreadable)
                node = scan(
                    pfs=list(view.pfs) if view.pfs is not None else None,
                    capacity=view.capacity,
                    # DRA preparations hold VFs as ADD counts them (node/prepared).
                    attachments=records + holdings(view.state_dir),
                    vfctl=vfctl,
                    home=VfFinder(host).in_host,
                )
            for problem in unreadable:
                log.warning("node state: %s; its VFs count as free only once back in the host", problem)
            members = networks.setdefault(view.name, {})
            rails.setdefault(view.name, {}).update(view.rails)
            for pv in pf_views(node, view.isolation):
                members[pv.name] = None
                pfs[pv.name] = nodestate.cautious(pfs[pv.name], pv) if pv.name in pfs else pv
            for att in records:
                seen[(os.path.realpath(view.state_dir), att.container_id, att.ifname)] = att
    return nodestate.NodeState(
        version=nodestate.VERSION_2,
        generation=0,
        updated="",
        networks=tuple(
            nodestate.Network(name, tuple(members), tuple(rails[name].get(pf) for pf in members))
            for name, members in networks.items()
        ),
        pfs=tuple(sorted(pfs.values(), key=lambda p: p.name)),
        allocations=tuple(allocations([seen[k] for k in sorted(seen)], published=pfs)),
    )


def unusable() -> nodestate.NodeState:
    """The state of a node whose ADD refuses every pod (records cannot be listed): nothing fits."""
    return nodestate.NodeState(version=nodestate.VERSION, generation=0, updated="", pfs=(), allocations=())
