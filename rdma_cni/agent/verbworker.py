"""The processes that run the shim's CNI verbs for the agent: a zygote, and the workers it forks.

``rdma-cni cni-workers --control-fd N`` is started once by the agent's CNI
server (:mod:`rdma_cni.agent.verbpool`, the other side of both channels
below). It imports everything a verb needs (the same list the fat binary's
warm server imports, :func:`rdma_cni.launch.warm.preload`), freezes those
objects out of the cycle collector, says it is ready, and from then on only
forks: one **worker** per request of the pool, each on a socket the pool
made for it. It runs no verb itself, so every worker starts from the same
clean, imported state, and a new worker costs a fork (milliseconds), never
an import. It stays single-threaded: a fork of a threaded process could
inherit a lock some other thread held.

A **worker** leads its own process group and runs one verb at a time, in
its own interpreter, for as long as it stays clean: it reads a request (the
shim's wire format, :mod:`rdma_cni.agent.shimwire`, with the pod's network
namespace as an fd beside it), sets up the environment a plugin process of
that call would have had (the server's, the runtime's ``CNI_*`` variables,
``RDMA_CNI_NETNS_VIA`` naming the fd), runs the executable's own CNI entry
(:func:`rdma_cni.cli.main.cni_answer`, which ``cli/main`` hands over, as it
hands the warm server its ``main``), captures what it writes to stderr, and
answers with the exit status, stdout and stderr, as the plugin process
would have exited. Nothing is forked or executed per verb (the IPAM guard
and the IPAM plugin aside), so a verb copies no page of the zygote's after
the worker's first and pays no interpreter start.

After each answer the worker checks that nothing of the verb stayed behind,
then says it is ready for the next (:class:`Baseline`): its threads (one),
its network namespace (a namespace switch returns the thread to its own, or
the verb ``_exit`` s: :func:`rdma_cni.kernel.netns.in_netns`), its open
descriptors (those it had when it became ready), its children (the IPAM
guards are collected by the verb), its working directory and umask, and
that the logging set-up is the one it started with (a verb's ``logFile``
handler is closed after it). Anything else, or :data:`MAX_VERBS` verbs
served, and it exits instead; the pool forks another. A verb that crashes
the interpreter or hangs takes only its worker with it: the pool kills the
worker's process group at the verb's timeout or when its caller goes away,
as a runtime would kill a plugin's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import signal
import socket
import struct
import sys
from collections.abc import Callable, Mapping, Sequence

from rdma_cni.agent.shimwire import REQUEST_HEADER, Request, WireError, encode_answer, parse_env, parse_header

log = logging.getLogger("rdma_cni.agent.cniserver")

# Pool <-> zygote, over a SOCK_SEQPACKET pair (one message each):
ZYGOTE_READY = b"Z"  # zygote -> pool, once: imported, forking from now on
FORK = b"F"  # pool -> zygote, with one fd: fork a worker serving that socket
FORKED = struct.Struct(
    "=cI"
)  # zygote -> pool: b"P" and the pid, with the worker's pidfd when the kernel has them
FORK_FAILED = b"E"  # zygote -> pool, then the reason
# Worker -> pool, on the worker's own stream socket:
WORKER_READY = b"R"  # after the warm-up, and after each answer once the worker is clean again
# What a worker keeps of a verb's stderr (the CNI server relays as much).
MAX_STDERR = 64 << 10
# A worker leaves after this many verbs: whatever a verb's code keeps grows no further.
MAX_VERBS = 1000
VIA_ENV = "RDMA_CNI_NETNS_VIA"  # rdma_cni.kernel.netns.NETNS_VIA_ENV

# What a worker runs for each verb: (environment, stdin) -> (exit status, stdout).
RunVerb = Callable[[Mapping[str, str], bytes], tuple[int, bytes]]


def plugin_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What a verb inherits from the server: its environment, less what is the caller's or the bundle's.

    The caller's ``CNI_*`` variables are the only ones a verb gets from outside. The built
    binary's bootloader sets ``LD_LIBRARY_PATH`` to its own libraries (and ``_PYI_*`` for its
    children): a verb must start as a runtime starts the plugin, and the IPAM plugins it runs
    must load their own libraries, not the bundle's.
    """
    env = {
        k: v
        for k, v in environ.items()
        if not k.startswith(("CNI_", "_PYI_", "_MEI")) and k not in (VIA_ENV, "LD_LIBRARY_PATH")
    }
    env.pop("LD_LIBRARY_PATH_ORIG", None)
    if environ.get("LD_LIBRARY_PATH_ORIG"):
        env["LD_LIBRARY_PATH"] = environ["LD_LIBRARY_PATH_ORIG"]
    return env


