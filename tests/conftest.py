"""Session-wide hygiene for every tier."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import pytest


def warm_servers() -> set[int]:
    """Pids of running ``rdma-cni warm-server`` processes (any tree)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[1] == b"warm-server" and argv[0].endswith(b"/rdma-cni"):
            pids.add(int(entry))
    return pids


@pytest.fixture(scope="session", autouse=True)
def _stop_warm_servers_started_by_the_tests() -> Iterator[None]:
    # Running the built binary starts warm servers (README, "Warm start"); they
    # would idle for minutes after the run. Servers that were already there
    # are not ours to stop.
    before = warm_servers()
    yield
    for pid in warm_servers() - before:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
