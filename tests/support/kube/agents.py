"""Node agents as conf/base/node/daemonset.yaml runs them, one per simulated node, against the API server.

Each agent is ``rdma-cni`` with the args of the DaemonSet's container, on a
simulated node of its own (tests/support/simnode.py), authenticated by a token
bound to a pod on its Node (the DaemonSet's projected token, so the admission
policy applies to every write). What a pod provides and a test run cannot is
replaced: host paths become the run's folders (the CNI bin and conf dirs, the
plugin's state directory and lock, the service-account mount, the shim and
the CNI server's socket), the metrics
listener a free loopback port, NRI off (no runtime here), and a short
heartbeat so that rewrites are seen within the test's patience.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

from tests.support.kube.controlplane import ControlPlane
from tests.support.kube.objects import create, create_node, pod_doc
from tests.support.kube.process import Component, start_component
from tests.support.kube.rdmascheduler import container, find, manifest, plugin_command
from tests.support.simnode import SimNode, SimPf

NAMESPACE, ACCOUNT = "kube-system", "rdma-cni"
# DaemonSet args that name host paths or listeners: replaced below.
_REPLACED = (
    "--ready-file",
    "--live-file",
    "--metrics-listen",
    "--nri-socket",
    "--cni-socket",
    "--shim-source",
)


@dataclass
class Agent:
    """One simulated node, its Node, and the agent process publishing it."""

    node: SimNode
    name: str
    process: Component
    directory: str


def daemonset_args() -> list[str]:
    """The install container's command after the executable, as conf/base/node/daemonset.yaml has it."""
    ds = find(manifest("base/node/daemonset.yaml"), "DaemonSet", "rdma-cni")
    c = container(ds, "install")
    command = list(c.get("command", [])) + list(c.get("args", []))
    assert command[0].endswith("/rdma-cni") and command[1] == "install", command
    return command[2:]


def _network_config(directory: str, name: str = "rdma-net", **fields: object) -> str:
    """Write network ``name``'s conflist (the node's stateDir, lockFile and IPAM, then ``fields``)."""
    path = os.path.join(directory, f"{name}.conflist")
    subnet = 78 if name == "rdma-net" else 79 + sum(map(ord, name)) % 100
    doc = {
        "cniVersion": "1.1.0",
        "name": name,
        "plugins": [
            {
                "type": "rdma-cni",
                "stateDir": os.path.join(directory, "state"),
                "lockFile": os.path.join(directory, "lock"),
                "ipam": {"type": "host-local", "ranges": [[{"subnet": f"10.{subnet}.0.0/24"}]]},
                **fields,
            }
        ],
    }
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def start_agent(
    cp: ControlPlane,
    directory: str,
    name: str,
    pfs: list[SimPf],
    prefix: str,
    heartbeat: float,
    networks: dict[str, dict[str, object]] | None = None,
) -> Agent:
    """Create the Node, a DaemonSet pod on it and its bound token; start the simulated node and agent.

    ``networks``: the node's networks (name -> fields of its rdma-cni entry, e.g. ``pfs`` and
    ``dra``) instead of the one network rdma-net on every PF.
    """
    node = prepare_node(cp, directory, name, pfs, prefix, networks)
    try:
        process = launch_agent(cp, node, f"rdma-cni-{name}", heartbeat)
    except BaseException:
        node.node.down()
        cp.kubectl("delete", "node", name, "--wait=false", check=False)
        raise
    return Agent(node.node, name, process, directory)


@dataclass
class NodeHost:
    """A simulated node and its Node: the host paths every agent pod on it shares."""

    node: SimNode
    name: str
    directory: str
    networks: tuple[str, ...] = ("rdma-net",)

    @property
    def kubelet_dir(self) -> str:
        """Where the agent's DRA plugin registers and serves, as kubelet's /var/lib/kubelet (a short path:
        a unix socket's path holds at most 107 bytes)."""
        return f"/tmp/rk-{os.getpid()}-{self.name[-24:]}"

    @property
    def registry_dir(self) -> str:
        """kubelet's plugin registry (``--kubelet-registry-dir``)."""
        return os.path.join(self.kubelet_dir, "plugins_registry")

    @property
    def plugin_dir(self) -> str:
        """The DRA plugin's own directory (``--kubelet-plugin-dir``)."""
        return os.path.join(self.kubelet_dir, "plugins", "rdma-cni.io")

    def network_file(self, name: str) -> str:
        """Network ``name``'s configuration."""
        return os.path.join(self.directory, f"{name}.conflist")

    @property
    def socket(self) -> str:
        """The CNI server's socket (the shim's)."""
        return os.path.join(self.directory, "agent", "cni.sock")

    @property
    def kubeconfig(self) -> str:
        """The kubeconfig the agents write for the plugin."""
        return os.path.join(self.directory, "net.d", "rdma-cni.kubeconfig")

    @property
    def network_config(self) -> str:
        """The network configuration the agents are given (the plugin's stateDir, lockFile, IPAM)."""
        return os.path.join(self.directory, "rdma-net.conflist")

    def pod_dir(self, pod: str) -> str:
        """What is the agent pod's own (its service-account mount, its /tmp with the ready file)."""
        return os.path.join(self.directory, "pods", pod)


