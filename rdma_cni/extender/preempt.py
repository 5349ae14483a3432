"""Preempt: keep a node only if evicting its proposed victims lets the pod fit there.

kube-scheduler picks victims by priority and resources it knows (CPU,
memory); it knows nothing of VFs and bandwidth. Evicting victims that hold
no RDMA interfaces on a PF the pod needs frees nothing the pod is waiting
for, so such a node is dropped rather than have pods evicted for nothing.
A victim's consumption comes from the node's published allocations (by uid)
or, when bound but not yet published, from its reservation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from rdma_cni.extender.decide import Decider, NodeView
from rdma_cni.extender.demand import Demand
from rdma_cni.extender.reservations import Reservations

__all__ = ["keep_nodes"]


def released(view: NodeView, victims: frozenset[str]) -> dict[str, tuple[int, int]]:
    """Per PF: (VFs, min rate sum) the published allocations of ``victims`` hold."""
    out: dict[str, tuple[int, int]] = {}
    assert view.state is not None
    for alloc in view.state.allocations:
        if alloc.uid in victims:
            for use in alloc.interfaces:
                vfs, rate = out.get(use.pf, (0, 0))
                out[use.pf] = (vfs + 1, rate + use.min_tx_rate)
    return out


def keep_nodes(
    demand: Demand,
    victims: Mapping[str, tuple[str, ...]],
    views: Callable[[str], NodeView | None],
    reservations: Reservations,
    decider: Decider,
) -> dict[str, tuple[str, ...]]:
    """The nodes (with their victims) where evicting the victims makes the demand fit."""
    now = decider.now()
    kept = {}
    for node, uids in victims.items():
        view = views(node)
        if decider.unusable(view, now):
            continue
        assert view is not None
        gone = frozenset(uids)
        # What the node holds with the victims gone: their reservations left out, their published
        # use given back, and they themselves no longer counted by the per-node rules.
        extra = reservations.extra(node, without=gone).releasing(released(view, gone), gone)
        if decider.admit(demand, view, now, extra).fits:
            kept[node] = uids
    return kept
