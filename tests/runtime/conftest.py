"""Fixtures for the runtime tier: real container runtimes driving the built plugin on the simulated node.

containerd (over CRI, from our own small client) and podman (CNI backend)
run the plugin from CNI bin directories of the tier's own, in each of the
ways docs/deploy.md offers: the static shim as ``rdma-cni install --mode
shim`` installs it, served by ``rdma-cni cni-server`` (as shipped), and the
fat ``dist/rdma-cni`` itself. A wrapper around the plugin logs what it was
passed and by whom. Needs root and the Debian packages ``make deps`` installs.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.runtime.harness import HOST_LOCAL_DIR, SHIM, Call, PluginInstall, Served, served
from tests.support.apiserver import ApiServer
from tests.support.cniserver import CniServerProcess
from tests.support.simnode import SimNode, SimPf, ip
from tests.support.waiting import wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if os.geteuid() != 0:
    pytest.skip("the runtime tier needs root (containerd, podman, netns)", allow_module_level=True)
_missing = [t for t in ("containerd", "ctr", "podman", "runc", "conmon", "nsenter") if not shutil.which(t)]
if _missing or not os.path.exists(os.path.join(HOST_LOCAL_DIR, "host-local")):
    pytest.fail(f"the runtime tier needs {_missing or 'host-local'}: run make deps", pytrace=False)
# make runtime names the binary it just built; a bare pytest uses dist/ if it is there.
BINARY = os.environ.get("RDMA_CNI_BINARY") or os.path.join(REPO, "dist", "rdma-cni")
SHIM_BINARY = os.path.join(os.path.dirname(BINARY), "rdma-cni-shim")
if not (os.access(BINARY, os.X_OK) and os.access(SHIM_BINARY, os.X_OK)):
    pytest.fail(f"{BINARY} and {SHIM_BINARY} are not built: run make runtime", pytrace=False)

_counter = itertools.count()


@dataclass
class Tier:
    """One run's simulated node, plugin install and network settings."""

    root: str
    node: SimNode
    plugin: PluginInstall
    subnet: str
    server: CniServerProcess | None = None
    server_pids: tuple[int, ...] = ()  # every CNI server this tier started, in order

    @property
    def mode(self) -> str:
        return self.plugin.mode

    @property
    def socket(self) -> str:
        """The CNI server's socket (the shim's spool is beside it)."""
        return os.path.join(self.root, "agent", "cni.sock")

    @property
    def spool(self) -> str:
        return os.path.join(self.root, "agent", "del-spool")

    def runtime_env(self) -> dict[str, str]:
        """What the runtime's environment adds: the shim finds its socket there (its plugins inherit it)."""
        return {"RDMA_CNI_SHIM_SOCKET": self.socket} if self.mode == SHIM else {}

    def start_server(self) -> CniServerProcess:
        """``rdma-cni cni-server`` on the tier's socket, on the simulated node, running the logged plugin."""
        assert self.server is None
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), **self.node.env()}
        self.server = CniServerProcess(
            [BINARY],
            self.socket,
            env,
            os.path.join(self.root, "cni-server.log"),
            plugin=self.plugin.plugin,
            state=(self.state_dir, self.plugin_entry()["lockFile"]),
        )
        self.server_pids += (self.server.pid,)
        return self.server

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def server_log(self) -> str:
        try:
            with open(os.path.join(self.root, "cni-server.log")) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def spooled(self) -> list[str]:
        return (
            sorted(n for n in os.listdir(self.spool) if not n.startswith("."))
            if os.path.isdir(self.spool)
            else []
        )

    def vfs_away(self) -> list[tuple[int, int]]:
        """The VFs (PF, index) whose netdev is not in the host under its name."""
        host = SimNode.host_links()
        return [(k, i) for k, i in self.node.all_vfs() if self.node.vf_netdev(k, i) not in host]

    def namespace_gone(self, vfs: list[tuple[int, int]], *, reboot: bool) -> None:
        """Wait for the pod's namespace to take ``vfs`` down with it; bring them back as the kernel would.

        A veth dies with its namespace (its host-side wire too); a real VF comes back
        to the host: under its pod-side name (or devN when the host has that name),
        or, after a reboot, under the name its driver gives it, its host name. Names
        unique to this tier stand for the former.
        """
        wires = {self.node.vf_wire(k, i) for k, i in vfs}
        wait_for(lambda: not wires & SimNode.host_links(), 60, "the pod's namespace to go, and its veths")
        for k, i in vfs:
            name = self.node.vf_netdev(k, i) if reboot else f"{self.node.prefix}h{k}{i}"
            ip("link", "add", name, "type", "veth", "peer", "name", self.node.vf_wire(k, i))
            ip("link", "set", self.node.vf_wire(k, i), "up")

    def served(self) -> list[Served]:
        """The verbs the CNI server ran (its log says each), in order."""
        return served(self.server_log())

    def assert_ran_as_installed(self, calls: list[Call]) -> None:
        """Each call reached the plugin the way the mode says: through the shim and the server, or directly.

        Through the shim, the CNI server ran each call the shim did not spool, with the same
        outcome, and a verb with a namespace had it as the fd the shim opened; directly, the
        runtime ran the plugin and nothing set ``RDMA_CNI_NETNS_VIA``.
        """
        assert calls
        ran = self.served()
        for call in calls:
            assert call.parent not in self.server_pids and call.netns_via == "", call
            if self.mode != SHIM or call.spooled:
                continue
            matching = [
                s
                for s in ran
                if (s.command, s.container_id, s.ifname, s.exit_code)
                == (call.command, call.container_id or "-", call.ifname or "-", call.exit_code)
            ]
            assert matching, f"{call.command} not run by the CNI server: {call}; it ran {ran}"
            if call.netns and call.command != "VERSION":
                assert any(s.how == "its namespace passed as an fd" for s in matching), (call, matching)

    @property
    def state_dir(self) -> str:
        return os.path.join(self.root, "state")

    @property
    def ipam_dir(self) -> str:
        return os.path.join(self.root, "ipam")

    @property
    def log_file(self) -> str:
        return os.path.join(self.root, "rdma-cni.log")

    def plugin_entry(self, **extra: Any) -> dict[str, Any]:
        """The rdma-cni entry of the tier's conflist."""
        return {
            "type": "rdma-cni",
            "stateDir": self.state_dir,
            "lockFile": os.path.join(self.root, "rdma-cni.lock"),
            "logFile": self.log_file,
            "logLevel": "debug",
            "ipam": {"type": "host-local", "ranges": [[{"subnet": self.subnet}]], "dataDir": self.ipam_dir},
            **extra,
        }

    def conflist(self, name: str, **extra: Any) -> dict[str, Any]:
        return {"cniVersion": "1.0.0", "name": name, "plugins": [self.plugin_entry(**extra)]}

    def records(self) -> list[str]:
        d = os.path.join(self.state_dir, "attachments")
        return sorted(os.listdir(d)) if os.path.isdir(d) else []

    def leases(self) -> list[str]:
        """Addresses host-local holds for any network of this tier."""
        out = []
        if os.path.isdir(self.ipam_dir):
            for net in os.listdir(self.ipam_dir):
                out += [
                    n for n in os.listdir(os.path.join(self.ipam_dir, net)) if n[0].isdigit() and "." in n
                ]
        return sorted(n for n in out if not n.startswith("last_reserved_ip"))

    def host_vf_names(self) -> set[str]:
        prefix = self.node.prefix
        return {n for n in SimNode.host_links() if n.startswith(prefix) and "v" in n[len(prefix) :]}

    def expected_vf_names(self) -> set[str]:
        return {self.node.vf_netdev(k, i) for k, i in self.node.all_vfs()}

    def pf_settings(self) -> dict[str, dict[str, Any]]:
        return {
            f"{pf}/{vf}": s
            for pf, table in self.node.vf_state().get("pfs", {}).items()
            for vf, s in table.items()
        }

    def plugin_log(self) -> str:
        try:
            with open(self.log_file) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def assert_released(self) -> None:
        """Every VF back in the host under its name, no record, no lease, PF-side settings at rest."""
        assert self.host_vf_names() == self.expected_vf_names()
        assert self.records() == []
        assert self.leases() == []
        for key, s in self.pf_settings().items():
            assert s.get("rate", [0, 0]) == [0, 0], f"{key} rate left at {s['rate']}"
            assert s.get("mac", "00:00:00:00:00:00") == "00:00:00:00:00:00", f"{key} MAC left at {s['mac']}"


