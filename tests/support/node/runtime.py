"""containerd 2.x and kubelet as the node tier runs them, inside the node's mount namespace.

Both run with their defaults wherever the node's namespace makes the default the run's own
(``/var/lib/containerd``, ``/run/containerd``, ``/var/lib/kubelet``, ``/etc/cni/net.d``,
``/opt/cni/bin``, ``/var/run/nri``; tests/support/node/host.py); what is set, and why:

containerd (config version 3): its runc shim by path (the build cache is not on ``PATH``),
``restrict_oom_score_adj`` (runc fails "can't get final child's PID from pipe" on this machine
kind otherwise, as for the runtime tier). NRI is left as 2.x ships it: on.

kubelet (:func:`kubelet_config`): ``failCgroupV1: false`` (KEP-5573: since 1.35 kubelet refuses
a cgroup v1 host unless told, and this machine's kernel mounts v1), ``cgroupDriver: cgroupfs``
(no systemd here), a ``cgroupRoot`` of the run's own, every listener on the node's loopback
address, eviction and image GC thresholds that a shared disk cannot trip, swap allowed (and
given to no pod) only on a host that has it, and the node named after its address
(tests/support/node/host.py, :class:`~tests.support.node.host.Addresses`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from typing import Any

import yaml

from tests.support.kube.controlplane import Binary, ControlPlane, write_kubeconfig
from tests.support.kube.process import Component, start_component

SOCKET = "/run/containerd/containerd.sock"  # kubelet's and crictl's default endpoint
ENDPOINT = f"unix://{SOCKET}"
NRI_SOCKET = "/var/run/nri/nri.sock"

CONTAINERD_CONFIG = """version = 3
# Defaults everywhere else: the node's namespace makes them the run's own.

[plugins.'io.containerd.cri.v1.runtime']
  # runc fails "can't get final child's PID from pipe" on this machine kind otherwise.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = 'io.containerd.runc.v2'
    # The shim built with this containerd (Debian's containerd 1.6 has one on PATH).
    runtime_path = '{shim}'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      SystemdCgroup = false
"""


class Containerd:
    """containerd 2.x on the node's default paths, with its own config file and log."""

    def __init__(self, directory: str, bins: dict[str, Binary]) -> None:
        self.bins = bins
        self.config = os.path.join(directory, "containerd.toml")
        with open(self.config, "w") as f:
            f.write(CONTAINERD_CONFIG.format(shim=bins["containerd-shim-runc-v2"].path))
        self.component: Component | None = None
        self.log_dir = os.path.join(directory, "logs")

    @property
    def version(self) -> str:
        return self.bins["containerd"].version

    def start(self) -> None:
        """Start it (again) and wait until its CRI answers."""
        if self.component is None:
            self.component = start_component(
                "containerd",
                [self.bins["containerd"].path, "--config", self.config, "--log-level", "info"],
                self.log_dir,
                self.ready,
                timeout=60,
            )
        else:
            self.component.start()
            self.component.wait_ready(self.ready, 60)

    def ready(self) -> bool:
        """True when the CRI plugin answers (crictl info)."""
        return self.crictl("info", check=False).returncode == 0

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop containerd alone: its shims run on, and so do the pods (as on a real node)."""
        if self.component is not None:
            self.component.stop(sig)

    def ctr(self, *args: str, timeout: float = 300) -> str:
        """``ctr -n k8s.io`` against this containerd (the ctr of the same build)."""
        proc = subprocess.run(
            [self.bins["ctr"].path, "--address", SOCKET, "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, f"ctr {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def crictl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """crictl against this containerd."""
        proc = subprocess.run(
            [self.bins["crictl"].path, "--runtime-endpoint", ENDPOINT, "--image-endpoint", ENDPOINT, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert proc.returncode == 0, f"crictl {' '.join(args)}: {proc.stderr}"
        return proc

    def crictl_json(self, command: str, *args: str) -> Any:
        """crictl's JSON output of ``command``, decoded (its options before the arguments: crictl
        stops reading options at the first argument)."""
        return json.loads(self.crictl(command, "-o", "json", *args).stdout)

    def import_image(self, archive: str) -> None:
        """``ctr images import`` into the k8s.io namespace (where the CRI looks)."""
        self.ctr("images", "import", "--no-unpack=false", archive)


def swap_on() -> bool:
    """True when the machine has swap in use (/proc/swaps lists a device or file)."""
    with open("/proc/swaps") as f:
        return len(f.read().strip().splitlines()) > 1


def kubelet_config(node_ip: str, cgroup_root: str, ca: str) -> dict[str, Any]:
    """The KubeletConfiguration of the tier's node (see the module's docstring for each setting)."""
    swap: dict[str, Any] = {}
    if swap_on():
        # kubelet refuses a host with swap unless told; pods get none of it (NoSwap).
        swap = {"failSwapOn": False, "memorySwap": {"swapBehavior": "NoSwap"}}
    return {
        **swap,
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # KEP-5573: kubelet >= 1.35 refuses cgroup v1 unless this is false (it then warns).
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{cgroup_root}",
        "containerRuntimeEndpoint": ENDPOINT,
        "address": node_ip,
        "healthzBindAddress": node_ip,
        "readOnlyPort": 0,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": ca},
        },
        "authorization": {"mode": "Webhook"},
        # The disk is shared with other work: only a nearly full one may evict or collect.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # The images are imported, never pulled: one missing is an error at once.
        "serializeImagePulls": False,
        # Pod status reaches the API sooner (the tier waits on it).
        "nodeStatusUpdateFrequency": "10s",
        "staticPodPath": "",
    }


class Kubelet:
    """kubelet registered with the tier's kube-apiserver as the node named after its address."""

    def __init__(
        self, directory: str, binary: Binary, cp: ControlPlane, node_ip: str, cgroup_root: str
    ) -> None:
        assert cp.pki is not None
        self.binary = binary
        self.node_ip = node_ip
        self.name = node_ip
        cert = cp.pki.client("kubelet", f"/CN=system:node:{self.name}/O=system:nodes")
        self.kubeconfig = write_kubeconfig(
            os.path.join(directory, "kubelet.kubeconfig"), cp.server, cp.pki.ca, client=cert
        )
        self.config = os.path.join(directory, "kubelet.yaml")
        with open(self.config, "w") as f:
            yaml.safe_dump(kubelet_config(node_ip, cgroup_root, cp.pki.ca), f)
        self.log_dir = os.path.join(directory, "logs")
        self.component: Component | None = None

    @property
    def argv(self) -> list[str]:
        return [
            self.binary.path,
            f"--config={self.config}",
            f"--kubeconfig={self.kubeconfig}",
            # The node's name and InternalIP (an IP given here is taken as the address unchecked).
            f"--hostname-override={self.name}",
            "--v=2",
        ]

    def healthy(self) -> bool:
        """True when kubelet's /healthz answers ok (on the node's address, port 10248)."""
        with urllib.request.urlopen(f"http://{self.node_ip}:10248/healthz", timeout=5) as resp:
            return bool(resp.read() == b"ok")

    def start(self) -> None:
        """Start it (again) and wait until it is healthy."""
        if self.component is None:
            self.component = start_component("kubelet", self.argv, self.log_dir, self.healthy, timeout=120)
        else:
            self.component.start()
            self.component.wait_ready(self.healthy, 120)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop kubelet (pods keep running under containerd)."""
        if self.component is not None:
            self.component.stop(sig)
