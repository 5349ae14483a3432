"""IPAM delegation: run the plugin named by ``ipam.type`` from CNI_PATH, as the spec prescribes.

This is the plugin's only exec. Each interface is a separate IPAM attachment
(its own CNI_IFNAME), so host-local and friends key their allocations by the
pod-side interface name.

IPAM plugins may speak an older CNI version than the config (Debian 12's
host-local stops at 1.0.0). The plugin's supported versions are asked once
with VERSION and cached in ``<stateDir>/ipam-versions.json`` keyed by the
binary's path, size and mtime; requests are then sent in the highest version
both sides speak.

What a killed verb does to its IPAM child (see :func:`start_guarded`): every
IPAM exec runs under a small guard process in a session of its own (the
launcher's guard mode, ``launcher/guard.c``, or a fork of the plugin), so a
runtime killing the plugin (or its process group, or a warm server killing
its child) never kills IPAM half-way through writing a lease. The guard lets
IPAM finish within the verb's IPAM budget, kills IPAM's whole process group
if it overruns, and keeps the node lock the plugin held (it shares the
lock's descriptor) until IPAM is done, so the runtime's DEL, waiting for the
lock, releases whatever that IPAM call took.

All IPAM calls of one verb share one time budget (``ipamTimeoutSeconds``):
a hanging IPAM holds the node lock once for that long, not once per call.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import select
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rdma_cni.cni.errors import DecodeFailure, IpamError, TryAgainLater
from rdma_cni.cni.protocol import CniEnv, Result, version_tuple
from rdma_cni.node.statedir import make_dirs
from rdma_cni.shared.atomicfile import write_atomic

log = logging.getLogger("rdma_cni.ipam")

DEFAULT_BUDGET_SECONDS = 30.0
# How long past the budget the plugin waits for the guard itself (which only
# has to kill and report) before killing it too.
GUARD_GRACE_SECONDS = 5.0
# IPAM types that read only their configuration and their own files, never
# the pod's interface: these may run while the VF is being moved (see
# Ipam.interface_blind). dhcp talks through the interface; anything else may.
INTERFACE_BLIND_TYPES = frozenset({"host-local", "static"})
# Output kept from an IPAM plugin (a result is a few hundred bytes).
MAX_OUTPUT_BYTES = 1 << 20
# At most this much of IPAM's stdin is written per ready pipe (a pipe takes 4 KiB at once, atomically).
PIPE_CHUNK = 1 << 16

# The deadline shared by every IPAM call of the verb that runs (one verb per
# process, but tests run several in one): set by the first call, cleared by
# start_verb().
_deadline: float | None = None


def start_verb() -> None:
    """Start a new verb's IPAM time budget (its first IPAM call starts the clock)."""
    global _deadline
    _deadline = None


def _remaining(budget: float) -> float:
    global _deadline
    if _deadline is None:
        _deadline = time.monotonic() + budget
    return _deadline - time.monotonic()


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
            from rdma_cni.payload import payload_id_of

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


@dataclass
class IpamCall:
    """One IPAM request under way (see :meth:`Ipam.start`)."""

    verb: str
    ifname: str
    what: str
    guarded: GuardedCall | None  # None: nothing was run (no version both sides speak)

    def wait(self) -> Outcome | None:
        """Wait for the IPAM plugin to end (idempotent); :meth:`Ipam.finish_add` judges the answer."""
        return self.guarded.collect() if self.guarded is not None else None


