"""Tests for rdma_cni.shared.placement: exactness against brute force, policy, errors, purity.

No root and no wall-clock assertions: timing is the benchmark's job
(benchmarks/placement_bench.py); here the worst cases only have to finish
well inside the step budget.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import random
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdma_cni.shared import placement
from rdma_cni.shared.placement import (
    DEFAULT_MAX_STEPS,
    NoFit,
    PfState,
    Placement,
    Request,
    bincompletion,
    free_summary,
    place,
    problem,
)
from tests.support.placement_oracle import allowed_on, assignment_ok, brute_force, reference_fits

ROOT = Path(__file__).resolve().parents[2]
REASONS = {"vfs", "unknown_capacity", "max_rate", "bandwidth"}
NAMES = ("enp1s0f0", "enp1s0f1", "enp2s0f0", "enp2s0f1", "ib0", "mlx5_3")

# ---------------------------------------------------------------- the oracle
# tests/support/placement_oracle.py: written straight from the rules in the
# module docstring, sharing no code with the module, so agreement means something.


def outcome(requests: Sequence[Request], pfs: Sequence[PfState], **kwargs: object) -> tuple[str, ...] | str:
    """The placement's PF names, or the NoFit reason."""
    try:
        return place(requests, pfs, **kwargs).pfs  # type: ignore[arg-type]
    except NoFit as exc:
        return exc.reason


# ---------------------------------------------------------------- strategies


@st.composite
def small_pfs(draw: st.DrawFn, max_pfs: int = 4) -> list[PfState]:
    """Up to ``max_pfs`` PFs with tiny numbers, so that ties and edge cases are common."""
    count = draw(st.integers(0, max_pfs))
    names = draw(st.permutations(NAMES))[:count]
    pfs = []
    for name in names:
        capacity = draw(st.sampled_from([None, 0, 1, 2, 3, 4, 6, 8]))
        reserved = 0 if capacity is None else draw(st.integers(0, 9))  # may exceed capacity
        pfs.append(
            PfState(
                name,
                draw(st.integers(0, 3)),
                capacity,
                reserved,
                draw(st.sampled_from([None, 0, 1])),
            )
        )
    return pfs


@st.composite
def small_requests(draw: st.DrawFn, max_requests: int = 5) -> list[Request]:
    """Up to ``max_requests`` requests; caps of 0 (none), equal to the min, or above it."""
    out = []
    for _ in range(draw(st.integers(0, max_requests))):
        low = draw(st.sampled_from([0, 0, 1, 2, 3, 4]))
        high = draw(st.sampled_from([0, low, low + 1, low + 4]))
        out.append(Request(low, high if high >= max(low, 1) else 0))
    return out


@st.composite
def symmetric_case(draw: st.DrawFn) -> tuple[list[Request], list[PfState]]:
    """Bigger inputs built from few PF and request templates: many interchangeable pieces."""
    templates = draw(
        st.lists(
            st.tuples(st.integers(0, 4), st.sampled_from([None, 0, 4, 6, 10]), st.integers(0, 4)),
            min_size=1,
            max_size=2,
        )
    )
    pfs = []
    for k in range(draw(st.integers(1, 6))):
        vfs, capacity, reserved = templates[draw(st.integers(0, len(templates) - 1))]
        pfs.append(PfState(f"pf{k}", vfs, capacity, 0 if capacity is None else reserved, k % 2))
    sizes = draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7]), min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(0, 9))):
        low = sizes[draw(st.integers(0, len(sizes) - 1))]
        requests.append(Request(low, draw(st.sampled_from([0, max(low, 6), max(low, 10)]))))
    return requests, pfs


FAST = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# ---------------------------------------------------------------- exactness


@FAST
@given(requests=small_requests(), pfs=small_pfs(), numa=st.sampled_from([None, 0, 1]))
def test_agrees_with_brute_force(requests: list[Request], pfs: list[PfState], numa: int | None) -> None:
    truth = brute_force(requests, pfs)
    try:
        result = place(requests, pfs, preferred_numa=numa)
    except NoFit as exc:
        assert truth is None, f"NoFit({exc.reason}) but {truth} fits"
        assert exc.reason in REASONS
        return
    assert truth is not None
    assert assignment_ok(requests, pfs, result.pfs)


