"""A node's DRA devices and the ResourceSlices that publish them. Standard library only, no I/O.

One device per DRA network and PF (:class:`DraDevice`), shared by every claim
that gets part of it: ``allowMultipleAllocations`` with two consumable
capacities (KEP-5075, ``DRAConsumableCapacity``, beta and on by default since
Kubernetes 1.36):

- ``bandwidth``, in Mbit/s: what the DRA path may promise on the PF, its
  capacity less what pods of the other path hold there (the agent computes it,
  agent/dra/devices). A request consumes its ``min_tx_rate``; the
  ``requestPolicy`` default is 0, so an interface without a guarantee consumes
  none. A PF of unknown capacity publishes no ``bandwidth``: kube-scheduler's
  allocator then gives it only requests that ask for none, as placement does.
- ``vfs``: the VFs the DRA path may hand out there; each allocation consumes
  exactly one (``requestPolicy`` default 1, the only valid value). A PF
  without one is not published (a policy of 1 needs a capacity of 1).

Attributes: the network, PF, rail, link speed and largest cap of ours, and
Kubernetes' standard ``resource.kubernetes.io/pcieRoot`` and ``numaNode``,
which claims match against other drivers' devices (a GPU under the same PCIe
root) with ``matchAttribute``.

Device names are DNS labels derived from (network, PF) with a hash, so any
network and PF name maps to one name, and a network's devices keep their
names from one publication to the next.

The shape is a parameter (:data:`PF_SHAPE`, the only one built). KEP-5941
(shared consumable capacity, ``DRASharedConsumableCapacity``; not in
Kubernetes v1.37) will allow one device per VF, each consuming part of a
per-PF shared counter: a shape function returning a VF's devices and the
slice's ``sharedCounters``, with the allocation results still naming a device
this module maps back to its network and PF (:func:`index`), which is all the
node side reads.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rdma_cni.shared.dra import (
    ATTR_LINK_SPEED,
    ATTR_MAX_TX_RATE,
    ATTR_NETWORK,
    ATTR_PF,
    ATTR_RAIL,
    BANDWIDTH,
    DRIVER,
    NUMA_NODE,
    PCIE_ROOT,
    RESOURCE_API,
    VFS,
)

__all__ = [
    "MAX_DEVICES_PER_SLICE",
    "PF_SHAPE",
    "DraDevice",
    "device_name",
    "index",
    "published_devices",
    "render_device",
    "render_slices",
]

# ResourceSliceMaxDevices in k8s.io/api resource/v1 (64 when a device uses taints, counters or list
# attributes, none of which this shape does).
MAX_DEVICES_PER_SLICE = 128
# generateName leaves room for the 5 random characters the API server appends (names: 253).
_MAX_PREFIX = 200
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")
_HASH = 8


@dataclass(frozen=True)
class DraDevice:
    """One DRA network's share of one PF, as published.

    ``vfs`` and ``bandwidth`` (Mbit/s; None when the PF's capacity is unknown)
    are what the DRA path may promise there. ``max_tx_rate`` is the largest
    cap a VF may get (the PF's capacity as placement counts it; None:
    unknown), ``link_speed`` what sysfs reports.
    """

    network: str
    pf: str
    vfs: int
    bandwidth: int | None
    max_tx_rate: int | None = None
    link_speed: int | None = None
    rail: str | None = None
    pcie_root: str | None = None
    numa_node: int | None = None

    @property
    def name(self) -> str:
        """Its device name (:func:`device_name`)."""
        return device_name(self.network, self.pf)


def device_name(network: str, pf: str) -> str:
    """The DNS label naming (network, PF)'s device: both names made label-safe, then a hash of the pair.

    The hash keeps names unique however the names are made safe or cut, and
    the same from one publication to the next.
    """
    digest = hashlib.sha256(f"{network}/{pf}".encode("utf-8", "surrogatepass")).hexdigest()[:_HASH]
    base = _NOT_LABEL.sub("-", f"{network}-{pf}".lower()).strip("-")
    base = base[: 63 - _HASH - 1].strip("-")
    return f"{base}-{digest}" if base else f"d-{digest}"


def _string(value: str) -> dict[str, str]:
    return {"string": value}


def _int(value: int) -> dict[str, int]:
    return {"int": value}


def render_device(dev: DraDevice) -> dict[str, Any]:
    """The resource.k8s.io/v1 Device publishing ``dev`` (KEP-5075's shape: one device, many claims)."""
    attributes: dict[str, Any] = {ATTR_NETWORK: _string(dev.network), ATTR_PF: _string(dev.pf)}
    if dev.rail is not None:
        attributes[ATTR_RAIL] = _string(dev.rail)
    if dev.link_speed is not None:
        attributes[ATTR_LINK_SPEED] = _int(dev.link_speed)
    if dev.max_tx_rate is not None:
        attributes[ATTR_MAX_TX_RATE] = _int(dev.max_tx_rate)
    if dev.pcie_root is not None:
        attributes[PCIE_ROOT] = _string(dev.pcie_root)
    if dev.numa_node is not None and dev.numa_node >= 0:
        attributes[NUMA_NODE] = _int(dev.numa_node)
    capacity: dict[str, Any] = {
        VFS: {"value": str(dev.vfs), "requestPolicy": {"default": "1", "validValues": ["1"]}},
    }
    if dev.bandwidth is not None:
        capacity[BANDWIDTH] = {"value": str(max(0, dev.bandwidth)), "requestPolicy": {"default": "0"}}
    return {
        "name": dev.name,
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": capacity,
    }


# A shape turns the node's devices into the API's devices, in the order the allocator tries them.
Shape = Callable[[Sequence[DraDevice]], list[dict[str, Any]]]


def _pf_shape(devices: Sequence[DraDevice]) -> list[dict[str, Any]]:
    return [render_device(d) for d in published_devices(devices)]


PF_SHAPE: Shape = _pf_shape


def published_devices(devices: Sequence[DraDevice]) -> list[DraDevice]:
    """The devices a publication holds, in its order: those with a VF, by (network, PF).

    kube-scheduler's allocator takes the first device that fits, in the order
    the slices list them: this order is the order it tries.
    """
    return sorted((d for d in devices if d.vfs > 0), key=lambda d: (d.network, d.pf))


def index(devices: Sequence[DraDevice]) -> dict[str, DraDevice]:
    """Device name -> device; ValueError when two (network, PF) pairs would share a name."""
    out: dict[str, DraDevice] = {}
    for dev in devices:
        other = out.get(dev.name)
        if other is not None and (other.network, other.pf) != (dev.network, dev.pf):
            raise ValueError(
                f"devices ({other.network}, {other.pf}) and ({dev.network}, {dev.pf}) have one name "
                f"{dev.name}"
            )
        out[dev.name] = dev
    return out


def render_slices(
    node: str,
    devices: Sequence[DraDevice],
    generation: int,
    *,
    owner: Mapping[str, str] | None = None,
    shape: Shape = PF_SHAPE,
) -> list[dict[str, Any]]:
    """The ResourceSlices of ``node``'s pool (named after the node) at ``generation``.

    At most :data:`MAX_DEVICES_PER_SLICE` devices each, every slice naming
    the pool's generation and slice count, as the API requires of a pool
    published in several slices; none for a node without devices. ``owner``
    (the Node's ``name`` and ``uid``) makes the Node their owner, so they go
    when it goes.
    """
    index(devices)  # names must be unique
    rendered = shape(devices)
    chunks = [rendered[i : i + MAX_DEVICES_PER_SLICE] for i in range(0, len(rendered), MAX_DEVICES_PER_SLICE)]
    out = []
    for chunk in chunks:
        metadata: dict[str, Any] = {"generateName": f"{node[:_MAX_PREFIX]}-{DRIVER}-"}
        if owner is not None:
            metadata["ownerReferences"] = [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": owner["name"],
                    "uid": owner["uid"],
                    "controller": True,
                }
            ]
        out.append(
            {
                "apiVersion": RESOURCE_API,
                "kind": "ResourceSlice",
                "metadata": metadata,
                "spec": {
                    "driver": DRIVER,
                    "nodeName": node,
                    "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)},
                    "devices": chunk,
                },
            }
        )
    return out
