"""``rdma-cni install --uninstall``: remove what the installer and the plugin put on this node.

It refuses while pods hold VFs (allocation records present): removing the
binary then would leave those pods' DELs with no plugin to run, and their VFs
in the pods. ``--drain`` waits instead (up to ``--drain-timeout``) for the
records to go, which they do as the runtime DELs each pod (``kubectl drain``
the node, or delete its RDMA pods); it never tears an interface out of a
running pod itself. Then, in this order: the network configuration it wrote
(no new ADD starts), the binary and its marker (only a file the installer
wrote, unless ``--force``), the kubeconfig, the ready file, the launcher's
cache (the warm server exits by itself once the binary is gone: the cache is
pruned as it lets go of its tree), and, once no record is left, the lock and
the NRI state beside it and the empty state directories. Every path it
leaves is printed with why.

Standard library only, as the rest of the installer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Callable
from typing import TextIO

from rdma_cni.install.binary import marker_path, sha256_file
from rdma_cni.install.common import say
from rdma_cni.launch import cacheprune

# The plugin's defaults (rdma_cni.cni.config, which needs pydantic; a test keeps them equal).
DEFAULT_STATE_DIR = "/var/lib/cni/rdma-cni"
DEFAULT_LOCK_FILE = "/run/rdma-cni/rdma-cni.lock"
DEFAULT_CACHE_DIR = "/var/cache/rdma-cni"
DEFAULT_LOG_FILE = "/var/log/rdma-cni/rdma-cni.log"
NRI_STATE = "nri-state"  # rdma_cni.node.nristate.STATE_FILE
BOOT_CHECKED = "boot-checked"  # rdma_cni.node.boot.MARKER: the boot whose records were last checked
SERVER_LOCKS = ("cni.lock", "cni.next.lock")  # beside the CNI server's socket (rdma_cni.agent.cniserver)
STATE_SUBDIRS = ("attachments", "quarantine", "ipam-pending")  # rdma_cni.node.statedir.SUBDIRS
PREPARED_DIR = "prepared"  # rdma_cni.node.prepared.DIRECTORY: DRA claims' preparations
NODE_STATE_ANNOTATION = "rdma-cni.io/node-state"  # rdma_cni.shared.nodestate.ANNOTATION
SPOOL_NAME = "del-spool"  # rdma_cni.agent.delspool.SPOOL_NAME, beside the CNI server's socket
CLAIMED = ".run-"  # rdma_cni.agent.delspool.CLAIMED
# The warm server checks its binary every 5 s (rdma_cni.launch.warm.TREE_CHECK_SECONDS).
WARM_EXIT_WAIT = 12.0


def add_options(parser: argparse.ArgumentParser) -> None:
    """The uninstaller's options, a group of the installer's parser."""
    group = parser.add_argument_group("uninstall")
    group.add_argument(
        "--uninstall",
        action="store_true",
        help="remove what install and the plugin put on this node (refuses while pods hold VFs)",
    )
    group.add_argument(
        "--drain",
        action="store_true",
        help="with --uninstall: wait for pods holding VFs to be deleted instead of refusing",
    )
    group.add_argument(
        "--drain-timeout", type=float, default=300.0, help="seconds --drain waits (default: %(default)s)"
    )
    group.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="the plugin's stateDir")
    group.add_argument("--lock-file", default=DEFAULT_LOCK_FILE, help="the plugin's lockFile")
    group.add_argument(
        "--cache-dir",
        default=os.environ.get("RDMA_CNI_CACHE_DIR") or DEFAULT_CACHE_DIR,
        help="the launcher's cache (default: $RDMA_CNI_CACHE_DIR, else %(default)s)",
    )


@dataclasses.dataclass
class Report:
    """What the uninstaller removed and what it left, with why."""

    removed: list[str] = dataclasses.field(default_factory=list)
    left: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def holders(state_dir: str) -> list[str]:
    """Who holds VFs: one line per allocation record (its pod when readable)."""
    directory = os.path.join(state_dir, "attachments")
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        if name.startswith(".") or not name.endswith(".json") or "@" not in name:
            continue
        container_id, _, ifname = name[: -len(".json")].partition("@")
        pod = "an unreadable record"
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                doc = json.load(f)
            pod = "pod {namespace}/{name}".format(**doc["pod"]) if doc.get("pod") else "a pod"
        out.append(f"{pod} (container {container_id[:12]}, {ifname})")
    return out


def spooled_dels(socket_path: str) -> list[str]:
    """DELs the shim spooled for the agent while none served (they run when an agent starts)."""
    try:
        names = os.listdir(os.path.join(os.path.dirname(socket_path), SPOOL_NAME))
    except OSError:
        return []
    # A DEL claimed by a run that failed, or by an agent killed mid-run, is ".run-<name>": spooled still.
    return sorted(n for n in names if not n.startswith(".") or n.startswith(CLAIMED))


def serving(socket_path: str) -> bool:
    """Whether an agent's CNI server answers on ``socket_path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(1.0)
        try:
            s.connect(socket_path)
        except OSError:
            return False
    return True


