"""The node's own view of the machine: a mount namespace, a loopback address, cgroups and sysctls.

The node tier's pytest process moves into a mount namespace of its own before
anything else starts, and every process it starts (the control plane,
containerd, kubelet, and through them every container) inherits it. In it, the
directories a node's runtime, kubelet, Multus and rdma-cni write are bind
mounts of the run's folder (:data:`NODE_DIRS`): ``/run``, ``/var/lib``,
``/var/log``, ``/etc/cni`` and ``/opt``. So everything runs with its defaults as
on a real node (``/opt/cni/bin``, ``/etc/cni/net.d``, ``/var/lib/kubelet``,
``/run/rdma-cni``, ``/var/lib/cni/rdma-cni``, ``/var/run/nri``,
``/var/run/netns``, and the DaemonSets' hostPath volumes resolve here), and
none of it is the machine's: its own plugin state is never seen, let alone
touched (:func:`host_plugin_state` reads it through a descriptor of the machine's root
opened before, to prove it).

The namespace is made shared inside (after cutting it off from the machine's),
as on a systemd host: a pod's network namespace that containerd mounts under
``/run/netns`` reaches the containers that mount that directory with
``HostToContainer`` propagation (the agent, Multus).

The network namespace stays the machine's: the simulated node's VFs are veths
there, and the pods' namespaces are made by containerd. Every address the
node listens on is a loopback address of its own (:class:`Addresses`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from tests.support.cniserver import HOST_STATE_PATHS

# What a node's components write, made the run's own (the parents exist on any Debian host, so
# no mount point is ever created on the machine).
NODE_DIRS = ("/run", "/var/lib", "/var/log", "/etc/cni", "/opt")
# The machine's operating system state below those, seen read-only: the package database
# (``dpkg -L`` lists the libraries the images' base is made of).
MACHINE_READ_ONLY = ("/var/lib/dpkg",)
CLONE_NEWNS = 0x00020000
CGROUP_V1 = "/sys/fs/cgroup"
# What kubelet sets at start (its kernel defaults for a node, setupKernelTunables), restored after.
KUBELET_SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")


@dataclass(frozen=True)
class Addresses:
    """A loopback /24 of this run's: kube-apiserver, the service range, the node's own address.

    The service range holds kube-apiserver's address as its first IP, so the ``kubernetes``
    Service's ClusterIP (the range's first address, port 443) is where kube-apiserver listens:
    a pod's in-cluster configuration (``KUBERNETES_SERVICE_HOST``/``_PORT``, which kubelet
    sets from that Service) reaches it with no kube-proxy, and nothing is sent off loopback.
    The node is named after its address (kubelet's ``--hostname-override``, as upstream's
    local-up-cluster.sh runs it): kubelet then takes it as the node's InternalIP, so
    ``status.hostIP`` (the agent's metrics listener) is loopback too.
    """

    prefix: str  # "127.A.B"

    @classmethod
    def for_run(cls) -> Addresses:
        """A /24 of 127.0.0.0/8 chosen by the process id (parallel runs do not collide)."""
        pid = os.getpid()
        return cls(f"127.{1 + (pid // 250) % 250}.{pid % 250}")

    @property
    def apiserver(self) -> str:
        return f"{self.prefix}.1"

    @property
    def service_range(self) -> str:
        return f"{self.prefix}.0/25"

    @property
    def node(self) -> str:
        return f"{self.prefix}.200"


def enter_node_namespace(root: str) -> None:
    """Move this process into a new mount namespace where :data:`NODE_DIRS` are ``root``'s.

    Must run before the process starts a thread (unshare refuses a shared filesystem
    context): the tier's first fixture calls it.
    """
    assert threading.active_count() == 1, "enter the node's namespace before any thread starts"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
    # Cut every mount off the machine's first (nothing made here reaches it, nor the reverse),
    # then bind the node's directories (the machine's read-only parts inside them first, while
    # they are still in sight), then share them again among the node's own mounts.
    _mount("--make-rprivate", "/")
    for path in MACHINE_READ_ONLY:
        inside = os.path.join(root, path.lstrip("/"))
        os.makedirs(inside, exist_ok=True)
        _mount("--bind", path, inside)
        _mount("-o", "remount,bind,ro", inside)
    for path in NODE_DIRS:
        source = os.path.join(root, path.lstrip("/"))
        os.makedirs(source, exist_ok=True)
        _mount("--rbind", source, path)
    _mount("--make-rshared", "/")


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


def machine_root() -> int:
    """A descriptor of ``/`` as the calling process sees it, to be opened before
    :func:`enter_node_namespace`: paths looked up from it stay in the machine's mounts."""
    return os.open("/", os.O_PATH | os.O_DIRECTORY)


def host_plugin_state(root_fd: int) -> dict[str, tuple[int, int, int] | None]:
    """(inode, size, mtime) of the machine's own plugin state paths, looked up from ``root_fd``
    (:func:`machine_root`): the machine's, whichever mount namespace the reader is in."""
    out: dict[str, tuple[int, int, int] | None] = {}
    for path in HOST_STATE_PATHS:
        try:
            st = os.stat(path.lstrip("/"), dir_fd=root_fd)
        except FileNotFoundError:
            out[path] = None
        else:
            out[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def mount_namespace(pid: int | str = "self") -> str:
    """The mount namespace of ``pid`` (``mnt:[inode]``), '' when it is gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return ""


def processes_in_my_namespace() -> list[int]:
    """Processes other than this one in this process's mount namespace (what it started)."""
    mine = mount_namespace()
    return [
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and int(p) != os.getpid() and mount_namespace(p) == mine
    ]


def kill_and_wait(pids: list[int], timeout: float = 20) -> None:
    """SIGKILL ``pids`` and wait until they are gone."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes did not die: {pids}")
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1]
    except OSError:
        return "Z"


def cgroup_hierarchies() -> list[str]:
    """The mounted cgroup v1 hierarchies (directories under /sys/fs/cgroup), the unified one left out."""
    return sorted(
        os.path.join(CGROUP_V1, d)
        for d in os.listdir(CGROUP_V1)
        if d != "unified" and os.path.ismount(os.path.join(CGROUP_V1, d))
    )


def make_cgroup_root(name: str) -> None:
    """Create ``/<name>`` in every hierarchy: kubelet's ``cgroupRoot`` must exist before it starts.

    A cpuset cgroup takes no task until its cpus and mems are set: copied from the parent.
    """
    for hierarchy in cgroup_hierarchies():
        path = os.path.join(hierarchy, name)
        os.makedirs(path, exist_ok=True)
        if os.path.basename(hierarchy) == "cpuset":
            for knob in ("cpuset.cpus", "cpuset.mems"):
                with open(os.path.join(hierarchy, knob)) as src, open(os.path.join(path, knob), "w") as dst:
                    dst.write(src.read())


def cgroup_tasks(name: str) -> list[int]:
    """Every process in ``/<name>`` or below, in any hierarchy."""
    pids: set[int] = set()
    for hierarchy in cgroup_hierarchies():
        for dirpath, _, files in os.walk(os.path.join(hierarchy, name)):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError), open(os.path.join(dirpath, "cgroup.procs")) as f:
                    pids.update(int(line) for line in f if line.strip())
    return sorted(pids)


def remove_cgroup_root(name: str) -> list[str]:
    """Remove ``/<name>`` and everything below it (deepest first); returns what could not go."""
    left = []
    for hierarchy in cgroup_hierarchies():
        top = os.path.join(hierarchy, name)
        if not os.path.isdir(top):
            continue
        for dirpath, _, _ in sorted(os.walk(top), key=lambda entry: -entry[0].count("/")):
            try:
                os.rmdir(dirpath)
            except OSError as exc:
                left.append(f"{dirpath}: {exc.strerror}")
    return left


def read_sysctls() -> dict[str, str]:
    """The machine's values of :data:`KUBELET_SYSCTLS`."""
    out = {}
    for key in KUBELET_SYSCTLS:
        with open(f"/proc/sys/{key}") as f:
            out[key] = f.read().strip()
    return out


def restore_sysctls(saved: dict[str, str]) -> None:
    """Write back what :func:`read_sysctls` read."""
    for key, value in saved.items():
        with open(f"/proc/sys/{key}", "w") as f:
            f.write(value)


def unmount_below(path: str) -> None:
    """Unmount (lazily) every mount point below ``path`` in this namespace, deepest first."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted((p for p in points if p.startswith(path.rstrip("/") + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


def remove_tree(path: str) -> None:
    """Remove a run's folder, whatever containers left in it (mounts below it unmounted first)."""
    unmount_below(path)
    shutil.rmtree(path, ignore_errors=True)