@FAST
@given(requests=small_requests(), pfs=small_pfs(), numa=st.sampled_from([None, 0, 1]))
def test_numa_first_policy_is_exact_too(
    requests: list[Request], pfs: list[PfState], numa: int | None
) -> None:
    result = outcome(requests, pfs, preferred_numa=numa, policy="numa_first")
    truth = brute_force(requests, pfs)
    if isinstance(result, str):
        assert truth is None
    else:
        assert assignment_ok(requests, pfs, result)


@settings(max_examples=300, deadline=None)
@given(case=symmetric_case())
def test_many_interchangeable_pieces_agree_with_reference(case: tuple[list[Request], list[PfState]]) -> None:
    requests, pfs = case
    result = outcome(requests, pfs)
    if isinstance(result, str):
        assert not reference_fits(requests, pfs), result
    else:
        assert assignment_ok(requests, pfs, result)


@settings(max_examples=300, deadline=None)
@given(case=symmetric_case(), budget=st.sampled_from([2, 5, 9, 40]))
def test_a_small_budget_never_gives_a_wrong_answer(
    case: tuple[list[Request], list[PfState]], budget: int
) -> None:
    # Running out of steps must say so rather than guess either way, and the
    # restarts that share the memo of failed states must stay exact.
    requests, pfs = case
    result = outcome(requests, pfs, max_steps=budget)
    if result == "search_limit":
        return
    if isinstance(result, str):
        assert not reference_fits(requests, pfs)
    else:
        assert assignment_ok(requests, pfs, result)


@FAST
@given(
    requests=small_requests(), pfs=small_pfs(), numa=st.sampled_from([None, 0, 1]), seed=st.integers(0, 999)
)
def test_deterministic_and_independent_of_pf_order(
    requests: list[Request], pfs: list[PfState], numa: int | None, seed: int
) -> None:
    first = outcome(requests, pfs, preferred_numa=numa)
    assert outcome(requests, pfs, preferred_numa=numa) == first
    shuffled = list(pfs)
    random.Random(seed).shuffle(shuffled)
    # PFs are considered by name, so their input order changes nothing at all.
    assert outcome(requests, shuffled, preferred_numa=numa) == first
    reordered = list(requests)
    random.Random(seed).shuffle(reordered)
    again = outcome(reordered, pfs, preferred_numa=numa)
    if isinstance(first, str):
        assert again == first
    else:
        assert not isinstance(again, str)
        assert assignment_ok(reordered, pfs, again)


@FAST
@given(
    size=st.integers(1, 9),
    cap=st.integers(0, 6),
    pfs=small_pfs(max_pfs=5),
    numa=st.sampled_from([None, 0, 1]),
)
def test_a_single_request_goes_where_it_fits_best(
    size: int, cap: int, pfs: list[PfState], numa: int | None
) -> None:
    req = Request(size, size + cap if cap else 0)
    result = outcome([req], pfs, preferred_numa=numa)
    candidates = [
        pf for pf in pfs if pf.free_vfs and allowed_on(req, pf) and (pf.free_mbps or 0) >= req.min_tx_rate
    ]
    if not candidates:
        assert isinstance(result, str)
        return
    best = min(
        candidates,
        key=lambda pf: ((pf.free_mbps or 0) - size, numa is None or pf.numa_node != numa, pf.name),
    )
    assert result == (best.name,)


# ---------------------------------------------------------------- edge cases


def test_zero_interfaces_is_an_empty_placement() -> None:
    assert place([], []) == Placement(())
    assert place([], [PfState("enp1s0f0", 0, None)]).pfs == ()


def test_no_pfs_at_all() -> None:
    with pytest.raises(NoFit) as info:
        place([Request()], [])
    assert info.value.reason == "vfs"
    assert "no PFs" in str(info.value)


def test_single_pf() -> None:
    pf = PfState("enp1s0f0", 2, 10_000, 4_000)
    assert place([Request(3_000), Request(3_000)], [pf]).pfs == ("enp1s0f0", "enp1s0f0")
    assert outcome([Request(3_000), Request(3_001)], [pf]) == "bandwidth"
    assert outcome([Request(), Request(), Request()], [pf]) == "vfs"


def test_zero_capacity_pf_takes_only_uncapped_requests_without_min_rate() -> None:
    pf = PfState("enp1s0f0", 2, 0)
    assert place([Request(0, 0)], [pf]).pfs == ("enp1s0f0",)
    assert outcome([Request(0, 1)], [pf]) == "max_rate"
    assert outcome([Request(1, 0)], [pf]) == "bandwidth"


