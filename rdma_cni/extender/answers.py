"""Filter and prioritize answers per request shape, kept current by re-judging only what changed.

kube-scheduler asks about every node for every pod, and most pods of a
cluster ask for one of a few shapes (the same interfaces and rates). Between
two pods of a shape, only a few nodes change: a node agent republished, or a
bind reserved capacity. So the answer to the last request of each shape is
kept, with its parts already encoded, and a new request with the same node
list re-judges only the nodes whose view (compared by identity: the cache
builds a new view for every new annotation) or reservations changed since.
What it re-judges goes through the same per-node decision as a full pass
(:meth:`Extender._decide`), so an answer is always the one a full pass would
give. A full pass runs when the node list differs, when the reservations'
history was forgotten, or when the oldest node state may have gone stale.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]

from rdma_cni.extender.decide import NodeView
from rdma_cni.extender.demand import Demand
from rdma_cni.extender.reservations import Reservations

__all__ = ["Answer", "Answers"]

# Shapes kept; each holds a few structures the size of the node list.
_SHAPES_KEPT = 32

Judge = Callable[
    [Demand, list[str], list[NodeView | None]],
    tuple[list[str], dict[str, str], dict[str, str], dict[str, int]],
]


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def _fragment(name: str, score: int) -> str:
    return f'{{"Host":{encode_basestring_ascii(name)},"Score":{score}}}'


@dataclass(frozen=True, slots=True)
class Answer:
    """One filter answer: its parts (never changed once built) and both encoded bodies."""

    passing: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]
    scores: dict[str, int]
    filter_body: bytes
    prioritize_body: bytes


@dataclass(slots=True)
class _Shape:
    names: list[str]
    name_set: frozenset[str]
    views: list[NodeView | None]
    version: int
    deadline: float
    fragments: dict[str, str]
    names_json: str
    failed_json: str
    unresolvable_json: str
    answer: Answer


class Answers:
    """The last answer per request shape; :meth:`filter` brings it up to date. Thread-safe."""

    def __init__(self, reservations: Reservations, judge: Judge, max_state_age: float | None) -> None:
        self.reservations = reservations
        self.judge = judge
        self.max_state_age = max_state_age
        self._lock = threading.Lock()
        self._shapes: dict[tuple[tuple[int, int], ...], _Shape] = {}
        # How many nodes were judged, by full passes and by updates (tests and the benchmark read them).
        self.full_passes = 0
        self.rejudged = 0

    def filter(self, demand: Demand, names: list[str], views: list[NodeView | None], now: float) -> Answer:
        """The answer for ``demand`` on ``names`` (their ``views`` looked up now)."""
        with self._lock:
            shape = self._shapes.get(demand.key)
            version, touched = self.reservations.changed_since(shape.version if shape is not None else -1)
            if (
                shape is None
                or touched is None
                or now >= shape.deadline
                or shape.names != names
                or len(shape.name_set) != len(names)  # a repeated name: updates assume none
            ):
                shape = self._full(demand, names, views, version, now)
            elif touched or shape.views != views:
                self._update(shape, demand, names, views, version, touched, now)
            return shape.answer

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
        self, demand: Demand, names: list[str], views: list[NodeView | None], version: int, now: float
    ) -> _Shape:
        passing, failed, unresolvable, scores = self.judge(demand, names, views)
        self.full_passes += 1
        fragments = {name: _fragment(name, scores[name]) for name in passing}
        names_json = _dumps(passing)
        failed_json = _dumps(failed)
        unresolvable_json = _dumps(unresolvable)
        shape = _Shape(
            names=names,
            name_set=frozenset(names),
            views=views,
            version=version,
            deadline=self._deadline(views, now),
            fragments=fragments,
            names_json=names_json,
            failed_json=failed_json,
            unresolvable_json=unresolvable_json,
            answer=self._answer(
                passing, failed, unresolvable, scores, fragments, (names_json, failed_json, unresolvable_json)
            ),
        )
        if len(self._shapes) >= _SHAPES_KEPT:
            self._shapes.clear()
        self._shapes[demand.key] = shape
        return shape

    @staticmethod
    def _answer(
        passing: list[str],
        failed: dict[str, str],
        unresolvable: dict[str, str],
        scores: dict[str, int],
        fragments: dict[str, str],
        encoded: tuple[str, str, str],
    ) -> Answer:
        # The same bytes json.dumps would give for wire.filter_result's document.
        body = (
            f'{{"Nodes":null,"NodeNames":{encoded[0]},"FailedNodes":{encoded[1]},'
            f'"FailedAndUnresolvableNodes":{encoded[2]},"Error":""}}'
        )
        prioritize = "[" + ",".join(map(fragments.__getitem__, passing)) + "]"
        return Answer(passing, failed, unresolvable, scores, body.encode(), prioritize.encode())

    def _update(
        self,
        shape: _Shape,
        demand: Demand,
        names: list[str],
        views: list[NodeView | None],
        version: int,
        touched: set[str],
        now: float,
    ) -> None:
        changed = touched & shape.name_set
        if shape.views != views:  # in C, and true at once when every view is the same object
            changed.update(
                names[i]
                for i, (old, new) in enumerate(zip(shape.views, views, strict=True))
                if old is not new
            )
        index = {name: i for i, name in enumerate(names)} if len(changed) > 64 else None
        order = sorted(changed, key=index.__getitem__ if index else names.index)
        part_views = [views[index[n] if index else names.index(n)] for n in order]
        _, failed, unresolvable, scores = self.judge(demand, order, part_views)
        self.rejudged += len(order)
        old = shape.answer
        new_scores = dict(old.scores)
        new_failed = dict(old.failed)
        new_unresolvable = dict(old.unresolvable)
        joined = False
        left: list[str] = []
        for name in order:
            was_passing = new_scores.pop(name, None) is not None
            new_failed.pop(name, None)
            new_unresolvable.pop(name, None)
            if name in scores:
                new_scores[name] = scores[name]
                shape.fragments[name] = _fragment(name, scores[name])
                joined |= not was_passing
            else:
                shape.fragments.pop(name, None)
                if was_passing:
                    left.append(name)
                if name in failed:
                    new_failed[name] = failed[name]
                else:
                    new_unresolvable[name] = unresolvable[name]
        new_passing = old.passing
        if joined:
            new_passing = [name for name in names if name in new_scores]  # in request order
        elif left:
            # The usual change after a bind: a node fills up. list.remove runs in C.
            new_passing = list(old.passing)
            for name in left:
                new_passing.remove(name)
        if joined or left:
            shape.names_json = _dumps(new_passing)
        if new_failed != old.failed:
            shape.failed_json = _dumps(new_failed)
        if new_unresolvable != old.unresolvable:
            shape.unresolvable_json = _dumps(new_unresolvable)
        shape.answer = self._answer(
            new_passing,
            new_failed,
            new_unresolvable,
            new_scores,
            shape.fragments,
            (shape.names_json, shape.failed_json, shape.unresolvable_json),
        )
        shape.views = views
        shape.version = version
        shape.deadline = min(shape.deadline, self._deadline(part_views, now))
