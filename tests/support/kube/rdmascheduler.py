"""``rdma-scheduler`` as an operator deploys it from conf/, run as two processes on 127.0.0.1.

The kube-scheduler configuration is the one the API server holds in the
ConfigMap that conf/ applied (read back from the cluster, not from a copy),
and the extender runs with the args of the Deployment's extender container.
What a pod provides and a loopback test run cannot, and nothing more, is
replaced:

- the in-cluster connection: kube-scheduler gets ``clientConnection.kubeconfig``
  with a token of the ``rdma-scheduler`` service account; the extender reads its
  service-account directory (token and CA) from ``RDMA_CNI_SERVICEACCOUNT_DIR``;
- fixed ports: each ``--*listen=ADDR:PORT`` becomes ``127.0.0.1:<free port>``
  (the probe and metrics listeners included, which the pod opens on 0.0.0.0 for
  the kubelet and Prometheus), and the extender's ``urlPrefix`` follows the
  extender's port; kube-scheduler's serving port is a free one too;
- kube-scheduler calls the extender through a recorder
  (tests/support/kube/recorder.py) that forwards every call unchanged and
  remembers which pod each was about.
"""

from __future__ import annotations

import http.client
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, cast

import yaml

from tests.support.kube.controlplane import REPO, ControlPlane, https_ok, insecure_context, write_kubeconfig
from tests.support.kube.process import Component, free_port, start_component
from tests.support.kube.recorder import Recorder, start_recorder

CONF = os.path.join(REPO, "conf")
_LISTEN = re.compile(r"^(--(?:[a-z]+-)?listen)=(.*):(\d+)$")


def plugin_command() -> list[str]:
    """The rdma-cni under test: the built binary when RDMA_CNI_BINARY is set, else the package."""
    binary = os.environ.get("RDMA_CNI_BINARY")
    return [binary] if binary else [sys.executable, "-m", "rdma_cni"]