def test_unknown_capacity_takes_any_cap_but_no_min_rate() -> None:
    pf = PfState("ib0", 2, None)
    assert place([Request(0, 400_000), Request(0, 0)], [pf]).pfs == ("ib0", "ib0")
    assert outcome([Request(1, 0)], [pf]) == "unknown_capacity"


def test_requests_without_min_rate_only_need_vfs() -> None:
    pfs = [PfState("enp1s0f0", 1, 10_000, 10_000), PfState("enp1s0f1", 2, 10_000, 10_000)]
    result = place([Request(), Request(), Request()], pfs)
    assert sorted(result.pfs) == ["enp1s0f0", "enp1s0f1", "enp1s0f1"]
    assert result.steps == 0


def test_overcommitted_pf_has_nothing_to_reserve_but_takes_vfs() -> None:
    pf = PfState("enp1s0f0", 3, 10_000, 12_000)
    assert pf.free_mbps == 0
    assert place([Request(0, 5_000)], [pf]).pfs == ("enp1s0f0",)
    assert outcome([Request(1)], [pf]) == "bandwidth"


def test_exact_fits_are_allowed() -> None:
    pf = PfState("enp1s0f0", 2, 25_000, 5_000)
    assert place([Request(10_000, 25_000), Request(10_000)], [pf]).pfs == ("enp1s0f0", "enp1s0f0")
    assert outcome([Request(10_000, 25_001)], [pf]) == "max_rate"


def test_caps_steer_requests_to_fast_enough_pfs() -> None:
    pfs = [PfState("enp1s0f0", 4, 25_000), PfState("enp2s0f0", 1, 100_000)]
    assert place([Request(1_000, 40_000), Request(1_000)], pfs).pfs == ("enp2s0f0", "enp1s0f0")


def test_search_needs_to_backtrack_over_vfs() -> None:
    # Best fit alone puts 7 on the 3-VF PF and then has no VF left for a 5.
    pfs = [PfState("p0", 3, 10), PfState("p1", 1, 10), PfState("p2", 1, 10)]
    requests = [Request(7), Request(6), Request(5), Request(5)]
    result = place(requests, pfs)
    assert assignment_ok(requests, pfs, result.pfs)
    assert result.steps > len(requests)


# ---------------------------------------------------------------- NoFit reasons


def test_nofit_vfs_message_and_attributes() -> None:
    pfs = [PfState("enp1s0f0", 2, 25_000, 15_000), PfState("enp1s0f1", 0, 25_000)]
    requests = [Request(15_000), Request(5_000), Request(0)]
    with pytest.raises(NoFit) as info:
        place(requests, pfs)
    exc = info.value
    assert exc.reason == "vfs"
    assert str(exc).startswith(
        "3 interfaces requested (min rates 15000, 5000, 0 Mbit/s) but the node has 2 free VFs"
    )
    assert "enp1s0f0: 2 VFs, 10000 of 25000 Mbit/s free" in str(exc)
    assert exc.requested == tuple(requests)
    assert exc.free_vfs == 2
    assert exc.free_mbps == {"enp1s0f0": 10_000, "enp1s0f1": 25_000}
    assert exc.largest_unplaced == Request(0)


def test_nofit_single_request_too_big() -> None:
    pfs = [PfState("enp1s0f0", 2, 25_000, 15_000), PfState("enp1s0f1", 0, 25_000)]
    with pytest.raises(NoFit) as info:
        place([Request(15_000), Request(1_000)], pfs)
    exc = info.value
    assert exc.reason == "bandwidth"
    assert (
        "cannot reserve 15000 Mbit/s: the largest free bandwidth on a PF with free VFs is 10000 Mbit/s"
        in str(exc)
    )
    assert exc.largest_unplaced == Request(15_000)


def test_nofit_total_bandwidth() -> None:
    pfs = [PfState("enp1s0f0", 3, 10_000), PfState("enp1s0f1", 3, 10_000)]
    with pytest.raises(NoFit) as info:
        place([Request(8_000)] * 3, pfs)
    assert info.value.reason == "bandwidth"
    assert "cannot reserve 24000 Mbit/s in total: the PFs with free VFs have 20000 Mbit/s free" in str(
        info.value
    )
    assert info.value.largest_unplaced == Request(8_000)


