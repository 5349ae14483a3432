"""One call of place() without constraints: necessary conditions, the searches in turn, the answer."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from rdma_cni.shared.placement.bincompletion import _BinCompletion, _l2_holds_weighted
from rdma_cni.shared.placement.itemsearch import _ItemSearch
from rdma_cni.shared.placement.model import (
    _UNLIMITED,
    NoFit,
    PfState,
    Placement,
    Policy,
    Request,
    _NoArrangement,
    _OutOfSteps,
    _plural,
    _sort_key,
    free_summary,
)

# Steps the item-by-item search gets before the bin completion search takes
# over; enough for best fit and short repairs of it.
_FIRST_SHARE = 64


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
            # Under different_pfs each PF offers one VF: say PFs, not VFs.
            have = (
                _plural(self.total_vfs, "PF") + " with a free VF"
                if self.note
                else _plural(self.total_vfs, "free VF")
            )
            raise self._fail(
                "vfs",
                f" but the node has {have}",
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
        return _l2_holds_weighted(fitting, usable, free0, vfs0)

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
