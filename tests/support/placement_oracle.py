"""An independent checker for placements, shared by the placement tests and benchmark.

Written straight from the rules in rdma_cni.shared.placement's docstring, sharing no
code with the module, so that agreement with it means something.
"""

from __future__ import annotations

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
