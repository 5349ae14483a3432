"""Baseline for the placement benchmark: the original research system's algorithm.

Re-implemented from its published description, not from its code: an
iterative backtracking search that takes the interfaces in request order and,
for each, tries every PF in order, accepting a PF when it has a free VF and
its remaining bandwidth covers the interface's min rate. On a dead end it
backtracks to the previous interface's next PF. It returns the first complete
assignment, or None once every combination has been tried. There is no
symmetry breaking, no memo and no bound, so proving that nothing fits costs
up to (number of PFs) ** (number of interfaces) steps.

The description checks only VFs and min rates: max rates are not checked,
and a PF of unknown capacity counts as having no bandwidth (so it takes only
interfaces without a min rate). The benchmark keeps every max rate within
every PF's capacity so that both algorithms answer the same question.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rdma_cni.shared.placement import PfState, Request

# Reading the clock on every step would dominate the cost of a step.
_CLOCK_EVERY = 4096


class Timeout(Exception):
    """The search was still running at its deadline."""


def place_backtracking(
    requests: Sequence[Request], pfs: Sequence[PfState], *, deadline: float | None = None
) -> tuple[str, ...] | None:
    """The chosen PF name per request, or None when nothing fits; Timeout past ``deadline``.

    ``deadline`` is a :func:`time.perf_counter` value.
    """
    n = len(requests)
    m = len(pfs)
    vfs = [pf.free_vfs for pf in pfs]
    room = [max(0, pf.capacity_mbps - pf.reserved_mbps) if pf.capacity_mbps is not None else 0 for pf in pfs]
    need = [req.min_tx_rate for req in requests]
    choice = [-1] * n
    i = 0
    ticks = 0
    while 0 <= i < n:
        ticks += 1
        if deadline is not None and ticks % _CLOCK_EVERY == 0 and time.perf_counter() > deadline:
            raise Timeout
        j = choice[i]
        if j >= 0:
            # Take back this interface's current PF before trying the next one.
            vfs[j] += 1
            room[j] += need[i]
        j += 1
        while j < m and (vfs[j] == 0 or room[j] < need[i]):
            j += 1
        if j < m:
            vfs[j] -= 1
            room[j] -= need[i]
            choice[i] = j
            i += 1
        else:
            choice[i] = -1
            i -= 1
    if i < 0:
        return None
    return tuple(pfs[j].name for j in choice)
