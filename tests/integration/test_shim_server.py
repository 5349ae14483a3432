"""The thick design end to end: the static shim, the agent's CNI server, the plugin on the simulated node.

The shim is what a runtime executes (launcher/shim.c, built from source); the
server is ``rdma-cni cni-server`` of the plugin under test, which runs each
verb as the plugin. What a runtime sees must be what it sees of the plugin
itself: the same documents and codes, the runtime's CNI_NETNS in the result.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.conftest import HOST_LOCAL_DIR, Cluster, plugin_command
from tests.support.cniserver import CniServerProcess
from tests.support.fake_ipam import write_ipam
from tests.support.shim import build_shim, run_shim
from tests.support.simnode import ip


class ServerProcess(CniServerProcess):
    """``rdma-cni cni-server`` on a socket of the test's own, with the simulated node's environment."""

    def __init__(self, socket_path: str, cluster: Cluster) -> None:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **cluster.node.env()}
        log_path = os.path.join(cluster.tmp, "cni-server.log")
        state = (cluster.state_dir, cluster.conf()["lockFile"])
        super().__init__(plugin_command(), socket_path, env, log_path, state=state)


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_shim(str(tmp_path_factory.mktemp("shim")))


@pytest.fixture
def socket_path(cluster: Cluster) -> Iterator[str]:
    yield os.path.join(cluster.tmp, "agent", "cni.sock")


@pytest.fixture
def server(socket_path: str, cluster: Cluster) -> Iterator[ServerProcess]:
    s = ServerProcess(socket_path, cluster)
    yield s
    s.stop()


def call(shim: str, socket_path: str, cluster: Cluster, verb: str, pod: dict[str, str], conf: Any) -> Any:
    """Run the shim as a runtime would (the CNI_* variables only: the node's environment is the server's)."""
    env = {k: v for k, v in cluster.env(verb, pod).items() if k.startswith("CNI_")}
    return run_shim(shim, socket_path, env, json.dumps(conf).encode())


def test_add_check_del_through_the_shim(
    shim: str, socket_path: str, server: ServerProcess, cluster: Cluster
) -> None:
    pod = cluster.pod([{"max_tx_rate": 1000}])
    conf = cluster.conf()
    add = call(shim, socket_path, cluster, "ADD", pod, conf)
    assert add.code == 0, add
    result = add.doc
    assert result is not None
    # The runtime's CNI_NETNS, not the fd the server opened it through.
    assert {i.get("sandbox") for i in result["interfaces"]} == {pod["CNI_NETNS"]}
    assert len(cluster.records) == 1
    netns = os.path.basename(pod["CNI_NETNS"])
    assert "net1" in ip("-n", netns, "-br", "link").stdout
    check = call(shim, socket_path, cluster, "CHECK", pod, cluster.check_conf(conf, result))
    assert check.code == 0, check
    dele = call(shim, socket_path, cluster, "DEL", pod, conf)
    assert dele.code == 0, dele
    assert cluster.records == []
    assert "net1" not in ip("-n", netns, "-br", "link").stdout


def test_a_configuration_error_is_the_plugins_own(
    shim: str, socket_path: str, server: ServerProcess, cluster: Cluster
) -> None:
    pod = cluster.pod()
    conf = cluster.conf(lockTimeoutSeconds="soon")
    direct = cluster.run("ADD", pod, conf)
    through = call(shim, socket_path, cluster, "ADD", pod, conf)
    assert through.code == direct.code == 1
    assert through.doc == direct.doc
    assert through.doc is not None and "lockTimeoutSeconds" in json.dumps(through.doc)


def test_a_del_spooled_while_the_agent_is_down_runs_when_it_starts(
    shim: str, socket_path: str, cluster: Cluster
) -> None:
    pod = cluster.pod([{}])
    conf = cluster.conf()
    server = ServerProcess(socket_path, cluster)
    try:
        assert call(shim, socket_path, cluster, "ADD", pod, conf).code == 0
    finally:
        server.stop()
    down = call(shim, socket_path, cluster, "DEL", pod, conf)
    assert down.code == 0, down
    assert "DEL spooled" in down.stderr
    assert len(cluster.records) == 1  # the VF stays held until the agent runs the DEL
    # An ADD with the agent down is refused, not half done.
    other = cluster.pod([{}])
    refused = call(shim, socket_path, cluster, "ADD", other, conf)
    assert refused.code == 1 and refused.doc is not None and refused.doc["code"] == 11
    server = ServerProcess(socket_path, cluster)
    try:
        deadline = time.monotonic() + 60
        spool = os.path.join(cluster.tmp, "agent", "del-spool")
        # The DEL removes the record, then its runner the spooled request: wait for both.
        while cluster.records or os.listdir(spool):
            assert time.monotonic() < deadline, f"the spooled DEL did not run: {os.listdir(spool)}"
            time.sleep(0.1)
        assert cluster.ipam_allocations() == []
        assert call(shim, socket_path, cluster, "ADD", other, conf).code == 0
        assert call(shim, socket_path, cluster, "DEL", other, conf).code == 0
    finally:
        server.stop()


def test_a_verb_runs_as_a_runtime_runs_the_plugin(shim: str, socket_path: str, cluster: Cluster) -> None:
    # The built binary's bootloader points LD_LIBRARY_PATH at its own libraries: the verb's
    # environment (what the IPAM plugins it runs inherit) must be the server's as it was before,
    # plus the runtime's CNI_* variables, as if a runtime had run the plugin.
    bindir = os.path.join(cluster.tmp, "bin")
    dump = os.path.join(cluster.tmp, "ipam-env")
    write_ipam(bindir, "host-local", {"ADD": f"env > {dump}"})
    cluster.cni_path = f"{bindir}:{HOST_LOCAL_DIR}"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LD_LIBRARY_PATH_ORIG": "/opt/own/lib",
        "FROM_THE_NODE": "1",
        **cluster.node.env(),
    }
    server = CniServerProcess(
        plugin_command(),
        socket_path,
        env,
        os.path.join(cluster.tmp, "cni-server.log"),
        state=(cluster.state_dir, cluster.conf()["lockFile"]),
    )
    try:
        pod = cluster.pod([{}])
        conf = cluster.conf()
        assert call(shim, socket_path, cluster, "ADD", pod, conf).code == 0
        assert call(shim, socket_path, cluster, "DEL", pod, conf).code == 0
    finally:
        server.stop()
    with open(dump) as f:
        seen = dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)
    assert seen["CNI_COMMAND"] == "ADD" and seen["CNI_CONTAINERID"] == pod["CNI_CONTAINERID"]
    assert seen["FROM_THE_NODE"] == "1"
    assert seen.get("LD_LIBRARY_PATH") == "/opt/own/lib"
    assert not [k for k in seen if k.startswith(("_PYI_", "_MEI"))]
