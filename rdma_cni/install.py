"""``rdma-cni install``: the DaemonSet container's entry point.

It puts the plugin where kubelet's container runtime looks for it and gives
the plugin credentials to read pods:

- copies the executable into the host's CNI bin directory, atomically, so a
  runtime never executes a half-written file, and without clobbering a file
  it did not install itself (a sidecar marker remembers what it wrote);
- writes a JSON kubeconfig built from the pod's service account, with the
  token and CA embedded inline, because the secret's mount path exists only
  inside this container and not on the host where the plugin runs;
- optionally drops a network configuration into the CNI conf directory;
- with ``--watch``, keeps the kubeconfig in step with the token file, which
  kubelet rotates, until SIGTERM;
- with ``--watch --node-state``, also runs the node agent
  (:mod:`rdma_cni.agent`) in a thread: it publishes this node's RDMA state
  on its Node object for the scheduler extender.

Standard library only: the installer must not pay for pydantic or requests
(the node agent imports them when it is switched on), and it never starts
another process.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO, TextIO

from rdma_cni import __version__, exporter
from rdma_cni.shared.atomicfile import write_atomic

DEFAULT_CNI_BIN_DIR = "/opt/cni/bin"
DEFAULT_CNI_CONF_DIR = "/etc/cni/net.d"
DEFAULT_NAME = "rdma-cni"
DEFAULT_KUBECONFIG_PATH = "/etc/cni/net.d/rdma-cni.d/rdma-cni.kubeconfig"
DEFAULT_SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_INTERVAL = 10.0

# Hashes of earlier installs kept in the marker: a crash between writing the
# marker and renaming the binary leaves the previous file in place, and it
# must still be recognised as ours on the next start.
_MARKER_HISTORY = 8
_CHUNK = 1 << 20
# Same grammar the plugin's kubeconfig reader enforces (printable, no spaces).
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")
# Extensions libcni loads from a conf directory; anything else is ignored silently.
_CONF_EXTENSIONS = (".conflist", ".conf", ".json")


class InstallError(Exception):
    """A problem the operator must fix; the message says what and where."""


@dataclasses.dataclass
class Options:
    """Everything one install pass needs; built from the command line by :func:`main`."""

    source: str
    cni_bin_dir: str = DEFAULT_CNI_BIN_DIR
    name: str = DEFAULT_NAME
    kubeconfig_path: str = DEFAULT_KUBECONFIG_PATH
    serviceaccount_dir: str = DEFAULT_SERVICEACCOUNT_DIR
    cni_conf_dir: str = DEFAULT_CNI_CONF_DIR
    write_conf: str | None = None
    conf_source: str | None = None
    force: bool = False
    interval: float = DEFAULT_INTERVAL
    ready_file: str | None = None
    environ: Mapping[str, str] = dataclasses.field(default_factory=lambda: os.environ)


# --------------------------------------------------------------------------
# Atomic file replacement


def atomic_write(path: str, fill: Callable[[BinaryIO], None], mode: int) -> None:
    """Replace ``path`` with what ``fill`` writes, all at once (see :mod:`rdma_cni.shared.atomicfile`).

    Readers and executors of ``path`` see the old file or the new one, never
    a partial one, and never a missing one. The temporary file is opened
    close-on-exec, so no child process can inherit a writable descriptor,
    which would make exec of the renamed file fail with ETXTBSY.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, fill, mode=mode)


def write_bytes_atomic(path: str, data: bytes, mode: int) -> None:
    """:func:`atomic_write` for data already in memory."""
    atomic_write(path, lambda f: f.write(data), mode)


def sha256_file(path: str) -> str:
    """The hex SHA-256 of a file's contents."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------
# The binary


def marker_path(bin_dir: str, name: str) -> str:
    """The sidecar file recording what this installer wrote as ``bin_dir/name``."""
    return os.path.join(bin_dir, f".{name}.installed")


def _read_marker(path: str, out: TextIO) -> list[str]:
    """Hashes of files this installer wrote, newest first; empty when there is no usable marker."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        _say(out, f"ignoring unreadable install marker {path}: {exc.__class__.__name__}")
        return []
    if not isinstance(doc, dict):
        return []
    hashes = [doc.get("sha256"), *(doc.get("previous") or [])]
    return [h for h in hashes if isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h)]


