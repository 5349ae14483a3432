"""The real control plane on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager, kube-scheduler.

The binaries are the ones ``make components`` builds (scripts/build_components.sh
names them). Every port is a free one picked at start, every file lives in the
run's folder, and everything listens on 127.0.0.1 only.

kube-controller-manager runs only the controllers the tier needs (service
accounts and their tokens, namespaces, garbage collection, the root CA
ConfigMap): the node lifecycle controller would mark the tier's Nodes, which
have no kubelet, NotReady.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from tests.support.kube.pki import ClientCert, Pki, make_pki
from tests.support.kube.process import Component, ComponentFailed, free_port, start_component

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BUILD_SCRIPT = os.path.join(REPO, "scripts", "build_components.sh")
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
CONTROLLERS = ",".join(
    (
        "serviceaccount-controller",
        "serviceaccount-token-controller",
        "namespace-controller",
        "garbage-collector-controller",
        "root-ca-certificate-publisher-controller",
        # Type-checks ValidatingAdmissionPolicies into their status.
        "validatingadmissionpolicy-status-controller",
        # DRA: makes a pod's ResourceClaims from its ResourceClaimTemplates and frees a claim's
        # reservation (and a generated claim) when its pod is gone (docs/dra.md).
        "resourceclaim-controller",
    )
)


@dataclass(frozen=True)
class Binary:
    """One built component."""

    name: str
    version: str
    path: str


def binaries() -> dict[str, Binary]:
    """The components ``make components`` builds, by name; raises when one is not built."""
    out = subprocess.run(["bash", BUILD_SCRIPT, "--list"], check=True, capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        name, version, path = line.split()
        if not os.access(path, os.X_OK):
            raise ComponentFailed(f"{name} {version} is not built ({path}): run `make components`")
        found[name] = Binary(name, version, path)
    missing = set(COMPONENTS) - set(found)
    if missing:
        raise ComponentFailed(f"scripts/build_components.sh --list names no {sorted(missing)}")
    return found


def write_kubeconfig(
    path: str,
    server: str,
    ca: str,
    *,
    client: ClientCert | None = None,
    token: str | None = None,
    user: str = "user",
) -> str:
    """A kubeconfig for ``server`` with a client certificate or a bearer token."""
    creds: dict[str, Any] = {}
    if client is not None:
        creds = {"client-certificate": client.cert, "client-key": client.key}
    if token is not None:
        creds["token"] = token
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "tier", "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "tier", "context": {"cluster": "tier", "user": user}}],
        "current-context": "tier",
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    return path


def https_ok(url: str, context: ssl.SSLContext) -> bool:
    """True when GET ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, context=context, timeout=5) as resp:
            return bool(resp.status == 200)
    except urllib.error.HTTPError:
        return False


def insecure_context() -> ssl.SSLContext:
    """A TLS client context that checks no certificate."""
    # Self-signed serving certificates of kube-controller-manager and
    # kube-scheduler, made at their start: only their /healthz is read.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


