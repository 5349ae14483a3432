"""Decide which physical function (PF) each RDMA interface of a pod goes on.

Pure computation, standard library only: the CNI plugin calls :func:`place` on
ADD and the scheduler extender imports this same module to filter nodes, so the
two can never disagree about what fits.

Model
-----
A pod asks for interfaces, each a :class:`Request` with ``min_tx_rate`` (a
bandwidth reservation) and ``max_tx_rate`` (a cap, 0 = no cap), in Mbit/s. The
node offers PFs (:class:`PfState`), each with free VFs, a link capacity (None
when unknown) and bandwidth already reserved by other pods. Putting a request
on a PF takes one free VF and reserves its min rate there; the reservations on
a PF never exceed its capacity. A cap may not exceed the PF's capacity. A PF of
unknown capacity takes only requests without a min rate (there is nothing to
reserve against), whatever their cap. A PF whose existing reservations already
exceed its capacity (the link renegotiated down) has nothing left to reserve
but still takes requests without a min rate, since those add no reservation.

Policy
------
Among the placements that fit, the one returned is chosen so the node stays
useful for later pods:

* Interfaces with a min rate go, largest first, on the PF with the least free
  bandwidth left after the reservation (best fit). Packing reservations onto
  already busy PFs keeps whole PFs free for the next large request.
* Ties in leftover bandwidth go first to a PF on ``preferred_numa`` (the pod's
  NUMA node; locality is free here), then to a PF this pod does not use yet
  (spreading the pod's interfaces is free here), then by PF name.
* Interfaces without a min rate only consume a VF, so they take the VF that is
  least useful to future min-rate requests: a PF of unknown capacity first,
  then the PF with the least free bandwidth, then the lowest capacity; the
  same NUMA / spreading / name tie-breaks follow.

``policy="numa_first"`` puts NUMA locality before everything else instead, for
callers that value locality over packing.

These rules order the search, so the placement returned is the first one the
search meets; usually that is plain best fit. Only when the inputs are so
tight that best fit has to backtrack a lot does the answer come from the bin
completion search (see below), which prefers the fullest fillings but follows
the other preferences only loosely (NUMA first, then name, within a PF class).

Algorithm
---------
Exact: when some assignment fits, one is returned. Only the min-rate requests
need a search (bin packing with VF counts and per-PF cap limits):

1. Cheap necessary conditions first, each with its own :class:`NoFit` reason:
   enough VFs in total; Hall's condition on VF counts (a cap admits exactly
   the PFs of capacity at least the cap, so these sets are nested and one
   check per distinct capacity suffices); every request fits alone on some
   PF; total bandwidth.
2. Depth-first search over the min-rate requests by decreasing min rate,
   candidate PFs in policy order. Its first descent is plain
   best-fit-decreasing and returns at once when it succeeds, the usual case.
   When it first has to backtrack, a stronger bound is tried once: a
   Martello-Toth L2 style dual-feasible-function bound, generalised to PFs of
   different sizes and folding in VF counts (see ``dff_bound_holds``). PFs
   in the same state are tried once per node, equal requests take PFs in a
   fixed order, a bound on what the PFs can still take prunes, and failed
   states are remembered. This search gets the first 64 steps.
3. Whatever it leaves open goes to a bin completion search (after Korf),
   which fills one PF at a time and closes it. A PF only gets undominated
   fillings: no remaining request fits beside them, and no remaining request
   at least as large (and with a cap level at least as high) fits in place of
   one of its requests; any fit can be rearranged into one that uses such a
   filling. At each node it branches either on one PF (the fillings of the
   tightest PF class) or on where the largest remaining request goes (every
   PF class and filling containing it), whichever has fewer children, and
   tries the fullest fillings first. When it branches on the largest
   request, a filling is not tried on a PF if it also fits another open PF
   that the first dominates (no more bandwidth, VFs or level): swapping the
   two PFs' contents turns any fit of the first kind into one of the second.
   PFs with equal (free bandwidth, VFs, level) are one class, and failed
   (requests left, PFs left) states are remembered. Each node checks: VFs
   and bandwidth per open PF (a PF with too few VFs to be filled shares the
   largest requests with the others like it); waste (a PF can hold at most
   its best sum of at most its VFs' worth of remaining requests, found by a
   small branch and bound, reused from the parent while its requests are
   still left, and computed only as far as the decision needs); a crowding
   bound (the PFs outside a set hold at most their VFs in requests, so the
   set gets at least the rest, at least the weight of that many smallest
   requests); the L2 bound over the open PFs; and Hall's condition on cap
   levels. What the bounds leave over, the slack, also limits the fillings
   tried next: in a fit a PF wastes at most its own waste bound plus the
   slack, so fillings that leave more room are not children at all. Requests
   without a min rate join as size-0 items only when some cap rules PFs out
   for them.
4. Both stages are exact, so finishing either one without a fit proves there
   is none; only the step budget can stop them early.
5. Requests without a min rate need only a VF on a PF whose capacity reaches
   their cap (or of unknown capacity). Those sets are nested, so the Hall
   condition kept during the search is exactly their feasibility, and
   assigning them afterwards, most restrictive cap first, never fails.

Step budget
-----------
Bin packing is NP-hard: no exact method is known that stays within a fixed
time on every input. So the search has a budget of ``max_steps`` steps
(default :data:`DEFAULT_MAX_STEPS`), and a step is weighted to cost about
the same time wherever it is spent (a node of the item-by-item search is
one step; see ``_NODE_STEPS`` for the bin completion search). A count keeps
the answer deterministic, a clock would not. A run that spends the whole
default budget took 8-9 ms on a slow 2-core virtual machine (single runs
there occasionally take longer).

Easy and clearly infeasible inputs take a few dozen steps, including the
adversarial ones that defeat plain backtracking (many identical PFs,
bandwidth that fits in total but not PF by PF). Every input of the
benchmark's families is decided within the default budget but for the
tightest generated bin packing: 16 PFs of mixed speeds with 1-4 VFs each
and 32 requests at 94-98 % load. Of 6,100 such inputs, 11 need more (1,030
to 16,590 steps; six of them fit), and so do 1 of 3,300 inputs whose VFs
and bandwidth are both nearly used up. Then :func:`place` raises
:class:`NoFit` with reason ``"search_limit"``: nothing was found and
nothing was proven. That answer is conservative (nothing is over-reserved)
and distinguishable from a proof; ``max_steps=None`` searches to the end,
and the CNI plugin, which decides for one node under its lock, gives the
search 50 times the default.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Literal

__all__ = [
    "DEFAULT_MAX_STEPS",
    "NoFit",
    "PfState",
    "Placement",
    "Policy",
    "Request",
    "free_summary",
    "place",
]

Policy = Literal["best_fit", "numa_first"]

# About 10 ms of search on a slow server core. See "Step budget".
DEFAULT_MAX_STEPS = 1000


def _is_int(value: object) -> bool:
    # bool is an int subclass; True VFs would be a caller bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{what} must not be negative, got {value}")


def _check_label(value: object, what: str) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{what} must be a non-empty string or None, got {value!r}")


def _check_request(req: object) -> None:
    if not isinstance(req, Request):
        raise ValueError(f"expected a Request, got {req!r}")
    _check_count(req.min_tx_rate, "min_tx_rate")
    _check_count(req.max_tx_rate, "max_tx_rate")
    if req.max_tx_rate and req.max_tx_rate < req.min_tx_rate:
        raise ValueError(
            f"max_tx_rate {req.max_tx_rate} is below min_tx_rate {req.min_tx_rate} (use 0 for no cap)"
        )
    _check_label(req.pf, "pf")
    _check_label(req.rail, "rail")
    if req.pf is not None and req.rail is not None:
        raise ValueError(f"a request names a PF ({req.pf!r}) or a rail ({req.rail!r}), not both")


def _check_pf(pf: object) -> None:
    if not isinstance(pf, PfState):
        raise ValueError(f"expected a PfState, got {pf!r}")
    if not isinstance(pf.name, str) or not pf.name:
        raise ValueError(f"PF name must be a non-empty string, got {pf.name!r}")
    _check_count(pf.free_vfs, f"{pf.name}: free_vfs")
    if pf.capacity_mbps is not None:
        _check_count(pf.capacity_mbps, f"{pf.name}: capacity_mbps")
    _check_count(pf.reserved_mbps, f"{pf.name}: reserved_mbps")
    if pf.numa_node is not None and not _is_int(pf.numa_node):
        raise ValueError(f"{pf.name}: numa_node must be an integer or None, got {pf.numa_node!r}")
    _check_label(pf.rail, f"{pf.name}: rail")


@dataclass(frozen=True)
class Request:
    """One requested interface: ``min_tx_rate`` is reserved, ``max_tx_rate`` caps (0 = no cap); Mbit/s.

    ``pf`` (a PF name) or ``rail`` (a PF's rail label), at most one of them,
    restricts the PFs it may go on; see "Constraints".
    """

    min_tx_rate: int = 0
    max_tx_rate: int = 0
    pf: str | None = None
    rail: str | None = None

    def __post_init__(self) -> None:
        _check_request(self)


@dataclass(frozen=True)
class PfState:
    """What a PF has free: VFs, link capacity (None = unknown) and bandwidth already reserved.

    ``rail`` is the operator's label for the PF in the network's PF list
    (None: no rail); requests naming a rail go only on PFs with that label.
    """

    name: str
    free_vfs: int
    capacity_mbps: int | None
    reserved_mbps: int = 0
    numa_node: int | None = None
    rail: str | None = None

    def __post_init__(self) -> None:
        _check_pf(self)

    @property
    def free_mbps(self) -> int | None:
        """Bandwidth still reservable (never negative), or None when the capacity is unknown."""
        if self.capacity_mbps is None:
            return None
        return max(0, self.capacity_mbps - self.reserved_mbps)


@dataclass(frozen=True)
class Placement:
    """The chosen PF name for each request, in request order, and the search steps spent."""

    pfs: tuple[str, ...]
    steps: int = 0


class NoFit(Exception):
    """No assignment of the requests to PFs fits; the message says what was asked and what is free.

    ``reason`` is one of ``"vfs"`` (too few free VFs in total), ``"unknown_capacity"``
    (min-rate requests but only PFs of unknown capacity have VFs for them),
    ``"max_rate"`` (too few VFs on PFs whose capacity reaches the requested
    caps), ``"bandwidth"`` (the min rates cannot be arranged on the PFs) or
    ``"search_limit"`` (the step budget ran out before an answer) or
    ``"constraint"`` (a request's ``pf`` or ``rail`` names no PF given, or
    leaves a request no PF it may use).
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        requested: tuple[Request, ...],
        free_vfs: int,
        free_mbps: dict[str, int | None],
        largest_unplaced: Request | None,
        steps: int = 0,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.requested = requested
        self.free_vfs = free_vfs
        self.free_mbps = free_mbps
        self.largest_unplaced = largest_unplaced
        self.steps = steps


class _OutOfSteps(Exception):
    pass


class _NoArrangement(Exception):
    pass


_UNLIMITED = 1 << 62


# Steps the item-by-item search gets before the bin completion search takes
# over; enough for best fit and short repairs of it.
_FIRST_SHARE = 64
# The bin completion search charges _NODE_STEPS per node, one step per
# enumeration it starts (of a PF's fillings or of its best sum) and one per
# _SETS_PER_STEP sets it enumerates. The weights come from timing the
# benchmark's hardest inputs, so that a step costs about the same wherever
# it is spent.
_SETS_PER_STEP = 16
_NODE_STEPS = 4
# At each node, a bin's completions are enumerated only while they are fewer
# than this (or than the best branching found so far).
_FIRST_CAP = 4


def _sorted_arrays(sizes: list[int], kinds: list[int]) -> tuple[list[int], list[int], list[int]]:
    """For items sorted largest first: negated sizes (to bisect), prefix sums, next item of another kind.

    Items of one kind are interchangeable, so a search tries only the first
    of a run at each position.
    """
    negated = [-x for x in sizes]
    prefix = [0]
    for x in sizes:
        prefix.append(prefix[-1] + x)
    n = len(sizes)
    following = [n] * n
    for i in range(n - 2, -1, -1):
        following[i] = i + 1 if kinds[i + 1] != kinds[i] else following[i + 1]
    return negated, prefix, following


def _best_subset_sum(
    sizes: list[int],
    kinds: list[int],
    arrays: tuple[list[int], list[int], list[int]],
    start: int,
    free: int,
    slots: int,
    enough: int,
) -> tuple[int, tuple[int, ...], int]:
    """The largest sum of at most ``slots`` of ``sizes[start:]`` that stays within ``free``.

    ``sizes`` are sorted largest first, ``kinds[i]`` names ``sizes[i]`` and
    ``arrays`` is ``_sorted_arrays(sizes, kinds)``; items of one kind are
    tried once per position. Branch and bound: a branch ends when even its
    largest fitting sizes cannot beat the best sum so far, or when they fit
    together (then they are its best). Returns (sum, kinds of the sizes making it, nodes
    visited); the search stops at the first sum of at least ``enough``, so
    the sum is the maximum only when it is below ``enough``.
    """
    negated, prefix, following = arrays
    n = len(sizes)
    best = -1
    witness: tuple[int, ...] = ()
    chosen: list[int] = []
    nodes = 0

    def rec(pos: int, room: int, left: int) -> bool:
        nonlocal best, witness, nodes
        nodes += 1
        got = free - room
        q = bisect_left(negated, -room, pos)
        end = q + left if q + left < n else n
        top = prefix[end] - prefix[q]
        if top <= room:
            if got + top > best:
                best = got + top
                witness = (*chosen, *kinds[q:end])
                return best >= enough
            return False
        if got > best:
            best = got
            witness = tuple(chosen)
        while q < n:
            end = q + left if q + left < n else n
            top = prefix[end] - prefix[q]
            if got + (top if top < room else room) <= best:
                return False
            chosen.append(kinds[q])
            if rec(q + 1, room - sizes[q], left - 1):
                return True
            chosen.pop()
            q = following[q]
        return False

    rec(start, free, slots)
    return best, witness, nodes


# A PF's filling: (bandwidth it leaves unused, PF class, the item kinds it holds).
_Filling = tuple[int, int, tuple[int, ...]]
# The remaining items, largest first: (sizes, kinds, their _sorted_arrays).
_Items = tuple[list[int], list[int], tuple[list[int], list[int], list[int]]]


class _Fillings:
    """One enumeration of the undominated fillings of a PF of class ``c`` (see ``completions``).

    ``sizes``/``item_kinds`` are the items the class can take, largest first, with
    their arrays; ``taken`` marks those in the filling being built,
    ``chosen`` their kinds; ``out`` receives the fillings, at most ``cap``
    of them, and the enumeration stops once ``search.enumerated`` passes ``limit``.
    """

    def __init__(self, search: _BinCompletion, c: int, cap: int, out: list[_Filling]) -> None:
        self.search = search
        self.c = c
        self.cap = cap
        self.out = out
        self.sizes, self.item_kinds, arrays, self.start = search.fitting(c)
        self.negated, self.prefix, self.following = arrays
        self.taken = [False] * len(self.sizes)
        self.chosen: list[int] = []
        search.enumerated += _SETS_PER_STEP
        self.limit = search.enumerated + _SETS_PER_STEP * 2 * (cap + 1) if cap < _UNLIMITED else _UNLIMITED

    def extend(self, pos: int, room: int, slots: int, ub: int, skipped: tuple[tuple[int, int], ...]) -> bool:
        """Add items from ``pos`` on to the filling (``room`` and ``slots`` left); False to stop.

        ``ub``: the final room must stay below it, or a skipped item at least as
        large and as demanding (``skipped``: (size, level) of each) would fit
        in place of a chosen one, which makes the filling dominated.
        """
        search = self.search
        search.enumerated += 1
        if search.enumerated > self.limit:
            return False
        sizes, taken = self.sizes, self.taken
        if room < ub:
            # The smallest item left; those before ``start`` never fit this class.
            t = len(sizes) - 1
            while t >= 0 and taken[t]:
                t -= 1
            if slots == 0 or t < self.start or sizes[t] > room:
                self.out.append((room, self.c, tuple(self.chosen)))
                if len(self.out) > self.cap:
                    return False
        if not slots:
            return True
        item_kinds, prefix, following = self.item_kinds, self.prefix, self.following
        uniform, kind_level = search.uniform, search.kind_level
        n = len(sizes)
        smallest_skipped = _UNLIMITED
        q = bisect_left(self.negated, -room, pos)
        while q < n:
            k = item_kinds[q]
            w = sizes[q]
            # Final room must stay below (skipped - taken) for every skipped
            # kind that could replace this one.
            bound = ub
            if uniform:
                if smallest_skipped - w < bound:
                    bound = smallest_skipped - w
            else:
                lv = kind_level[k]
                for sw, sl in skipped:
                    if sl >= lv and sw - w < bound:
                        bound = sw - w
            left = room - w
            # The largest items after this one, one per slot left, still leave too much room.
            end = q + slots
            if left - (prefix[end if end < n else n] - prefix[q + 1]) >= bound:
                if uniform:
                    break
            else:
                taken[q] = True
                self.chosen.append(k)
                ok = self.extend(q + 1, left, slots - 1, bound, skipped)
                self.chosen.pop()
                taken[q] = False
                if not ok:
                    return False
            if uniform:
                smallest_skipped = w
            else:
                skipped = (*skipped, (w, kind_level[k]))
            q = following[q]
        return True


class _BinCompletion:
    """Stage 3 of "Algorithm": an exact search that fills one PF at a time (bin completion).

    Items come in kinds (min rate, cap level), largest first (``kind_weight``,
    ``kind_level``); ``left[k]`` items of kind k are not placed yet. PFs come
    in classes (free bandwidth, VFs, level: ``class_free``, ``class_vfs``,
    ``class_level``); ``open[c]`` PFs of class c are not filled yet. ``path``
    holds the fillings chosen, (class, kinds) each; ``failed`` the (left,
    open) states proven to have no fit; ``steps`` and ``enumerated`` (sets,
    _SETS_PER_STEP to a step) what was spent against ``budget``. Each node's
    bounds set ``items`` (the items left), ``allow[c]`` (the most bandwidth a
    filling of class c may leave unused in a fit) and ``best_fills[depth]``
    (best sums of the classes whose items overflow them, reused by children).
    """

    def __init__(
        self, weights: list[int], levels: list[int], bins: list[tuple[int, int, int]], budget: int
    ) -> None:
        self.kinds = sorted(set(zip(weights, levels, strict=True)), key=lambda t: (-t[0], -t[1]))
        kind_of = {k: i for i, k in enumerate(self.kinds)}
        self.left = [0] * len(self.kinds)
        for item in zip(weights, levels, strict=True):
            self.left[kind_of[item]] += 1
        self.kind_weight = [k[0] for k in self.kinds]
        self.kind_level = [k[1] for k in self.kinds]
        self.neg_weight = [-w for w in self.kind_weight]
        self.uniform = len(set(self.kind_level)) <= 1
        self.classes = sorted({b for b in bins if b[1] > 0})
        class_of = {c: i for i, c in enumerate(self.classes)}
        self.open = [0] * len(self.classes)
        for b in bins:
            if b[1] > 0:
                self.open[class_of[b]] += 1
        self.class_free = [c[0] for c in self.classes]
        self.class_vfs = [c[1] for c in self.classes]
        self.class_level = [c[2] for c in self.classes]
        # Bins with few VFs and little bandwidth usually have the fewest completions.
        self.by_tightness = sorted(
            range(len(self.classes)), key=lambda c: (self.class_vfs[c], self.class_free[c], c)
        )
        self.budget = budget
        self.failed: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        self.path: list[tuple[int, tuple[int, ...]]] = []
        self.steps = 0
        self.enumerated = 0
        self.best_fills: list[dict[int, tuple[int, tuple[int, ...]]]] = []
        self.allow = [_UNLIMITED] * len(self.classes)
        self.items: _Items = ([], [], ([], [], []))

    def run(self) -> tuple[list[tuple[int, tuple[int, ...]]] | None, int]:
        """The path (class, item kinds) of a fit or None, and the steps spent; _OutOfSteps(budget) past it."""
        found = self._dfs()
        return (self.path if found else None), self.steps + self.enumerated // _SETS_PER_STEP

    # -- the search ---------------------------------------------------------

    def _dfs(self) -> bool:
        """One node: memo, budget, bounds, then each child (a filling of a PF) in turn."""
        if not any(self.left):
            return True
        key = (tuple(self.left), tuple(self.open))
        if key in self.failed:
            return False
        if self.steps + self.enumerated // _SETS_PER_STEP >= self.budget:
            raise _OutOfSteps(self.budget)
        self.steps += _NODE_STEPS
        if not self.bound_holds():
            self.failed.add(key)
            return False
        children = self._children()
        children.sort()
        for _, c, chosen in children:
            self._fill(c, chosen, -1)
            self.path.append((c, chosen))
            if self._dfs():
                return True
            self.path.pop()
            self._fill(c, chosen, 1)
        self.failed.add(key)
        return False

    def _fill(self, c: int, chosen: tuple[int, ...], sign: int) -> None:
        """Close a PF of class ``c`` holding ``chosen`` (sign -1), or open it again (1)."""
        self.open[c] += sign
        for k in chosen:
            self.left[k] += sign

    def _children(self) -> list[_Filling]:
        """Branch on the PF with the fewest fillings, or on where the largest item goes (fewer children)."""
        best: list[_Filling] | None = None
        for c in self.by_tightness:
            if self.open[c]:
                alt: list[_Filling] = []
                if self.completions(c, -1, len(best) - 1 if best is not None else _FIRST_CAP, alt):
                    best = alt
                    if len(best) <= 1:
                        break
        if best is None or len(best) > 1:
            homes = self._homes_of_largest(len(best) - 1 if best is not None else _UNLIMITED)
            if homes is not None:
                best = homes
        assert best is not None
        return best

    def _homes_of_largest(self, cap: int) -> list[_Filling] | None:
        """Every filling holding the largest item left, on any class; None past ``cap`` of them.

        A filling that also fits an open PF this one dominates (at least as
        much bandwidth, VFs and level) goes there instead: swapping the two
        PFs' contents keeps any fit a fit.
        """
        a = next(k for k in range(len(self.kinds)) if self.left[k])
        free, vfs, level = self.class_free, self.class_vfs, self.class_level
        hosts = [
            c
            for c in range(len(self.classes))
            if self.open[c] and free[c] >= self.kind_weight[a] and level[c] >= self.kind_level[a]
        ]
        out: list[_Filling] = []
        for c in hosts:
            mine: list[_Filling] = []
            if not self.completions(c, a, cap - len(out), mine):
                return None
            smaller = [
                d
                for d in hosts
                if d != c and free[d] <= free[c] and vfs[d] <= vfs[c] and level[d] <= level[c]
            ]
            for filling in mine:
                room, _, chosen = filling
                size = free[c] - room
                top = max(self.kind_level[k] for k in chosen)
                if not any(size <= free[d] and len(chosen) <= vfs[d] and top <= level[d] for d in smaller):
                    out.append(filling)
        return out

    def completions(self, c: int, anchor: int, cap: int, out: list[_Filling]) -> bool:
        """Append the undominated fillings of one PF of class c to ``out``; False past ``cap`` of them.

        A filling is kept only if no remaining item fits beside it and no
        remaining item is at least as large (and as demanding in level) as one
        of its items and fits in its place: any fit can be changed into one
        that uses a kept filling for this PF. A filling that leaves more room
        than ``allow[c]`` cannot be part of any fit and is not kept either.
        With ``anchor`` >= 0 (the largest remaining kind) the filling must contain it.
        """
        fillings = _Fillings(self, c, cap, out)
        free, vfs = self.class_free[c], self.class_vfs[c]
        if anchor >= 0:
            # The anchor is the largest remaining kind, so the first item the class can take.
            fillings.taken[fillings.start] = True
            fillings.chosen.append(anchor)
            return fillings.extend(
                fillings.start + 1, free - self.kind_weight[anchor], vfs - 1, self.allow[c], ()
            )
        return fillings.extend(fillings.start, free, vfs, self.allow[c], ())

    def fitting(self, c: int) -> tuple[list[int], list[int], tuple[list[int], list[int], list[int]], int]:
        """The remaining items class c can take, largest first, as (sizes, kinds, arrays, first index)."""
        if self.uniform:
            # All items share one cap level: a class takes every item that fits,
            # or none when its level is below theirs. Share this node's lists.
            sizes, kinds, arrays = self.items
            if self.kinds and self.class_level[c] < self.kind_level[0]:
                return sizes, kinds, arrays, len(sizes)
            return sizes, kinds, arrays, bisect_left(arrays[0], -self.class_free[c])
        lvl, free = self.class_level[c], self.class_free[c]
        kinds = [
            k
            for k in range(len(self.kinds))
            if self.left[k] and self.kind_level[k] <= lvl and self.kind_weight[k] <= free
            for _ in range(self.left[k])
        ]
        sizes = [self.kind_weight[k] for k in kinds]
        return sizes, kinds, _sorted_arrays(sizes, kinds), 0

    # -- the bounds ---------------------------------------------------------

    def bound_holds(self) -> bool:
        """Every bound of the node (see "Algorithm"); sets ``items``, ``best_fills`` and ``allow``."""
        kinds = [k for k in range(len(self.kinds)) if self.left[k] for _ in range(self.left[k])]
        items = [self.kind_weight[k] for k in kinds]
        self.items = (items, kinds, _sorted_arrays(items, kinds))
        depth = len(self.path)
        mine: dict[int, tuple[int, tuple[int, ...]]] = {}
        if len(self.best_fills) > depth:
            self.best_fills[depth] = mine
        else:
            self.best_fills.append(mine)
        small = [0]
        for x in reversed(items):
            small.append(small[-1] + x)
        scan = self._scan(items, small)
        if scan is None or not self._crowd_bound_holds(len(items), small):
            return False
        room, open_free, limited, overfull, full = scan
        room += self._limited_room(limited)
        total = sum(items)
        if room < total:
            return False
        waste: dict[int, int] = {}
        parent = self.best_fills[depth - 1] if depth else {}
        wasted = self._waste_at_least(room - total, overfull, mine, parent, waste) if overfull else 0
        if wasted is None or not self._levels_hold():
            return False
        # Martello-Toth L2 over the open bins (see dff_bound_holds, lam = 0).
        open_free.sort()
        heaviest = open_free[-1]
        if not _l2_holds([(x, open_free[bisect_left(open_free, x)], heaviest) for x in items], open_free):
            return False
        # In a fit, the PFs that are not count-limited hold at most their free
        # bandwidth less their waste bound, so one of them can waste at most
        # the slack on top of its own bound (count-limited PFs get no limit).
        slack = room - total - wasted
        self.allow = [_UNLIMITED] * len(self.classes)
        for c in full:
            self.allow[c] = slack + waste.get(c, 0) + 1
        return True

    def _scan(
        self, items: list[int], small: list[int]
    ) -> tuple[int, list[int], list[tuple[int, int, int]], list[tuple[int, int, int]], list[int]] | None:
        """Per open class, how many items it can hold and how much bandwidth; None when too little.

        Returns the bandwidth of the classes that can be filled, the open PFs'
        free bandwidths, the count-limited classes (free, items, PFs), the
        overflowing ones (class, items, PFs) and the classes not count-limited.
        """
        n = len(items)
        negated, prefix, _ = self.items[2]
        room = 0
        slots = 0
        open_free: list[int] = []
        limited: list[tuple[int, int, int]] = []
        overfull: list[tuple[int, int, int]] = []
        full: list[int] = []
        for c in range(len(self.classes)):
            m = self.open[c]
            if not m:
                continue
            free = self.class_free[c]
            open_free.extend([free] * m)
            k = min(self.class_vfs[c], n)
            if small[k] > free:
                k = bisect_right(small, free, 0, k + 1) - 1
            s = bisect_left(negated, -free)
            top = prefix[min(n, s + k)] - prefix[s]
            slots += k * m
            if top < free:
                # Too few VFs to fill this PF: count-limited.
                limited.append((free, k, m))
            else:
                room += free * m
                full.append(c)
                if top > free:
                    # Its requests overflow it: it may waste some bandwidth.
                    overfull.append((c, k, m))
        if slots < n or not open_free or max(open_free) < items[0]:
            return None
        return room, open_free, limited, overfull, full

    def _limited_room(self, limited: list[tuple[int, int, int]]) -> int:
        """What the count-limited PFs hold together, at most.

        They share the large requests: smallest PF first, each takes the
        largest requests left that fit it (requests fitting a PF also fit
        every larger one).
        """
        room = 0
        left = list(self.left)
        for free, k, m in limited:
            want = k * m
            for kk in range(bisect_left(self.neg_weight, -free), len(self.kinds)):
                take = min(left[kk], want)
                if take:
                    left[kk] -= take
                    want -= take
                    room += take * self.kind_weight[kk]
                    if not want:
                        break
        return room

    def _levels_hold(self) -> bool:
        """Hall's condition on cap levels: nested sets of PFs."""
        if self.uniform:
            return True
        for lvl in sorted(set(self.kind_level)):
            need = sum(self.left[k] for k in range(len(self.kinds)) if self.kind_level[k] >= lvl)
            have = sum(
                self.open[c] * self.class_vfs[c]
                for c in range(len(self.classes))
                if self.class_level[c] >= lvl
            )
            if need > have:
                return False
        return True

    def _crowd_bound_holds(self, n: int, small: list[int]) -> bool:
        """Whatever some PFs cannot hold by VF count must fit in the bandwidth of the others.

        Split the open PFs into T and the rest S: T takes at most its VFs in
        requests, so S gets at least the others, which weigh at least as much
        as that many smallest requests. The splits tried put into S the PFs
        with the least bandwidth, or the least bandwidth per VF.
        """
        open_bins = [
            (self.class_free[c], self.class_vfs[c])
            for c in range(len(self.classes))
            for _ in range(self.open[c])
        ]
        vfs_total = sum(v for _, v in open_bins)
        for order in (sorted(open_bins), sorted(open_bins, key=lambda b: b[0] / b[1])):
            free_s = 0
            vfs_s = 0
            for f, v in order[:-1]:
                free_s += f
                vfs_s += v
                k = n - vfs_total + vfs_s
                if k > 0 and small[k if k < n else n] > free_s:
                    return False
        return True

    def _best_fill(self, c: int, slots: int, enough: int) -> tuple[int, tuple[int, ...], int]:
        sizes, kinds, arrays, start = self.fitting(c)
        return _best_subset_sum(sizes, kinds, arrays, start, self.class_free[c], slots, enough)

    def _greedy_fill(self, c: int, slots: int) -> tuple[int, list[int]]:
        """Room a largest-first filling of a class ``c`` PF leaves, and its kinds (bounds the waste above)."""
        free = self.class_free[c]
        room = free
        left = slots
        took: list[int] = []
        for k in range(bisect_left(self.neg_weight, -free), len(self.kinds)):
            if not left:
                break
            w = self.kind_weight[k]
            if self.left[k] and w <= room and self.kind_level[k] <= self.class_level[c]:
                # Size-0 requests (caps only) take slots but no bandwidth.
                t = min(self.left[k], left, room // w) if w else min(self.left[k], left)
                room -= t * w
                left -= t
                took.extend([k] * t)
        return room, took

    def _waste_at_least(
        self,
        margin: int,
        overfull: list[tuple[int, int, int]],
        mine: dict[int, tuple[int, tuple[int, ...]]],
        parent: dict[int, tuple[int, tuple[int, ...]]],
        waste: dict[int, int],
    ) -> int | None:
        """Bound the bandwidth the overflowing PFs must leave unused; None when it exceeds ``margin``.

        Each of them holds at most its best sum of remaining requests, so it
        wastes at least the rest. Sums are computed only as far as the
        decision needs: a parent's sum still reachable is reused, a greedy
        filling bounds the waste from above, and the exact search runs,
        largest possible gain first, until the total settles either way.
        Fills ``waste`` with each class's lower bound; returns their total.
        """
        sure = 0
        maybe = 0
        todo = []
        for c, slots, m in overfull:
            free = self.class_free[c]
            lo = 0
            known = parent.get(c)
            if known is not None:
                best, made_of = known
                if len(made_of) <= slots and all(self.left[k] >= made_of.count(k) for k in set(made_of)):
                    mine[c] = known
                    waste[c] = free - best
                    sure += (free - best) * m
                    continue
                # Fewer requests now, so the best sum cannot have grown.
                lo = free - best
            room, took = self._greedy_fill(c, slots)
            waste[c] = lo
            sure += lo * m
            if room == lo:
                mine[c] = (free - room, tuple(took))
                continue
            maybe += (room - lo) * m
            todo.append(((room - lo) * m, c, slots, m, lo, room))
        if sure > margin:
            return None
        todo.sort(reverse=True)
        for gap, c, slots, m, lo, hi in todo:
            if sure + maybe <= margin:
                break
            free = self.class_free[c]
            # Past this sum the waste left cannot exceed the margin: stop there.
            enough = free - hi + (sure + maybe - margin + m - 1) // m
            best, made_of, nodes = self._best_fill(c, slots, min(enough, free - lo))
            self.enumerated += nodes + _SETS_PER_STEP
            if best >= enough and best < free - lo:
                break
            mine[c] = (best, made_of)
            waste[c] = free - best
            sure += (free - best - lo) * m
            maybe -= gap
            if sure > margin:
                return None
        return sure


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def free_summary(pfs: Sequence[PfState]) -> str:
    """One line describing what each PF has free, by PF name, for error messages."""
    parts = []
    for pf in sorted(pfs, key=lambda p: p.name):
        if pf.capacity_mbps is None:
            bandwidth = "capacity unknown"
        else:
            bandwidth = f"{pf.free_mbps} of {pf.capacity_mbps} Mbit/s free"
        parts.append(f"{pf.name}: {_plural(pf.free_vfs, 'VF')}, {bandwidth}")
    return "; ".join(parts) if parts else "no PFs"


def _sort_key(req: Request) -> tuple[int, int]:
    # Largest first: by min rate, then by cap with "no cap" (0) smallest.
    return (-req.min_tx_rate, -req.max_tx_rate)


def _l2_holds(pieces: list[tuple[int, int, int]], rooms: list[int]) -> bool:
    """The threshold test of :meth:`_Problem.dff_bound_holds` for one weighting.

    ``pieces`` are (size, lightest room it fits, heaviest room it fits);
    ``rooms`` are sorted. False proves the pieces cannot be packed.
    """
    above = [0] * (len(rooms) + 1)
    for t in range(len(rooms) - 1, -1, -1):
        above[t] = above[t + 1] + rooms[t]
    ks = sorted({size for size, _, _ in pieces})
    # Difference array over the thresholds: each piece weighs its size for
    # small k, its lightest room for middling k, nothing above it.
    diff = [0] * (len(ks) + 1)
    for size, lightest, heaviest in pieces:
        top = bisect_right(ks, size)
        cut = min(top, bisect_right(ks, heaviest - size))
        diff[0] += size
        diff[cut] += lightest - size
        diff[top] -= lightest
    demand = 0
    for t, k in enumerate(ks):
        demand += diff[t]
        if demand > above[bisect_left(rooms, k)]:
            return False
    return True


class _ItemSearch:
    """Stage 2 of "Algorithm": depth-first over the min-rate requests, largest first, best fit first.

    What is left on each PF is ``vfs``/``free``/``used``; ``work`` is the
    Hall slack per cap level; ``assign`` the PF of each request placed;
    ``failed`` the states proven to have no fit; ``steps`` the nodes
    visited (``stop_at`` ends the search with _OutOfSteps); ``deepest`` the
    furthest request reached (it names the culprit in errors); ``bounded``
    whether the costlier L2 bound has been tried (once, at the first failure).
    Requests of one run (same min rate and cap level) take PFs in a frozen
    order, ``pos`` (rank per PF), each from the previous one's rank ``prev`` on.
    """

    def __init__(self, problem: _Problem, slack: list[int]) -> None:
        self.problem = problem
        reqs = problem.requests
        self.weights = weights = [reqs[i].min_tx_rate for i in problem.reserving]
        self.rlevels = rlevels = [problem.rlevel[i] for i in problem.reserving]
        n = self.n = len(weights)
        self.negated = [-w for w in weights]
        self.prefix = prefix = [0]
        for w in weights:
            prefix.append(prefix[-1] + w)
        # small_sums[k]: the k smallest requests together (they are the last k).
        self.small_sums = [prefix[n] - prefix[n - k] for k in range(n + 1)]
        # Runs of requests that are interchangeable (same min rate, same cap level).
        kinds = list(zip(weights, rlevels, strict=True))
        self.starts_run = [i == 0 or kinds[i - 1] != kinds[i] for i in range(n)]
        self.continues_run = [i + 1 < n and not self.starts_run[i + 1] for i in range(n)]
        self.vfs = list(problem.vfs0)
        self.free = list(problem.free0)
        self.used = [0] * len(problem.pfs)
        self.work = list(slack)
        self.assign = [-1] * n
        self.vf_base = max(self.vfs) + 1
        self.level_base = 2 * (problem.n_levels + 1)
        self.failed: set[tuple[int, tuple[int, ...]]] = set()
        self.steps = 0
        self.stop_at = _UNLIMITED
        self.deepest = 0
        self.bounded = False

    def rank(self, j: int, w: int) -> tuple[int, ...]:
        """The policy's order of PFs for a request of min rate ``w`` (see "Policy")."""
        if self.problem.numa_first:
            return (self.problem.numa_rank[j], self.free[j] - w, self.used[j] > 0, j)
        return (self.free[j] - w, self.problem.numa_rank[j], self.used[j] > 0, j)

    def run(self, stop_at: int) -> bool:
        """Search from the first request; _OutOfSteps past ``stop_at`` steps, _NoArrangement when L2 fails."""
        self.stop_at = stop_at
        return self._dfs(0, None, -1)

    def _state(self, i: int, pos: list[int] | None, prev: int) -> list[int] | None:
        """The PFs' states at request ``i`` (the memo key before sorting), or None when a bound fails.

        Bandwidth below the smallest request is dead and beyond what is left
        to place is surplus (both canonicalised to merge states), and whether
        the current run of equal requests may still use the PF is part of it.
        The bound: each PF takes at most as many requests as its VFs allow and
        as the smallest remaining ones fit in its bandwidth, and at most that
        many of the largest that fit it; together they must hold what is left.
        """
        n, prefix, small_sums, negated = self.n, self.prefix, self.small_sums, self.negated
        vfs, free, plevel = self.vfs, self.free, self.problem.plevel
        vf_base, level_base = self.vf_base, self.level_base
        smallest = self.weights[-1]
        rest = prefix[n] - prefix[i]
        left = n - i
        inside = pos is not None and prev >= 0
        room = 0
        slots = 0
        state = []
        for j in self.problem.known_idx:
            v = vfs[j]
            if v:
                f = free[j]
                if f >= smallest:
                    k = v if v < left else left
                    if small_sums[k] > f:
                        k = bisect_right(small_sums, f, 0, k + 1) - 1
                    slots += k
                    s = bisect_left(negated, -f, i)
                    cap = prefix[s + k] - prefix[s] if s + k < n else prefix[n] - prefix[s]
                    room += f if f < cap else cap
                    if f > rest:
                        f = rest
                else:
                    f = 0
                code = ((f * vf_base + v) * level_base + plevel[j]) * 2
                state.append(code + 1 if not inside or pos[j] >= prev else code)  # type: ignore[index]
        if room < rest or slots < left:
            return None
        return state

    def _candidates(self, i: int, pos: list[int] | None, prev: int) -> list[int]:
        """The PFs request ``i`` may take, one per class of equivalent PFs, in the order to try them."""
        w = self.weights[i]
        a = self.rlevels[i]
        vfs, free, plevel = self.vfs, self.free, self.problem.plevel
        rest = self.prefix[self.n] - self.prefix[i]
        inside = pos is not None and prev >= 0
        fits = [j for j in self.problem.known_idx if vfs[j] and free[j] >= w and plevel[j] >= a]
        if inside:
            # Inside a run, the earliest equivalent PF in the frozen order stands for its class.
            fits = sorted((j for j in fits if pos[j] >= prev), key=pos.__getitem__)  # type: ignore[index,union-attr]
        else:
            fits.sort(key=lambda j: self.rank(j, w))
        seen: set[tuple[int, int, int]] = set()
        reps = []
        for j in fits:
            f = free[j]
            cls = (vfs[j], f if f < rest else rest, plevel[j])
            if cls not in seen:
                seen.add(cls)
                reps.append(j)
        if inside:
            reps.sort(key=lambda j: self.rank(j, w))
        return reps

    def _take(self, i: int, j: int, sign: int) -> bool:
        """Put request ``i`` on PF ``j`` (sign 1) or take it back (-1); False when Hall's slack goes negative.

        A request on a PF above its level takes a VF that requests of the
        levels in between could have used.
        """
        w = self.weights[i]
        self.vfs[j] -= sign
        self.free[j] -= sign * w
        self.used[j] += sign
        ok = True
        work = self.work
        for lvl in range(self.rlevels[i] + 1, self.problem.plevel[j] + 1):
            work[lvl] -= sign
            if work[lvl] < 0:
                ok = False
        return ok

    def _dfs(self, i: int, pos: list[int] | None, prev: int) -> bool:
        if i == self.n:
            return True
        if self.steps >= self.stop_at:
            raise _OutOfSteps
        self.steps += 1
        if self.starts_run[i]:
            prev = -1
            pos = None
            if self.continues_run[i]:
                # Freeze the order in which this run's requests must take PFs.
                w = self.weights[i]
                pos = [0] * len(self.vfs)
                for rank, j in enumerate(sorted(self.problem.known_idx, key=lambda j: self.rank(j, w))):
                    pos[j] = rank
        state = self._state(i, pos, prev)
        if state is None:
            self.deepest = max(self.deepest, i)
            return False
        key = None
        if self.failed:
            state.sort()
            key = (i, tuple(state))
            if key in self.failed:
                return False
        for j in self._candidates(i, pos, prev):
            if self._take(i, j, 1) and self._dfs(i + 1, pos, pos[j] if pos is not None else -1):
                self.assign[i] = j
                return True
            self._take(i, j, -1)
        self.deepest = max(self.deepest, i)
        if not self.bounded:
            # Only now, when best fit has failed once, is the costlier bound worth it.
            self.bounded = True
            if not self.problem.dff_bound_holds():
                raise _NoArrangement
        if key is None:
            state.sort()
            key = (i, tuple(state))
        self.failed.add(key)
        return False


class _Problem:
    """Precomputed arrays for one call of :func:`place`; PFs are indexed in name order."""

    def __init__(
        self,
        requests: tuple[Request, ...],
        pfs: list[PfState],
        preferred_numa: int | None,
        policy: Policy,
        shown: Sequence[PfState] | None = None,
        note: str = "",
    ) -> None:
        self.requests = requests
        self.pfs = pfs
        # What messages describe: the caller's PFs (the search may see fewer VFs, see place()).
        self.shown = pfs if shown is None else shown
        self.note = note
        self.numa_first = policy == "numa_first"
        self.known = [pf.capacity_mbps is not None for pf in pfs]
        self.vfs0 = [pf.free_vfs for pf in pfs]
        # -1 keeps unknown-capacity PFs out of every "free >= min" test.
        self.free0 = [pf.free_mbps if pf.free_mbps is not None else -1 for pf in pfs]
        self.numa_rank = [
            0 if preferred_numa is not None and pf.numa_node == preferred_numa else 1 for pf in pfs
        ]
        # Capacity levels: a request's cap allows exactly the PFs whose level is at
        # least the request's level, so eligibility is nested.
        self.caps = sorted({pf.capacity_mbps for pf in pfs if pf.capacity_mbps is not None})
        self.n_levels = len(self.caps)
        self.plevel = [
            bisect_left(self.caps, pf.capacity_mbps) if pf.capacity_mbps is not None else -1 for pf in pfs
        ]
        self.known_idx = [j for j in range(len(pfs)) if self.known[j]]
        self.unknown_vfs = sum(self.vfs0[j] for j in range(len(pfs)) if not self.known[j])
        self.total_vfs = sum(self.vfs0)

        order = sorted(range(len(requests)), key=lambda i: (_sort_key(requests[i]), i))
        self.reserving = [i for i in order if requests[i].min_tx_rate > 0]
        self.unreserved = [i for i in order if requests[i].min_tx_rate == 0]
        self.rlevel = [bisect_left(self.caps, r.max_tx_rate) for r in requests]

    # ----------------------------------------------------------------- messages

    def _fail(self, reason: str, detail: str, unplaced: Request | None, steps: int = 0) -> NoFit:
        mins = ", ".join(str(r.min_tx_rate) for r in self.requests)
        head = f"{_plural(len(self.requests), 'interface')}{self.note} requested (min rates {mins} Mbit/s)"
        return NoFit(
            f"{head}{detail} ({free_summary(self.shown)})",
            reason=reason,
            requested=self.requests,
            free_vfs=self.total_vfs,
            free_mbps={pf.name: pf.free_mbps for pf in self.shown},
            largest_unplaced=unplaced,
            steps=steps,
        )

    def _kth_largest(self, indices: list[int], k: int) -> Request:
        # With `k` places for these requests, the (k+1)-th largest is the first left over.
        ranked = sorted(indices, key=lambda i: (_sort_key(self.requests[i]), i))
        return self.requests[ranked[min(k, len(ranked) - 1)]]

    # ------------------------------------------------------- necessary conditions

    def hall_slack(self) -> list[int]:
        """Per capacity level, the spare VFs after Hall's condition; raises NoFit when negative.

        Level ``l`` stands for "capacity at least caps[l]". Min-rate requests of
        level >= l need VFs on known PFs of level >= l; all requests of level
        >= l can also use unknown-capacity PFs when they have no min rate.
        """
        levels = self.n_levels
        vf_at = [0] * (levels + 2)
        for j in self.known_idx:
            vf_at[self.plevel[j]] += self.vfs0[j]
        for lvl in range(levels - 1, -1, -1):
            vf_at[lvl] += vf_at[lvl + 1]
        nb = [0] * (levels + 2)
        nz = [0] * (levels + 2)
        for i in self.reserving:
            nb[self.rlevel[i]] += 1
        for i in self.unreserved:
            nz[self.rlevel[i]] += 1
        for lvl in range(levels - 1, -1, -1):
            nb[lvl] += nb[lvl + 1]
            nz[lvl] += nz[lvl + 1]
        only_known = [vf_at[lvl] - nb[lvl] for lvl in range(levels + 1)]
        with_unknown = [vf_at[lvl] + self.unknown_vfs - nb[lvl] - nz[lvl] for lvl in range(levels + 1)]

        if len(self.requests) > self.total_vfs:
            raise self._fail(
                "vfs",
                f" but the node has {_plural(self.total_vfs, 'free VF')}",
                self._kth_largest(list(range(len(self.requests))), self.total_vfs),
            )
        if only_known[0] < 0:
            raise self._fail(
                "unknown_capacity",
                f": {len(self.reserving)} of them reserve a min rate, which needs a PF of known capacity, "
                f"but those have {_plural(vf_at[0], 'free VF')}; the other "
                f"{_plural(self.unknown_vfs, 'free VF')} are on PFs of unknown capacity, "
                "usable only without a min rate",
                self._kth_largest(self.reserving, vf_at[0]),
            )
        for lvl in range(levels, 0, -1):
            if only_known[lvl] >= 0 and with_unknown[lvl] >= 0:
                continue
            above = self.caps[lvl - 1]
            if only_known[lvl] < 0:
                group = [i for i in self.reserving if self.rlevel[i] >= lvl]
                room = vf_at[lvl]
                who = " with a min rate"
                extra = ""
            else:
                group = [i for i in self.reserving + self.unreserved if self.rlevel[i] >= lvl]
                room = vf_at[lvl] + self.unknown_vfs
                who = ""
                extra = f", plus {_plural(self.unknown_vfs, 'free VF')} on PFs of unknown capacity"
            if lvl == levels:
                where = f"no PF has more than {above} Mbit/s"
            else:
                where = f"the PFs with at least {self.caps[lvl]} Mbit/s have {_plural(vf_at[lvl], 'free VF')}"
            raise self._fail(
                "max_rate",
                f": max_tx_rate above {above} Mbit/s on {_plural(len(group), 'interface')}{who} "
                f"needs a PF with that capacity, but {where}{extra}",
                self._kth_largest(group, room),
            )
        return [min(a, b) for a, b in zip(only_known, with_unknown, strict=True)]

    def check_bandwidth(self) -> None:
        """Raise NoFit when a cheap bound shows the min rates cannot be reserved."""
        reqs = self.requests
        usable = [j for j in self.known_idx if self.vfs0[j] > 0]
        for i in self.reserving:
            need = reqs[i].min_tx_rate
            lvl = self.rlevel[i]
            room = [self.free0[j] for j in usable if self.plevel[j] >= lvl]
            best = max(room)  # non-empty: the Hall check passed
            if need > best:
                where = "on a PF with free VFs"
                if lvl > 0:
                    where += f" and capacity of at least {reqs[i].max_tx_rate} Mbit/s (its max_tx_rate)"
                raise self._fail(
                    "bandwidth",
                    f": cannot reserve {need} Mbit/s: the largest free bandwidth {where} is {best} Mbit/s",
                    reqs[i],
                )
        total = sum(reqs[i].min_tx_rate for i in self.reserving)
        free_total = sum(self.free0[j] for j in usable)
        if total > free_total:
            raise self._fail(
                "bandwidth",
                f": cannot reserve {total} Mbit/s in total: the PFs with free VFs have "
                f"{free_total} Mbit/s free in total",
                self._greedy_unplaced(),
            )

    def dff_bound_holds(self) -> bool:
        """A generalised Martello-Toth L2 bound; False proves the min rates cannot be arranged.

        Fix a threshold k. Weigh a request of size x on a PF of room r as r
        when x > r - k (nothing else of size >= k fits beside it), as x when
        k <= x <= r - k, and as 0 when x < k: a PF's weights then never exceed
        its room. So the sum over requests of their lightest weight on any PF
        they fit must not exceed the room of the PFs that can hold a request of
        size k. PFs of different rooms are allowed, unlike in the textbook form.

        VF counts enter by adding lam to every request and lam per VF to every
        PF's room, which keeps every real packing valid: lam = 0 is the pure
        bandwidth bound, a lam above every room is a pure counting bound (it
        proves, say, that 32 requests cannot pair up on 16 PFs with 2 VFs), and
        the median request size mixes the two.
        """
        reqs = self.requests
        usable = [j for j in self.known_idx if self.vfs0[j] > 0]
        free0 = self.free0
        vfs0 = self.vfs0
        fitting = [
            (
                reqs[i].min_tx_rate,
                [j for j in usable if self.plevel[j] >= self.rlevel[i] and free0[j] >= reqs[i].min_tx_rate],
            )
            for i in self.reserving
        ]
        sizes = sorted(x for x, _ in fitting)
        for lam in (0, sizes[len(sizes) // 2], max(free0[j] for j in usable) + 1):
            rooms = sorted(free0[j] + lam * vfs0[j] for j in usable)
            pieces = [
                (
                    x + lam,
                    min(free0[j] + lam * vfs0[j] for j in js),
                    max(free0[j] + lam * vfs0[j] for j in js),
                )
                for x, js in fitting
            ]
            if not _l2_holds(pieces, rooms):
                return False
        return True

    def _arrangement_detail(self, total: int, free_total: int) -> str:
        return (
            f": cannot reserve {total} Mbit/s: it fits in the {free_total} Mbit/s free in total "
            "but not PF by PF, since each interface needs its whole min rate on one PF"
        )

    def _greedy_unplaced(self) -> Request | None:
        """First request best-fit-decreasing cannot place; names the culprit in bandwidth errors."""
        vfs = list(self.vfs0)
        free = list(self.free0)
        for i in self.reserving:
            need = self.requests[i].min_tx_rate
            lvl = self.rlevel[i]
            fits = [j for j in self.known_idx if vfs[j] > 0 and free[j] >= need and self.plevel[j] >= lvl]
            if not fits:
                return self.requests[i]
            j = min(fits, key=lambda j: (free[j] - need, j))
            vfs[j] -= 1
            free[j] -= need
        return None

    # ------------------------------------------------------------------ search

    def search(self, slack: list[int], max_steps: int | None) -> tuple[list[int], dict[int, int], int]:
        """Assign the min-rate requests exactly.

        Returns the PF of each reserving request, PFs already fixed for other
        requests, and the steps spent.
        """
        if not self.reserving:
            return [], {}, 0
        reqs = self.requests
        items = _ItemSearch(self, slack)
        # Best fit and short repairs of it first; the bin completion search
        # below decides whatever that leaves open.
        fixed: dict[int, int] = {}
        assign = items.assign
        try:
            found = items.run(_FIRST_SHARE if max_steps is None else min(max_steps, _FIRST_SHARE))
        except _NoArrangement:
            found = False
        except _OutOfSteps:
            budget = _UNLIMITED if max_steps is None else max_steps - items.steps
            try:
                found, used_steps = self.complete(fixed, budget)
            except _OutOfSteps as exc:
                steps = items.steps + exc.args[0]
                raise self._fail(
                    "search_limit",
                    f": gave up after {steps} search steps without finding a placement "
                    "or proving that none exists",
                    reqs[self.reserving[items.deepest]],
                    steps,
                ) from None
            items.steps += used_steps
            if found:
                assign = [fixed.pop(i) for i in self.reserving]
        if not found:
            total = items.prefix[items.n]
            free_total = sum(self.free0[j] for j in self.known_idx if self.vfs0[j] > 0)
            unplaced = reqs[self.reserving[items.deepest]]
            greedy = self._greedy_unplaced()
            if greedy is not None and _sort_key(greedy) > _sort_key(unplaced):
                unplaced = greedy
            raise self._fail("bandwidth", self._arrangement_detail(total, free_total), unplaced, items.steps)
        return assign, fixed, items.steps

    def complete(self, fixed: dict[int, int], budget: int) -> tuple[bool, int]:
        """Run the bin completion search; fills ``fixed`` (request -> PF) and returns (fits, steps).

        Requests without a min rate join as items of size 0 only when some of
        them has a cap that rules PFs out; otherwise any free VF takes them.
        """
        items = list(self.reserving)
        with_zero = any(self.rlevel[i] > 0 for i in self.unreserved)
        if with_zero:
            items += self.unreserved
        reqs = self.requests
        pf_bins: list[tuple[int, int, int]] = []
        pf_index: list[int] = []
        for j in range(len(self.pfs)):
            if not self.vfs0[j]:
                continue
            if self.known[j]:
                pf_bins.append((self.free0[j], self.vfs0[j], self.plevel[j]))
            elif with_zero:
                pf_bins.append((0, self.vfs0[j], self.n_levels))
            else:
                continue
            pf_index.append(j)
        search = _BinCompletion(
            [reqs[i].min_tx_rate for i in items], [self.rlevel[i] for i in items], pf_bins, budget
        )
        found, steps = search.run()
        kinds, classes = search.kinds, search.classes
        if found is None:
            return False, steps
        # Interchangeable PFs of a class are used in tie-break order.
        members: dict[tuple[int, int, int], list[int]] = {}
        for b, j in zip(pf_bins, pf_index, strict=True):
            members.setdefault(b, []).append(j)
        for group in members.values():
            group.sort(key=lambda j: (self.numa_rank[j], j), reverse=True)
        waiting: dict[tuple[int, int], list[int]] = {}
        for i in reversed(items):
            waiting.setdefault((reqs[i].min_tx_rate, self.rlevel[i]), []).append(i)
        for c, chosen in found:
            j = members[classes[c]].pop()
            for k in chosen:
                fixed[waiting[kinds[k]].pop()] = j
        return True, steps

    def finish(self, assign: list[int], fixed: dict[int, int]) -> tuple[str, ...]:
        """Place the requests without a min rate and return PF names in request order."""
        pfs = self.pfs
        vfs = list(self.vfs0)
        free = list(self.free0)
        used = [0] * len(pfs)
        chosen: list[int] = [-1] * len(self.requests)
        for i, j in [*zip(self.reserving, assign, strict=True), *fixed.items()]:
            chosen[i] = j
            vfs[j] -= 1
            free[j] -= self.requests[i].min_tx_rate
            used[j] += 1

        def value(j: int) -> tuple[int, ...]:
            usefulness = (int(self.known[j]), free[j], self.plevel[j])
            tail = (int(used[j] > 0), j)
            if self.numa_first:
                return (self.numa_rank[j], *usefulness, *tail)
            return (*usefulness, self.numa_rank[j], *tail)

        # Most restrictive cap first: every later request can use a superset of
        # PFs, so any choice keeps the rest feasible (Hall held during search).
        for i in sorted(self.unreserved, key=lambda i: (-self.rlevel[i], -self.requests[i].max_tx_rate, i)):
            if i in fixed:
                continue
            lvl = self.rlevel[i]
            fits = [j for j in range(len(pfs)) if vfs[j] and (not self.known[j] or self.plevel[j] >= lvl)]
            j = min(fits, key=value)
            chosen[i] = j
            vfs[j] -= 1
            used[j] += 1
        return tuple(pfs[j].name for j in chosen)


def place(
    requests: Sequence[Request],
    pfs: Sequence[PfState],
    *,
    preferred_numa: int | None = None,
    policy: Policy = "best_fit",
    max_steps: int | None = DEFAULT_MAX_STEPS,
    different_pfs: bool = False,
) -> Placement:
    """Choose a PF for each request, or raise :class:`NoFit` saying why none fits.

    See the module docstring for the rules, the policy among fitting
    placements, the constraints (``Request.pf``, ``Request.rail`` and
    ``different_pfs``: each request on a different PF) and the step budget.
    Raises ValueError on malformed input (negative numbers, a cap below the
    min rate, duplicate PF names).
    """
    reqs = tuple(requests)
    for req in reqs:
        _check_request(req)
    for pf in pfs:
        _check_pf(pf)
    ordered = sorted(pfs, key=lambda p: p.name)
    for a, b in pairwise(ordered):
        if a.name == b.name:
            raise ValueError(f"duplicate PF name {a.name!r}")
    if policy not in ("best_fit", "numa_first"):
        raise ValueError(f"unknown placement policy {policy!r}")
    if preferred_numa is not None and not _is_int(preferred_numa):
        raise ValueError(f"preferred_numa must be an integer or None, got {preferred_numa!r}")
    if max_steps is not None and (not _is_int(max_steps) or max_steps < 1):
        raise ValueError(f"max_steps must be a positive integer or None, got {max_steps!r}")
    if not isinstance(different_pfs, bool):
        raise ValueError(f"different_pfs must be a boolean, got {different_pfs!r}")
    if not reqs:
        return Placement(())
    shown = ordered
    note = ""
    if different_pfs:
        # A request's interfaces on different PFs is exactly each PF offering it one VF.
        ordered = [replace(pf, free_vfs=min(pf.free_vfs, 1)) for pf in ordered]
        note = " (each on a different PF)"
    if any(r.pf is not None or r.rail is not None for r in reqs):
        from rdma_cni.shared.constrained import place_constrained

        return place_constrained(reqs, ordered, shown, preferred_numa, policy, max_steps, note)
    return _place_plain(reqs, ordered, preferred_numa, policy, max_steps, shown, note)


def _place_plain(
    reqs: tuple[Request, ...],
    ordered: list[PfState],
    preferred_numa: int | None,
    policy: Policy,
    max_steps: int | None,
    shown: Sequence[PfState] | None = None,
    note: str = "",
) -> Placement:
    """:func:`place` for validated requests without ``pf`` or ``rail``, PFs in name order."""
    problem = _Problem(reqs, ordered, preferred_numa, policy, shown, note)
    slack = problem.hall_slack()
    problem.check_bandwidth()
    assign, fixed, steps = problem.search(slack, max_steps)
    return Placement(problem.finish(assign, fixed), steps)