def install_binary(source: str, bin_dir: str, name: str, *, force: bool, out: TextIO) -> str:
    """Copy ``source`` to ``bin_dir/name`` atomically; return "installed", "replaced" or "unchanged".

    An existing target is replaced only when it is a file this installer
    wrote (its hash is in the marker), already has the new content, or
    ``force`` is set. Raises :class:`InstallError` otherwise.
    """
    target = os.path.join(bin_dir, name)
    if not os.path.isfile(source):
        raise InstallError(f"source binary {source} does not exist or is not a regular file")
    try:
        new_sha = sha256_file(source)
    except OSError as exc:
        raise InstallError(f"cannot read source binary {source}: {exc.strerror or exc}") from None
    marker = marker_path(bin_dir, name)
    known = _read_marker(marker, out)

    status = "installed"
    if os.path.lexists(target):
        if os.path.isdir(target) and not os.path.islink(target):
            raise InstallError(f"{target} is a directory; remove it before installing")
        old_sha = sha256_file(target) if os.path.isfile(target) else None
        if old_sha == new_sha:
            # Same content: rewriting would only churn the inode under kubelet.
            _write_marker(marker, name, new_sha, known, source)
            return "unchanged"
        if old_sha not in known:
            if not force:
                raise InstallError(
                    f"{target} exists and was not installed by rdma-cni install "
                    f"(no matching sha256 in {marker}); refusing to overwrite it: "
                    "remove it, or pass --force to replace it"
                )
            _say(out, f"--force: replacing {target}, which rdma-cni install did not write")
        status = "replaced"

    def copy(dst: BinaryIO) -> None:
        digest = hashlib.sha256()
        with open(source, "rb") as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != new_sha:
            raise InstallError(f"source binary {source} changed while it was being copied")

    os.makedirs(bin_dir, exist_ok=True)
    # Marker first: if we die before the rename, the old file is still listed in it.
    _write_marker(marker, name, new_sha, known, source)
    atomic_write(target, copy, 0o755)
    return status


def _write_marker(path: str, name: str, sha: str, known: list[str], source: str) -> None:
    if known and known[0] == sha:
        # Nothing new to record: leave the file alone rather than rewrite it on every start.
        return
    previous = [h for h in known if h != sha][:_MARKER_HISTORY]
    doc = {
        "name": name,
        "sha256": sha,
        "previous": previous,
        "version": __version__,
        "source": source,
        "installedAt": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    write_bytes_atomic(path, (json.dumps(doc, indent=2) + "\n").encode(), 0o644)


# --------------------------------------------------------------------------
# The kubeconfig


def api_server_url(environ: Mapping[str, str]) -> str:
    """The API server URL from KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT."""
    host = environ.get("KUBERNETES_SERVICE_HOST", "").strip()
    port = environ.get("KUBERNETES_SERVICE_PORT", "").strip()
    for var, value in (("KUBERNETES_SERVICE_HOST", host), ("KUBERNETES_SERVICE_PORT", port)):
        if not value:
            raise InstallError(
                f"{var} is not set: cannot tell the plugin where the API server is "
                "(kubelet sets it in every pod; set it in the DaemonSet's env to override)"
            )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InstallError(f"KUBERNETES_SERVICE_PORT is not a port number: {port[:20]!r}")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal needs brackets in a URL
    return f"https://{host}:{int(port)}"


def render_kubeconfig(serviceaccount_dir: str, environ: Mapping[str, str]) -> bytes:
    """The plugin's kubeconfig (JSON) built from a service-account directory and the environment."""
    token_path = os.path.join(serviceaccount_dir, "token")
    ca_path = os.path.join(serviceaccount_dir, "ca.crt")
    token = _read_piece(token_path, "token").decode("utf-8", "replace").strip()
    if not token:
        raise InstallError(f"service account token {token_path} is empty")
    if not _TOKEN_CHARS.fullmatch(token):
        # The value is a secret: say what is wrong with it, never what it is.
        raise InstallError(f"service account token {token_path} contains whitespace or non-printable bytes")
    ca = _read_piece(ca_path, "CA certificate")
    if b"-----BEGIN CERTIFICATE-----" not in ca:
        raise InstallError(f"service account CA certificate {ca_path} is not a PEM certificate")
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "kubernetes",
                "cluster": {
                    "server": api_server_url(environ),
                    "certificate-authority-data": base64.b64encode(ca).decode("ascii"),
                },
            }
        ],
        "users": [{"name": "rdma-cni", "user": {"token": token}}],
        "contexts": [{"name": "rdma-cni", "context": {"cluster": "kubernetes", "user": "rdma-cni"}}],
        "current-context": "rdma-cni",
        "preferences": {},
    }
    return (json.dumps(doc, indent=2) + "\n").encode("utf-8")