@pytest.fixture(scope="session")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    server = ApiServer(str(tmp_path_factory.mktemp("api")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def mode() -> str:
    """How the plugin is installed: the shim and the agent's CNI server, as shipped.

    A test parametrizes ``mode`` with ``FAT`` too where the fat binary is to be run.
    """
    return SHIM


@pytest.fixture
def tier(tmp_path: Any, api_server: ApiServer, mode: str) -> Iterator[Tier]:
    """A fresh simulated node (one 25 Gbit/s PF with 4 VFs) and the plugin installed for a runtime.

    With the shim, its CNI server is serving when the test starts.
    """
    api_server.reset()
    n = next(_counter)
    prefix = f"r{os.getpid() % 100000:05d}{n % 10}"  # unique beside other test sessions: 7 characters
    node = SimNode(str(tmp_path / "node"), [SimPf(f"{prefix}pf", 4, 25000)], prefix=prefix)
    node.up()
    tier = None
    try:
        plugin = PluginInstall(str(tmp_path / "plugin"), BINARY, node.env(), mode)
        tier = Tier(str(tmp_path), node, plugin, f"10.79.{n % 250}.0/24")
        if mode == SHIM:
            with open(plugin.shim, "rb") as f, open(SHIM_BINARY, "rb") as g:
                assert f.read() == g.read(), "the installer did not put the shim in the CNI bin dir"
            tier.start_server()
        yield tier
    finally:
        if tier is not None:
            tier.stop_server()
        node.down()


def dump(doc: Any) -> str:
    return json.dumps(doc, indent=1, sort_keys=True)
