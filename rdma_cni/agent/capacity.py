"""The node's RDMA capacity in its Node's status, as the extended resources kube-scheduler counts.

With ``rdma-cni.io/bandwidth`` (Mbit/s) and ``rdma-cni.io/vf`` in the Node's
capacity and allocatable, kube-scheduler's own filters count the pods that
declare their interfaces under those names, and its preemption picks victims
by them (docs/scheduling.md, preemption for bandwidth). The values come from
the state the agent publishes: the VFs pods may get, and the PFs' capacities
summed, left out when any PF's is unknown (placement does not limit rates
there, and a total that is not the node's would mislead kube-scheduler).

A JSON merge patch of the status subresource, with those two keys only (the
conf/ admission policy allows nothing else there). It is written when the
values change and again with every heartbeat of the state, since the kubelet
sets extended resources it does not manage to 0 when it starts without its
device-manager checkpoint. A failure is logged once per distinct message and
tried again with the next write of the state: the annotation, which the
extender and ADD rely on, never waits for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from rdma_cni.agent import metrics
from rdma_cni.shared import nodestate

if TYPE_CHECKING:
    from rdma_cni.kube.client import ApiClient

log = logging.getLogger("rdma_cni.agent")

__all__ = ["Advertiser", "resources"]


def resources(state: nodestate.NodeState) -> dict[str, str]:
    """The extended resources ``state`` gives its node, as quantities (bandwidth absent if unknown)."""
    out = {nodestate.VF_RESOURCE: str(sum(pf.capacity_vfs for pf in state.pfs))}
    capacities = [pf.capacity_tx_rate for pf in state.pfs]
    if all(c is not None for c in capacities):
        out[nodestate.BANDWIDTH_RESOURCE] = str(sum(c for c in capacities if c is not None))
    return out


class Advertiser:
    """Keeps the Node's status showing the RDMA resources of the latest published state."""

    def __init__(self, client: Callable[[], ApiClient], node: str) -> None:
        self.client = client  # the publisher's current client (it may reconnect)
        self.path = f"/api/v1/nodes/{node}/status"
        self.node = node
        self.advertised: dict[str, str] | None = None  # what the status holds, as far as we know
        self.writes = 0
        self.last_error = ""

    def advertise(self, state: nodestate.NodeState, *, again: bool = False) -> bool:
        """Patch the status if ``state``'s resources differ from the last written (or ``again``)."""
        from rdma_cni.kube import client as kubeapi

        wanted = resources(state)
        if wanted == self.advertised and not again:
            return False
        # A key no longer given (a PF's capacity became unknown) is removed: null in a merge patch.
        values = {k: wanted.get(k) for k in (nodestate.BANDWIDTH_RESOURCE, nodestate.VF_RESOURCE)}
        try:
            self.client().patch_merge(self.path, {"status": {"capacity": values, "allocatable": values}})
        except kubeapi.ApiError as exc:
            self.advertised = None
            metrics.api_error(exc)
            message = f"{type(exc).__name__}: {exc}"
            if message != self.last_error:
                log.warning("cannot advertise node %s's RDMA resources in its status: %s", self.node, message)
            self.last_error = message
            return False
        if self.advertised != wanted or self.last_error:
            log.info("advertised %s in the status of node %s", wanted, self.node)
        self.advertised = wanted
        self.writes += 1
        self.last_error = ""
        return True
