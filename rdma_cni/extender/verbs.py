"""The extender's verbs: filter, prioritize, preempt and bind on decoded extender/v1 documents.

Every verb answers with its result document; bad input (a malformed pod
annotation too: invalid on every node, said once) becomes the result's
``Error`` and never a failure of the request, so kube-scheduler shows the
reason in the pod's events. Filter and prioritize decide under a
:class:`Deadline` (half of kube-scheduler's ``httpTimeout``, or what the
server hands in): past it they are abandoned with an ``Error``. Both node
modes are decided per request by what arrives: full ``Nodes`` carry their
own annotations (decoded once per distinct text), ``NodeNames`` are looked
up in the node cache.

What a request body carries shapes that request's answer and nothing else:
full Nodes are never kept, and the pod a filter sends is not remembered for
its bind. Bind and preempt decide from the watched node cache, bind from the
API server's copy of the pod (see bind.py). The HTTP side (reading requests
under limits, connections, deadlines) is :mod:`rdma_cni.extender.server`.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from rdma_cni.cni.errors import InvalidPodRequest
from rdma_cni.extender import metrics, wire
from rdma_cni.extender.answers import Answers
from rdma_cni.extender.bind import Binder
from rdma_cni.extender.bounded import Bounded
from rdma_cni.extender.decide import NEVER, Abandoned, Deadline, Decider, NodeView, Verdict
from rdma_cni.extender.demand import Demand, Demands
from rdma_cni.extender.preempt import keep_nodes
from rdma_cni.extender.resample import Resampler
from rdma_cni.extender.reservations import Reservations
from rdma_cni.extender.retry import Retrier
from rdma_cni.extender.settings import Settings
from rdma_cni.shared import nodestate, placement
from rdma_cni.shared.quote import quote

__all__ = ["Extender", "KeptScores", "error_answer"]

# The logger the verbs had in server.py before the split (log configurations name it).
log = logging.getLogger("rdma_cni.extender.server")

# Scores from a pod's filter, reused by its prioritize when it comes within this many seconds.
_SCORES_FRESH = 5.0
# Pods whose scores are kept, and the bytes they may hold: scores of a full-Node request are a dict per
# passing node, and a kept answer's are its verdicts (see _remember).
_SCORES_KEPT = 1024
_SCORES_BYTES = 32 * 1024 * 1024
# A node's share of what kept scores hold: a dict entry or a verdict, its name's share of a list.
_SCORE_NODE_BYTES = 120


def _key_bytes(key: tuple[Any, ...]) -> int:
    """Roughly what a demand's key holds (tuples of rates, names and flags)."""
    return 64 + sum(_key_bytes(part) if isinstance(part, tuple) else 48 for part in key)


def _ranks(names: list[str]) -> dict[str, int]:
    """Each name's first position in ``names`` (a repeated name keeps its first)."""
    return dict(zip(reversed(names), range(len(names) - 1, -1, -1), strict=True))