def test_nofit_bandwidth_that_fits_in_total_but_not_per_pf() -> None:
    pfs = [PfState("enp1s0f0", 3, 10_000), PfState("enp1s0f1", 3, 10_000)]
    with pytest.raises(NoFit) as info:
        place([Request(6_000)] * 3, pfs)
    exc = info.value
    assert exc.reason == "bandwidth"
    assert "cannot reserve 18000 Mbit/s: it fits in the 20000 Mbit/s free in total but not PF by PF" in str(
        exc
    )
    assert exc.largest_unplaced == Request(6_000)
    assert exc.free_mbps == {"enp1s0f0": 10_000, "enp1s0f1": 10_000}


def test_nofit_max_rate_above_every_capacity() -> None:
    with pytest.raises(NoFit) as info:
        place([Request(1_000, 40_000)], [PfState("enp1s0f0", 4, 25_000)])
    exc = info.value
    assert exc.reason == "max_rate"
    assert "max_tx_rate above 25000 Mbit/s" in str(exc)
    assert "no PF has more than 25000 Mbit/s" in str(exc)
    assert exc.largest_unplaced == Request(1_000, 40_000)


def test_nofit_max_rate_too_few_vfs_on_fast_pfs() -> None:
    pfs = [PfState("enp1s0f0", 4, 25_000), PfState("enp2s0f0", 1, 100_000)]
    with pytest.raises(NoFit) as info:
        place([Request(1_000, 40_000), Request(2_000, 50_000)], pfs)
    exc = info.value
    assert exc.reason == "max_rate"
    assert "the PFs with at least 100000 Mbit/s have 1 free VF" in str(exc)
    assert exc.largest_unplaced == Request(1_000, 40_000)


def test_nofit_unknown_capacity() -> None:
    pfs = [PfState("ib0", 4, None), PfState("enp1s0f0", 0, 25_000)]
    with pytest.raises(NoFit) as info:
        place([Request(1_000), Request()], pfs)
    exc = info.value
    assert exc.reason == "unknown_capacity"
    assert "unknown capacity" in str(exc)
    assert exc.free_mbps == {"enp1s0f0": 25_000, "ib0": None}
    assert exc.largest_unplaced == Request(1_000)


def test_nofit_search_limit_says_it_gave_up() -> None:
    pfs = [PfState("p0", 3, 10), PfState("p1", 1, 10), PfState("p2", 1, 10)]
    with pytest.raises(NoFit) as info:
        place([Request(7), Request(6), Request(5), Request(5)], pfs, max_steps=2)
    exc = info.value
    assert exc.reason == "search_limit"
    assert exc.steps == 2
    assert "gave up after 2 search steps" in str(exc)


def test_free_summary() -> None:
    pfs = [PfState("enp2s0", 1, None), PfState("enp1s0", 2, 25_000, 5_000)]
    assert free_summary(pfs) == "enp1s0: 2 VFs, 20000 of 25000 Mbit/s free; enp2s0: 1 VF, capacity unknown"
    assert free_summary([]) == "no PFs"


# ---------------------------------------------------------------- invalid input


@pytest.mark.parametrize(
    "make",
    [
        lambda: Request(-1),
        lambda: Request(0, -1),
        lambda: Request(5, 3),
        lambda: Request(True),  # type: ignore[arg-type]
        lambda: Request(1.5),  # type: ignore[arg-type]
        lambda: PfState("", 1, 1),
        lambda: PfState("enp1s0f0", -1, 1),
        lambda: PfState("enp1s0f0", 1, -1),
        lambda: PfState("enp1s0f0", 1, 1, -1),
        lambda: PfState("enp1s0f0", 1, 1, 0, "0"),  # type: ignore[arg-type]
    ],
)
def test_invalid_values_raise_value_error(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]


