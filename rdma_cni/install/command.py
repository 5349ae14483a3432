"""``rdma-cni install`` as a command: its options, one install pass, ``--watch``, and the node agent's thread.

Standard library only until the node agent (``--node-state``) or the CNI server (``--mode shim
--watch``, which reads the networks' configurations with the plugin's model) is switched on.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TextIO

from rdma_cni import __version__
from rdma_cni.agent.cniserver import DEFAULT_SOCKET
from rdma_cni.agent.takeover import MetricsPort
from rdma_cni.httpd import exporter
from rdma_cni.install.binary import install_binary
from rdma_cni.install.common import (
    DEFAULT_CNI_BIN_DIR,
    DEFAULT_CNI_CONF_DIR,
    DEFAULT_INTERVAL,
    DEFAULT_KUBECONFIG_PATH,
    DEFAULT_NAME,
    DEFAULT_SERVICEACCOUNT_DIR,
    InstallError,
    Options,
    say,
    write_bytes_atomic,
)
from rdma_cni.install.handover import refresh_keep
from rdma_cni.install.kubeconfig import write_kubeconfig
from rdma_cni.install.netconf import write_conf
from rdma_cni.install.uninstall import add_options as add_uninstall_options
from rdma_cni.install.uninstall import run as run_uninstall

if TYPE_CHECKING:
    from rdma_cni.agent.cniserver import CniServer


def _set_ready(path: str | None, ready: bool) -> None:
    if not path:
        return
    if ready:
        if not os.path.exists(path):
            write_bytes_atomic(path, b"ready\n", 0o644)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def touch_live(path: str | None) -> None:
    """Create ``path`` or move its mtime to now: the liveness probe's proof that the agent turns."""
    if not path:
        return
    try:
        os.utime(path)
    except FileNotFoundError:
        write_bytes_atomic(path, b"live\n", 0o644)


def run_once(opts: Options, out: TextIO) -> None:
    """One full install: binary, kubeconfig, optional network configuration. Raises InstallError."""
    # The kubeconfig goes first: a binary that cannot read pods is worse than none.
    if write_kubeconfig(opts.kubeconfig_path, opts.serviceaccount_dir, opts.environ):
        say(out, f"wrote kubeconfig {opts.kubeconfig_path}")
    else:
        say(out, f"kubeconfig {opts.kubeconfig_path} is up to date")
    target = os.path.join(opts.cni_bin_dir, opts.name)
    status = install_binary(opts.source, opts.cni_bin_dir, opts.name, force=opts.force, out=out)
    say(out, f"{status} {target} (rdma-cni {__version__}) from {opts.source}")
    if opts.write_conf:
        status = write_conf(opts, out)
        say(out, f"{status} {os.path.join(opts.cni_conf_dir, opts.write_conf)}")


