"""The search for requests with a rail beside requests without one on shared PFs.

Pure computation, standard library only: steps 4 to 6 of
:mod:`rdma_cni.shared.placement.constrained` (see its docstring), which
resolves names, places requests naming a PF and splits the rest into
components, and hands a component here when its requests with a rail and
without one share PFs.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from rdma_cni.shared.placement.bincompletion import _l2_holds_weighted
from rdma_cni.shared.placement.model import DEFAULT_MAX_STEPS, NoFit, PfState, Request, _sort_key
from rdma_cni.shared.placement.problem import _place_plain

if TYPE_CHECKING:
    from rdma_cni.shared.placement.constrained import _Context

_UNLIMITED = 1 << 62
# Steps a node of _Search costs, so that a step costs about what a step of
# the plain search does (timed on the constrained benchmark's inputs).
_NODE_STEPS = 2
# The mixed search's phases (see run()): the item search in its first order gets 3/5 of the
# budget and the relaxation without rails 2/5 of it, each at most _PHASE_CAP steps; the search
# with rail requests first gets the rest. Tuned on the constrained benchmark's worst-case family:
# the first order decides what it decides within 940 steps, the other after more.
_PHASE_CAP = DEFAULT_MAX_STEPS
# Steps a hand-off to the plain search costs besides its own steps (its set-up), so that a step
# of the search with rail requests first costs about what one of the others does (timed on the
# constrained benchmark's worst-case family).
_HANDOFF_STEPS = 16


def _entries(indices: Sequence[int]) -> str:
    return ("entry " if len(indices) == 1 else "entries ") + ", ".join(str(i) for i in sorted(indices))


def _match(eligible: list[list[int]], capacity: list[int]) -> list[int] | None:
    """A PF for each item among its ``eligible`` ones, at most ``capacity[j]`` per PF; None if impossible.

    Augmenting paths (Kuhn's algorithm with capacities): exact.
    """
    holders: list[list[int]] = [[] for _ in capacity]
    where = [-1] * len(eligible)

    def augment(i: int, seen: set[int]) -> bool:
        for j in eligible[i]:
            if j in seen:
                continue
            seen.add(j)
            if len(holders[j]) < capacity[j]:
                holders[j].append(i)
                where[i] = j
                return True
            for k in list(holders[j]):
                if augment(k, seen):
                    holders[j].remove(k)
                    holders[j].append(i)
                    where[i] = j
                    return True
        return False

    for i in range(len(eligible)):
        if not augment(i, set()):
            return None
    return where


class _Search:
    """Exact search for one component where requests with a rail and without one share PFs.

    State: free VFs and bandwidth per PF (``vfs``, ``free``), the PF of each
    min-rate request placed so far (``assign``), failed states (``failed``).
    With ``handoff`` (and every request without a min rate free to use every
    PF) the requests with a rail come first and the plain search places the
    rest at depth ``handoff``; otherwise ``handoff`` is -1.
    """

    def __init__(
        self,
        ctx: _Context,
        items: list[int],
        sets: dict[int, list[int]],
        pfs: list[PfState],
        handoff: bool = False,
    ) -> None:
        self.ctx = ctx
        self.args = (items, sets)
        self.pfs = pfs
        reqs = ctx.reqs
        self.known = [pf.capacity_mbps is not None for pf in pfs]
        self.vfs = [pf.free_vfs for pf in pfs]
        # -1 keeps unknown-capacity PFs out of every "free >= min" test.
        self.free = [pf.free_mbps if pf.free_mbps is not None else -1 for pf in pfs]
        self.numa = [
            0 if ctx.preferred_numa is not None and pf.numa_node == ctx.preferred_numa else 1 for pf in pfs
        ]
        self.numa_first = ctx.policy == "numa_first"
        self.used = [0] * len(pfs)
        # The PFs each request may use: its constraint, the cap and capacity rules, a free VF.
        self.eligible = {i: [k for k in sets[i] if self._allowed(reqs[i], k)] for i in items}
        for i in items:
            if not self.eligible[i]:
                raise ctx.fail(
                    "constraint",
                    f"entry {i}{self._what(i)} fits on none of the PFs it may use",
                    reqs[i],
                )
        # Min-rate requests, largest first, the most constrained first among equals.
        self.order = sorted(
            (i for i in items if reqs[i].min_tx_rate),
            key=lambda i: (_sort_key(reqs[i]), len(self.eligible[i]), tuple(self.eligible[i]), i),
        )
        self.zero = sorted(
            (i for i in items if not reqs[i].min_tx_rate),
            key=lambda i: (len(self.eligible[i]), -reqs[i].max_tx_rate, i),
        )
        # Requests that may use every PF of the component (no rail) are a plain problem once the
        # others are placed: when every request without a min rate is one of them, the search
        # places the restricted ones first and hands the rest to the plain search.
        free = {i for i in items if len(sets[i]) == len(pfs)}
        self.handoff = -1
        if handoff and all(i in free for i in self.zero):
            restricted = [i for i in self.order if i not in free]
            self.order = restricted + [i for i in self.order if i in free]
            self.handoff = len(restricted)
        self.weights = [reqs[i].min_tx_rate for i in self.order]
        suffix = [0]
        for w in reversed(self.weights):
            suffix.append(suffix[-1] + w)
        self.rest = suffix[::-1]  # rest[d]: the min rates of order[d:]
        # Per depth, the min rates left largest first from index ``start`` on (negated, for
        # bisecting), their prefix sums, sums of the k smallest, and the smallest. Largest first
        # overall, one set of lists serves every depth; rail requests first, each depth has its own.
        self.left: list[tuple[list[int], list[int], list[int], int, int]] = []
        for d in range(len(self.weights) + 1):
            if d and self.handoff < 0:
                self.left.append((*self.left[0][:3], d, self.left[0][4]))
                continue
            ws = sorted(self.weights[d:], reverse=True)
            prefix = [0]
            for w in ws:
                prefix.append(prefix[-1] + w)
            smalls = [0]
            for w in reversed(ws):
                smalls.append(smalls[-1] + w)
            self.left.append(([-w for w in ws], prefix, smalls, 0, ws[-1] if ws else 0))
        self.classes = self._classes(items)
        self.groups = self._groups(items, sets)
        self.assign: dict[int, int] = {}
        self.states: dict[tuple[int, int, int], PfState] = {}  # a PF as the plain search sees it
        self.plain_reqs: tuple[Request, ...] | None = None
        self.failed: set[tuple[int, tuple[tuple[int, int, int], ...]]] = set()
        self.deepest = 0

    # -- set-up -------------------------------------------------------------

    def _allowed(self, req: Request, k: int) -> bool:
        pf = self.pfs[k]
        if not pf.free_vfs:
            return False
        if pf.capacity_mbps is None:
            return req.min_tx_rate == 0
        return req.max_tx_rate <= pf.capacity_mbps and req.min_tx_rate <= self.free[k]

    def _what(self, i: int) -> str:
        req = self.ctx.reqs[i]
        return f" (rail {req.rail!r})" if req.rail is not None else ""

    def _classes(self, items: list[int]) -> list[int]:
        """Per PF, a class id: PFs in one class are interchangeable for every request."""
        ids: dict[tuple[bool, ...], int] = {}
        out = []
        for k in range(len(self.pfs)):
            sig = (self.known[k], *(k in self.eligible[i] for i in items))
            out.append(ids.setdefault(sig, len(ids)))
        return out

    def _groups(
        self, items: list[int], sets: dict[int, list[int]]
    ) -> list[tuple[list[int], list[int], list[int], int, list[bool]]]:
        """Hall's sets: per PF set S of some request's constraint (and all PFs), the PFs of S, per
        depth the min rates and the number of min-rate requests that must go inside S, and
        the number of requests without a min rate that must, and which min-rate requests must."""
        # The constraints' sets (a rail's PFs, all PFs): few, so checking them at each node is cheap.
        chosen = {tuple(k for k in sets[i] if self.vfs[k]) for i in items} | {tuple(range(len(self.pfs)))}
        out = []
        for t in sorted(chosen):
            s = list(t)
            inside = set(s)
            within = [set(self.eligible[i]) <= inside for i in self.order]
            zeros = sum(1 for i in self.zero if set(self.eligible[i]) <= inside)
            rate = [0] * (len(self.order) + 1)
            count = [0] * (len(self.order) + 1)
            for d in range(len(self.order) - 1, -1, -1):
                rate[d] = rate[d + 1] + (self.weights[d] if within[d] else 0)
                count[d] = count[d + 1] + (1 if within[d] else 0)
            out.append((s, rate, count, zeros, within))
        return out

    # -- the search ---------------------------------------------------------

    def run(self) -> dict[int, int]:
        """The PF (local index) of every request, or NoFit."""
        ctx = self.ctx
        reqs = ctx.reqs
        if not self._hall_holds(0):
            raise ctx.fail(
                "vfs" if not self.order else "bandwidth",
                f"{_entries(list(self.eligible))}: too few free VFs or too little bandwidth "
                "on the PFs their constraints allow",
                reqs[self.order[0]] if self.order else reqs[self.zero[0]],
            )
        budget = ctx.budget()
        scale = _UNLIMITED if budget is None else budget
        # 1. Largest first, best fit first: decides most inputs in a few dozen steps.
        done, found = self._attempt(max(1, min(scale * 3 // 5, _PHASE_CAP)))
        search = self
        if not done:
            # 2. The plain search without the rails: its no-fit is a proof, its fit may keep them.
            relaxed = self._relaxed(max(1, min(scale * 2 // 5, _PHASE_CAP)))
            if relaxed is not None:
                return relaxed
            # 3. Rail requests first, then the plain search for the rest at each of their
            # placements (when every request without a min rate is free); else 1 goes on.
            other = _Search(ctx, *self.args, self.pfs, handoff=True)
            if other.handoff >= 0:
                search = other
            budget = ctx.budget()
            if budget is None or budget > 0:
                done, found = search._attempt(_UNLIMITED if budget is None else budget)
        if not done:
            raise ctx.fail(
                "search_limit",
                f"gave up after {ctx.steps} search steps without finding a placement "
                "or proving that none exists",
                search._unplaced(),
            )
        if found is None:
            raise ctx.fail(
                "bandwidth" if self.order else "vfs",
                f"{_entries(list(self.eligible))}: the min rates and VFs cannot be arranged "
                "on the PFs each interface may use",
                search._unplaced(),
            )
        out = dict(search.assign)
        out.update(found)
        return out

    def _unplaced(self) -> Request | None:
        """The request the search got stuck at: a min-rate one, else (all placed) one without."""
        reqs = self.ctx.reqs
        if self.deepest < len(self.order):
            return reqs[self.order[self.deepest]]
        return reqs[self.zero[0]] if self.zero else None

    def _attempt(self, stop_at: int) -> tuple[bool, dict[int, int] | None]:
        """The search within ``stop_at`` steps: (decided, its answer); the steps go to the context.

        Running out restores the state, so another attempt starts from the top
        again; the failed states it found stay known, so it soon gets back.
        """
        saved = (list(self.vfs), list(self.free), list(self.used), dict(self.assign))
        self.stop_at = stop_at
        self.spent = 0
        try:
            return True, self._dfs(0)
        except _OutOfSteps:
            self.vfs, self.free, self.used, self.assign = saved
            return False, None
        finally:
            self.ctx.steps += self.spent

    def _relaxed(self, share: int) -> dict[int, int] | None:
        """The plain search without the rails: NoFit if that has no fit, else its fit if it keeps them."""
        items = list(self.eligible)
        names = self.ctx.relaxed(items, self.pfs, share)
        if names is None:
            return None
        local = {pf.name: k for k, pf in enumerate(self.pfs)}
        out = {i: local[name] for i, name in zip(items, names, strict=True)}
        if all(out[i] in self.eligible[i] for i in items):
            return out
        return None

    def _hall_holds(self, depth: int) -> bool:
        """Each set S of PFs has the VFs and bandwidth the requests confined to S still need.

        A PF holds at most as many min-rate requests as its VFs allow and as the
        smallest ones left fit in its bandwidth, and at most its bandwidth or the
        sum of that many of the largest that fit it, whichever is less (as the
        plain search bounds it): what the PFs of S can hold must cover what
        must go inside S.
        """
        vfs, free = self.vfs, self.free
        negated, prefix, small_sums, start, smallest = self.left[depth]
        n = len(negated)
        left = n - start
        room = [0] * len(vfs)
        slots = [0] * len(vfs)
        if left:
            for k, v in enumerate(vfs):
                f = free[k]
                if not v or f < smallest:
                    continue
                c = v if v < left else left
                if small_sums[c] > f:
                    c = bisect_right(small_sums, f, 0, c + 1) - 1
                first = bisect_left(negated, -f, start)
                top = prefix[first + c if first + c < n else n] - prefix[first]
                room[k] = f if f < top else top
                slots[k] = c
        for s, rate, count, zeros, _within in self.groups:
            have_vfs = 0
            have_rate = 0
            have_slots = 0
            for k in s:
                have_vfs += vfs[k]
                have_rate += room[k]
                have_slots += slots[k]
            if count[depth] + zeros > have_vfs or count[depth] > have_slots or rate[depth] > have_rate:
                return False
        return True

    def _dff_holds(self, depth: int) -> bool:
        """The plain search's L2 bound (see ``_Problem.dff_bound_holds``) on each Hall set S.

        The min-rate requests confined to S must pack into the PFs of S by
        themselves (other requests only take more), so a failed bound there
        proves this state has no fit.
        """
        vfs, free = self.vfs, self.free
        for s, _rate, count, _zeros, within in self.groups:
            if not count[depth]:
                continue
            usable = [k for k in s if vfs[k] and free[k] > 0]
            if not usable:
                return False
            fitting = []
            for d in range(depth, len(self.order)):
                if not within[d]:
                    continue
                w = self.weights[d]
                js = [k for k in self.eligible[self.order[d]] if k in usable and free[k] >= w]
                if not js:
                    return False
                fitting.append((w, js))
            if not _l2_holds_weighted(fitting, usable, free, vfs):
                return False
        return True

    def _key(self, depth: int) -> tuple[int, tuple[tuple[int, int, int], ...]]:
        """The state up to interchangeable PFs; bandwidth no request left can use is merged."""
        rest = self.rest[depth]
        # The smallest min rate left (all placed: the smallest of all, as any value would do).
        small = self.left[depth][4] if depth < len(self.weights) else self.left[0][4]
        state = []
        for k, cls in enumerate(self.classes):
            v = self.vfs[k]
            f = self.free[k] if v else 0
            if f < small:
                f = 0
            elif f > rest:
                f = rest
            state.append((cls, v, f))
        state.sort()
        return depth, tuple(state)

    def _rank(self, k: int, w: int) -> tuple[int, ...]:
        if self.numa_first:
            return (self.numa[k], self.free[k] - w, self.used[k] > 0, k)
        return (self.free[k] - w, self.numa[k], self.used[k] > 0, k)

    def _dfs(self, depth: int) -> dict[int, int] | None:
        """Place order[depth:] and then the requests without a min rate; their PFs, or None."""
        if self.spent + _NODE_STEPS > self.stop_at:
            raise _OutOfSteps
        self.spent += _NODE_STEPS
        if not self._hall_holds(depth):
            self.deepest = max(self.deepest, depth)
            return None
        key = self._key(depth)
        if key in self.failed:
            return None
        if depth == 0 and self.order and not self._dff_holds(depth):
            self.failed.add(key)
            self.deepest = max(self.deepest, depth)
            return None
        if depth == self.handoff:
            got = self._plain_rest(depth)
            if got is None:
                self.failed.add(key)
                self.deepest = max(self.deepest, depth)
            return got
        if depth == len(self.order):
            got = self._finish()
            if got is None:
                self.failed.add(key)
            return got
        i = self.order[depth]
        w = self.weights[depth]
        tried: set[tuple[int, int, int]] = set()
        for k in sorted(
            (k for k in self.eligible[i] if self.vfs[k] and self.free[k] >= w), key=lambda k: self._rank(k, w)
        ):
            cls = (self.classes[k], self.vfs[k], self.free[k])
            if cls in tried:
                continue
            tried.add(cls)
            self.vfs[k] -= 1
            self.free[k] -= w
            self.used[k] += 1
            self.assign[i] = k
            got = self._dfs(depth + 1)
            if got is not None:
                return got
            del self.assign[i]
            self.vfs[k] += 1
            self.free[k] += w
            self.used[k] -= 1
        self.deepest = max(self.deepest, depth)
        self.failed.add(key)
        return None

    def _plain_rest(self, depth: int) -> dict[int, int] | None:
        """The requests left (none with a rail) on what the PFs have left, by the plain search."""
        items = self.order[depth:] + self.zero
        if not items:
            return {}
        if self.plain_reqs is None:
            # Always the same requests (those at depth handoff and on): made once.
            self.plain_reqs = tuple(replace(self.ctx.reqs[i], pf=None, rail=None) for i in items)
        # Setting up the plain search costs time its steps do not count.
        if self.stop_at - self.spent <= _HANDOFF_STEPS:
            raise _OutOfSteps
        self.spent += _HANDOFF_STEPS
        limit = None if self.stop_at == _UNLIMITED else self.stop_at - self.spent
        pfs = []
        cache = self.states
        for k, pf in enumerate(self.pfs):
            state = (k, self.vfs[k], self.free[k])
            got_pf = cache.get(state)
            if got_pf is None:
                # What is placed so far is reserved; a PF of unknown capacity took no min rate.
                got_pf = cache[state] = (
                    replace(pf, free_vfs=self.vfs[k], reserved_mbps=pf.capacity_mbps - self.free[k])
                    if pf.capacity_mbps is not None
                    else replace(pf, free_vfs=self.vfs[k])
                )
            pfs.append(got_pf)
        sub = self.plain_reqs
        try:
            got = _place_plain(sub, pfs, self.ctx.preferred_numa, self.ctx.policy, limit)
        except NoFit as exc:
            self.spent += exc.steps
            if exc.reason == "search_limit":
                raise _OutOfSteps from None
            return None
        self.spent += got.steps
        local = {pf.name: k for k, pf in enumerate(self.pfs)}
        return {i: local[name] for i, name in zip(items, got.pfs, strict=True)}

    def _finish(self) -> dict[int, int] | None:
        """The requests without a min rate on the VFs left: greedily, else by a matching."""
        self.spent += len(self.zero)
        vfs = list(self.vfs)
        used = list(self.used)
        out: dict[int, int] = {}

        def value(k: int) -> tuple[int, ...]:
            # The VF least useful to later min-rate requests, as the plain search's finish().
            usefulness = (int(self.known[k]), self.free[k])
            tail = (int(used[k] > 0), k)
            if self.numa_first:
                return (self.numa[k], *usefulness, *tail)
            return (*usefulness, self.numa[k], *tail)

        for i in self.zero:
            fits = [k for k in self.eligible[i] if vfs[k]]
            if not fits:
                break
            k = min(fits, key=value)
            out[i] = k
            vfs[k] -= 1
            used[k] += 1
        else:
            return out
        # Greedy is not exact for sets that are not nested: a matching is.
        self.spent += len(self.zero) * _NODE_STEPS
        got = _match([self.eligible[i] for i in self.zero], self.vfs)
        if got is None:
            return None
        return dict(zip(self.zero, got, strict=True))


class _OutOfSteps(Exception):
    pass