def test_invalid_arguments_raise_value_error() -> None:
    pf = PfState("enp1s0f0", 1, 1)
    with pytest.raises(ValueError, match="duplicate"):
        place([Request()], [pf, PfState("enp1s0f0", 2, 2)])
    with pytest.raises(ValueError):
        place([Request()], [pf], policy="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        place([Request()], [pf], preferred_numa="0")  # type: ignore[arg-type]
    for steps in (0, -1, True):
        with pytest.raises(ValueError):
            place([Request()], [pf], max_steps=steps)
    with pytest.raises(ValueError):
        place([(0, 0)], [pf])  # type: ignore[list-item]


def test_values_changed_behind_the_dataclass_are_still_caught() -> None:
    # The scheduler extender may build these by other means; place() checks again.
    bad = Request(1)
    object.__setattr__(bad, "min_tx_rate", -5)
    with pytest.raises(ValueError):
        place([bad], [PfState("enp1s0f0", 1, 1)])


# ---------------------------------------------------------------- policy


def test_best_fit_takes_the_pf_with_least_bandwidth_left() -> None:
    pfs = [PfState("a", 4, 30_000), PfState("b", 4, 12_000), PfState("c", 4, 9_000)]
    assert place([Request(10_000)], pfs).pfs == ("b",)


def test_largest_request_is_placed_first() -> None:
    # Taken in request order, best fit would put 5000 on "a" and 10000 on "b",
    # leaving two 5000 gaps where largest-first leaves one 5000 gap.
    pfs = [PfState("a", 4, 10_000), PfState("b", 4, 15_000)]
    assert place([Request(5_000), Request(10_000)], pfs).pfs == ("b", "a")


def test_best_fit_packs_rather_than_spreads() -> None:
    pfs = [PfState("a", 4, 100_000), PfState("b", 4, 100_000)]
    assert place([Request(10_000), Request(10_000)], pfs).pfs == ("a", "a")


def test_numa_breaks_ties() -> None:
    pfs = [PfState("a", 4, 100_000, 0, 0), PfState("b", 4, 100_000, 0, 1)]
    assert place([Request(10_000)], pfs, preferred_numa=1).pfs == ("b",)
    assert place([Request(10_000)], pfs, preferred_numa=0).pfs == ("a",)
    assert place([Request(10_000)], pfs).pfs == ("a",)


def test_numa_does_not_override_best_fit_unless_asked() -> None:
    pfs = [PfState("a", 4, 10_000, 0, 0), PfState("b", 4, 20_000, 0, 1)]
    assert place([Request(8_000)], pfs, preferred_numa=1).pfs == ("a",)
    assert place([Request(8_000)], pfs, preferred_numa=1, policy="numa_first").pfs == ("b",)


def test_spreads_when_it_costs_nothing() -> None:
    # After 20000 on "a", the 5000 fills "a" or "c" exactly: the unused "c" wins over name order.
    pfs = [PfState("a", 4, 25_000), PfState("c", 4, 5_000)]
    assert place([Request(20_000), Request(5_000)], pfs).pfs == ("a", "c")


def test_requests_without_min_rate_spread_over_equal_pfs() -> None:
    pfs = [PfState("a", 4, 100_000), PfState("b", 4, 100_000)]
    assert place([Request(), Request()], pfs).pfs == ("a", "b")


def test_requests_without_min_rate_take_the_least_useful_vf() -> None:
    unknown = PfState("u", 4, None)
    busy = PfState("busy", 4, 100_000, 90_000)
    idle = PfState("idle", 4, 100_000)
    assert place([Request()], [idle, busy, unknown]).pfs == ("u",)
    assert place([Request()], [idle, busy]).pfs == ("busy",)
    slow = PfState("slow", 4, 10_000)
    fast = PfState("fast", 4, 100_000, 90_000)
    # Same free bandwidth: the lower capacity keeps the fast PF for fast requests.
    assert place([Request()], [fast, slow]).pfs == ("slow",)
    assert place([Request(0, 40_000)], [fast, slow]).pfs == ("fast",)


def test_numa_breaks_ties_for_requests_without_min_rate() -> None:
    pfs = [PfState("a", 4, None, 0, 0), PfState("b", 4, None, 0, 1)]
    assert place([Request()], pfs, preferred_numa=1).pfs == ("b",)


# ---------------------------------------------------------------- worst cases


def _benchmark_families() -> dict[str, list]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import placement_bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return placement_bench.families()


@pytest.fixture(scope="module")
def bench_families() -> dict[str, list]:
    return _benchmark_families()


def test_benchmark_families_stay_far_below_the_budget(bench_families: dict[str, list]) -> None:
    for family, instances in bench_families.items():
        if family.startswith("stress"):
            continue
        for number, inst in enumerate(instances):
            try:
                result = place(inst.requests, inst.pfs)
                verdict, steps = True, result.steps
                assert assignment_ok(inst.requests, inst.pfs, result.pfs)
            except NoFit as exc:
                assert exc.reason != "search_limit", (family, number)
                verdict, steps = False, exc.steps
            assert steps <= DEFAULT_MAX_STEPS, (family, number, steps)
            assert inst.fits in (None, verdict), (family, number)


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        # The item-by-item search alone gave up on 8 of these; the bin
        # completion search without the waste bound on 2 (47 and 97).
        ("stress: tight 16x32 (extra)", []),
        # Number 727 needed about 2,200 steps before the VF-crowding bound.
        ("stress: tight 16x32, 1000 more", []),
        ("stress: identical PFs 99-99.9 %", []),
        ("stress: few distinct sizes", []),
        ("stress: VF- and bandwidth-tight", []),
        # Documented, not desired: the tail of the tightest bin packing (see
        # "Step budget"); each is decided by the CNI plugin's own budget below.
        ("stress: tight 16x32, 5000 more", [215, 855, 1723, 2766, 2774, 3164, 3667, 3888, 4344, 4808, 4972]),
        ("stress: VF- and bandwidth-tight, 3000 more", [1082]),
    ],
)
def test_stress_families_are_decided_correctly_and_within_the_budget_but_for_known_inputs(
    bench_families: dict[str, list], family: str, expected: list[int]
) -> None:
    gave_up = []
    for number, inst in enumerate(bench_families[family]):
        result = outcome(inst.requests, inst.pfs)
        if result == "search_limit":
            gave_up.append(number)
        elif not isinstance(result, str):
            assert assignment_ok(inst.requests, inst.pfs, result)
    assert gave_up == expected


