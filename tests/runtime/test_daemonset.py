"""conf/base/node/daemonset.yaml as kubelet would run it, under podman: the image's entrypoint with the
manifest's security context, volumes, environment and command, read from the manifest itself.

The image is conf/Containerfile's image stage, built by ``podman build`` on a stand-in for its
``debian:12-slim`` base made offline (:func:`tests.runtime.images.glibc_base_tar`), with this
tree's dist/ in place of its build stage (``--build-context build=``; the node tier builds both). The pod's
host paths are directories of a stand-in host root; its service account token is the API
stand-in's; its node is the simulated node (the sysfs seams are the only additions to the
manifest's environment). The container must install the plugin, publish the node's state to the
API stand-in, and serve NRI: this test plays containerd on the NRI socket, replaying the recorded
containerd 1.7 wire (tests/unit/data/nri/).
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rdma_cni.agent.nri import nri_api_pb2 as api
from rdma_cni.agent.nri import plugin as nri_plugin
from rdma_cni.agent.nri import ttrpc
from rdma_cni.shared import nodestate
from tests.runtime.conftest import BINARY, REPO, Tier
from tests.runtime.harness import Podman
from tests.runtime.images import glibc_base_tar
from tests.runtime.test_podman import ULIMITS
from tests.support.apiserver import ApiServer
from tests.support.nri_capture import replay_runtime
from tests.support.processes import cache_id

MANIFEST = Path(REPO) / "conf" / "base/node/daemonset.yaml"
CONTAINERFILE = Path(REPO) / "conf" / "Containerfile"
BASE_IMAGE = "localhost/rdma-cni-base-standin:tier"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def daemonset_pod() -> dict[str, Any]:
    (ds,) = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "DaemonSet"]
    return ds["spec"]["template"]["spec"]


def _quantity_cpus(value: str) -> float:
    """A Kubernetes CPU quantity in cores: ``100m`` is 0.1, ``1`` (or ``"1"``) is 1."""
    value = str(value)
    return int(value.removesuffix("m")) / 1000 if value.endswith("m") else float(value)


def _quantity_bytes(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(text[:-2]) * units[text[-2:]] if text[-2:] in units else int(text)


def expand(text: str, env: dict[str, str]) -> str:
    """kubelet's $(VAR) expansion of command, args and env values ($$ escapes; unknown names stay)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def podman_run_args(
    pod: dict[str, Any], host: str, node: str, env: dict[str, str], metrics: int
) -> list[str]:
    """`podman run` options for the pod's one container, as kubelet would run it on ``host``.

    Fails on a manifest setting it does not know how to translate, so that a new one is never
    silently dropped. The one change: the metrics listener's port, which would collide on a
    shared machine's host network, is ``metrics``."""
    (ctr,) = pod["containers"]
    args = ["--name", f"rdma-cni-ds-{os.getpid()}", "--pull=never"]
    if pod.get("hostNetwork"):
        args.append("--network=host")
    assert not pod.get("hostPID") and not pod.get("hostIPC"), "translate hostPID/hostIPC"
    seccomp = pod.get("securityContext", {}).get("seccompProfile", {}).get("type", "RuntimeDefault")
    assert seccomp == "RuntimeDefault", seccomp  # podman's default profile
    ctx = ctr.get("securityContext", {})
    if ctx.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"]  # only the pod's volumes are writable
    if ctx.get("privileged"):
        args.append("--privileged")
    if ctx.get("allowPrivilegeEscalation") is False:
        args.append("--security-opt=no-new-privileges")
    if "runAsUser" in ctx:
        args.append(f"--user={ctx['runAsUser']}" + (f":{ctx['runAsGroup']}" if "runAsGroup" in ctx else ""))
    caps = ctx.get("capabilities", {})
    args += [f"--cap-drop={c.lower()}" for c in caps.get("drop", [])]
    args += [f"--cap-add={c}" for c in caps.get("add", [])]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in ctr["volumeMounts"]:
        volume = volumes[mount["name"]]
        options = ["ro"] if mount.get("readOnly") else []
        if "hostPath" in volume:
            source = os.path.join(host, volume["hostPath"]["path"].lstrip("/"))
            kind = volume["hostPath"].get("type", "")
            assert kind in ("", "Directory", "DirectoryOrCreate"), f"translate hostPath type {kind}"
            os.makedirs(source, exist_ok=True)
            propagation = mount.get("mountPropagation", "None")
            options += {"None": [], "HostToContainer": ["rslave"], "Bidirectional": ["rshared"]}[propagation]
        elif "emptyDir" in volume:
            assert volume["emptyDir"].get("medium", "") == "", "translate emptyDir medium"
            source = os.path.join(host, "emptydir", mount["name"])  # a directory on the node's disk
            os.makedirs(source, exist_ok=True)
        else:
            raise AssertionError(f"translate volume {volume}")
        args.append(f"--volume={source}:{mount['mountPath']}" + (f":{','.join(options)}" if options else ""))
    if pod.get("automountServiceAccountToken", True):
        args.append(f"--volume={os.path.join(host, 'serviceaccount')}:{SERVICE_ACCOUNT_DIR}:ro")
    # The downward API's fields as kubelet fills them for a host-network pod on this stand-in node.
    fields = {"spec.nodeName": node, "status.hostIP": "127.0.0.1", "status.podIP": "127.0.0.1"}
    fields |= {"metadata.name": f"rdma-cni-{node}", "metadata.namespace": "kube-system"}
    values: dict[str, str] = {}
    for item in ctr.get("env", []):
        if "value" in item:
            values[item["name"]] = expand(item["value"], values)
        else:
            path = item["valueFrom"].get("fieldRef", {}).get("fieldPath")
            assert path in fields, f"translate env {item}"
            values[item["name"]] = fields[path]
        args.append(f"--env={item['name']}={values[item['name']]}")
    args += [f"--env={k}={v}" for k, v in env.items()]
    limits = ctr.get("resources", {}).get("limits", {})
    if "memory" in limits:
        args.append(f"--memory={_quantity_bytes(limits['memory'])}")
    if "cpu" in limits:
        args.append(f"--cpus={_quantity_cpus(limits['cpu'])}")
    command = [expand(a, values) for a in ctr["command"]]
    command = [
        f"{a.split('=', 1)[0]}={a.split('=', 1)[1].rsplit(':', 1)[0]}:{metrics}"
        if a.startswith("--metrics-listen=")
        else a
        for a in command
    ]
    args.append(f"--entrypoint={json.dumps(command)}")
    return [*args, ctr["image"], *[expand(a, values) for a in ctr.get("args", [])]]


