"""Pure decisions: which nodes a pod's demand fits, and how well, via :func:`placement.place`.

Many nodes publish the same state (identical hardware, same load), so a
verdict is computed once per (demand, state) and looked up for every other
node in that state: each node's view carries a small integer naming its PF
states (``fp``), interned when the annotation is decoded, never per request.
Interned ids are never reused, so a cached verdict stays right for its id.

A node that cannot hold the pod even when empty is *unresolvable*: no
preemption can help there. So is a node whose state is missing, invalid or
too old: evicting pods would not change what we know about it.

What a verdict is cached under, exactly: the demand's ``key`` (its
attachments' networks, rates, PF and rail names and ``different_pfs``, up to
the order of interfaces within an attachment) and the fingerprint ``fp`` of
(the PF states as placement sees them: name, free VFs, capacity, reserved
Mbit/s, NUMA node, rail; the node's VF capacity, for the score; the
networks' PF and rail lists). Nothing else: not the node's name, labels,
taints or pod count, not the time or the state's age, not who the pod is.
So a per-node rule that depends on anything outside that fingerprint must
never be folded into a cached verdict (every node in the same state would
share its answer): it is a rule of :mod:`rdma_cni.extender.rules`, which
:meth:`Decider.admit_all` (filter, in bulk) and :meth:`Decider.admit` (bind's
check under its lock, preemption: the same code for one node) apply before
the cache.

Work per request is bounded three ways. One pod's attachments on one node
state share one step budget (:data:`placement.DEFAULT_MAX_STEPS`, bind's
:data:`BIND_STEPS`), not one each; the cheap necessary conditions of the
whole pod run first, and a pod's trailing run of identical one-interface
attachments is judged as one (for identical interfaces any order of ADDs
fits exactly when one joint assignment does). And a :class:`Deadline` from
the verb is checked as verdicts are computed: past it, :class:`Abandoned`
ends the request and nothing half-decided is cached.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal, NamedTuple

from rdma_cni.extender import rules
from rdma_cni.extender.demand import Demand
from rdma_cni.extender.reservations import Reserved
from rdma_cni.extender.rules import FUTURE_SKEW
from rdma_cni.extender.settings import Settings
from rdma_cni.shared import nodestate, placement

__all__ = [
    "FUTURE_SKEW",
    "GONE_EVERY",
    "NEVER",
    "Abandoned",
    "Deadline",
    "Decider",
    "NodeView",
    "Policy",
    "Verdict",
    "cannot_fit",
    "greedy_fits",
]

Policy = Literal["binpack", "spread"]
MAX_SCORE = 10
# Bind decides for one node, like ADD: the same larger search budget as ADD's.
BIND_STEPS = 50_000
# How often a decision asks whether its caller hung up (see Deadline.check).
GONE_EVERY = 0.05
# Distinct (demand, state) verdicts and annotation texts kept; cleared when exceeded.
_VERDICT_LIMIT = 200_000
_VIEW_LIMIT = 50_000
# Placements use() keeps (each a key of a few PF states and its answer: well under a KB).
_USE_LIMIT = 4096
# ... and at most this many bytes of annotation texts (a view holds its state decoded, a few times more);
# a text longer than _VIEW_TEXT_MAX (a real one is a few KiB) is decoded for each request, never kept.
_VIEW_BYTES = 8 * 1024 * 1024
_VIEW_TEXT_MAX = 256 * 1024

Extra = Mapping[str, tuple[int, int]]


class Abandoned(Exception):
    """The request's :class:`Deadline` passed (or its caller left) before its verdicts were all found."""


