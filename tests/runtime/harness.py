"""The runtime tier's plumbing: the plugin installed into a runtime's CNI bin dir, its call log,
containerd on its own directories, podman pointed at the tier's CNI dirs, and clean-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.cniserver import install_shim
from tests.support.processes import pids_mentioning, wait_gone

HOST_LOCAL_DIR = "/usr/lib/cni"
IMAGE = "docker.io/library/rdma-cni-busybox:tier"
PODMAN_IMAGE = "localhost/rdma-cni-busybox:tier"

WRAPPER = """#!/bin/sh
# rdma-cni as the runtime tier installs it: records what the runtime passed (and the stderr it got
# back), then runs what the mode installs: the fat plugin on the simulated node, or the shim.
n=$$
cat > "{log_dir}/stdin.$n"
printf '%s\\t%s\\t%s\\t%s\\t%s\\t%s\\t%s\\t%s\\t%s\\n' "$n" "$CNI_COMMAND" "$CNI_CONTAINERID" "$CNI_NETNS" \\
    "$CNI_IFNAME" "$CNI_ARGS" "$CNI_PATH" "$PPID" "$RDMA_CNI_NETNS_VIA" >> "{log_dir}/calls.tsv"
{node_env} "{binary}" < "{log_dir}/stdin.$n" 2> "{log_dir}/stderr.$n"
rc=$?
cat "{log_dir}/stderr.$n" >&2
printf '%s\\t%s\\n' "$n" "$rc" >> "{log_dir}/exits.tsv"
exit $rc
"""

# How the plugin reaches the runtime's CNI bin dir (docs/deploy.md, host operating systems).
SHIM = "shim"  # as shipped: the installer's static shim, handing each verb to the CNI server
FAT = "fat"  # --mode fat: the whole plugin, run by the runtime itself


@dataclass
class Call:
    """One call of the runtime's (the fat plugin, or the shim), as the wrapper logged it."""

    pid: str
    command: str
    container_id: str
    netns: str
    ifname: str
    args: str
    path: str
    parent: int  # who ran it: the runtime
    netns_via: str  # RDMA_CNI_NETNS_VIA: nothing on the runtime's side sets it
    exit_code: int | None
    stdin: dict[str, Any] | None
    stderr: str = ""  # what the runtime read on stderr (the shim says when it spooled a DEL)

    @property
    def cni_args(self) -> dict[str, str]:
        return dict(kv.split("=", 1) for kv in self.args.split(";") if kv)

    @property
    def spooled(self) -> bool:
        """The shim answered it by spooling it (a DEL with no agent serving)."""
        return "DEL spooled" in self.stderr


@dataclass(frozen=True)
class Served:
    """One verb the CNI server ran, as its log says (``rdma_cni.agent.cniserver``)."""

    command: str
    container_id: str
    ifname: str
    how: str  # "its namespace passed as an fd", "no namespace passed" or "spooled"
    exit_code: int


SERVED = re.compile(r"served (\S+) (\S+)/(\S+) \(([^)]*)\): exit (-?\d+) in ")


def served(server_log: str) -> list[Served]:
    """The verbs a CNI server's log says it ran, in order."""
    return [
        Served(m.group(1), m.group(2), m.group(3), m.group(4), int(m.group(5)))
        for m in SERVED.finditer(server_log)
    ]


