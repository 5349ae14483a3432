"""A pod that fits none of the nodes kube-scheduler sampled but fits one it left out: retried, not refused.

kube-scheduler stops looking for feasible nodes once it has found
``percentageOfNodesToScore`` of them (by default 50% minus 1% per 125 nodes,
at least 5% and 100 nodes: 500 of 5,000), and sends extenders only those.
conf/ keeps that default, because filtering every node for every pod cost
kube-scheduler three times the CPU at 5,000 nodes (docs/performance.md). So a
pod whose RDMA request fits none of the nodes sent may still fit a node
kube-scheduler never looked at. Answered "fits nowhere", the pod would be told
so in its event, kube-scheduler would run preemption for it (evicting pods for
room a free node has), and it would wait in the unschedulable queue for the
next cluster event (in a quiet cluster, up to 5 minutes).

A list is a sample only when it is as long as the sample kube-scheduler stops
at (:func:`sample_size`, from the number of nodes and the profile's
percentage, ``--percentage-of-nodes-to-score``): a shorter list holds every
node kube-scheduler's own filters passed (a pod pinned to a few nodes by its
selector is one), and is answered as before, so such a pod gets preemption at
once. When the list is a sample, no node of it fits, and the watched node
cache holds a node outside it that fits, filter answers an ``Error`` instead:
kube-scheduler retries the pod after its backoff (1 s, doubling to 10 s), and
starts each search where the last one stopped, so the retry is sent the next
nodes. A node outside the list may also have been left out by kube-scheduler's
own filters (a taint, the pod's node selector, too little CPU), which the
extender cannot tell: so a pod is retried this way at most as often as it
takes lists of this size to cover every node, per :data:`PERIOD`; past that it
is answered as fitting nowhere, as before. Preemption runs only for a pod that
fits nowhere: one that fits a node outside the list is retried, never made to
evict.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from rdma_cni.extender.bounded import Bounded

if TYPE_CHECKING:  # the verbs call this module: types only, no import cycle
    from rdma_cni.extender.decide import Deadline, NodeView, Verdict
    from rdma_cni.extender.demand import Demand

__all__ = ["PERIOD", "Resampler", "sample_size"]

# The retries of one pod are counted over this many seconds, then counted afresh: a pod that fits
# only where its own constraints keep it away costs at most one full run of retries per period.
PERIOD = 600.0
# Pods whose retries are counted; beyond, the least recently retried are forgotten (a forgotten pod
# may be retried again: bounded all the same, by this many pods at a time).
_PODS = 10_000
# Nodes judged per call of the judge: a fitting node ends the search at the end of its chunk.
_CHUNK = 256

# kube-scheduler's bounds on its sample (minFeasibleNodesToFind, minFeasibleNodesPercentageToFind).
_MIN_NODES = 100
_MIN_PERCENTAGE = 5


def sample_size(nodes: int, percentage: int = 0) -> int:
    """How many feasible nodes kube-scheduler stops at, of ``nodes``, as v1.37 computes it.

    ``percentage`` is the profile's ``percentageOfNodesToScore``; 0 is kube-scheduler's default,
    50% less 1% per 125 nodes. Never fewer than 100 nodes, nor (by default) 5%.
    """
    if nodes < _MIN_NODES:
        return nodes
    if percentage == 0:
        percentage = max(50 - nodes // 125, _MIN_PERCENTAGE)
    return max(nodes * percentage // 100, _MIN_NODES)


Judge = Callable[["Demand", list[str], list["NodeView | None"], "Deadline | None"], list["Verdict"]]


class Resampler:
    """Per pod, whether a filter that passed no node should send kube-scheduler back for more."""

    def __init__(
        self, judge: Judge, percentage: int = 0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._judge = judge
        self._percentage = percentage
        self._clock = clock
        # uid -> (when its retries began, how many so far)
        self._tries: Bounded[str, tuple[float, int]] = Bounded(_PODS, _PODS)

    def outside(
        self,
        uid: str,
        demand: Demand,
        sent: list[str],
        cache: Mapping[str, NodeView],
        deadline: Deadline | None = None,
    ) -> tuple[str, int, int] | None:
        """``(node, try, tries)`` when ``uid`` should be retried: a node not in ``sent`` fits it.

        ``try`` counts this pod's retries in the period (1 for the first) and ``tries`` is how many it
        gets. ``None`` when the list is shorter than kube-scheduler's sample (it holds every node
        kube-scheduler's filters passed), nothing outside fits, or the pod's retries are used up.
        The search stops at the first chunk with a fitting node.
        """
        if not uid or not sent or len(sent) >= len(cache) or not self.is_sample(len(sent), len(cache)):
            return None
        now = self._clock()
        began, done = self._tries.get(uid) or (now, 0)
        if now - began > PERIOD:
            began, done = now, 0
        # Lists of this size that cover the nodes it left out: kube-scheduler moves on by at least
        # the list's length each time.
        tries = math.ceil((len(cache) - len(sent)) / len(sent))
        if done >= tries:
            return None
        node = self._first_fit(demand, set(sent), cache, deadline)
        if node is None:
            return None
        self._tries.put(uid, (began, done + 1))
        return node, done + 1, tries

    def is_sample(self, sent: int, nodes: int) -> bool:
        """Whether ``sent`` nodes of ``nodes`` is as many as kube-scheduler's sample holds.

        kube-scheduler's count of nodes and the cache's may differ by the nodes one of them has not
        seen yet: a list that short of the sample by 1% still counts.
        """
        size = sample_size(nodes, self._percentage)
        return size < nodes and sent >= size - size // 100 - 1

    def forget(self, uid: str) -> None:
        """``uid`` found its node (or is gone): its next miss starts a new count."""
        self._tries.pop(uid)

    def _first_fit(
        self, demand: Demand, sent: set[str], cache: Mapping[str, NodeView], deadline: Deadline | None
    ) -> str | None:
        names: list[str] = []
        views: list[NodeView | None] = []
        for name, view in list(cache.items()):
            if name in sent:
                continue
            names.append(name)
            views.append(view)
            if len(names) == _CHUNK:
                found = self._fit_among(demand, names, views, deadline)
                if found is not None:
                    return found
                names, views = [], []
        return self._fit_among(demand, names, views, deadline) if names else None

    def _fit_among(
        self, demand: Demand, names: list[str], views: list[NodeView | None], deadline: Deadline | None
    ) -> str | None:
        for name, verdict in zip(names, self._judge(demand, names, views, deadline), strict=True):
            if verdict.fits:
                return name
        return None
