"""The agent's CNI server: runs the verbs the host's shim (launcher/shim.c) hands over.

The thick design: /opt/cni/bin holds a small static shim, which runs on any
host glibc, and the plugin itself runs here, in the agent's userspace (the
DaemonSet image's): the runtime's ``CNI_*`` variables and stdin, its stdout,
stderr and exit status relayed back. Each verb runs in a worker of
:mod:`rdma_cni.agent.verbpool` (pre-imported processes forked from one
zygote, each running one verb at a time in-process: no exec, no interpreter
start, no copy of the imports per verb) exactly as the plugin's entry point
runs it, so every guarantee of the plugin (the node lock, records, rollback,
the IPAM guard) is the plugin's own, unchanged. The server reports itself
ready (:meth:`CniServer.wait_ready`, the agent's readiness) only once the
pool's spare workers are: no verb on a node is a cold one.

- **Who may connect:** the socket's directory is 0700, the socket 0600, and
  a peer whose uid (SO_PEERCRED) is neither root nor ours is dropped unanswered.
- **The pod's namespace** comes as an fd the shim opened in the runtime's
  mount view; it goes on to the worker the same way, which opens it as
  ``/proc/self/fd/<n>`` (named in ``RDMA_CNI_NETNS_VIA``, see
  :mod:`rdma_cni.kernel.netns`), so this side never resolves a host path and
  ``CNI_NETNS`` keeps the runtime's value for results, records and logs.
- **Bounds:** at most ``max_connections`` calls taken at once (one more is
  answered with code 11 at once), at most the pool's ``workers`` of them
  running (the others wait their turn, within their timeout), 10 s to send a
  request, sizes checked before reading, ``verb_timeout`` per verb (the
  worker's process group is then killed, as a runtime's timeout would kill
  a plugin's), answers capped.
- **A caller that goes away** (a runtime killing the shim) gets its verb's
  worker killed, as killing a plugin would; one still waiting for a worker
  is not run at all.
- **Spooled DELs** (:mod:`rdma_cni.agent.delspool`): the server that owns
  the socket runs them in the background (at start, as they appear, failures
  on a backoff); an ADD first settles only its own attachment's entries; a
  DEL served directly retires its attachment's entries; a DEL that finds every
  slot busy is spooled here and answered as done.
- **Two agents on a node** (a rollout with surge): one server owns the socket
  path at a time, by an ``flock`` on ``cni.lock``. A server that starts while
  another owns it waits, holding ``cni.next.lock`` to say that it waits, and
  takes the path over the moment the lock is free: it binds a socket of its
  own at a temporary name and renames it over the path, so a connecting shim
  reaches one server or the other, never nothing. A stopping server that sees
  a successor waiting lets go of ``cni.lock`` first and keeps accepting until
  the path names the successor's socket (at most :data:`HANDOVER_SECONDS`), then
  answers what is left in its backlog and closes; calls under way are given
  :data:`DRAIN_SECONDS` to finish. With no successor it closes at once (the
  shim spools DELs and answers ADDs "try again later" until a server is back).
  Each server has its workers; the waiting one's are ready before it takes over.
- **Attachments whose pod namespace is gone though no DEL came** (Multus'
  shim answering DEL itself while its daemon is down, a runtime losing one):
  the server that owns the socket releases them in this boot, every few
  seconds, when the kernel proves the namespace gone and the VFs home
  (:mod:`rdma_cni.agent.orphanpass`, :mod:`rdma_cni.node.orphans`).
- **Records of an earlier boot** (which no runtime would DEL or GC, the spool
  being lost with ``/run``) are released at the first try to start, before
  the socket is served (and while an old server still serves, during a
  surge): ``rdma-cni release-previous-boot`` run as the plugin, for each
  state directory the server is told (its networks':
  :mod:`rdma_cni.agent.bootrelease`; none unless told); every verb the
  plugin runs also does it first if no one has yet this boot
  (:mod:`rdma_cni.node.boot`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from rdma_cni.agent.bootrelease import StatePaths, add_state, network_states, plugin_default, release_all
from rdma_cni.agent.delspool import Runner, Spool, entry_name, spool_dir
from rdma_cni.agent.orphanpass import INTERVAL as ORPHAN_INTERVAL
from rdma_cni.agent.orphanpass import OrphanPass
from rdma_cni.agent.shimconn import REQUEST_SECONDS, Knock, peer_allowed, read_request
from rdma_cni.agent.shimwire import Request, WireError, encode_answer
from rdma_cni.agent.takeover import FileLock
from rdma_cni.agent.verbpool import MAX_WORKERS, WorkerPool, cni_error
from rdma_cni.agent.verbworker import plugin_environment
from rdma_cni.shared.quote import escape

log = logging.getLogger("rdma_cni.agent.cniserver")

DEFAULT_SOCKET = "/run/rdma-cni/agent/cni.sock"
# Below the shim's wait (300 s) so that the shim hears the timeout as an answer.
VERB_TIMEOUT = 270.0
# Calls taken at once (waiting for a worker or running): a burst of 64 pods on a node is taken whole.
DEFAULT_MAX_CONNECTIONS = 128
# With a successor waiting, a stopping server accepts until the successor owns the path, this long at most.
HANDOVER_SECONDS = 5.0
# Calls under way when the server stops get this long to finish (below the DaemonSet's grace period).
DRAIN_SECONDS = 20.0
TAKEOVER_POLL = 0.05
# An ADD waits this long at most for its own attachment's spooled DEL (a run under way, or its own run of it).
GATE_SECONDS = 60.0


class ServerError(Exception):
    """The server cannot start (its directory, its socket, another server): the message says why."""


def default_plugin() -> list[str]:
    """The plugin whose workers run the verbs: this process's built executable, else the package."""
    launcher = os.environ.get("RDMA_CNI_LAUNCHER")
    if launcher and getattr(sys, "frozen", False):
        return [launcher]
    if getattr(sys, "frozen", False):
        return [sys.executable]
    return [sys.executable, "-m", "rdma_cni"]


