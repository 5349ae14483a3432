"""Benchmark rdma_cni.shared.placement.place against the original system's backtracking placement.

Run with ``.venv/bin/python benchmarks/placement_bench.py``; prints a Markdown
table. Every instance family comes from a fixed seed, so two runs measure the
same inputs. Each instance runs once per algorithm (no best-of-n); the baseline
has a wall-clock timeout, and a timeout counts as a failure to decide.

The tests import :func:`families` to check the answers, and that the step
budget runs out only on the known inputs of the largest stress samples.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from original_backtracking import Timeout, place_backtracking

from rdma_cni.shared.placement import DEFAULT_MAX_STEPS, NoFit, PfState, Request, place
from tests.support.placement_oracle import assignment_ok

SEED = 20_240_611
TIMEOUT_S = 2.0
BASELINE_PER_FAMILY = 10
REPEATS = 1
CAPACITIES = (10_000, 25_000, 40_000, 50_000, 100_000, 200_000)
BIG_PF = 100_000


@dataclass(frozen=True)
class Instance:
    """One input; ``fits`` is the known answer, or None when only a solver can tell."""

    requests: tuple[Request, ...]
    pfs: tuple[PfState, ...]
    fits: bool | None


def _name(k: int) -> str:
    return f"enp{k // 2 + 1}s0f{k % 2}"


def _random_pfs(rng: random.Random, count: int, *, max_vfs: int = 8, unknown: float = 0.0) -> list[PfState]:
    pfs = []
    for k in range(count):
        if rng.random() < unknown:
            pfs.append(PfState(_name(k), rng.randint(1, max_vfs), None, 0, rng.randint(0, 1)))
            continue
        cap = rng.choice(CAPACITIES)
        reserved = rng.randint(0, cap * 6 // 10)
        pfs.append(PfState(_name(k), rng.randint(1, max_vfs), cap, reserved, rng.randint(0, 1)))
    return pfs


def _cap(rng: random.Random, min_rate: int, pfs: Sequence[PfState]) -> int:
    # The baseline ignores max rates, so keep each within every PF's capacity.
    ceiling = min((pf.capacity_mbps for pf in pfs if pf.capacity_mbps is not None), default=0)
    if rng.random() < 0.5 or ceiling < max(1, min_rate):
        return 0
    return rng.randint(max(1, min_rate), ceiling)


def _free(pf: PfState) -> int:
    return pf.free_mbps or 0


def _split(rng: random.Random, total: int, parts: int) -> list[int]:
    """``parts`` positive integers summing to about ``total``, unevenly."""
    weights = [rng.random() + 0.05 for _ in range(parts)]
    scale = total / sum(weights)
    return [max(1, int(w * scale)) for w in weights]


def _planted(rng: random.Random, pfs: list[PfState], count: int) -> list[Request]:
    """Requests built from a hidden assignment, so they fit by construction."""
    vfs = [pf.free_vfs for pf in pfs]
    room = [_free(pf) for pf in pfs]
    requests = []
    for _ in range(count):
        open_pfs = [j for j in range(len(pfs)) if vfs[j]]
        if not open_pfs:
            break
        j = rng.choice(open_pfs)
        min_rate = 0 if rng.random() < 0.2 or pfs[j].capacity_mbps is None else rng.randint(0, room[j])
        vfs[j] -= 1
        room[j] -= min_rate
        requests.append(Request(min_rate, _cap(rng, min_rate, pfs)))
    rng.shuffle(requests)
    return requests


def feasible_random(rng: random.Random) -> Instance:
    """Up to 16 PFs of mixed speeds and load, up to 32 requests planted so that they fit."""
    pfs = _random_pfs(rng, rng.randint(1, 16))
    return Instance(tuple(_planted(rng, pfs, rng.randint(1, 32))), tuple(pfs), True)


def infeasible_random(rng: random.Random) -> Instance:
    """Provably no fit: total min rate over the free bandwidth, one request too big, or one VF short."""
    kind = rng.randrange(3)
    if kind == 0:
        pfs = _random_pfs(rng, rng.randint(1, 16))
        vfs = sum(pf.free_vfs for pf in pfs)
        total = sum(_free(pf) for pf in pfs) * rng.uniform(1.01, 1.15)
        mins = _split(rng, int(total) + 1, rng.randint(1, min(32, vfs)))
        requests = [Request(x, _cap(rng, x, pfs)) for x in mins]
    elif kind == 1:
        pfs = _random_pfs(rng, rng.randint(1, 16))
        requests = _planted(rng, pfs, rng.randint(0, 31))
        too_big = max(_free(pf) for pf in pfs) + rng.randint(1, 5_000)
        requests.insert(rng.randint(0, len(requests)), Request(too_big, 0))
    else:
        pfs = _random_pfs(rng, rng.randint(1, 10), max_vfs=3)
        requests = _planted(rng, pfs, 31)
        requests += [Request(0, 0)] * (sum(pf.free_vfs for pf in pfs) + 1 - len(requests))
        rng.shuffle(requests)
    return Instance(tuple(requests), tuple(pfs), False)


def adversarial_symmetric(rng: random.Random) -> Instance:
    """16 identical PFs and 32 requests whose total fits; built so the answer is known.

    All but the exact-pairs kind have no fit, which plain backtracking can only
    learn by trying every arrangement.
    """
    kind = rng.randrange(5)
    vfs = 2 if kind == 2 else 4
    pfs = tuple(PfState(_name(k), vfs, BIG_PF, 0, 0) for k in range(16))
    fits = False
    if kind == 0:
        # 17 requests over half a PF: one of them has nowhere to go.
        mins = [rng.randint(50_001, 60_000) for _ in range(17)]
        mins += [rng.randint(1_000, 3_000) for _ in range(15)]
    elif kind == 1:
        # Big ones cannot share a PF with a medium one, and three mediums never fit together.
        big = rng.randint(8, 13)
        mins = [rng.randint(66_001, 70_000) for _ in range(big)]
        mins += [rng.randint(33_334, 34_000) for _ in range(32 - big)]
    elif kind == 2:
        # Two VFs per PF: the largest cannot pair with anyone, leaving 31 for 30 VFs.
        mins = [70_000] + [rng.randint(30_001, 46_000) for _ in range(31)]
    elif kind == 3:
        # Sixteen pairs that each fill a PF exactly: fits, with no slack at all.
        halves = [rng.randint(20_000, 50_000) for _ in range(16)]
        mins = halves + [BIG_PF - x for x in halves]
        fits = True
    elif rng.randrange(2):
        # Equal requests, two sizes: a big one and a medium one never share a PF.
        big = rng.randint(2, 14)
        mins = [50_500] * big + [49_600] * (32 - big)
    else:
        # Equal requests that fit two to a PF.
        mins = [rng.randint(30_000, 50_000)] * 32
        fits = True
    rng.shuffle(mins)
    return Instance(tuple(Request(x, 0) for x in mins), pfs, fits)


def mixed_sizes(rng: random.Random) -> Instance:
    """1-16 PFs (some of unknown speed) and 1-32 requests at 30-110 % of the free bandwidth."""
    pfs = _random_pfs(rng, rng.choice((1, 2, 4, 8, 16)), unknown=0.15)
    count = rng.choice((1, 2, 4, 8, 16, 32))
    known_free = sum(_free(pf) for pf in pfs)
    mins = _split(rng, max(1, int(known_free * rng.uniform(0.3, 1.1))), count)
    mins = [0 if rng.random() < 0.25 else x for x in mins]
    return Instance(tuple(Request(x, _cap(rng, x, pfs)) for x in mins), tuple(pfs), None)


def tight_stress(rng: random.Random) -> Instance:
    """16 PFs x 32 requests with little bandwidth to spare, and often few VFs to spare.

    Identical PFs at 97-99.9 % or 94-98 % load, or PFs of mixed speed and load
    with 1-4 VFs each at 94-98 %: these are the inputs that can exhaust the
    step budget.
    """
    kind = rng.randrange(3)
    if kind == 0:
        pfs = [PfState(_name(k), 4, BIG_PF, 0, 0) for k in range(16)]
        load = rng.uniform(0.97, 0.999)
    elif kind == 1:
        pfs = [PfState(_name(k), rng.choice((3, 8)), BIG_PF, 0, k % 2) for k in range(16)]
        load = rng.uniform(0.94, 0.98)
    else:
        pfs = []
        for k in range(16):
            cap = rng.choice((10_000, 25_000, 40_000, BIG_PF))
            pfs.append(PfState(_name(k), rng.randint(1, 4), cap, rng.randint(0, cap // 2), k % 2))
        load = rng.uniform(0.94, 0.98)
    mins = _split(rng, int(sum(_free(pf) for pf in pfs) * load), 32)
    return Instance(tuple(Request(x, 0) for x in mins), tuple(pfs), None)


def identical_nearly_full(rng: random.Random) -> Instance:
    """16 identical PFs at 99-99.9 % load with 2-4 VFs each: the classic hard bin packing."""
    vfs = rng.choice((2, 3, 4))
    pfs = [PfState(_name(k), vfs, BIG_PF, 0, k % 2) for k in range(16)]
    mins = _split(rng, int(16 * BIG_PF * rng.uniform(0.99, 0.999)), 32)
    return Instance(tuple(Request(x, 0) for x in mins), tuple(pfs), None)


def few_sizes(rng: random.Random) -> Instance:
    """32 requests in 2-4 distinct sizes on 16 PFs of one or two kinds, 95-100 % load."""
    speeds = (25_000, 40_000, BIG_PF)
    kinds = [(rng.choice((2, 3, 4, 8)), rng.choice(speeds)) for _ in range(rng.randint(1, 2))]
    pfs = []
    for k in range(16):
        vfs, cap = kinds[k % len(kinds)]
        pfs.append(PfState(_name(k), vfs, cap, 0, k % 2))
    target = sum(_free(pf) for pf in pfs) * rng.uniform(0.95, 1.0) / 32
    sizes = [max(1, int(target * rng.uniform(0.4, 1.6))) for _ in range(rng.randint(2, 4))]
    mins = [rng.choice(sizes) for _ in range(32)]
    return Instance(tuple(Request(x, 0) for x in mins), tuple(pfs), None)


def vf_and_bandwidth_tight(rng: random.Random) -> Instance:
    """Mixed PFs where VFs and bandwidth are both nearly used up: 32-34 VFs, 94-99 % load."""
    pfs = []
    vfs = [1] * 16
    for _ in range(rng.randint(16, 18)):
        vfs[rng.randrange(16)] += 1
    for k in range(16):
        cap = rng.choice((10_000, 25_000, 40_000, 50_000, BIG_PF))
        pfs.append(PfState(_name(k), vfs[k], cap, rng.randint(0, cap * 6 // 10), k % 2))
    mins = _split(rng, int(sum(_free(pf) for pf in pfs) * rng.uniform(0.94, 0.99)), 32)
    return Instance(tuple(Request(x, 0) for x in mins), tuple(pfs), None)


FAMILIES: dict[str, tuple[Callable[[random.Random], Instance], int]] = {
    "feasible random": (feasible_random, 200),
    "infeasible random": (infeasible_random, 200),
    "adversarial symmetric 16x32": (adversarial_symmetric, 200),
    "mixed sizes": (mixed_sizes, 200),
    "stress: tight 16x32 (extra)": (tight_stress, 100),
    "stress: tight 16x32, 1000 more": (tight_stress, 1000),
    "stress: identical PFs 99-99.9 %": (identical_nearly_full, 300),
    "stress: few distinct sizes": (few_sizes, 300),
    "stress: VF- and bandwidth-tight": (vf_and_bandwidth_tight, 300),
    # Large samples of the two hardest families, to measure how often the
    # default budget runs out (it does on a handful: see "Step budget" in
    # rdma_cni/shared/placement/).
    "stress: tight 16x32, 5000 more": (tight_stress, 5000),
    "stress: VF- and bandwidth-tight, 3000 more": (vf_and_bandwidth_tight, 3000),
}


def families(seed: int = SEED) -> dict[str, list[Instance]]:
    """Every benchmark family's instances, the same for the same seed."""
    out = {}
    for number, (name, (make, count)) in enumerate(FAMILIES.items()):
        rng = random.Random(seed * 100 + number)
        out[name] = [make(rng) for _ in range(count)]
    return out


