"""Bind: the check that guarantees no node is over-committed, then the Binding.

kube-scheduler filters the next pod while it binds the previous one, so a
filter may pass on a state that a bind is about to change. Bind is the one
place that decides for good: under one lock it re-checks the pod against the
node's published state plus every reservation held, and records the pod's
reservation. The Binding is created after the lock is released (so one slow
API call does not hold up every other bind); the reservation is already in
place, so any bind checking the same node meanwhile counts it, and an API
refusal drops it again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from rdma_cni.cni.errors import InvalidPodRequest
from rdma_cni.extender.decide import Decider, NodeView
from rdma_cni.extender.demand import Demand, Demands
from rdma_cni.extender.reservations import Reservations
from rdma_cni.extender.wire import BindArgs, pod_identity
from rdma_cni.shared import nodestate, placement

__all__ = ["Binder", "PodMemo"]

log = logging.getLogger("rdma_cni.extender.bind")

_MEMO_LIMIT = 20_000


class PodMemo:
    """Demands of pods seen by filter, by uid: bind is only told the pod's name and uid."""

    def __init__(self) -> None:
        self._items: dict[str, tuple[str, str, Demand | None]] = {}

    def remember(self, pod: dict[str, Any], demand: Demand | None) -> None:
        """Keep the pod's demand for its bind."""
        namespace, name, uid = pod_identity(pod)
        if uid:
            if len(self._items) >= _MEMO_LIMIT:
                self._items.clear()
            self._items[uid] = (namespace, name, demand)

    def recall(self, args: BindArgs) -> tuple[bool, Demand | None]:
        """(known, demand) for the pod being bound; unknown when filter never saw it."""
        got = self._items.pop(args.pod_uid, None) if args.pod_uid else None
        if got is None or got[:2] != (args.pod_namespace, args.pod_name):
            return False, None
        return True, got[2]


class Binder:
    """Checks, reserves and binds, one decision at a time."""

    def __init__(
        self,
        client: Any,
        decider: Decider,
        demands: Demands,
        reservations: Reservations,
        views: Callable[[str], NodeView | None],
        memo: PodMemo,
    ) -> None:
        self.client = client
        self.decider = decider
        self.demands = demands
        self.reservations = reservations
        self.views = views
        self.memo = memo
        self.lock = threading.Lock()

    def _demand(self, args: BindArgs) -> Demand | None:
        known, demand = self.memo.recall(args)
        if known:
            return demand
        pod = self.client.get(f"/api/v1/namespaces/{args.pod_namespace}/pods/{args.pod_name}")
        uid = (pod.get("metadata") or {}).get("uid")
        if args.pod_uid and uid != args.pod_uid:
            raise LookupError(
                f"pod {args.pod_namespace}/{args.pod_name} now has uid {uid}, not {args.pod_uid}"
            )
        return self.demands.of_pod(pod)

    def bind(self, args: BindArgs) -> str:
        """Bind the pod; the ``Error`` to answer ("" on success)."""
        from rdma_cni.kube import client as kubeapi

        who = f"pod {args.pod_namespace}/{args.pod_name}"
        try:
            demand = self._demand(args)
        except (kubeapi.ApiError, LookupError) as exc:
            return f"rdma-cni: cannot read {who} to check it against node {args.node}: {exc}"
        except InvalidPodRequest as exc:
            return f"rdma-cni: {exc.msg}"
        reserved = False
        if demand is not None:
            with self.lock:
                self.reservations.expire()
                problem = self._reserve(args, demand)
            if problem:
                return problem
            reserved = self.reservations.get(args.pod_uid) is not None
        try:
            self._post(args)
        except kubeapi.ApiError as exc:
            if reserved:
                self.reservations.drop(args.pod_uid, f"the API refused the Binding: {exc}")
            return f"rdma-cni: binding {who} to {args.node} failed: {exc}"
        log.info("bound %s to %s", who, args.node)
        return ""

    def _reserve(self, args: BindArgs, demand: Demand) -> str:
        # Called under self.lock: the check and the reservation are one step.
        view = self.views(args.node)
        problem = self.decider.unusable(view, self.decider.now())
        if problem:
            return f"{problem} (binding pod {args.pod_namespace}/{args.pod_name} to {args.node})"
        assert view is not None
        if args.pod_uid in view.uids:
            return ""  # already published on this node: it holds what it needs
        extra = self.reservations.extra(args.node, without=(args.pod_uid,))
        verdict = self.decider.verdict(demand, view, extra)
        if not verdict.fits:
            # One node, one refusal: worth the free-capacity detail filter's reasons leave out.
            free = placement.free_summary(nodestate.pf_states(view.state, extra))
            return (
                f"rdma-cni: pod {args.pod_namespace}/{args.pod_name} no longer fits node {args.node}: "
                f"{verdict.reason.removeprefix('rdma-cni: ')} ({free})"
            )
        if args.pod_uid:
            try:
                use = self.decider.use(demand, view, extra)
            except placement.NoFit as exc:  # the verdict's search gave up where bind's did not
                return (
                    f"rdma-cni: pod {args.pod_namespace}/{args.pod_name} does not fit node {args.node}: {exc}"
                )
            self.reservations.add(args.pod_uid, args.pod_namespace, args.pod_name, args.node, use)
        return ""

    def _post(self, args: BindArgs) -> None:
        from rdma_cni.kube import client as kubeapi

        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": args.pod_name, "namespace": args.pod_namespace},
            "target": {"apiVersion": "v1", "kind": "Node", "name": args.node},
        }
        if args.pod_uid:
            body["metadata"]["uid"] = args.pod_uid
        path = f"/api/v1/namespaces/{args.pod_namespace}/pods/{args.pod_name}/binding"
        try:
            self.client.post(path, body)
        except kubeapi.Conflict:
            # A retried bind whose first attempt reached the API: fine if it went to this node.
            pod = self.client.get(f"/api/v1/namespaces/{args.pod_namespace}/pods/{args.pod_name}")
            if (pod.get("spec") or {}).get("nodeName") != args.node:
                raise
