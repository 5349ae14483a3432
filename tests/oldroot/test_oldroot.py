"""The host side on glibc 2.31: the shim installed into a Debian 11 root, verbs run from inside it.

The server (``rdma-cni cni-server`` of the binary under test) runs in this
machine's userspace on the simulated node; only the shim runs in the old root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.integration.conftest import Cluster
from tests.integration.test_shim_server import ServerProcess
from tests.support.cniserver import install_shim
from tests.support.shim import REPO, ShimOutcome
from tests.support.simnode import ip

FLOOR = (2, 28)  # the host side's promise (docs/deploy.md): RHEL 8
# Where the agent's socket directory and a pod's namespace appear inside the root: the shim's
# own default, and a path the server's mount view does not have.
ROOT_SOCKET_DIR = "/run/rdma-cni/agent"
ROOT_PODS = "/run/oldroot-pods"

# Binds the given (source, target-inside-root) pairs in a private mount namespace, then runs the
# command chrooted: nothing is mounted on the shared root outside this one process tree.
_ENTER = """set -e
root=$1; shift
while [ "$1" != "--" ]; do mount --bind "$1" "$root$2"; shift 2; done
shift
exec chroot "$root" "$@"
"""


def entered(root: str, binds: list[str], argv: list[str]) -> list[str]:
    """The command line running ``argv`` chrooted in ``root`` with ``binds`` (source, target pairs)."""
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        _ENTER,
        "sh",
        root,
        *binds,
        "--",
        *argv,
    ]


def glibc_versions(path: str) -> set[tuple[int, ...]]:
    """The GLIBC_x.y symbol versions an ELF file needs (readelf's version-needs section)."""
    out = subprocess.run(["readelf", "-VW", path], capture_output=True, text=True, check=False).stdout
    return {tuple(int(p) for p in v.split(".")) for v in re.findall(r"\bGLIBC_(\d+(?:\.\d+)+)\b", out)}


def is_elf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


@dataclass
class OldHost:
    """The old root with the shim installed, and how to run it there for one test."""

    root: str
    socket_dir: str  # the server's socket directory in this machine's view
    tmp: str

    def run(self, env: dict[str, str], stdin: bytes, netns: str | None = None) -> ShimOutcome:
        """Run /opt/cni/bin/rdma-cni inside the root; ``netns`` (a host path) appears under ROOT_PODS."""
        binds = [self.socket_dir, ROOT_SOCKET_DIR]
        if netns:
            inside = os.path.join(ROOT_PODS, os.path.basename(netns))
            open(self.root + inside, "a").close()  # a mount point
            binds += [netns, inside]
            env = {**env, "CNI_NETNS": inside}
        proc = subprocess.run(
            entered(self.root, binds, ["/opt/cni/bin/rdma-cni"]),
            input=stdin,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **env},
            capture_output=True,
            timeout=120,
            check=False,
        )
        return ShimOutcome(proc.returncode, proc.stdout.decode(), proc.stderr.decode())


@pytest.fixture
def old_host(old_root: str, binary: str, tmp_path: Any) -> Iterator[OldHost]:
    # Installed as the DaemonSet's installer installs it, into the root's /opt/cni/bin.
    install_shim(binary, f"{old_root}/opt/cni/bin", str(tmp_path))
    for d in (ROOT_SOCKET_DIR, ROOT_PODS):
        os.makedirs(old_root + d, exist_ok=True)
    socket_dir = tmp_path / "agent"
    socket_dir.mkdir(mode=0o700)
    host = OldHost(old_root, str(socket_dir), str(tmp_path))
    yield host
    for name in os.listdir(old_root + ROOT_PODS):
        if name.startswith(f"rcni{os.getpid()}x"):
            os.unlink(os.path.join(old_root + ROOT_PODS, name))


@pytest.fixture
def server(old_host: OldHost, cluster: Cluster) -> Iterator[ServerProcess]:
    s = ServerProcess(os.path.join(old_host.socket_dir, "cni.sock"), cluster)
    yield s
    s.stop()


def cni_env(cluster: Cluster, verb: str, pod: dict[str, str] | None = None) -> dict[str, str]:
    return {k: v for k, v in cluster.env(verb, pod).items() if k.startswith("CNI_")}


# What the host side loads.


def test_the_root_is_older_than_the_build_machine(old_root: str) -> None:
    libc = "/lib/x86_64-linux-gnu/libc.so.6"  # executable: it prints its release
    out = subprocess.run(["chroot", old_root, libc], capture_output=True, text=True, check=False).stdout
    assert "release version 2.31" in out


