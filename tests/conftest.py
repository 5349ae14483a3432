"""Session-wide hygiene for every tier."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import cache_id, warm_servers


def _ours(pid: int, marks: tuple[str, ...]) -> bool:
    """Whether warm server ``pid`` runs from a tree this session made (its binary's, or under its temp)."""
    try:
        program = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return any(mark in program for mark in marks)


@pytest.fixture(scope="session", autouse=True)
def _stop_warm_servers_started_by_the_tests(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # Running the built binary starts warm servers (docs/architecture.md, "Warm start"); they
    # would idle for minutes after the run. Servers that were already there,
    # or that belong to another test session's binary running beside this
    # one, are not ours to stop.
    before = set(warm_servers())
    binary = os.environ.get("RDMA_CNI_BINARY")
    marks = (str(tmp_path_factory.getbasetemp()),) + ((cache_id(binary),) if binary else ())
    yield
    for pid in set(warm_servers()) - before:
        if _ours(pid, marks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


@pytest.fixture
def no_real_sysfs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Point the plugin at an empty sysfs tree, without the fake VF control, so a test never reads /sys."""
    empty = tmp_path / "empty-sys"
    empty.mkdir()
    monkeypatch.setenv("RDMA_CNI_SYSFS_ROOT", str(empty))
    monkeypatch.delenv("RDMA_CNI_FAKE_VF_CONTROL", raising=False)