@dataclass
class ControlPlane:
    """One control plane; :meth:`start` brings it up, :meth:`stop` takes it down."""

    directory: str
    bins: dict[str, Binary] = field(default_factory=binaries)
    components: dict[str, Component] = field(default_factory=dict)
    pki: Pki | None = None
    # kube-apiserver's address and port (0: a free one). The node tier gives it a loopback
    # address of its own and port 443, the `kubernetes` Service's ClusterIP and port there.
    address: str = "127.0.0.1"
    api_port: int = 0
    etcd_port: int = 0
    # A dedicated control plane's differences (the wire tests: compaction,
    # the watch cache, a kube-scheduler of their own): appended to the
    # component's command line, after the tier's own flags.
    etcd_args: list[str] = field(default_factory=list)
    apiserver_args: list[str] = field(default_factory=list)
    # False: no default kube-scheduler (a test runs the cluster's own, configured from conf/).
    default_scheduler: bool = True
    # kube-controller-manager's controllers besides CONTROLLERS (the node tier: daemonset-controller).
    extra_controllers: list[str] = field(default_factory=list)
    # Each controller on its own service account and bootstrap role, as kubeadm runs them: the
    # DaemonSet controller needs its role's rights (controllerrevisions), which
    # kube-controller-manager's own identity lacks.
    service_account_credentials: bool = False

    @property
    def server(self) -> str:
        """The API server's URL."""
        return f"https://{self.address}:{self.api_port}"

    @property
    def version(self) -> str:
        """The Kubernetes version of the components."""
        return self.bins["kube-apiserver"].version

    def path(self, *parts: str) -> str:
        """A path inside the run's folder."""
        return os.path.join(self.directory, *parts)

    def start(self) -> None:
        """Generate certificates, then start etcd, kube-apiserver, kube-controller-manager, kube-scheduler."""
        os.makedirs(self.path("logs"), exist_ok=True)
        self.pki = make_pki(self.path("pki"), self.address)
        self.admin_kubeconfig = write_kubeconfig(
            self.path("admin.kubeconfig"), "", self.pki.ca, client=self.pki.admin
        )
        self._start_etcd()
        self._start_apiserver()
        write_kubeconfig(self.admin_kubeconfig, self.server, self.pki.ca, client=self.pki.admin)
        self._start_controller_manager()
        if self.default_scheduler:
            self._start_scheduler()

    def _start_etcd(self) -> None:
        self.etcd_port, peer = free_port(), free_port()
        client_url, peer_url = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{peer}"
        argv = [
            self.bins["etcd"].path,
            "--name=tier",
            f"--data-dir={self.path('etcd')}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=tier={peer_url}",
            # A test cluster thrown away after the run: durability buys nothing.
            "--unsafe-no-fsync",
            "--log-level=warn",
            *self.etcd_args,
        ]

        def ready() -> bool:
            with urllib.request.urlopen(f"{client_url}/health", timeout=5) as resp:
                return bool(json.load(resp).get("health") == "true")

        self.components["etcd"] = start_component("etcd", argv, self.path("logs"), ready)

    def _apiserver_argv(self) -> list[str]:
        assert self.pki is not None
        return [
            self.bins["kube-apiserver"].path,
            f"--bind-address={self.address}",
            "--advertise-address=127.0.0.1",
            # The reconciler would publish the advertise address as the
            # `kubernetes` Service's endpoint, and refuses a loopback one.
            "--endpoint-reconciler-type=none",
            f"--secure-port={self.api_port}",
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            f"--tls-cert-file={self.pki.server_cert}",
            f"--tls-private-key-file={self.pki.server_key}",
            f"--client-ca-file={self.pki.ca}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={self.pki.sa_pub}",
            f"--service-account-signing-key-file={self.pki.sa_key}",
            # Only allocated, never routed: no traffic goes to this range.
            "--service-cluster-ip-range=10.96.0.0/24",
            "--authorization-mode=Node,RBAC",
            # As kubeadm and kind run it: privileged containers (the DaemonSet's) allowed.
            "--allow-privileged=true",
            f"--cert-dir={self.path('apiserver-certs')}",
            "--v=1",
            *self.apiserver_args,
        ]

    def _start_apiserver(self) -> None:
        assert self.pki is not None
        self.api_port = self.api_port or free_port()
        context = ssl.create_default_context(cafile=self.pki.ca)
        context.load_cert_chain(self.pki.admin.cert, self.pki.admin.key)
        self._api_context = context
        self.components["kube-apiserver"] = start_component(
            "kube-apiserver", self._apiserver_argv(), self.path("logs"), self.api_ready, timeout=180
        )

    def api_ready(self) -> bool:
        """True when kube-apiserver's /readyz answers 200."""
        return https_ok(f"{self.server}/readyz", self._api_context)

    def restart_apiserver(self, sig: int = signal.SIGTERM) -> None:
        """Stop kube-apiserver and start it again on the same port."""
        component = self.components["kube-apiserver"]
        component.stop(sig)
        component.start()
        component.wait_ready(self.api_ready, 180)

    def _start_controller_manager(self) -> None:
        assert self.pki is not None
        kubeconfig = write_kubeconfig(
            self.path("controller-manager.kubeconfig"),
            self.server,
            self.pki.ca,
            client=self.pki.controller_manager,
        )
        # With --use-service-account-credentials=false every controller acts as
        # system:kube-controller-manager, whose bootstrap role lacks what two of them need: the DRA
        # claim controller's (claims from templates) and the garbage collector's (deleting any
        # object whose owner is gone, a Node's ResourceSlices among them), the roles each would
        # have under its own service account.
        for controller in ("resource-claim-controller", "generic-garbage-collector"):
            self.kubectl(
                "create",
                "clusterrolebinding",
                f"tier-{controller}",
                f"--clusterrole=system:controller:{controller}",
                "--user=system:kube-controller-manager",
            )
        port = free_port()
        argv = [
            self.bins["kube-controller-manager"].path,
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            "--leader-elect=false",
            f"--controllers={','.join([CONTROLLERS, *self.extra_controllers])}",
            f"--service-account-private-key-file={self.pki.sa_key}",
            f"--root-ca-file={self.pki.ca}",
            f"--use-service-account-credentials={str(self.service_account_credentials).lower()}",
            "--v=1",
        ]
        self.components["kube-controller-manager"] = start_component(
            "kube-controller-manager",
            argv,
            self.path("logs"),
            lambda: https_ok(f"https://127.0.0.1:{port}/healthz", insecure_context()),
        )

    def _start_scheduler(self) -> None:
        assert self.pki is not None
        kubeconfig = write_kubeconfig(
            self.path("scheduler.kubeconfig"), self.server, self.pki.ca, client=self.pki.scheduler
        )
        port = free_port()
        argv = [
            self.bins["kube-scheduler"].path,
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            "--leader-elect=false",
            "--v=1",
        ]
        self.components["kube-scheduler"] = start_component(
            "kube-scheduler",
            argv,
            self.path("logs"),
            lambda: https_ok(f"https://127.0.0.1:{port}/healthz", insecure_context()),
        )

    def kubectl(
        self,
        *args: str,
        kubeconfig: str | None = None,
        input: str | None = None,
        check: bool = True,
        cwd: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl (as the admin unless ``kubeconfig`` says otherwise)."""
        argv = [self.bins["kubectl"].path, f"--kubeconfig={kubeconfig or self.admin_kubeconfig}", *args]
        proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=120, cwd=cwd)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def get(self, *args: str) -> Any:
        """``kubectl get ... -o json``, decoded."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def token(self, namespace: str, account: str, *extra: str) -> str:
        """A TokenRequest for a service account (``kubectl create token``)."""
        return self.kubectl("create", "token", account, "-n", namespace, *extra).stdout.strip()

    def alive(self) -> list[str]:
        """Names of components that are not running (empty when all are)."""
        return [name for name, c in self.components.items() if not c.alive()]

    def stop(self) -> None:
        """Stop every component, the last started first."""
        for component in reversed(list(self.components.values())):
            component.stop()
