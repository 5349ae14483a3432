"""Benchmark placement with per-interface constraints (rails, PFs by name, different_pfs) at 16 PFs x 32 VFs.

Run with ``.venv/bin/python benchmarks/constraints_bench.py``; prints a
Markdown table per family: the median and worst time of one decision, the
answers (fit, no fit, search limit) and the most steps spent. Fixed seeds;
each instance is timed ``REPEATS`` times and its fastest run kept (the
machine it was written on is shared: a single run's worst is mostly the
neighbours' noise; the steps, which the budget counts, are the same every
run). The hardest family is the worst case constructed for the constrained
search: requests with a rail beside requests without one (they share PFs,
so no split into per-rail problems applies) at 85-100 % of the node's free
bandwidth. The tests import :func:`families`.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rdma_cni.shared.placement import DEFAULT_MAX_STEPS, NoFit, PfState, Request, place
from tests.support.placement_oracle import assignment_ok

Case = tuple[list[Request], list[PfState], bool]
REPEATS = 3


def _pfs(rng: random.Random, rails: int, vfs: list[int]) -> list[PfState]:
    return [
        PfState(
            f"enp{k}s0",
            rng.choice(vfs),
            rng.choice([25_000, 50_000, 100_000]),
            rng.randint(0, 20_000),
            k % 2,
            f"rail-{k % rails}",
        )
        for k in range(16)
    ]


def one_per_rail(seed: int = 1, count: int = 200) -> list[Case]:
    """The multi-rail case: 8 or 16 rails of 1-2 PFs, one or two interfaces per rail (per-rail problems)."""
    rng = random.Random(seed)
    out = []
    for n in range(count):
        rails = 8 if n % 2 else 16
        pfs = _pfs(rng, rails, [32])
        per = rng.choice([1, 2])
        requests = [
            Request(rng.choice([0, 10_000, 25_000]), rail=f"rail-{r}")
            for r in range(rails)
            for _ in range(per)
        ]
        out.append((requests[:32], pfs, n % 3 == 0))
    return out


def pinned_and_free(seed: int = 2, count: int = 200) -> list[Case]:
    """Some interfaces name a PF, the others go anywhere (pinned first, then one plain problem)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        pfs = _pfs(rng, 4, [1, 2, 32])
        requests = []
        for _ in range(rng.randint(8, 32)):
            pf = f"enp{rng.randrange(16)}s0" if rng.random() < 0.3 else None
            requests.append(Request(rng.choice([0, 1_000, 5_000, 10_000]), pf=pf))
        out.append((requests, pfs, False))
    return out


def mixed_tight(seed: int = 25, count: int = 60) -> list[Case]:
    """The worst case: rail and free interfaces sharing 16 PFs, 16-32 of them at 85-100 % load."""
    rng = random.Random(seed)
    out = []
    for n in range(count):
        rails = 2 if n % 2 else 4
        pfs = _pfs(rng, rails, [1, 2, 32] if n % 3 else [32])
        total = sum(pf.free_mbps or 0 for pf in pfs)
        count_ = rng.randint(16, 32)
        load = rng.uniform(0.85, 1.0) * total
        requests = []
        for _ in range(count_):
            size = int(rng.uniform(0.5, 1.5) * load / count_) // 100 * 100
            rail = rng.choice([None, None, f"rail-{rng.randrange(rails)}"])
            requests.append(Request(size, rail=rail))
        out.append((requests, pfs, n % 5 == 0))
    return out


def families() -> dict[str, list[Case]]:
    """Every family, by name."""
    return {
        "one interface per rail (8 or 16 rails)": one_per_rail(),
        "PFs by name beside free interfaces": pinned_and_free(),
        "rails beside free interfaces, tight (worst case)": [
            c for s in range(25, 30) for c in mixed_tight(s)
        ],
    }


def main() -> int:
    """Run every family once and print the table."""
    print(f"16 PFs x 32 VFs; step budget {DEFAULT_MAX_STEPS}; fastest of {REPEATS} runs per instance.\n")
    print("| family | instances | median ms | worst ms | fit | no fit | search limit | most steps |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    all_families = families()
    gc.collect()
    gc.freeze()
    worst = 0.0
    for name, cases in all_families.items():
        times = []
        answers: Counter[str] = Counter()
        most = 0
        for requests, pfs, different in cases:
            best = float("inf")
            for _ in range(REPEATS):
                started = time.perf_counter()
                try:
                    got = place(requests, pfs, different_pfs=different)
                    steps = got.steps
                    answer = "fit"
                except NoFit as exc:
                    steps = exc.steps
                    answer = "search limit" if exc.reason == "search_limit" else "no fit"
                best = min(best, time.perf_counter() - started)
            if answer == "fit":
                assert assignment_ok(requests, pfs, got.pfs, different)
            answers[answer] += 1
            times.append(best)
            most = max(most, steps)
        worst = max(worst, max(times))
        print(
            f"| {name} | {len(cases)} | {statistics.median(times) * 1000:.2f} | {max(times) * 1000:.2f} "
            f"| {answers['fit']} | {answers['no fit']} | {answers['search limit']} | {most} |"
        )
    print(f"\nworst single decision: {worst * 1000:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
