"""The logFile is rotated by size into one ``.1``, and concurrent verbs never rotate twice."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from rdma_cni import log as rdma_log


def fill(path: Path, size: int, byte: bytes = b"a") -> None:
    path.write_bytes(byte * size)


def test_a_full_log_becomes_dot_one_and_replaces_the_old(tmp_path: Path) -> None:
    path = tmp_path / "rdma-cni.log"
    fill(tmp_path / "rdma-cni.log.1", 10, b"o")
    fill(path, 100)
    assert not rdma_log.rotate_if_full(str(path), max_bytes=101)
    assert rdma_log.rotate_if_full(str(path), max_bytes=100)
    assert not path.exists()
    assert (tmp_path / "rdma-cni.log.1").read_bytes() == b"a" * 100
    assert not rdma_log.rotate_if_full(str(path), max_bytes=100)  # nothing there: nothing to do


def test_a_verb_that_loses_the_race_leaves_the_fresh_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rdma-cni.log"
    fill(path, 100)
    real_flock = rdma_log.fcntl.flock

    def another_verb_rotates_first(fd: int, op: int) -> None:
        os.rename(path, str(path) + ".1")
        fill(path, 5, b"n")
        real_flock(fd, op)

    monkeypatch.setattr(rdma_log.fcntl, "flock", another_verb_rotates_first)
    assert not rdma_log.rotate_if_full(str(path), max_bytes=100)
    assert path.read_bytes() == b"n" * 5
    assert (tmp_path / "rdma-cni.log.1").read_bytes() == b"a" * 100


def test_configure_rotates_before_it_opens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rdma-cni.log"
    fill(path, 64)
    monkeypatch.setattr(rdma_log, "LOG_MAX_BYTES", 64)
    root = logging.getLogger("rdma_cni")
    before = list(root.handlers)
    try:
        rdma_log.configure(str(path), "info", "ADD c/eth1")
        root.info("after rotation")
    finally:
        for handler in root.handlers[len(before) :]:
            handler.close()
        root.handlers[:] = before
    assert (tmp_path / "rdma-cni.log.1").read_bytes() == b"a" * 64
    assert "after rotation" in path.read_text()
