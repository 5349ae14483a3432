"""A rollout with surge on one node, as conf/'s DaemonSet ships it (``maxSurge: 1, maxUnavailable: 0``).

Two real agent processes on one simulated node, each with a token bound to its
own pod object by TokenRequest (the DaemonSet's projected token): the old one
runs, the new one starts beside it, and the old one is stopped (SIGTERM) and its
pod object deleted, which kills its token as kubelet's deletion would. All the
while ADDs and DELs go through the shim, and the node's kubeconfig is tried
against the real kube-apiserver. The new agent must never exit, become Ready
beside the old one, take over the metrics port and the CNI socket, and leave
no moment in which a verb or the kubeconfig's token fails. Then the other way:
a rollout undone while the surge pod ran leaves the old pod's token in the
kubeconfig within the documented time.

Needs root (the simulated node's veth VFs, the pods' network namespaces).
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from rdma_cni.install.handover import bound_pod, jwt_claims, kubeconfig_token
from tests.cluster.conftest import unique
from tests.support.kube.agents import NodeHost, launch_agent, prepare_node
from tests.support.kube.controlplane import ControlPlane
from tests.support.kube.objects import create, pod_doc
from tests.support.kube.process import Component, free_port
from tests.support.shim import build_shim, run_shim
from tests.support.simnode import SimPf, add_netns, del_netns
from tests.support.waiting import wait_for

if os.geteuid() != 0:
    pytest.skip("the simulated node and the pods' namespaces need root", allow_module_level=True)

HOST_LOCAL_DIR = "/usr/lib/cni"
HEARTBEAT = 30.0
# docs/deploy.md: the remaining pod rewrites a file bound to a gone pod at its next refresh (--interval;
# 1 s here). Generous: the machine is shared.
REFRESH_PATIENCE = 20.0


@dataclass
class Workload:
    """RDMA pods on the node whose ADD and DEL go through the shim, round after round, in a thread."""

    cp: ControlPlane
    host: NodeHost
    shim: str
    namespace: str
    pods: list[dict[str, str]] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    rounds: int = 0
    token_checks: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    status_thread: threading.Thread | None = None
    statuses: int = 0

    def make_pods(self, count: int) -> None:
        for k in range(count):
            name = f"rdma-{k}"
            doc = pod_doc(self.namespace, name, annotations={"rdma_interfaces_required": "[{}]"})
            create(self.cp, doc)
            uid = self.cp.get("pod", name, "-n", self.namespace)["metadata"]["uid"]
            ns = f"surge{os.getpid() % 100000}x{k}{uuid.uuid4().hex[:4]}"
            self.netns.append(ns)
            self.pods.append(
                {
                    "CNI_CONTAINERID": f"ctr{k:02d}{uuid.uuid4().hex[:12]}",
                    "CNI_NETNS": add_netns(ns),
                    "CNI_IFNAME": "net1",
                    "CNI_PATH": HOST_LOCAL_DIR,
                    "CNI_ARGS": f"IgnoreUnknown=true;K8S_POD_NAMESPACE={self.namespace};K8S_POD_NAME={name};"
                    f"K8S_POD_INFRA_CONTAINER_ID=x;K8S_POD_UID={uid}",
                }
            )

    def conf(self) -> bytes:
        with open(self.host.network_config) as f:
            conflist = json.load(f)
        entry = dict(conflist["plugins"][0])
        entry.update(
            cniVersion=conflist["cniVersion"],
            name=conflist["name"],
            kubeconfig=self.host.kubeconfig,
            lockTimeoutSeconds=60,
        )
        entry["ipam"] = {**entry["ipam"], "dataDir": os.path.join(self.host.directory, "ipam")}
        return json.dumps(entry).encode()

    def verb(self, verb: str, pod: dict[str, str]) -> None:
        out = run_shim(self.shim, self.host.socket, {**pod, "CNI_COMMAND": verb}, self.conf(), timeout=120)
        if out.code != 0:
            self.failures.append(f"{verb} {pod['CNI_CONTAINERID']} at {time.monotonic():.1f}: {out}")

    def check_token(self) -> None:
        """The node's kubeconfig, as the plugin reads it: its token must be one the API server accepts."""
        with open(self.host.kubeconfig, "rb") as f:
            token = kubeconfig_token(f.read())
        if token is None:
            self.failures.append("the kubeconfig holds no token")
            return
        ok = token_accepted(self.cp, token)
        self.token_checks += 1
        if not ok:
            claims = jwt_claims(token) or {}
            self.failures.append(f"the kubeconfig's token (pod {bound_pod(claims)}) was refused")

    def run(self) -> None:
        while not self.stop.is_set():
            for pod in self.pods:
                self.check_token()
                self.verb("ADD", pod)
                self.check_token()
                self.verb("DEL", pod)
            self.rounds += 1

    def status_all_along(self) -> None:
        """STATUS, back to back: each one a call the agent's server must take (the shim answers it
        itself, code 50, only when no server does), far denser than the ADD and DEL rounds."""
        while not self.stop.is_set():
            env = {"CNI_COMMAND": "STATUS", "CNI_PATH": HOST_LOCAL_DIR}
            out = run_shim(self.shim, self.host.socket, env, self.conf(), timeout=120)
            self.statuses += 1
            if out.code != 0:
                self.failures.append(f"STATUS at {time.monotonic():.1f}: {out}")

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        self.status_thread = threading.Thread(target=self.status_all_along, daemon=True)
        self.status_thread.start()

    def wait_rounds(self, more: int, timeout: float = 120) -> None:
        target = self.rounds + more
        wait_for(lambda: self.rounds >= target, timeout, f"{more} more rounds of ADD and DEL")

    def finish(self) -> None:
        self.stop.set()
        for thread in (self.thread, self.status_thread):
            if thread is not None:
                thread.join(300)
        for ns in self.netns:
            del_netns(ns)