def prepare_node(
    cp: ControlPlane,
    directory: str,
    name: str,
    pfs: list[SimPf],
    prefix: str,
    networks: dict[str, dict[str, object]] | None = None,
) -> NodeHost:
    """Create the Node and bring the simulated node up; no agent yet."""
    os.makedirs(directory, exist_ok=True)
    create_node(cp, name)
    # The CNI server's socket directory must be the agent's own, 0700.
    os.makedirs(os.path.join(directory, "agent"), mode=0o700, exist_ok=True)
    networks = networks if networks is not None else {"rdma-net": {}}
    for network, fields in networks.items():
        _network_config(directory, network, **fields)
    node = SimNode(os.path.join(directory, "node"), pfs, prefix=prefix)
    node.up()
    return NodeHost(node, name, directory, tuple(networks))


def agent_pod(cp: ControlPlane, host: NodeHost, pod: str) -> str:
    """Create a DaemonSet pod object on the node and its service-account mount (a token bound to it)."""
    assert cp.pki is not None
    create(cp, pod_doc(NAMESPACE, pod, node=host.name, account=ACCOUNT))
    token = cp.token(
        NAMESPACE, ACCOUNT, "--bound-object-kind=Pod", f"--bound-object-name={pod}", "--duration=2h"
    )
    sa_dir = os.path.join(host.pod_dir(pod), "serviceaccount")
    os.makedirs(sa_dir, exist_ok=True)
    with open(cp.pki.ca) as f:
        ca = f.read()
    for file, text in (("token", token), ("namespace", NAMESPACE), ("ca.crt", ca)):
        with open(os.path.join(sa_dir, file), "w") as f:
            f.write(text)
    return token


def launch_agent(
    cp: ControlPlane, host: NodeHost, pod: str, heartbeat: float, *, metrics_port: int | None = None
) -> Component:
    """Create agent pod ``pod`` on the node and start its agent; returns once it is Ready (its ready file).

    With ``metrics_port``, ``--metrics-listen`` is kept: loopback, that port (shared by the node's agents).
    """
    agent_pod(cp, host, pod)
    directory = host.directory
    ready = os.path.join(host.pod_dir(pod), "ready")
    args = [a for a in daemonset_args() if not a.startswith(_REPLACED)]
    source = os.path.join(directory, "rdma-cni-source")
    with open(source, "w") as f:
        f.write("#!/bin/sh\n")
    argv = [
        *plugin_command(),
        "install",
        *args,
        f"--source={source}",
        # --mode=shim: the shim file installed and the CNI server's socket.
        f"--shim-source={source}",
        f"--cni-socket={host.socket}",
        f"--cni-bin-dir={os.path.join(directory, 'bin')}",
        f"--cni-conf-dir={os.path.join(directory, 'net.d')}",
        f"--kubeconfig-path={host.kubeconfig}",
        f"--serviceaccount-dir={os.path.join(host.pod_dir(pod), 'serviceaccount')}",
        *(f"--network-config={host.network_file(n)}" for n in host.networks),
        f"--kubelet-registry-dir={host.registry_dir}",
        f"--kubelet-plugin-dir={host.plugin_dir}",
        f"--ready-file={ready}",
        f"--live-file={os.path.join(host.pod_dir(pod), 'live')}",
        "--nri-socket=",
        "--interval=1",
        "--node-state-period=1",
        f"--node-state-heartbeat={heartbeat}",
    ]
    if metrics_port is not None:
        argv.append(f"--metrics-listen=127.0.0.1:{metrics_port}")
    env = dict(os.environ)
    env.update(host.node.env())
    env.update(
        NODE_NAME=host.name, KUBERNETES_SERVICE_HOST="127.0.0.1", KUBERNETES_SERVICE_PORT=str(cp.api_port)
    )
    return start_component(f"agent-{pod}", argv, cp.path("logs"), lambda: os.path.exists(ready), env=env)


def stop_agent(cp: ControlPlane, agent: Agent) -> None:
    """Stop the agent, take its simulated node down and delete its Node (no later test sees it)."""
    agent.process.stop()
    agent.node.down()
    shutil.rmtree(NodeHost(agent.node, agent.name, agent.directory).kubelet_dir, ignore_errors=True)
    cp.kubectl("delete", "node", agent.name, "--wait=false", check=False)