def parser() -> argparse.ArgumentParser:
    """The options of ``rdma-cni cni-workers`` (started by the CNI server, not by people)."""
    p = argparse.ArgumentParser(
        prog="rdma-cni cni-workers", description="The CNI server's verb workers (started by the CNI server)."
    )
    p.add_argument("--control-fd", type=int, required=True, help="the pool's end of the control socket")
    p.add_argument(
        "--kubeconfig",
        action="append",
        default=[],
        metavar="FILE",
        help="a kubeconfig the verbs will name: each worker connects to its API server before it is ready",
    )
    return p


def main(argv: list[str], run: RunVerb, preload: Callable[[], None] | None = None) -> int:
    """``rdma-cni cni-workers``: import, then fork a worker for each request of the pool until it hangs up.

    ``preload`` imports what the verbs need (default: the warm server's list).
    """
    args = parser().parse_args(argv)
    try:
        control = socket.socket(fileno=args.control_fd)
    except OSError as exc:
        sys.stderr.write(f"rdma-cni cni-workers: --control-fd {args.control_fd}: {exc.strerror}\n")
        return 2
    if control.type != socket.SOCK_SEQPACKET:
        sys.stderr.write("rdma-cni cni-workers: --control-fd is not the CNI server's control socket\n")
        return 2
    control.set_inheritable(False)
    if preload is None:
        from rdma_cni.launch.warm import preload
    preload()
    # Objects that exist now are shared by every worker: the collector must not touch (copy) their pages.
    gc.freeze()
    # Workers that exit are reaped at once; this process forks, and never waits on anything else.
    signal.signal(signal.SIGCHLD, _reap)
    # A terminal's ^C goes to the agent, which closes the control socket: that is how this ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control.sendall(ZYGOTE_READY)
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(control, 16, 1)
        except OSError:
            return 0
        if not msg:
            return 0  # the pool (the agent) is gone; its workers leave when their sockets close
        if msg != FORK or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            continue
        _fork_worker(control, fds[0], run, args.kubeconfig)


def _reap(_signo: int, _frame: object) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _fork_worker(control: socket.socket, channel: int, run: RunVerb, kubeconfigs: Sequence[str] = ()) -> None:
    """Fork one worker on ``channel`` and tell the pool its pid (and pidfd); the worker never returns."""
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(channel)
        with contextlib.suppress(OSError):
            control.sendall(FORK_FAILED + (exc.strerror or "fork failed").encode())
        return
    if pid == 0:  # pragma: no cover - the worker never returns (coverage cannot follow it)
        code = 70
        try:
            control.close()
            code = _worker(channel, run, kubeconfigs)
        except BaseException:  # nothing may escape into a second copy of the zygote's loop
            with contextlib.suppress(Exception):
                log.exception("a CNI verb worker failed")
        finally:
            os._exit(code)
    os.close(channel)
    fds = []
    with contextlib.suppress(OSError):
        # Until this process reaps it, the pid cannot name another process: the pidfd taken now
        # names this worker for as long as the pool keeps it (its kill can never reach another).
        fds.append(os.pidfd_open(pid))
    try:
        socket.send_fds(control, [FORKED.pack(b"P", pid)], fds)
    except OSError:
        pass  # the pool is gone: the worker sees its socket close and leaves
    finally:
        for fd in fds:
            os.close(fd)


