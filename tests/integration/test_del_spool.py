"""The DEL spool with the real plugin on the simulated node: the five ways issue 36 found it broke.

Each test plays one of them through the shim (launcher/shim.c, built from
source) and the agent's CNI server, as the thick design runs on a node:

1. a rollout whose two agents both run one spooled DEL must leave the socket served;
2. a stale spooled DEL must never release a later ADD of the same container id and interface;
3. one network's failing spooled DEL must not hold up the ADDs of another;
4. a DEL spooled while the agent runs (busy) must run without waiting for an ADD;
5. after a reboot (``/run`` empty) a DEL before the agent is back must be spooled.

Where two agents are needed the servers run in this process as the node agent
runs them (``rdma_cni.install.command._start_cni_server``: try to start, else
take the socket over in the background), each running the plugin as a process.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rdma_cni.agent import delspool, shimwire
from rdma_cni.install.command import _start_cni_server
from tests.integration.conftest import HOST_LOCAL_DIR, Cluster, ns_name
from tests.integration.test_shim_server import ServerProcess, call
from tests.support.fake_ipam import write_ipam
from tests.support.shim import build_shim, run_shim
from tests.support.simnode import ip


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_shim(str(tmp_path_factory.mktemp("shim")))


@pytest.fixture
def socket_path(cluster: Cluster) -> str:
    return os.path.join(cluster.tmp, "agent", "cni.sock")


@contextlib.contextmanager
def node_lock_held(conf: dict[str, Any]) -> Iterator[None]:
    """Hold the network's node lock, as a long verb of another pod would."""
    fd = os.open(conf["lockFile"], os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def spool_files(socket_path: str) -> list[str]:
    """The spooled DELs, claimed (``.run-``) or not."""
    spool = delspool.spool_dir(socket_path)
    names = os.listdir(spool) if os.path.isdir(spool) else []
    return sorted(n for n in names if n.startswith(("del-", ".run-del-")))


def put_in_spool(socket_path: str, cluster: Cluster, pod: dict[str, str], conf: dict[str, Any]) -> None:
    """Spool a DEL as the shim does when the agent drops it (the agent is up meanwhile)."""
    env = {k: v for k, v in cluster.env("DEL", pod).items() if k.startswith("CNI_")}
    name = f"del-{pod['CNI_CONTAINERID']}-{pod['CNI_IFNAME'].encode().hex()}.req"  # as the shim names it
    path = os.path.join(delspool.spool_dir(socket_path), name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, shimwire.encode_request(env, json.dumps(conf).encode()))
    os.close(fd)


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def in_pod(pod: dict[str, str]) -> str:
    return ip("-n", ns_name(pod), "-br", "link").stdout


class Agent:
    """One agent's CNI server, in this process, as the node agent starts it (take-over included)."""

    def __init__(self, socket_path: str) -> None:
        self.stop = threading.Event()
        self.out = io.StringIO()
        self.thread, _ = _start_cni_server(socket_path, (), self.stop, self.out)

    def close(self, timeout: float = 60) -> None:
        self.stop.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the agent's CNI server did not stop"


# 1. A rollout.


def test_a_rollout_whose_agents_both_run_a_spooled_del_leaves_the_socket_served(
    shim: str, socket_path: str, cluster: Cluster
) -> None:
    conf = cluster.conf()
    pod, other = cluster.pod([{}]), cluster.pod([{}])
    old = Agent(socket_path)
    new: Agent | None = None
    try:
        wait_for(lambda: os.path.exists(socket_path), 30, "the old agent never served")
        assert call(shim, socket_path, cluster, "ADD", pod, conf).code == 0
        adding: list[Any] = []
        with node_lock_held(conf):
            # The old agent is busy with this DEL (it waits for the node lock)...
            put_in_spool(socket_path, cluster, pod, conf)
            caller = threading.Thread(
                target=lambda: adding.append(call(shim, socket_path, cluster, "ADD", other, conf)),
                daemon=True,
            )
            caller.start()
            time.sleep(2)
            # ...when the new agent starts beside it, and the old one is stopped: the new one takes over.
            new = Agent(socket_path)
            time.sleep(0.5)
            threading.Thread(target=old.close, daemon=True).start()
            time.sleep(3)
        caller.join(60)
        old.thread.join(60)
        assert adding and adding[0].code == 0, adding
        # The socket is served after the rollout: ADDs are taken, DELs are not spooled.
        third = cluster.pod([{}])
        add = call(shim, socket_path, cluster, "ADD", third, conf)
        assert add.code == 0, add
        wait_for(lambda: spool_files(socket_path) == [], 30, "the spooled DEL never ran")
        assert pod["CNI_CONTAINERID"] not in json.dumps([cluster.records])
        assert "net1" not in in_pod(pod)
        for p in (other, third):
            assert call(shim, socket_path, cluster, "DEL", p, conf).code == 0
        assert spool_files(socket_path) == [] and cluster.records == []
    finally:
        old.close()
        if new is not None:
            new.close()


# 2. A stale spooled DEL and a reused container id.


def test_a_stale_spooled_del_never_takes_the_vf_of_a_later_add_of_the_same_container(
    shim: str, socket_path: str, cluster: Cluster
) -> None:
    conf = cluster.conf(lockTimeoutSeconds=2)
    pod = cluster.pod([{}])
    server = ServerProcess(socket_path, cluster)
    assert call(shim, socket_path, cluster, "ADD", pod, conf).code == 0
    server.stop()
    assert call(shim, socket_path, cluster, "DEL", pod, conf).code == 0  # spooled
    with node_lock_held(conf):
        server = ServerProcess(socket_path, cluster)
        time.sleep(3)  # its run of the spooled DEL fails: the node lock is busy
    try:
        assert spool_files(socket_path), "the spooled DEL should still wait"
        # The runtime's own DEL of the container is served directly...
        assert call(shim, socket_path, cluster, "DEL", pod, conf).code == 0
        assert cluster.records == []
        # ...and the same container id and interface are added again while another pod holds the
        # node lock for 3 s: longer than a DEL waits for it (2 s), not longer than the ADD then would.
        first: list[Any] = []
        adding = threading.Thread(
            target=lambda: first.append(call(shim, socket_path, cluster, "ADD", pod, conf))
        )
        with node_lock_held(conf):
            adding.start()
            time.sleep(3)
        adding.join(60)
        added = first[0] if first and first[0].code == 0 else None
        for _ in range(10):  # retried as kubelet retries
            if added is not None:
                break
            out = call(shim, socket_path, cluster, "ADD", pod, conf)
            if out.code == 0:
                added = out
            else:
                assert out.doc is not None and out.doc["code"] == 11, out
                time.sleep(1)
        assert added is not None, "the ADD never succeeded"
        assert "net1" in in_pod(pod) and len(cluster.records) == 1
        # Passes of the spool (the runner's, and whatever an ADD of another pod does) leave it alone.
        other = cluster.pod([{}])
        assert call(shim, socket_path, cluster, "ADD", other, conf).code == 0
        time.sleep(6)  # a few passes of the runner (it retries a failure after 2 s, then 4 s)
        assert "net1" in in_pod(pod), "a stale spooled DEL released the VF of a running container"
        assert len(cluster.records) == 2 and spool_files(socket_path) == []
        for p in (pod, other):
            assert call(shim, socket_path, cluster, "DEL", p, conf).code == 0
        assert cluster.records == []
    finally:
        server.stop()


# 3. One network's failing spooled DEL and another network's ADDs.


def _two_networks(cluster: Cluster, same_lock: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Network A, whose IPAM DEL hangs past its 4 s timeout, and network B on the other PF."""
    bindir = os.path.join(cluster.tmp, "bin")
    write_ipam(bindir, "hangs-on-del", {"DEL": "cat >/dev/null; exec sleep 60"})
    cluster.cni_path = f"{bindir}:{HOST_LOCAL_DIR}"
    a = cluster.conf(name="net-a", pfs=["simpf0"], stateDir=os.path.join(cluster.tmp, "state-a"))
    a["ipam"] = {**a["ipam"], "type": "hangs-on-del"}
    a["ipamTimeoutSeconds"] = 4
    b = cluster.conf(
        name="net-b",
        pfs=["simpf1"],
        stateDir=os.path.join(cluster.tmp, "state-b"),
        lockFile=a["lockFile"] if same_lock else os.path.join(cluster.tmp, "lock-b"),
    )
    b["ipam"] = {**b["ipam"], "ranges": [[{"subnet": "10.78.0.0/24"}]]}
    return a, b


@pytest.mark.parametrize("same_lock", [False, True], ids=["own-lock", "shared-node-lock"])
def test_a_failing_spooled_del_never_holds_up_another_networks_adds(
    shim: str, socket_path: str, cluster: Cluster, same_lock: bool
) -> None:
    net_a, net_b = _two_networks(cluster, same_lock)
    pod_a = cluster.pod([{}])
    server = ServerProcess(socket_path, cluster)
    assert call(shim, socket_path, cluster, "ADD", pod_a, net_a).code == 0
    server.stop()
    assert call(shim, socket_path, cluster, "DEL", pod_a, net_a).code == 0  # spooled
    server = ServerProcess(socket_path, cluster)
    pods = [cluster.pod([{}]) for _ in range(3)]
    took: list[float] = []
    try:

        def add(p: dict[str, str]) -> None:
            began = time.monotonic()
            out = call(shim, socket_path, cluster, "ADD", p, net_b)
            assert out.code == 0, out
            took.append(time.monotonic() - began)

        time.sleep(0.5)  # the runner is in the spooled DEL's hanging IPAM by now
        callers = [threading.Thread(target=add, args=(p,)) for p in pods]
        for c in callers:
            c.start()
        for c in callers:
            c.join(120)
        assert len(took) == 3
        # Bound: with its own lock an ADD never waits for the spool; sharing the node lock, at most
        # one spooled DEL's hold of it (that network's ipamTimeoutSeconds), not one per ADD.
        bound = 3.0 if not same_lock else net_a["ipamTimeoutSeconds"] + 3.0
        assert max(took) < bound, f"ADDs of another network took {sorted(took)} s"
        # The failing DEL gave the VF back all the same (the lease release waits, and is retried).
        wait_for(
            lambda: os.listdir(os.path.join(net_a["stateDir"], "attachments")) == [], 30, "VF not released"
        )
        assert spool_files(socket_path) != []
    finally:
        server.stop()
        for p in pods:
            call(shim, socket_path, cluster, "DEL", p, net_b)


# 4. A DEL spooled while the agent runs.


def test_a_del_spooled_while_the_agent_is_busy_runs_with_no_add_coming(
    shim: str, socket_path: str, cluster: Cluster
) -> None:
    conf = cluster.conf()
    pod = cluster.pod([{}])
    server = ServerProcess(socket_path, cluster)
    try:
        assert call(shim, socket_path, cluster, "ADD", pod, conf).code == 0
        put_in_spool(socket_path, cluster, pod, conf)  # the shim found the agent busy a moment ago
        wait_for(lambda: cluster.records == [], 15, "the DEL spooled while the agent ran never ran")
        assert "net1" not in in_pod(pod)
        assert cluster.ipam_allocations() == [] and spool_files(socket_path) == []
        assert "ran the spooled DEL" in server.log()
    finally:
        server.stop()


# 5. A reboot.


def test_after_a_reboot_a_del_before_the_agent_is_spooled_and_run_when_it_starts(
    shim: str, cluster: Cluster
) -> None:
    conf = cluster.conf()
    run = os.path.join(cluster.tmp, "run")
    socket_path = os.path.join(run, "rdma-cni", "agent", "cni.sock")
    pod = cluster.pod([{}])
    server = ServerProcess(socket_path, cluster)
    assert call(shim, socket_path, cluster, "ADD", pod, conf).code == 0
    server.stop()
    # The reboot: /run is a fresh tmpfs; the records (on /var/lib) are kept.
    subprocess.run(["rm", "-rf", os.path.join(run, "rdma-cni")], check=True)
    os.chmod(run, 0o755)
    out = call(shim, socket_path, cluster, "DEL", pod, conf)
    assert out.code == 0, out
    assert "DEL spooled" in out.stderr
    assert stat.S_IMODE(os.stat(os.path.join(run, "rdma-cni")).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(os.path.dirname(socket_path)).st_mode) == 0o700
    assert len(spool_files(socket_path)) == 1 and len(cluster.records) == 1
    server = ServerProcess(socket_path, cluster)
    try:
        wait_for(lambda: cluster.records == [], 30, "the DEL spooled after the reboot never ran")
        assert spool_files(socket_path) == [] and cluster.ipam_allocations() == []
        other = cluster.pod([{}])
        assert call(shim, socket_path, cluster, "ADD", other, conf).code == 0
        assert call(shim, socket_path, cluster, "DEL", other, conf).code == 0
    finally:
        server.stop()
    assert run_shim(shim, socket_path, {"CNI_COMMAND": "VERSION"}, b"").code == 0
