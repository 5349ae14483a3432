"""Fixtures for the runtime tier: real container runtimes driving the built plugin on the simulated node.

containerd (over CRI, from our own small client) and podman (CNI backend)
run the built ``dist/rdma-cni`` from their CNI bin directories through a
wrapper that logs what each runtime passed. Needs root and the Debian
packages ``make deps`` installs.
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

from tests.runtime.harness import HOST_LOCAL_DIR, PluginInstall
from tests.support.apiserver import ApiServer
from tests.support.simnode import SimNode, SimPf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if os.geteuid() != 0:
    pytest.skip("the runtime tier needs root (containerd, podman, netns)", allow_module_level=True)
_missing = [t for t in ("containerd", "ctr", "podman", "runc", "conmon", "nsenter") if not shutil.which(t)]
if _missing or not os.path.exists(os.path.join(HOST_LOCAL_DIR, "host-local")):
    pytest.fail(f"the runtime tier needs {_missing or 'host-local'}: run make deps", pytrace=False)
# make runtime names the binary it just built; a bare pytest uses dist/ if it is there.
BINARY = os.environ.get("RDMA_CNI_BINARY") or os.path.join(REPO, "dist", "rdma-cni")
if not os.access(BINARY, os.X_OK):
    pytest.fail(f"{BINARY} is not built: run make runtime", pytrace=False)

_counter = itertools.count()


@dataclass
class Tier:
    """One run's simulated node, plugin install and network settings."""

    root: str
    node: SimNode
    plugin: PluginInstall
    subnet: str

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
def tier(tmp_path: Any, api_server: ApiServer) -> Iterator[Tier]:
    """A fresh simulated node (one 25 Gbit/s PF with 4 VFs) and the plugin installed for a runtime."""
    api_server.reset()
    n = next(_counter)
    prefix = f"r{os.getpid() % 100000:05d}{n % 10}"  # unique beside other test sessions: 7 characters
    node = SimNode(str(tmp_path / "node"), [SimPf(f"{prefix}pf", 4, 25000)], prefix=prefix)
    node.up()
    try:
        plugin = PluginInstall(str(tmp_path / "plugin"), BINARY, node.env())
        yield Tier(str(tmp_path), node, plugin, f"10.79.{n % 250}.0/24")
    finally:
        node.down()


def dump(doc: Any) -> str:
    return json.dumps(doc, indent=1, sort_keys=True)