def _worker(channel_fd: int, run: RunVerb, kubeconfigs: Sequence[str] = ()) -> int:
    """A worker's life: become ready, then serve verbs until the pool hangs up or a check fails."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the verbs wait for their own children (the IPAM guards)
    channel = socket.socket(fileno=channel_fd)
    channel.set_inheritable(False)
    from rdma_cni.kube import podget

    # This process outlives its verbs: keep the API server's connection and TLS context between them.
    podget.keep_connections(True)
    verbs = Verbs(run)
    verbs.warm_up(kubeconfigs)
    baseline = Baseline.now()
    channel.sendall(WORKER_READY)
    served = 0
    while True:
        try:
            request, fd = receive(channel)
        except (OSError, WireError, EOFError):
            return 0  # the pool hung up (or sent something it never sends): nothing was started
        answer = verbs.run_one(request, fd)
        served += 1
        try:
            channel.sendall(answer.encoded)
        except OSError:
            return 0
        problem = answer.problem or baseline.differs()
        gc.collect()  # the verbs ran without the cycle collector; after the answer, off their path
        if problem is not None:
            log.warning("a CNI verb worker leaves (the pool starts another): %s", problem)
            return 0
        if served >= MAX_VERBS:
            return 0
        try:
            channel.sendall(WORKER_READY)
        except OSError:
            return 0


def receive(channel: socket.socket) -> tuple[Request, int | None]:
    """One request from the pool and the namespace fd that came with it; EOFError when it hung up."""
    raw, ancdata, _flags, _ = channel.recvmsg(REQUEST_HEADER.size, socket.CMSG_SPACE(4))
    fds = [
        fd
        for level, kind, data in ancdata
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
        for (fd,) in struct.iter_unpack("i", data[: len(data) - len(data) % 4])
    ]
    try:
        if not raw:
            raise EOFError
        while len(raw) < REQUEST_HEADER.size:
            more = channel.recv(REQUEST_HEADER.size - len(raw))
            if not more:
                raise EOFError
            raw += more
        header = parse_header(raw)
        body = read_exact(channel, header.env_len + header.stdin_len)
        request = Request(
            env=parse_env(body[: header.env_len]),
            stdin=body[header.env_len :],
            netns_errno=header.netns_errno,
        )
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return request, (fds[0] if fds else None)


def read_exact(channel: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from the pool's and the workers' socketpair; EOFError when it closes."""
    buf = bytearray()
    while len(buf) < n:
        chunk = channel.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


class Answer:
    """One verb's outcome as the plugin process would have ended: its encoded answer, and whether the
    worker must leave after it (``problem``: why)."""

    def __init__(self, status: int, stdout: bytes, stderr: bytes, problem: str | None = None) -> None:
        self.encoded = encode_answer(status, stdout, stderr)
        self.problem = problem


