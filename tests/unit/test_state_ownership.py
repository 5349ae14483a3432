"""stateDir or lockFile owned or writable by others, symlinked, or on procfs: code 5, nothing changed."""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rdma_cni.cni.errors import IOFailure
from rdma_cni.node import statedir
from rdma_cni.node.record import Attachment, RecordStore, node_lock

NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def tree(root: Path) -> dict[str, tuple[int, int, bytes | None]]:
    """Every path under ``root``: (uid, mode, content of files)."""
    out = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            content = Path(path).read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[os.path.relpath(path, root)] = (st.st_uid, st.st_mode, content)
    return out


def refused(state_dir: Path) -> IOFailure:
    with pytest.raises(IOFailure) as info:
        RecordStore(str(state_dir))
    assert info.value.code == 5
    return info.value


# --------------------------------------------------------------------------
# stateDir


@needs_root
def test_state_dir_owned_by_another_user_is_code_5(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "attachments").mkdir(parents=True)
    (state / "attachments" / "c1@net1.json").write_text("{}")  # a planted record
    os.chown(state, NOBODY, NOBODY)
    before = tree(tmp_path)
    err = refused(state)
    assert str(state) in err.msg and f"uid {NOBODY}" in err.msg
    assert tree(tmp_path) == before


@needs_root
@pytest.mark.parametrize("sub", statedir.SUBDIRS)
def test_subdirectory_owned_by_another_user_is_code_5(tmp_path: Path, sub: str) -> None:
    state = tmp_path / "state"
    (state / sub).mkdir(parents=True)
    os.chown(state / sub, NOBODY, NOBODY)
    err = refused(state)
    assert str(state / sub) in err.msg and f"uid {NOBODY}" in err.msg


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757, 0o1777])
def test_state_dir_writable_by_others_is_code_5(tmp_path: Path, mode: int) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, mode)
    err = refused(state)
    assert str(state) in err.msg and f"uid {os.geteuid()}" in err.msg and "writable" in err.msg


def test_attachments_writable_by_others_is_code_5(tmp_path: Path) -> None:
    (tmp_path / "state" / "attachments").mkdir(parents=True)
    os.chmod(tmp_path / "state" / "attachments", 0o777)
    assert str(tmp_path / "state" / "attachments") in refused(tmp_path / "state").msg


def test_symlinked_state_dir_is_code_5(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "state").symlink_to(real)
    err = refused(tmp_path / "state")
    assert "symbolic link" in err.msg and str(tmp_path / "state") in err.msg
    assert list(real.iterdir()) == []


def test_symlinked_attachments_is_code_5(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "attachments").symlink_to(tmp_path / "elsewhere")
    assert "symbolic link" in refused(tmp_path / "state").msg


def test_state_dir_in_a_directory_others_can_write_is_code_5(tmp_path: Path) -> None:
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)
    err = refused(parent / "state")
    assert str(parent) in err.msg and "not sticky" in err.msg
    assert list(parent.iterdir()) == []


def test_state_dir_in_a_sticky_directory_is_fine(tmp_path: Path) -> None:
    parent = tmp_path / "tmp"
    parent.mkdir()
    os.chmod(parent, 0o1777)
    RecordStore(str(parent / "state")).ensure()


def test_plugin_creates_its_directories_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        store = RecordStore(str(tmp_path / "a" / "state"))
        store.ensure()
        store.write(Attachment(container_id="c", ifname="net1", network="n", netns="/x", cni_version="1.0.0"))
        store.quarantine(store.path("c", "net1"))
    finally:
        os.umask(old)
    modes = {p: stat.S_IMODE(os.stat(tmp_path / p).st_mode) for p in ("a", "a/state", "a/state/attachments")}
    assert modes == {"a": 0o755, "a/state": 0o700, "a/state/attachments": 0o700}
    assert stat.S_IMODE(os.stat(tmp_path / "a/state/quarantine").st_mode) == 0o700
    RecordStore(str(tmp_path / "a" / "state"))  # and they pass the check


def test_existing_0755_state_dir_is_kept_and_accepted(tmp_path: Path) -> None:
    # Earlier versions left stateDir 0755: no one else can write it, so it is trusted as it is.
    (tmp_path / "state" / "attachments").mkdir(parents=True, mode=0o755)
    os.chmod(tmp_path / "state", 0o755)
    RecordStore(str(tmp_path / "state")).ensure()
    assert stat.S_IMODE(os.stat(tmp_path / "state").st_mode) == 0o755


# --------------------------------------------------------------------------
# lockFile


def lock_refused(lock_file: str) -> IOFailure:
    started = time.monotonic()
    with pytest.raises(IOFailure) as info, node_lock(lock_file, 5):
        pass
    assert info.value.code == 5
    assert time.monotonic() - started < 1  # at once, not after the lock timeout
    return info.value