@pytest.mark.parametrize(
    ("family", "number"),
    [
        ("stress: tight 16x32 (extra)", 47),
        ("stress: tight 16x32 (extra)", 97),
        ("stress: tight 16x32, 5000 more", 4808),  # fits, found after 8,927 steps
        ("stress: tight 16x32, 5000 more", 4972),  # does not fit, proven in 16,590 steps
        ("stress: VF- and bandwidth-tight, 3000 more", 1082),
    ],
)
def test_the_hardest_known_inputs_are_decided_by_the_plugins_budget(
    bench_families: dict[str, list], family: str, number: int
) -> None:
    from rdma_cni.verbs.add import PLACEMENT_STEPS

    inst = bench_families[family][number]
    try:
        result = place(inst.requests, inst.pfs, max_steps=PLACEMENT_STEPS)
    except NoFit as exc:
        assert exc.reason == "bandwidth", exc.reason
        with pytest.raises(NoFit) as unlimited:
            place(inst.requests, inst.pfs, max_steps=None)
        assert unlimited.value.reason == "bandwidth"
        return
    assert assignment_ok(inst.requests, inst.pfs, result.pfs)


def test_a_spent_budget_is_said_and_a_bigger_one_finishes(bench_families: dict[str, list]) -> None:
    inst = bench_families["stress: tight 16x32, 5000 more"][4808]
    assert outcome(inst.requests, inst.pfs) == "search_limit"
    result = place(inst.requests, inst.pfs, max_steps=None)
    assert assignment_ok(inst.requests, inst.pfs, result.pfs)
    assert DEFAULT_MAX_STEPS < result.steps < 10 * DEFAULT_MAX_STEPS


@FAST
@given(
    sizes=st.lists(st.integers(0, 40), max_size=9),
    free=st.integers(0, 100),
    slots=st.integers(0, 5),
    enough=st.sampled_from([None, 0, 30, 60]),
)
def test_best_subset_sum_agrees_with_brute_force(
    sizes: list[int], free: int, slots: int, enough: int | None
) -> None:
    sizes = sorted(sizes, reverse=True)
    kinds = sizes  # a size names its own kind here
    cut = free + 1 if enough is None else enough
    best, made_of, nodes = bincompletion._best_subset_sum(
        sizes, kinds, bincompletion._sorted_arrays(sizes, kinds), 0, free, slots, cut
    )
    truth = max(
        (
            sum(c)
            for r in range(min(slots, len(sizes)) + 1)
            for c in itertools.combinations(sizes, r)
            if sum(c) <= free
        ),
        default=0,
    )
    assert nodes >= 1
    # The witness is a real choice of at most ``slots`` of the sizes making that sum.
    assert sum(made_of) == best <= free and len(made_of) <= slots
    assert not Counter(made_of) - Counter(sizes)
    if best < cut:
        assert best == truth
    else:
        assert truth >= best >= cut