class Deadline:
    """When the caller of a verb stops waiting: a time (monotonic clock) and, optionally, a check
    that says whether it has already gone (its connection closed)."""

    __slots__ = ("asked", "at", "gone", "seconds")

    def __init__(self, seconds: float = math.inf, gone: Callable[[], bool] | None = None) -> None:
        self.seconds = seconds
        now = time.monotonic()
        self.at = now + seconds
        self.gone = gone
        # When ``gone`` is next asked: it is a system call, which lets every other thread take the
        # interpreter first, so a filter asking it per placement waited on binds many times over
        # (docs/performance.md). A caller that left is noticed within GONE_EVERY of leaving.
        self.asked = now + GONE_EVERY

    def check(self) -> None:
        """Raise :class:`Abandoned` when the deadline has passed or the caller has gone (asked at most
        every :data:`GONE_EVERY` seconds)."""
        now = time.monotonic()
        if now >= self.at:
            raise Abandoned(f"no answer within {self.seconds:g} s")
        if self.gone is not None and now >= self.asked:
            self.asked = now + GONE_EVERY
            if self.gone():
                raise Abandoned(f"no answer within {self.seconds:g} s")


# No deadline: bind (one node, under its own budget), preempt's few nodes, start-up, tests.
NEVER = Deadline()
_Fingerprint = tuple[tuple[placement.PfState, ...], int, tuple[nodestate.Network, ...]]


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
    networks: tuple[nodestate.Network, ...] = ()


class Verdict(NamedTuple):
    """Whether a demand fits a state; if not, why and whether it could fit the empty node; its score.

    A tuple (built for thousands of nodes at a time; dataclass construction costs more).
    """

    fits: bool
    unresolvable: bool
    reason: str
    score: int
    # The placement search ran out of steps: nothing was proven.
    exhausted: bool = False


def _parse_time(text: str) -> float:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def greedy_fits(wants: Sequence[tuple[int, int]], pfs: Sequence[placement.PfState]) -> bool:
    """Whether best fit puts every ``(min, max)`` (largest first) on a PF, under placement's rules.

    True proves a fit (the assignment is one); False proves nothing. Rules, as in
    :mod:`rdma_cni.shared.placement`: one free VF per request; a cap (max) not above the
    PF's capacity; a min rate only on a PF of known capacity, within what is free.
    """
    if len(wants) == 1:
        # The common case, without building lists: some PF takes the one interface.
        low, high = wants[0]
        for pf in pfs:
            if pf.free_vfs:
                cap = pf.capacity_mbps
                if cap is None:
                    if not low:
                        return True
                elif high <= cap and (not low or low <= cap - pf.reserved_mbps):
                    return True
        return False
    vfs = [pf.free_vfs for pf in pfs]
    free = [pf.free_mbps for pf in pfs]
    caps = [pf.capacity_mbps for pf in pfs]
    for low, high in wants:
        best = -1
        best_left = 0
        for i, cap in enumerate(caps):
            if not vfs[i]:
                continue
            if cap is None:
                if low:
                    continue
                left = -1  # unknown capacity: the VF least useful to min-rate requests
            else:
                room: int = free[i]  # type: ignore[assignment]
                if high > cap or low > room:
                    continue
                left = room - low
            if best < 0 or left < best_left:
                best, best_left = i, left
        if best < 0:
            return False
        vfs[best] -= 1
        if caps[best] is not None:
            free[best] -= low  # type: ignore[operator]
    return True


def cannot_fit(demand: Demand, pfs: Sequence[placement.PfState]) -> str:
    """A short reason when a necessary condition of placement's rules fails, else "".

    Each condition is one :func:`placement.place` checks too, so a reason here
    always means placement finds no fit. The texts are short and name the
    demand's numbers, not the node's (but for a VF shortfall's few values):
    nodes failing the same way give the same text, which kube-scheduler's
    event counts once, and the answer stays small.
    """
    vfs = 0
    free_total = 0
    for pf in pfs:
        if pf.free_vfs:
            vfs += pf.free_vfs
            if pf.capacity_mbps is not None:
                free_total += pf.free_mbps  # type: ignore[operator]
    if vfs < len(demand.requests):
        return f"rdma-cni: needs {len(demand.requests)} free VFs, the node has {vfs}"
    for low, high in demand.distinct_wants:
        for pf in pfs:
            if not pf.free_vfs:
                continue
            cap = pf.capacity_mbps
            if cap is None:
                if not low:
                    break
            elif high <= cap and (not low or low <= cap - pf.reserved_mbps):
                break
        else:
            where = f" and capacity of at least {high} Mbit/s" if high else ""
            if low:
                return f"rdma-cni: needs {low} Mbit/s free on one PF with a free VF{where}"
            return f"rdma-cni: needs a PF with a free VF{where}"
    if demand.min_total > free_total:
        return f"rdma-cni: needs {demand.min_total} Mbit/s free in total on the PFs with free VFs"
    return ""