def _read_piece(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise InstallError(
            f"service account {what} {path} is missing: is a service account token mounted "
            "(automountServiceAccountToken) and is --serviceaccount-dir right?"
        ) from None
    except OSError as exc:
        raise InstallError(f"cannot read service account {what} {path}: {exc.strerror or exc}") from None


def write_kubeconfig(path: str, serviceaccount_dir: str, environ: Mapping[str, str]) -> bool:
    """Write the kubeconfig (mode 0600) if its content would change; return True when it was written.

    Comparing content, not timestamps, is what detects a rotated token, and
    it also restores a kubeconfig someone deleted or edited on the host.
    """
    data = render_kubeconfig(serviceaccount_dir, environ)
    try:
        with open(path, "rb") as f:
            current = f.read()
        mode = os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        current, mode = None, None
    if current == data and mode == 0o600:
        return False
    write_bytes_atomic(path, data, 0o600)
    return True


# --------------------------------------------------------------------------
# The network configuration


def default_conflist(kubeconfig_path: str = DEFAULT_KUBECONFIG_PATH) -> dict[str, Any]:
    """The built-in conflist written by ``--write-conf`` without ``--conf-source``.

    Kept identical to conf/rdma-cni.conflist (a test checks it).
    """
    return {
        "cniVersion": "1.0.0",
        "name": "rdma-net",
        "plugins": [
            {
                "type": "rdma-cni",
                # containerd's CRI then passes the pod's annotations itself.
                "capabilities": {"io.kubernetes.cri.pod-annotations": True},
                "kubeconfig": kubeconfig_path,
                "annotation": "rdma_interfaces_required",
                "defaultRequest": [{}],
                "rdmaIsolation": "auto",
                "stateDir": "/var/lib/cni/rdma-cni",
                "lockFile": "/run/rdma-cni/rdma-cni.lock",
                "lockTimeoutSeconds": 60,
                "logFile": "/var/log/rdma-cni.log",
                "logLevel": "info",
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": "192.168.128.0/20"}]],
                },
            }
        ],
    }


def _check_netconf(doc: Any, filename: str, origin: str) -> None:
    """Reject a configuration a runtime would refuse or ignore; the plugin itself validates the rest."""
    if not isinstance(doc, dict):
        raise InstallError(f"{origin}: not a JSON object")
    for key in ("cniVersion", "name"):
        if not isinstance(doc.get(key), str) or not doc[key]:
            raise InstallError(f"{origin}: {key} is missing")
    if filename.endswith(".conflist"):
        plugins = doc.get("plugins")
        if not isinstance(plugins, list) or not plugins:
            raise InstallError(f"{origin}: a .conflist needs a non-empty 'plugins' list")
        entries = plugins
    else:
        if "plugins" in doc:
            raise InstallError(f"{origin}: has 'plugins', so it must be written as a .conflist file")
        entries = [doc]
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("type"), str) or not entry["type"]:
            raise InstallError(f"{origin}: plugin entry {i} has no 'type'")