class NriRuntime:
    """containerd's side of NRI on a listening socket: the recorded wire, to the first plugin connecting."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(1)
        self.sock.settimeout(180)
        self.result: tuple[ttrpc.Request, list[tuple[ttrpc.Request, ttrpc.Response]]] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
            with conn:
                conn.settimeout(30)
                self.result = replay_runtime(conn)
        except BaseException as exc:  # reported by the test
            self.error = exc

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def host() -> Iterator[str]:
    """The stand-in node's root (short: the NRI socket's path must fit a unix socket address)."""
    root = tempfile.mkdtemp(prefix="rcni-ds-", dir="/tmp")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def image(tier: Tier, host: str) -> Iterator[tuple[Podman, str]]:
    """podman with conf/Containerfile built on the base stand-in, under the manifest's image name."""
    runtime = Podman(os.path.join(tier.root, "podman"), tier.plugin.bin_dir, tier.conflist("rdma-ds-unused"))
    try:
        base = os.path.join(tier.root, "base.tar")
        Path(base).write_bytes(glibc_base_tar())
        runtime("import", base, BASE_IMAGE)
        # The image stage only: ``--build-context build=`` stands in the build stage's output
        # with this tree's dist/ (the node tier builds both stages from source).
        context = os.path.join(tier.root, "context")
        for source in containerfile_sources():
            os.makedirs(os.path.join(context, "dist"), exist_ok=True)
            shutil.copy(built_file(source), os.path.join(context, "dist", os.path.basename(source)))
        (name,) = {c["image"] for c in daemonset_pod()["containers"]}
        runtime(
            "build",
            "--build-arg",
            f"BASE={BASE_IMAGE}",
            "--build-context",
            f"build={context}",
            "-f",
            str(CONTAINERFILE),
            "-t",
            name,
            context,
            timeout=300,
        )
        yield runtime, name
    finally:
        runtime.stop()


def containerfile_sources() -> dict[str, str]:
    """What conf/Containerfile's image stage copies from its build stage: path there -> in the image."""
    out = {}
    for line in CONTAINERFILE.read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and "--from=build" in words:
            source, target = [w for w in words[1:] if not w.startswith("--")]
            out[source] = target
    assert set(out) == {"/dist/rdma-cni", "/dist/rdma-cni-shim"}, out
    return out


def built_file(source: str) -> str:
    """This tree's build of a file the build stage makes (``/dist/rdma-cni``: the binary tested)."""
    if source == "/dist/rdma-cni":
        return BINARY
    path = os.path.join(REPO, source.lstrip("/"))
    assert os.path.isfile(path), f"{path} is not built: make build"
    return path


