"""The RDMA capacity a pod declares as extended resources, held to what its interfaces ask.

kube-scheduler's own filters and preemption count extended resources and
nothing else of RDMA. Where a node's RDMA capacity is advertised as
``rdma-cni.io/bandwidth`` (Mbit/s) and ``rdma-cni.io/vf`` in its status, a pod
that declares its interfaces in those resources is counted by them, so
kube-scheduler's preemption chooses victims by the bandwidth and VFs they hold
(docs/scheduling.md, preemption). What a pod declares is its own text, and
kube-scheduler believes it: a pod declaring less would look smaller than it is,
and one declaring more would have kube-scheduler evict pods for room it will
never use. So a pod that declares either resource must declare both, exactly:
as many VFs as its interfaces, and the sum of their ``min_tx_rate`` (the
bandwidth placement reserves). A pod that declares neither is judged as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rdma_cni.cni.errors import InvalidPodRequest
from rdma_cni.shared.nodestate import BANDWIDTH_RESOURCE, VF_RESOURCE
from rdma_cni.shared.quantity import whole
from rdma_cni.shared.quote import quote

if TYPE_CHECKING:  # demand calls this module: the type only, no import cycle
    from rdma_cni.extender.demand import Demand

__all__ = ["BANDWIDTH", "VFS", "check", "declared"]

BANDWIDTH = BANDWIDTH_RESOURCE
VFS = VF_RESOURCE
_RESOURCES = (BANDWIDTH, VFS)


def _quantity(value: Any, where: str) -> int:
    count = whole(value)
    if count is None:
        raise InvalidPodRequest(f"{where} is {quote(value)}, not a whole number")
    return count


def _resources(container: Any) -> Mapping[str, Any]:
    resources = container.get("resources") if isinstance(container, Mapping) else None
    if not isinstance(resources, Mapping):
        return {}
    # kube-scheduler counts requests; an extended resource given only in limits is requested as much.
    requests = resources.get("requests")
    limits = resources.get("limits")
    out = dict(limits) if isinstance(limits, Mapping) else {}
    if isinstance(requests, Mapping):
        out.update(requests)
    return out


def _listed(spec: Mapping[str, Any], key: str) -> list[Any]:
    value = spec.get(key)
    return value if isinstance(value, list) else []


def declared(pod: Mapping[str, Any], who: str) -> dict[str, int]:
    """The RDMA resources the pod's containers request, summed (empty when it declares none).

    An init container may not declare them: kube-scheduler counts the larger of
    the init containers and the sum of the others, which ADD does not.
    """
    spec = pod.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    for kind in ("initContainers", "ephemeralContainers"):
        for container in _listed(spec, kind):
            named = [r for r in _RESOURCES if r in _resources(container)]
            if named:
                raise InvalidPodRequest(f"{who}: {kind} may not request {named[0]}; declare it in containers")
    out: dict[str, int] = {}
    for k, container in enumerate(_listed(spec, "containers")):
        resources = _resources(container)
        for name in _RESOURCES:
            if name in resources:
                where = f"{who} containers[{k}] resources {name}"
                out[name] = out.get(name, 0) + _quantity(resources[name], where)
    return out


def check(pod: Mapping[str, Any], demand: Demand | None, who: str) -> None:
    """InvalidPodRequest unless the pod declares nothing, or both resources exactly as ``demand`` asks."""
    got = declared(pod, who)
    if not got:
        return
    if demand is None:
        raise InvalidPodRequest(f"{who} requests {', '.join(sorted(got))} but asks for no RDMA interface")
    wanted = {BANDWIDTH: demand.min_total, VFS: len(demand.requests)}
    for name in _RESOURCES:
        if got.get(name) != wanted[name]:
            has = "does not request it" if name not in got else f"requests {got[name]}"
            raise InvalidPodRequest(
                f"{who} {has} as {name}, but its RDMA interfaces ask for {wanted[name]} "
                f"({'the sum of their min_tx_rate' if name == BANDWIDTH else 'one VF each'}): "
                f"request exactly that, or neither {BANDWIDTH} nor {VFS}"
            )