def token_accepted(cp: ControlPlane, token: str) -> bool:
    """Whether kube-apiserver authenticates ``token`` (a 401 is the only "no")."""
    assert cp.pki is not None
    ctx = ssl.create_default_context(cafile=cp.pki.ca)
    req = urllib.request.Request(f"{cp.server}/api", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=30):
            return True
    except urllib.error.HTTPError as exc:
        return exc.code != 401


def kubeconfig_pod(host: NodeHost) -> str | None:
    """The name of the pod whose token the node's kubeconfig holds."""
    with open(host.kubeconfig, "rb") as f:
        token = kubeconfig_token(f.read())
    ref = bound_pod(jwt_claims(token) or {}) if token else None
    return ref[1] if ref else None


def listener_pid(port: int) -> int | None:
    """The pid of the process listening on 127.0.0.1:``port`` (from /proc/net/tcp and each process's fds)."""
    inode = None
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            local, state = cols[1], cols[3]
            if state == "0A" and local == f"0100007F:{port:04X}":
                inode = cols[9]
    if inode is None:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]" for fd in fds):
                return int(pid)
        except OSError:
            continue
    return None


def stop_like_kubelet(cp: ControlPlane, agent: Component, pod: str) -> float:
    """SIGTERM the agent, wait for its exit, then delete its pod object (its token dies); seconds it took."""
    assert agent.proc is not None
    began = time.monotonic()
    os.killpg(agent.proc.pid, signal.SIGTERM)
    agent.proc.wait(40)
    took = time.monotonic() - began
    cp.kubectl("delete", "pod", pod, "-n", "kube-system", "--grace-period=0", "--force", check=False)
    return took


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_shim(str(tmp_path_factory.mktemp("shim")))


@pytest.fixture
def node(applied: ControlPlane, tmp_path: Any) -> Iterator[NodeHost]:
    name = unique("surge")
    prefix = f"s{uuid.uuid4().hex[:5]}"
    host = prepare_node(applied, str(tmp_path / name), name, [SimPf("simpf0", 4, 25000)], prefix)
    yield host
    host.node.down()
    applied.kubectl("delete", "node", name, "--wait=false", check=False)


@pytest.fixture
def workload(applied: ControlPlane, node: NodeHost, shim: str) -> Iterator[Workload]:
    namespace = unique("surge-pods")
    applied.kubectl("create", "namespace", namespace)
    w = Workload(applied, node, shim, namespace)
    try:
        w.make_pods(2)
        yield w
    finally:
        w.finish()
        applied.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture
def agents() -> Iterator[list[Component]]:
    started: list[Component] = []
    yield started
    for agent in started:
        agent.stop()


