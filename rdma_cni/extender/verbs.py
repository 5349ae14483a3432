"""The extender's verbs: filter, prioritize, preempt and bind on decoded extender/v1 documents.

Every verb answers with its result document; bad input becomes the result's
``Error`` (or, for a malformed pod annotation, a reason on every node) and
never a failure of the request, so kube-scheduler shows the reason in the
pod's events. Both node modes are decided per request by what arrives: full
``Nodes`` carry their own annotations (decoded once per distinct text),
``NodeNames`` are looked up in the node cache.

What a request body carries shapes that request's answer and nothing else:
full Nodes are never kept, and the pod a filter sends is not remembered for
its bind. Bind and preempt decide from the watched node cache, bind from the
API server's copy of the pod (see bind.py). The HTTP side (reading requests
under limits, connections, deadlines) is :mod:`rdma_cni.extender.server`.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from rdma_cni.cni.errors import InvalidPodRequest
from rdma_cni.extender import metrics, wire
from rdma_cni.extender.answers import Answers
from rdma_cni.extender.bind import DEFAULT_SCHEDULER_NAMES, Binder
from rdma_cni.extender.decide import FUTURE_SKEW, Decider, NodeView, Verdict
from rdma_cni.extender.demand import Demand, Demands
from rdma_cni.extender.preempt import keep_nodes
from rdma_cni.extender.reservations import Reservations
from rdma_cni.shared import nodestate

__all__ = ["Extender", "KeptScores", "error_answer"]

# The logger the verbs had in server.py before the split (log configurations name it).
log = logging.getLogger("rdma_cni.extender.server")

# Scores from a pod's filter, reused by its prioritize when it comes within this many seconds.
_SCORES_FRESH = 5.0
_SCORES_KEPT = 1024


class KeptScores(NamedTuple):
    """What a pod's filter computed, kept for the prioritize that kube-scheduler sends next."""

    when: float  # time.monotonic() of the filter
    demand_key: tuple[tuple[int, int], ...]  # the demand it was computed for (the pod may change)
    score: Callable[[str], int]  # a node's score (0: does not fit)
    passing: list[str] | None  # the nodes that passed, when the answer came from Answers' cache
    body: bytes  # the encoded priorities of exactly ``passing``