def valid(instance: Instance, names: Sequence[str]) -> bool:
    """Independent check of an assignment against VF counts, min rates and max rates."""
    return assignment_ok(instance.requests, instance.pfs, names)


@dataclass
class Row:
    """Aggregated results of one algorithm on one family."""

    times: list[float]
    decided: int = 0
    correct: int = 0
    finished: int = 0
    agree: int = 0


def run_ours(instances: list[Instance]) -> tuple[Row, list[bool | None]]:
    """Time place() on every instance; returns the row and our verdict per instance."""
    row = Row([])
    verdicts: list[bool | None] = []
    for inst in instances:
        best = float("inf")
        verdict: bool | None = None
        for _ in range(REPEATS):
            start = time.perf_counter()
            try:
                names = place(inst.requests, inst.pfs).pfs
                verdict = True
            except NoFit as exc:
                names = ()
                verdict = None if exc.reason == "search_limit" else False
            best = min(best, time.perf_counter() - start)
        row.times.append(best)
        verdicts.append(verdict)
        if verdict is None:
            continue
        row.decided += 1
        sound = valid(inst, names) if verdict else True
        if sound and inst.fits in (None, verdict):
            row.correct += 1
    return row, verdicts


def run_baseline(instances: list[Instance], ours: list[bool | None]) -> Row:
    """Time the original backtracking once per instance, with the timeout."""
    row = Row([])
    for inst, our in zip(instances, ours, strict=True):
        start = time.perf_counter()
        try:
            names = place_backtracking(inst.requests, inst.pfs, deadline=start + TIMEOUT_S)
        except Timeout:
            row.times.append(time.perf_counter() - start)
            continue
        row.times.append(time.perf_counter() - start)
        verdict = names is not None
        row.finished += 1
        row.decided += 1
        truth = inst.fits if inst.fits is not None else our
        if truth is not None and verdict == truth and (names is None or valid(inst, names)):
            row.correct += 1
        if our is not None and verdict == our:
            row.agree += 1
    return row


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if seconds < 1 else f"{seconds * 1e3:.0f}"