def _remove_socket(socket_path: str, report: Report) -> None:
    """The CNI server's socket (a stale one: a live agent's is left), its empty spool and directory."""
    if serving(socket_path):
        report.left.append((socket_path, "an agent still serves here: delete the DaemonSet first"))
        return
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.lstat(socket_path).st_mode):
            _remove_file(socket_path, report)
    directory = os.path.dirname(socket_path)
    # Which server owns the socket, and which waits to take it over (rdma_cni.agent.cniserver).
    for lock in SERVER_LOCKS:
        _remove_file(os.path.join(directory, lock), report)
    _remove_empty_dir(os.path.join(directory, SPOOL_NAME), report, "not empty: DELs still spooled")
    _remove_empty_dir(directory, report, "not empty")


def _remove_file(path: str, report: Report) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    report.removed.append(path)


def _remove_empty_dir(path: str, report: Report, why_kept: str) -> None:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return
    except OSError:
        report.left.append((path, why_kept))
        return
    report.removed.append(path)


def _remove_binary(bin_dir: str, name: str, force: bool, report: Report) -> None:
    target = os.path.join(bin_dir, name)
    marker = marker_path(bin_dir, name)
    if os.path.lexists(target):
        known: list[str] = []
        with contextlib.suppress(OSError, ValueError, AttributeError):
            with open(marker, encoding="utf-8") as f:
                doc = json.load(f)
            known = [doc.get("sha256"), *(doc.get("previous") or [])]
        ours = os.path.isfile(target) and sha256_file(target) in known
        if not (ours or force):
            report.left.append(
                (target, "not written by rdma-cni install (no matching marker); --force removes it")
            )
            return
        _remove_file(target, report)
    _remove_file(marker, report)


def _prune_cache(cache_dir: str, report: Report, wait: float, sleep: Callable[[float], None]) -> None:
    """Remove every tree but the one this command runs from, waiting for warm servers to let go."""
    own = os.path.dirname(os.path.abspath(sys.executable)) if getattr(sys, "frozen", False) else ""
    current = os.path.basename(own) if os.path.dirname(own) == os.path.abspath(cache_dir) else None
    deadline = time.monotonic() + wait
    while True:
        outcomes = cacheprune.prune(cache_dir, current, min_idle=0.0)
        held = [o for o in outcomes if not o.removed and o.why == "a warm server holds it"]
        report.removed += [os.path.join(cache_dir, o.tree) for o in outcomes if o.removed]
        if not held or time.monotonic() >= deadline:
            break
        sleep(0.5)
    for o in outcomes:
        if not o.removed:
            report.left.append((os.path.join(cache_dir, o.tree), o.why))
    if current:
        report.left.append((own, "this command runs from it: remove it once it has exited"))
    _remove_empty_dir(cache_dir, report, "not empty")


