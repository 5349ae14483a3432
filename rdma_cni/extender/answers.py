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
only per changed node. A request that reads the bodies only when no node
passes (``--best-nodes``) asks for none: its shape keeps verdicts only, and is
encoded the first time a request wants it so.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import compress
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from operator import attrgetter
from typing import NamedTuple

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
_UPDATED = attrgetter("updated")
_BRACKETS = (("[", "]"), ("{", "}"), ("{", "}"), ("[", "]"))

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


def _passing(names: list[str], ranks: list[int]) -> list[str]:
    """The names that passed (rank 0 or more), in order."""
    return list(compress(names, map((-1).__lt__, ranks)))


def _join(parts: list[str], open_: str, close: str) -> str:
    # Every fragment starts with a comma: drop the first one.
    return open_ + "".join(parts)[1:] + close


class Bodies(NamedTuple):
    """An answer encoded: the filter and prioritize bodies, and its two failed maps as JSON."""

    filter: bytes
    prioritize: bytes
    failed: str
    unresolvable: str


def _bodies(joined: list[str]) -> Bodies:
    # The same document wire.filter_result builds, encoded as json.dumps would.
    body = (
        f'{{"Nodes":null,"NodeNames":{joined[_PASSING]},"FailedNodes":{joined[_FAILED]},'
        f'"FailedAndUnresolvableNodes":{joined[_UNRESOLVABLE]},"Error":""}}'
    )
    return Bodies(body.encode(), joined[_PRIORITY].encode(), joined[_FAILED], joined[_UNRESOLVABLE])


def _encode(names: list[str], verdicts: list[Verdict]) -> tuple[tuple[list[str], ...], list[str]]:
    """Every node's fragments, per part, and each part joined."""
    columns = list(zip(*map(_fragments, names, verdicts), strict=True)) or [(), (), (), ()]
    parts = tuple(list(column) for column in columns)
    joined = [_join(part, open_, close) for part, (open_, close) in zip(parts, _BRACKETS, strict=True)]
    return parts, joined


@dataclass(frozen=True, slots=True)
class Answer:
    """One filter answer: the verdict per requested node (never changed once built) and its bodies.

    The bodies are encoded when first read, unless the answer was built with them: a filter that
    passes only the best nodes (``--best-nodes``) reads them only when no node passes.
    """

    names: list[str]
    index: dict[str, int]
    verdicts: list[Verdict]
    passing: list[str]
    # Per node: its score if it passed, else -1 (what :meth:`best` ranks by).
    ranks: list[int]
    # One cell: the bodies once encoded (an answer is frozen; its encoding is filled in once).
    encoded: list[Bodies | None] = field(default_factory=lambda: [None])

    def bodies(self) -> Bodies:
        """The answer encoded (see :class:`Bodies`)."""
        got = self.encoded[0]
        if got is None:
            # Two threads may both encode it: the same bytes either way.
            got = self.encoded[0] = _bodies(_encode(self.names, self.verdicts)[1])
        return got

    @property
    def filter_body(self) -> bytes:
        """The ExtenderFilterResult, encoded."""
        return self.bodies().filter

    @property
    def prioritize_body(self) -> bytes:
        """The HostPriorityList, encoded (nodes scoring 0 left out)."""
        return self.bodies().prioritize

    def score(self, name: str) -> int:
        """The node's score (0 when it did not pass or was not asked about)."""
        i = self.index.get(name)
        return 0 if i is None else self.verdicts[i].score

    def best(self, n: int) -> list[str]:
        """The ``n`` passing nodes the policy ranks first, best first: highest score, ties in the
        answer's order (a fixed order, so pods of a shape keep choosing the same node while it fits)."""
        ranks = self.ranks
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
        ``failures`` the failed maps are left empty too, and nothing else is encoded (see
        docs/scheduling.md, "The best nodes")."""
        names = ",".join(map(encode_basestring_ascii, passing))
        if failures:
            bodies = self.bodies()
            failed, unresolvable = bodies.failed, bodies.unresolvable
        else:
            failed = unresolvable = "{}"
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
    # Per part (_PASSING ...): one fragment per requested node, and the part joined; None until a
    # request of this shape wants its answer encoded (then kept up to date with the verdicts).
    parts: tuple[list[str], ...] | None
    joined: list[str] | None
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
        *,
        encoded: bool = True,
    ) -> Answer:
        """The answer for ``demand`` on ``names`` (their ``views`` looked up now).

        With ``encoded`` its bodies are ready, kept up to date node by node as verdicts change;
        without, they are encoded only if read (a filter passing its best nodes reads them only
        when none passes). Past ``deadline`` :class:`~rdma_cni.extender.decide.Abandoned` goes out
        and the kept answer is as it was: nodes are judged before anything kept changes.
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
                shape = self._full(demand, names, views, version, now, deadline, encoded)
            else:
                if encoded and shape.parts is None:
                    self._encode(shape)
                if touched or shape.views != views:
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
        # The oldest stamp still within the age (a view without a state has none: 0.0), in C.
        oldest = min(
            filter((now - self.max_state_age).__le__, map(_UPDATED, filter(None, views))), default=math.inf
        )
        return oldest + self.max_state_age

    def _full(
        self,
        demand: Demand,
        names: list[str],
        views: list[NodeView | None],
        version: int,
        now: float,
        deadline: Deadline | None,
        encoded: bool,
    ) -> _Shape:
        verdicts = self.judge(demand, names, views, deadline)
        self.full_passes += 1
        index = {name: i for i, name in enumerate(names)}
        ranks = _ranks(verdicts)
        shape = _Shape(
            names=names,
            index=index,
            views=views,
            version=version,
            deadline=self._deadline(views, now),
            verdicts=verdicts,
            ranks=ranks,
            parts=None,
            joined=None,
            answer=Answer(names, index, verdicts, _passing(names, ranks), ranks),
        )
        if encoded:
            self._encode(shape)
        self._shapes.put(demand.key, shape, _NODE_BYTES * len(names) + 2 * sum(map(len, names)))
        return shape

    @staticmethod
    def _encode(shape: _Shape) -> None:
        """Encode the shape's answer, and keep its fragments to update from now on."""
        shape.parts, shape.joined = _encode(shape.names, shape.verdicts)
        shape.answer.encoded[0] = _bodies(shape.joined)

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
        parts, joined = shape.parts, shape.joined
        dirty = [False] * 4
        changed_any = False
        for i, verdict in zip(order, judged, strict=True):
            if verdicts[i] == verdict:
                continue
            verdicts[i] = verdict
            changed_any = True
            rank = verdict.score if verdict.fits else -1
            if ranks[i] != rank:
                if ranks is shape.ranks:
                    ranks = list(ranks)  # the old answer keeps its own, as its verdicts
                ranks[i] = rank
            if parts is not None:
                for part, fragment in enumerate(_fragments(names[i], verdict)):
                    if parts[part][i] != fragment:
                        parts[part][i] = fragment
                        dirty[part] = True
        if changed_any:
            old = shape.answer
            passing = _passing(names, ranks) if ranks is not shape.ranks else old.passing
            answer = Answer(names, index, verdicts, passing, ranks)
            if parts is not None and joined is not None:
                for part, (open_, close) in enumerate(_BRACKETS):
                    if dirty[part]:
                        joined[part] = _join(parts[part], open_, close)
                answer.encoded[0] = _bodies(joined)
            shape.answer = answer
        shape.verdicts = verdicts
        shape.ranks = ranks
        shape.views = views
        shape.version = version
        shape.deadline = min(shape.deadline, self._deadline(part_views, now))
