"""Fixtures for the integration tier: a simulated node, pod namespaces, the API stand-in, and a plugin runner.

Everything runs as root against the real kernel: veth VFs, network
namespaces, netlink, the real host-local IPAM binary, and a real HTTPS
server for the Kubernetes API. The one replaced seam is PF-side VF
configuration (see rdma_cni.kernel.vfcontrol).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.support.apiserver import ApiServer
from tests.support.processes import cache_id, warm_servers
from tests.support.simnode import SimNode, SimPf, add_netns, del_netns, ip

HOST_LOCAL_DIR = "/usr/lib/cni"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if os.geteuid() != 0:
    pytest.skip("the integration tier needs root (netns, veth)", allow_module_level=True)
if not os.path.exists(os.path.join(HOST_LOCAL_DIR, "host-local")):
    pytest.fail("host-local IPAM is missing: apt-get install containernetworking-plugins", pytrace=False)

_counter = itertools.count()


def plugin_command() -> list[str]:
    """The plugin under test: the built binary when RDMA_CNI_BINARY is set, else the package."""
    binary = os.environ.get("RDMA_CNI_BINARY")
    return [binary] if binary else [sys.executable, "-m", "rdma_cni"]


@dataclass
class Outcome:
    code: int
    doc: dict[str, Any] | None
    stderr: str

    @property
    def ok(self) -> bool:
        return self.code == 0


@dataclass
class Cluster:
    """A simulated node plus everything a CNI invocation needs around it."""

    node: SimNode
    api: ApiServer
    tmp: str
    cni_path: str
    netns_names: list[str] = field(default_factory=list)

    @property
    def state_dir(self) -> str:
        return os.path.join(self.tmp, "state")

    @property
    def records(self) -> list[str]:
        d = os.path.join(self.state_dir, "attachments")
        return sorted(n for n in os.listdir(d) if n.endswith(".json")) if os.path.isdir(d) else []

    def conf(self, **overrides: Any) -> dict[str, Any]:
        """A network config for this node (1.1.0, host-local, the API stand-in's kubeconfig)."""
        conf: dict[str, Any] = {
            "cniVersion": "1.1.0",
            "name": "rdma-net",
            "type": "rdma-cni",
            "kubeconfig": os.path.join(self.tmp, "kubeconfig"),
            "stateDir": self.state_dir,
            "lockFile": os.path.join(self.tmp, "lock"),
            "lockTimeoutSeconds": 30,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": "10.77.0.0/24", "gateway": "10.77.0.1"}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": os.path.join(self.tmp, "ipam"),
            },
        }
        conf.update(overrides)
        return {k: v for k, v in conf.items() if v is not None}

    def pod(
        self, annotation: Any = None, name: str | None = None, namespace: str = "default"
    ) -> dict[str, str]:
        """Create a pod (with the annotation, if given) and a netns for it; returns its CNI_* environment."""
        n = next(_counter)
        name = name or f"pod{n}"
        annotations = {}
        if annotation is not None:
            annotations["rdma_interfaces_required"] = (
                annotation if isinstance(annotation, str) else json.dumps(annotation)
            )
        uid = str(uuid.uuid4())
        self.api.add_pod(namespace, name, annotations, uid=uid)
        ns = f"rcni{os.getpid()}x{n}"
        self.netns_names.append(ns)
        path = add_netns(ns)
        return {
            "CNI_CONTAINERID": f"ctr{n:04d}{uid[:8]}",
            "CNI_NETNS": path,
            "CNI_IFNAME": "net1",
            "CNI_ARGS": f"IgnoreUnknown=true;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};"
            f"K8S_POD_INFRA_CONTAINER_ID=x;K8S_POD_UID={uid}",
        }

    def env(self, command: str, pod_env: dict[str, str] | None = None) -> dict[str, str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CNI_COMMAND": command,
            "CNI_PATH": self.cni_path,
        }
        env.update(self.node.env())
        env.update(pod_env or {})
        return env

    def run(
        self, command: str, pod_env: dict[str, str] | None, conf: dict[str, Any], *, timeout: float = 60
    ) -> Outcome:
        """Run the plugin as a runtime would: a process, env and stdin."""
        proc = subprocess.run(
            plugin_command(),
            input=json.dumps(conf).encode(),
            env=self.env(command, pod_env),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        out = proc.stdout.decode()
        doc = json.loads(out) if out.strip() else None
        return Outcome(proc.returncode, doc, proc.stderr.decode())

    def run_inproc(self, command: str, pod_env: dict[str, str] | None, conf: dict[str, Any]) -> Outcome:
        """Run the plugin in this process (for tests that patch a step); os.environ must hold node.env()."""
        from rdma_cni.cli.main import run_cni

        code, doc = run_cni(self.env(command, pod_env), json.dumps(conf).encode())
        return Outcome(code, doc, "")

    def check_conf(self, conf: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        return {**conf, "prevResult": result}

    def ipam_allocations(self) -> list[str]:
        """Addresses host-local holds (one file per address)."""
        d = os.path.join(self.tmp, "ipam", "rdma-net")
        if not os.path.isdir(d):
            return []
        return sorted(n for n in os.listdir(d) if n[0].isdigit() and n != "last_reserved_ip.0")


def use_ipam(cluster: Cluster, name: str, per_verb: dict[str, str], **conf: Any) -> dict[str, Any]:
    """A config whose IPAM is fake plugin ``name`` (tests.support.fake_ipam), first on CNI_PATH."""
    from tests.support.fake_ipam import write_ipam

    bindir = os.path.join(cluster.tmp, "bin")
    write_ipam(bindir, name, per_verb)
    cluster.cni_path = f"{bindir}:{HOST_LOCAL_DIR}"
    doc = cluster.conf(**conf)
    doc["ipam"]["type"] = name
    return doc


def slow_ipam(cluster: Cluster, seconds: float = 30) -> tuple[dict[str, Any], str]:
    """A config whose IPAM ADD touches a marker file, then waits before running host-local: a window
    to kill ADD in. Returns the config and the marker's path."""
    from tests.support.fake_ipam import sleeps_then_host_local

    marker = os.path.join(cluster.tmp, "ipam-started")
    return use_ipam(cluster, "slow-local", {"ADD": sleeps_then_host_local(seconds, marker)}), marker


def start_add_until_ipam_runs(
    cluster: Cluster, pod: dict[str, str], conf: dict[str, Any], marker: str, new_session: bool = False
) -> subprocess.Popen[bytes]:
    """Start an ADD with the IPAM of :func:`slow_ipam` and return once that IPAM has started."""
    proc = subprocess.Popen(
        plugin_command(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cluster.env("ADD", pod),
        start_new_session=new_session,
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(conf).encode())
    proc.stdin.close()
    deadline = time.monotonic() + 30
    while not os.path.exists(marker):
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return proc


def warm_server_pids() -> list[int]:
    """The warm server of the binary under test (default cache) and its forked children, once it listens."""
    tree = os.path.join("/var/cache/rdma-cni", cache_id(os.environ["RDMA_CNI_BINARY"]))
    return warm_servers(tree) if os.path.exists(os.path.join(tree, "warm.sock")) else []


def wait_warm_server(cluster: Cluster) -> None:
    """Make sure the binary under test has a listening warm server (one verb starts it)."""
    assert cluster.run("STATUS", {}, cluster.conf()).ok
    deadline = time.monotonic() + 30
    while not warm_server_pids():
        assert time.monotonic() < deadline, "no warm server came up"
        time.sleep(0.05)


@pytest.fixture(scope="session")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    server = ApiServer(str(tmp_path_factory.mktemp("api")))
    server.start()
    yield server
    server.stop()


def _node_layout(request: pytest.FixtureRequest) -> list[SimPf]:
    marker = request.node.get_closest_marker("node")
    if marker:
        return list(marker.args[0])
    return [SimPf("simpf0", 4, 25000), SimPf("simpf1", 4, 10000)]


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, tmp_path: Any, api_server: ApiServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Cluster]:
    """A fresh simulated node (default: 2 PFs x 4 VFs, 25 and 10 Gbit/s) for one test."""
    api_server.reset()
    # Unique across tests of this session (the counter) and across test
    # sessions running side by side on one machine (the pid): 6 characters.
    prefix = f"{chr(ord('a') + next(_counter) % 26)}{os.getpid() % 100000:05d}"
    node = SimNode(str(tmp_path / "node"), _node_layout(request), prefix=prefix)
    node.up()
    cluster = Cluster(node=node, api=api_server, tmp=str(tmp_path), cni_path=HOST_LOCAL_DIR)
    api_server.write_kubeconfig(os.path.join(cluster.tmp, "kubeconfig"), mode="token")
    for key, value in node.env().items():
        monkeypatch.setenv(key, value)
    try:
        yield cluster
    finally:
        for ns in cluster.netns_names:
            del_netns(ns)
        node.down()


def host_names(cluster: Cluster) -> set[str]:
    """Names of the simulated VF netdevs currently in the host."""
    return {
        n
        for n in SimNode.host_links()
        if n.startswith(cluster.node.prefix) and "v" in n[len(cluster.node.prefix) :]
    }


def expected_vf_names(cluster: Cluster) -> set[str]:
    return {cluster.node.vf_netdev(k, i) for k, i in cluster.node.all_vfs()}


def assert_node_pristine(cluster: Cluster) -> None:
    """Every VF back in the host under its name, no record, no IPAM lease, PF-side settings at rest."""
    assert host_names(cluster) == expected_vf_names(cluster)
    assert cluster.records == []
    assert cluster.ipam_allocations() == []
    for pf, table in cluster.node.vf_state().get("pfs", {}).items():
        for vf, settings in table.items():
            assert settings.get("rate", [0, 0]) == [0, 0], f"{pf}/{vf} rate left at {settings['rate']}"


def addresses_in(ns: str) -> dict[str, list[str]]:
    out = subprocess.run(["ip", "-n", ns, "-j", "addr"], capture_output=True, text=True, check=True).stdout
    return {
        link["ifname"]: [
            f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", []) if a["family"] == "inet"
        ]
        for link in json.loads(out)
    }


def ns_name(pod_env: dict[str, str]) -> str:
    return os.path.basename(pod_env["CNI_NETNS"])


__all__ = ["Cluster", "Outcome", "addresses_in", "assert_node_pristine", "io", "ip", "ns_name"]
