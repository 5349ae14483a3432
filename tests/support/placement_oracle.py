"""An independent checker for placements, shared by the placement tests and benchmark.

Written straight from the rules in rdma_cni.shared.placement's docstring, sharing no
code with the module, so that agreement with it means something.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from rdma_cni.shared.placement import PfState, Request


def allowed_on(req: Request, pf: PfState) -> bool:
    """Whether ``req`` may go on ``pf`` at all, ignoring VFs and other requests."""
    if req.pf is not None and req.pf != pf.name:
        return False
    if req.rail is not None and req.rail != pf.rail:
        return False
    if pf.capacity_mbps is None:
        return req.min_tx_rate == 0
    return req.max_tx_rate <= pf.capacity_mbps


def assignment_ok(
    requests: Sequence[Request], pfs: Sequence[PfState], names: Sequence[str], different_pfs: bool = False
) -> bool:
    """Every rule of a placement: VF counts, bandwidth, caps, unknown capacity, pf, rail, different PFs."""
    if len(names) != len(requests):
        return False
    if different_pfs and len(set(names)) != len(names):
        return False
    by_name = {pf.name: pf for pf in pfs}
    count: dict[str, int] = {}
    load: dict[str, int] = {}
    for req, name in zip(requests, names, strict=True):
        pf = by_name.get(name)
        if pf is None or not allowed_on(req, pf):
            return False
        count[name] = count.get(name, 0) + 1
        load[name] = load.get(name, 0) + req.min_tx_rate
    for name, used in count.items():
        pf = by_name[name]
        if used > pf.free_vfs:
            return False
        if load[name] and pf.reserved_mbps + load[name] > (pf.capacity_mbps or 0):
            return False
    return True


def brute_force(
    requests: Sequence[Request], pfs: Sequence[PfState], different_pfs: bool = False
) -> tuple[str, ...] | None:
    """Some valid placement, trying every PF for every request, or None."""
    for names in itertools.product([pf.name for pf in pfs], repeat=len(requests)):
        if assignment_ok(requests, pfs, names, different_pfs):
            return names
    return None


def reference_fits(requests: Sequence[Request], pfs: Sequence[PfState], different_pfs: bool = False) -> bool:
    """Exact but plain: request by request, every PF, memo on the full (unsorted) state.

    For inputs too large for :func:`brute_force`; ``different_pfs`` is one VF per PF.
    """
    failed: set[tuple[int, tuple[tuple[int, int], ...]]] = set()

    def go(i: int, state: tuple[tuple[int, int], ...]) -> bool:
        if i == len(requests):
            return True
        if (i, state) in failed:
            return False
        req = requests[i]
        for j, pf in enumerate(pfs):
            vfs, load = state[j]
            if not vfs or not allowed_on(req, pf):
                continue
            if req.min_tx_rate and pf.reserved_mbps + load + req.min_tx_rate > (pf.capacity_mbps or 0):
                continue
            nxt = (*state[:j], (vfs - 1, load + req.min_tx_rate), *state[j + 1 :])
            if go(i + 1, nxt):
                return True
        failed.add((i, state))
        return False

    return go(0, tuple((min(pf.free_vfs, 1) if different_pfs else pf.free_vfs, 0) for pf in pfs))