def manifest(name: str) -> list[dict[str, Any]]:
    """The documents of one conf/ manifest."""
    with open(os.path.join(CONF, name)) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The document of ``kind`` named ``name``."""
    for doc in docs:
        if doc.get("kind") == kind and doc.get("metadata", {}).get("name") == name:
            return doc
    raise AssertionError(f"no {kind} {name} in the manifest")


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    """One container of a Deployment's pod template."""
    for c in deployment["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return dict(c)
    raise AssertionError(f"the Deployment has no container {name}")


@dataclass
class RdmaScheduler:
    """The running pair, and what was changed from conf/ to run them here."""

    extender: Component
    scheduler: Component
    extender_port: int
    probe_port: int
    metrics_port: int | None
    config: dict[str, Any]
    recorder: Recorder
    scheduler_port: int = 0

    def stop(self) -> None:
        """Stop kube-scheduler, then the recorder and the extender."""
        self.scheduler.stop()
        self.recorder.stop()
        self.extender.stop()

    def restart_exited(self, timeout: float = 90) -> list[str]:
        """Start again what exited, as the kubelet restarts a pod's container; returns the names.

        kube-scheduler with leader election exits when it cannot renew its
        lease (kube-apiserver down for longer than its renew deadline).
        """
        restarted = []
        for component, ready in (
            (self.extender, self.ready),
            (
                self.scheduler,
                lambda: https_ok(f"https://127.0.0.1:{self.scheduler_port}/healthz", insecure_context()),
            ),
        ):
            if not component.alive():
                component.start()
                component.wait_ready(ready, timeout)
                restarted.append(component.name)
        return restarted

    def ready(self) -> bool:
        """True when the extender's /readyz answers 200 (node cache synced, reservations rebuilt)."""
        return _probe_ready(self.probe_port)

    def metrics(self) -> str:
        """The extender's /metrics page."""
        assert self.metrics_port is not None
        conn = http.client.HTTPConnection("127.0.0.1", self.metrics_port, timeout=10)
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()


def _rewrite_listen(args: list[str]) -> tuple[list[str], dict[str, int]]:
    """Each ``--X-listen=ADDR:PORT`` onto a free loopback port; returns the args and ports by flag."""
    out, ports = [], {}
    for arg in args:
        m = _LISTEN.match(arg)
        if m:
            port = free_port()
            ports[m.group(1)] = port
            arg = f"{m.group(1)}=127.0.0.1:{port}"
        out.append(arg)
    return out, ports


def _probe_ready(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/readyz")
        return conn.getresponse().status == 200
    finally:
        conn.close()


def in_cluster_env(cp: ControlPlane, sa_dir: str, token: str) -> dict[str, str]:
    """The environment of a pod's container on ``cp``: the service account's token and CA in
    ``sa_dir`` (the projected volume), the API server as ``KUBERNETES_SERVICE_*`` on loopback."""
    assert cp.pki is not None
    os.makedirs(sa_dir, exist_ok=True)
    with open(os.path.join(sa_dir, "token"), "w") as f:
        f.write(token)
    with open(cp.pki.ca) as src, open(os.path.join(sa_dir, "ca.crt"), "w") as dst:
        dst.write(src.read())
    return {
        **os.environ,
        "KUBERNETES_SERVICE_HOST": cp.address,
        "KUBERNETES_SERVICE_PORT": str(cp.api_port),
        "RDMA_CNI_SERVICEACCOUNT_DIR": sa_dir,
    }


def start_rdma_scheduler(
    cp: ControlPlane,
    manifest_name: str = "base/extender/scheduler-extender.yaml",
    tag: str = "rdma",
    networks: str | None = None,
    *,
    extender_api_port: int | None = None,
    record: bool = True,
) -> RdmaScheduler:
    """Start the extender and kube-scheduler of ``manifest_name`` (already applied to ``cp``).

    ``networks``: the extender's ``--networks`` instead of the manifest's (an operator lists
    every rdma-cni network there, as the manifest's comment says).
    ``extender_api_port``: the extender reaches kube-apiserver at that loopback port instead (a
    test's relay in between); kube-scheduler always reaches it directly.
    ``record``: kube-scheduler calls the extender through the recorder; without, directly, as
    deployed (the benchmarks: a recorder's hop is not what they measure).
    """
    assert cp.pki is not None
    docs = manifest(manifest_name)
    deployment = find(docs, "Deployment", "rdma-scheduler")
    namespace = deployment["metadata"]["namespace"]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    token = cp.token(namespace, account, "--duration=2h")

    # The extender, as its container runs it, on the service account's credentials.
    ext = container(deployment, "extender")
    command = list(ext.get("command", [])) + list(ext.get("args", []))
    assert command[0].endswith("/rdma-cni"), command
    args, ports = _rewrite_listen(command[1:])
    if networks is not None:
        assert sum(a.startswith("--networks=") for a in args) == 1, args
        args = [f"--networks={networks}" if a.startswith("--networks=") else a for a in args]
    env = in_cluster_env(cp, cp.path(f"{tag}-serviceaccount"), token)
    if extender_api_port is not None:
        env["KUBERNETES_SERVICE_PORT"] = str(extender_api_port)
    probe = ports["--probe-listen"]
    extender = start_component(
        f"{tag}-extender", [*plugin_command(), *args], cp.path("logs"), lambda: _probe_ready(probe), env=env
    )

    # kube-scheduler with the ConfigMap the API server holds.
    recorder = start_recorder(ports["--listen"]) if record else cast(Recorder, _Direct(ports["--listen"]))
    try:
        volume = next(
            v for v in deployment["spec"]["template"]["spec"]["volumes"] if v.get("configMap") is not None
        )
        configmap = cp.get("configmap", volume["configMap"]["name"], "-n", namespace)
        (key, text), *rest = configmap["data"].items()
        assert not rest, "one configuration file in the ConfigMap"
        config = yaml.safe_load(text)
        kubeconfig = write_kubeconfig(
            cp.path(f"{tag}-scheduler.kubeconfig"), cp.server, cp.pki.ca, token=token
        )
        config.setdefault("clientConnection", {})["kubeconfig"] = kubeconfig
        for entry in config.get("extenders", []):
            prefix = entry["urlPrefix"]
            assert re.fullmatch(r"https?://127\.0\.0\.1:\d+", prefix), prefix
            entry["urlPrefix"] = f"{prefix.rsplit(':', 1)[0]}:{recorder.port}"
        config_path = cp.path(f"{tag}-scheduler-config.yaml")
        with open(config_path, "w") as f:
            yaml.safe_dump(config, f)
        sched = container(deployment, "kube-scheduler")
        mount = next(m["mountPath"] for m in sched["volumeMounts"] if m["name"] == volume["name"])
        sched_args = [
            a.replace(f"{mount}/{key}", config_path)
            for a in list(sched.get("command", []))[1:] + list(sched.get("args", []))
        ]
        assert f"--config={config_path}" in sched_args, sched_args
        port = free_port()
        sched_argv = [
            cp.bins["kube-scheduler"].path,
            *sched_args,
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
        ]
        scheduler = start_component(
            f"{tag}-kube-scheduler",
            sched_argv,
            cp.path("logs"),
            lambda: https_ok(f"https://127.0.0.1:{port}/healthz", insecure_context()),
        )
    except BaseException:
        recorder.stop()
        extender.stop()
        raise
    return RdmaScheduler(
        extender, scheduler, ports["--listen"], probe, ports.get("--metrics-listen"), config, recorder, port
    )


class _Direct:
    """Where the recorder would be with ``record=False``: its port is the extender's own."""

    def __init__(self, port: int) -> None:
        self.port = port

    def stop(self) -> None:
        pass
