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

Constraints
-----------
A request may name the PF it must go on (``Request.pf``) or a rail
(``Request.rail``: it goes on a PF whose ``PfState.rail`` is that label), and
``place(..., different_pfs=True)`` puts every request on a different PF.
``different_pfs`` is the same problem with each PF offering the call one VF,
so everything above applies unchanged. Requests naming a PF or rail are
decided by :mod:`rdma_cni.shared.placement.constrained`: names this call's
PFs do not have are a no-fit (reason ``"constraint"``), requests naming a PF
are placed there first, and the rest split into independent problems where
they can (one per rail when every request names a rail), each decided by the
search above; only requests with and without a rail sharing PFs need a
search of their own. Exact as well, within the same step budget.

Layout: :mod:`~rdma_cni.shared.placement.model` (the dataclasses, NoFit,
messages), :mod:`~rdma_cni.shared.placement.problem` (necessary conditions,
the searches in turn, the answer), :mod:`~rdma_cni.shared.placement.itemsearch`
(stage 2), :mod:`~rdma_cni.shared.placement.bincompletion` (stage 3) with
:mod:`~rdma_cni.shared.placement.fillings` (one PF's fillings),
:mod:`~rdma_cni.shared.placement.constrained` (constraints) and
:mod:`~rdma_cni.shared.placement.mixed` (its search for requests with and
without a rail sharing PFs).

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

from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise

from rdma_cni.shared.placement.constrained import place_constrained
from rdma_cni.shared.placement.model import (
    DEFAULT_MAX_STEPS,
    NoFit,
    PfState,
    Placement,
    Policy,
    Request,
    _check_pf,
    _check_request,
    _is_int,
    free_summary,
)
from rdma_cni.shared.placement.problem import _place_plain

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
        return place_constrained(reqs, ordered, shown, preferred_numa, policy, max_steps, note)
    return _place_plain(reqs, ordered, preferred_numa, policy, max_steps, shown, note)