def network_pfs(
    pfs: Sequence[placement.PfState], networks: Sequence[nodestate.Network], network: str | None
) -> tuple[tuple[placement.PfState, ...], str]:
    """The PFs one attachment's ADD places on, with their rails, and a phrase naming them for reasons.

    A version 2 state lists each network's PFs and rails; a version 1 state,
    or a network the state does not list (its agent is not told of it), only
    the union of the node's PFs, without rails.
    """
    for net in networks:
        if net.name == network:
            by_name = {pf.name: pf for pf in pfs}
            own = tuple(
                by_name[name] if by_name[name].rail == rail else replace(by_name[name], rail=rail)
                for name, rail in zip(net.pfs, net.rails, strict=True)
                if name in by_name
            )
            return own, f" (on the PFs of network {network})"
    return tuple(pfs), f" (network {network})" if network is not None and networks else ""


Part = tuple[str | None, tuple[placement.Request, ...], bool]


def _trailing_run(parts: list[Part]) -> list[Part]:
    """``parts`` with its last run of identical one-interface attachments (no PF, no rail) as one.

    For identical interfaces, each PF takes as many as its free VFs and free
    bandwidth allow whichever PF each ADD picks, so k such ADDs in a row all
    fit exactly when k interfaces fit together: one check instead of k
    placements (the selection of one network 3,000 times is one check).
    Only the last run: an earlier run's choices shape what later ADDs find.
    """
    last = parts[-1]
    network, requests, _ = last
    if len(requests) != 1 or requests[0].pf is not None or requests[0].rail is not None:
        return parts
    start = len(parts) - 1
    while start > 0 and parts[start - 1][0] == network and parts[start - 1][1] == requests:
        start -= 1
    count = len(parts) - start
    if count == 1:
        return parts
    return [*parts[:start], (network, requests * count, False)]


def _filter_plan(demand: Demand) -> tuple[list[Part], Demand]:
    """The attachments filter judges in turn (the trailing run as one), and the last one as a demand
    of its own: built once per demand, which is judged on many node states."""
    got = demand.__dict__.get("_filter_plan")
    if got is None:
        parts = demand.attachments()
        if len(parts) > 1:
            parts = _trailing_run(parts)
        _, requests, different = parts[-1]
        got = (parts, Demand(requests, (), demand.source, (), (different,)))
        object.__setattr__(demand, "_filter_plan", got)
    return got


