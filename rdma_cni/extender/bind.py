"""Bind: the check that guarantees no node is over-committed, then the Binding.

kube-scheduler filters the next pod while it binds the previous one, so a
filter may pass on a state that a bind is about to change. Bind is the one
place that decides for good: under one lock it re-checks the pod against the
node's published state plus every reservation held, and records the pod's
reservation. The Binding is created after the lock is released (so one slow
API call does not hold up every other bind); the reservation is already in
place, so any bind checking the same node meanwhile counts it, and an API
refusal drops it again.

Bind trusts nothing a request says about the pod or the node. The pod is
read from the API server (its demand, its schedulerName, whether it is
already bound, its uid); the node's state is the watched node cache's. A
filter request body never changes either. A Binding whose outcome is unknown
(no answer, a 5xx) keeps its reservation until the pod is read back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from typing import Any

from rdma_cni.cni.errors import InvalidPodRequest
from rdma_cni.extender import metrics
from rdma_cni.extender.decide import Decider, NodeView
from rdma_cni.extender.demand import Demand, Demands
from rdma_cni.extender.reservations import Reservations, Reserved
from rdma_cni.extender.settings import Settings
from rdma_cni.extender.wire import BindArgs, clip
from rdma_cni.shared import nodestate, placement

__all__ = ["DEFAULT_SCHEDULER_NAMES", "Binder", "binding_outcome_unknown"]

log = logging.getLogger("rdma_cni.extender.bind")

# One definition, the settings' default.
DEFAULT_SCHEDULER_NAMES = Settings().scheduler_names


class _Refused(Exception):
    """Bind refuses the pod: the message is the verb's Error; ``reason`` one of metrics.REFUSAL_REASONS."""

    def __init__(self, message: str, reason: str) -> None:
        # Quoted in the answer, the log and an Event: capped however long what it quotes.
        super().__init__(clip(message))
        self.reason = reason


def binding_outcome_unknown(exc: Exception) -> bool:
    """Whether a failed Binding POST may still have been applied: no answer (status 0) or a 5xx.

    A 4xx answer (and 429, which the API answers before doing anything) is a clear refusal.
    """
    status = getattr(exc, "status", 0)
    return status == 0 or status >= 500


