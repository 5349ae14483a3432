"""Placement with per-interface constraints: a request may name a PF (``pf``) or a rail (``rail``).

Pure computation, standard library only, called by :func:`rdma_cni.shared.placement.place`
when some request names a PF or a rail (``different_pfs`` needs no search of
its own: place() gives each PF one VF for the request first).

How an exact answer is kept
---------------------------
1. Names are resolved first: a ``pf`` that is not one of the PFs given, or a
   ``rail`` no PF given carries, is a no-fit (reason ``"constraint"``): PF
   names and rails are facts of a node and its network, so on another node
   the same request may fit. The message names the field (``entry 2.rail``).
2. Requests naming a PF have one choice: they are placed there first, by
   the plain search on that PF alone, and the PF keeps what they leave.
3. The other requests may use all PFs (no constraint) or their rail's PFs.
   Linking the PFs a request may use splits the PFs into independent
   components. A component where every request may use every PF of the
   component is the plain problem, solved by the plain search (all its
   bounds and its bin completion). Rails are disjoint, so a request whose
   interfaces all name rails splits into one plain problem per rail.
4. What is left (requests with a rail beside requests without one) goes to
   :class:`~rdma_cni.shared.placement.mixed._Search`: depth-first over the min-rate requests, largest first,
   each on the PFs it may use (best fit first), with PFs that are
   interchangeable for every request tried once, failed states remembered,
   and Hall's condition, on VF counts and on bandwidth, checked for the PF
   set of every request at each node. Requests without a min rate are
   matched to the VFs left at the end (a bipartite matching, exact).
5. That search decides most inputs in a few dozen steps. When it has had
   3/5 of the budget (at most 1,000 steps) without deciding, the same
   requests with their rails set aside go to the plain search (2/5 of the
   budget, at most 1,000 steps). That is a relaxation: every placement
   keeping the rails is one of its placements, so its no-fit is a proof,
   and a fit it finds that happens to keep every rail is an answer.
6. Still undecided, the search starts again in another order: the requests
   with a rail first. Once they are placed, what is left (requests that may
   use every PF of the component) is the plain problem on the PFs' remaining
   VFs and bandwidth, so each such state is handed to the plain search, all
   its bounds and bin completion included; a failed state is remembered like
   any other. This needs every request without a min rate to have no rail
   (they are matched at the end otherwise); if one has, the search of 4
   goes on instead. Exact either way, and with an unlimited budget 6 ends
   with an answer.

The step budget is shared by all the searches of one call; running out
raises :class:`~rdma_cni.shared.placement.NoFit` with reason ``"search_limit"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from rdma_cni.shared.placement.mixed import _entries, _Search
from rdma_cni.shared.placement.model import (
    NoFit,
    PfState,
    Placement,
    Policy,
    Request,
    _plural,
    free_summary,
)
from rdma_cni.shared.placement.problem import _place_plain

__all__ = ["place_constrained"]


def _names(values: Sequence[str | None]) -> str:
    named = sorted({v for v in values if v is not None})
    return ", ".join(repr(v) for v in named) if named else "none"


class _Context:
    """One call of place() with constraints: its inputs, the steps spent, and how to say no."""

    def __init__(
        self,
        reqs: tuple[Request, ...],
        pfs: list[PfState],
        shown: Sequence[PfState],
        preferred_numa: int | None,
        policy: Policy,
        max_steps: int | None,
        note: str,
    ) -> None:
        self.reqs = reqs
        self.pfs = pfs
        self.shown = shown
        self.preferred_numa = preferred_numa
        self.policy = policy
        self.max_steps = max_steps
        self.note = note
        self.steps = 0

    def budget(self) -> int | None:
        """Steps left for the next search (None: unlimited)."""
        if self.max_steps is None:
            return None
        return self.max_steps - self.steps

    def fail(self, reason: str, detail: str, unplaced: Request | None) -> NoFit:
        """A NoFit for the whole request: ``detail`` follows the head, the free summary ends it."""
        mins = ", ".join(str(r.min_tx_rate) for r in self.reqs)
        head = f"{_plural(len(self.reqs), 'interface')}{self.note} requested (min rates {mins} Mbit/s)"
        return NoFit(
            f"{head}: {detail} ({free_summary(self.shown)})",
            reason=reason,
            requested=self.reqs,
            free_vfs=sum(pf.free_vfs for pf in self.pfs),
            free_mbps={pf.name: pf.free_mbps for pf in self.shown},
            largest_unplaced=unplaced,
            steps=self.steps,
        )

    def plain(self, items: list[int], pfs: list[PfState], where: str) -> tuple[str, ...]:
        """The plain search for ``items`` on ``pfs``; its NoFit said of the whole request, ``where`` first."""
        budget = self.budget()
        sub = tuple(replace(self.reqs[i], pf=None, rail=None) for i in items)
        if budget is not None and budget < 1:
            raise self.fail("search_limit", f"{where}: the search step budget is spent", sub[0])
        try:
            got = _place_plain(sub, pfs, self.preferred_numa, self.policy, budget)
        except NoFit as exc:
            self.steps += exc.steps
            raise self.fail(exc.reason, f"{where}: {_detail(exc, sub, pfs)}", exc.largest_unplaced) from None
        self.steps += got.steps
        return got.pfs

    def relaxed(self, items: list[int], pfs: list[PfState], share: int) -> tuple[str, ...] | None:
        """The plain search for ``items`` on ``pfs`` with their rails set aside, within ``share`` steps.

        A relaxation of the mixed problem (every placement keeping the rails is
        one of its placements): no fit without the rails proves none with them
        (NoFit, said of the whole request); a fit is returned for the caller to
        check against the rails; None when the share ran out.
        """
        budget = self.budget()
        if budget is not None:
            share = min(share, budget)
        if share < 1:
            return None
        sub = tuple(replace(self.reqs[i], pf=None, rail=None) for i in items)
        try:
            got = _place_plain(sub, pfs, self.preferred_numa, self.policy, share)
        except NoFit as exc:
            self.steps += exc.steps
            if exc.reason == "search_limit":
                return None
            detail = f"{_entries(items)}: even with their rails set aside, {_detail(exc, sub, pfs)}"
            raise self.fail(exc.reason, detail, exc.largest_unplaced) from None
        self.steps += got.steps
        return got.pfs


def _detail(exc: NoFit, sub: tuple[Request, ...], pfs: list[PfState]) -> str:
    """The plain search's message without its head and free summary: the whole request's replace them."""
    mins = ", ".join(str(r.min_tx_rate) for r in sub)
    head = f"{_plural(len(sub), 'interface')} requested (min rates {mins} Mbit/s)"
    text = exc.message.removeprefix(head).removesuffix(f" ({free_summary(pfs)})")
    return text.removeprefix(" but ").removeprefix(": ").replace("the node has", "those PFs have")


def place_constrained(
    reqs: tuple[Request, ...],
    pfs: list[PfState],
    shown: Sequence[PfState],
    preferred_numa: int | None,
    policy: Policy,
    max_steps: int | None,
    note: str = "",
) -> Placement:
    """:func:`~rdma_cni.shared.placement.place` for validated requests of which some name a PF or rail.

    ``pfs`` are in name order (with one VF each under ``different_pfs``),
    ``shown`` is what messages describe.
    """
    ctx = _Context(reqs, pfs, shown, preferred_numa, policy, max_steps, note)
    index = {pf.name: j for j, pf in enumerate(pfs)}
    rails: dict[str, list[int]] = {}
    for j, pf in enumerate(pfs):
        if pf.rail is not None:
            rails.setdefault(pf.rail, []).append(j)
    # 1. Names resolve, or the request cannot fit here.
    for i, req in enumerate(reqs):
        if req.pf is not None and req.pf not in index:
            raise ctx.fail(
                "constraint",
                f"entry {i}.pf: {req.pf!r} is not one of the network's PFs here "
                f"(PFs here: {_names([pf.name for pf in pfs])})",
                req,
            )
        if req.rail is not None and req.rail not in rails:
            raise ctx.fail(
                "constraint",
                f"entry {i}.rail: no PF of the network here has rail {req.rail!r} "
                f"(rails here: {_names([pf.rail for pf in pfs])})",
                req,
            )
    chosen: list[str] = [""] * len(reqs)
    state = list(pfs)
    # 2. Requests naming a PF go there: one plain search per such PF.
    pinned: dict[int, list[int]] = {}
    for i, req in enumerate(reqs):
        if req.pf is not None:
            pinned.setdefault(index[req.pf], []).append(i)
    for j, items in sorted(pinned.items()):
        pf = state[j]
        ctx.plain(items, [pf], f"{_entries(items)} (pf {pf.name!r})")
        state[j] = replace(
            pf,
            free_vfs=pf.free_vfs - len(items),
            reserved_mbps=pf.reserved_mbps + sum(reqs[i].min_tx_rate for i in items),
        )
        for i in items:
            chosen[i] = pf.name
    # 3. The others, by component of the PFs they may use.
    allowed = {
        i: (rails[req.rail] if req.rail is not None else list(range(len(pfs))))
        for i, req in enumerate(reqs)
        if req.pf is None
    }
    for comp_pfs, items in _components(allowed, len(pfs)):
        members = set(comp_pfs)
        sub = [state[j] for j in comp_pfs]
        if all(set(allowed[i]) == members for i in items):
            rail = {reqs[i].rail for i in items}
            where = f"{_entries(items)} (rail {rail.pop()!r})" if None not in rail else _entries(items)
            for i, name in zip(items, ctx.plain(items, sub, where), strict=True):
                chosen[i] = name
        else:
            local = {j: k for k, j in enumerate(comp_pfs)}
            search = _Search(ctx, items, {i: [local[j] for j in allowed[i]] for i in items}, sub)
            for i, k in search.run().items():
                chosen[i] = sub[k].name
    return Placement(tuple(chosen), ctx.steps)


def _components(allowed: dict[int, list[int]], n_pfs: int) -> list[tuple[list[int], list[int]]]:
    """(PFs, requests) of each component linked by the requests' PF sets, in PF order."""
    parent = list(range(n_pfs))

    def root(j: int) -> int:
        while parent[j] != j:
            parent[j] = parent[parent[j]]
            j = parent[j]
        return j

    for js in allowed.values():
        for j in js[1:]:
            a, b = root(js[0]), root(j)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for i, js in sorted(allowed.items()):
        groups.setdefault(root(js[0]), ([], []))[1].append(i)
    for j in range(n_pfs):
        if root(j) in groups:
            groups[root(j)][0].append(j)
    return [groups[r] for r in sorted(groups)]
