"""The mutual-TLS variant as an operator sets it up: the cluster's own kube-scheduler and the extender.

The operator's steps are docs/deploy.md's, run as written ("Certificates for
the mutual-TLS variant": the openssl block, the extender's side, then
``rdma-cni scheduler-config`` writing kube-scheduler's configuration), with
the stand-ins a loopback run needs and nothing more:

- the control-plane node's ``/etc/kubernetes/`` is ``<root>/etc/kubernetes/``
  (the run's folder), holding kube-scheduler's kubeconfig (``scheduler.conf``,
  the tier's kube-scheduler certificate) and the configuration the operator's
  kube-scheduler ran with before (:data:`OPERATORS_CONFIG`, which step 4
  merges into); ``kubectl`` is the tier's, ``rdma-cni`` the one under test;
- the Service's ClusterIP, which only kube-proxy would route: a relay on
  127.0.0.1 per ClusterIP (:class:`ServiceRelays`), gone with its Service.
  kube-scheduler starts from a copy of the file step 4 wrote whose
  ``urlPrefix`` host is that relay, and nothing else changed; ``serverName``
  stays, so it checks the extender's certificate for the Service's name;
- the kubelet's volumes: the extender's Secret and ConfigMap written into
  folders that stand for their mounts, as the kubelet's atomic writer does
  (a ``..data`` link swapped at once), when the extender starts and again on
  :meth:`MtlsExtender.sync` (the kubelet's periodic sync of a changed Secret).

The extender runs with the args of conf/base/extender-mtls/scheduler-extender-mtls.yaml's
Deployment, on its service account's token.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import shutil
import subprocess
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rdma_cni.agent import capacity
from rdma_cni.shared import nodestate
from tests.support.docblocks import blocks
from tests.support.kube.controlplane import REPO, ControlPlane, https_ok, insecure_context, write_kubeconfig
from tests.support.kube.objects import client_for_token, create, pod_doc
from tests.support.kube.process import Component, free_port, start_component
from tests.support.kube.rdmascheduler import (
    CONF,
    _probe_ready,
    _rewrite_listen,
    container,
    find,
    in_cluster_env,
    manifest,
    plugin_command,
)
from tests.support.kube.relay import Relay

DEPLOY_MD = Path(REPO) / "docs" / "deploy.md"
SECTION = "## Certificates for the mutual-TLS variant"
ETC = "/etc/kubernetes/"
CONFIG = "kube-scheduler-config.yaml"
MTLS_MANIFEST = "base/extender-mtls/scheduler-extender-mtls.yaml"
SERVICE = "rdma-cni-scheduler-extender"
VFS, BANDWIDTH = nodestate.VF_RESOURCE, nodestate.BANDWIDTH_RESOURCE
# What the operator's kube-scheduler ran with before the variant (step 4 merges into it): kubeadm's
# kubeconfig, the default profile with a plugin setting of the operator's own, and no leader
# election (one kube-scheduler here: a restart need not wait out a lease).
OPERATORS_CONFIG = {
    "apiVersion": "kubescheduler.config.k8s.io/v1",
    "kind": "KubeSchedulerConfiguration",
    "clientConnection": {"kubeconfig": "/etc/kubernetes/scheduler.conf"},
    "leaderElection": {"leaderElect": False},
    "profiles": [
        {
            "schedulerName": "default-scheduler",
            "plugins": {"score": {"disabled": [{"name": "ImageLocality"}]}},
        }
    ],
}


def docs_blocks() -> list[str]:
    """The shell blocks of docs/deploy.md's mutual-TLS section that run (not ``norun``), in order:
    the openssl block, the extender's side, kube-scheduler's configuration, the serving
    certificate's renewal."""
    text = DEPLOY_MD.read_text()
    begin = text.index(SECTION)
    start = text[:begin].count("\n") + 1
    end = text[: text.index("\n## ", begin + len(SECTION))].count("\n") + 1
    found = [
        b.text for b in blocks(DEPLOY_MD) if start <= b.line <= end and b.is_shell and b.marker != "norun"
    ]
    assert len(found) == 4, f"docs/deploy.md's {SECTION!r} has {len(found)} blocks that run, not 4"
    return found


