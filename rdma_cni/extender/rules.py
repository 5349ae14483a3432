"""Per-node admission rules: the one place for what the extender checks of a node beyond its PF states.

A verdict on a node's PF states is cached under their fingerprint (see
:mod:`rdma_cni.extender.decide`), so it may depend on nothing else. Anything
else about a node (whether its state is usable now, how many pods it has,
which ones) is a rule here, applied before that verdict on every path that
admits a pod to a node: filter and prioritize (in bulk,
:meth:`Decider.admit_all`), bind's check under its lock, preemption, the
``nodes --fits`` report (one node, :meth:`Decider.admit`, which is the bulk
path for one node). Both paths call the same :meth:`NodeRule.refuse` of the
same rule objects, so there is no second copy of a rule to forget.

A rule reads only the pod's demand, the node's view (its published state),
what the node holds beyond it (a :class:`Reserved`: per PF sums, and which
pods) and the time. Filter's kept answers (answers.py) re-judge a node when
its view or what it holds changes, and every node once the oldest state may
have gone stale; a rule reading anything else (labels, taints) needs those
answers told when it changes.

A new rule: a :class:`NodeRule` (``check`` for one node, or ``refuse`` for
many when per-node Python work must be avoided), and its entry in
:data:`RULES`, which builds it from the extender's settings (or None when
they turn it off). The rules apply in that order; a node's first refusal is
its verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from rdma_cni.extender.reservations import Reserved
from rdma_cni.extender.settings import Settings

if TYPE_CHECKING:
    from rdma_cni.extender.decide import NodeView
    from rdma_cni.extender.demand import Demand

__all__ = ["FUTURE_SKEW", "RULES", "NodeRule", "Refusal", "StateUsable", "node_rules", "pods"]

# A state stamped further ahead of the extender's clock than this is stale (with --max-state-age):
# a node whose clock runs ahead, and whose agent then died, must not look fresh for ever.
FUTURE_SKEW = 60.0


class Refusal(NamedTuple):
    """Why a rule refuses a node, and whether evicting pods there could change that."""

    reason: str
    # True: no preemption on this node can help (kube-scheduler then does not try it there).
    unresolvable: bool


class NodeRule:
    """One per-node admission rule (see the module docstring).

    A subclass writes :meth:`check` (one node, with a state) or, to avoid
    per-node Python work on filter's hot path, :meth:`refuse` (every node of
    a request at once). The bulk and the single path both call ``refuse``.
    """

    def check(self, demand: Demand, view: NodeView, held: Reserved | None, now: float) -> Refusal | None:
        """Why ``view``'s node cannot take ``demand`` (None: this rule admits it).

        ``view`` has a state (:class:`StateUsable`, the first rule, refused the others);
        ``held`` is what the node holds beyond it, None when nothing.
        """
        raise NotImplementedError

    def refuse(
        self,
        demand: Demand,
        views: Sequence[NodeView | None],
        held: Sequence[Reserved | None],
        now: float,
    ) -> Iterable[tuple[int, Refusal]]:
        """``(i, refusal)`` for each node ``i`` this rule refuses (``views[i]``, holding ``held[i]``)."""
        check = self.check
        for i, (view, extra) in enumerate(zip(views, held, strict=True)):
            if view is not None and view.state is not None:
                got = check(demand, view, extra, now)
                if got is not None:
                    yield i, got


class StateUsable(NodeRule):
    """The node has a valid published state, recent enough (with ``max_state_age``): always the first rule.

    Refusals are unresolvable: evicting pods changes nothing we know about the node.
    """

    def __init__(self, max_state_age: float | None) -> None:
        self.max_state_age = max_state_age

    def reason(self, view: NodeView | None, now: float) -> str:
        """Why no decision can be made for this node ("" when one can)."""
        if view is None:
            return "rdma-cni: node is not known to the extender yet"
        if view.problem:
            return view.problem
        if self.max_state_age is not None and view.updated - now > FUTURE_SKEW:
            return (
                f"rdma-cni: node state is stamped more than {FUTURE_SKEW:.0f} s in the future:"
                " is the node's clock right?"
            )
        if self.max_state_age is not None and now - view.updated > self.max_state_age:
            # No age in the text: it would differ per node and per second, so kube-scheduler's event
            # could not group it, and a kept answer (answers.py) would go out of date by itself.
            return (
                f"rdma-cni: node state is older than {self.max_state_age:.0f} s:"
                " is the rdma-cni node agent running?"
            )
        return ""

    def refuse(
        self,
        demand: Demand,
        views: Sequence[NodeView | None],
        held: Sequence[Reserved | None],
        now: float,
    ) -> list[tuple[int, Refusal]]:
        # Filter asks this of every node it is sent, pod after pod: one comprehension over the views
        # (a call per node would cost more than the rest of filter's lookups), reasons only for the
        # nodes refused, rarely any. The window is reason()'s, written as one chained comparison.
        if self.max_state_age is None:
            bad = [i for i, v in enumerate(views) if v is None or v.problem]
        else:
            low, high = now - self.max_state_age, now + FUTURE_SKEW
            bad = [i for i, v in enumerate(views) if v is None or v.problem or not low <= v.updated <= high]
        return [(i, Refusal(self.reason(views[i], now), True)) for i in bad]


# Every per-node rule, in the order they apply, each built from the extender's settings (None: off).
# StateUsable stays first: the rules after it may count on a node with a usable state.
RULES: list[Callable[[Settings], NodeRule | None]] = [
    lambda settings: StateUsable(settings.max_state_age),
]


def node_rules(settings: Settings) -> tuple[NodeRule, ...]:
    """The rules :data:`RULES` builds for ``settings``, in order."""
    return tuple(rule for rule in (make(settings) for make in RULES) if rule is not None)


def pods(view: NodeView, held: Reserved | None) -> frozenset[str]:
    """The uids of the pods on ``view``'s node: published, plus reserved or held beyond its state, less
    those counted as gone (preemption's victims). What a rule about pods counts."""
    if held is None:
        return view.uids
    return (view.uids - held.gone) | held.pods