def main() -> int:
    """Run every family through both algorithms and print the Markdown table."""
    started = time.perf_counter()
    print(f"seed {SEED}; baseline timeout {TIMEOUT_S:.0f} s on the first {BASELINE_PER_FAMILY} instances")
    print(f"of each family; ours: one run per instance, step budget {DEFAULT_MAX_STEPS}.\n")
    print("| family | algorithm | instances | median ms | worst ms | decided correctly | agrees with ours |")
    print("|---|---|---:|---:|---:|---:|---:|")
    overall_worst = 0.0
    all_families = families()
    # The generated instances are the benchmark's heap, not the placement's:
    # keep the collector from walking them in the middle of a timed call.
    gc.collect()
    gc.freeze()
    for name, instances in all_families.items():
        ours, verdicts = run_ours(instances)
        overall_worst = max(overall_worst, max(ours.times))
        count = len(instances)
        print(
            f"| {name} | ours | {count} | {_ms(statistics.median(ours.times))} | {_ms(max(ours.times))} "
            f"| {ours.correct}/{count} | - |"
        )
        subset = instances[:BASELINE_PER_FAMILY]
        base = run_baseline(subset, verdicts[:BASELINE_PER_FAMILY])
        timeouts = len(subset) - base.finished
        print(
            f"| {name} | original backtracking | {len(subset)} | {_ms(statistics.median(base.times))} "
            f"| {_ms(max(base.times))} | {base.correct}/{len(subset)} ({timeouts} timed out) "
            f"| {base.agree}/{base.finished} finished |"
        )
        sys.stdout.flush()
    print(f"\nours, worst single decision over all families: {_ms(overall_worst)} ms")
    print(f"total benchmark time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
