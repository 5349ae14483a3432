"""``rdma-cni doctor``: check one node, a line per check, with exit codes a probe can use.

Each check reads; none changes the node. The exit code is the worst finding:
0 when every check is OK (or skipped), 1 when one warns, 2 when one fails.
Bad usage is argparse's 2 as well, before any check runs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import json
import os
import stat
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

from rdma_cni.agent.cniserver import DEFAULT_SOCKET as DEFAULT_CNI_SOCKET
from rdma_cni.agent.loop import DEFAULT_PERIOD
from rdma_cni.agent.publish import DEFAULT_HEARTBEAT, MAX_BACKOFF
from rdma_cni.install.binary import marker_path, sha256_file
from rdma_cni.install.common import DEFAULT_CNI_BIN_DIR, DEFAULT_NAME
from rdma_cni.install.handover import jwt_claims
from rdma_cni.launch import cacheprune

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"
EXIT_CODES = {OK: 0, SKIP: 0, WARN: 1, FAIL: 2}

# The support table's floor (docs/deploy.md): RHEL 8's glibc.
GLIBC_FLOOR = (2, 28)
# kubelet renews a projected token at 80% of its life (48 min of the hour);
# with ten minutes or less left the installer's refresh has stopped.
TOKEN_WARN_SECONDS = 600
# More unpacked versions than this, and the cache holds upgrades nobody runs.
CACHE_WARN_VERSIONS = 3
DEFAULT_NRI_SOCKET = "/var/run/nri/nri.sock"
DEFAULT_CACHE_DIR = "/var/cache/rdma-cni"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One check's outcome: ``status`` is OK, WARN, FAIL or SKIP; ``detail`` says what was seen."""

    check: str
    status: str
    detail: str


def exit_code(findings: Iterable[Finding]) -> int:
    """0 all OK or skipped, 1 at least one warning, 2 at least one failure."""
    return max((EXIT_CODES[f.status] for f in findings), default=0)


def check_rdma_mode(mode: str | None, error: str | None, rdma_node: bool = True) -> Finding:
    """The RDMA subsystem's netns mode: exclusive is what isolation needs (SKIP on a node without PFs)."""
    name = "rdma-netns-mode"
    if not rdma_node and mode != "exclusive":
        seen = mode or f"unreadable ({error or 'no RDMA subsystem'})"
        return Finding(name, SKIP, f"{seen}; no SR-IOV PF on this node, so no pod gets RDMA devices here")
    if mode is None:
        return Finding(name, FAIL, f"cannot read the RDMA netns mode: {error or 'no answer'}")
    if mode == "exclusive":
        return Finding(name, OK, "exclusive: each pod's RDMA devices move into its namespace")
    return Finding(
        name,
        WARN,
        f"{mode}: RDMA devices stay visible to every namespace (set ib_core netns_mode=0, docs/deploy.md)",
    )


@dataclasses.dataclass(frozen=True)
class NodeView:
    """What the checks of the node's devices read: the inventory's PFs and RDMA mode, and more.

    ``named`` is the config's ``pfs`` (None: every SR-IOV PF, the plugin's default); ``idle`` the
    netdevs that can have VFs (``sriov_totalvfs`` above 0) but have none (``sriov_numvfs`` 0).
    """

    pfs: list[dict[str, Any]]
    mode: str | None = None
    rdma_error: str | None = None
    named: list[str] | None = None
    idle: tuple[str, ...] = ()

    def rdma_node(self) -> bool:
        """Whether rdma-cni has work here: PFs with VFs, PFs that could have them, or PFs named."""
        return bool(self.pfs or self.idle or self.named)


