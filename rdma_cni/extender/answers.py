"""Filter and prioritize answers per request shape, kept current by re-judging only what changed.

kube-scheduler asks about every node for every pod, and most pods of a
cluster ask for one of a few shapes (the same interfaces and rates). Between
two pods of a shape, only a few nodes change: a node agent republished, or a
bind reserved capacity. So the answer to the last request of each shape is
kept, with its parts already encoded, and a new request with the same nodes,
in any order (see :meth:`Answers._reordered`), re-judges only the nodes whose
view (compared by identity: the cache builds a new view for every new
annotation) or reservations changed since.
What it re-judges goes through the same per-node decision as a full pass
(:meth:`Extender._judge`), so an answer is always the one a full pass would
give. A full pass runs when the set of nodes differs, when the reservations'
history was forgotten, or when the oldest node state may have gone stale.

The encoded answer is kept as one JSON fragment per node and part, in the order
of the request that made the full pass (``,"name"`` in the passing list,
``,"name":"reason"`` in a failed map, ``,{"Host":"name","Score":7}`` in the
priorities; ``""`` where the node is not in that part, and in the priorities
where it scores 0: see
:func:`wire.priority_json`). Re-judging a node replaces its fragments; the
bodies are then C-level joins of those lists, so a request costs Python work
only per changed node.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]

from rdma_cni.extender.bounded import Bounded
from rdma_cni.extender.decide import Deadline, NodeView, Verdict
from rdma_cni.extender.demand import Demand
from rdma_cni.extender.reservations import Reservations
from rdma_cni.extender.wire import clip

__all__ = ["Answer", "Answers"]

# Shapes kept; each holds a few lists the size of the node list (~0.3 KB per node, and fragments as long
# as the names), so all kept shapes are bounded in (estimated) bytes as well: 32 shapes of 5,000 nodes
# of 64-byte names. A list heavier than that alone is answered, never kept.
_SHAPES_KEPT = 32
_SHAPES_BYTES = 64 * 1024 * 1024
_NODE_BYTES = 300
# The four encoded parts of an answer, by position in _Shape.parts.
_PASSING, _FAILED, _UNRESOLVABLE, _PRIORITY = range(4)

# (demand, names, views, deadline) -> verdicts: Extender._judge.
Judge = Callable[[Demand, list[str], list[NodeView | None], Deadline | None], list[Verdict]]


def _fragments(name: str, verdict: Verdict) -> tuple[str, str, str, str]:
    """The node's fragment in each part (see the module docstring)."""
    quoted = encode_basestring_ascii(name)
    if verdict.fits:
        priority = f',{{"Host":{quoted},"Score":{verdict.score}}}' if verdict.score else ""
        return "," + quoted, "", "", priority
    entry = f",{quoted}:{encode_basestring_ascii(clip(verdict.reason))}"
    if verdict.unresolvable:
        return "", "", entry, ""
    return "", entry, "", ""


def _ranks(verdicts: list[Verdict]) -> list[int]:
    """Per verdict: its score if the node passed, else -1."""
    return [v.score if v.fits else -1 for v in verdicts]


def _join(parts: list[str], open_: str, close: str) -> str:
    # Every fragment starts with a comma: drop the first one.
    return open_ + "".join(parts)[1:] + close


@dataclass(frozen=True, slots=True)
class Answer:
    """One filter answer: the verdict per requested node (never changed once built) and both bodies."""

    names: list[str]
    index: dict[str, int]
    verdicts: list[Verdict]
    passing: list[str]
    filter_body: bytes
    prioritize_body: bytes
    # The encoded FailedNodes and FailedAndUnresolvableNodes, for answers that pass fewer nodes.
    failed_json: str = "{}"
    unresolvable_json: str = "{}"
    # Per node: its score if it passed, else -1 (what :meth:`best` ranks by); None: from the verdicts.
    ranks: list[int] | None = None

    def score(self, name: str) -> int:
        """The node's score (0 when it did not pass or was not asked about)."""
        i = self.index.get(name)
        return 0 if i is None else self.verdicts[i].score

    def best(self, n: int) -> list[str]:
        """The ``n`` passing nodes the policy ranks first, best first: highest score, ties in the
        answer's order (a fixed order, so pods of a shape keep choosing the same node while it fits)."""
        ranks = self.ranks if self.ranks is not None else _ranks(self.verdicts)
        top = max(ranks, default=-1)
        if n == 1 and top >= 0:
            return [self.names[ranks.index(top)]]  # the usual case, in C
        out: list[str] = []
        for score in range(top, -1, -1):
            # One C-level pass per score, from the highest down, until n are found.
            out += compress(self.names, map(score.__eq__, ranks))
            if len(out) >= n:
                break
        return out[:n]

    def filter_body_passing(self, passing: list[str], failures: bool = True) -> bytes:
        """The filter answer passing only ``passing`` (some of :attr:`passing`); the nodes that fit but are
        left out are in neither failed map: kube-scheduler drops them without a status. Without
        ``failures`` the failed maps are left empty too (see docs/scheduling.md, "The best nodes")."""
        names = ",".join(map(encode_basestring_ascii, passing))
        failed, unresolvable = (self.failed_json, self.unresolvable_json) if failures else ("{}", "{}")
        return (
            f'{{"Nodes":null,"NodeNames":[{names}],"FailedNodes":{failed},'
            f'"FailedAndUnresolvableNodes":{unresolvable},"Error":""}}'
        ).encode()

    @property
    def failed(self) -> dict[str, str]:
        """FailedNodes: node -> reason, for nodes that are merely full."""
        return {
            n: v.reason
            for n, v in zip(self.names, self.verdicts, strict=True)
            if not v.fits and not v.unresolvable
        }

    @property
    def unresolvable(self) -> dict[str, str]:
        """FailedAndUnresolvableNodes: node -> reason."""
        return {n: v.reason for n, v in zip(self.names, self.verdicts, strict=True) if v.unresolvable}

    @property
    def scores(self) -> dict[str, int]:
        """Scores of the passing nodes."""
        return {n: v.score for n, v in zip(self.names, self.verdicts, strict=True) if v.fits}