@pytest.fixture
def bin_completion_only() -> Iterator[None]:
    """Send every search straight to the bin completion stage, so the tests exercise it on small inputs."""
    saved = problem._FIRST_SHARE
    problem._FIRST_SHARE = 1
    try:
        yield
    finally:
        problem._FIRST_SHARE = saved


@FAST
@given(requests=small_requests(max_requests=6), pfs=small_pfs(max_pfs=4))
def test_bin_completion_agrees_with_brute_force(
    bin_completion_only: None, requests: list[Request], pfs: list[PfState]
) -> None:
    truth = brute_force(requests, pfs)
    result = outcome(requests, pfs, max_steps=None)
    if isinstance(result, str):
        assert truth is None, f"{result} but {truth} fits"
    else:
        assert assignment_ok(requests, pfs, result)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=symmetric_case())
def test_bin_completion_agrees_with_reference_on_interchangeable_pieces(
    bin_completion_only: None, case: tuple[list[Request], list[PfState]]
) -> None:
    requests, pfs = case
    result = outcome(requests, pfs, max_steps=None)
    if isinstance(result, str):
        assert not reference_fits(requests, pfs), result
    else:
        assert assignment_ok(requests, pfs, result)


def test_bin_completion_leaves_a_pf_too_slow_for_every_cap_empty(bin_completion_only: None) -> None:
    # Every request has the same cap, which the 1 Mbit/s PF cannot carry: its
    # only filling is the empty one, although the requests would fit its bandwidth.
    pfs = [PfState("slow", 1, 1), PfState("fast", 2, 2)]
    requests = [Request(1, 2), Request(1, 2)]
    assert place(requests, pfs, max_steps=None).pfs == ("fast", "fast")
    with pytest.raises(NoFit):
        place([*requests, Request(1, 2)], pfs, max_steps=None)


def test_adversarial_identical_pfs() -> None:
    pfs = [PfState(f"pf{k:02}", 4, 100_000) for k in range(16)]
    # 17 requests of more than half a PF each: no fit, decided without searching.
    requests = [Request(50_001 + k) for k in range(17)] + [Request(1_000)] * 15
    with pytest.raises(NoFit) as info:
        place(requests, pfs)
    assert info.value.reason == "bandwidth"
    assert info.value.steps <= 32
    # Sixteen exact pairs: fits only by pairing each request with its complement.
    halves = [20_000 + 1_700 * k for k in range(16)]
    requests = [Request(x) for x in halves] + [Request(100_000 - x) for x in reversed(halves)]
    result = place(requests, pfs)
    assert assignment_ok(requests, pfs, result.pfs)
    assert result.steps <= 32
    # 32 equal requests that fit two per PF, and 33 that do not.
    assert place([Request(40_000)] * 32, pfs).steps <= 32
    more_vfs = [dataclasses.replace(pf, free_vfs=8) for pf in pfs]
    with pytest.raises(NoFit) as info:
        place([Request(40_000)] * 33, more_vfs)
    assert info.value.steps <= 64


def test_unlimited_search_finishes_what_the_budget_cut_short() -> None:
    pfs = [PfState("p0", 3, 10), PfState("p1", 1, 10), PfState("p2", 1, 10)]
    requests = [Request(7), Request(6), Request(5), Request(5)]
    assert outcome(requests, pfs, max_steps=2) == "search_limit"
    result = place(requests, pfs, max_steps=None)
    assert assignment_ok(requests, pfs, result.pfs)


# ---------------------------------------------------------------- purity


PACKAGE_DIR = Path(placement.__file__).parent


@pytest.mark.parametrize("module", sorted(p.stem for p in PACKAGE_DIR.glob("*.py")))
def test_imports_only_the_standard_library_and_does_no_io(module: str) -> None:
    """Every module of the package imports the standard library and its siblings, nothing else."""
    tree = ast.parse((PACKAGE_DIR / f"{module}.py").read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module is not None
            if not node.module.startswith("rdma_cni.shared.placement."):
                modules.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in {"open", "print", "input", "exec", "eval", "__import__"}
    assert modules, "the parse found no imports at all"
    assert modules <= set(sys.stdlib_module_names) | {"__future__"}, modules - set(sys.stdlib_module_names)


def test_the_package_is_what_callers_import() -> None:
    assert {"place", "PfState", "Request", "NoFit", "Placement", "free_summary", "DEFAULT_MAX_STEPS"} <= set(
        placement.__all__
    )
    assert len(list(PACKAGE_DIR.glob("*.py"))) == 8  # a new module gets the purity test above by itself