def check_vfs(
    pfs: list[Mapping[str, Any]], named: list[str] | None = None, idle: Iterable[str] = ()
) -> Finding:
    """VFs per PF, as the inventory reads them.

    FAIL for a PF the config names that has no VFs (or is missing), or, without names, for a PF
    that can have VFs but has none enabled; SKIP for a node with no SR-IOV PF at all (a node
    without RDMA NICs that the DaemonSet runs on too); WARN for a PF without VFs.
    """
    name = "vfs"
    found = {pf["name"] for pf in pfs}
    missing = [n for n in named or () if n not in found]
    if missing:
        return Finding(
            name,
            FAIL,
            f"the config's pfs name {', '.join(missing)}, not found with VFs on this node "
            "(missing, misspelled, or sriov_numvfs not set: docs/deploy.md)",
        )
    idle = list(idle)
    if not pfs and idle:
        return Finding(
            name,
            FAIL,
            f"{', '.join(idle)} can have VFs but none are enabled (sriov_numvfs is 0: is the boot unit "
            "that sets it installed? docs/deploy.md)",
        )
    if not pfs:
        return Finding(
            name, SKIP, "no SR-IOV PF on this node: no RDMA devices, nothing for rdma-cni to serve"
        )
    parts = [
        f"{pf['name']}: {pf['capacity_vfs']} VFs, {pf['free_vfs']} free, {pf['used_vfs']} used" for pf in pfs
    ]
    empty = [pf["name"] for pf in pfs if not pf["capacity_vfs"]]
    if empty:
        return Finding(name, WARN, "; ".join(parts) + f" (no VFs created on {', '.join(empty)})")
    return Finding(name, OK, "; ".join(parts))


def check_nri_socket(path: str) -> Finding:
    """The runtime's NRI socket, through which the agent gives pods their devices."""
    name = "nri-socket"
    if not path:
        return Finding(name, SKIP, "NRI off (--nri-socket '')")
    try:
        st = os.stat(path)
    except OSError as exc:
        return Finding(name, FAIL, f"{path}: {exc.strerror} (is NRI enabled in containerd or CRI-O?)")
    if not stat.S_ISSOCK(st.st_mode):
        return Finding(name, FAIL, f"{path} is not a socket")
    return Finding(name, OK, f"{path} is a socket")


def check_shim(bin_dir: str, name: str = DEFAULT_NAME) -> Finding:
    """The plugin in the CNI bin directory: there, executable, and the file ``rdma-cni install`` wrote."""
    check = "cni-plugin"
    path = os.path.join(bin_dir, name)
    try:
        st = os.stat(path)
    except OSError as exc:
        return Finding(check, FAIL, f"{path}: {exc.strerror} (has the DaemonSet's installer run here?)")
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o111:
        return Finding(check, FAIL, f"{path} is not an executable file")
    marker = marker_path(bin_dir, name)
    try:
        with open(marker, encoding="utf-8") as f:
            doc = json.load(f)
        sha = sha256_file(path)
    except (OSError, ValueError) as exc:
        return Finding(check, WARN, f"{path}: no readable install marker {marker} ({exc.__class__.__name__})")
    if not isinstance(doc, dict) or doc.get("sha256") != sha:
        return Finding(
            check, WARN, f"{path} is not the file the installer last wrote (its sha256 differs from {marker})"
        )
    source = os.path.basename(str(doc.get("source") or "?"))
    return Finding(check, OK, f"{path}: {source} {doc.get('version', '?')}, as the installer wrote it")


def check_cni_socket(path: str, mode: str = "shim") -> Finding:
    """The agent's CNI socket, which the shim hands each verb to: there, a socket, and accepting.

    A connection closed without a request is the probe the agent expects (it logs nothing).
    """
    name = "cni-socket"
    if mode != "shim":
        return Finding(name, SKIP, f"--mode {mode}: the plugin runs whole, no agent socket needed")
    try:
        st = os.stat(path)
    except OSError as exc:
        return Finding(
            name, FAIL, f"{path}: {exc.strerror}: no agent serves the shim (is the DaemonSet's pod up?)"
        )
    if not stat.S_ISSOCK(st.st_mode):
        return Finding(name, FAIL, f"{path} is not a socket")
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(path)
        except OSError as exc:
            return Finding(name, FAIL, f"{path}: {exc.strerror or exc}: nothing accepts the shim's calls")
    return Finding(name, OK, f"{path} accepts connections")


