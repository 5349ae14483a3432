"""The fault tier's seed, scale and counts (one module, shared by the conftest and the harness)."""

from __future__ import annotations

import os
import random
from collections import Counter

SEED = int(os.environ.get("RDMA_CNI_FAULT_SEED") or random.SystemRandom().randrange(1 << 32))
SCALE = float(os.environ.get("RDMA_CNI_FAULT_SCALE") or 1)
# family -> inputs, cycles, plugin runs, violations; filled by the tests.
STATS: dict[str, Counter[str]] = {}


def scaled(n: int) -> int:
    """``n`` inputs or cycles at the configured scale (at least 1)."""
    return max(1, round(n * SCALE))