class Ipam:
    """The IPAM plugin of one network config, found on CNI_PATH."""

    def __init__(self, conf_doc: Mapping[str, Any], env: CniEnv, state_dir: str) -> None:
        ipam = conf_doc.get("ipam") or {}
        # The document was validated as a NetConf (0 < ipamTimeoutSeconds <= 600).
        self.budget = float(conf_doc.get("ipamTimeoutSeconds", DEFAULT_BUDGET_SECONDS))
        self.type = str(ipam.get("type", ""))
        self._doc = dict(conf_doc)
        self._env = env
        self._cache_path = os.path.join(state_dir, "ipam-versions.json")
        self.binary = self._find(env.require_path())

    def _find(self, path: tuple[str, ...]) -> str:
        for directory in path:
            candidate = os.path.join(directory, self.type)
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
        raise IpamError(f"IPAM plugin {self.type!r} not found in CNI_PATH ({':'.join(path)})")

    @property
    def interface_blind(self) -> bool:
        """Whether this IPAM type never looks at the pod's interface, so it may run before the VF moves.

        host-local and static read only their configuration and their own
        files; dhcp needs the interface in the pod, and an unknown type may
        too, so every other type runs after the move, as CNI orders it.
        """
        return self.type in INTERFACE_BLIND_TYPES

    def _exec(self, verb: str, ifname: str, stdin: Mapping[str, Any]) -> tuple[int, Any]:
        return self._outcome(self._launch(verb, ifname, stdin))

    def _launch(self, verb: str, ifname: str, stdin: Mapping[str, Any]) -> IpamCall:
        env = dict(self._env.environ)
        env["CNI_COMMAND"] = verb
        if ifname:
            env["CNI_IFNAME"] = ifname
        what = f"IPAM plugin {self.type} {verb} for {ifname or 'the network'}"
        left = _remaining(self.budget)
        if left <= 0:
            raise TryAgainLater(
                f"{what} not run: the verb's IPAM time budget (ipamTimeoutSeconds, {self.budget:g} s) "
                "is spent"
            )
        try:
            guarded = start_guarded([self.binary], env, json.dumps(stdin).encode(), left)
        except OSError as exc:  # fork or pipe refused: the node is short of processes or descriptors
            raise TryAgainLater(f"{what} not run: cannot start its guard process: {exc.strerror}") from exc
        return IpamCall(verb, ifname, what, guarded)

    def _outcome(self, call: IpamCall) -> tuple[int, Any]:
        verb, what = call.verb, call.what
        done = call.wait()
        assert done is not None  # _launch always starts a guard
        if done.spawn_error:
            raise IpamError(f"cannot run IPAM plugin {self.binary}: {done.spawn_error}")
        if done.stderr:
            log.info("IPAM %s %s stderr: %s", self.type, verb, done.stderr.decode(errors="replace").strip())
        if done.timed_out:
            raise TryAgainLater(
                f"{what} did not finish within the verb's IPAM time budget (ipamTimeoutSeconds, "
                f"{self.budget:g} s); its process group was killed"
            )
        if done.status is None:
            raise IpamError(f"{what} was killed by signal {done.signal}")
        out = done.stdout.decode(errors="replace").strip()
        try:
            doc = json.loads(out) if out else None
        except ValueError:
            doc = None
            if done.status == 0:
                raise IpamError(f"{what} printed something that is not JSON", out[:500]) from None
        return done.status, doc

    def supported_versions(self) -> list[str]:
        """The IPAM plugin's supportedVersions (cached by binary identity)."""
        st = os.stat(self.binary)
        key = f"{self.binary}:{st.st_size}:{st.st_mtime_ns}"
        try:
            with open(self._cache_path, encoding="utf-8") as f:
                cache = json.load(f)
            if isinstance(cache, dict) and isinstance(cache.get(key), list):
                return cache[key]
        except (OSError, ValueError):
            cache = {}
        code, doc = self._exec("VERSION", "", {"cniVersion": "0.4.0"})
        versions = doc.get("supportedVersions") if code == 0 and isinstance(doc, dict) else None
        if not isinstance(versions, list):
            raise IpamError(f"IPAM plugin {self.type} did not answer VERSION", json.dumps(doc)[:500])
        try:
            make_dirs(os.path.dirname(self._cache_path))
            # A lost cache is asked again: no directory fsync needed.
            write_atomic(self._cache_path, json.dumps({key: versions}), sync_dir=False)
        except OSError as exc:
            log.warning("cannot cache IPAM versions in %s: %s", self._cache_path, exc)
        return versions

    def _version_for(self, wanted: str, minimum: str = "0.3.0") -> str | None:
        """The highest version <= ``wanted`` (and >= ``minimum``) the IPAM plugin speaks."""
        ours = version_tuple(wanted)
        usable = []
        for v in self.supported_versions():
            try:
                t = version_tuple(v)
            except ValueError:
                continue
            if version_tuple(minimum) <= t <= ours:
                usable.append((t, v))
        return max(usable)[1] if usable else None

    def _request(
        self, verb: str, ifname: str, extra: Mapping[str, Any] | None = None, minimum: str = "0.3.0"
    ) -> Any:
        call = self._begin(verb, ifname, extra, minimum)
        if call is None:
            return None
        try:
            return self._end(call)
        finally:
            call.wait()  # reaped even when the wait itself was interrupted

    def _begin(
        self, verb: str, ifname: str, extra: Mapping[str, Any] | None = None, minimum: str = "0.3.0"
    ) -> IpamCall | None:
        """Start one request (None: the plugin speaks no version that allows it)."""
        version = str(self._doc["cniVersion"])
        if version_tuple(version) > (1, 0, 0):
            # Only 1.1.0 has outrun common IPAM plugins; older configs go as they are.
            negotiated = self._version_for(version, minimum)
            if negotiated is None:
                return None
            version = negotiated
        # Each interface is its own IPAM attachment: a chained prevResult is not its business.
        stdin = {k: v for k, v in self._doc.items() if k != "prevResult"}
        stdin.update(extra or {})
        stdin["cniVersion"] = version
        return self._launch(verb, ifname, stdin)

    def _end(self, call: IpamCall) -> Any:
        """Wait for a request and judge its answer."""
        verb, ifname = call.verb, call.ifname
        if call.guarded is None:
            return None
        code, doc = self._outcome(call)
        # An error document is a failure even with exit status 0: a plugin saying
        # so must not hand the pod interfaces without addresses.
        if code != 0 or (isinstance(doc, dict) and "code" in doc):
            msg = doc.get("msg", "") if isinstance(doc, dict) else ""
            err_code = doc.get("code") if isinstance(doc, dict) else None
            target = ifname or "the network"
            status = f"exit status {code}" + (" with an error document" if code == 0 else "")
            text = f"IPAM plugin {self.type} {verb} for {target} failed: {str(msg)[:500] or status}"
            if err_code == 11:
                raise TryAgainLater(text, str(doc.get("details", "")))
            raise IpamError(text, json.dumps(doc)[:500] if doc else "")
        return doc

    def add(self, ifname: str) -> dict[str, Any]:
        """IPAM ADD for one pod-side interface; returns the IPAM result document."""
        call = self.start("ADD", ifname)
        try:
            return self.finish_add(call)
        finally:
            call.wait()

    def start(self, verb: str, ifname: str) -> IpamCall:
        """Start IPAM ``verb`` (ADD or DEL) for one pod-side interface; :meth:`finish_add` or
        :meth:`finish_delete` waits for it. The caller must make sure :meth:`IpamCall.wait` runs
        on every path (it is idempotent), so that IPAM never outlives the caller's own rollback."""
        # A plugin speaking no usable version is not run: its ADD then has no result, its DEL is moot.
        return self._begin(verb, ifname) or IpamCall(verb, ifname, f"IPAM plugin {self.type} {verb}", None)

    def finish_add(self, call: IpamCall) -> dict[str, Any]:
        """The result of an IPAM ADD started with :meth:`start`, checked."""
        doc = self._end(call)
        if not isinstance(doc, dict):
            raise IpamError(f"IPAM plugin {self.type} ADD for {call.ifname} returned no result")
        check_result(doc, f"IPAM plugin {self.type} ADD for {call.ifname}")
        return doc

    def delete(self, ifname: str) -> None:
        """IPAM DEL for one pod-side interface (idempotent for well-behaved IPAM plugins)."""
        self._request("DEL", ifname)

    def finish_delete(self, call: IpamCall) -> None:
        """Wait for an IPAM DEL started with :meth:`start`; raises as :meth:`delete` does."""
        self._end(call)

    def check(self, ifname: str, prev: Mapping[str, Any]) -> None:
        """IPAM CHECK for one interface, against its own result."""
        self._request("CHECK", ifname, {"prevResult": dict(prev)}, minimum="0.4.0")

    def gc(self, valid: list[dict[str, str]]) -> bool:
        """Forward GC; False when the IPAM plugin does not speak 1.1.0."""
        if self._version_for(str(self._doc["cniVersion"]), "1.1.0") is None:
            return False
        self._request("GC", "", {"cni.dev/valid-attachments": valid}, minimum="1.1.0")
        return True

    def status(self) -> bool:
        """Forward STATUS; False when the IPAM plugin does not speak 1.1.0 (nothing to ask)."""
        if self._version_for(str(self._doc["cniVersion"]), "1.1.0") is None:
            return False
        self._request("STATUS", "", minimum="1.1.0")
        return True


