"""Pruning the launcher's cache: other versions' trees go once nothing may use them, and only then."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from rdma_cni.launch import cacheprune, warm

NOW = 1_800_000_000.0
DAY = 86400.0
CURRENT = "0123456789abcdef"
OLD = "fedcba9876543210"


def unpack(base: Path, name: str, started: float) -> Path:
    """A complete tree as the launcher leaves it, its program last started at ``started``."""
    tree = base / name
    tree.mkdir(parents=True)
    program = tree / "rdma-cni"
    program.write_bytes(b"x" * 100)
    (tree / ".complete").write_text("")
    os.utime(program, (started, started))
    return tree


@pytest.fixture
def base(tmp_path: Path) -> Path:
    base = tmp_path / "cache"
    base.mkdir(mode=0o700)
    return base


def empty_proc(tmp_path: Path) -> str:
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    return str(proc)


def test_an_old_idle_tree_goes_the_current_one_stays(base: Path, tmp_path: Path) -> None:
    unpack(base, CURRENT, NOW - 30 * DAY)
    unpack(base, OLD, NOW - 8 * DAY)
    (base / ".tmp-0123456789abcdef-1").mkdir()  # an unpack in progress: not the pruner's
    (base / "notes").write_text("")
    outcomes = cacheprune.prune(str(base), CURRENT, now=NOW, proc=empty_proc(tmp_path))
    assert [(o.tree, o.removed) for o in outcomes] == [(OLD, True)]
    assert sorted(os.listdir(base)) == [".tmp-0123456789abcdef-1", CURRENT, "notes"]


def test_a_tree_started_recently_stays(base: Path, tmp_path: Path) -> None:
    unpack(base, OLD, NOW - 2 * DAY)
    [outcome] = cacheprune.prune(str(base), CURRENT, now=NOW, proc=empty_proc(tmp_path))
    assert not outcome.removed and "started 172800 s ago" in outcome.why
    assert (base / OLD / ".complete").exists()


def test_a_tree_a_process_runs_from_stays(base: Path, tmp_path: Path) -> None:
    tree = unpack(base, OLD, NOW - 30 * DAY)
    proc = Path(empty_proc(tmp_path))
    (proc / "4242").mkdir()
    (proc / "4242" / "exe").symlink_to(tree / "rdma-cni")
    (proc / "self").mkdir()  # not a pid
    [outcome] = cacheprune.prune(str(base), CURRENT, now=NOW, proc=str(proc))
    assert not outcome.removed and "process 4242" in outcome.why
    assert tree.exists()


def test_a_tree_whose_warm_server_holds_its_lock_stays(base: Path, tmp_path: Path) -> None:
    tree = unpack(base, OLD, NOW - 30 * DAY)
    fd = os.open(tree / "warm.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        [outcome] = cacheprune.prune(str(base), CURRENT, now=NOW, proc=empty_proc(tmp_path))
        assert not outcome.removed and outcome.why == "a warm server holds it"
        assert tree.exists()
    finally:
        os.close(fd)
    # The server gone (its lock released), the tree goes.
    [outcome] = cacheprune.prune(str(base), CURRENT, now=NOW, proc=empty_proc(tmp_path))
    assert outcome.removed and not tree.exists()


def test_what_an_interrupted_prune_left_is_removed(base: Path, tmp_path: Path) -> None:
    aside = base / f".prune-{OLD}-77"
    (aside / "lib").mkdir(parents=True)
    assert cacheprune.prune(str(base), CURRENT, now=NOW, proc=empty_proc(tmp_path)) == []
    assert not aside.exists()


def test_no_cache_prunes_nothing(tmp_path: Path) -> None:
    assert cacheprune.prune(str(tmp_path / "none"), CURRENT) == []


def test_the_real_proc_finds_a_process_by_its_program(tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    tree = tmp_path / OLD
    tree.mkdir()
    shutil.copy(sys.executable, tree / "rdma-cni")
    child = subprocess.Popen([str(tree / "rdma-cni"), "-c", "import time; time.sleep(30)"])
    try:
        # Also through another path to the same file (a host root mounted elsewhere).
        (tmp_path / "elsewhere").symlink_to(tmp_path)
        assert cacheprune.processes_in(str(tmp_path / "elsewhere" / OLD)) == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert cacheprune.processes_in(str(tree)) == []


def test_the_warm_server_prunes_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "cache"
    tree = unpack(base, CURRENT, NOW)
    old = unpack(base, OLD, 0.0)  # 1970: long idle
    server = warm.Server(str(tree), None, run=lambda: 0)  # serves no child here
    monkeypatch.setattr(server, "wanted", lambda: False)
    try:
        server.serve_forever()  # not wanted: returns after its first round
    finally:
        server.close()
    assert tree.exists() and not old.exists()