def watch(
    opts: Options,
    stop: threading.Event,
    out: TextIO,
    *,
    max_iterations: int | None = None,
    alive: Callable[[], list[str]] | None = None,
) -> None:
    """Refresh the kubeconfig every ``opts.interval`` seconds until ``stop`` is set.

    A failed refresh (say, the token file caught mid-rotation) is reported and
    retried on the next tick; the last good kubeconfig stays in place, and
    the ready file, if any, is removed until a refresh succeeds again.
    Each tick also touches the live file (``--live-file``, the liveness probe's) unless
    ``alive`` names parts of the agent that stopped: a hung loop or a dead part lets it age.
    ``max_iterations`` bounds the number of ticks, for tests.
    """
    ticks = 0
    failing = False
    # The pod that started last took the file over in run_once; leave it to it (install/handover).
    keep = refresh_keep(opts.serviceaccount_dir, opts.environ)
    dead: list[str] = []
    while not stop.wait(opts.interval):
        ticks += 1
        now_dead = alive() if alive is not None else []
        if now_dead and now_dead != dead:
            say(out, f"error: {', '.join(now_dead)} stopped: no longer touching the live file")
        dead = now_dead
        if not dead:
            with contextlib.suppress(OSError):  # a full /tmp: the probe then fails, as it should
                touch_live(opts.live_file)
        try:
            if write_kubeconfig(opts.kubeconfig_path, opts.serviceaccount_dir, opts.environ, keep=keep):
                say(out, f"service account changed: rewrote kubeconfig {opts.kubeconfig_path}")
            if failing:
                say(out, "kubeconfig refresh works again")
            failing = False
            _set_ready(opts.ready_file, True)
        except (InstallError, OSError) as exc:
            if not failing:
                say(out, f"error: kubeconfig refresh failed, will retry: {exc}")
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
    parser.add_argument(
        "--mode",
        choices=("fat", "shim"),
        default="fat",
        help="what goes into --cni-bin-dir: 'shim', the static shim that hands verbs to this "
        "agent's CNI server (any host glibc; needs --watch to serve), or 'fat', the whole plugin "
        "(hosts with a glibc at least the build machine's) (default: %(default)s)",
    )
    parser.add_argument(
        "--shim-source",
        metavar="FILE",
        help="the shim to install with --mode shim (default: rdma-cni-shim beside --source)",
    )
    parser.add_argument(
        "--cni-socket",
        metavar="PATH",
        default=DEFAULT_SOCKET,
        help="with --mode shim --watch, serve CNI verbs here (default: %(default)s, the shim's own)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="install and exit (the default)")
    mode.add_argument("--watch", action="store_true", help="install, then keep the kubeconfig fresh")
    parser.add_argument(
        "--interval", type=float, default=DEFAULT_INTERVAL, help="--watch poll period in seconds"
    )
    parser.add_argument(
        "--ready-file", metavar="PATH", help="create this file once installed (for a readiness probe)"
    )
    parser.add_argument(
        "--live-file",
        metavar="PATH",
        help="with --watch, touch this file every --interval while the agent's threads run "
        "(for a liveness probe: its age says the agent is stuck)",
    )
    parser.add_argument("--max-iterations", type=int, help=argparse.SUPPRESS)  # tests only
    _agent_options(parser.add_argument_group("node agent (with --watch)"))
    add_uninstall_options(parser)
    return parser


def _agent_options(agent: argparse._ArgumentGroup) -> None:
    """The node agent's options (``--node-state`` and what goes with it)."""
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
        "(default: the plugin's defaults); with --mode shim --watch, also the stateDirs whose "
        "records of an earlier boot the CNI server releases at start",
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
        "--kubelet-registry-dir",
        metavar="DIR",
        default="/var/lib/kubelet/plugins_registry",
        help='kubelet\'s plugin registry, where the DRA plugin of the DRA networks ("dra": true) registers; '
        "empty: no kubelet plugin (default: %(default)s)",
    )
    agent.add_argument(
        "--kubelet-plugin-dir",
        metavar="DIR",
        default="/var/lib/kubelet/plugins/rdma-cni.io",
        help="where the DRA plugin serves kubelet (default: %(default)s)",
    )
    agent.add_argument(
        "--metrics-listen",
        metavar="ADDR:PORT",
        type=exporter.address_option("--metrics-listen", "10.0.0.5:9473"),
        help="serve the agent's Prometheus /metrics here, plain HTTP: the node's own address "
        "(conf/: $(HOST_IP) from the downward API), not 0.0.0.0, which on the host network is "
        "every interface of the node (default: off)",
    )