def test_the_installed_shim_is_static(old_host: OldHost) -> None:
    shim = os.path.join(old_host.root, "opt", "cni", "bin", "rdma-cni")
    headers = subprocess.run(["readelf", "-lW", shim], capture_output=True, text=True, check=True).stdout
    dynamic = subprocess.run(["readelf", "-dW", shim], capture_output=True, text=True, check=True).stdout
    assert "INTERP" not in headers  # no dynamic loader: the host's libc is never loaded
    assert "NEEDED" not in dynamic and "There is no dynamic section" in dynamic
    assert all(v <= FLOOR for v in glibc_versions(shim))


def test_the_fat_bundles_floor_is_the_one_stated(binary: str) -> None:
    tree = os.path.join(os.path.dirname(binary), "rdma-cni-dir")
    needed: set[tuple[int, ...]] = set()
    for base, _dirs, files in os.walk(tree):
        for name in files:
            path = os.path.join(base, name)
            if not os.path.islink(path) and is_elf(path):
                needed |= glibc_versions(path)
    floor = ".".join(map(str, max(needed)))
    with open(os.path.join(REPO, "docs", "deploy.md")) as f:
        deploy = f.read()
    stated = re.search(r"the fat binary built here needs glibc (\d+\.\d+)", deploy)
    assert stated is not None, "docs/deploy.md states no floor for the fat binary"
    assert stated.group(1) == floor, f"the bundle needs GLIBC_{floor}, docs/deploy.md says {stated.group(1)}"


def test_the_fat_binary_would_not_start_there(old_host: OldHost, binary: str) -> None:
    # Why the host side is a shim: the fat binary in the same root (its launcher is static and
    # unpacks; the unpacked Python is not).
    work = os.path.join(old_host.root, "tmp", f"fat-{os.getpid()}")
    os.makedirs(work + "/cache", mode=0o700)
    shutil.copy(binary, work + "/rdma-cni")
    inside = work[len(old_host.root) :]
    try:
        proc = subprocess.run(
            entered(old_host.root, ["/proc", "/proc"], [f"{inside}/rdma-cni"]),
            env={
                "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                "CNI_COMMAND": "VERSION",
                "RDMA_CNI_CACHE_DIR": f"{inside}/cache",
            },
            input=b"",
            capture_output=True,
            timeout=120,
            check=False,
        )
    finally:
        shutil.rmtree(work)
    assert proc.returncode != 0
    assert re.search(r"GLIBC_2\.3[2-9]' not found", proc.stderr.decode()), proc.stderr.decode()


# Verbs from inside the root.


def test_version_with_and_without_the_agent(old_host: OldHost, cluster: Cluster) -> None:
    down = old_host.run(cni_env(cluster, "VERSION"), b"")
    assert down.code == 0, down
    server = ServerProcess(os.path.join(old_host.socket_dir, "cni.sock"), cluster)
    try:
        up = old_host.run(cni_env(cluster, "VERSION"), json.dumps(cluster.conf()).encode())
    finally:
        server.stop()
    assert up.code == 0, up
    assert down.doc is not None and up.doc is not None
    assert down.doc["supportedVersions"] == up.doc["supportedVersions"]


def test_a_configuration_error(old_host: OldHost, server: ServerProcess, cluster: Cluster) -> None:
    pod = cluster.pod()
    conf = cluster.conf(lockTimeoutSeconds="soon")
    out = old_host.run(cni_env(cluster, "ADD", pod), json.dumps(conf).encode(), netns=pod["CNI_NETNS"])
    direct = cluster.run("ADD", pod, conf)  # the plugin itself, on this machine
    assert out.code == direct.code == 1
    assert out.doc == direct.doc
    assert out.doc is not None and "lockTimeoutSeconds" in json.dumps(out.doc)
    assert cluster.records == []


def test_add_check_del(old_host: OldHost, server: ServerProcess, cluster: Cluster) -> None:
    pod = cluster.pod([{"max_tx_rate": 1000}, {}])
    conf = cluster.conf()
    netns = os.path.basename(pod["CNI_NETNS"])
    add = old_host.run(cni_env(cluster, "ADD", pod), json.dumps(conf).encode(), netns=pod["CNI_NETNS"])
    assert add.code == 0, add
    assert add.doc is not None
    inside = os.path.join(ROOT_PODS, netns)
    # The runtime's path (which only the root has) in the result: the server went by the fd.
    assert {i.get("sandbox") for i in add.doc["interfaces"]} == {inside}
    assert len(cluster.records) == 1
    links = ip("-n", netns, "-br", "link").stdout
    assert "net1@" in links and "net1-1@" in links
    check_conf = json.dumps(cluster.check_conf(conf, add.doc)).encode()
    check = old_host.run(cni_env(cluster, "CHECK", pod), check_conf, netns=pod["CNI_NETNS"])
    assert check.code == 0, check
    dele = old_host.run(cni_env(cluster, "DEL", pod), json.dumps(conf).encode(), netns=pod["CNI_NETNS"])
    assert dele.code == 0, dele
    assert cluster.records == []
    assert "net1" not in ip("-n", netns, "-br", "link").stdout
