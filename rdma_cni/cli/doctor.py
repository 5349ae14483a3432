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


def check_rdma_mode(mode: str | None, error: str | None) -> Finding:
    """The RDMA subsystem's netns mode: exclusive is what isolation needs."""
    name = "rdma-netns-mode"
    if mode is None:
        return Finding(name, FAIL, f"cannot read the RDMA netns mode: {error or 'no answer'}")
    if mode == "exclusive":
        return Finding(name, OK, "exclusive: each pod's RDMA devices move into its namespace")
    return Finding(
        name,
        WARN,
        f"{mode}: RDMA devices stay visible to every namespace (set ib_core netns_mode=0, docs/deploy.md)",
    )


def check_vfs(pfs: list[Mapping[str, Any]]) -> Finding:
    """VFs per PF, as the inventory reads them: FAIL without any, WARN for a PF without VFs."""
    name = "vfs"
    if not pfs:
        return Finding(name, FAIL, "no SR-IOV PF found (sriov_numvfs set? pfs in the config right?)")
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


def check_state_age(
    node: str,
    max_age: float,
    now: float,
    read: Callable[[], tuple[str | None, str | None]],
) -> Finding:
    """The age of the state this node's agent last published: FAIL past ``max_age``, WARN past a third."""
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
    if age > max_age / 3:
        return Finding(name, WARN, f"{detail}: a heartbeat was missed")
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


def _inventory(config: str | None) -> tuple[list[dict[str, Any]], str | None, str | None]:
    """The PFs and RDMA netns mode through ``rdma-cni inventory``'s own code."""
    from rdma_cni.cli.inventory import _collect
    from rdma_cni.cni.errors import CniError

    try:
        doc = _collect(config)
    except CniError as exc:
        return [], None, exc.msg
    except OSError as exc:
        return [], None, str(exc)
    return doc["pfs"], doc.get("rdma_netns_mode"), doc.get("rdma_error")


def run_checks(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    *,
    inventory: Callable[[str | None], tuple[list[dict[str, Any]], str | None, str | None]] | None = None,
    now: Callable[[], float] = time.time,
) -> list[Finding]:
    """Every check, in the order they are printed."""
    pfs, mode, rdma_error = (inventory or _inventory)(args.config)
    return [
        check_rdma_mode(mode, rdma_error),
        check_vfs(pfs),
        check_nri_socket(args.nri_socket),
        check_glibc(glibc_version()),
        check_token(args.kubeconfig, now()),
        check_state_age(
            args.node, args.max_state_age, now(), lambda: read_node_state(args.kubeconfig, args.node)
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
        help="a state older than this, in seconds, fails; a third of it warns (default: %(default)s)",
    )
    parser.add_argument(
        "--cache-dir", help="the launcher's cache (default: $RDMA_CNI_CACHE_DIR, else /var/cache/rdma-cni)"
    )
    return parser


def main(argv: list[str], out: TextIO, environ: Mapping[str, str] | None = None) -> int:
    """Entry point of ``rdma-cni doctor``: the worst finding's exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.max_state_age > 0:
        parser.error("--max-state-age must be positive")
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