def glibc_version() -> str | None:
    """The C library's version as the dynamic loader gave it to this process; None when not glibc."""
    try:
        libc = ctypes.CDLL(None)
        fn = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_char_p
    value = fn()
    return value.decode("ascii", "replace") if value else None


def check_glibc(version: str | None) -> Finding:
    """The host's glibc against the support table's floor."""
    name = "glibc"
    floor = ".".join(map(str, GLIBC_FLOOR))
    if version is None:
        return Finding(name, WARN, "not glibc (or its version unreadable): outside the support table")
    try:
        parsed = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return Finding(name, WARN, f"unparsable glibc version {version!r}")
    if parsed < GLIBC_FLOOR:
        return Finding(name, FAIL, f"glibc {version} is older than the supported floor {floor}")
    return Finding(name, OK, f"glibc {version} (floor {floor})")


def check_token(path: str, now: float) -> Finding:
    """The node kubeconfig: present, with a token whose ``exp`` is not past nor close."""
    name = "kubeconfig-token"
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        token = doc["users"][0]["user"]["token"]
    except FileNotFoundError:
        return Finding(name, FAIL, f"{path} is missing: has the DaemonSet's installer run here?")
    except OSError as exc:
        return Finding(name, FAIL, f"cannot read {path}: {exc.strerror}")
    except (ValueError, KeyError, IndexError, TypeError):
        return Finding(name, FAIL, f"{path} is not a kubeconfig the installer writes (no token)")
    if not isinstance(token, str) or not token:
        return Finding(name, FAIL, f"{path} has an empty token")
    claims = jwt_claims(token)
    if claims is None:
        return Finding(name, WARN, f"{path}: the token is not a JWT; its expiry is unknown")
    exp = claims.get("exp")
    if not isinstance(exp, (int, float)):
        return Finding(name, OK, f"{path}: the token does not expire")
    left = exp - now
    if left <= 0:
        return Finding(
            name, FAIL, f"{path}: the token expired {int(-left)} s ago (is the installer's --watch running?)"
        )
    if left <= TOKEN_WARN_SECONDS:
        return Finding(name, WARN, f"{path}: the token expires in {int(left)} s and was not renewed")
    return Finding(name, OK, f"{path}: the token expires in {int(left)} s")


def read_node_state(kubeconfig: str, node: str) -> tuple[str | None, str | None]:
    """This Node's node-state annotation, with the node kubeconfig: (text or None, error or None)."""
    from rdma_cni.cni.errors import CniError
    from rdma_cni.kube import client as kubeapi
    from rdma_cni.shared.nodestate import ANNOTATION

    try:
        with kubeapi.ApiClient.from_kubeconfig(kubeconfig) as api:
            doc = api.get(f"/api/v1/nodes/{urllib.parse.quote(node, safe='')}")
    except CniError as exc:
        return None, exc.msg
    except kubeapi.ApiError as exc:
        return None, f"cannot read Node {node}: {exc.message}"
    annotations = (doc.get("metadata") or {}).get("annotations") or {}
    return annotations.get(ANNOTATION), None


def state_warn_age(heartbeat: float = DEFAULT_HEARTBEAT) -> float:
    """The oldest state a healthy agent leaves on its Node, with a heartbeat of ``heartbeat`` seconds.

    The agent rewrites an unchanged state at the first periodic snapshot after a heartbeat
    (``rdma_cni.agent.loop.DEFAULT_PERIOD`` later at most), and a write that fails is retried
    after at most ``MAX_BACKOFF``; the state's time has one-second precision.
    """
    return heartbeat + DEFAULT_PERIOD + MAX_BACKOFF + 1


