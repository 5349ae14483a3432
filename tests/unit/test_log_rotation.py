"""The plugin's logFile rotation (rdma_cni.log): bounded on disk, one rotator among concurrent verbs."""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdma_cni import log


@pytest.fixture
def restore_handlers() -> Iterator[None]:
    root = logging.getLogger("rdma_cni")
    before = list(root.handlers)
    yield
    for handler in root.handlers[len(before) :]:
        handler.close()
    root.handlers[:] = before


def test_a_small_or_missing_file_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "rdma-cni.log"
    assert log.rotate_if_large(str(path), limit=10) is False
    path.write_text("short\n")
    assert log.rotate_if_large(str(path), limit=10) is False
    assert path.read_text() == "short\n" and not (tmp_path / "rdma-cni.log.1").exists()


def test_a_full_file_moves_to_dot_1_replacing_the_previous(tmp_path: Path) -> None:
    path = tmp_path / "rdma-cni.log"
    (tmp_path / "rdma-cni.log.1").write_text("oldest\n")
    path.write_text("x" * 20)
    assert log.rotate_if_large(str(path), limit=10) is True
    assert not path.exists() and (tmp_path / "rdma-cni.log.1").read_text() == "x" * 20


def test_configure_starts_a_new_file_once_the_old_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_handlers: None
) -> None:
    path = tmp_path / "sub" / "rdma-cni.log"
    path.parent.mkdir()
    path.write_text("y" * 64)
    monkeypatch.setattr(log, "ROTATE_BYTES", 32)
    log.configure(str(path), "info", "ADD c/net1")
    logging.getLogger("rdma_cni.test").info("after rotation")
    for handler in logging.getLogger("rdma_cni").handlers:
        handler.flush()
    assert (tmp_path / "sub" / "rdma-cni.log.1").read_text() == "y" * 64
    assert "after rotation" in path.read_text() and "y" * 64 not in path.read_text()


def test_a_verb_already_rotating_it_wins(tmp_path: Path) -> None:
    """Another verb holds the file's lock (it is rotating): this one leaves the file alone."""
    path = tmp_path / "rdma-cni.log"
    path.write_text("z" * 20)
    with open(path) as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        assert log.rotate_if_large(str(path), limit=10) is False
    assert path.read_text() == "z" * 20


def test_a_file_rotated_meanwhile_is_not_rotated_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between this verb's open and its lock another verb rotated the file and a new one began."""
    path = tmp_path / "rdma-cni.log"
    path.write_text("z" * 20)
    real_flock = fcntl.flock

    def rotated_meanwhile(fd: int, op: int) -> None:
        os.rename(path, f"{path}.1")
        path.write_text("new\n")
        real_flock(fd, op)

    monkeypatch.setattr(log.fcntl, "flock", rotated_meanwhile)
    assert log.rotate_if_large(str(path), limit=10) is False
    assert path.read_text() == "new\n" and (tmp_path / "rdma-cni.log.1").read_text() == "z" * 20


def test_a_rotation_that_fails_is_logged_never_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "rdma-cni.log"
    path.write_text("z" * 20)
    (tmp_path / "rdma-cni.log.1").mkdir()  # rename onto a directory fails
    (tmp_path / "rdma-cni.log.1" / "keep").write_text("")
    logging.getLogger("rdma_cni").propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="rdma_cni"):
            assert log.rotate_if_large(str(path), limit=10) is False
    finally:
        logging.getLogger("rdma_cni").propagate = False
    assert path.read_text() == "z" * 20
    assert "cannot rotate logFile" in caplog.text


def test_a_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("z" * 20)
    path = tmp_path / "rdma-cni.log"
    path.symlink_to(target)
    assert log.rotate_if_large(str(path), limit=10) is False
    assert path.is_symlink() and target.read_text() == "z" * 20


def test_a_fifo_or_a_directory_is_not_rotated_nor_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    assert log.rotate_if_large(str(fifo), limit=0) is False  # returns at once: no writer needed
    directory = tmp_path / "dir.log"
    directory.mkdir()
    assert log.rotate_if_large(str(directory), limit=0) is False
    assert fifo.exists() and directory.is_dir() and not (tmp_path / "dir.log.1").exists()
