"""The node lock (a blocking flock with a bounded wait, compatible with filelock's flock) and each
attachment's (a byte of the same file, locked by an open file description)."""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from rdma_cni.cni.errors import IOFailure, TryAgainLater
from rdma_cni.node import record
from rdma_cni.node.record import attachment_lock, attachment_lock_if_free, held_lock, node_lock


def _holder(path: Path, seconds: float) -> int:
    """A child process that holds flock on ``path`` for ``seconds``; its pid, once it holds it."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(ready_r)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(ready_w, b"x")
        time.sleep(seconds)
        os._exit(0)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"x"
    os.close(ready_r)
    return pid


def test_lock_is_created_0600_and_released(tmp_path: Path) -> None:
    lock = tmp_path / "run" / "rdma-cni.lock"
    with node_lock(str(lock), 1):
        assert lock.stat().st_mode & 0o777 == 0o600
        fd = os.open(lock, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
    os.close(fd)


SYS_FLOCK = 73  # x86_64


def test_waiter_sleeps_in_flock_so_the_kernel_hands_the_lock_over_at_release(tmp_path: Path) -> None:
    # Polling (filelock's way) would show the waiter in a sleep between
    # attempts, and leave the lock idle for up to a poll interval.
    lock = tmp_path / "lock"
    held = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            with node_lock(str(lock), 10):
                os._exit(0)
        except BaseException:
            os._exit(1)
    try:
        deadline = time.monotonic() + 10
        while True:
            with open(f"/proc/{pid}/syscall") as f:
                if f.read().split()[0] == str(SYS_FLOCK):
                    break
            assert time.monotonic() < deadline, "the waiter never blocked in flock"
            time.sleep(0.01)
    finally:
        fcntl.flock(held, fcntl.LOCK_UN)
        os.close(held)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_timeout_is_code_11_and_restores_the_alarm_handler(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    pid = _holder(lock, 5)
    before = signal.getsignal(signal.SIGALRM)
    try:
        started = time.monotonic()
        with pytest.raises(TryAgainLater) as info, node_lock(str(lock), 0.2):
            pass
        assert 0.2 <= time.monotonic() - started < 2
        assert info.value.code == 11 and str(lock) in info.value.msg
        assert signal.getsignal(signal.SIGALRM) is before
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        with pytest.raises(TryAgainLater), node_lock(str(lock), 0):  # timeout 0: one try only
            pass
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_off_the_main_thread_the_wait_polls_and_still_times_out(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    pid = _holder(lock, 0.3)
    outcomes: list[object] = []

    def run(timeout: float) -> None:
        try:
            with node_lock(str(lock), timeout):
                outcomes.append("held")
        except TryAgainLater as exc:
            outcomes.append(exc)

    try:
        short = threading.Thread(target=run, args=(0.05,))
        short.start()
        short.join()
        patient = threading.Thread(target=run, args=(10,))
        patient.start()
        patient.join()
    finally:
        os.waitpid(pid, 0)
    assert isinstance(outcomes[0], TryAgainLater)
    assert outcomes[1] == "held"


def test_unopenable_lock_file_is_code_5(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    with pytest.raises(IOFailure) as info, node_lock(str(tmp_path / "dir"), 1):
        pass
    assert "cannot open lockFile" in info.value.msg
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(IOFailure) as info, node_lock(str(blocker / "lock"), 1):
        pass
    assert "is not a directory" in info.value.msg


# The attachment's lock: one byte of the same file, under an open file description's lock.


def test_an_attachments_lock_excludes_only_that_attachment(tmp_path: Path) -> None:
    lock = str(tmp_path / "lock")
    with attachment_lock(lock, "ctr1", "net1", 1):
        # Another attachment, and the node lock, are free meanwhile (OFD locks conflict between
        # open file descriptions even in one process, so this process can ask itself).
        with attachment_lock(lock, "ctr1", "net2", 1), attachment_lock(lock, "ctr2", "net1", 1):
            pass
        with node_lock(lock, 1):
            pass
        started = time.monotonic()
        with pytest.raises(TryAgainLater) as info, attachment_lock(lock, "ctr1", "net1", 0.2):
            pass
        assert 0.2 <= time.monotonic() - started < 2
        assert info.value.code == 11 and "ctr1/net1" in info.value.msg
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        with attachment_lock_if_free(lock, "ctr1", "net1") as free:
            assert not free
    with attachment_lock_if_free(lock, "ctr1", "net1") as free:
        assert free
        with pytest.raises(TryAgainLater), attachment_lock(lock, "ctr1", "net1", 0):
            pass
    with attachment_lock(lock, "ctr1", "net1", 0):  # free again once left
        pass


def test_the_node_lock_held_elsewhere_does_not_hold_an_attachment(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    pid = _holder(lock, 5)  # flock of the whole file, in another process
    try:
        with attachment_lock(str(lock), "ctr1", "net1", 0):
            pass
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_the_innermost_lock_is_what_an_ipam_guard_keeps(tmp_path: Path) -> None:
    lock = str(tmp_path / "lock")
    assert held_lock() is None
    with attachment_lock(lock, "ctr1", "net1", 1):
        outer = held_lock()
        with node_lock(lock, 1):
            assert held_lock() not in (None, outer)
        assert held_lock() == outer
        # A guard's copy of the descriptor keeps the attachment held after this process lets go.
        assert outer is not None
        copy = os.dup(outer)
    try:
        with pytest.raises(TryAgainLater), attachment_lock(lock, "ctr1", "net1", 0.1):
            pass
    finally:
        os.close(copy)
    with attachment_lock(lock, "ctr1", "net1", 0):
        pass
    assert held_lock() is None


def test_off_the_main_thread_an_attachment_wait_polls(tmp_path: Path) -> None:
    lock = str(tmp_path / "lock")
    outcomes: list[object] = []

    def run(timeout: float) -> None:
        try:
            with attachment_lock(lock, "ctr1", "net1", timeout):
                outcomes.append("held")
        except TryAgainLater as exc:
            outcomes.append(exc)

    with attachment_lock(lock, "ctr1", "net1", 1):
        short = threading.Thread(target=run, args=(0.05,))
        short.start()
        short.join()
        patient = threading.Thread(target=run, args=(10,))
        patient.start()
        time.sleep(0.1)
    patient.join()
    assert isinstance(outcomes[0], TryAgainLater)
    assert outcomes[1] == "held"


def test_an_attachment_lock_on_an_unusable_lock_file_is_code_5(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    with pytest.raises(IOFailure), attachment_lock(str(tmp_path / "dir"), "c", "n", 1):
        pass
    with pytest.raises(IOFailure), attachment_lock_if_free(str(tmp_path / "dir"), "c", "n"):
        pass


def test_the_holder_runs_ahead_of_the_verbs_not_waiting_and_goes_back_after(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("lowering a nice value needs CAP_SYS_NICE (the unit tier runs as root in CI)")
    lock = tmp_path / "rdma-cni.lock"
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with node_lock(str(lock), 1):
        assert os.getpriority(os.PRIO_PROCESS, 0) == min(before, record.HOLDER_NICE)
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
    with pytest.raises(RuntimeError), node_lock(str(lock), 1):
        raise RuntimeError("a verb failing under the lock")
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def test_a_holder_already_higher_is_left_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nice = {"now": -15}
    monkeypatch.setattr(os, "getpriority", lambda which, who: nice["now"])
    monkeypatch.setattr(os, "setpriority", lambda which, who, value: nice.update(now=value))
    with node_lock(str(tmp_path / "rdma-cni.lock"), 1):
        assert nice["now"] == -15
    assert nice["now"] == -15


def test_without_cap_sys_nice_the_lock_is_taken_all_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int] = []

    def refused(which: int, who: int, value: int) -> None:
        asked.append(value)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "getpriority", lambda which, who: 0)
    monkeypatch.setattr(os, "setpriority", refused)
    lock = tmp_path / "rdma-cni.lock"
    with node_lock(str(lock), 1):
        fd = os.open(lock, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    assert asked == [record.HOLDER_NICE]  # asked once; nothing to give back