def main(argv: list[str], out: TextIO, err: TextIO | None = None) -> int:
    """Entry point of ``rdma-cni install``: 0 on success, 1 on an install error, 2 on bad usage."""
    err = err or sys.stderr
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.uninstall:
        return run_uninstall(args, out, err)
    source = args.source or _default_source()
    if source is None:
        err.write(
            "rdma-cni install: error: running from the Python package, not the built binary: "
            "pass --source PATH naming the executable to install\n"
        )
        return 1
    if args.mode == "shim":
        source = args.shim_source or os.path.join(os.path.dirname(source), "rdma-cni-shim")
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
        live_file=args.live_file,
    )
    return _run(args, opts, out, err)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options that do not go together, or out of range: exit 2 through ``parser.error``."""
    if args.conf_source and not args.write_conf:
        parser.error("--conf-source needs --write-conf")
    if not args.interval > 0:
        parser.error("--interval must be positive")
    if args.node_state and not args.watch:
        parser.error("--node-state needs --watch")
    if (args.api_kubeconfig or args.metrics_listen) and not args.node_state:
        parser.error("--api-kubeconfig and --metrics-listen need --node-state")
    if args.network_config and not (args.node_state or (args.mode == "shim" and args.watch)):
        parser.error("--network-config needs --node-state, or --mode shim with --watch")
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


def _run(args: argparse.Namespace, opts: Options, out: TextIO, err: TextIO) -> int:
    """Install once, then (``--watch``) keep the kubeconfig fresh and run the agent until stopped."""
    stop = threading.Event()
    # Handlers go in before the first write: a SIGTERM mid-install then lets
    # the atomic writes finish instead of leaving temporary files behind.
    with _stop_on_signals(stop):
        server = None
        cni = None
        if args.mode == "shim" and args.watch:
            # Serving before the shim is in place: no call finds a shim without a server (or, in a
            # rollout with surge, the old agent serves until this one takes the socket over).
            from rdma_cni.agent.bootrelease import network_states

            try:
                states = network_states(args.network_config)
                server, cni = _start_cni_server(args.cni_socket, states, stop, out, [opts.kubeconfig_path])
            except InstallError as exc:
                err.write(f"rdma-cni install: error: {exc}\n")
                err.flush()
                return 1
        elif args.mode == "shim":
            say(out, "--mode shim without --watch: run `rdma-cni cni-server` to serve the shim's calls")
        parts = {"the CNI server": server} if server is not None else {}
        try:
            code = _install_and_watch(args, opts, stop, out, err, parts, cni)
        finally:
            stop.set()
            if server is not None:
                # The CNI server hands its socket over to a waiting agent, then lets calls under way finish.
                from rdma_cni.agent.cniserver import DRAIN_SECONDS, HANDOVER_SECONDS

                server.join(timeout=HANDOVER_SECONDS + DRAIN_SECONDS + 1)
        if code is not None:
            return code
    say(out, "stopping")
    return 0


def _install_and_watch(
    args: argparse.Namespace,
    opts: Options,
    stop: threading.Event,
    out: TextIO,
    err: TextIO,
    parts: dict[str, threading.Thread] | None = None,
    cni: CniServer | None = None,
) -> int | None:
    """The install pass, the agent, and ``--watch``; an exit code to return early, None when stopped.

    ``parts``: the threads that must keep running for the agent to be alive (the live file). With
    the CNI server (``cni``), Ready waits for its verb workers: the first verb on the node is then
    as fast as any (they import while the installer writes its files).
    """
    parts = dict(parts or {})
    try:
        run_once(opts, out)
    except (InstallError, OSError) as exc:
        err.write(f"rdma-cni install: error: {exc}\n")
        err.flush()
        return 1
    agent = None
    port = None
    if args.node_state:
        try:
            agent, port = _start_agent(args, opts, stop, out)
        except InstallError as exc:
            err.write(f"rdma-cni install: error: {exc}\n")
            err.flush()
            return 1
    if cni is not None and not cni.wait_ready(0):
        say(out, "waiting for the CNI verb workers before reporting ready")
        while not cni.wait_ready(0.5):
            if stop.is_set():
                return None
        say(out, "CNI verb workers ready")
    if agent is not None:
        parts["the node agent"] = agent
    # Ready without waiting for what another agent still holds (see rdma_cni/agent/takeover.py).
    _set_ready(opts.ready_file, True)
    if args.watch:
        touch_live(opts.live_file)
    if not args.watch or stop.is_set():
        if port is not None:
            port.close()
        return 0
    say(out, f"watching {opts.serviceaccount_dir} every {opts.interval:g}s")
    watch(
        opts,
        stop,
        out,
        max_iterations=args.max_iterations,
        alive=lambda: [name for name, thread in parts.items() if not thread.is_alive()],
    )
    stop.set()
    if port is not None:
        port.close()  # first: the next agent on this node is waiting for the port
    if agent is not None:
        agent.join(timeout=10)
    return None


def _start_cni_server(
    socket_path: str,
    states: Sequence[tuple[str, str]],
    stop: threading.Event,
    out: TextIO,
    kubeconfigs: Sequence[str] = (),
) -> tuple[threading.Thread, CniServer]:
    """Serve the shim's calls in a thread until ``stop``; InstallError when the socket cannot be served.

    Returns the thread, and the server (whose workers the agent's readiness waits for).

    ``states``: the ``stateDir`` and ``lockFile`` of the node's networks, whose records of an
    earlier boot the server releases before it serves. Another agent serving the socket (the old
    one of a rollout with surge) is no error: this one takes the socket over in the background
    the moment that one lets go. ``kubeconfigs``: the one this install writes, which its network
    configuration names; each verb worker connects to its API server before it is ready.
    """
    from rdma_cni.agent.cniserver import TAKEOVER_POLL, CniServer, ServerError
    from rdma_cni.agent.takeover import HELD, take_over

    server = CniServer(socket_path, states=states, kubeconfigs=kubeconfigs)
    try:
        serving = server.try_start()
    except ServerError as exc:
        raise InstallError(f"CNI server: {exc}") from None

    def run() -> None:
        if not serving and not take_over(
            "cni", server.try_start, stop, poll=TAKEOVER_POLL, max_poll=TAKEOVER_POLL
        ):
            server.close()
            return
        HELD["cni"] = True
        try:
            server.serve(stop)
        finally:
            HELD["cni"] = False

    HELD["cni"] = serving
    thread = threading.Thread(target=run, name="cni-server", daemon=True)
    thread.start()
    if serving:
        say(out, f"serving CNI verbs for the shim on {server.socket_path} (plugin {server.plugin[0]})")
    else:
        say(out, f"another agent serves {server.socket_path}: taking it over when it stops")
    return thread, server


def _start_agent(
    args: argparse.Namespace, opts: Options, stop: threading.Event, out: TextIO
) -> tuple[threading.Thread, MetricsPort | None]:
    """Start the node agent thread and its metrics; InstallError for what the operator must fix."""
    from rdma_cni.agent.loop import run_agent, setup_agent, start_dra, start_nri

    node_name = opts.environ.get("NODE_NAME", "")
    try:
        agent = setup_agent(
            node_name=node_name,
            network_configs=args.network_config,
            kubeconfig=args.api_kubeconfig or opts.kubeconfig_path,
            period=args.node_state_period,
            heartbeat=args.node_state_heartbeat,
            kubelet_dirs=(args.kubelet_registry_dir, args.kubelet_plugin_dir)
            if args.kubelet_registry_dir
            else None,
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
    port = None
    if args.metrics_listen:
        port = MetricsPort(args.metrics_listen, metrics.serve)
        try:
            serving = port.start(stop)
        except OSError as exc:
            raise InstallError(
                "node agent: cannot serve metrics on {}:{}: {}".format(*args.metrics_listen, exc)
            ) from None
        if serving:
            say(out, "serving metrics on {}:{}".format(*port.server.server_address[:2]))
        else:
            say(
                out,
                "metrics port {}:{} is busy (another agent): taking it over when it is free".format(
                    *args.metrics_listen
                ),
            )
    # The agent reports through logging; the container's log should show its progress, not only errors.
    for handler in logging.getLogger("rdma_cni").handlers:
        handler.setLevel(logging.INFO)
    thread = threading.Thread(target=run_agent, args=(agent, stop), name="node-agent", daemon=True)
    thread.start()
    say(out, f"publishing node state on node {node_name} ({len(agent.views)} network(s))")
    from rdma_cni.agent.nri.plugin import grantable_memlock

    # What the runtime can grant on this host, not only what was asked: a raise it cannot make
    # fails the container (grantable_memlock).
    memlock, why = grantable_memlock(args.memlock)
    if why:
        say(out, f"NRI: {why}")
    start_nri(agent.all_views, args.nri_socket, memlock, stop)
    if agent.dra is not None:
        try:
            start_dra(agent, stop)
        except (OSError, RuntimeError) as exc:
            raise InstallError(f"node agent: DRA kubelet plugin: {exc}") from None
        say(out, f"publishing ResourceSlices of {len(agent.dra.views)} DRA network(s) on node {node_name}")
    return thread, port
