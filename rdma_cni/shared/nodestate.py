"""The node's RDMA state as published on its Node object (annotation ``rdma-cni.io/node-state``).

A contract between components of different versions: the node agent writes
it, the scheduler extender reads it. Standard library only, no I/O. Readers
are strict about the types and bounds of the keys they know and ignore keys
they do not (a newer writer may add some). The encoding is compact: per PF
totals and per pod rates, never one entry per VF, so a node with 16 PFs of
128 VFs and 256 pods of several interfaces stays far below the API server's
256 KiB annotation limit.

``eligible_vf`` is the rule ADD applies to decide whether a free VF may be
handed out; the agent counts ``capacity_vfs`` with the same function, so the
extender and ADD cannot disagree about how many VFs a PF offers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

from rdma_cni.shared import names, placement
from rdma_cni.shared.quote import quote

__all__ = [
    "ANNOTATION",
    "BANDWIDTH_RESOURCE",
    "VERSION",
    "VERSION_2",
    "VF_RESOURCE",
    "Allocation",
    "InterfaceUse",
    "Network",
    "NodeState",
    "NodeStateError",
    "PfSummary",
    "cautious",
    "decode",
    "eligible_vf",
    "encode",
    "pf_state",
    "pf_states",
    "same_content",
]

ANNOTATION = "rdma-cni.io/node-state"
# The node's RDMA capacity as extended resources, which kube-scheduler's own filters count: in the
# Node's status (agent/capacity) and in the containers of pods that declare their interfaces
# (extender/declared). Bandwidth in Mbit/s of min_tx_rate; one VF per interface.
BANDWIDTH_RESOURCE = "rdma-cni.io/bandwidth"
VF_RESOURCE = "rdma-cni.io/vf"
VERSION = 1
# Version 2: PFs, allocations and the networks (each with its PFs and their rails) as arrays.
VERSION_2 = 2
MAX_NETWORKS = 64

# Bounds a reader enforces: generous for real nodes, tight enough that a
# hostile or corrupt annotation cannot make the extender allocate much.
MAX_TEXT_BYTES = 256 * 1024
MAX_PFS = 256
MAX_VFS_PER_PF = 4096
MAX_ALLOCATIONS = 4096
MAX_INTERFACES_PER_ALLOCATION = 64
MAX_RATE_MBPS = 10_000_000
# Sums of min rates on a PF: every VF at the largest rate.
MAX_USED_RATE = MAX_RATE_MBPS * MAX_VFS_PER_PF
MAX_NAME = 253
# A Kubernetes UID is a UUID (36 characters); an allocation record outside Kubernetes has none.
MAX_UID = 128
MAX_NUMA = 1 << 16
MAX_GENERATION = (1 << 63) - 1

# ADD's userspace-bound drivers: such a VF has no netdev to give a pod.
USERSPACE_DRIVERS = frozenset({"vfio-pci", "uio_pci_generic", "igb_uio"})

ISOLATION_POLICIES = ("auto", "required", "off")

_NO_EXTRA: Mapping[str, tuple[int, int]] = MappingProxyType({})

# What each name in the state must be (docs/node-state.md#names): a reader refuses the whole state
# otherwise, so a corrupt or hostile agent can neither send terminal escapes to an operator's
# `rdma-cni nodes` nor names no real node has into the extender's answers.
_UID = re.compile(rf"[A-Za-z0-9._-]{{0,{MAX_UID}}}")
_STAMP = re.compile(r"[0-9A-Za-z:.+-]{1,64}")


def _empty_or(check: Callable[[str], bool]) -> Callable[[str], bool]:
    # Records made outside Kubernetes (cnitool) name no pod: empty namespace, name and uid.
    return lambda value: not value or check(value)


# rule -> (check, what a value must be); the message says the rule.
_RULES: Mapping[str, tuple[Callable[[str], bool], str]] = MappingProxyType(
    {
        "pf": (names.kernel_ifname, f"an interface name the kernel allows: {names.KERNEL_IFNAME_RULE}"),
        "rail": (names.valid_rail, f"a rail label: {names.RAIL_RULE}"),
        "network": (names.valid_network_name, f"a network name: {names.NETWORK_RULE}"),
        "namespace": (_empty_or(names.dns_label), f"empty or a namespace name: {names.LABEL_RULE}"),
        "pod": (_empty_or(names.dns_subdomain), f"empty or a Pod name: {names.SUBDOMAIN_RULE}"),
        "uid": (
            lambda v: _UID.fullmatch(v) is not None,
            f"a UID: 0-{MAX_UID} letters, digits, '-', '_' or '.'",
        ),
        "updated": (
            lambda v: _STAMP.fullmatch(v) is not None,
            "an RFC 3339 time: 1-64 digits, letters, ':', '.', '+' or '-'",
        ),
    }
)


class NodeStateError(ValueError):
    """The annotation is not a node state this reader understands; the message says why."""


def _either_unknown(a: int | None, b: int | None) -> int | None:
    # An unknown capacity is the cautious one: only interfaces without a min rate fit it.
    return None if a is None or b is None else min(a, b)


def _first(a: Any, b: Any) -> Any:
    return a


def _merged(how: Callable[[Any, Any], Any], **default: Any) -> Any:
    """A :class:`PfSummary` field with ``how`` two networks' views of it merge (see :func:`cautious`);
    ``default=`` gives it one (what a state from an older writer, without the field, decodes to)."""
    return field(metadata={"cautious": how}, **default)


@dataclass(frozen=True)
class PfSummary:
    """One PF: capacity (Mbit/s, None when unknown), reserved rate, eligible and used VFs, NUMA node.

    Built by keyword (every field after ``name`` is keyword-only): a new field
    cannot shift another's value. Each field says how two networks' views of
    the PF merge into the most cautious one (:func:`cautious`).
    """

    name: str = _merged(_first)
    _: KW_ONLY
    capacity_tx_rate: int | None = _merged(_either_unknown)
    used_tx_rate: int = _merged(max)
    capacity_vfs: int = _merged(min)
    used_vfs: int = _merged(max)
    numa_node: int | None = _merged(_first)  # one PF: the same NUMA node whichever network looks

    @property
    def free_vfs(self) -> int:
        """VFs ADD could still hand out (never negative): as placement counts them (:func:`pf_state`)."""
        return pf_state(self).free_vfs

    @property
    def free_tx_rate(self) -> int | None:
        """Bandwidth still reservable (never negative), or None when the capacity is unknown."""
        if self.capacity_tx_rate is None:
            return None
        return max(0, self.capacity_tx_rate - self.used_tx_rate)


def cautious(a: PfSummary, b: PfSummary) -> PfSummary:
    """The most cautious of two networks' views of one PF: each field merged as it declares (smallest
    capacity and pool, largest use), the pool never below what is used.

    A field that declares no merge is refused (TypeError): it would otherwise keep one view's value.
    """
    kind = type(a)
    merged: dict[str, Any] = {}
    for f in fields(kind):
        how = f.metadata.get("cautious")
        if how is None:
            raise TypeError(f"{kind.__name__}.{f.name} does not say how two views of a PF merge (_merged)")
        merged[f.name] = how(getattr(a, f.name), getattr(b, f.name))
    merged["capacity_vfs"] = max(merged["used_vfs"], merged["capacity_vfs"])
    return kind(**merged)


@dataclass(frozen=True)
class InterfaceUse:
    """One interface of a pod: the PF its VF is on and its rates."""

    pf: str
    min_tx_rate: int
    max_tx_rate: int


@dataclass(frozen=True)
class Allocation:
    """A pod holding VFs on the node, from the allocation records."""

    namespace: str
    name: str
    uid: str
    interfaces: tuple[InterfaceUse, ...]


@dataclass(frozen=True)
class Network:
    """One rdma-cni network on the node (version 2): its PFs and each one's rail label (or None)."""

    name: str
    pfs: tuple[str, ...]
    rails: tuple[str | None, ...]