class Verbs:
    """Runs verbs in this process as separate plugin processes would run them: environment, stderr, exit."""

    def __init__(self, run: RunVerb) -> None:
        self.run = run
        # Started through the built binary's bootloader, this process's environment has what the
        # bootloader added for itself: a verb starts from what the server handed over.
        self.base_env = plugin_environment(os.environ) if getattr(sys, "frozen", False) else dict(os.environ)
        # Where fd 2 points during a verb: what the verb writes to stderr is its answer's stderr.
        self.capture = os.memfd_create("verb-stderr", os.MFD_CLOEXEC)

    def warm_up(self, kubeconfigs: Sequence[str] = ()) -> None:
        """What the first verb would do first, done before the worker says it is ready.

        The first verb of a fresh fork would otherwise copy the pages it writes (the entry point, a
        configuration's validation, the logging set-up) while a runtime waits; a VERSION run through
        the whole entry touches them now. For each of ``kubeconfigs`` (the ones the node's networks
        name) the API server's connection is opened too: its TLS context and handshake were about a
        third of the first ADD after an agent started. One that fails is only logged: the verb
        that needs it meets the failure and reports it as it would have.
        """
        self.run_one(Request(env={"CNI_COMMAND": "VERSION"}, stdin=b'{"cniVersion": "1.0.0"}'), None)
        from rdma_cni.cni.errors import CniError
        from rdma_cni.kube import credentials, podget

        for path in kubeconfigs:
            try:
                problem = podget.connect_ahead(credentials.load_credentials(path))
            except CniError as exc:  # a kubeconfig not written yet (a first install) or malformed
                problem = f"{exc.msg}: {exc.details}" if exc.details else exc.msg
            if problem:
                log.info("no connection opened ahead for kubeconfig %s: %s", path, problem)

    def run_one(self, request: Request, fd: int | None) -> Answer:
        """Run one verb; the namespace fd (if any) is closed after it."""
        from rdma_cni import log as rdma_log

        env = dict(self.base_env)
        env.update(request.env)
        if fd is not None:
            env[VIA_ENV] = f"/proc/self/fd/{fd}"
        elif request.netns_errno and request.env.get("CNI_NETNS"):
            env[VIA_ENV] = f"errno:{request.netns_errno}"
        os.environ.clear()
        os.environ.update(env)
        os.ftruncate(self.capture, 0)
        os.lseek(self.capture, 0, os.SEEK_SET)
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(self.capture, 2)
        problem = None
        status, out = 1, b""
        try:
            with rdma_log.verb_scope():
                status, out = self.run(env, request.stdin)
        except SystemExit as exc:  # a plugin process would have exited with it
            problem = "a verb raised SystemExit"
            status = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # KeyboardInterrupt, MemoryError: what a plugin would have died of
            problem = f"a verb raised {type(exc).__name__}"
            with contextlib.suppress(Exception):
                import traceback

                traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if fd is not None:
                os.close(fd)
            os.environ.clear()
            os.environ.update(self.base_env)
        size = os.lseek(self.capture, 0, os.SEEK_END)
        err = os.pread(self.capture, MAX_STDERR, max(0, size - MAX_STDERR))
        return Answer(status & 0xFF, out, err, problem)


class Baseline:
    """What a clean worker looks like; :meth:`differs` says what a verb left behind, if anything."""

    def __init__(self) -> None:
        self.netns = os.readlink("/proc/thread-self/ns/net")
        self.fds = _open_fds()
        self.cwd = os.getcwd()
        self.umask = _umask()
        self.logging = _logging_state()

    @classmethod
    def now(cls) -> Baseline:
        return cls()

    def differs(self) -> str | None:
        """Why this worker is no longer as clean as it was (None when it is)."""
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:
            return f"{threads} threads"
        if os.readlink("/proc/thread-self/ns/net") != self.netns:
            return "its network namespace changed"
        try:
            if os.waitpid(-1, os.WNOHANG)[0]:
                return "a child of a verb was left to reap"
            return "a child of a verb is still running"
        except ChildProcessError:
            pass
        fds = _open_fds()
        if fds != self.fds:
            return f"open descriptors changed ({len(self.fds)} -> {len(fds)})"
        if os.getcwd() != self.cwd or _umask() != self.umask:
            return "its working directory or umask changed"
        if _logging_state() != self.logging:
            return "its logging set-up changed"
        return None


def _open_fds() -> set[int]:
    """This process's open descriptors, less those kept between verbs on purpose.

    Those are the API server's connection (:func:`rdma_cni.kube.podget.keep_connections`) and
    the launcher the IPAM guard runs from (:mod:`rdma_cni.node.ipam_guard`, opened once).
    """
    from rdma_cni.kube import podget
    from rdma_cni.node import ipam_guard

    listed = {int(name) for name in os.listdir("/proc/self/fd")}
    return listed - podget.kept_fds() - ipam_guard.kept_fds()


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def _logging_state() -> tuple[int, tuple[int, ...]]:
    root = logging.getLogger("rdma_cni")
    return root.level, tuple(id(h) for h in root.handlers)
