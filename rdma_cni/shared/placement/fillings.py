"""The fillings of one PF for bin completion (stage 3, see the package docstring and bincompletion).

A PF's best sum of remaining items (a small branch and bound), and the
enumeration of its undominated fillings; :class:`~rdma_cni.shared.placement.bincompletion._BinCompletion`
drives both and counts their work.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING

from rdma_cni.shared.placement.model import _UNLIMITED

if TYPE_CHECKING:
    from rdma_cni.shared.placement.bincompletion import _BinCompletion

# One step of the bin completion search per _SETS_PER_STEP sets enumerated.
_SETS_PER_STEP = 16


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