@dataclass(frozen=True)
class NodeState:
    """The whole annotation. ``generation`` counts the writer's changes; ``updated`` is RFC 3339.

    ``networks`` is empty in a version 1 state: the reader then knows only the
    union of the networks' PFs.
    """

    version: int
    generation: int
    updated: str
    pfs: tuple[PfSummary, ...]
    allocations: tuple[Allocation, ...]
    networks: tuple[Network, ...] = ()


def eligible_vf(*, has_netdev: bool, userspace_driver: bool, has_rdma_device: bool, isolation: str) -> bool:
    """Whether a VF nobody holds may be handed to a pod under the ``rdmaIsolation`` policy.

    It needs a host netdev (a VF bound to a userspace driver has none), and
    ``required`` also needs an RDMA device to move into the pod.
    """
    if isolation not in ISOLATION_POLICIES:
        raise ValueError(f"unknown rdmaIsolation policy {isolation!r}")
    if not has_netdev or userspace_driver:
        return False
    return isolation != "required" or has_rdma_device


def _encode_v2(state: NodeState) -> dict[str, Any]:
    # Arrays, not objects: a key per value would be most of the text (256 pods x 8 interfaces
    # is ~160 KB as objects). PFs are referred to by their index in "pfs".
    index = {pf.name: i for i, pf in enumerate(state.pfs)}
    return {
        "version": state.version,
        "generation": state.generation,
        "updated": state.updated,
        # [name, capacity_tx_rate, used_tx_rate, capacity_vfs, used_vfs, numa_node]
        "pfs": [
            [pf.name, pf.capacity_tx_rate, pf.used_tx_rate, pf.capacity_vfs, pf.used_vfs, pf.numa_node]
            for pf in state.pfs
        ],
        # [name, [[pf index, rail or null], ...]]
        "networks": [
            [net.name, [[index[pf], rail] for pf, rail in zip(net.pfs, net.rails, strict=True)]]
            for net in state.networks
        ],
        # [namespace, name, uid, [pf index, min_tx_rate, max_tx_rate, pf index, ...]]
        "allocations": [
            [
                a.namespace,
                a.name,
                a.uid,
                [v for i in a.interfaces for v in (index[i.pf], i.min_tx_rate, i.max_tx_rate)],
            ]
            for a in state.allocations
        ],
    }