def check_state_age(
    node: str,
    max_age: float,
    now: float,
    read: Callable[[], tuple[str | None, str | None]],
    heartbeat: float = DEFAULT_HEARTBEAT,
) -> Finding:
    """The age of the state this node's agent last published.

    FAIL past ``max_age``; WARN past :func:`state_warn_age` of ``heartbeat`` (a heartbeat missed),
    which a healthy agent never reaches.
    """
    name = "node-state-age"
    if not node:
        return Finding(name, SKIP, "no --node (or NODE_NAME): which Node's state to read is unknown")
    from rdma_cni.shared import nodestate
    from rdma_cni.shared.quote import bounded

    text, error = read()
    if error is not None:
        return Finding(name, WARN, bounded(error, 300))
    if text is None:
        return Finding(name, FAIL, f"Node {node} has no {nodestate.ANNOTATION}: is the agent running here?")
    try:
        state = nodestate.decode(text)
        updated = datetime.datetime.fromisoformat(state.updated).timestamp()
    except (nodestate.NodeStateError, ValueError) as exc:
        return Finding(name, FAIL, f"Node {node}'s state cannot be read: {bounded(str(exc), 300)}")
    age = max(0.0, now - updated)
    detail = f"Node {node}: state {int(age)} s old (generation {state.generation})"
    if age > max_age:
        return Finding(name, FAIL, f"{detail}, over {int(max_age)} s: is the agent publishing?")
    if age > state_warn_age(heartbeat):
        return Finding(
            name,
            WARN,
            f"{detail}, over {int(state_warn_age(heartbeat))} s: a heartbeat ({int(heartbeat)} s) was missed",
        )
    return Finding(name, OK, detail)


def cache_dir(environ: Mapping[str, str], executable: str | None = None) -> str:
    """Where the launcher unpacks: the cache this binary runs from, else by the launcher's rule."""
    if environ.get("RDMA_CNI_CACHE_DIR"):
        return environ["RDMA_CNI_CACHE_DIR"]
    if executable is None and getattr(sys, "frozen", False) and environ.get("RDMA_CNI_LAUNCHER"):
        executable = sys.executable
    if executable:
        # <cache>/<id>/rdma-cni: a launcher that fell back to another directory is followed.
        return os.path.dirname(os.path.dirname(os.path.abspath(executable)))
    if os.geteuid() == 0:
        return DEFAULT_CACHE_DIR
    return f"/tmp/rdma-cni-{os.geteuid()}"


def unpacked_trees(base: str) -> list[str]:
    """The launcher's complete trees under ``base`` (its temporaries are not versions)."""
    try:
        names = os.listdir(base)
    except OSError:
        return []
    return sorted(
        n
        for n in names
        if cacheprune.is_tree_name(n) and os.path.exists(os.path.join(base, n, cacheprune.COMPLETE))
    )


def tree_bytes(path: str) -> int:
    """Bytes under ``path``, links not followed."""
    total = 0
    for top, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # a file removed while we walk
                total += os.lstat(os.path.join(top, f)).st_size
    return total


def check_cache(base: str) -> Finding:
    """Cache use: bytes and versions unpacked."""
    name = "cache"
    if not os.path.isdir(base):
        return Finding(name, OK, f"{base}: nothing unpacked")
    trees = unpacked_trees(base)
    size = tree_bytes(base)
    detail = f"{base}: {len(trees)} version(s) unpacked, {size / 1e6:.1f} MB"
    if len(trees) > CACHE_WARN_VERSIONS:
        return Finding(name, WARN, detail + f" (more than {CACHE_WARN_VERSIONS}: is a warm server pruning?)")
    return Finding(name, OK, detail)


def _named_pfs(config: str | None) -> list[str] | None:
    """The config's ``pfs``, as the plugin reads it (None without a config or without the key)."""
    if not config:
        return None
    from rdma_cni.cni.config import load_netconf
    from rdma_cni.cni.errors import CniError
    from rdma_cni.cni.protocol import decode_stdin

    try:
        with open(config, "rb") as f:
            return load_netconf(decode_stdin(f.read())).pfs
    except (OSError, CniError):
        return None  # the inventory reports why


def _idle_pfs() -> tuple[str, ...]:
    """Netdevs that can have VFs (``sriov_totalvfs`` > 0) with none enabled."""
    from rdma_cni.kernel import sysfs

    return tuple(n for n in sysfs.net_devices() if sysfs.total_vfs(n) > 0 and sysfs.num_vfs(n) <= 0)