@dataclass(slots=True)
class _Shape:
    names: list[str]
    index: dict[str, int]
    views: list[NodeView | None]
    version: int
    deadline: float
    verdicts: list[Verdict]
    ranks: list[int]
    # Per part (_PASSING ...): one fragment per requested node, and the part joined.
    parts: tuple[list[str], list[str], list[str], list[str]]
    joined: list[str]
    answer: Answer


class Answers:
    """The last answer per request shape; :meth:`filter` brings it up to date. Thread-safe."""

    def __init__(self, reservations: Reservations, judge: Judge, max_state_age: float | None) -> None:
        self.reservations = reservations
        self.judge = judge
        self.max_state_age = max_state_age
        self._lock = threading.Lock()
        self._shapes: Bounded[tuple[tuple[int, int], ...], _Shape] = Bounded(_SHAPES_KEPT, _SHAPES_BYTES)
        # How many nodes were judged, by full passes and by updates (tests and the benchmark read them).
        self.full_passes = 0
        self.rejudged = 0

    def filter(
        self,
        demand: Demand,
        names: list[str],
        views: list[NodeView | None],
        now: float,
        deadline: Deadline | None = None,
    ) -> Answer:
        """The answer for ``demand`` on ``names`` (their ``views`` looked up now).

        Past ``deadline`` :class:`~rdma_cni.extender.decide.Abandoned` goes out and the kept answer is
        as it was: nodes are judged before anything kept changes.
        """
        with self._lock:
            shape = self._shapes.get(demand.key)
            version, touched = self.reservations.changed_since(shape.version if shape is not None else -1)
            same_nodes = shape is not None and shape.names == names
            if shape is not None and not same_nodes:
                # The same nodes in another order (kube-scheduler's usual case) are the kept shape's
                # nodes: their views are put in its order and the kept answer goes on from there.
                reordered = self._reordered(shape, names, views)
                if reordered is not None:
                    names, views, same_nodes = shape.names, reordered, True
            if (
                shape is None
                or not same_nodes
                or touched is None
                or now >= shape.deadline
                or len(shape.index) != len(names)  # a repeated name: updates assume none
            ):
                shape = self._full(demand, names, views, version, now, deadline)
            elif touched or shape.views != views:
                self._update(shape, demand, views, version, touched, now, deadline)
            return shape.answer

    @staticmethod
    def _reordered(
        shape: _Shape, names: list[str], views: list[NodeView | None]
    ) -> list[NodeView | None] | None:
        """``views`` (of ``names``) in the order of ``shape.names``, when ``names`` holds exactly its
        nodes, each once; otherwise None.

        kube-scheduler lists the feasible nodes in the order its parallel filter goroutines finish
        (schedule_one.go appends them through an atomic counter), so the order changes pod after pod
        while the set does not. It reads the answer as sets: ``HTTPExtender.Filter`` looks each
        returned name up in a map of the nodes it sent (and refuses a name it did not send),
        ``FailedNodes`` and ``FailedAndUnresolvableNodes`` are maps, and prioritize scores are summed
        per host. So the kept answer, in the order it was first asked, answers any order of its
        nodes. All of this is C-level work over the list (a dict built, key views compared, a map).
        """
        if len(names) != len(shape.names):
            return None
        by_name = dict(zip(names, views, strict=True))
        # Equal key sets of equal size to the list: no name repeated and no name new.
        if len(by_name) != len(names) or by_name.keys() != shape.index.keys():
            return None
        return list(map(by_name.__getitem__, shape.names))

    def _deadline(self, views: list[NodeView | None], now: float) -> float:
        # The first moment a node judged usable now may turn stale; states only age.
        if self.max_state_age is None:
            return math.inf
        limit = self.max_state_age
        oldest = min(
            (v.updated for v in views if v is not None and v.state is not None and now - v.updated <= limit),
            default=math.inf,
        )
        return oldest + limit

    def _full(
        self,
        demand: Demand,
        names: list[str],
        views: list[NodeView | None],
        version: int,
        now: float,
        deadline: Deadline | None,
    ) -> _Shape:
        verdicts = self.judge(demand, names, views, deadline)
        self.full_passes += 1
        columns = list(zip(*map(_fragments, names, verdicts), strict=True)) or [(), (), (), ()]
        parts = tuple(list(column) for column in columns)
        joined = [
            _join(parts[_PASSING], "[", "]"),
            _join(parts[_FAILED], "{", "}"),
            _join(parts[_UNRESOLVABLE], "{", "}"),
            _join(parts[_PRIORITY], "[", "]"),
        ]
        index = {name: i for i, name in enumerate(names)}
        passing = list(compress(names, parts[_PASSING]))
        ranks = _ranks(verdicts)
        shape = _Shape(
            names=names,
            index=index,
            views=views,
            version=version,
            deadline=self._deadline(views, now),
            verdicts=verdicts,
            ranks=ranks,
            parts=parts,  # type: ignore[arg-type]
            joined=joined,
            answer=self._answer(names, index, verdicts, passing, joined, ranks),
        )
        self._shapes.put(demand.key, shape, _NODE_BYTES * len(names) + 2 * sum(map(len, names)))
        return shape

    @staticmethod
    def _answer(
        names: list[str],
        index: dict[str, int],
        verdicts: list[Verdict],
        passing: list[str],
        joined: list[str],
        ranks: list[int],
    ) -> Answer:
        # The same document wire.filter_result builds, encoded as json.dumps would.
        body = (
            f'{{"Nodes":null,"NodeNames":{joined[_PASSING]},"FailedNodes":{joined[_FAILED]},'
            f'"FailedAndUnresolvableNodes":{joined[_UNRESOLVABLE]},"Error":""}}'
        )
        return Answer(
            names,
            index,
            verdicts,
            passing,
            body.encode(),
            joined[_PRIORITY].encode(),
            joined[_FAILED],
            joined[_UNRESOLVABLE],
            ranks,
        )

    def _update(
        self,
        shape: _Shape,
        demand: Demand,
        views: list[NodeView | None],
        version: int,
        touched: set[str],
        now: float,
        deadline: Deadline | None,
    ) -> None:
        index = shape.index
        changed = {index[name] for name in touched if name in index}
        if shape.views != views:  # in C, and true at once when every view is the same object
            changed.update(
                i for i, (old, new) in enumerate(zip(shape.views, views, strict=True)) if old is not new
            )
        order = sorted(changed)
        names = shape.names
        part_views = [views[i] for i in order]
        judged = self.judge(demand, [names[i] for i in order], part_views, deadline)
        self.rejudged += len(order)
        verdicts = list(shape.verdicts)  # the old answer keeps its own
        ranks = shape.ranks
        parts = shape.parts
        dirty = [False] * 4
        for i, verdict in zip(order, judged, strict=True):
            if verdicts[i] == verdict:
                continue
            verdicts[i] = verdict
            rank = verdict.score if verdict.fits else -1
            if ranks[i] != rank:
                if ranks is shape.ranks:
                    ranks = list(ranks)  # the old answer keeps its own, as its verdicts
                ranks[i] = rank
            for part, fragment in enumerate(_fragments(names[i], verdict)):
                if parts[part][i] != fragment:
                    parts[part][i] = fragment
                    dirty[part] = True
        if dirty[_PASSING]:
            shape.joined[_PASSING] = _join(parts[_PASSING], "[", "]")
        if dirty[_FAILED]:
            shape.joined[_FAILED] = _join(parts[_FAILED], "{", "}")
        if dirty[_UNRESOLVABLE]:
            shape.joined[_UNRESOLVABLE] = _join(parts[_UNRESOLVABLE], "{", "}")
        if dirty[_PRIORITY]:
            shape.joined[_PRIORITY] = _join(parts[_PRIORITY], "[", "]")
        old = shape.answer
        passing = list(compress(names, parts[_PASSING])) if dirty[_PASSING] else old.passing
        if any(dirty) or ranks is not shape.ranks:
            shape.answer = self._answer(names, index, verdicts, passing, shape.joined, ranks)
        shape.verdicts = verdicts
        shape.ranks = ranks
        shape.views = views
        shape.version = version
        shape.deadline = min(shape.deadline, self._deadline(part_views, now))