class PluginInstall:
    """The plugin in ``bin_dir`` as ``mode`` puts it there, with host-local and loopback.

    ``fat``: dist/rdma-cni behind the logging wrapper, which adds the simulated
    node's environment. ``shim``: what ``rdma-cni install --once --mode shim``
    writes (the static shim, moved aside to :attr:`shim`) behind the same wrapper; the
    CNI server's ``--plugin`` (:attr:`plugin`) is a copy of dist/rdma-cni, the agent's
    own, whose workers run the verbs, the node's environment the server's.
    """

    def __init__(self, root: str, binary: str, node_env: dict[str, str], mode: str) -> None:
        self.mode = mode
        self.bin_dir = os.path.join(root, "bin")
        self.log_dir = os.path.join(root, "calls")
        os.makedirs(self.bin_dir)
        os.makedirs(self.log_dir)
        for plugin in ("host-local", "loopback"):
            shutil.copy2(os.path.join(HOST_LOCAL_DIR, plugin), os.path.join(self.bin_dir, plugin))
        wrapper = os.path.join(self.bin_dir, "rdma-cni")
        if mode == SHIM:
            agent = os.path.join(root, "agent-bin")  # the agent's own userspace, not the runtime's
            os.makedirs(agent)
            self.plugin = os.path.join(agent, "rdma-cni")
            shutil.copy2(binary, self.plugin)
            self.install_output = install_shim(binary, self.bin_dir, os.path.join(root, "install"))
            self.shim = os.path.join(self.bin_dir, ".rdma-cni-shim")
            os.rename(wrapper, self.shim)
            real, env = self.shim, ""
        else:
            real = os.path.join(self.bin_dir, "rdma-cni.bin")
            self.plugin = wrapper
            self.install_output = ""
            shutil.copy2(binary, real)
            env = " ".join(f"{k}='{v}'" for k, v in sorted(node_env.items()))
        with open(wrapper, "w") as f:
            f.write(WRAPPER.format(log_dir=self.log_dir, node_env=env, binary=real))
        os.chmod(wrapper, 0o755)

    def calls(self) -> list[Call]:
        """Every run so far, in order."""
        path = os.path.join(self.log_dir, "calls.tsv")
        exits: dict[str, int] = {}
        with contextlib.suppress(FileNotFoundError), open(os.path.join(self.log_dir, "exits.tsv")) as f:
            for line in f:
                pid, rc = line.rstrip("\n").split("\t")
                exits[pid] = int(rc)
        out = []
        with contextlib.suppress(FileNotFoundError), open(path) as f:
            for line in f:
                pid, command, cid, netns, ifname, args, cni_path, ppid, via = line.rstrip("\n").split("\t")
                try:
                    with open(os.path.join(self.log_dir, f"stdin.{pid}")) as s:
                        stdin = json.load(s)
                except (OSError, ValueError):
                    stdin = None
                try:
                    with open(os.path.join(self.log_dir, f"stderr.{pid}")) as s:
                        stderr = s.read()
                except OSError:
                    stderr = ""
                out.append(
                    Call(
                        pid,
                        command,
                        cid,
                        netns,
                        ifname,
                        args,
                        cni_path,
                        int(ppid),
                        via,
                        exits.get(pid),
                        stdin,
                        stderr,
                    )
                )
        return out


def netns_addresses(netns: str) -> dict[str, list[str]]:
    """IPv4 addresses per interface inside the netns at path ``netns``, from the kernel."""
    out = subprocess.run(
        ["nsenter", f"--net={netns}", "ip", "-j", "addr"], capture_output=True, text=True, check=True
    ).stdout
    return {
        link["ifname"]: [
            f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", []) if a["family"] == "inet"
        ]
        for link in json.loads(out)
    }


def listed_addresses(ip_o_addr: str) -> dict[str, list[str]]:
    """``ip -o -4 addr`` output (busybox's, inside a container) as {interface: [cidr]}."""
    out: dict[str, list[str]] = {}
    for line in ip_o_addr.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "inet":
            out.setdefault(fields[1], []).append(fields[3])
    return out