def encode(state: NodeState) -> str:
    """The annotation value: compact JSON with sorted keys, so equal states encode equally.

    The form follows ``state.version``: 1 (objects, no networks) or 2 (arrays, with networks).
    """
    if state.version == VERSION_2:
        return json.dumps(_encode_v2(state), sort_keys=True, separators=(",", ":"))
    doc = {
        "version": state.version,
        "generation": state.generation,
        "updated": state.updated,
        "pfs": [
            {
                "name": pf.name,
                "capacity_tx_rate": pf.capacity_tx_rate,
                "used_tx_rate": pf.used_tx_rate,
                "capacity_vfs": pf.capacity_vfs,
                "used_vfs": pf.used_vfs,
                "numa_node": pf.numa_node,
            }
            for pf in state.pfs
        ],
        "allocations": [
            {
                "namespace": a.namespace,
                "name": a.name,
                "uid": a.uid,
                "interfaces": [
                    {"pf": i.pf, "min_tx_rate": i.min_tx_rate, "max_tx_rate": i.max_tx_rate}
                    for i in a.interfaces
                ],
            }
            for a in state.allocations
        ],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def _field(obj: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise NodeStateError(f"{where}: missing {key!r}")
    return obj[key]


def _int(obj: Mapping[str, Any], key: str, where: str, low: int, high: int, *, nullable: bool = False) -> Any:
    value = _field(obj, key, where)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an integer or null" if nullable else "an integer"
        raise NodeStateError(f"{where}.{key}: expected {kind}, got {quote(value)}")
    if not low <= value <= high:
        raise NodeStateError(f"{where}.{key}: {value} is outside {low}..{high}")
    return value


def _name(obj: Mapping[str, Any], key: str, where: str, rule: str) -> str:
    """``obj[key]``, a string that keeps the named rule of :data:`_RULES`; the error quotes it bounded."""
    value = _field(obj, key, where)
    if not isinstance(value, str):
        raise NodeStateError(f"{where}.{key}: expected a string, got {quote(value)}")
    check, what = _RULES[rule]
    if len(value) > MAX_NAME or not check(value):
        raise NodeStateError(f"{where}.{key}: {quote(value)} is not {what}")
    return value


def _obj(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise NodeStateError(f"{where}: expected an object")
    return value


def _list(obj: Mapping[str, Any], key: str, where: str, limit: int) -> list[Any]:
    value = _field(obj, key, where)
    if not isinstance(value, list):
        raise NodeStateError(f"{where}.{key}: expected a list")
    if len(value) > limit:
        raise NodeStateError(f"{where}.{key}: {len(value)} entries, the limit is {limit}")
    return value


def _pf(raw: Any, where: str) -> PfSummary:
    obj = _obj(raw, where)
    pf = PfSummary(
        name=_name(obj, "name", where, "pf"),
        capacity_tx_rate=_int(obj, "capacity_tx_rate", where, 0, MAX_RATE_MBPS, nullable=True),
        used_tx_rate=_int(obj, "used_tx_rate", where, 0, MAX_USED_RATE),
        capacity_vfs=_int(obj, "capacity_vfs", where, 0, MAX_VFS_PER_PF),
        used_vfs=_int(obj, "used_vfs", where, 0, MAX_VFS_PER_PF),
        numa_node=_int(obj, "numa_node", where, -1, MAX_NUMA, nullable=True),
    )
    # Linux reports -1 for "no NUMA node"; placement wants None.
    return replace(pf, numa_node=None) if pf.numa_node == -1 else pf


def _allocation(raw: Any, where: str) -> Allocation:
    obj = _obj(raw, where)
    interfaces = []
    for j, item in enumerate(_list(obj, "interfaces", where, MAX_INTERFACES_PER_ALLOCATION)):
        iwhere = f"{where}.interfaces[{j}]"
        iobj = _obj(item, iwhere)
        interfaces.append(
            InterfaceUse(
                pf=_name(iobj, "pf", iwhere, "pf"),
                min_tx_rate=_int(iobj, "min_tx_rate", iwhere, 0, MAX_RATE_MBPS),
                max_tx_rate=_int(iobj, "max_tx_rate", iwhere, 0, MAX_RATE_MBPS),
            )
        )
    return Allocation(
        # Outside Kubernetes (cnitool) a record names no pod: empty strings.
        namespace=_name(obj, "namespace", where, "namespace"),
        name=_name(obj, "name", where, "pod"),
        uid=_name(obj, "uid", where, "uid"),
        interfaces=tuple(interfaces),
    )


def decode(text: str) -> NodeState:
    """Parse an annotation value; raise :class:`NodeStateError` saying what is wrong.

    Strict about the known keys' types and bounds, lenient about unknown keys.
    A PF listed twice, or an allocation on a PF the state does not list, is
    refused: the extender would otherwise count capacity it cannot see.
    """
    if not isinstance(text, str):
        raise NodeStateError(f"node state must be a string, got {type(text).__name__}")
    if len(text) > MAX_TEXT_BYTES:
        raise NodeStateError(f"node state is {len(text)} characters, the limit is {MAX_TEXT_BYTES}")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise NodeStateError(f"node state is not valid JSON: {exc}") from None
    top = _obj(doc, "node state")
    version = _int(top, "version", "node state", 0, MAX_GENERATION)
    if version == VERSION_2:
        return _decode_v2(top)
    if version != VERSION:
        raise NodeStateError(
            f"node state version {version} is not supported (this reader knows {VERSION} and {VERSION_2})"
        )
    generation, updated, pfs = _common(top, _pf)
    allocations = tuple(
        _allocation(raw, f"allocations[{i}]")
        for i, raw in enumerate(_list(top, "allocations", "node state", MAX_ALLOCATIONS))
    )
    known = {pf.name for pf in pfs}
    for i, alloc in enumerate(allocations):
        for j, use in enumerate(alloc.interfaces):
            if use.pf not in known:
                raise NodeStateError(
                    f"allocations[{i}].interfaces[{j}].pf: {quote(use.pf)} is not a listed PF"
                )
    return NodeState(
        version=version, generation=generation, updated=updated, pfs=pfs, allocations=allocations
    )


def _row(raw: Any, where: str, size: int) -> list[Any]:
    if not isinstance(raw, list) or len(raw) < size:
        raise NodeStateError(f"{where}: expected a list of at least {size} entries")
    return raw


def _pf_v2(raw: Any, where: str) -> PfSummary:
    row = _row(raw, where, 6)
    keys = ("name", "capacity_tx_rate", "used_tx_rate", "capacity_vfs", "used_vfs", "numa_node")
    return _pf(dict(zip(keys, row[:6], strict=True)), where)


def _index(value: Any, where: str, pfs: tuple[PfSummary, ...]) -> str:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(pfs):
        raise NodeStateError(f"{where}: {quote(value)} is not the index of a listed PF")
    return pfs[value].name


def _network_v2(raw: Any, where: str, pfs: tuple[PfSummary, ...]) -> Network:
    row = _row(raw, where, 2)
    name = _name({"name": row[0]}, "name", where, "network")
    members = row[1]
    if not isinstance(members, list) or len(members) > MAX_PFS:
        raise NodeStateError(f"{where}: its PF list must be a list of at most {MAX_PFS} entries")
    names: list[str] = []
    rails: list[str | None] = []
    for j, item in enumerate(members):
        mwhere = f"{where}.pfs[{j}]"
        pair = _row(item, mwhere, 2)
        names.append(_index(pair[0], mwhere, pfs))
        rail = pair[1]
        rails.append(None if rail is None else _name({"rail": rail}, "rail", mwhere, "rail"))
    if len(set(names)) != len(names):
        raise NodeStateError(f"{where}: lists a PF more than once")
    return Network(name, tuple(names), tuple(rails))


def _allocation_v2(raw: Any, where: str, pfs: tuple[PfSummary, ...]) -> Allocation:
    row = _row(raw, where, 4)
    flat = row[3]
    if not isinstance(flat, list) or len(flat) % 3 or len(flat) > 3 * MAX_INTERFACES_PER_ALLOCATION:
        raise NodeStateError(
            f"{where}: interfaces must be a flat list of (PF index, min, max) triples, "
            f"at most {MAX_INTERFACES_PER_ALLOCATION}"
        )
    uses = []
    for k in range(0, len(flat), 3):
        iwhere = f"{where}.interfaces[{k // 3}]"
        pf = _index(flat[k], iwhere, pfs)
        rates = {"min_tx_rate": flat[k + 1], "max_tx_rate": flat[k + 2]}
        uses.append(
            InterfaceUse(
                pf,
                _int(rates, "min_tx_rate", iwhere, 0, MAX_RATE_MBPS),
                _int(rates, "max_tx_rate", iwhere, 0, MAX_RATE_MBPS),
            )
        )
    ids = {"namespace": row[0], "name": row[1], "uid": row[2]}
    return Allocation(
        namespace=_name(ids, "namespace", where, "namespace"),
        name=_name(ids, "name", where, "pod"),
        uid=_name(ids, "uid", where, "uid"),
        interfaces=tuple(uses),
    )


def _common(
    top: Mapping[str, Any], pf: Callable[[Any, str], PfSummary]
) -> tuple[int, str, tuple[PfSummary, ...]]:
    """What every version has: the generation, the updated stamp, and the PFs (each name once)."""
    generation = _int(top, "generation", "node state", 0, MAX_GENERATION)
    updated = _name(top, "updated", "node state", "updated")
    pfs = tuple(pf(raw, f"pfs[{i}]") for i, raw in enumerate(_list(top, "pfs", "node state", MAX_PFS)))
    names = [p.name for p in pfs]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise NodeStateError(f"node state lists PF {quote(dupes[0])} more than once")
    return generation, updated, pfs


def _decode_v2(top: Mapping[str, Any]) -> NodeState:
    generation, updated, pfs = _common(top, _pf_v2)
    networks = tuple(
        _network_v2(raw, f"networks[{i}]", pfs)
        for i, raw in enumerate(_list(top, "networks", "node state", MAX_NETWORKS))
    )
    allocations = tuple(
        _allocation_v2(raw, f"allocations[{i}]", pfs)
        for i, raw in enumerate(_list(top, "allocations", "node state", MAX_ALLOCATIONS))
    )
    return NodeState(VERSION_2, generation, updated, pfs, allocations, networks)


def same_content(a: NodeState, b: NodeState) -> bool:
    """Equal ignoring ``generation`` and ``updated``: a writer publishes only when this is False."""
    return (
        a.version == b.version
        and a.pfs == b.pfs
        and a.allocations == b.allocations
        and a.networks == b.networks
    )


def pf_state(pf: PfSummary, held: tuple[int, int] = (0, 0), *, empty: bool = False) -> placement.PfState:
    """One published PF as :func:`placement.place` sees it: the one conversion, home of every per-PF rule.

    ``held`` is ``(vfs, min_tx_rate sum)`` held beyond the published state
    (reservations not yet published; negative values release, for preemption
    victims). ``empty`` gives the PF as if nothing held any of its VFs (the
    extender's "could this node ever fit" question); ``held`` is then ignored.
    Free VFs and reserved bandwidth are clamped to what placement accepts.
    """
    vfs, rate = (0, 0) if empty else held
    used_vfs, used_rate = (0, 0) if empty else (pf.used_vfs, pf.used_tx_rate)
    return placement.PfState(
        name=pf.name,
        free_vfs=max(0, min(pf.capacity_vfs, pf.capacity_vfs - used_vfs - vfs)),
        capacity_mbps=pf.capacity_tx_rate,
        reserved_mbps=max(0, used_rate + rate),
        numa_node=pf.numa_node,
    )


def pf_states(
    state: NodeState, extra_used: Mapping[str, tuple[int, int]] = _NO_EXTRA, *, empty: bool = False
) -> list[placement.PfState]:
    """The node as :func:`placement.place` sees it, minus (or plus) reservations not yet published.

    ``extra_used`` maps a PF name to ``(vfs, min_tx_rate sum)`` held beyond the
    published state; ``empty``: every PF as if no pod held anything
    (:func:`pf_state` says how each PF is converted).
    """
    return [pf_state(pf, extra_used.get(pf.name, (0, 0)), empty=empty) for pf in state.pfs]