def write_conf(opts: Options, out: TextIO) -> str:
    """Write the ``--write-conf`` file; return "installed", "replaced" or "unchanged"."""
    filename = opts.write_conf or ""
    if not filename or "/" in filename or filename.startswith("."):
        raise InstallError(f"--write-conf takes a file name inside --cni-conf-dir, not {filename!r}")
    if not filename.endswith(_CONF_EXTENSIONS):
        raise InstallError(
            f"--write-conf {filename}: runtimes only load files ending in {', '.join(_CONF_EXTENSIONS)}"
        )
    if opts.conf_source:
        origin = opts.conf_source
        try:
            with open(opts.conf_source, "rb") as f:
                raw = f.read()
            doc = json.loads(raw)
        except OSError as exc:
            raise InstallError(f"cannot read --conf-source {origin}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise InstallError(f"--conf-source {origin} is not valid JSON: {exc}") from None
    else:
        origin = "the built-in default configuration"
        # The plugin insists on an absolute kubeconfig path.
        doc = default_conflist(os.path.abspath(opts.kubeconfig_path))
        raw = (json.dumps(doc, indent=2) + "\n").encode("utf-8")
    _check_netconf(doc, filename, origin)

    target = os.path.join(opts.cni_conf_dir, filename)
    status = "installed"
    if os.path.lexists(target):
        try:
            with open(target, "rb") as f:
                existing: Any = json.loads(f.read())
        except (OSError, ValueError):
            existing = None  # unreadable or not JSON: certainly different
        if existing == doc:
            return "unchanged"
        if not opts.force:
            raise InstallError(
                f"{target} exists with different content; refusing to overwrite it: "
                "remove it, or pass --force to replace it"
            )
        _say(out, f"--force: replacing {target}")
        status = "replaced"
    write_bytes_atomic(target, raw, 0o644)
    return status


# --------------------------------------------------------------------------
# Running


def _say(out: TextIO, line: str) -> None:
    out.write(f"rdma-cni install: {line}\n")
    out.flush()


def _set_ready(path: str | None, ready: bool) -> None:
    if not path:
        return
    if ready:
        if not os.path.exists(path):
            write_bytes_atomic(path, b"ready\n", 0o644)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def run_once(opts: Options, out: TextIO) -> None:
    """One full install: binary, kubeconfig, optional network configuration. Raises InstallError."""
    # The kubeconfig goes first: a binary that cannot read pods is worse than none.
    if write_kubeconfig(opts.kubeconfig_path, opts.serviceaccount_dir, opts.environ):
        _say(out, f"wrote kubeconfig {opts.kubeconfig_path}")
    else:
        _say(out, f"kubeconfig {opts.kubeconfig_path} is up to date")
    target = os.path.join(opts.cni_bin_dir, opts.name)
    status = install_binary(opts.source, opts.cni_bin_dir, opts.name, force=opts.force, out=out)
    _say(out, f"{status} {target} (rdma-cni {__version__}) from {opts.source}")
    if opts.write_conf:
        status = write_conf(opts, out)
        _say(out, f"{status} {os.path.join(opts.cni_conf_dir, opts.write_conf)}")


def watch(
    opts: Options,
    stop: threading.Event,
    out: TextIO,
    *,
    max_iterations: int | None = None,
) -> None:
    """Refresh the kubeconfig every ``opts.interval`` seconds until ``stop`` is set.

    A failed refresh (say, the token file caught mid-rotation) is reported and
    retried on the next tick; the last good kubeconfig stays in place, and
    the ready file, if any, is removed until a refresh succeeds again.
    ``max_iterations`` bounds the number of ticks, for tests.
    """
    ticks = 0
    failing = False
    while not stop.wait(opts.interval):
        ticks += 1
        try:
            if write_kubeconfig(opts.kubeconfig_path, opts.serviceaccount_dir, opts.environ):
                _say(out, f"service account changed: rewrote kubeconfig {opts.kubeconfig_path}")
            if failing:
                _say(out, "kubeconfig refresh works again")
            failing = False
            _set_ready(opts.ready_file, True)
        except (InstallError, OSError) as exc:
            if not failing:
                _say(out, f"error: kubeconfig refresh failed, will retry: {exc}")
            failing = True
            _set_ready(opts.ready_file, False)
        if max_iterations is not None and ticks >= max_iterations:
            break


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Turn SIGTERM and SIGINT into ``stop.set()`` while the block runs."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, lambda _signo, _frame: stop.set())
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _default_source() -> str | None:
    # The shipped binary is launcher/launcher.c with the PyInstaller tree packed
    # behind it: the launcher execs the unpacked program from its cache and
    # names itself in RDMA_CNI_LAUNCHER, and that single file is what to copy.
    launcher = os.environ.get("RDMA_CNI_LAUNCHER")
    if launcher and getattr(sys, "frozen", False):
        return launcher
    # A plain PyInstaller build runs with sys.executable set to the binary
    # itself; from the Python package, sys.executable is the interpreter.
    if getattr(sys, "frozen", False):
        return sys.executable
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rdma-cni install",
        description="Install rdma-cni on this node: binary, kubeconfig and optionally a network config.",
    )
    parser.add_argument(
        "--source", help="the file to install (default: this executable, when it is the built binary)"
    )
    parser.add_argument("--cni-bin-dir", default=DEFAULT_CNI_BIN_DIR, help="default: %(default)s")
    parser.add_argument("--name", default=DEFAULT_NAME, help="installed file name (default: %(default)s)")
    parser.add_argument("--kubeconfig-path", default=DEFAULT_KUBECONFIG_PATH, help="default: %(default)s")
    parser.add_argument(
        "--serviceaccount-dir", default=DEFAULT_SERVICEACCOUNT_DIR, help="default: %(default)s"
    )
    parser.add_argument("--cni-conf-dir", default=DEFAULT_CNI_CONF_DIR, help="default: %(default)s")
    parser.add_argument(
        "--write-conf", metavar="FILE", help="also write this file (a name) into --cni-conf-dir"
    )
    parser.add_argument(
        "--conf-source", metavar="PATH", help="configuration to write with --write-conf (default: built-in)"
    )
    parser.add_argument("--force", action="store_true", help="replace files this installer did not write")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="install and exit (the default)")
    mode.add_argument("--watch", action="store_true", help="install, then keep the kubeconfig fresh")
    parser.add_argument(
        "--interval", type=float, default=DEFAULT_INTERVAL, help="--watch poll period in seconds"
    )
    parser.add_argument(
        "--ready-file", metavar="PATH", help="create this file once installed (for a readiness probe)"
    )
    parser.add_argument("--max-iterations", type=int, help=argparse.SUPPRESS)  # tests only
    agent = parser.add_argument_group("node agent (with --watch)")
    agent.add_argument(
        "--node-state",
        action="store_true",
        help="also publish this node's RDMA state on its Node (NODE_NAME names it)",
    )
    agent.add_argument(
        "--network-config",
        metavar="FILE",
        action="append",
        default=[],
        help="the plugin's network configuration (conflist or entry) whose pfs, capacityMbps, "
        "rdmaIsolation, stateDir and lockFile to use; repeat for several networks "
        "(default: the plugin's defaults)",
    )
    agent.add_argument(
        "--api-kubeconfig",
        metavar="FILE",
        help="credentials for publishing (default: the kubeconfig this installer writes)",
    )
    agent.add_argument(
        "--node-state-period",
        type=float,
        default=30.0,
        help="also re-read the node this often, in seconds (default: %(default)s)",
    )
    agent.add_argument(
        "--node-state-heartbeat",
        type=float,
        default=300.0,
        help="rewrite an unchanged state this often, in seconds, so that readers can tell "
        "it is fresh (default: %(default)s)",
    )
    agent.add_argument(
        "--nri-socket",
        metavar="PATH",
        default="/var/run/nri/nri.sock",
        help="the runtime's NRI socket, through which each pod gets its own RDMA devices; "
        "empty disables (default: %(default)s)",
    )
    agent.add_argument(
        "--memlock",
        default="unlimited",
        help="RLIMIT_MEMLOCK given to containers that get RDMA devices: 'unlimited', a number of "
        "bytes, or 'off' (default: %(default)s)",
    )
    agent.add_argument(
        "--metrics-listen",
        metavar="ADDR:PORT",
        type=exporter.address_option("--metrics-listen", "0.0.0.0:9101"),
        help="serve the agent's Prometheus /metrics here, plain HTTP (default: off)",
    )
    return parser