def wait_for(what: str, check: Any, timeout: float, logs: Any, alive: Any) -> Any:
    """``check()``'s first true value; fails at once, with the log, if the container stopped."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert alive(), f"the container exited before {what}; its log:\n{logs()}"
        assert time.monotonic() < deadline, f"{what} within {timeout} s; container log:\n{logs()}"
        time.sleep(0.5)


def test_the_daemonset_starts_as_shipped(
    tier: Tier, host: str, image: tuple[Podman, str], api_server: ApiServer
) -> None:
    podman, _name = image
    pod = daemonset_pod()
    node = f"ds-node-{os.getpid()}"
    api_server.add_node(node)
    sa = os.path.join(host, "serviceaccount")
    os.makedirs(sa)
    Path(sa, "token").write_text(api_server.token)
    shutil.copy(api_server.ca_path, os.path.join(sa, "ca.crt"))
    Path(sa, "namespace").write_text("kube-system")
    nri_dir = os.path.join(host, os.path.dirname(nri_plugin.DEFAULT_SOCKET).lstrip("/"))
    os.makedirs(nri_dir)
    nri = NriRuntime(os.path.join(nri_dir, os.path.basename(nri_plugin.DEFAULT_SOCKET)))
    metrics = free_port()
    env = {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",  # the pod is on the host network, as the API stand-in
        "KUBERNETES_SERVICE_PORT": str(api_server.port),
        **tier.node.env(),  # the simulated node's sysfs and PF seams, mounted read-only below
    }
    args = podman_run_args(pod, host, node, env, metrics)
    # Not the manifest's: the simulated node, and limits within this sandbox's hard limits.
    args[:0] = [f"--volume={tier.node.root}:{tier.node.root}:ro", *ULIMITS]
    container = args[args.index("--name") + 1]
    podman("run", "-d", *args, timeout=180)

    def logs() -> str:
        got = podman("logs", container, check=False)
        return got.stdout + got.stderr

    def alive() -> bool:
        return podman("inspect", "-f", "{{.State.Running}}", container, check=False).stdout.strip() == "true"

    try:
        (ctr,) = pod["containers"]
        probe = ctr["readinessProbe"]["exec"]["command"]
        wait_for(
            "ready", lambda: podman("exec", container, *probe, check=False).returncode == 0, 180, logs, alive
        )
        # The startup and liveness probes' command, with the image's own sh and find: the agent
        # touched its live file (and keeps touching it every --interval).
        for kind in ("startupProbe", "livenessProbe"):
            live = ctr[kind]["exec"]["command"]
            assert podman("exec", container, *live, check=False).returncode == 0, kind

        # Installed: a file of the image on the host's CNI path, a kubeconfig from the token.
        installed = os.path.join(host, "opt/cni/bin/rdma-cni")
        copied = [built_file(src) for src in containerfile_sources()]
        assert any(filecmp.cmp(installed, f, shallow=False) for f in copied), "not a file of the image"
        kubeconfig = Path(host, "etc/cni/net.d/rdma-cni.d/rdma-cni.kubeconfig")
        assert oct(kubeconfig.stat().st_mode & 0o777) == "0o600"
        assert f"https://127.0.0.1:{api_server.port}" in kubeconfig.read_text()
        # Unpacked into the pod's tmp volume, where the manifest says; the root stayed read-only.
        cache = {e["name"]: e.get("value") for e in ctr["env"]}["RDMA_CNI_CACHE_DIR"]
        (tmp_mount,) = [m for m in ctr["volumeMounts"] if cache.startswith(m["mountPath"] + "/")]
        unpacked = Path(host, "emptydir", tmp_mount["name"], cache[len(tmp_mount["mountPath"]) + 1 :])
        assert (unpacked / cache_id(BINARY) / ".complete").exists()
        write = podman("exec", container, "sh", "-c", "echo x > /var/cache/probe", check=False)
        assert write.returncode != 0 and "Read-only file system" in write.stderr

        # Published: its Node carries the simulated node's state.
        def published() -> nodestate.NodeState | None:
            text = ((api_server.get_node(node) or {}).get("metadata", {}).get("annotations") or {}).get(
                nodestate.ANNOTATION
            )
            return nodestate.decode(text) if text else None

        state = wait_for("the node state published", published, 60, logs, alive)
        assert [(pf.name, pf.capacity_vfs) for pf in state.pfs] == [
            (p.name, p.num_vfs) for p in tier.node.pfs
        ]

        # Serves NRI: registered on the socket, and answered every call of the recorded wire.
        nri.thread.join(60)
        assert nri.error is None and nri.result is not None, f"{nri.error!r}\n{logs()}"
        register, calls = nri.result
        assert api.RegisterPluginRequest.FromString(register.payload).plugin_name == nri_plugin.PLUGIN_NAME
        assert calls and all(resp.code == ttrpc.OK for _, resp in calls), calls
        configure = next(resp for req, resp in calls if req.method == "Configure")
        assert api.ConfigureResponse.FromString(configure.payload).events == 1 << (
            nri_plugin.EVENT_CREATE_CONTAINER - 1
        )
        assert "CreateContainer" in [req.method for req, _ in calls]

        # And serves its metrics where the manifest's listener says (on the test's free port).
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as resp:
            assert resp.status == 200 and b"rdma_cni" in resp.read()
        assert alive(), logs()
    finally:
        podman("rm", "-f", "-t", "5", container, check=False)
        nri.close()