@needs_root
def test_lock_file_owned_and_flocked_by_another_user_is_code_5(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.write_text("")
    os.chown(lock, NOBODY, NOBODY)
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as its owner would, from another open file description
        err = lock_refused(str(lock))
    assert str(lock) in err.msg and f"uid {NOBODY}" in err.msg
    assert os.stat(lock).st_uid == NOBODY


def test_lock_file_writable_by_others_is_code_5(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.write_text("")
    os.chmod(lock, 0o666)
    err = lock_refused(str(lock))
    assert str(lock) in err.msg and "writable" in err.msg
    assert stat.S_IMODE(os.stat(lock).st_mode) == 0o666


@needs_root
def test_lock_directory_owned_by_another_user_is_code_5(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    os.chown(tmp_path / "run", NOBODY, NOBODY)
    err = lock_refused(str(tmp_path / "run" / "lock"))
    assert str(tmp_path / "run") in err.msg and f"uid {NOBODY}" in err.msg
    assert list((tmp_path / "run").iterdir()) == []


def test_lock_directory_writable_by_others_is_code_5(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    os.chmod(tmp_path / "run", 0o777)
    assert "not sticky" in lock_refused(str(tmp_path / "run" / "lock")).msg
    assert list((tmp_path / "run").iterdir()) == []


def test_symlinked_lock_file_is_code_5(tmp_path: Path) -> None:
    (tmp_path / "real").write_text("")
    (tmp_path / "lock").symlink_to(tmp_path / "real")
    assert "symbolic link" in lock_refused(str(tmp_path / "lock")).msg


@pytest.mark.parametrize("path", ["/proc/self/status", "/proc/version", "/sys/kernel/uevent_seqnum"])
def test_lock_file_on_procfs_or_sysfs_is_code_5(path: str) -> None:
    err = lock_refused(path)
    assert path in err.msg and ("on procfs" in err.msg or "on sysfs" in err.msg)


def test_lock_file_reached_through_a_link_to_proc_is_code_5(tmp_path: Path) -> None:
    (tmp_path / "p").symlink_to("/proc/self")
    assert "on procfs" in lock_refused(str(tmp_path / "p" / "status")).msg


@contextmanager
def mounted(fstype: str, where: Path) -> Iterator[Path]:
    """A pseudo file system of ``fstype`` mounted at ``where`` (as a node's /host/proc is) for the test."""
    where.mkdir()
    subprocess.run(["mount", "-t", fstype, fstype, str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


needs_mount = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a pseudo file system needs root")


@needs_mount
@pytest.mark.parametrize(
    ("fstype", "name", "inside"),
    [
        ("proc", "procfs", "self/status"),  # an existing file
        ("proc", "procfs", "rdma-cni.lock"),  # one the plugin would create
        ("sysfs", "sysfs", "kernel/rdma-cni.lock"),
        ("cgroup2", "cgroup2", "rdma-cni.lock"),
        ("debugfs", "debugfs", "rdma-cni.lock"),
    ],
)
def test_lock_file_on_a_pseudo_fs_mounted_elsewhere_is_code_5(
    tmp_path: Path, fstype: str, name: str, inside: str
) -> None:
    with mounted(fstype, tmp_path / "host-proc") as where:
        lock_file = str(where / inside)
        err = lock_refused(lock_file)
        assert (
            err.msg == f"lockFile {lock_file} is on {name}, where it cannot be locked; use a path under /run"
        )


@needs_mount
@pytest.mark.parametrize("inside", ["", "rdma-cni", "self"])
def test_state_dir_on_procfs_mounted_elsewhere_is_code_5(tmp_path: Path, inside: str) -> None:
    with mounted("proc", tmp_path / "host-proc") as where:
        state = where / inside if inside else where
        err = refused(state)
        assert (
            err.msg
            == f"stateDir {state} is on procfs, where nothing written is kept; use a path under /var/lib"
        )
        assert not (where / "rdma-cni").exists()


@needs_mount
def test_lock_file_on_tmpfs_mounted_elsewhere_is_fine(tmp_path: Path) -> None:
    with mounted("tmpfs", tmp_path / "run"), node_lock(str(tmp_path / "run" / "lock"), 1):
        pass


def test_lock_file_whose_file_system_cannot_be_read_is_code_5(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")  # statfs: too many levels of symbolic links
    err = lock_refused(str(tmp_path / "loop" / "lock"))
    assert err.msg.startswith(f"cannot inspect the file system of lockFile {tmp_path / 'loop'}")


def test_plugin_creates_the_lock_file_0600(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        with node_lock(str(tmp_path / "run" / "lock"), 1):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "lock").st_mode) == 0o600
    with node_lock(str(tmp_path / "run" / "lock"), 1):  # and it passes the check next time
        pass