def _private_dir(path: str) -> None:
    """Create ``path`` 0700 if missing; ServerError unless it is ours and closed to others."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise ServerError(f"cannot create the socket directory {path}: {exc.strerror}") from None
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ServerError(
            f"the socket directory {path} must be a directory owned by this user with mode 0700 "
            f"(it is {oct(st.st_mode & 0o777)}, owner {st.st_uid})"
        )


class CniServer:
    """Listens on ``socket_path`` and runs each call in a worker of ``plugin`` (a command line)."""

    def __init__(
        self,
        socket_path: str = DEFAULT_SOCKET,
        plugin: Sequence[str] | None = None,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        workers: int = MAX_WORKERS,
        verb_timeout: float = VERB_TIMEOUT,
        environ: Mapping[str, str] | None = None,
        states: Sequence[StatePaths] = (),
        handover_seconds: float = HANDOVER_SECONDS,
        drain_seconds: float = DRAIN_SECONDS,
        orphan_interval: float = ORPHAN_INTERVAL,
        kubeconfigs: Sequence[str] = (),
    ) -> None:
        """Nothing is opened until :meth:`start`.

        ``states``: the ``stateDir`` and ``lockFile`` of each network whose records of an
        earlier boot are released at start (:func:`rdma_cni.agent.bootrelease.network_states`);
        none by default, which leaves it to the verbs: a server names the node's state itself.
        The same directories get the same-boot pass over attachments whose pod namespace is gone
        though no DEL came, every ``orphan_interval`` seconds while this server owns the socket
        (:mod:`rdma_cni.agent.orphanpass`; 0 turns it off). ``kubeconfigs``: those the networks
        name, whose API servers each worker connects to before it is ready.
        """
        self.states = list(states)
        self._boot_checked = False
        self.socket_path = os.path.abspath(socket_path)
        self.plugin = list(plugin or default_plugin())
        self.verb_timeout = verb_timeout
        self.base_env = plugin_environment(os.environ if environ is None else environ)
        # Started at the first try to start, so that the workers import while the boot release runs.
        self.pool = WorkerPool(self.plugin, self.base_env, size=workers, kubeconfigs=kubeconfigs)
        self._served = False  # serve() ran: it closes the pool once the calls under way are done
        self._slots = threading.BoundedSemaphore(max_connections)
        # Calls told "busy" are bounded too: beyond these, a call is closed unanswered.
        self._busy_slots = threading.BoundedSemaphore(max_connections)
        self._sock: socket.socket | None = None
        directory = os.path.dirname(self.socket_path)
        self.spool = Spool(spool_dir(self.socket_path), self._run_spooled)
        self.runner = Runner(self.spool, verb_timeout)
        self.orphans = OrphanPass(self.plugin, self.base_env, self.states, orphan_interval)
        self._lock = FileLock(os.path.join(directory, "cni.lock"))
        self._lock_held = False
        # Held while this server waits for the lock: a stopping owner then hands over instead of closing.
        self._next = FileLock(os.path.join(directory, "cni.next.lock"))
        self._path_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file this server bound
        self.handover_seconds = handover_seconds
        self.drain_seconds = drain_seconds
        self._calls = 0
        self._calls_done = threading.Condition()

    def start(self, wait: threading.Event | None = None) -> None:
        """Make the directory, take its lock, bind and listen; ServerError when it cannot.

        With ``wait``, a lock held by another server (the old agent of a rolling update with
        surge) is waited for until that server stops or ``wait`` is set (ServerError then).
        """
        told = False
        while not self.try_start():
            if wait is None or wait.is_set():
                self._next.release()
                raise ServerError(f"another CNI server serves {self.socket_path}")
            if not told:
                log.warning("another CNI server serves %s: waiting for it to stop", self.socket_path)
                told = True
            wait.wait(TAKEOVER_POLL)

    def try_start(self) -> bool:
        """Start serving if no other server owns the path (True); False while one does.

        ServerError for what waiting cannot mend: the directory, the path's length, a bind that fails.
        While False, this server is marked as the waiting successor (``cni.next.lock``).
        """
        directory = os.path.dirname(self.socket_path)
        _private_dir(directory)
        # Before anything is served: a spool the server cannot use is the operator's to fix, not
        # something to find out after the socket has been taken over (nothing half done).
        _private_dir(self.spool.directory)
        if len(self.socket_path.encode()) + len(".next") > 107:
            raise ServerError(f"the socket path {self.socket_path} is longer than a unix socket allows")
        self.pool.start()
        if not self._boot_checked:
            # Once, at the first try: before this server serves (an ADD then places with what an
            # earlier boot held free), and off a surge handover's path (the old server still serves).
            self._boot_checked = True
            self.release_previous_boot()
        try:
            if not self._lock.try_acquire():
                with contextlib.suppress(OSError):
                    self._next.try_acquire()  # a third server waits unmarked: one successor is enough
                return False
        except OSError as exc:
            raise ServerError(f"cannot open the lock in {directory}: {exc.strerror}") from None
        self._lock_held = True
        self._next.release()
        try:
            self._publish()
        except ServerError:
            # The workers stop first: a zygote the pool's thread is starting holds a copy of the
            # lock's file (fork) until it execs, and this server will not serve.
            self.pool.close()
            self._lock_held = False
            self._lock.release()
            raise
        # Off the start's path: a spooled DEL (even one that fails, or hangs in its IPAM) never
        # keeps this server from serving, nor delays an ADD of another attachment.
        self.runner.start()
        self.orphans.start()
        return True

    def _publish(self) -> None:
        """Bind at a temporary name and rename over the path: the path always names a listening socket."""
        temp = self.socket_path + ".next"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)  # a server that died between bind and rename: we hold the lock
            sock.bind(temp)
            sock.listen(64)
            # Not shared/atomicfile: a listening socket is published, not a file's content (bind
            # cannot replace a name, so it is bound aside and renamed); /run does not outlive the boot.
            os.rename(temp, self.socket_path)
            st = os.stat(self.socket_path)
        except OSError as exc:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise ServerError(f"cannot listen on {self.socket_path}: {exc.strerror}") from None
        finally:
            os.umask(old)
        self._sock = sock
        self._path_id = (st.st_dev, st.st_ino)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Whether the workers are ready: a verb served now is not a cold one (waits up to ``timeout``)."""
        return self.pool.wait_ready(timeout)

    def _owns_path(self) -> bool:
        try:
            st = os.stat(self.socket_path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._path_id

    def _successor_waits(self) -> bool:
        """Whether another server waits to take over (it holds ``cni.next.lock``)."""
        probe = FileLock(self._next.path)
        try:
            free = probe.try_acquire()
        except OSError:
            return False
        finally:
            probe.release()
        return not free

    def close(self) -> None:
        """Stop listening (calls under way finish) and the spool's runner.

        The path is removed only while this server still holds ``cni.lock`` and the path names its
        socket: once the lock is let go, a successor may rename its own socket over the path at any
        moment, and removing the path then would leave the node with no server.
        """
        self.runner.stop()
        self.orphans.stop()
        if self._sock is not None:
            if self._lock_held and self._owns_path():
                with contextlib.suppress(OSError):
                    os.unlink(self.socket_path)
            self._sock.close()
            self._sock = None
        self._lock_held = False
        self._lock.release()
        self._next.release()
        if not self._served:
            self.pool.close()

    def _hand_over(self) -> None:
        """On stop, with a successor waiting: let it take the path, answering calls until it has."""
        assert self._sock is not None
        self.runner.stop()  # the successor runs the spool and the orphan pass from now on
        self.orphans.stop()
        self._lock_held = False
        self._lock.release()
        deadline = time.monotonic() + self.handover_seconds
        self._sock.settimeout(0.05)
        while self._owns_path() and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                self._accept_one()
        # The path names the successor's socket now: whoever connected to ours is in the backlog.
        self._sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                self._accept_one()
        if self._owns_path():
            log.warning(
                "no other CNI server took %s over within %.0f s", self.socket_path, self.handover_seconds
            )
            # Our socket is removed (close) only if the lock is ours again: a successor that holds it
            # may be renaming its own socket over the path right now.
            with contextlib.suppress(OSError):
                self._lock_held = self._lock.try_acquire()
        else:
            log.info("handed %s over to the next CNI server", self.socket_path)

    def _accept_one(self) -> None:
        """Accept one call and start it (TimeoutError or BlockingIOError when none is waiting)."""
        assert self._sock is not None
        conn, _ = self._sock.accept()
        conn.settimeout(None)
        if not self._slots.acquire(blocking=False):
            if self._busy_slots.acquire(blocking=False):
                threading.Thread(target=self._busy, args=(conn,), daemon=True).start()
            else:
                conn.close()
            return
        with self._calls_done:
            self._calls += 1
        threading.Thread(target=self._handle, args=(conn,), name="cni-call", daemon=True).start()

    def _drain(self) -> None:
        """Wait for the calls under way to be answered, :attr:`drain_seconds` at most."""
        with self._calls_done:
            if not self._calls_done.wait_for(lambda: self._calls == 0, self.drain_seconds):
                log.warning("stopping with %d CNI call(s) still running", self._calls)

    def serve(self, stop: threading.Event) -> None:
        """Accept calls until ``stop`` is set (each runs in a thread of its own), then hand over or close."""
        assert self._sock is not None, "start() first"
        self._served = True
        self._sock.settimeout(0.5)
        try:
            while not stop.is_set():
                try:
                    self._accept_one()
                except TimeoutError:
                    continue
                except OSError as exc:
                    log.error("accept on %s failed: %s", self.socket_path, exc)
                    time.sleep(0.1)
                    continue
            if self._successor_waits():
                self._hand_over()
        finally:
            self.close()
            self._drain()
            self.runner.stop(wait=self.drain_seconds)
            self.pool.close()

    def _run_spooled(self, request: Request, budget: float) -> tuple[int, bytes]:
        """Run one spooled DEL as the plugin, within ``budget`` seconds: its exit status and stderr."""
        status, out, err = self._run(request, None, None, timeout=min(budget, self.verb_timeout))
        with contextlib.suppress(ValueError, AttributeError, UnicodeDecodeError):
            msg = json.loads(out).get("msg")  # the plugin's own error document says why, unprefixed
            if status and isinstance(msg, str) and msg:
                return status, msg.encode()
        return status, err

    def release_previous_boot(self) -> None:
        """Release the records of an earlier boot in each of ``states``, through the plugin; never fatal.

        All of them within one verb timeout: the server serves only after.
        """
        release_all(self.plugin, self.base_env, self.states, self.verb_timeout)

    def _busy(self, conn: socket.socket) -> None:
        with conn:
            try:
                self._answer_busy(conn)
            finally:
                self._busy_slots.release()

    def _answer_busy(self, conn: socket.socket) -> None:
        if peer_allowed(conn):
            with contextlib.suppress(OSError, WireError):
                # The request is read (and its fd closed) so that the shim's send completes.
                request, fd = read_request(conn)
                if fd is not None:
                    os.close(fd)
                if request.command == "DEL" and self.spool.write(request):
                    # A pod must always be deletable: the spool's runner takes it within seconds.
                    note = b"rdma-cni agent: every slot was busy: DEL spooled; it runs within seconds\n"
                    conn.sendall(encode_answer(0, b"", note))
                    return
                msg = "the rdma-cni agent is serving too many calls at once; try again later"
                conn.sendall(encode_answer(1, cni_error(11, msg), b""))

    def _handle(self, conn: socket.socket) -> None:
        fd: int | None = None
        try:
            with conn:
                if not peer_allowed(conn):
                    return
                try:
                    request, fd = read_request(conn)
                except Knock:
                    return  # a probe: it only wanted to know that the socket accepts
                except (OSError, WireError) as exc:
                    log.warning("dropped a call: %s", exc)
                    return
                status, out, err = self._serve_verb(request, fd, conn)
                conn.settimeout(REQUEST_SECONDS)
                with contextlib.suppress(OSError):
                    conn.sendall(encode_answer(status, out, err))
        finally:
            if fd is not None:
                os.close(fd)
            self._slots.release()
            with self._calls_done:
                self._calls -= 1
                self._calls_done.notify_all()

    def _serve_verb(self, request: Request, fd: int | None, conn: socket.socket) -> tuple[int, bytes, bytes]:
        """Run a caller's verb, keeping the spool's promise for its attachment (see delspool)."""
        name = entry_name(request.env.get("CNI_CONTAINERID", ""), request.env.get("CNI_IFNAME", ""))
        if name is None:
            return self._run(request, fd, conn)
        if request.command == "ADD":
            started = time.monotonic()
            settled = self.spool.settle(name, GATE_SECONDS, wait=GATE_SECONDS)
            if settled.outcome != "done":
                msg = (
                    "an earlier DEL of this container's interface, spooled while the rdma-cni agent could "
                    f"not take it, has not finished ({settled.detail}); try again later"
                )
                return 1, cni_error(11, msg), b""
            # The whole call stays within the shim's wait for an answer.
            left = self.verb_timeout - (time.monotonic() - started)
            return self._run(request, fd, conn, timeout=max(left, 1.0))
        status, out, err = self._run(request, fd, conn)
        if request.command == "DEL" and status == 0:
            self.spool.retire(name)
        return status, out, err

    def _run(
        self, request: Request, fd: int | None, conn: socket.socket | None, timeout: float | None = None
    ) -> tuple[int, bytes, bytes]:
        """Run one verb in a worker within ``timeout`` s (default: the verb timeout): (exit status, stdout,
        stderr). ``conn`` is the caller's (None for a spooled DEL): a caller gone gets its verb killed."""
        limit = self.verb_timeout if timeout is None else timeout
        started = time.monotonic()
        status, out, err = self.pool.run(request, fd, conn, limit)
        if conn is None:
            how = "spooled"
        elif fd is not None:
            how = "its namespace passed as an fd"
        else:
            how = "no namespace passed"
        # One line per verb: what an operator (and the runtime tier) reads of the calls served. The
        # names are the caller's, not yet checked by the plugin: escaped and bounded.
        log.info(
            "served %s %s/%s (%s): exit %d in %.1f ms",
            escape(request.command[:16] or "-"),
            escape(request.env.get("CNI_CONTAINERID", "")[:200] or "-"),
            escape(request.env.get("CNI_IFNAME", "")[:64] or "-"),
            how,
            status,
            (time.monotonic() - started) * 1000,
        )
        return status, out, err


def _log_progress() -> None:
    """Let the server's progress (spooled DELs run, kept) reach stderr, not only its warnings.

    The executable's entry point (``rdma_cni.cli.main``) has already given the ``rdma_cni``
    logger a stderr handler at WARNING that does not propagate, so configuring the root
    logger would change nothing: that handler is lowered instead, as the agent's is.
    """
    ours = logging.getLogger("rdma_cni")
    if not ours.handlers:  # called without the entry point
        logging.basicConfig(level=logging.INFO, format="rdma-cni cni-server: %(message)s")
        return
    for handler in ours.handlers:
        handler.setLevel(logging.INFO)


def parser() -> argparse.ArgumentParser:
    """The options of ``rdma-cni cni-server``."""
    p = argparse.ArgumentParser(
        prog="rdma-cni cni-server", description="Run the CNI verbs the rdma-cni shim hands over."
    )
    p.add_argument("--socket", default=DEFAULT_SOCKET, help="default: %(default)s")
    p.add_argument(
        "--plugin",
        metavar="PATH",
        help="the plugin executable whose workers run the verbs (default: this executable)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="calls taken at once, running or waiting for a worker (default: %(default)s)",
    )
    p.add_argument(
        "--workers", type=int, default=MAX_WORKERS, help="verbs run at once, at most (default: %(default)s)"
    )
    p.add_argument(
        "--network-config",
        metavar="FILE",
        action="append",
        default=[],
        help="a network configuration (conflist or entry) whose stateDir and lockFile hold records "
        "to release at start if an earlier boot wrote them; repeat for several networks",
    )
    p.add_argument(
        "--state-dir",
        help="one more stateDir whose records of an earlier boot are released at start "
        "(default, without --network-config: the plugin's)",
    )
    p.add_argument("--lock-file", help="its lockFile (default: the plugin's)")
    p.add_argument(
        "--kubeconfig",
        metavar="FILE",
        action="append",
        default=[],
        help="the kubeconfig the networks name: each verb worker connects to its API server before the "
        "server says it is ready, so that the first ADD does not; repeat for several",
    )
    p.add_argument(
        "--take-over",
        action="store_true",
        help="if another server serves the socket, wait for it to stop and take over from it with no call "
        "refused (a new version started beside the old one); without it, exit with an error",
    )
    return p


def _states(args: argparse.Namespace) -> list[StatePaths]:
    """The state directories ``cni-server`` releases at start: the networks', and ``--state-dir``'s."""
    states = network_states(args.network_config) if args.network_config else []
    if args.state_dir or args.lock_file or not args.network_config:
        default_dir, default_lock = plugin_default()
        add_state(states, (args.state_dir or default_dir, args.lock_file or default_lock))
    return states


def main(argv: list[str]) -> int:
    """``rdma-cni cni-server``: the CNI server alone (podman or cnitool with the shim, no DaemonSet)."""
    args = parser().parse_args(argv)
    if args.max_connections < 1:
        sys.stderr.write("rdma-cni cni-server: error: --max-connections must be at least 1\n")
        return 2
    if args.workers < 1:
        sys.stderr.write("rdma-cni cni-server: error: --workers must be at least 1\n")
        return 2
    for name, value in (("--state-dir", args.state_dir), ("--lock-file", args.lock_file)):
        if value is not None and not os.path.isabs(value):
            sys.stderr.write(f"rdma-cni cni-server: error: {name} must be an absolute path\n")
            return 2
    _log_progress()
    server = CniServer(
        args.socket,
        [args.plugin] if args.plugin else None,
        max_connections=args.max_connections,
        workers=args.workers,
        states=_states(args),
        kubeconfigs=args.kubeconfig,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _s, _f: stop.set())
    try:
        server.start(wait=stop if args.take_over else None)
    except ServerError as exc:
        if stop.is_set():
            return 0  # stopped while it waited to take over: nothing was served
        sys.stderr.write(f"rdma-cni cni-server: error: {exc}\n")
        return 1
    # Said once a verb would be warm: the workers imported, forked and warmed up.
    while not server.wait_ready(0.5):
        failed = server.pool.never_started()
        if stop.is_set() or failed:
            server.close()
            if failed:
                sys.stderr.write(f"rdma-cni cni-server: error: the verb workers cannot start: {failed}\n")
                return 1
            return 0
    sys.stdout.write(json.dumps({"listening": server.socket_path}) + "\n")
    sys.stdout.flush()
    server.serve(stop)
    return 0