class Extender:
    """The four verbs on decoded documents; owns the decision state shared by all requests."""

    def __init__(
        self,
        *,
        decider: Decider,
        demands: Demands,
        reservations: Reservations,
        client: Any = None,
        cache_views: Callable[[], dict[str, NodeView]] | None = None,
        cache_generation: Callable[[], int | None] | None = None,
        annotation: str = nodestate.ANNOTATION,
        scheduler_names: frozenset[str] = DEFAULT_SCHEDULER_NAMES,
    ) -> None:
        self.decider = decider
        self.demands = demands
        self.reservations = reservations
        self.annotation = annotation
        self._cache_views = cache_views or dict
        # Bumped by the cache after every change of its views; None: lists are never reused.
        self._cache_generation: Callable[[], int | None] = cache_generation or (lambda: None)
        self._last_lookup: tuple[int, list[str], list[NodeView | None]] | None = None
        # Per pod uid: what its filter computed, for its prioritize.
        self._scores: dict[str, KeptScores] = {}
        self.answers = Answers(reservations, self._judge, decider.max_state_age)
        self.binder = Binder(client, decider, demands, reservations, self.view_of, scheduler_names)
        self.ready = threading.Event()

    def routes(self) -> dict[str, Callable[[Any], Any]]:
        """The verbs by request path, for the HTTP server (an answer is a document or encoded bytes)."""
        return {
            "/filter": self.filter_encoded,
            "/prioritize": self.prioritize,
            "/preempt": self.preempt,
            "/bind": self.bind,
        }

    def view_of(self, name: str) -> NodeView | None:
        """The watched node cache's view of a node: what bind and preempt decide from.

        Never a view a full-Node request carried: a request body can say anything about any node.
        """
        return self._cache_views().get(name)

    def _views(self, args: wire.FilterArgs) -> tuple[list[str], list[NodeView | None]]:
        if args.node_names is not None:
            views = self._cache_views()
            return args.node_names, list(map(views.get, args.node_names))
        names, out = [], []
        for node in args.nodes or ():
            name = wire.node_name(node)
            meta = node.get("metadata") or {}
            annotations = meta.get("annotations") or {}
            text = annotations.get(self.annotation) if isinstance(annotations, dict) else None
            # Shapes this answer only: never kept where bind, preempt or other requests look.
            view = self.decider.view(text if isinstance(text, str) else None)
            names.append(name)
            out.append(view)
        return names, out

    def _judge(self, demand: Demand, names: list[str], views: list[NodeView | None]) -> list[Verdict]:
        """The verdict per node (``views`` in the order of ``names``): the hot loop of filter."""
        decider = self.decider
        now = decider.now()
        max_age = decider.max_state_age
        # Usable states were stamped in [oldest, newest]: a future stamp is no fresher than a stale one.
        oldest = now - max_age if max_age is not None else -math.inf
        newest = now + FUTURE_SKEW if max_age is not None else math.inf
        reservations = self.reservations
        reserved = reservations.nodes()
        table = decider.table(demand)
        out: list[Verdict] = []
        for name, view in zip(names, views, strict=True):
            if view is None or view.problem or not oldest <= view.updated <= newest:
                out.append(Verdict(False, True, decider.unusable(view, now), 0))
            elif name in reserved:
                out.append(decider.verdict(demand, view, reservations.extra(name)))
            else:
                verdict = table.get(view.fp)
                out.append(verdict if verdict is not None else decider.fill(demand, view, table))
        return out

    def _decide(
        self, demand: Demand, names: list[str], views: list[NodeView | None]
    ) -> tuple[list[str], dict[str, str], dict[str, str], dict[str, int]]:
        """:meth:`_judge` split into passing nodes, failed ones, unresolvable ones and scores."""
        passing: list[str] = []
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        scores: dict[str, int] = {}
        for name, verdict in zip(names, self._judge(demand, names, views), strict=True):
            if verdict.fits:
                passing.append(name)
                scores[name] = verdict.score
            elif verdict.unresolvable:
                unresolvable[name] = verdict.reason
            else:
                failed[name] = verdict.reason
        return passing, failed, unresolvable, scores

    def _demand(self, pod: dict[str, Any]) -> Demand | None:
        # Not remembered for bind: bind reads the pod from the API server.
        return self.demands.of_pod(pod)

    def filter(self, doc: Any) -> dict[str, Any]:
        """ExtenderArgs -> ExtenderFilterResult."""
        answer = self.filter_encoded(doc)
        return json.loads(answer) if isinstance(answer, bytes) else answer

    def filter_encoded(self, doc: Any) -> dict[str, Any] | bytes:
        """:meth:`filter` for the server: already encoded when it came from :class:`Answers`."""
        try:
            args = wire.parse_filter(doc)
        except wire.WireError as exc:
            metrics.decided("filter", "error")
            return wire.filter_error(f"rdma-cni: bad ExtenderArgs: {exc}")
        names = args.names if args.node_names is not None else None
        if names is not None and not self.ready.is_set():
            metrics.decided("filter", "error")
            return wire.filter_result(
                args, [], {}, {}, "rdma-cni: the extender's node cache is not synced yet"
            )
        try:
            demand = self._demand(args.pod)
        except InvalidPodRequest as exc:
            reason = f"rdma-cni: {exc.msg}"
            metrics.decided("filter", "error")
            return wire.filter_result(args, [], {}, {n: reason for n in args.names})
        except wire.WireError as exc:
            metrics.decided("filter", "error")
            return wire.filter_error(f"rdma-cni: bad ExtenderArgs: {exc}")
        if demand is None:
            metrics.decided("filter", "not_rdma")
            return wire.filter_result(args, args.names, {}, {})
        uid = wire.pod_identity(args.pod)[2]
        if args.node_names is not None:
            names, views = self._lookup(args.node_names)
            answer = self.answers.filter(demand, names, views, self.decider.now())
            self._remember(uid, demand, answer.score, answer.passing, answer.prioritize_body)
            metrics.decided("filter", "fits" if answer.passing else "no_fit")
            if log.isEnabledFor(logging.DEBUG):  # first: answer.failed is built per call
                self._log_detail(args.pod, answer.failed, self._cache_views())
            return answer.filter_body
        names, views = self._views(args)
        passing, failed, unresolvable, scores = self._decide(demand, names, views)
        self._remember(uid, demand, lambda node: scores.get(node, 0), None, b"")
        metrics.decided("filter", "fits" if passing else "no_fit")
        return wire.filter_result(args, passing, failed, unresolvable)

    def _lookup(self, names: list[str]) -> tuple[list[str], list[NodeView | None]]:
        """The cached views of ``names``, and ``names`` as a list equal to it.

        kube-scheduler sends the same node list for pod after pod. When the list
        equals the last one looked up (one C-level comparison) and the cache has
        not changed since, the last lookup's lists are reused: the names as the
        same objects, so that :class:`Answers` compares them by identity, and the
        views without hashing thousands of new strings again.
        """
        # The generation is read before the views: a change after this read bumps it, so lists
        # looked up during a change are never reused (the cache bumps after it changes its views).
        generation = self._cache_generation()
        last = self._last_lookup
        if generation is not None and last is not None and last[0] == generation and last[1] == names:
            return last[1], last[2]
        views = list(map(self._cache_views().get, names))
        if generation is not None:
            self._last_lookup = (generation, names, views)
        return names, views

    def _log_detail(self, pod: dict[str, Any], failed: dict[str, str], views: dict[str, NodeView]) -> None:
        # Reasons are short and shared; what each node has free is here, for whoever debugs.
        from rdma_cni.shared import placement

        namespace, name, _ = wire.pod_identity(pod)
        for node, reason in failed.items():
            view = views.get(node)
            if view is None or view.state is None:
                continue
            pfs = nodestate.pf_states(view.state, self.reservations.extra(node))
            log.debug("filter %s/%s: %s: %s (%s)", namespace, name, node, reason, placement.free_summary(pfs))

    def _remember(
        self,
        uid: str,
        demand: Demand,
        score: Callable[[str], int],
        passing: list[str] | None,
        body: bytes,
    ) -> None:
        # kube-scheduler asks prioritize for the same pod next: its scores are computed now.
        if uid:
            if len(self._scores) >= _SCORES_KEPT:
                self._scores.clear()
            self._scores[uid] = KeptScores(time.monotonic(), demand.key, score, passing, body)

    def prioritize(self, doc: Any) -> bytes:
        """ExtenderArgs -> HostPriorityList, encoded; nodes that score 0 (that do not fit; all of them
        for a non-RDMA pod) are left out (see :func:`wire.priority_json`)."""
        try:
            args = wire.parse_filter(doc)
            demand = self._demand(args.pod)
        except (wire.WireError, InvalidPodRequest):
            # Prioritize has no error field; filter already failed such a pod.
            return b"[]"
        if demand is None:
            return b"[]"
        kept = self._scores.pop(wire.pod_identity(args.pod)[2], None)
        if (
            kept is not None
            and kept.demand_key == demand.key
            and time.monotonic() - kept.when < _SCORES_FRESH
        ):
            if kept.passing is not None and args.names == kept.passing:
                return kept.body  # the nodes filter passed, as kube-scheduler usually sends them
            score = kept.score
            return wire.priority_json((n, score(n)) for n in args.names)
        names, views = self._views(args)
        _, _, _, scores = self._decide(demand, names, views)
        return wire.priority_json((n, scores.get(n, 0)) for n in names)

    def preempt(self, doc: Any) -> dict[str, Any]:
        """ExtenderPreemptionArgs -> ExtenderPreemptionResult (only nodes where eviction helps)."""
        try:
            args = wire.parse_preempt(doc)
            demand = self.demands.of_pod(args.pod)
        except (wire.WireError, InvalidPodRequest) as exc:
            log.warning("preempt: %s", getattr(exc, "msg", exc))
            metrics.preempted(0, 0, "error")
            return wire.preempt_result({}, {})
        if demand is None:
            metrics.preempted(len(args.victims), len(args.victims), "not_rdma")
            return wire.preempt_result(args.victims, args.pdb_violations)
        kept = keep_nodes(demand, args.victims, self.view_of, self.reservations, self.decider)
        metrics.preempted(len(args.victims), len(kept))
        return wire.preempt_result(kept, args.pdb_violations)

    def bind(self, doc: Any) -> dict[str, Any]:
        """ExtenderBindingArgs -> ExtenderBindingResult."""
        try:
            args = wire.parse_bind(doc)
        except wire.WireError as exc:
            metrics.bind_refused("bad_request")
            return wire.bind_result(f"rdma-cni: bad ExtenderBindingArgs: {exc}")
        if not self.ready.is_set():
            metrics.bind_refused("not_ready")
            return wire.bind_result("rdma-cni: the extender is not ready (reservations not rebuilt yet)")
        return wire.bind_result(self.binder.bind(args))


def error_answer(path: str, message: str) -> Any:
    """The error answer in the format of the verb at ``path`` (a request that could not be decided)."""
    verb = path.split("?", 1)[0].rstrip("/")
    if verb == "/prioritize":
        return b"[]"
    if verb == "/preempt":
        return wire.preempt_result({}, {})
    if verb == "/bind":
        return wire.bind_result(message)
    return wire.filter_error(message)