@dataclass
class Operator:
    """The operator's shell on a control-plane node: ``/etc/kubernetes/`` in ``root``, the tier's
    kubectl, the rdma-cni under test; the certificates' folder is ``root/certs``."""

    cp: ControlPlane
    root: Path

    @property
    def etc(self) -> Path:
        return self.root / "etc" / "kubernetes"

    @property
    def certs(self) -> Path:
        return self.root / "certs"

    @property
    def config(self) -> Path:
        """The file step 4 writes, kube-scheduler's configuration."""
        return self.etc / CONFIG

    def prepare(self) -> None:
        """The control-plane node before the variant: kube-scheduler's kubeconfig and configuration."""
        assert self.cp.pki is not None
        self.etc.mkdir(parents=True)
        self.certs.mkdir()
        write_kubeconfig(
            str(self.etc / "scheduler.conf"), self.cp.server, self.cp.pki.ca, client=self.cp.pki.scheduler
        )
        # This node's /etc/kubernetes/ is the folder above: so are the paths its configuration names.
        text = yaml.safe_dump(OPERATORS_CONFIG).replace(ETC, str(self.etc) + "/")
        self.config.write_text(text)
        # The blocks apply conf/ files by their path in a checkout.
        os.symlink(CONF, self.certs / "conf")

    def run(
        self, block: str, cwd: Path | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """One docs block as written, ``/etc/kubernetes/`` being this node's; raises when it fails."""
        binary, config = self.cp.bins["kubectl"].path, self.cp.admin_kubeconfig
        kubectl = f'kubectl() {{ "{binary}" --kubeconfig="{config}" "$@"; }}\n'
        rdma_cni = "rdma-cni() { " + " ".join(f'"{a}"' for a in plugin_command()) + ' "$@"; }\n'
        script = "set -euo pipefail\n" + kubectl + rdma_cni + block.replace(ETC, str(self.etc) + "/")
        proc = subprocess.run(
            ["bash", "-c", script], cwd=cwd or self.certs, capture_output=True, text=True, timeout=180
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"docs block failed ({proc.returncode}):\n{block}\n{proc.stderr}")
        return proc


class ServiceRelays:
    """kube-proxy's part: the extender Service's ClusterIP relayed on 127.0.0.1 to the extender, while
    the Service has that address; any other address is a loopback port nothing listens on."""

    def __init__(self, cp: ControlPlane, target_port: int) -> None:
        self.cp = cp
        self.target = ("127.0.0.1", target_port)
        self.relays: dict[str, Relay] = {}
        self.nowhere: dict[str, int] = {}

    def port_for(self, ip: str) -> int:
        if ip in self.relays:
            return self.relays[ip].port
        proc = self.cp.kubectl("get", "service", SERVICE, "-n", "kube-system", "-o", "json", check=False)
        if proc.returncode == 0 and json.loads(proc.stdout)["spec"].get("clusterIP") == ip:
            self.relays[ip] = Relay(self.target)
            return self.relays[ip].port
        # No Service has it: nothing answers there (kube-proxy has no rule for it).
        return self.nowhere.setdefault(ip, free_port())

    def drop(self, cluster_ip: str) -> None:
        """The Service of ``cluster_ip`` is gone: nothing answers there any more."""
        relay = self.relays.pop(cluster_ip, None)
        if relay is not None:
            relay.close()

    def close(self) -> None:
        for ip in list(self.relays):
            self.drop(ip)


class VolumeMissing(AssertionError):
    """A Secret or ConfigMap the pod mounts does not exist: the kubelet cannot start the pod."""


def _volume_files(cp: ControlPlane, namespace: str, volume: dict[str, Any]) -> dict[str, bytes]:
    kind, name = (
        ("secret", volume["secret"]["secretName"])
        if "secret" in volume
        else (
            "configmap",
            volume["configMap"]["name"],
        )
    )
    proc = cp.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    if proc.returncode != 0:
        raise VolumeMissing(f"{kind} {namespace}/{name}: {proc.stderr.strip()}")
    doc = json.loads(proc.stdout)
    if kind == "secret":
        return {k: base64.b64decode(v) for k, v in doc["data"].items()}
    return {k: v.encode() for k, v in doc["data"].items()}


def _write_volume(into: Path, files: dict[str, bytes]) -> None:
    """As the kubelet's atomic writer: a new timestamped folder, ``..data`` swapped to it at once."""
    into.mkdir(mode=0o700, parents=True, exist_ok=True)
    stamp = into / f"..{time.time_ns()}"
    stamp.mkdir(mode=0o700)
    for key, data in files.items():
        fd = os.open(stamp / key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    link = into / "..data_tmp"
    os.symlink(stamp.name, link)
    old = os.readlink(into / "..data") if (into / "..data").is_symlink() else None
    os.replace(link, into / "..data")
    for key in files:
        if not (into / key).is_symlink():
            os.symlink(f"..data/{key}", into / key)
    if old:
        shutil.rmtree(into / old)


@dataclass
class MtlsExtender:
    """The extender container of conf/base/extender-mtls/'s manifest, its mounts from the cluster."""

    cp: ControlPlane
    root: Path
    component: Component | None = None
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        deployment = find(manifest(MTLS_MANIFEST), "Deployment", SERVICE)
        self.namespace = deployment["metadata"]["namespace"]
        pod = deployment["spec"]["template"]["spec"]
        ext = container(deployment, "extender")
        command = list(ext.get("command", [])) + list(ext.get("args", []))
        assert command[0].endswith("/rdma-cni"), command
        args, self.ports = _rewrite_listen(command[1:])
        volumes = {v["name"]: v for v in pod["volumes"]}
        self.mounts: dict[Path, dict[str, Any]] = {}
        for mount in ext["volumeMounts"]:
            volume = volumes[mount["name"]]
            if "secret" not in volume and "configMap" not in volume:
                continue  # the emptyDir for /tmp: the run's own /tmp
            where = self.root / "mounts" / mount["name"]
            self.mounts[where] = volume
            args = [a.replace(f"={mount['mountPath']}/", f"={where}/") for a in args]
        self.argv = [*plugin_command(), *args]
        self.account = pod["serviceAccountName"]

    @property
    def port(self) -> int:
        return self.ports["--listen"]

    def sync(self) -> None:
        """The kubelet's sync of the pod's volumes: each written again from the cluster's objects."""
        contents = {where: _volume_files(self.cp, self.namespace, v) for where, v in self.mounts.items()}
        for where, files in contents.items():
            _write_volume(where, files)

    def start(self) -> None:
        """Start the container (its volumes first: :class:`VolumeMissing` when the kubelet could not)."""
        self.sync()
        token = self.cp.token(self.namespace, self.account, "--duration=2h")
        env = in_cluster_env(self.cp, str(self.root / "serviceaccount"), token)
        probe = self.ports["--probe-listen"]
        if self.component is None:
            self.component = start_component(
                "mtls-extender", self.argv, self.cp.path("logs"), lambda: _probe_ready(probe), env=env
            )
        else:
            self.component.env = env
            self.component.start()
            self.component.wait_ready(lambda: _probe_ready(probe), 90)

    def stop(self) -> None:
        if self.component is not None:
            self.component.stop()

    def metrics(self) -> dict[str, float]:
        """The extender's /metrics samples, ``name{label=value,...}`` -> value."""
        import http.client

        from prometheus_client.parser import text_string_to_metric_families

        conn = http.client.HTTPConnection("127.0.0.1", self.ports["--metrics-listen"], timeout=10)
        conn.request("GET", "/metrics")
        page = conn.getresponse().read().decode()
        out = {}
        for family in text_string_to_metric_families(page):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
        return out


def cluster_ip(cp: ControlPlane) -> str:
    """The extender Service's ClusterIP."""
    return str(cp.get("service", SERVICE, "-n", "kube-system")["spec"]["clusterIP"])


@dataclass
class DefaultScheduler:
    """The cluster's kube-scheduler, started from the file step 4 wrote (its urlPrefix host relayed)."""

    cp: ControlPlane
    operator: Operator
    relays: ServiceRelays
    component: Component | None = None
    port: int = 0
    config: dict[str, Any] = field(default_factory=dict)

    def _loopback_copy(self) -> Path:
        """Step 4's file with the ClusterIP in ``urlPrefix`` relayed (kube-proxy's part), else as written."""
        config = yaml.safe_load(self.operator.config.read_text())
        for entry in config.get("extenders") or []:
            url = urllib.parse.urlsplit(entry["urlPrefix"])
            try:
                ip = str(ipaddress.ip_address(url.hostname or ""))
            except ValueError:
                continue  # not an address (conf/'s placeholder): left to fail as it would
            # Never dialled: the relay stands for it (no traffic leaves loopback).
            entry["urlPrefix"] = f"https://127.0.0.1:{self.relays.port_for(ip)}"
        self.config = config
        copy = self.operator.root / "kube-scheduler.loopback.yaml"
        copy.write_text(yaml.safe_dump(config))
        os.chmod(copy, 0o600)
        return copy

    def argv(self) -> list[str]:
        self.port = self.port or free_port()
        path = self._loopback_copy()
        kubeconfig = self.config["clientConnection"]["kubeconfig"]
        return [
            self.cp.bins["kube-scheduler"].path,
            f"--config={path}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--v=2",
        ]

    def healthy(self) -> bool:
        return https_ok(f"https://127.0.0.1:{self.port}/healthz", insecure_context())

    def start(self) -> None:
        """Start it, or again after :meth:`stop`; raises with its log when it exits or is not healthy."""
        argv = self.argv()
        if self.component is None:
            self.component = start_component(
                "default-kube-scheduler", argv, self.cp.path("logs"), self.healthy
            )
        else:
            self.component.argv = argv
            self.component.start()
            self.component.wait_ready(self.healthy, 90)

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.component is not None:
            self.component.stop()

    def exit_log(self, timeout: float = 60) -> str:
        """Start it and expect it to exit: the end of its log (AssertionError if it keeps running)."""
        assert self.component is not None
        self.component.argv = self.argv()
        self.component.start()
        assert self.component.proc is not None
        try:
            self.component.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.component.stop()
            raise AssertionError("kube-scheduler kept running") from None
        return Path(self.component.log).read_text()[-6000:]


def rdma_pod(
    cp: ControlPlane, namespace: str, name: str, request: list[dict[str, int]], on_node: str | None = None
) -> None:
    """An RDMA pod of the default scheduler that declares its request as conf/pod.yaml does."""
    annotations = {
        "k8s.v1.cni.cncf.io/networks": "default/rdma-net",
        "rdma_interfaces_required": json.dumps(request),
    }
    doc = pod_doc(namespace, name, annotations=annotations, on_node=on_node)
    # What makes kube-scheduler ask the extender (managedResources), and what it counts itself:
    # one VF per interface and the sum of min_tx_rate, exactly (the extender refuses other sums).
    declared = {VFS: str(len(request)), BANDWIDTH: str(sum(i.get("min_tx_rate", 0) for i in request))}
    resources = doc["spec"]["containers"][0]["resources"]
    resources["requests"].update(declared)
    resources["limits"] = dict(declared)  # extended resources: limits equal to requests
    create(cp, doc)


def advertise(cp: ControlPlane, node: str, state: nodestate.NodeState, tag: str) -> None:
    """The node's agent advertises ``state``'s RDMA resources in the Node's status.

    The agent's own code (agent/capacity), with a token bound to a pod on the node as the
    DaemonSet's is, so through conf/base/node/rbac.yaml's RBAC and admission policy.
    """
    pod = f"rdma-cni-agent-{tag}"
    create(cp, pod_doc("kube-system", pod, node=node, account="rdma-cni"))
    token = cp.token("kube-system", "rdma-cni", "--bound-object-kind=Pod", f"--bound-object-name={pod}")
    with client_for_token(cp, token, f"agent-{tag}") as client:
        advertiser = capacity.Advertiser(lambda: client, node)
        assert advertiser.advertise(state), advertiser.last_error
    cp.kubectl("delete", "pod", pod, "-n", "kube-system", "--wait=false")