class Binder:
    """Checks, reserves and binds, one decision at a time."""

    def __init__(
        self,
        client: Any,
        decider: Decider,
        demands: Demands,
        reservations: Reservations,
        views: Callable[[str], NodeView | None],
        scheduler_names: Collection[str] = DEFAULT_SCHEDULER_NAMES,
    ) -> None:
        self.client = client
        self.decider = decider
        self.demands = demands
        self.reservations = reservations
        # The watched node cache only: never a view a request carried.
        self.views = views
        self.scheduler_names = frozenset(scheduler_names)
        self.lock = threading.Lock()
        # Told of every refusal: (the bind's args, reason, the Error answered); must not block.
        self.on_refused: Callable[[BindArgs, str, str], None] | None = None

    def _pod_path(self, args: BindArgs) -> str:
        return f"/api/v1/namespaces/{args.pod_namespace}/pods/{args.pod_name}"

    def _get_pod(self, args: BindArgs) -> dict[str, Any]:
        """The pod from kube-apiserver's cache, or from etcd when the cache's copy cannot be the one bound.

        A read at resourceVersion 0 is served from the API server's watch cache, not as a quorum
        read of etcd: per pod bound, that read was most of what the extender added to etcd's work
        (docs/performance.md). The cache trails etcd by the time an event takes to arrive, so a pod
        created a moment ago may be missing (404) and a pod replaced under the same name may still
        be the old one (another uid): both are read again from etcd. Any other staleness changes
        nothing a quorum read makes safe: the pod may change right after either read, its
        annotations included, and the Binding is refused (409, checked in :meth:`_post`) for a pod
        bound meanwhile, and (by its uid) for a pod replaced.
        """
        from rdma_cni.kube import client as kubeapi

        path = self._pod_path(args)
        try:
            pod = self.client.get(path, {"resourceVersion": "0"})
        except kubeapi.NotFound:
            return self.client.get(path)
        uid = (pod.get("metadata") or {}).get("uid")
        if args.pod_uid and uid != args.pod_uid:
            return self.client.get(path)
        return pod

    def _read(self, args: BindArgs) -> tuple[str, Demand | None, str]:
        """The API's uid of the pod, its demand and its scheduler, after every check a bind makes of it."""
        from rdma_cni.kube import client as kubeapi

        who = f"pod {args.pod_namespace}/{args.pod_name}"
        if self.views(args.node) is None:
            raise _Refused(
                f"rdma-cni: node {args.node} is not known to the extender (binding {who})", "unknown_node"
            )
        try:
            pod = self._get_pod(args)
        except kubeapi.ApiError as exc:
            raise _Refused(
                f"rdma-cni: cannot read {who} to check it against node {args.node}: {exc}", "pod_unreadable"
            ) from None
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        uid = meta.get("uid") if isinstance(meta.get("uid"), str) else ""
        if args.pod_uid and uid != args.pod_uid:
            raise _Refused(
                f"rdma-cni: cannot read {who} to check it against node {args.node}: "
                f"pod {args.pod_namespace}/{args.pod_name} now has uid {uid}, not {args.pod_uid}",
                "pod_replaced",
            )
        scheduler = spec.get("schedulerName") or "default-scheduler"
        if scheduler not in self.scheduler_names:
            raise _Refused(
                f"rdma-cni: {who} has schedulerName {scheduler!r}, which this extender does not serve",
                "other_scheduler",
            )
        bound = spec.get("nodeName")
        if bound:
            raise _Refused(f"rdma-cni: {who} is already bound to node {bound}", "already_bound")
        try:
            demand = self.demands.of_pod(pod)
        except InvalidPodRequest as exc:
            raise _Refused(f"rdma-cni: {exc.msg}", "bad_annotation") from None
        if demand is not None and (not args.pod_uid or not uid):
            raise _Refused(
                f"rdma-cni: {who} asks for RDMA interfaces but the bind names no pod uid", "no_pod_uid"
            )
        return uid, demand, scheduler

    def bind(self, args: BindArgs) -> str:
        """Bind the pod; the ``Error`` to answer ("" on success). A refusal is counted and told."""
        try:
            error = self._bind(args)
        except _Refused as refused:
            log.info("bind refused: %s", refused)
            metrics.bind_refused(refused.reason)
            if self.on_refused is not None:
                self.on_refused(args, refused.reason, str(refused))
            return str(refused)
        finally:
            # The pod's hold has done its work, whatever the outcome: a reservation made here replaced
            # it in the same step (no moment with neither), and a refused pod is filtered afresh.
            if args.pod_uid:
                self.reservations.release(args.pod_uid)
        metrics.decided("bind", "bound")
        return error

    def _bind(self, args: BindArgs) -> str:
        from rdma_cni.kube import client as kubeapi

        who = f"pod {args.pod_namespace}/{args.pod_name}"
        uid, demand, scheduler = self._read(args)
        reserved = False
        if demand is not None:
            with self.lock:
                self.reservations.expire()
                problem, reason = self._reserve(args, demand, scheduler)
            if problem:
                raise _Refused(problem, reason)
            reserved = self.reservations.get(args.pod_uid) is not None
        try:
            self._post(args, uid)
        except kubeapi.ApiError as exc:
            if reserved and binding_outcome_unknown(exc):
                return self._unknown(args, exc)
            if reserved:
                self.reservations.drop(args.pod_uid, f"the API refused the Binding: {exc}")
            raise _Refused(f"rdma-cni: binding {who} to {args.node} failed: {exc}", "api_refused") from None
        log.info("bound %s to %s", who, args.node)
        return ""

    def _unknown(self, args: BindArgs, exc: Exception) -> str:
        """The Binding may have been applied: read the pod back; keep the reservation unless unbound."""
        from rdma_cni.kube import client as kubeapi

        who = f"pod {args.pod_namespace}/{args.pod_name}"
        self.reservations.unconfirm(args.pod_uid)
        try:
            pod = self.client.get(self._pod_path(args))
        except kubeapi.NotFound:
            self.reservations.drop(args.pod_uid, "the pod is gone")
            raise _Refused(
                f"rdma-cni: binding {who} to {args.node} failed: {exc}", "outcome_unknown"
            ) from None
        except kubeapi.ApiError as again:
            log.warning(
                "binding %s to %s: outcome unknown (%s) and the pod cannot be read back (%s): "
                "its reservation is kept until it is",
                who,
                args.node,
                exc,
                again,
            )
            raise _Refused(
                f"rdma-cni: binding {who} to {args.node}: outcome unknown ({exc}); "
                "its reservation is kept until the pod is read back",
                "outcome_unknown",
            ) from None
        uid = (pod.get("metadata") or {}).get("uid")
        node = (pod.get("spec") or {}).get("nodeName")
        if uid == args.pod_uid and node == args.node:
            self.reservations.confirm(args.pod_uid)
            log.info("bound %s to %s (the Binding's answer was lost: read back)", who, args.node)
            return ""
        if uid == args.pod_uid and not node:
            self.reservations.drop(args.pod_uid, f"the Binding was not applied: {exc}")
        else:
            self.reservations.drop(args.pod_uid, "the pod is bound elsewhere or was replaced")
        raise _Refused(f"rdma-cni: binding {who} to {args.node} failed: {exc}", "outcome_unknown")

    def _reserve(self, args: BindArgs, demand: Demand, scheduler: str = "") -> tuple[str, str]:
        """("", "") when reserved (or nothing to reserve), else (the refusal, its reason)."""
        # Called under self.lock: the check and the reservation are one step.
        view = self.views(args.node)
        now = self.decider.now()
        problem = self.decider.unusable(view, now)
        if problem:
            return (
                f"{problem} (binding pod {args.pod_namespace}/{args.pod_name} to {args.node})",
                "state_unusable",
            )
        assert view is not None
        if args.pod_uid in view.uids:
            return "", ""  # already published on this node: it holds what it needs
        # Reservations only: holds are filter's guesses (see reservations.py), never a reason to refuse.
        extra = self.reservations.extra(args.node, without=(args.pod_uid,), holds=False)
        # The same per-node rule as filter's: node rules, then the fit with every reservation held.
        verdict = self.decider.admit(demand, view, now, extra)
        if not verdict.fits:
            # One node, one refusal: worth the free-capacity detail filter's reasons leave out.
            free = placement.free_summary(nodestate.pf_states(view.state, extra))
            return (
                f"rdma-cni: pod {args.pod_namespace}/{args.pod_name} no longer fits node {args.node}: "
                f"{verdict.reason.removeprefix('rdma-cni: ')} ({free})"
            ), "no_fit"
        if args.pod_uid:
            use = self._held_use(args, view, extra)
            if use is None:
                # Placed where the other pods' holds leave room if it can be, so as not to take the PFs
                # their filters counted on; reservations alone decide whether it fits at all.
                try:
                    use = self.decider.use(
                        demand, view, self.reservations.extra(args.node, without=(args.pod_uid,))
                    )
                except placement.NoFit:
                    use = None
            try:
                use = use or self.decider.use(demand, view, extra)
            except placement.NoFit as exc:  # the verdict's search gave up where bind's did not
                return (
                    f"rdma-cni: pod {args.pod_namespace}/{args.pod_name} does not fit node {args.node}: {exc}"
                ), "no_fit"
            self.reservations.add(
                args.pod_uid, args.pod_namespace, args.pod_name, args.node, use, scheduler=scheduler
            )
        return "", ""

    def _held_use(
        self, args: BindArgs, view: NodeView, extra: Reserved
    ) -> tuple[tuple[str, int, int], ...] | None:
        """The PFs the pod's hold on this node took, when they still have room: what to reserve.

        Filters of other pods since the hold were judged with exactly these PFs taken; a placement
        made afresh here (without the other pods' holds) may pick other PFs of the node, and a pod
        judged to fit beside the hold would then not fit beside the reservation. None when there is
        no such hold, the node's state changed since, or a PF no longer has the room.
        """
        hold = self.reservations.held(args.pod_uid)
        if hold is None or hold.node != args.node or hold.basis is not view or view.state is None:
            return None
        pfs = {pf.name: pf for pf in view.state.pfs}
        for name, vfs, rate in hold.use:
            summary = pfs.get(name)
            if summary is None:
                return None
            pf = nodestate.pf_state(summary, extra.get(name, (0, 0)))
            capacity = pf.capacity_mbps
            if pf.free_vfs < vfs or (capacity is not None and pf.reserved_mbps + rate > capacity):
                return None
        return hold.use

    def _post(self, args: BindArgs, uid: str) -> None:
        from rdma_cni.kube import client as kubeapi

        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": args.pod_name, "namespace": args.pod_namespace},
            "target": {"apiVersion": "v1", "kind": "Node", "name": args.node},
        }
        if uid:
            # The uid read from the API: a pod replaced since is not bound in its place.
            body["metadata"]["uid"] = uid
        path = f"/api/v1/namespaces/{args.pod_namespace}/pods/{args.pod_name}/binding"
        try:
            self.client.post(path, body)
        except kubeapi.Conflict:
            # A retried bind whose first attempt reached the API: fine if it went to this node.
            pod = self.client.get(f"/api/v1/namespaces/{args.pod_namespace}/pods/{args.pod_name}")
            if (pod.get("spec") or {}).get("nodeName") != args.node:
                raise
