"""The placement model: requests, PF states, the answer and NoFit, validated; messages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Policy = Literal["best_fit", "numa_first"]

# About 10 ms of search on a slow server core. See "Step budget".
DEFAULT_MAX_STEPS = 1000


def _is_int(value: object) -> bool:
    # bool is an int subclass; True VFs would be a caller bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{what} must not be negative, got {value}")


def _check_label(value: object, what: str) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{what} must be a non-empty string or None, got {value!r}")


def _check_request(req: object) -> None:
    if not isinstance(req, Request):
        raise ValueError(f"expected a Request, got {req!r}")
    _check_count(req.min_tx_rate, "min_tx_rate")
    _check_count(req.max_tx_rate, "max_tx_rate")
    if req.max_tx_rate and req.max_tx_rate < req.min_tx_rate:
        raise ValueError(
            f"max_tx_rate {req.max_tx_rate} is below min_tx_rate {req.min_tx_rate} (use 0 for no cap)"
        )
    _check_label(req.pf, "pf")
    _check_label(req.rail, "rail")
    if req.pf is not None and req.rail is not None:
        raise ValueError(f"a request names a PF ({req.pf!r}) or a rail ({req.rail!r}), not both")


def _check_pf(pf: object) -> None:
    if not isinstance(pf, PfState):
        raise ValueError(f"expected a PfState, got {pf!r}")
    if not isinstance(pf.name, str) or not pf.name:
        raise ValueError(f"PF name must be a non-empty string, got {pf.name!r}")
    _check_count(pf.free_vfs, f"{pf.name}: free_vfs")
    if pf.capacity_mbps is not None:
        _check_count(pf.capacity_mbps, f"{pf.name}: capacity_mbps")
    _check_count(pf.reserved_mbps, f"{pf.name}: reserved_mbps")
    if pf.numa_node is not None and not _is_int(pf.numa_node):
        raise ValueError(f"{pf.name}: numa_node must be an integer or None, got {pf.numa_node!r}")
    _check_label(pf.rail, f"{pf.name}: rail")


@dataclass(frozen=True)
class Request:
    """One requested interface: ``min_tx_rate`` is reserved, ``max_tx_rate`` caps (0 = no cap); Mbit/s.

    ``pf`` (a PF name) or ``rail`` (a PF's rail label), at most one of them,
    restricts the PFs it may go on; see "Constraints".
    """

    min_tx_rate: int = 0
    max_tx_rate: int = 0
    pf: str | None = None
    rail: str | None = None

    def __post_init__(self) -> None:
        _check_request(self)


@dataclass(frozen=True)
class PfState:
    """What a PF has free: VFs, link capacity (None = unknown) and bandwidth already reserved.

    ``rail`` is the operator's label for the PF in the network's PF list
    (None: no rail); requests naming a rail go only on PFs with that label.
    """

    name: str
    free_vfs: int
    capacity_mbps: int | None
    reserved_mbps: int = 0
    numa_node: int | None = None
    rail: str | None = None

    def __post_init__(self) -> None:
        _check_pf(self)

    @property
    def free_mbps(self) -> int | None:
        """Bandwidth still reservable (never negative), or None when the capacity is unknown."""
        if self.capacity_mbps is None:
            return None
        return max(0, self.capacity_mbps - self.reserved_mbps)


@dataclass(frozen=True)
class Placement:
    """The chosen PF name for each request, in request order, and the search steps spent."""

    pfs: tuple[str, ...]
    steps: int = 0


class NoFit(Exception):
    """No assignment of the requests to PFs fits; the message says what was asked and what is free.

    ``reason`` is one of ``"vfs"`` (too few free VFs in total), ``"unknown_capacity"``
    (min-rate requests but only PFs of unknown capacity have VFs for them),
    ``"max_rate"`` (too few VFs on PFs whose capacity reaches the requested
    caps), ``"bandwidth"`` (the min rates cannot be arranged on the PFs) or
    ``"search_limit"`` (the step budget ran out before an answer) or
    ``"constraint"`` (a request's ``pf`` or ``rail`` names no PF given, or
    leaves a request no PF it may use).
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        requested: tuple[Request, ...],
        free_vfs: int,
        free_mbps: dict[str, int | None],
        largest_unplaced: Request | None,
        steps: int = 0,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.requested = requested
        self.free_vfs = free_vfs
        self.free_mbps = free_mbps
        self.largest_unplaced = largest_unplaced
        self.steps = steps


class _OutOfSteps(Exception):
    pass


class _NoArrangement(Exception):
    pass


_UNLIMITED = 1 << 62


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _shown(name: str) -> str:
    # PF names come from node states, and the kernel allows an ESC in one: never raw in a message
    # (the package stays self-contained, so this is shared/quote's escape, written out).
    return name if name.isprintable() else repr(name)[1:-1]


def free_summary(pfs: Sequence[PfState]) -> str:
    """One line describing what each PF has free, by PF name, for error messages."""
    parts = []
    for pf in sorted(pfs, key=lambda p: p.name):
        if pf.capacity_mbps is None:
            bandwidth = "capacity unknown"
        else:
            bandwidth = f"{pf.free_mbps} of {pf.capacity_mbps} Mbit/s free"
        parts.append(f"{_shown(pf.name)}: {_plural(pf.free_vfs, 'VF')}, {bandwidth}")
    return "; ".join(parts) if parts else "no PFs"


def _sort_key(req: Request) -> tuple[int, int]:
    # Largest first: by min rate, then by cap with "no cap" (0) smallest.
    return (-req.min_tx_rate, -req.max_tx_rate)