def _inventory(config: str | None) -> NodeView:
    """The PFs and RDMA netns mode through ``rdma-cni inventory``'s own code, and what it leaves out."""
    from rdma_cni.cli.inventory import _collect
    from rdma_cni.cni.errors import CniError

    named, idle = _named_pfs(config), _idle_pfs()
    try:
        doc = _collect(config)
    except CniError as exc:
        return NodeView([], None, exc.msg, named, idle)
    except OSError as exc:
        return NodeView([], None, str(exc), named, idle)
    return NodeView(doc["pfs"], doc.get("rdma_netns_mode"), doc.get("rdma_error"), named, idle)


def run_checks(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    *,
    inventory: Callable[[str | None], NodeView] | None = None,
    now: Callable[[], float] = time.time,
) -> list[Finding]:
    """Every check, in the order they are printed."""
    view = (inventory or _inventory)(args.config)
    return [
        check_rdma_mode(view.mode, view.rdma_error, view.rdma_node()),
        check_vfs(view.pfs, view.named, view.idle),
        check_shim(args.cni_bin_dir),
        check_cni_socket(args.cni_socket, args.mode),
        check_nri_socket(args.nri_socket),
        check_glibc(glibc_version()),
        check_token(args.kubeconfig, now()),
        check_state_age(
            args.node,
            args.max_state_age,
            now(),
            lambda: read_node_state(args.kubeconfig, args.node),
            args.node_state_heartbeat,
        ),
        check_cache(args.cache_dir or cache_dir(environ)),
    ]


def _parser() -> argparse.ArgumentParser:
    from rdma_cni.install.common import DEFAULT_KUBECONFIG_PATH

    parser = argparse.ArgumentParser(prog="rdma-cni doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    parser.add_argument("--config", help="a network config (JSON) whose pfs and stateDir to use")
    parser.add_argument("--kubeconfig", default=DEFAULT_KUBECONFIG_PATH, help="default: %(default)s")
    parser.add_argument(
        "--mode",
        choices=("shim", "fat"),
        default="shim",
        help="how the plugin was installed, as install's --mode (default: %(default)s, as in conf/)",
    )
    parser.add_argument(
        "--cni-bin-dir",
        default=DEFAULT_CNI_BIN_DIR,
        help="where the plugin is installed (default: %(default)s)",
    )
    parser.add_argument(
        "--cni-socket",
        default=DEFAULT_CNI_SOCKET,
        help="the agent's CNI socket, with --mode shim (default: %(default)s)",
    )
    parser.add_argument(
        "--nri-socket", default=DEFAULT_NRI_SOCKET, help="default: %(default)s; '' skips the check"
    )
    parser.add_argument(
        "--node",
        default=os.environ.get("NODE_NAME", ""),
        help="this node's name, whose published state to read (default: $NODE_NAME)",
    )
    parser.add_argument(
        "--max-state-age",
        type=float,
        default=900.0,
        help="a state older than this, in seconds, fails (default: %(default)s)",
    )
    parser.add_argument(
        "--node-state-heartbeat",
        type=float,
        default=DEFAULT_HEARTBEAT,
        help="the agent's --node-state-heartbeat: a state older than it plus the agent's longest delay "
        "warns (default: %(default)s)",
    )
    parser.add_argument(
        "--cache-dir", help="the launcher's cache (default: $RDMA_CNI_CACHE_DIR, else /var/cache/rdma-cni)"
    )
    return parser


def main(argv: list[str], out: TextIO, environ: Mapping[str, str] | None = None) -> int:
    """Entry point of ``rdma-cni doctor``: the worst finding's exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not (args.max_state_age > 0 and args.node_state_heartbeat > 0):
        parser.error("--max-state-age and --node-state-heartbeat must be positive")
    from rdma_cni.launch.startup import quiet_pydantic

    quiet_pydantic()
    findings = run_checks(args, os.environ if environ is None else environ)
    code = exit_code(findings)
    if args.json:
        doc = {"exit_code": code, "checks": [dataclasses.asdict(f) for f in findings]}
        out.write(json.dumps(doc) + "\n")
    else:
        for f in findings:
            out.write(f"{f.status:<4}  {f.check:<16}  {f.detail}\n")
    out.flush()
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:], sys.stdout))