def mounts_under(root: str) -> list[str]:
    """Mount points at or under ``root``, deepest first."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == root or point.startswith(root.rstrip("/") + "/"):
                points.append(point)
    return sorted(points, key=len, reverse=True)


def stop_processes_mentioning(text: str) -> None:
    """SIGKILL processes whose command line holds ``text`` (this tier's own paths only)."""
    pids = [p for p in pids_mentioning(text) if p != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_gone(pids, timeout=10)


def unmount_all(root: str) -> None:
    for point in mounts_under(root):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


CONTAINERD_CONFIG = """version = 2
root = "{root}/root"
state = "{root}/state"
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "{root}/c.sock"

[ttrpc]
  address = "{root}/c.sock.ttrpc"

[debug]
  level = "info"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{image}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # runc fails "can't get final child's PID from pipe" on this machine kind otherwise.
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bin_dir}"
    conf_dir = "{conf_dir}"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
"""


class Containerd:
    """containerd from Debian on its own config, socket and state directories."""

    def __init__(
        self, root: str, bin_dir: str, conflist: dict[str, Any], env: dict[str, str] | None = None
    ) -> None:
        self.root = root
        self.env = {**os.environ, **(env or {})}  # its plugins inherit it (libcni)
        self.socket = os.path.join(root, "c.sock")
        self.conf_dir = os.path.join(root, "net.d")
        os.makedirs(self.conf_dir)
        with open(os.path.join(self.conf_dir, "10-rdma.conflist"), "w") as f:
            json.dump(conflist, f)
        self.config = os.path.join(root, "config.toml")
        with open(self.config, "w") as f:
            f.write(CONTAINERD_CONFIG.format(root=root, image=IMAGE, bin_dir=bin_dir, conf_dir=self.conf_dir))
        self.log_path = os.path.join(root, "containerd.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                ["containerd", "--config", self.config],
                stdout=log,
                stderr=log,
                env=self.env,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket):
            assert self.proc.poll() is None, f"containerd exited: {self.log_tail()}"
            assert time.monotonic() < deadline, f"containerd did not listen in 30 s: {self.log_tail()}"
            time.sleep(0.05)

    def ctr(self, *args: str) -> str:
        proc = subprocess.run(
            ["ctr", "--address", self.socket, "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, f"ctr {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def stop(self) -> None:
        """Stop containerd, then its shims and whatever they left mounted (this instance's only)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Shims run with -address <our socket>; their containers (busybox) die with them.
        stop_processes_mentioning(self.socket)
        unmount_all(self.root)


class Podman:
    """podman with the CNI network backend, its storage and CNI directories the tier's own."""

    def __init__(
        self, root: str, bin_dir: str, conflist: dict[str, Any], env: dict[str, str] | None = None
    ) -> None:
        self.root = root
        # podman refuses a run root longer than 50 characters: a short one of our own.
        self.runroot = tempfile.mkdtemp(prefix="rcni-pm-", dir="/tmp")
        self.conf_dir = os.path.join(root, "net.d")
        os.makedirs(self.conf_dir)
        with open(os.path.join(self.conf_dir, f"{conflist['name']}.conflist"), "w") as f:
            json.dump(conflist, f)
        self.containers_conf = os.path.join(root, "containers.conf")
        with open(self.containers_conf, "w") as f:
            f.write(
                "[network]\n"
                'network_backend = "cni"\n'
                f'cni_plugin_dirs = ["{bin_dir}"]\n'
                f'network_config_dir = "{self.conf_dir}"\n'
                "[engine]\n"
                # Its plugins inherit podman's environment (libcni); this reaches the podman that
                # conmon starts to clean up after a container that stopped (its own environment is
                # podman's choice), as the process environment does not.
                f"env = {json.dumps([f'{k}={v}' for k, v in sorted((env or {}).items())])}\n"
                'cgroup_manager = "cgroupfs"\n'
                'events_logger = "file"\n'
                f'events_logfile_path = "{root}/events.log"\n'
                'runtime = "runc"\n'
                f'tmp_dir = "{root}/tmp"\n'
                f'static_dir = "{root}/libpod"\n'
                f'volume_path = "{root}/volumes"\n'
            )

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "CONTAINERS_CONF": self.containers_conf,
            "HOME": self.root,
        }
        proc = subprocess.run(
            [
                "podman",
                "--root",
                os.path.join(self.root, "storage"),
                "--runroot",
                self.runroot,
                "--storage-driver",
                "overlay",
                *args,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
        if check:
            assert proc.returncode == 0, f"podman {' '.join(args)} -> {proc.returncode}: {proc.stderr}"
        return proc

    def stop(self) -> None:
        """Remove every container of this instance, then its conmons and mounts."""
        self("rm", "-a", "-f", "-t", "0", check=False)
        for place in (self.root, self.runroot):
            stop_processes_mentioning(place)
            unmount_all(place)
        shutil.rmtree(self.runroot, ignore_errors=True)


def read_path(path: str | Path) -> str:
    with open(path) as f:
        return f.read()