def check_result(doc: Mapping[str, Any], what: str) -> None:
    """Refuse (code 104) an IPAM result the plugin could not apply or pass on as it is."""
    try:
        res = Result.from_dict(doc)
    except DecodeFailure as exc:
        raise IpamError(f"{what} returned a malformed result: {exc.msg}", exc.details) from exc

    def bad(problem: str) -> IpamError:
        return IpamError(f"{what} returned an invalid result: {problem}", json.dumps(doc)[:500])

    def address(text: str, where: str, version: int) -> None:
        try:
            parsed = ipaddress.ip_address(text)
        except ValueError:
            raise bad(f"{where} {text[:100]!r} is not an IP address") from None
        if parsed.version != version:
            raise bad(f"{where} {text[:100]!r} is not an IPv{version} address")

    for i, ip in enumerate(res.ips):
        try:
            version = ipaddress.ip_interface(ip.address).version if "/" in ip.address else None
        except ValueError:
            version = None
        if version is None:
            raise bad(f"ips[{i}].address {ip.address[:100]!r} is not an address with a prefix length")
        if ip.gateway:
            address(ip.gateway, f"ips[{i}].gateway", version)
    for i, route in enumerate(res.routes):
        try:
            net = ipaddress.ip_network(route.dst, strict=False)
        except ValueError:
            raise bad(f"routes[{i}].dst {route.dst[:100]!r} is not a network") from None
        if route.gw:
            address(route.gw, f"routes[{i}].gw", net.version)
        for key in ("mtu", "advmss", "priority", "table", "scope"):
            value = getattr(route, key)
            if value is not None and (type(value) is not int or not 0 <= value < 1 << 32):
                raise bad(f"routes[{i}].{key} {value!r} is not a 32-bit unsigned integer")
    for key in ("nameservers", "search", "options"):
        values = res.dns.get(key, [])
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise bad(f"dns.{key} is not a list of strings")
    if not isinstance(res.dns.get("domain", ""), str):
        raise bad("dns.domain is not a string")
