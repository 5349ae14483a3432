"""Stage 3 of placement's search: bin completion, one PF filled at a time (see the package docstring)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Collection, Sequence

from rdma_cni.shared.placement.fillings import (
    _SETS_PER_STEP,
    _best_subset_sum,
    _Filling,
    _Fillings,
    _Items,
    _sorted_arrays,
)
from rdma_cni.shared.placement.model import _UNLIMITED, _OutOfSteps

# The bin completion search charges _NODE_STEPS per node, one step per
# enumeration it starts (of a PF's fillings or of its best sum) and one per
# _SETS_PER_STEP sets it enumerates (see fillings). The weights come from
# timing the benchmark's hardest inputs, so that a step costs about the same
# wherever it is spent.
_NODE_STEPS = 4
# At each node, a bin's completions are enumerated only while they are fewer
# than this (or than the best branching found so far).
_FIRST_CAP = 4


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


def _l2_holds_weighted(
    fitting: list[tuple[int, list[int]]], usable: Collection[int], free: Sequence[int], vfs: Sequence[int]
) -> bool:
    """:func:`_l2_holds` under three weightings of a PF's VFs against its bandwidth.

    ``fitting`` holds each min-rate request's rate and the PFs it fits; a PF's
    room weighs ``free + lam * vfs`` and a request ``rate + lam``, for lam 0
    (bandwidth alone), the median rate, and more than any PF's bandwidth (VFs
    alone). False proves the requests cannot be placed on ``usable``.
    """
    sizes = sorted(x for x, _ in fitting)
    for lam in (0, sizes[len(sizes) // 2], max(free[k] for k in usable) + 1):
        rooms = sorted(free[k] + lam * vfs[k] for k in usable)
        pieces = [
            (
                x + lam,
                min(free[k] + lam * vfs[k] for k in js),
                max(free[k] + lam * vfs[k] for k in js),
            )
            for x, js in fitting
        ]
        if not _l2_holds(pieces, rooms):
            return False
    return True
