"""Session-wide hygiene for every tier."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import warm_servers


@pytest.fixture(scope="session", autouse=True)
def _stop_warm_servers_started_by_the_tests() -> Iterator[None]:
    # Running the built binary starts warm servers (README, "Warm start"); they
    # would idle for minutes after the run. Servers that were already there
    # are not ours to stop.
    before = set(warm_servers())
    yield
    for pid in set(warm_servers()) - before:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


@pytest.fixture
def no_real_sysfs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Point the plugin at an empty sysfs tree, without the fake VF control, so a test never reads /sys."""
    empty = tmp_path / "empty-sys"
    empty.mkdir()
    monkeypatch.setenv("RDMA_CNI_SYSFS_ROOT", str(empty))
    monkeypatch.delenv("RDMA_CNI_FAKE_VF_CONTROL", raising=False)