def main(argv: list[str], out: TextIO, err: TextIO | None = None) -> int:
    """Entry point of ``rdma-cni install``: 0 on success, 1 on an install error, 2 on bad usage."""
    err = err or sys.stderr
    parser = _parser()
    args = parser.parse_args(argv)
    if args.conf_source and not args.write_conf:
        parser.error("--conf-source needs --write-conf")
    if not args.interval > 0:
        parser.error("--interval must be positive")
    if args.node_state and not args.watch:
        parser.error("--node-state needs --watch")
    if (args.network_config or args.api_kubeconfig or args.metrics_listen) and not args.node_state:
        parser.error("--network-config, --api-kubeconfig and --metrics-listen need --node-state")
    if not (args.node_state_period > 0 and args.node_state_heartbeat > 0):
        parser.error("--node-state-period and --node-state-heartbeat must be positive")
    if args.node_state:
        # Imported only when the agent runs, as the rest of the agent is.
        from rdma_cni.agent.nri.plugin import parse_memlock

        try:
            args.memlock = parse_memlock(args.memlock)
        except ValueError as exc:
            parser.error(str(exc))
    if not args.name or "/" in args.name or args.name.startswith("."):
        # A hidden name would collide with the marker and temporary files.
        parser.error("--name must be a plain file name, not starting with '.'")
    source = args.source or _default_source()
    if source is None:
        err.write(
            "rdma-cni install: error: running from the Python package, not the built binary: "
            "pass --source PATH naming the executable to install\n"
        )
        return 1
    opts = Options(
        source=source,
        cni_bin_dir=args.cni_bin_dir,
        name=args.name,
        kubeconfig_path=args.kubeconfig_path,
        serviceaccount_dir=args.serviceaccount_dir,
        cni_conf_dir=args.cni_conf_dir,
        write_conf=args.write_conf,
        conf_source=args.conf_source,
        force=args.force,
        interval=args.interval,
        ready_file=args.ready_file,
    )
    stop = threading.Event()
    # Handlers go in before the first write: a SIGTERM mid-install then lets
    # the atomic writes finish instead of leaving temporary files behind.
    with _stop_on_signals(stop):
        try:
            run_once(opts, out)
        except (InstallError, OSError) as exc:
            err.write(f"rdma-cni install: error: {exc}\n")
            err.flush()
            return 1
        agent = None
        if args.node_state:
            try:
                agent = _start_agent(args, opts, stop, out)
            except InstallError as exc:
                err.write(f"rdma-cni install: error: {exc}\n")
                err.flush()
                return 1
        _set_ready(opts.ready_file, True)
        if not args.watch or stop.is_set():
            return 0
        _say(out, f"watching {opts.serviceaccount_dir} every {opts.interval:g}s")
        watch(opts, stop, out, max_iterations=args.max_iterations)
        stop.set()
        if agent is not None:
            agent.join(timeout=10)
    _say(out, "stopping")
    return 0