class Decider:
    """Verdicts and scores for demands on node views, with the caches that make them cheap. Thread-safe."""

    def __init__(
        self,
        *,
        policy: Policy = "binpack",
        max_state_age: float | None = None,
        settings: Settings | None = None,
    ) -> None:
        """``settings`` (the extender's, whole) gives the policy and the state age when present."""
        if settings is not None:
            policy, max_state_age = settings.policy, settings.max_state_age
        self.settings = settings or Settings(policy=policy, max_state_age=max_state_age)
        if policy not in ("binpack", "spread"):
            raise ValueError(f"unknown policy {policy!r}")
        self.policy = policy
        # The per-node rules, in order (rules.py): both admit paths apply exactly these.
        self.rules = rules.node_rules(self.settings)
        self._usable = rules.StateUsable(max_state_age)
        # Every passing verdict is one of these eleven.
        self._fits = [Verdict(True, False, "", score) for score in range(MAX_SCORE + 1)]
        self.max_state_age = max_state_age
        self._lock = threading.Lock()
        self._ids: dict[_Fingerprint, int] = {}
        self._next_id = 1
        self._tables: dict[tuple[Any, ...], dict[int, Verdict]] = {}
        self._entries = 0
        self._views: dict[str | None, NodeView] = {}
        self._view_bytes = 0
        # Per view (by id): the Reserved last applied to it, and the states and id that made.
        self._extra_states: dict[int, tuple[NodeView, Reserved, tuple[placement.PfState, ...], int]] = {}
        # What use() placed, by everything it places from (see use).
        self._uses: dict[tuple[Any, ...], tuple[tuple[str, int, int], ...]] = {}

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
        size = len(text) if text is not None else 0
        if size > _VIEW_TEXT_MAX:
            return view
        with self._lock:
            if len(self._views) >= _VIEW_LIMIT or self._view_bytes + size > _VIEW_BYTES:
                self._views.clear()
                self._view_bytes = 0
            self._views[text] = view
            self._view_bytes += size
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
            fp=self._intern((pfs, capacity, state.networks)),
            empty_fp=self._intern((empty, capacity, state.networks)),
            pfs=pfs,
            capacity_vfs=capacity,
            uids=frozenset(a.uid for a in state.allocations if a.uid),
            networks=state.networks,
        )

    # -- verdicts ----------------------------------------------------------

    def unusable(self, view: NodeView | None, now: float) -> str:
        """Why no decision can be made for this node ("" when one can): the first rule's reason."""
        return self._usable.reason(view, now)

    def admit(
        self,
        demand: Demand,
        view: NodeView | None,
        now: float,
        extra: Reserved | None = None,
        deadline: Deadline = NEVER,
    ) -> Verdict:
        """The per-node admission rule for one node: :meth:`admit_all` of one (bind's check under its
        lock, preemption, ``nodes --fits``). ``extra``: what the node holds beyond its state."""
        return self.admit_all(demand, (view,), (extra,), now, deadline)[0]

    def admit_all(
        self,
        demand: Demand,
        views: Sequence[NodeView | None],
        held: Sequence[Reserved | None],
        now: float,
        deadline: Deadline = NEVER,
    ) -> list[Verdict]:
        """The verdict of each node (``views[i]``, holding ``held[i]`` beyond its state, or None).

        First every rule of :attr:`rules` (rules.py; a node's first refusal is
        its verdict); then, for the nodes no rule refused, the verdict on their
        PF states with what they hold applied, cached by fingerprint. Cached
        verdicts are found in bulk: every node's for its state id is looked up
        at C speed, and only nodes holding something or whose state is new to
        this demand are judged one by one.
        """
        deadline.check()
        table = self.table(demand)
        # A missing view, or one without a state, has id 0, which no state is given: never found.
        out: list[Verdict | None] = list(map(table.get, [0 if v is None else v.fp for v in views]))
        refused: dict[int, Verdict] = {}
        for rule in self.rules:
            for i, refusal in rule.refuse(demand, views, held, now):
                if i not in refused:
                    refused[i] = Verdict(False, refusal.unresolvable, refusal.reason, 0)
        # One by one: nodes holding something (their states with it, kept per view: see
        # _with_extra) and nodes whose verdict is not cached yet.
        todo = [
            i
            for i, (verdict, extra) in enumerate(zip(out, held, strict=True))
            if verdict is None or extra is not None
        ]
        with_extra = self._extra_states.get
        slow = 0
        for i in todo:
            if i in refused:
                continue
            view, extra = views[i], held[i]
            assert view is not None  # no rule refused it: it has a usable state
            if extra is not None:
                kept = with_extra(id(view))
                verdict = table.get(kept[3]) if kept and kept[0] is view and kept[1] is extra else None
                if verdict is not None:
                    out[i] = verdict
                    continue
            slow += 1
            if not slow & 255:  # the deadline, every 256 nodes judged one by one
                deadline.check()
            out[i] = (
                self.verdict(demand, view, extra, table, deadline)
                if extra
                else self.fill(demand, view, table, deadline)
            )
        for i, verdict in refused.items():
            out[i] = verdict
        return out  # type: ignore[return-value]

    def table(self, demand: Demand) -> dict[int, Verdict]:
        """Final verdicts for ``demand`` by state id: filter's per-node lookup (one dict get, no hashing
        of the request). Missing entries are filled by :meth:`verdict`."""
        table = self._tables.get(demand.key)
        if table is None:
            with self._lock:
                table = self._tables.setdefault(demand.key, {})
        return table

    def verdict(
        self,
        demand: Demand,
        view: NodeView,
        extra: Extra | None = None,
        table: dict[int, Verdict] | None = None,
        deadline: Deadline = NEVER,
    ) -> Verdict:
        """The verdict for a demand on a usable view's PF states, with reservations ``extra`` applied.

        Only what the fingerprint covers: per-node rules are rules.py's, applied first by
        :meth:`admit_all`.
        ``table`` is :meth:`table` of the demand, when the caller already has it.
        """
        assert view.state is not None
        if extra:
            pfs, fp = self._with_extra(view, extra)
            return self._final(demand, pfs, fp, view, table, deadline)
        return self._final(demand, view.pfs, view.fp, view, table, deadline)

    def _with_extra(self, view: NodeView, extra: Extra) -> tuple[tuple[placement.PfState, ...], int]:
        """The view's PF states with ``extra`` applied, and their id.

        A bind changes one node's reservations, and then every request shape
        judges that node again: for what filter looks up (a :class:`Reserved`,
        the same object until the node's reservations change), they share these
        states, one entry per view, found by identity without hashing what it holds.
        Any other mapping (bind's and preempt's, one-off) is applied afresh.
        """
        kept = getattr(extra, "kept", False)
        if kept:
            got = self._extra_states.get(id(view))
            # The view and the Reserved are kept in the value: neither id is reused while it is there.
            if got is not None and got[0] is view and got[1] is extra:
                return got[2], got[3]
        assert view.state is not None
        pfs = tuple(nodestate.pf_states(view.state, extra))
        fp = self._intern((pfs, view.capacity_vfs, view.state.networks))
        if kept:
            with self._lock:
                if len(self._extra_states) >= _VIEW_LIMIT:
                    self._extra_states.clear()
                self._extra_states[id(view)] = (view, extra, pfs, fp)  # type: ignore[assignment]
        return pfs, fp

    @staticmethod
    def _empty(state: nodestate.NodeState) -> tuple[placement.PfState, ...]:
        # The published state's one conversion (nodestate.pf_state), as if no pod held anything.
        return tuple(nodestate.pf_state(pf, empty=True) for pf in state.pfs)

    def fill(
        self, demand: Demand, view: NodeView, table: dict[int, Verdict], deadline: Deadline = NEVER
    ) -> Verdict:
        """:meth:`verdict` without reservations, for filter's first look at a state (its hot path)."""
        pfs = view.pfs
        if demand.simple and (not demand.networks or not view.networks) and greedy_fits(demand.wants, pfs):
            got = self._fits[self._score(pfs, view.capacity_vfs, demand)]
            self._entries += 1
            table[view.fp] = got
            return got
        return self._final(demand, pfs, view.fp, view, table, deadline)

    def _final(
        self,
        demand: Demand,
        pfs: tuple[placement.PfState, ...],
        fp: int,
        view: NodeView,
        table: dict[int, Verdict] | None = None,
        deadline: Deadline = NEVER,
    ) -> Verdict:
        if table is None:
            table = self.table(demand)
        got = table.get(fp)
        if got is not None:
            return got
        got = self._compute(demand, pfs, view.capacity_vfs, view.networks, deadline)
        if not got.fits:
            if fp == view.empty_fp:
                empty = got
            else:
                assert view.state is not None
                # Few distinct empty states: look the verdict up before building the state.
                empty = table.get(view.empty_fp) or self._final(
                    demand, self._empty(view.state), view.empty_fp, view, table, deadline
                )
            # A search that ran out of steps proved nothing: preemption may still help.
            unresolvable = not empty.fits and not empty.exhausted
            got = Verdict(False, unresolvable, got.reason, 0, exhausted=got.exhausted)
        # Counted without the lock: an approximate bound is enough. Tables handed out
        # keep working after a clear; they are just no longer shared.
        self._entries += 1
        if self._entries > _VERDICT_LIMIT:
            self._entries = 0
            self._tables.clear()
        table[fp] = got
        return got

    def _compute(
        self,
        demand: Demand,
        pfs: tuple[placement.PfState, ...],
        capacity_vfs: int,
        networks: tuple[nodestate.Network, ...] = (),
        deadline: Deadline = NEVER,
    ) -> Verdict:
        got = self._attach_all(demand, pfs, networks, None, deadline)
        return got or self._fits[self._score(pfs, capacity_vfs, demand)]

    def _attach_all(
        self,
        demand: Demand,
        pfs: Sequence[placement.PfState],
        networks: Sequence[nodestate.Network],
        use: dict[str, list[int]] | None,
        deadline: Deadline = NEVER,
    ) -> Verdict | None:
        """Judge the pod's attachments as its ADDs run: one after the other, each on its network's PFs.

        Each ADD takes what placement chooses on what the ones before it
        left, so this is exactly whether every ADD succeeds (on the published
        state), not whether some joint assignment exists. All of them share
        one step budget. With ``use`` (bind) it collects per PF the VFs and
        min rates taken, searches with bind's budget and lets
        :class:`placement.NoFit` out; else it returns the failing verdict or None.
        """
        parts = demand.attachments()
        budget = BIND_STEPS if use is not None else placement.DEFAULT_MAX_STEPS
        last: Demand | None = None
        if use is None:
            parts, last = _filter_plan(demand)
        if use is None and len(demand.attachments()) > 1:
            # The whole pod's necessary conditions on all the node's PFs (each ADD has a subset of
            # them): a pod asking for more than a node has fails here in one pass, however many
            # attachments it has. Its last identical ones are then one check (see _trailing_run).
            reason = cannot_fit(demand, pfs)
            if reason:
                return Verdict(False, False, reason, 0)
        state = {pf.name: pf for pf in pfs}
        for k, (network, requests, different) in enumerate(parts):
            deadline.check()
            sub, where = network_pfs(tuple(state.values()), networks, network)
            if last is not None and k == len(parts) - 1:
                # The last ADD leaves nothing to the next: only whether it fits, cheap proofs first.
                got = self._misfit(last, sub, budget)
                return got._replace(reason=f"{got.reason}{where}") if got is not None else None
            try:
                # What earlier attachments left of the budget; at least one step, so that an
                # exhausted budget ends in placement's own "search_limit" answer.
                placed = placement.place(requests, sub, max_steps=max(1, budget), different_pfs=different)
            except placement.NoFit as exc:
                if use is not None:
                    raise
                return self._refused(exc, sub, where)
            budget -= placed.steps
            for req, name in zip(requests, placed.pfs, strict=True):
                pf = state[name]
                state[name] = replace(
                    pf, free_vfs=pf.free_vfs - 1, reserved_mbps=pf.reserved_mbps + req.min_tx_rate
                )
                if use is not None:
                    slot = use.setdefault(name, [0, 0])
                    slot[0] += 1
                    slot[1] += req.min_tx_rate
        return None

    @staticmethod
    def _refused(exc: placement.NoFit, pfs: Sequence[placement.PfState], where: str = "") -> Verdict:
        # The free-capacity summary differs per node: it goes to the log (see
        # Extender), not into the reason, so that reasons group.
        text = exc.message.removesuffix(f" ({placement.free_summary(pfs)})")
        return Verdict(False, False, f"rdma-cni: {text}{where}", 0, exhausted=exc.reason == "search_limit")

    def _misfit(
        self, demand: Demand, pfs: tuple[placement.PfState, ...], budget: int = placement.DEFAULT_MAX_STEPS
    ) -> Verdict | None:
        """The failing verdict when ``demand`` (one attachment) does not fit on ``pfs``, else None."""
        # Most verdicts are "fits" on a node with room: a greedy assignment that respects every
        # rule proves it in microseconds (placement is exact, so ADD finds a fit too); it knows
        # rates only, so not for constrained requests. Then cheap necessary conditions (true of
        # constrained requests too: constraints only take PFs away) prove most misfits;
        # placement searches only what is left.
        if demand.simple and greedy_fits(demand.wants, pfs):
            return None
        reason = cannot_fit(demand, pfs)
        if reason:
            return Verdict(False, False, reason, 0)
        try:
            placement.place(
                demand.requests, pfs, max_steps=max(1, budget), different_pfs=any(demand.different_pfs)
            )
        except placement.NoFit as exc:
            return self._refused(exc, pfs)
        return None

    def use(
        self, demand: Demand, view: NodeView, extra: Extra | None = None
    ) -> tuple[tuple[str, int, int], ...]:
        """(PF, VFs, min rate sum) per PF that placement picks for ``demand``: what a reservation holds.

        The attachments are placed as their ADDs will place them (see
        :meth:`_attach_all`). Raises :class:`placement.NoFit` when it does not
        fit (bind checks the verdict first).
        """
        assert view.state is not None
        pfs = tuple(nodestate.pf_states(view.state, extra)) if extra else view.pfs
        # Placement is a function of the requests in their order (not only the demand's key, which
        # is up to order), the PF states and the networks, and the same ones come back pod after
        # pod: filter's hold places the pod on the node it passes once per filter (a tenth of the
        # interpreter's time at 5,000 nodes, docs/performance.md), and binpack sends pods of one shape
        # to nodes in the same states. A NoFit is not kept (bind's rare refusal).
        key = (demand.requests, demand.networks, demand.different_pfs, pfs, view.networks)
        got = self._uses.get(key)
        if got is not None:
            return got
        use: dict[str, list[int]] = {}
        self._attach_all(demand, pfs, view.networks, use)
        got = tuple(sorted((pf, vfs, rate) for pf, (vfs, rate) in use.items()))
        if len(self._uses) >= _USE_LIMIT:
            self._uses.clear()  # a bound, not an eviction order: the next ones fill it again
        self._uses[key] = got
        return got

    def _score(self, pfs: tuple[placement.PfState, ...], capacity_vfs: int, demand: Demand) -> int:
        """0-10 from the node's utilization after placing the pod (VFs or bandwidth, the fuller).

        binpack scores fuller nodes higher (whole nodes stay free for large pods);
        spread scores emptier nodes higher. Where the pod's interfaces go does not
        change the node's totals: every min rate fits in its PF's free bandwidth.
        """
        free_vfs = -len(demand.requests)
        cap = 0
        used = demand.min_total
        for pf in pfs:
            free_vfs += pf.free_vfs
            total = pf.capacity_mbps
            if total:
                cap += total
                used += total if pf.reserved_mbps > total else pf.reserved_mbps
        vf_util = 1.0 - free_vfs / capacity_vfs if capacity_vfs else 1.0
        util = max(vf_util, used / cap if cap else 0.0)
        score = round(min(1.0, max(0.0, util)) * MAX_SCORE)
        return score if self.policy == "binpack" else MAX_SCORE - score

    def now(self) -> float:
        """Wall-clock time, for state age (``updated`` is wall-clock)."""
        return time.time()
