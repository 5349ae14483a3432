"""Warm start server: forks pre-imported plugin processes for the launcher.

A cold start of the built binary spends most of its time importing pydantic
and pyroute2, on every pod. The launcher (launcher/warm.c, which
documents the handshake) starts this server once per unpacked tree as
``rdma-cni warm-server``; the server imports everything the verbs need,
listens on ``<tree>/warm.sock`` and forks one child per CNI invocation. The
child takes the caller's stdin, stdout and stderr (passed over the socket)
and its argv, environment, working directory and umask (read from
/proc/<pid>, so a caller cannot describe itself as someone else), then runs
the executable's entry point exactly as a cold start would: the function
:func:`rdma_cni.cli.main.main` hands this server when it starts it, so that
neither module imports the other.

Safety:

* Only a caller with our effective uid, in all of our namespaces (mount,
  network, pid, user, ipc, uts) and with our root directory is served:
  namespace paths such as CNI_NETNS and the "host" network namespace must
  mean the same thing to the child as to the caller. Anyone else is refused
  and the launcher runs the command cold.
* The child leads its own process group; when its caller disappears (a
  runtime killing the plugin on a timeout), that group is killed, as killing
  a cold plugin's process group would. An IPAM call under way is not in it:
  its guard has a session of its own and lets it finish (rdma_cni.node.ipam).
* One server per tree: it holds ``warm.lock`` (flock) for its lifetime; a
  second one exits at once.

Lifetime: a quiet node must not fall back to cold starts, so by default the
server never idles out. It lives as long as it can serve the binary that
started it: it exits when its tree is removed, or when none of the
launchers it has served (the executables kubelet runs, known from the
spawning launcher and from each caller's /proc/<pid>/exe) still carries its
payload, which is what an upgrade or an uninstall looks like. A new binary
has a new tree and so a new server; the old one notices within
``TREE_CHECK_SECONDS`` and exits once its children have finished.
``RDMA_CNI_WARM_IDLE`` (seconds, in the environment of the invocation that
starts the server) brings back an idle timeout for whoever wants the memory
back on quiet nodes.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import selectors
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping

from rdma_cni.launch import cacheprune
from rdma_cni.launch.payload import payload_id

SOCKET_NAME = "warm.sock"
LOCK_NAME = "warm.lock"
HELLO = b"RDMACNI-WARM-1"
TREE_CHECK_SECONDS = 5.0
# Other versions' trees are pruned at start and then this often (rdma_cni.launch.cacheprune).
PRUNE_EVERY_SECONDS = 6 * 3600.0
# Launcher paths remembered at most (a node normally has one or two).
MAX_LAUNCHERS = 16
NAMESPACES = ("mnt", "net", "pid", "user", "ipc", "uts")
# Modules the verbs import lazily; importing them here is the point of the server.
PRELOAD = (
    "rdma_cni.launch.startup",
    "rdma_cni.cni.config",
    # rdma_cni.cni.config imports it for configs with unknown keys (GC's always
    # carry cni.dev/valid-attachments).
    "difflib",
    # rdma_cni.kube.tls imports it for kubeconfigs with inline client keys.
    "tempfile",
    "rdma_cni.verbs.add",
    "rdma_cni.verbs.delete",
    "rdma_cni.verbs.check",
    "rdma_cni.verbs.status",
    "rdma_cni.verbs.gc",
    "rdma_cni.node.isolation",
    "rdma_cni.kube.podget",  # and what it imports: kube.credentials, kube.tls, kube.status
    # rdma_cni.kube.tls hashes kubeconfigs' certificates to keep TLS contexts
    # (only in a warm server and its children).
    "hashlib",
    # The pod GET resolves the API server's name, which loads the idna codec
    # (and unicodedata, a shared library) on first use; the built binary's
    # children also loaded the ascii codec on every ADD.
    "encodings.idna",
    "encodings.ascii",
)


class Refused(Exception):
    """A caller this server must not serve (the launcher then starts cold)."""


def idle_seconds(environ: Mapping[str, str]) -> float | None:
    """The idle timeout from ``RDMA_CNI_WARM_IDLE``; None (never idle out) unless a positive number."""
    raw = environ.get("RDMA_CNI_WARM_IDLE", "")
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if 0 < value < 1e7 else None


def _identity(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class Launchers:
    """The launcher executables this server serves, and whether any still carries its payload.

    An upgrade replaces the launcher kubelet runs (a new file, or new
    content): its trailer then names another tree, and this server is no
    longer anyone's warm start.
    """

    def __init__(self, tree_id: str) -> None:
        self.tree_id = tree_id
        self.known: dict[str, tuple[int, int, int, int]] = {}
        self.ever_known = False

    def add(self, path: str) -> None:
        """Remember ``path`` if it is a launcher of this payload (checked once per path)."""
        if path in self.known or len(self.known) >= MAX_LAUNCHERS or not path.startswith("/"):
            return
        identity = _identity(path)
        if identity is not None and payload_id(path) == self.tree_id:
            self.known[path] = identity
            self.ever_known = True

    def any_current(self) -> bool:
        """Forget launchers replaced or removed since; True while one is left (or none was ever known).

        A server started by hand, with no launcher known, is bound to its tree only.
        """
        if not self.ever_known:
            return True
        for path, identity in list(self.known.items()):
            now = _identity(path)
            if now != identity:
                if now is not None and payload_id(path) == self.tree_id:
                    self.known[path] = now
                else:
                    del self.known[path]
        return bool(self.known)


def preload() -> None:
    """Import what the verbs would otherwise import on every start."""
    import importlib

    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    for name in PRELOAD:
        importlib.import_module(name)
    from rdma_cni.kernel import netlink, rdma

    # pyroute2's message classes are built on first use; build them once here.
    netlink._cls("ifinfmsg")
    rdma._message_class()
    # So are OpenSSL's global state and pyroute2's attribute tables (compiled
    # per class on first encode or decode): read-only dumps of the server's
    # own namespace build the tables, ~1 ms of CPU less in every child.
    import ssl

    ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # The link dump also proves, once for every child, that sysfs shows this namespace (ADD's
    # proof of a VF home without the RTNL lock: kernel/identity.sysfs_shows).
    from rdma_cni.kernel import identity

    with contextlib.suppress(OSError), netlink.Rtnl() as rtnl:
        identity.sysfs_shows(rtnl)
        rtnl.addresses(1)
        rtnl.routes(1)


def _ns_ids(proc: str) -> list[tuple[int, int]]:
    ids = []
    for ns in NAMESPACES:
        st = os.stat(f"{proc}/ns/{ns}")
        ids.append((st.st_dev, st.st_ino))
    root = os.stat(f"{proc}/root")
    ids.append((root.st_dev, root.st_ino))
    return ids


class Caller:
    """Everything about a connecting launcher process that its child must inherit."""

    def __init__(self, pid: int) -> None:
        proc = f"/proc/{pid}"
        with open(f"{proc}/cmdline", "rb") as f:
            self.argv = [os.fsdecode(a) for a in f.read().split(b"\0")[:-1]]
        with open(f"{proc}/environ", "rb") as f:
            pairs = [item.partition(b"=") for item in f.read().split(b"\0") if b"=" in item]
        self.environ = {os.fsdecode(k): os.fsdecode(v) for k, _, v in pairs}
        self.environ["RDMA_CNI_LAUNCHER"] = os.readlink(f"{proc}/exe")
        self.cwd = os.readlink(f"{proc}/cwd")
        self.umask = 0o022
        with open(f"{proc}/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    self.umask = int(line.split()[1], 8)
        # Read last: had the pid been reused meanwhile, its namespaces or the
        # peer credentials checked by the caller of this class would differ.
        self.namespaces = _ns_ids(proc)


class Server:
    """The accept/fork/reap loop of one tree's warm server."""

    def __init__(self, tree: str, idle: float | None, launcher: str = "", *, run: Callable[[], int]) -> None:
        self.tree = tree
        self.run = run  # what each child runs: the executable's entry point, as a cold start would
        self.idle = idle
        self.launchers = Launchers(os.path.basename(tree))
        if launcher:
            self.launchers.add(launcher)
        self.children: dict[int, socket.socket] = {}
        self.own_ns = _ns_ids("/proc/self")
        self.uid = os.geteuid()
        self.selector = selectors.DefaultSelector()
        self.last_activity = time.monotonic()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # Children name the kubeconfigs whose TLS context they had to build
        # (rdma_cni.kube.tls.note_context_miss); the server builds and keeps them.
        self.hint_r, self.hint_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.dirfd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def listen(self) -> None:
        """Listen on ``warm.sock`` (0600), replacing a socket left by a dead server.

        The socket is bound under a temporary name and renamed once it
        listens: a launcher never finds a name that refuses connections and
        starts yet another server.
        """
        path = f"/proc/self/fd/{self.dirfd}/{SOCKET_NAME}"
        temporary = f"{path}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        old = os.umask(0o177)
        try:
            self.listener.bind(temporary)
        finally:
            os.umask(old)
        self.listener.listen(128)
        # Not shared/atomicfile: this publishes a listening socket, not a file's content (a bind
        # cannot replace an existing name, so it is bound aside and renamed); there is nothing to
        # flush, and the socket does not outlive the boot.
        os.rename(temporary, path)
        self.listener.setblocking(False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "reap")
        self.selector.register(self.hint_r, selectors.EVENT_READ, "hint")

    def close(self) -> None:
        """Stop listening: remove the socket first so no caller waits on a dead server."""
        with contextlib.suppress(OSError):
            os.unlink(f"/proc/self/fd/{self.dirfd}/{SOCKET_NAME}")
        self.listener.close()

    def wanted(self) -> bool:
        """Whether this server still has a reason to run: its tree, and a launcher that uses it."""
        return os.path.exists(os.path.join(self.tree, ".complete")) and self.launchers.any_current()

    def serve_forever(self) -> None:
        """Serve while :meth:`wanted` (checked every few seconds) and, with an idle timeout, not idle."""
        next_check = next_prune = 0.0
        while True:
            now = time.monotonic()
            left = None if self.idle is None else self.idle - (now - self.last_activity)
            if not self.children:
                if now >= next_prune:
                    prune_cache(self.tree)
                    next_prune = now + PRUNE_EVERY_SECONDS
                if left is not None and left <= 0:
                    return
                if now >= next_check:
                    if not self.wanted():
                        return
                    next_check = now + TREE_CHECK_SECONDS
            # Wake at least every few seconds to notice a removed tree or launcher.
            wait = TREE_CHECK_SECONDS if left is None else min(max(left, 0.01), TREE_CHECK_SECONDS)
            for key, _ in self.selector.select(wait):
                if key.data == "accept":
                    self._accept()
                elif key.data == "reap":
                    self._reap()
                elif key.data == "hint":
                    self._keep_contexts()
                else:
                    self._caller_gone(key.data)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        self.last_activity = time.monotonic()
        conn.setblocking(True)
        # A launcher sends its hello at once; a caller that stalls is dropped
        # (it then starts cold) instead of stalling everyone behind it.
        conn.settimeout(1.0)
        fds: list[int] = []
        try:
            if conn.recv(len(HELLO)) != HELLO:
                raise Refused("bad hello")
            caller = self._check(conn)
            self.launchers.add(caller.environ["RDMA_CNI_LAUNCHER"])
            conn.sendall(b"R")
            msg, fds, _flags, _addr = socket.recv_fds(conn, 1, 3)
            if msg != b"G" or len(fds) != 3:
                raise Refused("no go")
        except (OSError, Refused, ValueError):
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        try:
            pid = os.fork()
        except OSError:
            with contextlib.suppress(OSError):
                conn.sendall(b"F")
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        if pid == 0:  # pragma: no cover - the child never returns (coverage cannot follow it)
            self._child(caller, fds, conn)
        # Also set here, so the group exists even if the caller is gone before
        # the child gets to run (see _caller_gone).
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        for fd in fds:
            os.close(fd)
        # The child itself says 'S' (and 'X' when done): see _child.
        conn.settimeout(None)
        self.children[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def _keep_contexts(self) -> None:
        """Build the TLS contexts children asked for, so that later children inherit them."""
        try:
            data = os.read(self.hint_r, 65536)
        except BlockingIOError:
            return
        from rdma_cni.kube import credentials, tls

        kept = False
        for path in set(data.split(b"\n")):
            if not path:
                continue
            try:
                kept |= tls.keep_context(credentials.load_credentials(os.fsdecode(path)))
            except Exception:  # the child that read it reported any problem; the server keeps serving
                continue
        if kept:
            gc.freeze()  # the new context's objects are shared by every child from now on, like the rest

    def _check(self, conn: socket.socket) -> Caller:
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != self.uid:
            raise Refused(f"uid {uid}")
        caller = Caller(pid)
        if caller.namespaces != self.own_ns:
            raise Refused("other namespaces")
        return caller

    def _child(self, caller: Caller, fds: list[int], conn: socket.socket) -> None:
        code = 1
        try:
            os.setpgid(0, 0)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for other in self.children.values():
                other.close()
            conn.settimeout(None)
            with contextlib.suppress(OSError):
                conn.sendall(b"S")
            self.listener.close()
            self.selector.close()
            for fd in (self.wake_r, self.wake_w, self.dirfd, self.hint_r):
                os.close(fd)
            from rdma_cni.kube import tls

            tls.context_hint_fd = self.hint_w
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            try:
                os.chdir(caller.cwd)
            except OSError:
                os.chdir("/")
            os.umask(caller.umask)
            os.environ.clear()
            os.environ.update(caller.environ)
            sys.argv = caller.argv or ["rdma-cni"]
            from rdma_cni import log

            log.start_kind = "warm"

            code = self.run()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            # Tell the launcher now, with the caller's stdio closed: tearing
            # down this copy of the server's memory, then being reaped, takes
            # milliseconds the runtime need not wait for. Should this child
            # die first (a signal), the server reports its status instead.
            for fd in (0, 1, 2):
                with contextlib.suppress(OSError):
                    os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(b"X" + struct.pack("i", (code & 0xFF) << 8))
            os._exit(code & 0xFF)

    def _reap(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 512):
                pass
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(KeyError):
                self.selector.unregister(conn)
            with contextlib.suppress(OSError):
                conn.sendall(b"X" + struct.pack("i", status))
            conn.close()
            self.last_activity = time.monotonic()

    def _caller_gone(self, pid: int) -> None:
        # The launcher never writes after 'G': readable means it has gone.
        conn = self.children.get(pid)
        if conn is not None:
            self.selector.unregister(conn)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def prune_cache(tree: str) -> None:
    """Remove the trees of other versions nobody runs any more; a failure never stops the server."""
    with contextlib.suppress(OSError):
        cacheprune.prune(os.path.dirname(tree), os.path.basename(tree))


def _stop(signo: int, _frame: object) -> None:
    raise SystemExit(128 + signo)


def main(argv: list[str], run: Callable[[], int]) -> int:
    """``rdma-cni warm-server``: started by the launcher, not by people; each child calls ``run()``."""
    if argv:
        sys.stderr.write("rdma-cni warm-server takes no arguments\n")
        return 2
    if not getattr(sys, "frozen", False):
        sys.stderr.write("rdma-cni warm-server runs only from the built binary's tree\n")
        return 2
    tree = os.path.dirname(os.path.abspath(sys.executable))
    lock = os.open(os.path.join(tree, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another server has this tree
    preload()
    # The launcher that spawned us names itself (launcher/warm.c); see Launchers.
    server = Server(tree, idle_seconds(os.environ), os.environ.get("RDMA_CNI_LAUNCHER", ""), run=run)
    server.listen()
    # Stopped with SIGTERM (or SIGINT), remove the socket on the way out.
    for signo in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signo, _stop)
    # Objects that exist now are shared by every child: keep the collector
    # from touching (and so copying) their pages.
    gc.freeze()
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0
