"""Stage 2 of placement's search: the item-by-item search (see the package docstring).

Driven by :class:`~rdma_cni.shared.placement.problem._Problem`, which owns
the arrays it reads, the necessary conditions and the step budget's split.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import TYPE_CHECKING

from rdma_cni.shared.placement.model import _UNLIMITED, _NoArrangement, _OutOfSteps

if TYPE_CHECKING:
    from rdma_cni.shared.placement.problem import _Problem


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