class KeptScores(NamedTuple):
    """What a pod's filter computed, kept for the prioritize that kube-scheduler sends next."""

    when: float  # time.monotonic() of the filter
    demand_key: tuple[tuple[int, int], ...]  # the demand it was computed for (the pod may change)
    score: Callable[[str], int]  # a node's score (0: does not fit)
    rank: dict[str, int]  # the nodes filter passed, by the policy's rank (0 best): prioritize's ties


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
        settings: Settings | None = None,
        retrier: Retrier | None = None,
    ) -> None:
        self.settings = settings = settings or Settings()
        self.decider = decider
        self.demands = demands
        self.reservations = reservations
        # The node annotation full-Node requests carry (not the pod's: that is Demands').
        self.annotation = nodestate.ANNOTATION
        self._cache_views = cache_views or dict
        # Bumped by the cache after every change of its views; None: lists are never reused.
        self._cache_generation: Callable[[], int | None] = cache_generation or (lambda: None)
        self._last_lookup: tuple[int, list[str], list[NodeView | None]] | None = None
        # The last list's names as a set, for lists of the same nodes in another order.
        self._last_set: frozenset[str] = frozenset()
        # Per pod uid: what its filter computed, for its prioritize.
        self._scores: Bounded[str, KeptScores] = Bounded(_SCORES_KEPT, _SCORES_BYTES)
        self.answers = Answers(reservations, self._judge, decider.max_state_age)
        self.resampler = Resampler(self._judge, settings.percentage_of_nodes_to_score)
        self.binder = Binder(client, decider, demands, reservations, self.view_of, settings.scheduler_names)
        # Makes kube-scheduler retry the pods filter refused once a node has room (None: nobody does).
        self.retrier = retrier
        self.ready = threading.Event()

    def routes(self) -> dict[str, Callable[[Any, Callable[[], bool]], Any]]:
        """The verbs by request path, for the HTTP server (an answer is a document or encoded bytes).

        Each is called with the request's document and a check that says whether its caller hung up.
        Filter and prioritize give up once it has (kube-scheduler stopped waiting: their work would
        only delay other pods' verbs); preempt and bind always finish (bind holds a reservation
        whose outcome must be known).
        """
        return {
            "/filter": lambda doc, gone: self.filter_encoded(doc, self.deadline(gone)),
            "/prioritize": lambda doc, gone: self.prioritize(doc, self.deadline(gone)),
            "/preempt": lambda doc, _gone: self.preempt(doc),
            "/bind": lambda doc, _gone: self.bind(doc),
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

    def _judge(
        self, demand: Demand, names: list[str], views: list[NodeView | None], deadline: Deadline | None = None
    ) -> list[Verdict]:
        """The verdict per node (``views`` in the order of ``names``): the hot loop of filter.

        Each node's is :meth:`Decider.admit_all`'s (the per-node rules, then the fit; bind's check
        runs the same for one node) with what each node holds now.
        """
        decider = self.decider
        held = list(map(self.reservations.held_on(), names))
        return decider.admit_all(demand, views, held, decider.now(), deadline or NEVER)

    def _decide(
        self, demand: Demand, names: list[str], views: list[NodeView | None], deadline: Deadline | None = None
    ) -> tuple[list[str], dict[str, str], dict[str, str], dict[str, int]]:
        """:meth:`_judge` split into passing nodes, failed ones, unresolvable ones and scores."""
        passing: list[str] = []
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        scores: dict[str, int] = {}
        for name, verdict in zip(names, self._judge(demand, names, views, deadline), strict=True):
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

    def deadline(self, gone: Callable[[], bool] | None = None) -> Deadline:
        """A deadline starting now: the share of kube-scheduler's httpTimeout a verb may spend deciding.

        ``gone``, when given, says whether the caller has already left (its connection closed).
        """
        return Deadline(self.settings.decision_timeout, gone)

    def filter(self, doc: Any, deadline: Deadline | None = None) -> dict[str, Any]:
        """ExtenderArgs -> ExtenderFilterResult."""
        answer = self.filter_encoded(doc, deadline)
        return json.loads(answer) if isinstance(answer, bytes) else answer

    def filter_encoded(self, doc: Any, deadline: Deadline | None = None) -> dict[str, Any] | bytes:
        """:meth:`filter` for the server: already encoded when it came from :class:`Answers`.

        ``deadline`` (default :meth:`deadline`, from now) is when its caller stops waiting: the server
        may hand in one that also knows when the connection closed.
        """
        deadline = deadline or self.deadline()
        try:
            return self._filter(doc, deadline)
        except Abandoned as exc:
            # Verdicts found so far stay cached: kube-scheduler's retry of the pod goes on from there.
            metrics.decided("filter", "error")
            log.warning("filter abandoned: %s", exc)
            return wire.filter_error(
                f"rdma-cni: deciding this pod took too long ({exc}); abandoned, kube-scheduler retries it"
            )

    def _filter(self, doc: Any, deadline: Deadline) -> dict[str, Any] | bytes:
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
            # Invalid on every node: said once, as the answer's Error, never once per node (see
            # docs/scheduling.md: kube-scheduler fails the attempt and shows it once in the pod's events).
            metrics.decided("filter", "error")
            return wire.filter_error(f"rdma-cni: {exc.msg}")
        except wire.WireError as exc:
            metrics.decided("filter", "error")
            return wire.filter_error(f"rdma-cni: bad ExtenderArgs: {exc}")
        if demand is None:
            metrics.decided("filter", "not_rdma")
            return wire.filter_result(args, args.names, {}, {})
        uid = wire.pod_identity(args.pod)[2]
        # Before anything is looked at: a refusal judged on views that changed meanwhile is judged again.
        mark = self.retrier.mark() if self.retrier is not None else (0, 0)
        if args.node_names is not None:
            # A new attempt for this pod: its hold from an earlier one must not count against it.
            self.reservations.release(uid)
            names, views = self._lookup(args.node_names)
            best = self.settings.best_nodes
            answer = self.answers.filter(demand, names, views, self.decider.now(), deadline, encoded=not best)
            passing = answer.passing
            if best and passing:
                # kube-scheduler reads the failed maps only to explain a pod that fits nowhere (its
                # event, preemption's candidates): with a node passed, they would be bytes both sides
                # pay for (hundreds of KB at 5,000 nodes) and nobody reads; nor is the rest encoded.
                if len(passing) > best:
                    passing = answer.best(best)
                body = answer.filter_body_passing(passing, failures=False)
            else:
                body = answer.filter_body
            if best and len(passing) == 1:
                # kube-scheduler takes a lone feasible node without asking prioritize: held now. Only
                # with --best-nodes, which says the answers are kube-scheduler's to act on as given.
                self._hold(args.pod, demand, passing[0])
            if passing:
                self.resampler.forget(uid)
                self._not_owed(uid)
            else:
                outside = self.resampler.outside(uid, demand, names, self._cache_views(), deadline)
                if outside is not None:
                    self._not_owed(uid)  # retried by kube-scheduler's backoff, not parked
                    return self._resample(names, *outside)
                if self.retrier is not None:
                    self.retrier.refused(args.pod, demand, names, mark)
            self._remember(uid, demand, answer.score, passing, len(answer.names))
            metrics.decided("filter", "fits" if passing else "no_fit")
            if log.isEnabledFor(logging.DEBUG):  # first: answer.failed is built per call
                self._log_detail(args.pod, answer.failed, self._cache_views())
            return body
        names, views = self._views(args)
        passing, failed, unresolvable, scores = self._decide(demand, names, views, deadline)
        self._remember(uid, demand, lambda node: scores.get(node, 0), passing, len(scores))
        if passing:
            self._not_owed(uid)
        elif self.retrier is not None:
            # Retried on the watched views' room (what bind decides on), never on these Nodes'.
            self.retrier.refused(args.pod, demand, names, mark)
        metrics.decided("filter", "fits" if passing else "no_fit")
        return wire.filter_result(args, passing, failed, unresolvable)

    def _not_owed(self, uid: str) -> None:
        """``uid`` passed a filter (or was bound): no retry is owed to it."""
        if self.retrier is not None:
            self.retrier.passed(uid)

    @staticmethod
    def _resample(sent: list[str], node: str, attempt: int, attempts: int) -> dict[str, Any]:
        """The Error that sends kube-scheduler back for other nodes (see :mod:`resample`)."""
        metrics.decided("filter", "resample")
        return wire.filter_error(
            f"rdma-cni: none of the {len(sent)} nodes kube-scheduler sampled fits this pod, but node "
            f"{quote(node)} outside them does: retried with kube-scheduler's next nodes "
            f"({attempt} of at most {attempts})"
        )

    def _hold(self, pod: dict[str, Any], demand: Demand, node: str) -> None:
        """Hold what ``pod`` would take on ``node`` (the watched cache's view) until its bind comes."""
        namespace, name, uid = wire.pod_identity(pod)
        view = self.view_of(node)
        if not uid or view is None or view.state is None:
            return
        try:
            use = self.decider.use(demand, view, self.reservations.extra(node, without=(uid,)))
        except placement.NoFit:
            return  # judged on a state that changed since: nothing to hold, bind decides
        self.reservations.hold(uid, namespace, name, node, use, view)

    def _lookup(self, names: list[str]) -> tuple[list[str], list[NodeView | None]]:
        """The cached views of ``names``, and ``names`` as a list equal to it.

        A scheduler that sends its nodes in a fixed order sends the same list pod after pod
        (kube-scheduler does not: see :meth:`Answers._reordered`). When the list
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
        if generation is not None and last is not None and len(names) == len(last[1]):
            # The same nodes in another order (kube-scheduler's usual case, see Answers._reordered):
            # answered in the last list's order, which kube-scheduler reads as a set. Hashing the new
            # names once for a set is all the new list costs; the views come from the last lookup.
            # A sample of a large cluster is another set pod after pod: its first name settles most.
            given = set(names) if names and names[0] in self._last_set else frozenset()
            if len(given) == len(names) and given == self._last_set:
                if last[0] == generation:
                    return last[1], last[2]
                names = last[1]
        views = list(map(self._cache_views().get, names))
        if generation is not None:
            if last is None or names is not last[1]:
                self._last_set = frozenset(names)
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
        passing: list[str],
        nodes: int,
    ) -> None:
        """Keep what ``uid``'s filter computed (``score`` knows ``nodes`` nodes; ``passing`` best first)
        for its prioritize."""
        # kube-scheduler asks prioritize for the same pod next: its scores are computed now. Weighed by
        # what the entry holds (uids and keys come from the pod, scores from the node list).
        if uid:
            rank = _ranks(passing)
            kept = KeptScores(time.monotonic(), demand.key, score, rank)
            weight = (
                _SCORE_NODE_BYTES * (nodes + 2 * len(passing)) + sys.getsizeof(uid) + _key_bytes(demand.key)
            )
            self._scores.put(uid, kept, weight)

    def prioritize(self, doc: Any, deadline: Deadline | None = None) -> bytes:
        """ExtenderArgs -> HostPriorityList, encoded; nodes that score 0 (that do not fit; all of them
        for a non-RDMA pod) are left out (see :func:`wire.priority_json`). Abandoned past ``deadline``
        (default :meth:`deadline`): then no node gets a score."""
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
            score, rank = kept.score, kept.rank
            scored = [(n, score(n)) for n in args.names]
            fits = [n for n in args.names if n in rank]
        else:
            names, views = self._views(args)
            try:
                passing, _, _, scores = self._decide(demand, names, views, deadline or self.deadline())
            except Abandoned as exc:
                log.warning("prioritize abandoned: %s", exc)
                return b"[]"
            rank = _ranks(passing)
            scored = [(n, scores.get(n, 0)) for n in names]
            fits = passing
        if not fits:
            return wire.priority_json(scored)
        return wire.priority_json(self._one_top(args, demand, scored, fits, rank))

    def _one_top(
        self,
        args: wire.FilterArgs,
        demand: Demand,
        scored: list[tuple[str, int]],
        fits: list[str],
        rank: dict[str, int],
    ) -> list[tuple[str, int]]:
        """``scored`` with one node alone on top, held for the pod (see docs/scheduling.md,
        "Holds"): the best-scored node that fits, ties by the policy's rank.

        The others keep their scores below it (capped one under), so kube-scheduler, whose
        extender weight makes one point of this score outweigh all of its own plugins (conf/),
        binds the pod where the hold is; ties would otherwise be broken at random, on a node
        that nothing holds.
        """
        scores = dict(scored)
        top = min(fits, key=lambda n: (-scores.get(n, 0), rank.get(n, len(rank))))
        best = max(1, scores.get(top, 0))
        if args.node_names is not None:
            self._hold(args.pod, demand, top)
        return [(n, best if n == top else min(s, best - 1)) for n, s in scored]

    def preempt(self, doc: Any) -> dict[str, Any]:
        """ExtenderPreemptionArgs -> ExtenderPreemptionResult (only nodes where eviction helps)."""
        try:
            args = wire.parse_preempt(doc)
            demand = self.demands.of_pod(args.pod)
        except (wire.WireError, InvalidPodRequest) as exc:
            log.warning("preempt: %s", wire.clip(str(getattr(exc, "msg", exc))))
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
        error = self.binder.bind(args)
        if not error:
            self._not_owed(args.pod_uid)
        return wire.bind_result(error)


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
