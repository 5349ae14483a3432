"""The mutual-TLS variant as an operator sets it up: the cluster's own kube-scheduler and the extender.

The operator's steps are docs/deploy.md's, run as written ("Certificates for
the mutual-TLS variant": the openssl block, then the block that hands each
side its part), with two stand-ins a loopback run needs and nothing more:

- the control-plane node's ``/etc/kubernetes/`` is ``<root>/etc/kubernetes/``
  (the run's folder), and ``kubectl`` is the tier's, talking to this
  control plane;
- the Service's ClusterIP, which docs/deploy.md says to put in ``urlPrefix``,
  is ``127.0.0.1:<the extender's port>``; ``serverName`` stays, so
  kube-scheduler still checks the extender's certificate for the Service name.

kube-scheduler reads conf/kube-scheduler-default.yaml from ``<root>/etc/kubernetes/``
with its kubeconfig there (``scheduler.conf``, kube-scheduler's client
certificate of the control plane). The extender runs with the args of
conf/scheduler-extender-mtls.yaml's Deployment, its Secret and ConfigMap
volumes read back from the cluster into folders that stand for their mounts,
on its service account's token.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Any

import yaml

from tests.support.kube.controlplane import REPO, ControlPlane, https_ok, insecure_context, write_kubeconfig
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

DEPLOY_MD = os.path.join(REPO, "docs", "deploy.md")
SECTION = "## Certificates for the mutual-TLS variant"
ETC = "/etc/kubernetes/"
MTLS_MANIFEST = "scheduler-extender-mtls.yaml"
SCHEDULER_CONFIG = "kube-scheduler-default.yaml"
_HOST = re.compile(r"^https://[a-z0-9.-]+:443$")


def docs_blocks() -> list[str]:
    """The shell blocks of docs/deploy.md's mutual-TLS certificate section, in order."""
    with open(DEPLOY_MD) as f:
        text = f.read()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return re.findall(r"^```sh\n(.*?)^```$", text[start:end], re.S | re.M)


def run_docs_steps(cp: ControlPlane, root: str) -> str:
    """Run the section's blocks in ``root/certs`` (an empty folder); returns that folder.

    The second block writes to ``/etc/kubernetes/`` on a control-plane node:
    here ``root/etc/kubernetes/``; its kubectl is the tier's, as the admin.
    """
    certs = os.path.join(root, "certs")
    os.makedirs(certs)
    # The block applies conf/ files by their path in a checkout.
    os.symlink(CONF, os.path.join(certs, "conf"))
    kubectl = f'kubectl() {{ "{cp.bins["kubectl"].path}" --kubeconfig="{cp.admin_kubeconfig}" "$@"; }}\n'
    etc = os.path.join(root, "etc", "kubernetes") + "/"
    for n, block in enumerate(docs_blocks()):
        script = "set -euo pipefail\n" + kubectl + block.replace(ETC, etc)
        proc = subprocess.run(["bash", "-c", script], cwd=certs, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            raise AssertionError(f"docs/deploy.md's block {n + 1} failed ({proc.returncode}):\n{proc.stderr}")
    return certs


@dataclass
class MtlsScheduler:
    """The running pair and where kube-scheduler's copy of its configuration lives."""

    extender: Component
    scheduler: Component
    extender_port: int
    probe_port: int
    metrics_port: int
    config: dict[str, Any]

    def stop(self) -> None:
        """Stop kube-scheduler, then the extender."""
        self.scheduler.stop()
        self.extender.stop()


def _volume_files(cp: ControlPlane, namespace: str, volume: dict[str, Any], into: str) -> None:
    """Write a Secret's or ConfigMap's keys as files, as the kubelet mounts them."""
    os.makedirs(into, mode=0o700)
    if "secret" in volume:
        doc = cp.get("secret", volume["secret"]["secretName"], "-n", namespace)
        files = {k: base64.b64decode(v) for k, v in doc["data"].items()}
    else:
        doc = cp.get("configmap", volume["configMap"]["name"], "-n", namespace)
        files = {k: v.encode() for k, v in doc["data"].items()}
    for key, data in files.items():
        fd = os.open(os.path.join(into, key), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def start_extender(cp: ControlPlane, root: str) -> tuple[Component, dict[str, int]]:
    """The extender container of conf/scheduler-extender-mtls.yaml, its mounts from the cluster."""
    assert cp.pki is not None
    deployment = find(manifest(MTLS_MANIFEST), "Deployment", "rdma-cni-scheduler-extender")
    namespace = deployment["metadata"]["namespace"]
    pod = deployment["spec"]["template"]["spec"]
    ext = container(deployment, "extender")
    command = list(ext.get("command", [])) + list(ext.get("args", []))
    assert command[0].endswith("/rdma-cni"), command
    args, ports = _rewrite_listen(command[1:])
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in ext["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "secret" not in volume and "configMap" not in volume:
            continue  # the emptyDir for /tmp: the run's own /tmp
        where = os.path.join(root, "mounts", mount["name"])
        _volume_files(cp, namespace, volume, where)
        args = [a.replace(f"={mount['mountPath']}/", f"={where}/") for a in args]
    token = cp.token(namespace, pod["serviceAccountName"], "--duration=2h")
    env = in_cluster_env(cp, os.path.join(root, "serviceaccount"), token)
    probe = ports["--probe-listen"]
    extender = start_component(
        "mtls-extender", [*plugin_command(), *args], cp.path("logs"), lambda: _probe_ready(probe), env=env
    )
    return extender, ports


def scheduler_config(root: str, extender_port: int) -> tuple[str, dict[str, Any]]:
    """conf/kube-scheduler-default.yaml copied into ``root``'s /etc/kubernetes/, urlPrefix on loopback."""
    with open(os.path.join(CONF, SCHEDULER_CONFIG)) as f:
        text = f.read()
    etc = os.path.join(root, "etc", "kubernetes") + "/"
    config = yaml.safe_load(text.replace(ETC, etc))
    (entry,) = config["extenders"]
    assert _HOST.match(entry["urlPrefix"]), entry["urlPrefix"]
    # The Service's ClusterIP in a cluster (docs/deploy.md); serverName keeps the name checked.
    entry["urlPrefix"] = f"https://127.0.0.1:{extender_port}"
    path = os.path.join(etc, SCHEDULER_CONFIG)
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path, config


def start_mtls_scheduler(cp: ControlPlane, root: str) -> MtlsScheduler:
    """Start the extender, then the cluster's kube-scheduler configured for it (run_docs_steps first)."""
    assert cp.pki is not None
    extender, ports = start_extender(cp, root)
    try:
        path, config = scheduler_config(root, ports["--listen"])
        kubeconfig = config["clientConnection"]["kubeconfig"]
        write_kubeconfig(kubeconfig, cp.server, cp.pki.ca, client=cp.pki.scheduler)
        port = free_port()
        argv = [
            cp.bins["kube-scheduler"].path,
            f"--config={path}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--v=2",
        ]
        scheduler = start_component(
            "mtls-kube-scheduler",
            argv,
            cp.path("logs"),
            lambda: https_ok(f"https://127.0.0.1:{port}/healthz", insecure_context()),
        )
    except BaseException:
        extender.stop()
        raise
    return MtlsScheduler(
        extender, scheduler, ports["--listen"], ports["--probe-listen"], ports["--metrics-listen"], config
    )