def run(
    args: argparse.Namespace,
    out: TextIO,
    err: TextIO,
    *,
    sleep: Callable[[float], None] = time.sleep,
    warm_exit_wait: float = WARM_EXIT_WAIT,
) -> int:
    """Uninstall: 0 done (what is left is printed), 1 refused (pods hold VFs), 2 bad usage."""
    if args.watch or args.node_state:
        err.write("rdma-cni install: error: --uninstall does not go with --watch or --node-state\n")
        return 2
    pods = holders(args.state_dir)
    if pods and args.drain:
        say(
            out,
            f"draining: waiting up to {args.drain_timeout:g}s for {len(pods)} attachment(s) to be deleted",
        )
        deadline = time.monotonic() + args.drain_timeout
        while pods and time.monotonic() < deadline:
            sleep(1.0)
            pods = holders(args.state_dir)
    if pods:
        err.write(
            f"rdma-cni install: error: refusing to uninstall: {len(pods)} attachment(s) hold VFs on this "
            "node; delete these pods (kubectl drain the node) and retry, or pass --drain to wait:\n"
        )
        err.writelines(f"  {p}\n" for p in pods)
        spooled = spooled_dels(args.cni_socket)
        if spooled:
            err.write(
                f"  and {len(spooled)} DEL(s) the shim spooled while no agent ran: start the "
                "DaemonSet again, its agent runs them first, then retry\n"
            )
        err.flush()
        return 1
    report = Report()
    if args.write_conf:
        _remove_file(os.path.join(args.cni_conf_dir, args.write_conf), report)
    _remove_binary(args.cni_bin_dir, args.name, args.force, report)
    late = holders(args.state_dir)  # an ADD that started before the configuration went
    _remove_file(args.kubeconfig_path, report)
    _remove_empty_dir(os.path.dirname(args.kubeconfig_path), report, "not empty")
    if args.ready_file:
        _remove_file(args.ready_file, report)
    _prune_cache(args.cache_dir, report, warm_exit_wait, sleep)
    if late:
        for p in late:
            report.left.append((args.state_dir, f"{p} was added during the uninstall: reinstall to DEL it"))
    else:
        _remove_socket(args.cni_socket, report)
        _remove_file(args.lock_file, report)
        _remove_file(os.path.join(os.path.dirname(args.lock_file), NRI_STATE), report)
        # Which agent's NRI plugin registers (rdma_cni.agent.nri.plugin's lock_file).
        _remove_file(os.path.join(os.path.dirname(args.lock_file), NRI_STATE + ".lock"), report)
        _remove_empty_dir(os.path.dirname(args.lock_file), report, "not empty")
        for sub in STATE_SUBDIRS:
            _remove_empty_dir(
                os.path.join(args.state_dir, sub),
                report,
                "not empty: set-aside records or IPAM releases still pending (docs/operations.md)",
            )
        # Kubelet unprepares a claim once its pod is gone (docs/dra.md); one still here is a pod's.
        _remove_empty_dir(
            os.path.join(args.state_dir, PREPARED_DIR),
            report,
            "not empty: DRA claims still prepared (kubelet unprepares each when its pod goes)",
        )
        _remove_file(os.path.join(args.state_dir, BOOT_CHECKED), report)
        _remove_empty_dir(args.state_dir, report, "not empty")
    report.left.append((DEFAULT_LOG_FILE, "the plugin's logFile, if set: logs are the operator's to delete"))
    report.left.append(
        (
            f"the {NODE_STATE_ANNOTATION} annotation on this Node",
            f"kubectl annotate node NODE {NODE_STATE_ANNOTATION}- removes it",
        )
    )
    for path in report.removed:
        say(out, f"removed {path}")
    for path, why in report.left:
        say(out, f"left {path}: {why}")
    return 0
