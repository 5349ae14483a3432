"""The one atomic write: fsync, exact mode (0600 by default); a failure leaves the old file, no temporary."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

import pytest

from rdma_cni.shared import atomicfile
from rdma_cni.shared.atomicfile import write_atomic


def test_writes_0600_by_default_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        write_atomic(str(tmp_path / "f"), "text")
    finally:
        os.umask(old)
    assert (tmp_path / "f").read_text() == "text"
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["f"]


def test_exact_mode_bytes_and_writer_function(tmp_path: Path) -> None:
    write_atomic(str(tmp_path / "b"), b"\x00\x01", mode=0o755)
    assert (tmp_path / "b").read_bytes() == b"\x00\x01"
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o755
    write_atomic(str(tmp_path / "b"), lambda f: f.write(b"new"), mode=0o640)
    assert (tmp_path / "b").read_bytes() == b"new"
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o640


def test_fsyncs_the_file_then_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(atomicfile.os, "fsync", fsync)
    monkeypatch.setattr(atomicfile.os, "replace", replace)
    write_atomic(str(tmp_path / "f"), "x")
    assert events == ["file", "rename", "dir"]
    events.clear()
    write_atomic(str(tmp_path / "f"), "y", sync_dir=False)
    assert events == ["file", "rename"]


def _fail_writing(f: BinaryIO) -> None:
    f.write(b"partial")
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("where", ["write", "fsync", "rename"])
def test_failure_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    target = tmp_path / "f"
    target.write_text("old")
    os.chmod(target, 0o644)
    data: object = "new"
    if where == "write":
        data = _fail_writing
    else:

        def boom(*_args: object) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(atomicfile.os, "fsync" if where == "fsync" else "replace", boom)
    with pytest.raises(OSError):
        write_atomic(str(target), data)  # type: ignore[arg-type]
    assert target.read_text() == "old"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert os.listdir(tmp_path) == ["f"]


def test_does_not_follow_a_planted_temporary_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, atomicfile.temporary_name(str(tmp_path / "f")))
    with pytest.raises(OSError):
        write_atomic(str(tmp_path / "f"), "x")
    assert victim.read_text() == "keep"


# Renames that are not file writes, each saying why where it is: a listening socket put in place
# (the warm server's, the CNI server's), a full logFile moved aside (rotation), an unpacked tree
# moved aside before it is deleted, a spooled DEL claimed by a hard link (delspool: a link never
# replaces a claim another runner made). A corrupt record or spooled DEL set aside is atomicfile.move.
NOT_WRITES = {
    ("rdma_cni/launch/warm.py", "listen"),
    ("rdma_cni/agent/cniserver.py", "_publish"),
    ("rdma_cni/agent/delspool.py", "settle"),
    ("rdma_cni/log.py", "rotate_if_large"),
    ("rdma_cni/launch/cacheprune.py", "_remove"),
}


def test_every_writer_uses_the_one_helper() -> None:
    import ast

    root = Path(__file__).resolve().parents[2]
    found = set()
    for path in sorted((root / "rdma_cni").rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel == "rdma_cni/shared/atomicfile.py":
            continue
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef):
                continue
            for node in ast.walk(func):
                if not isinstance(node, ast.Attribute):
                    continue
                owner = node.value.id if isinstance(node.value, ast.Name) else ""
                if (
                    (owner == "os" and node.attr in ("rename", "renames", "replace", "link"))
                    or (owner == "tempfile" and node.attr == "mkstemp")
                    or (owner == "shutil" and node.attr == "move")
                    or (node.attr == "rename" and owner != "os")  # pathlib's, or anything named so
                ):
                    found.add((rel, func.name))
    assert found == NOT_WRITES


def test_a_move_is_renamed_then_both_directories_flushed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "f").write_text("x")
    events: list[str] = []
    real_replace = os.replace
    monkeypatch.setattr(atomicfile.os, "replace", lambda s, d: events.append("rename") or real_replace(s, d))
    monkeypatch.setattr(atomicfile, "fsync_dir", lambda d: events.append(os.path.basename(d)))
    atomicfile.move(str(tmp_path / "a" / "f"), str(tmp_path / "b" / "g"))
    assert events == ["rename", "b", "a"] and (tmp_path / "b" / "g").read_text() == "x"
    events.clear()
    atomicfile.move(str(tmp_path / "b" / "g"), str(tmp_path / "b" / "h"))
    assert events == ["rename", "b"]  # one directory: flushed once
    events.clear()
    atomicfile.move(str(tmp_path / "b" / "h"), str(tmp_path / "a" / "f"), sync_dir=False)
    assert events == ["rename"]
    with pytest.raises(FileNotFoundError):
        atomicfile.move(str(tmp_path / "b" / "h"), str(tmp_path / "a" / "g"))
    assert not (tmp_path / "a" / "g").exists()


def test_a_corrupt_record_is_set_aside_with_the_one_move(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rdma_cni.node.record import RecordStore

    store = RecordStore(str(tmp_path / "state"))
    store.ensure()
    path = store.path("c", "net1")
    Path(path).write_text("{")
    moved: list[tuple[str, str]] = []
    real = atomicfile.move
    monkeypatch.setattr(atomicfile, "move", lambda s, d: moved.append((s, d)) or real(s, d))
    kept = store.quarantine(path)
    assert moved == [(path, kept)] and Path(kept).read_text() == "{" and not Path(path).exists()