def test_a_rollout_with_surge_leaves_no_window(
    applied: ControlPlane, node: NodeHost, workload: Workload, agents: list[Component]
) -> None:
    port = free_port()
    old_pod, new_pod = unique("rdma-cni-old"), unique("rdma-cni-new")
    old = launch_agent(applied, node, old_pod, HEARTBEAT, metrics_port=port)
    agents.append(old)
    assert old.proc is not None
    assert listener_pid(port) == old.proc.pid
    workload.start()
    workload.wait_rounds(2)

    # The new pod starts beside the old one: Ready, although the old one holds the port and the socket.
    new = launch_agent(applied, node, new_pod, HEARTBEAT, metrics_port=port)
    agents.append(new)
    assert new.proc is not None
    assert kubeconfig_pod(node) == new_pod  # written at once, while the old token still works
    workload.wait_rounds(2)
    assert new.alive() and old.alive()
    assert listener_pid(port) == old.proc.pid  # the old one still serves /metrics ...
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        page = resp.read().decode()
    assert 'rdma_cni_agent_serving{part="cni"} 1.0' in page

    # Kubelet deletes the old pod now that the new one is Ready.
    took = stop_like_kubelet(applied, old, old_pod)
    assert old.proc.returncode == 0, old.proc.returncode
    assert took < 30  # inside the DaemonSet's grace period
    new_pid = new.proc.pid
    wait_for(lambda: listener_pid(port) == new_pid, 30, "the new agent to take the metrics port over")
    workload.wait_rounds(3)
    assert new.alive()
    assert kubeconfig_pod(node) == new_pod
    workload.finish()
    assert workload.failures == [], workload.failures[:5]
    assert workload.token_checks > 0 and workload.rounds >= 7 and workload.statuses > workload.rounds


def test_a_rollout_undone_during_the_surge_keeps_a_valid_token(
    applied: ControlPlane, node: NodeHost, workload: Workload, agents: list[Component]
) -> None:
    port = free_port()
    old_pod, new_pod = unique("rdma-cni-old"), unique("rdma-cni-new")
    old = launch_agent(applied, node, old_pod, HEARTBEAT, metrics_port=port)
    agents.append(old)
    new = launch_agent(applied, node, new_pod, HEARTBEAT, metrics_port=port)
    agents.append(new)
    assert kubeconfig_pod(node) == new_pod
    # The rollout is undone: the surge pod goes (it never held the socket or the port) and its token dies.
    took = stop_like_kubelet(applied, new, new_pod)
    assert new.proc is not None and new.proc.returncode == 0
    assert took < 10
    began = time.monotonic()
    wait_for(lambda: kubeconfig_pod(node) == old_pod, REFRESH_PATIENCE, "the old pod to write its token")
    rewritten = time.monotonic() - began
    with open(node.kubeconfig, "rb") as f:
        token = kubeconfig_token(f.read())
    assert token is not None and token_accepted(applied, token)
    # The old agent served throughout: verbs work, its port is its own.
    workload.start()
    workload.wait_rounds(2)
    workload.finish()
    assert workload.failures == [], workload.failures[:5]
    assert old.alive() and old.proc is not None and listener_pid(port) == old.proc.pid
    assert rewritten < REFRESH_PATIENCE


def test_the_daemonsets_pods_hold_no_host_port(applied: ControlPlane) -> None:
    from tests.support.kube.rdmascheduler import find, manifest

    template = find(manifest("base/node/daemonset.yaml"), "DaemonSet", "rdma-cni")["spec"]["template"]

    def stored(spec: dict[str, Any]) -> dict[str, Any]:
        doc = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": unique("ds-pod")}, "spec": spec}
        out = applied.kubectl(
            "create", "-n", "kube-system", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(doc)
        )
        return dict(json.loads(out.stdout)["spec"])

    # As shipped: nothing for the scheduler's NodePorts filter to hold against the surge pod.
    spec = stored(template["spec"])
    assert [p for c in spec["containers"] for p in c.get("ports", [])] == []
    # Why: on the host network the API server turns a declared port into a hostPort.
    declared = json.loads(json.dumps(template["spec"]))
    declared["containers"][0]["ports"] = [{"name": "metrics", "containerPort": 9473}]
    (port,) = stored(declared)["containers"][0]["ports"]
    assert port["hostPort"] == 9473
