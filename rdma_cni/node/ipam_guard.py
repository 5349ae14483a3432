"""The guard process every IPAM exec runs under: what a killed verb does to its IPAM child.

Every IPAM exec runs under a small guard process in a session of its own (the
launcher's guard mode, ``launcher/guard.c``, or a fork of the plugin), so a
runtime killing the plugin (or its process group, or a warm server killing
its child) never kills IPAM half-way through writing a lease. The guard lets
IPAM finish within the verb's IPAM budget, kills IPAM's whole process group
if it overruns, and keeps the node lock the plugin held (it shares the
lock's descriptor) until IPAM is done, so the runtime's DEL, waiting for the
lock, releases whatever that IPAM call took.

The guard is the launcher in its guard mode when the plugin runs from the
packed binary (posix_spawn: no copy of the plugin's pages), else a fork of
the plugin. It reports through a pipe: IPAM's pid, then a short header line
and the raw output (:class:`Outcome`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

# How long past the budget the plugin waits for the guard itself (which only
# has to kill and report) before killing it too.
GUARD_GRACE_SECONDS = 5.0
# Output kept from an IPAM plugin (a result is a few hundred bytes).
MAX_OUTPUT_BYTES = 1 << 20
# At most this much of IPAM's stdin is written per ready pipe (a pipe takes 4 KiB at once, atomically).
PIPE_CHUNK = 1 << 16


@dataclass
class Outcome:
    """How one guarded IPAM exec ended."""

    status: int | None  # exit status; None when it did not exit by itself
    signal: int | None  # the signal that ended it, if one did
    timed_out: bool
    stdout: bytes
    stderr: bytes
    spawn_error: str = ""


def _guard(argv: list[str], env: Mapping[str, str], data: bytes, timeout: float, report: int) -> None:
    """The guard's body: run IPAM in its own process group, bounded by ``timeout``, and report.

    The guard is a fork of the plugin, so every page of the plugin it writes
    is a copy: it does as little Python as it can. IPAM is started with
    ``posix_spawn`` (glibc's vfork-like clone: no second copy of the page
    tables) rather than :mod:`subprocess`, its pipes are served by one
    ``select`` loop, and the report is a short header line followed by the
    raw output.
    """
    # Only stdio reaches IPAM: every other descriptor of the plugin (the node
    # lock's above all) is closed on exec, whoever opened it.
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != report:
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        pid = os.posix_spawn(
            argv[0],
            argv,
            dict(env),
            file_actions=[
                (os.POSIX_SPAWN_DUP2, in_r, 0),
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
            ],
            setpgroup=0,
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),  # as subprocess restores them for a child
        )
    except OSError as exc:
        _write_all(report, b"E" + (exc.strerror or str(exc)).encode() + b"\n")
        return
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    _write_all(report, f"{pid}\n".encode())
    out, err, timed_out = _serve(pid, in_w, data, out_r, err_r, timeout)
    _, status = os.waitpid(pid, 0)  # exited, or killed by _serve
    code = os.waitstatus_to_exitcode(status)
    out = out[:MAX_OUTPUT_BYTES]
    err = err[-65536:]
    head = f"R {code} {int(timed_out)} {len(out)} {len(err)}\n".encode()
    _write_all(report, head + out + err)


def _serve(
    pid: int, stdin: int, data: bytes, out_fd: int, err_fd: int, timeout: float
) -> tuple[bytes, bytes, bool]:
    """Feed ``data`` to IPAM and read its output until it has exited and both pipes closed, or
    ``timeout`` ends it (then its group is killed; on return ``pid`` has exited either way)."""
    os.set_blocking(stdin, False)
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    kept = {out_fd: 0, err_fd: 0}
    exit_fd = os.pidfd_open(pid)  # readable once IPAM has exited: its output closing is not enough
    readers = [out_fd, err_fd, exit_fd]
    writers = [stdin] if data else []
    if not data:
        os.close(stdin)
    view = memoryview(data)
    deadline = time.monotonic() + timeout
    timed_out = False
    while readers:
        left = deadline - time.monotonic()
        if left <= 0 and not timed_out:
            timed_out = True
            # The whole group: a shell script's children hold the pipes and the leases too.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            for fd in writers:
                os.close(fd)
            writers = []
            # What is left is reading what the killed group wrote; give it a moment, not forever.
            deadline = time.monotonic() + GUARD_GRACE_SECONDS / 2
            continue
        if left <= 0:
            break
        ready_r, ready_w, _ = select.select(readers, writers, [], left)
        for fd in ready_w:
            try:
                view = view[os.write(fd, view[:PIPE_CHUNK]) :]
            except BrokenPipeError:
                view = view[:0]
            if not view:
                os.close(fd)
                writers = []
        for fd in ready_r:
            if fd == exit_fd:
                readers.remove(fd)
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                readers.remove(fd)
                continue
            if fd == err_fd or kept[fd] < MAX_OUTPUT_BYTES:
                chunks[fd].append(chunk)
                kept[fd] += len(chunk)
    if exit_fd in readers:  # the grace after the kill ran out before the exit was seen
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    for fd in writers:
        os.close(fd)
    for fd in (out_fd, err_fd, exit_fd):
        os.close(fd)
    return b"".join(chunks[out_fd]), b"".join(chunks[err_fd]), timed_out


def _write_all(fd: int, payload: bytes) -> None:
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view) :]


class GuardedCall:
    """A guarded IPAM exec under way: :func:`start_guarded` forks it, :meth:`collect` waits for it.

    The guard reports through a pipe; nothing here uses threads. Between the
    two the caller may do other work (ADD moves the VF meanwhile for an IPAM
    type that never looks at the pod's interface). :meth:`collect` is
    idempotent and always reaps the guard, so a caller that fails half-way
    calls it once more in a ``finally`` and never leaves IPAM running behind
    its own rollback.
    """

    def __init__(self, pid: int, report: int, timeout: float) -> None:
        self._pid = pid
        self._report = report
        self._limit = time.monotonic() + timeout + GUARD_GRACE_SECONDS
        self._outcome: Outcome | None = None

    def collect(self) -> Outcome:
        """Wait for the guard (within the budget plus a grace) and return how IPAM ended."""
        if self._outcome is None:
            self._outcome = self._wait()
        return self._outcome

    def _wait(self) -> Outcome:
        r, pid = self._report, self._pid
        ipam_pid = 0
        buf = b""
        try:
            while True:
                left = self._limit - time.monotonic()
                ready, _, _ = select.select([r], [], [], max(left, 0))
                if not ready:
                    # The guard itself is stuck (stopped?): end it and its IPAM.
                    for target, kill in ((ipam_pid, os.killpg), (pid, os.kill)):
                        if target:
                            with contextlib.suppress(ProcessLookupError):
                                kill(target, signal.SIGKILL)
                    return Outcome(None, None, True, b"", b"")
                chunk = os.read(r, 65536)
                if not chunk:
                    break
                buf += chunk
                if not ipam_pid and b"\n" in buf and buf[:1].isdigit():
                    head, _, buf = buf.partition(b"\n")
                    ipam_pid = int(head)
        finally:
            os.close(r)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        return _parse_report(buf)


def _parse_report(buf: bytes) -> Outcome:
    """Decode what :func:`_guard` wrote after IPAM's pid line."""
    if buf[:1] == b"E":
        return Outcome(None, None, False, b"", b"", spawn_error=buf[1:].decode(errors="replace").strip())
    head, sep, rest = buf.partition(b"\n")
    fields = head.split()
    try:
        if not sep or len(fields) != 5 or fields[0] != b"R":
            raise ValueError("no report")
        code, timed_out, n_out, n_err = (int(f) for f in fields[1:])
        if len(rest) != n_out + n_err:
            raise ValueError("short report")
    except ValueError:
        return Outcome(
            None, None, False, b"", b"", spawn_error="the IPAM guard process ended without a report"
        )
    return Outcome(
        code if code >= 0 else None,
        -code if code < 0 else None,
        bool(timed_out),
        rest[:n_out],
        rest[n_out:],
    )


# The argument that makes the launcher an IPAM guard (launcher/guard.h).
GUARD_ARG = "--ipam-guard"
# The launcher to run as the guard: (its descriptor, its path), None for a
# forked guard, False until looked up (once per process: a warm server's
# child looks it up itself, for its own caller's launcher).
_launcher: tuple[int, str] | bool | None = False


def kept_fds() -> set[int]:
    """The descriptor this process keeps open once it has looked its launcher up (none before)."""
    return {_launcher[0]} if isinstance(_launcher, tuple) else set()


def _guard_launcher() -> tuple[int, str] | None:
    """The packed launcher this plugin was started by, if it carries this very build.

    Only a launcher whose payload is the tree this process runs from is
    trusted to understand :data:`GUARD_ARG` (an older launcher installed
    meanwhile would start the plugin instead). It is kept open and run from
    that descriptor, so a file replaced after the check is never run.
    """
    global _launcher
    if _launcher is False:
        _launcher = None
        path = os.environ.get("RDMA_CNI_LAUNCHER", "")
        if path and getattr(sys, "frozen", False):
            from rdma_cni.launch.payload import payload_id_of

            own = os.path.basename(os.path.dirname(sys.executable))
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
            if payload_id_of(fd) == own:
                _launcher = (fd, path)
            else:
                os.close(fd)
    return _launcher or None


def start_guarded(argv: list[str], env: Mapping[str, str], data: bytes, timeout: float) -> GuardedCall:
    """Start ``argv`` with ``data`` on stdin under a guard process; see the module docstring.

    The guard is the launcher in its guard mode (``launcher/guard.c``) when
    this plugin runs from the packed binary, else a fork of this process.
    Either way it holds the node lock this process holds, and it leaves our
    session and our stdio at once: a runtime waiting for our stdout to
    close is never kept waiting by it. Raises OSError only before the guard
    started (nothing is then running).
    """
    launcher = _guard_launcher()
    if launcher is not None:
        return _spawn_guard(launcher, argv, env, data, timeout)
    return _fork_guard(argv, env, data, timeout)


def _spawn_guard(
    launcher: tuple[int, str], argv: list[str], env: Mapping[str, str], data: bytes, timeout: float
) -> GuardedCall:
    """Start the exec'd guard: the request on a memfd as its stdin, the lock on fd 3, the report on fd 1.

    posix_spawn is glibc's vfork-like clone: no copy of this process's
    pages or page tables, which a fork of a ~37 MB Python process costs.
    """
    from rdma_cni.node.record import held_lock

    fd, path = launcher
    r, w = os.pipe()
    opened: list[int] = [w]
    try:
        request = os.memfd_create("ipam-request", os.MFD_CLOEXEC)
        opened.append(request)
        view = memoryview(data)
        while view:
            view = view[os.write(request, view) :]
        os.lseek(request, 0, os.SEEK_SET)
        actions = [
            (os.POSIX_SPAWN_DUP2, request, 0),
            (os.POSIX_SPAWN_DUP2, w, 1),
            (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_RDWR, 0),
        ]
        lock = held_lock()
        if lock is not None:
            # Above the descriptors dup'ed onto 0-3, so no action undoes another.
            spare = fcntl.fcntl(lock, fcntl.F_DUPFD_CLOEXEC, 10)
            opened.append(spare)
            actions.append((os.POSIX_SPAWN_DUP2, spare, 3))
        if fd <= 3:  # the actions above would replace it before the exec
            fd = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
            opened.append(fd)
        budget_ms = max(1, int(timeout * 1000))
        pid = os.posix_spawn(
            f"/proc/self/fd/{fd}",
            [path, GUARD_ARG, str(budget_ms), *argv],
            dict(env),
            file_actions=actions,
            setsid=True,
        )
    except BaseException:
        os.close(r)
        raise
    finally:
        for extra in opened:
            os.close(extra)
    return GuardedCall(pid, r, timeout)


def _fork_guard(argv: list[str], env: Mapping[str, str], data: bytes, timeout: float) -> GuardedCall:
    """Start a guard that is a fork of this process (which then holds the node lock's descriptor)."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:  # pragma: no cover - the guard never returns (coverage cannot follow it)
        try:
            os.close(r)
            os.setsid()
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            _guard(argv, env, data, timeout, w)
        except BaseException:  # nothing may escape into a copy of the plugin
            pass
        finally:
            os._exit(0)
    os.close(w)
    return GuardedCall(pid, r, timeout)


def run_guarded(argv: list[str], env: Mapping[str, str], data: bytes, timeout: float) -> Outcome:
    """:func:`start_guarded` and wait for it."""
    return start_guarded(argv, env, data, timeout).collect()