def _start_agent(
    args: argparse.Namespace, opts: Options, stop: threading.Event, out: TextIO
) -> threading.Thread:
    """Start the node agent thread; InstallError for what the operator must fix (nothing is started then)."""
    from rdma_cni.agent.loop import run_agent, setup_agent, start_nri

    node_name = opts.environ.get("NODE_NAME", "")
    try:
        agent = setup_agent(
            node_name=node_name,
            network_configs=args.network_config,
            kubeconfig=args.api_kubeconfig or opts.kubeconfig_path,
            period=args.node_state_period,
            heartbeat=args.node_state_heartbeat,
        )
    except ValueError as exc:
        raise InstallError(f"node agent: {exc}") from None
    from rdma_cni.agent import metrics
    from rdma_cni.kube.events import EventSink

    publisher = agent.publisher
    publisher.events = EventSink(
        lambda path, body: publisher.client.post(path, body), "rdma-cni-agent", host=node_name
    )
    metrics.watch(publisher)
    if args.metrics_listen:
        try:
            server = metrics.serve(args.metrics_listen)
        except OSError as exc:
            raise InstallError(
                "node agent: cannot serve metrics on {}:{}: {}".format(*args.metrics_listen, exc)
            ) from None
        _say(out, "serving metrics on {}:{}".format(*server.server_address[:2]))
    # The agent reports through logging; the container's log should show its progress, not only errors.
    for handler in logging.getLogger("rdma_cni").handlers:
        handler.setLevel(logging.INFO)
    thread = threading.Thread(target=run_agent, args=(agent, stop), name="node-agent", daemon=True)
    thread.start()
    _say(out, f"publishing node state on node {node_name} ({len(agent.views)} network(s))")
    start_nri(agent.views, args.nri_socket, args.memlock, stop)
    return thread
