"""Pure decisions: which nodes a pod's demand fits, and how well, via :func:`placement.place`.

Many nodes publish the same state (identical hardware, same load), so a
verdict is computed once per (demand, state) and looked up for every other
node in that state: each node's view carries a small integer naming its PF
states (``fp``), interned when the annotation is decoded, never per request.
Interned ids are never reused, so a cached verdict stays right for its id.

A node that cannot hold the pod even when empty is *unresolvable*: no
preemption can help there. So is a node whose state is missing, invalid or
too old: evicting pods would not change what we know about it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from rdma_cni import nodestate, placement
from rdma_cni.extender.demand import Demand

__all__ = ["Decider", "NodeView", "Policy", "Verdict"]

Policy = Literal["binpack", "spread"]
MAX_SCORE = 10
# Distinct (demand, state) verdicts and annotation texts kept; cleared when exceeded.
_VERDICT_LIMIT = 200_000
_VIEW_LIMIT = 50_000

Extra = Mapping[str, tuple[int, int]]
_Fingerprint = tuple[tuple[placement.PfState, ...], int]


@dataclass(frozen=True, slots=True)
class NodeView:
    """A node's decoded state as decisions need it, or why it has none (``problem``)."""

    state: nodestate.NodeState | None
    problem: str
    updated: float
    fp: int
    empty_fp: int
    pfs: tuple[placement.PfState, ...]
    capacity_vfs: int
    uids: frozenset[str]


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a demand fits a state; if not, why and whether it could fit the empty node; its score."""

    fits: bool
    unresolvable: bool
    reason: str
    score: int
    # (PF name, VFs, min rate sum) the placement takes: what a reservation holds.
    use: tuple[tuple[str, int, int], ...] = ()
    # The placement search ran out of steps: nothing was proven.
    exhausted: bool = False


def _parse_time(text: str) -> float:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


class Decider:
    """Verdicts and scores for demands on node views, with the caches that make them cheap. Thread-safe."""

    def __init__(self, *, policy: Policy = "binpack", max_state_age: float | None = None) -> None:
        if policy not in ("binpack", "spread"):
            raise ValueError(f"unknown policy {policy!r}")
        self.policy = policy
        self.max_state_age = max_state_age
        self._lock = threading.Lock()
        self._ids: dict[_Fingerprint, int] = {}
        self._next_id = 1
        self._tables: dict[tuple[tuple[int, int], ...], dict[int, Verdict]] = {}
        self._entries = 0
        self._views: dict[str | None, NodeView] = {}

    # -- views -------------------------------------------------------------

    def _intern(self, fp: _Fingerprint) -> int:
        with self._lock:
            ident = self._ids.get(fp)
            if ident is None:
                if len(self._ids) >= _VERDICT_LIMIT:
                    self._ids.clear()
                ident = self._ids[fp] = self._next_id
                self._next_id += 1
            return ident

    def view(self, text: str | None) -> NodeView:
        """The view of an annotation value (None: absent), decoded once per distinct text."""
        got = self._views.get(text)
        if got is not None:
            return got
        view = self._build_view(text)
        with self._lock:
            if len(self._views) >= _VIEW_LIMIT:
                self._views.clear()
            self._views[text] = view
        return view

    def _build_view(self, text: str | None) -> NodeView:
        if text is None:
            problem = f"rdma-cni: node has no {nodestate.ANNOTATION} annotation (no rdma-cni node agent here)"
            return NodeView(None, problem, 0.0, 0, 0, (), 0, frozenset())
        try:
            state = nodestate.decode(text)
        except nodestate.NodeStateError as exc:
            return NodeView(None, f"rdma-cni: invalid node state: {exc}", 0.0, 0, 0, (), 0, frozenset())
        pfs = tuple(nodestate.pf_states(state))
        capacity = sum(pf.capacity_vfs for pf in state.pfs)
        empty = self._empty(state)
        return NodeView(
            state=state,
            problem="",
            updated=_parse_time(state.updated),
            fp=self._intern((pfs, capacity)),
            empty_fp=self._intern((empty, capacity)),
            pfs=pfs,
            capacity_vfs=capacity,
            uids=frozenset(a.uid for a in state.allocations if a.uid),
        )

    # -- verdicts ----------------------------------------------------------

    def unusable(self, view: NodeView | None, now: float) -> str:
        """Why no decision can be made for this node ("" when one can)."""
        if view is None:
            return "rdma-cni: node is not known to the extender yet"
        if view.problem:
            return view.problem
        if self.max_state_age is not None and now - view.updated > self.max_state_age:
            return (
                f"rdma-cni: node state is {now - view.updated:.0f} s old (limit {self.max_state_age:.0f} s):"
                " is the rdma-cni node agent running?"
            )
        return ""

    def table(self, demand: Demand) -> dict[int, Verdict]:
        """Final verdicts for ``demand`` by state id: filter's per-node lookup (one dict get, no hashing
        of the request). Missing entries are filled by :meth:`verdict`."""
        table = self._tables.get(demand.key)
        if table is None:
            with self._lock:
                table = self._tables.setdefault(demand.key, {})
        return table

    def verdict(self, demand: Demand, view: NodeView, extra: Extra | None = None) -> Verdict:
        """The verdict for a demand on a usable view, with reservations ``extra`` applied."""
        assert view.state is not None
        if extra:
            pfs = tuple(nodestate.pf_states(view.state, extra))
            return self._final(demand, pfs, self._intern((pfs, view.capacity_vfs)), view)
        return self._final(demand, view.pfs, view.fp, view)

    @staticmethod
    def _empty(state: nodestate.NodeState) -> tuple[placement.PfState, ...]:
        return tuple(
            placement.PfState(pf.name, pf.capacity_vfs, pf.capacity_tx_rate, 0, pf.numa_node)
            for pf in state.pfs
        )

    def _final(self, demand: Demand, pfs: tuple[placement.PfState, ...], fp: int, view: NodeView) -> Verdict:
        table = self.table(demand)
        got = table.get(fp)
        if got is not None:
            return got
        got = self._compute(demand, pfs, view.capacity_vfs)
        if not got.fits:
            if fp == view.empty_fp:
                empty = got
            else:
                assert view.state is not None
                empty = self._final(demand, self._empty(view.state), view.empty_fp, view)
            # A search that ran out of steps proved nothing: preemption may still help.
            unresolvable = not empty.fits and not empty.exhausted
            got = Verdict(False, unresolvable, got.reason, 0, exhausted=got.exhausted)
        with self._lock:
            self._entries += 1
            if self._entries > _VERDICT_LIMIT:
                # Tables handed out keep working; they are just no longer shared.
                self._tables.clear()
                self._entries = 0
            table[fp] = got
        return got

    def _compute(self, demand: Demand, pfs: tuple[placement.PfState, ...], capacity_vfs: int) -> Verdict:
        try:
            placed = placement.place(demand.requests, pfs)
        except placement.NoFit as exc:
            return Verdict(
                False, False, f"rdma-cni: {exc.message}", 0, exhausted=exc.reason == "search_limit"
            )
        use: dict[str, list[int]] = {}
        for req, pf in zip(demand.requests, placed.pfs, strict=True):
            slot = use.setdefault(pf, [0, 0])
            slot[0] += 1
            slot[1] += req.min_tx_rate
        uses = tuple(sorted((pf, vfs, rate) for pf, (vfs, rate) in use.items()))
        return Verdict(True, False, "", self._score(pfs, capacity_vfs, uses), uses)

    def _score(
        self, pfs: tuple[placement.PfState, ...], capacity_vfs: int, uses: tuple[tuple[str, int, int], ...]
    ) -> int:
        """0-10 from the node's utilization after placing the pod (VFs or bandwidth, the fuller).

        binpack scores fuller nodes higher (whole nodes stay free for large pods);
        spread scores emptier nodes higher.
        """
        taken = {pf: (vfs, rate) for pf, vfs, rate in uses}
        free_vfs = sum(pf.free_vfs for pf in pfs) - sum(v for v, _ in taken.values())
        vf_util = 1.0 - free_vfs / capacity_vfs if capacity_vfs else 1.0
        cap = used = 0
        for pf in pfs:
            if pf.capacity_mbps:
                cap += pf.capacity_mbps
                used += min(pf.capacity_mbps, pf.reserved_mbps + taken.get(pf.name, (0, 0))[1])
        util = max(vf_util, used / cap if cap else 0.0)
        util = min(1.0, max(0.0, util))
        score = round(util * MAX_SCORE)
        return score if self.policy == "binpack" else MAX_SCORE - score

    def now(self) -> float:
        """Wall-clock time, for state age (``updated`` is wall-clock)."""
        return time.time()
