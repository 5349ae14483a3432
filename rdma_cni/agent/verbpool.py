"""The CNI server's pool of verb workers: who runs each verb the shim hands over.

The workers are processes of :mod:`rdma_cni.agent.verbworker`, forked by one
zygote that this pool starts (``<plugin> cni-workers``, the only exec; again
only if it dies) and that imported the verbs once. A call takes an idle
worker (or waits for one), sends it the request and the pod's namespace fd
over the worker's socket, and waits for its answer, for the caller going
away and for the verb's timeout at once:

- the answer comes: it is relayed, and the worker rejoins the idle ones once
  it says it is clean again (after the answer: the caller never waits for
  that), or is dropped if it leaves instead;
- the caller goes away, or the verb outlives its timeout: the worker's
  process group is killed, as a runtime kills a plugin's (an IPAM call under
  way is left to finish: its guard has a session of its own), and another
  worker takes its place;
- the worker dies mid-verb: the call is answered code 11, the outcome unknown.

How many: :attr:`WorkerPool.spare` workers are kept ready at all times (the
agent reports Ready only once they are: :meth:`WorkerPool.wait_ready`), more
are forked while calls wait, up to :attr:`WorkerPool.size` at once, and those
beyond the spare ones leave after :attr:`WorkerPool.idle_seconds` unused. The
node lock serializes most of a verb anyway; the bound keeps the agent's
memory bounded however many calls arrive at once (each worker's own pages
are what it wrote; the rest it shares with the zygote).

One thread of the pool (``cni-workers``) starts the zygote and the workers,
reads the readiness of new and just-used workers, and retires idle ones;
the server's call threads only take idle workers and hand them back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rdma_cni.agent.shimconn import hung_up
from rdma_cni.agent.shimwire import ANSWER_HEADER, ANSWER_MAGIC, Request, encode_request
from rdma_cni.agent.verbworker import FORK, FORK_FAILED, FORKED, WORKER_READY, ZYGOTE_READY, read_exact

log = logging.getLogger("rdma_cni.agent.cniserver")

# Workers kept (ready or running a verb), and at most at once (docs/deploy.md: the shim and the agent).
# ADD holds the node lock a few milliseconds; most of a verb is the kernel's namespace moves, one
# after another under its RTNL lock, and Python between them: in a burst of 64 pods, 12 workers kept
# the kernel busy where 4 left it idle while they all ran Python (docs/performance.md).
SPARE_WORKERS = 2
MAX_WORKERS = 12
# Workers beyond the spare ones leave after this long unused.
IDLE_SECONDS = 60.0
# The zygote's imports; a fork and a worker's warm-up.
ZYGOTE_START_SECONDS = 120.0
WORKER_START_SECONDS = 30.0
# A zygote that fails to start (or dies) is started again after this long, doubling to the maximum.
RESTART_FIRST, RESTART_MAX = 1.0, 60.0
# An answer (written at once by the worker) must arrive whole within this long of its first byte.
ANSWER_SECONDS = 10.0
# Largest stdout relayed (the shim's own bound, launcher/shim.c MAX_ANSWER).
MAX_OUTPUT = 4 << 20
MAX_STDERR = 64 << 10


def cni_error(code: int, msg: str) -> bytes:
    """A CNI error document, for the answers the server gives itself."""
    import json

    return (json.dumps({"cniVersion": "1.1.0", "code": code, "msg": msg}) + "\n").encode()


@dataclass(eq=False)
class Worker:
    """One worker process, as the pool holds it."""

    pid: int
    pidfd: int | None  # None on kernels without pidfds (before 5.3)
    channel: socket.socket
    served: int = 0
    idle_since: float = field(default_factory=time.monotonic)

    def gone(self) -> bool:
        """Whether an idle worker has died (it sends nothing while idle: readable means closed)."""
        poller = select.poll()
        poller.register(self.channel.fileno(), select.POLLIN | select.POLLHUP)
        return bool(poller.poll(0))

    def _exited(self) -> bool:
        if self.pidfd is None:
            return False
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def kill(self) -> None:
        """SIGKILL the worker's process group (it leads its own), as a runtime kills a plugin's.

        The pid is safe to signal while the pidfd says the worker has not exited: the zygote has
        not reaped it, so no other process can have its pid. Without pidfds, the group is killed
        while the worker's socket is still open (the same, for a process that never closes it).
        """
        if not self._exited():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        if self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def close(self) -> None:
        self.channel.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class WorkerPool:
    """Workers forked from one zygote started as ``command cni-workers`` with environment ``env``."""

    def __init__(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        *,
        size: int = MAX_WORKERS,
        spare: int = SPARE_WORKERS,
        idle_seconds: float = IDLE_SECONDS,
        kubeconfigs: Sequence[str] = (),
    ) -> None:
        self.command = list(command)
        self.env = dict(env)
        # Each worker connects to these kubeconfigs' API servers before it is ready (verbworker.warm_up).
        self.kubeconfigs = list(kubeconfigs)
        self.size = max(1, size)
        self.spare = max(1, min(spare, self.size))
        self.idle_seconds = idle_seconds
        self._cond = threading.Condition()
        self._idle: list[Worker] = []
        self._alive = 0  # idle, busy, settling and starting workers
        self._waiting = 0  # calls waiting for a worker
        self._settling: list[Worker] = []  # answered, not yet said clean: the pool thread reads them
        self._closing = False
        self._failure: str | None = None  # why there is no zygote, while there is none
        self._started = False  # a zygote has been ready once
        self._ready = threading.Event()
        self._zygote: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread: threading.Thread | None = None
        self.started_workers = 0

    # -- the server's side ------------------------------------------------------

    def start(self) -> None:
        """Start the zygote and the spare workers, in the pool's thread (once; later calls do nothing)."""
        with self._cond:
            if self._thread is not None or self._closing:
                return
            self._thread = threading.Thread(target=self._maintain, name="cni-workers", daemon=True)
            self._thread.start()

    def never_started(self) -> str | None:
        """Why no zygote has started yet, once a try has failed (None once one has, or before any try)."""
        with self._cond:
            return None if self._started else self._failure

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Whether the spare workers are ready (imported, forked and warmed), waiting up to ``timeout``."""
        return self._ready.wait(timeout)

    def close(self) -> None:
        """Stop: the zygote and the idle workers leave; a worker still running a verb leaves after it."""
        with self._cond:
            self._closing = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        self._wake()
        for worker in idle:
            worker.close()
        if self._thread is not None:
            self._thread.join(10)

    def run(
        self, request: Request, fd: int | None, conn: socket.socket | None, timeout: float
    ) -> tuple[int, bytes, bytes]:
        """Run one verb within ``timeout`` seconds: (exit status, stdout, stderr), as the plugin ends.

        ``conn``: the caller's connection, watched for the caller going away (None: nobody waits,
        a spooled DEL).
        """
        deadline = time.monotonic() + timeout
        self.start()  # a server that runs spooled DELs before it serves (its first start) starts it here
        data = encode_request(
            request.env, request.stdin, netns=fd is not None, netns_errno=request.netns_errno
        )
        while True:
            worker = self._acquire(deadline, conn)
            if isinstance(worker, tuple):
                return worker
            try:
                _send(worker.channel, data, fd)
            except OSError:
                # It died while idle: it never read the request, so another may run it.
                self._drop(worker)
                continue
            break
        outcome = self._answer(worker, request.command, conn, deadline, timeout)
        with self._cond:
            keep = outcome.keep and not self._closing
            if keep:
                worker.served += 1
                self._settling.append(worker)
        if keep:
            self._wake()
        else:
            self._drop(worker, kill=not outcome.keep)
        return outcome.status, outcome.stdout, outcome.stderr

    def _acquire(self, deadline: float, conn: socket.socket | None) -> Worker | tuple[int, bytes, bytes]:
        """An idle worker, or the answer to give when none comes (a timeout, the caller gone, no zygote)."""
        with self._cond:
            self._waiting += 1
            try:
                while True:
                    while self._idle:
                        worker = self._idle.pop()  # the last used: its pages and caches are the warmest
                        if not worker.gone():
                            return worker
                        self._alive -= 1
                        worker.close()
                    if self._closing:
                        return 1, cni_error(11, "the rdma-cni agent is stopping; try again later"), b""
                    if self._failure is not None and self._zygote is None and self._alive == 0:
                        return 1, cni_error(11, f"the rdma-cni agent cannot run verbs: {self._failure}"), b""
                    left = deadline - time.monotonic()
                    if left <= 0:
                        msg = "the rdma-cni agent had no free worker for the verb in time; try again later"
                        return 1, cni_error(11, msg), b""
                    if conn is not None and hung_up(conn):
                        log.warning("a caller went away while its verb waited for a worker: not run")
                        return 1, b"", b""
                    self._wake()  # the pool thread forks another worker if the bound allows
                    self._cond.wait(min(left, 0.1))
            finally:
                self._waiting -= 1

    def _drop(self, worker: Worker, *, kill: bool = True) -> None:
        """Forget ``worker``: killed (a verb cut short, a worker gone wrong), or let go (it sees its socket
        close and leaves)."""
        if kill:
            worker.kill()
        worker.close()
        with self._cond:
            self._alive -= 1
            self._cond.notify_all()
        self._wake()

    @dataclass
    class _Outcome:
        status: int
        stdout: bytes
        stderr: bytes
        keep: bool

    def _answer(
        self, worker: Worker, command: str, conn: socket.socket | None, deadline: float, timeout: float
    ) -> WorkerPool._Outcome:
        """Wait for ``worker``'s answer, the caller going away or the deadline, whichever comes first."""
        poller = select.poll()
        poller.register(worker.channel.fileno(), select.POLLIN | select.POLLHUP)
        if conn is not None:
            poller.register(conn.fileno(), select.POLLIN | select.POLLHUP | select.POLLRDHUP)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                log.error("%s ran longer than %.0f s: killed (worker %d)", command, timeout, worker.pid)
                msg = f"the plugin did not finish {command} within {timeout:.0f} s; try again later"
                return self._Outcome(1, cni_error(11, msg), b"", keep=False)
            events = dict(poller.poll(min(left, 1.0) * 1000))
            if conn is not None and conn.fileno() in events:
                log.warning(
                    "the caller of %s went away: its verb was killed (worker %d)", command, worker.pid
                )
                return self._Outcome(1, b"", b"", keep=False)
            if worker.channel.fileno() in events:
                return self._read_answer(worker, command)

    def _read_answer(self, worker: Worker, command: str) -> WorkerPool._Outcome:
        died = (
            f"the rdma-cni agent's worker running {command} died before it answered; the outcome is unknown"
        )
        worker.channel.settimeout(ANSWER_SECONDS)
        try:
            head = read_exact(worker.channel, ANSWER_HEADER.size)
            magic, status, out_len, err_len, _ = ANSWER_HEADER.unpack(head)
            if magic != ANSWER_MAGIC or out_len > MAX_OUTPUT or err_len > MAX_STDERR:
                log.error("worker %d answered %s with something it never sends: killed", worker.pid, command)
                return self._Outcome(
                    1, cni_error(999, "the plugin's answer is too large to relay"), b"", False
                )
            body = read_exact(worker.channel, out_len + err_len)
        except (OSError, EOFError):
            log.error("worker %d died running %s", worker.pid, command)
            return self._Outcome(1, cni_error(11, died), b"", keep=False)
        finally:
            with contextlib.suppress(OSError):
                worker.channel.settimeout(None)
        return self._Outcome(status, body[:out_len], body[out_len:], keep=True)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"w")

    # -- the pool's thread -----------------------------------------------------

    def _maintain(self) -> None:
        restart_at, restart_delay = 0.0, RESTART_FIRST
        readying: dict[int, Worker] = {}  # fd -> a new or just-used worker whose WORKER_READY is awaited
        try:
            while True:
                with self._cond:
                    if self._closing:
                        return
                    settled, self._settling = self._settling, []
                for worker in settled:
                    readying[worker.channel.fileno()] = worker
                now = time.monotonic()
                if self._zygote is None and now >= restart_at:
                    if self._start_zygote():
                        restart_delay = RESTART_FIRST
                    else:
                        restart_at, restart_delay = now + restart_delay, min(restart_delay * 2, RESTART_MAX)
                while self._control is not None and self._wants_one(len(readying)):
                    worker = self._fork()
                    if worker is None:
                        break
                    readying[worker.channel.fileno()] = worker
                self._retire_idle()
                watched = [self._wake_r, *readying]
                if self._control is not None:
                    watched.append(self._control.fileno())
                ready, _, _ = select.select(watched, [], [], 1.0)
                for fd in ready:
                    if fd == self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            while os.read(self._wake_r, 512):
                                pass
                    elif self._control is not None and fd == self._control.fileno():
                        self._zygote_gone()
                        restart_at = time.monotonic() + restart_delay
                    elif fd in readying:
                        self._readied(readying.pop(fd))
        finally:
            for worker in readying.values():
                worker.close()
            self._stop_zygote()

    def _wants_one(self, readying: int) -> bool:
        """Whether to fork a worker: fewer than the spare ones, or a call waiting, within the bound."""
        with self._cond:
            if self._alive >= self.size:
                return False
            return self._alive < self.spare or len(self._idle) + readying < self._waiting

    def _start_zygote(self) -> bool:
        """Start ``command cni-workers`` and wait for its imports; False (and why, in the log) if it fails."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            theirs.set_inheritable(True)
            try:
                zygote = subprocess.Popen(
                    [
                        *self.command,
                        "cni-workers",
                        f"--control-fd={theirs.fileno()}",
                        *(f"--kubeconfig={path}" for path in self.kubeconfigs),
                    ],
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    pass_fds=[theirs.fileno()],
                    start_new_session=True,
                )
            except OSError as exc:
                self._failed(f"cannot start {self.command[0]}: {exc.strerror}")
                ours.close()
                return False
        finally:
            theirs.close()
        ours.settimeout(ZYGOTE_START_SECONDS)
        try:
            hello = ours.recv(16)
        except OSError:
            hello = b""
        if hello != ZYGOTE_READY:
            with contextlib.suppress(ProcessLookupError):
                zygote.kill()
            code = zygote.wait()
            self._failed(f"{self.command[0]} cni-workers did not start (exit status {code})")
            ours.close()
            return False
        ours.settimeout(WORKER_START_SECONDS)
        self._zygote, self._control = zygote, ours
        with self._cond:
            self._failure = None
            self._started = True
        log.info("CNI verb workers: zygote %d ready", zygote.pid)
        return True

    def _failed(self, why: str) -> None:
        log.error("CNI verb workers: %s", why)
        with self._cond:
            self._failure = why
            self._cond.notify_all()

    def _zygote_gone(self) -> None:
        """The zygote closed its socket (it died): its workers serve on; another zygote forks the next."""
        code = self._stop_zygote()
        self._failed(f"the workers' zygote ended (exit status {code}); starting another")

    def _stop_zygote(self) -> int | None:
        if self._control is not None:
            self._control.close()
            self._control = None
        zygote, self._zygote = self._zygote, None
        if zygote is None:
            return None
        try:
            return zygote.wait(10)  # it leaves once its socket closes
        except subprocess.TimeoutExpired:
            zygote.kill()
            return zygote.wait()

    def _fork(self) -> Worker | None:
        """Have the zygote fork one worker; None (zygote dropped) when it cannot."""
        assert self._control is not None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            socket.send_fds(self._control, [FORK], [theirs.fileno()])
            msg, fds, _flags, _addr = socket.recv_fds(self._control, 64, 1)
        except OSError:
            ours.close()
            self._zygote_gone()
            return None
        finally:
            theirs.close()
        if len(msg) == FORKED.size and msg[:1] == b"P":
            _, pid = FORKED.unpack(msg)
            with self._cond:
                self._alive += 1
                self.started_workers += 1
            return Worker(pid, fds[0] if fds else None, ours)
        for fd in fds:
            os.close(fd)
        ours.close()
        if msg[:1] == FORK_FAILED:
            log.error("CNI verb workers: the zygote cannot fork: %s", msg[1:].decode(errors="replace"))
        else:
            self._zygote_gone()
        return None

    def _readied(self, worker: Worker) -> None:
        """A new or just-used worker spoke: ready (it joins the idle ones), or gone (it is dropped)."""
        try:
            said = worker.channel.recv(1, socket.MSG_DONTWAIT)
        except OSError:
            said = b""
        if said != WORKER_READY:
            self._drop(worker)
            return
        worker.idle_since = time.monotonic()
        with self._cond:
            if self._closing:
                self._alive -= 1
                worker.close()
                return
            self._idle.append(worker)
            if len(self._idle) >= self.spare:
                self._ready.set()
            self._cond.notify_all()

    def _retire_idle(self) -> None:
        """Let workers beyond the spare ones go, unused for :attr:`idle_seconds` (longest unused first)."""
        now = time.monotonic()
        with self._cond:
            excess = min(self._alive - self.spare, len(self._idle))
            if excess <= 0:
                return
            old = [w for w in self._idle[:excess] if now - w.idle_since >= self.idle_seconds]
            for worker in old:
                self._idle.remove(worker)
                self._alive -= 1
        for worker in old:
            worker.close()  # it sees its socket close and leaves


def _send(channel: socket.socket, data: bytes, fd: int | None) -> None:
    """The request, with the namespace fd on its first bytes."""
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))] if fd is not None else []
    sent = channel.sendmsg([data], ancillary)
    if sent < len(data):
        channel.sendall(data[sent:])
