"""The fault tier (`make faults`): the integration tier's node and fixtures, a seed, and the counts.

The seed comes from RDMA_CNI_FAULT_SEED (else a random one) and is printed in
the header and the summary: the same seed replays the same inputs, kill
delays and faults. RDMA_CNI_FAULT_SCALE multiplies the number of inputs and
cycles (default 1, about five minutes on the 2-core development machine).
Both live in knobs.py.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from tests.faults.knobs import SCALE, SEED, STATS
from tests.integration.conftest import api_server, cluster  # noqa: F401 - fixtures shared with the integration tier


def pytest_report_header() -> str:
    return f"fault tier seed {SEED} (replay with RDMA_CNI_FAULT_SEED={SEED}), scale {SCALE:g}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not STATS:
        return
    tr = terminalreporter
    tr.section("fault tier counts")
    tr.write_line(f"seed {SEED}, scale {SCALE:g}")
    tr.write_line("| family | inputs | cycles | plugin runs | violations | also |")
    tr.write_line("| --- | ---: | ---: | ---: | ---: | --- |")
    total: Counter[str] = Counter()
    main = ("inputs", "cycles", "runs", "violations")
    for family, c in sorted(STATS.items()):
        total.update({k: c[k] for k in main})
        also = ", ".join(f"{k} {v}" for k, v in sorted(c.items()) if k not in main)
        tr.write_line(
            f"| {family} | {c['inputs']} | {c['cycles']} | {c['runs']} | {c['violations']} | {also} |"
        )
    tr.write_line(
        f"| total | {total['inputs']} | {total['cycles']} | {total['runs']} | {total['violations']} | |"
    )


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """A generator seeded from the tier's seed and the test's name: each test replays on its own."""
    return random.Random(f"{SEED}:{request.node.name}")
