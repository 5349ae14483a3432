"""The node agent against the HTTPS API stand-in: publish on change, never write an unchanged state, retry."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from rdma_cni.agent import capacity, loop, publish, snapshot
from rdma_cni.kube import client as kubeapi
from rdma_cni.shared import nodestate
from tests.integration.conftest import REPO, Cluster, plugin_command
from tests.support import waiting

_names = itertools.count()


def node_name() -> str:
    return f"agent-node-{os.getpid()}-{next(_names)}"


def conf_file(cluster: Cluster, **overrides: Any) -> str:
    path = os.path.join(cluster.tmp, "agent-net.conflist")
    entry = cluster.conf(**overrides)
    doc = {"cniVersion": entry.pop("cniVersion"), "name": entry.pop("name"), "plugins": [entry]}
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def published(cluster: Cluster, name: str) -> nodestate.NodeState | None:
    node = cluster.api.get_node(name) or {}
    text = (node.get("metadata", {}).get("annotations") or {}).get(nodestate.ANNOTATION)
    if not text:
        return None
    try:
        return nodestate.decode(text)
    except nodestate.NodeStateError:
        return None  # not (yet) the agent's


def patches(cluster: Cluster, name: str) -> int:
    return sum(
        1 for r in cluster.api.requests_seen if r.method == "PATCH" and r.path.endswith(f"/nodes/{name}")
    )


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    return waiting.wait_for(check, timeout, what, interval=0.02)


@contextmanager
def running(agent: loop.Agent) -> Iterator[threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=loop.run_agent, args=(agent, stop), daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(10)
        assert not thread.is_alive()


def make_agent(cluster: Cluster, name: str, kubeconfig: str | None = None, **kwargs: Any) -> loop.Agent:
    agent = loop.setup_agent(
        node_name=name,
        network_configs=[conf_file(cluster)],
        kubeconfig=kubeconfig or os.path.join(cluster.tmp, "kubeconfig"),
        period=kwargs.pop("period", 30.0),
        heartbeat=kwargs.pop("heartbeat", 300.0),
    )
    agent.publisher.max_backoff = kwargs.pop("max_backoff", publish.MAX_BACKOFF)
    assert not kwargs
    return agent


def test_publishes_the_node_follows_add_and_del_and_writes_nothing_unchanged(cluster: Cluster) -> None:
    name = node_name()
    cluster.api.add_node(name, labels={"kubernetes.io/hostname": name}, annotations={"other": "kept"})
    agent = make_agent(cluster, name, period=0.3)
    conf = cluster.conf()
    with running(agent):
        first = wait_for(lambda: published(cluster, name), 10, "the first publish")
        assert first.generation == 1 and first.allocations == ()
        assert nodestate.same_content(first, snapshot.snapshot([snapshot.load_view(conf_file(cluster))]))
        assert cluster.api.get_node(name)["metadata"]["annotations"]["other"] == "kept"

        # Idle, with a periodic re-read every 0.3 s: not one more write.
        before = patches(cluster, name)
        reads = agent.snapshots
        wait_for(lambda: agent.snapshots >= reads + 3, 15, "three periodic re-reads")
        assert patches(cluster, name) == before == 1

        pod = cluster.pod([{"min_tx_rate": 15000, "max_tx_rate": 20000}, {}], name=f"p{os.getpid()}")
        assert cluster.run("ADD", pod, conf).ok
        added = time.monotonic()
        state = wait_for(
            lambda: (s := published(cluster, name)) and s.allocations and s, 5, "the ADD to be published"
        )
        latency = time.monotonic() - added
        assert latency < 1.0, f"ADD published after {latency:.2f} s"
        assert state.generation == 2
        (alloc,) = state.allocations
        assert (alloc.namespace, alloc.name) == ("default", f"p{os.getpid()}")
        assert [(i.min_tx_rate, i.max_tx_rate) for i in alloc.interfaces] == [(15000, 20000), (0, 0)]
        assert sum(p.used_vfs for p in state.pfs) == 2

        assert cluster.run("DEL", pod, conf).ok
        removed = time.monotonic()
        back = wait_for(
            lambda: (s := published(cluster, name)) and s.generation == 3 and s, 5, "the DEL to be published"
        )
        assert time.monotonic() - removed < 1.0
        assert nodestate.same_content(back, first)
        time.sleep(0.6)
        assert patches(cluster, name) == 3


def test_a_burst_of_changes_is_one_write(cluster: Cluster) -> None:
    name = node_name()
    cluster.api.add_node(name)
    agent = make_agent(cluster, name)
    conf = cluster.conf(ipam=None)
    with running(agent):
        wait_for(lambda: published(cluster, name), 10, "the first publish")
        pods = [cluster.pod([{}]) for _ in range(3)]
        for pod in pods:
            assert cluster.run_inproc("ADD", pod, conf).ok
        wait_for(lambda: len(published(cluster, name).allocations) == 3, 5, "three pods published")
        time.sleep(0.5)
        # three ADDs in well under the debounce window, or nearly: at most one intermediate write
        assert patches(cluster, name) <= 3
        for pod in pods:
            assert cluster.run_inproc("DEL", pod, conf).ok


def test_5xx_and_409_are_retried_with_backoff(cluster: Cluster) -> None:
    name = node_name()
    cluster.api.add_node(name)
    cluster.api.fail_next(1000, 503)
    agent = make_agent(cluster, name, max_backoff=2.0)
    with running(agent):
        time.sleep(3.0)

        def settled() -> int | None:
            # A try the API stand-in has counted may not have been counted as failed by the agent
            # yet (a loaded machine): read both between tries.
            count = cluster.api.request_count
            return count if count and agent.publisher.failures == count else None

        tried = wait_for(settled, 5, "the agent's failure count to match the API's request count")
        # Backoff 0.5, 1, 2, 2 s (each jittered down to half at most): a few tries, not one per 0.1 s tick.
        assert 2 <= tried <= 9, tried
        assert published(cluster, name) is None
        cluster.api.reset()
        cluster.api.fail_next(1, 409)
        state = wait_for(lambda: published(cluster, name), 10, "the publish after the API recovered")
        assert state.generation == 1
        # The agent sees its PATCH answered a moment after the API server stored it.
        wait_for(lambda: agent.publisher.last_error == "", 5, "the agent to say it recovered")


def test_api_server_unreachable_never_stops_the_loop(cluster: Cluster) -> None:
    name = node_name()
    bad = os.path.join(cluster.tmp, "unreachable.kubeconfig")
    cluster.api.write_kubeconfig(bad, mode="token")
    with open(bad) as f:
        doc = json.load(f)
    doc["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:1"  # nothing listens there
    with open(bad, "w") as f:
        json.dump(doc, f)
    agent = make_agent(cluster, name, kubeconfig=bad, max_backoff=1.0)
    with running(agent) as thread:
        time.sleep(2.5)
        assert thread.is_alive()
        assert 2 <= agent.publisher.failures <= 10
        assert "Unavailable" in agent.publisher.last_error
        # The node is still read, ready for when the API comes back.
        assert agent.snapshots >= 1


def test_missing_node_is_retried_until_it_exists(cluster: Cluster) -> None:
    name = node_name()
    agent = make_agent(cluster, name, max_backoff=0.5)
    with running(agent):
        wait_for(lambda: agent.publisher.failures >= 1, 5, "a 404")
        assert "NotFound" in agent.publisher.last_error
        cluster.api.add_node(name)
        assert wait_for(lambda: published(cluster, name), 5, "publish once the node exists").generation == 1


def test_restart_continues_the_generation_and_replaces_garbage(cluster: Cluster) -> None:
    name = node_name()
    cluster.api.add_node(name, annotations={nodestate.ANNOTATION: "{not json"})
    agent = make_agent(cluster, name)
    with running(agent):
        assert wait_for(lambda: published(cluster, name), 10, "publish over garbage").generation == 1
    restarted = make_agent(cluster, name)
    with running(restarted):
        # A new process cannot know how old the Node's copy is: it writes once, continuing the count.
        assert wait_for(lambda: (s := published(cluster, name)) and s.generation == 2, 10, "gen 2")
        time.sleep(0.5)
        assert restarted.publisher.writes == 1


def test_heartbeat_rewrites_an_unchanged_state(cluster: Cluster) -> None:
    name = node_name()
    cluster.api.add_node(name)
    agent = make_agent(cluster, name, period=0.2, heartbeat=0.5)
    with running(agent):
        wait_for(lambda: (s := published(cluster, name)) and s.generation >= 3, 5, "heartbeat writes")
    assert 3 <= agent.publisher.writes <= 6


def test_the_nodes_rdma_resources_are_advertised_in_its_status_and_kept_there(cluster: Cluster) -> None:
    name = node_name()
    cluster.api.add_node(name)
    before = cluster.api.get_node(name)["status"]
    agent = make_agent(cluster, name, period=0.2, heartbeat=0.5)

    def shown() -> dict[str, str] | None:
        status = cluster.api.get_node(name)["status"]
        ours = {k: v for k, v in status["capacity"].items() if k.startswith("rdma-cni.io/")}
        return (
            ours if ours and ours == {k: v for k, v in status["allocatable"].items() if k in ours} else None
        )

    with running(agent):
        state = wait_for(lambda: published(cluster, name), 10, "the first publish")
        wanted = capacity.resources(state)
        assert wait_for(shown, 10, "the RDMA resources in the status") == wanted
        assert int(wanted[nodestate.VF_RESOURCE]) == sum(p.capacity_vfs for p in state.pfs) > 0
        # The rest of the status is the kubelet's, untouched.
        status = cluster.api.get_node(name)["status"]
        assert {k: v for k, v in status["capacity"].items() if k not in wanted} == before["capacity"]
        assert status["conditions"] == before["conditions"]
        # The kubelet sets extended resources to 0 when it starts without its checkpoint: the next
        # heartbeat of the state writes them again.
        zero = {k: "0" for k in wanted}
        with kubeapi.ApiClient.from_kubeconfig(os.path.join(cluster.tmp, "kubeconfig")) as client:
            client.patch_merge(
                f"/api/v1/nodes/{name}/status", {"status": {"capacity": zero, "allocatable": zero}}
            )
        assert wait_for(lambda: shown() == wanted and wanted, 10, "the resources advertised again")


def test_unlistable_records_publish_that_nothing_fits_until_fixed(cluster: Cluster) -> None:
    name = node_name()
    cluster.api.add_node(name)
    os.makedirs(cluster.state_dir)
    bad = os.path.join(cluster.state_dir, "attachments")
    with open(bad, "w") as f:
        f.write("not a directory")
    agent = make_agent(cluster, name)
    with running(agent):
        state = wait_for(lambda: published(cluster, name), 10, "the first publish")
        assert state.pfs == () and state.allocations == ()
        os.unlink(bad)
        fixed = wait_for(lambda: (s := published(cluster, name)) and s.pfs and s, 5, "the repaired state")
        assert [p.name for p in fixed.pfs] == ["simpf0", "simpf1"]


def test_rotated_token_is_picked_up_after_a_401(cluster: Cluster) -> None:
    name = node_name()
    cluster.api.add_node(name)
    path = os.path.join(cluster.tmp, "rotating.kubeconfig")
    cluster.api.write_kubeconfig(path, mode="token", token="expired-token")
    agent = make_agent(cluster, name, kubeconfig=path, max_backoff=0.5)
    with running(agent):
        wait_for(lambda: agent.publisher.failures >= 1, 5, "a 401")
        cluster.api.write_kubeconfig(path, mode="token")
        assert wait_for(lambda: published(cluster, name), 5, "publish with the new token").generation == 1


def nri_handshake(conn: socket.socket) -> bytes:
    """Take the plugin's registration as a runtime would, then ask CreateContainer; its answer's payload."""
    from rdma_cni.agent.nri import mux, plugin, ttrpc
    from rdma_cni.agent.nri import nri_api_pb2 as api

    readers = {1: ttrpc.Reader(), 2: ttrpc.Reader()}

    def next_message() -> tuple[int, ttrpc.Message]:
        while True:
            cid, payload = mux.read_frame(conn)
            for msg in readers[cid].feed(payload):
                return cid, msg

    cid, msg = next_message()
    assert cid == mux.RUNTIME_CONN and ttrpc.decode_request(msg.payload).method == "RegisterPlugin"
    ok = ttrpc.encode_response(ttrpc.Response(0, "", b""))
    mux.send_frame(conn, mux.RUNTIME_CONN, ttrpc.encode_message(msg.stream, ttrpc.TYPE_RESPONSE, ok))
    pod = api.CreateContainerRequest(pod=api.PodSandbox(id="no-such-sandbox")).SerializeToString()
    req = ttrpc.encode_request(ttrpc.Request(plugin.PLUGIN_SERVICE, "CreateContainer", pod))
    mux.send_frame(conn, mux.PLUGIN_CONN, ttrpc.encode_message(1, ttrpc.TYPE_REQUEST, req))
    cid, msg = next_message()
    assert (cid, msg.stream, msg.type) == (mux.PLUGIN_CONN, 1, ttrpc.TYPE_RESPONSE)
    resp = ttrpc.decode_response(msg.payload)
    assert resp.code == 0, resp.message
    return resp.payload


def test_install_watch_node_state_publishes_and_stops_on_sigterm(cluster: Cluster, tmp_path: Any) -> None:
    name = node_name()
    nri_socket = str(tmp_path / "nri.sock")
    runtime = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    runtime.bind(nri_socket)
    runtime.listen()
    runtime.settimeout(20)
    cluster.api.add_node(name)
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("installer-token")
    with open(_ca_of(cluster)) as f:
        (sa / "ca.crt").write_text(f.read())
    source = tmp_path / "rdma-cni-bin"
    source.write_bytes(b"#!/bin/sh\n")
    with socket.socket() as probe:  # a free port for the agent's /metrics
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "NODE_NAME": name,
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(cluster.api.port),
        "PYTHONPATH": REPO,
    }
    proc = subprocess.Popen(
        [
            *plugin_command(),
            "install",
            "--watch",
            "--node-state",
            f"--source={source}",
            f"--cni-bin-dir={tmp_path / 'bin'}",
            f"--kubeconfig-path={tmp_path / 'net.d' / 'rdma-cni.kubeconfig'}",
            f"--serviceaccount-dir={sa}",
            f"--network-config={conf_file(cluster)}",
            f"--api-kubeconfig={os.path.join(cluster.tmp, 'kubeconfig')}",
            f"--nri-socket={nri_socket}",
            f"--metrics-listen=127.0.0.1:{port}",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        state = wait_for(lambda: published(cluster, name), 20, "the installer's agent to publish")
        assert [p.name for p in state.pfs] == ["simpf0", "simpf1"]
        # The same process is the NRI plugin: it registers on the runtime's socket and answers.
        conn, _ = runtime.accept()
        with conn:
            conn.settimeout(20)
            assert nri_handshake(conn) == b""  # a container of a pod without attachments: no adjustment
        # Its /metrics: one write, and per PF what the Node now says.
        written = ("rdma_cni_agent_publishes_total", (("outcome", "written"),))
        # Counted just after the PATCH returns: a scrape may come between the two.
        page = wait_for(lambda: (got := _scrape(port)) and written in got and got, 10, "the agent's /metrics")
        assert page[written] == 1
        assert page[("rdma_cni_agent_last_publish_timestamp_seconds", ())] > time.time() - 60
        for pf in state.pfs:
            labels = (("node", name), ("pf", pf.name))
            assert page[("rdma_cni_node_pf_capacity_vfs", labels)] == pf.capacity_vfs
            assert page[("rdma_cni_node_pf_used_vfs", labels)] == pf.used_vfs
            assert page[("rdma_cni_node_pf_used_mbps", labels)] == pf.used_tx_rate
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert f"publishing node state on node {name}" in out
    assert "published node state generation 1" in err
    assert f"NRI: registered with the runtime at {nri_socket}" in err
    runtime.close()


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
    """Every sample of the agent's /metrics, None while it does not answer yet."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _ca_of(cluster: Cluster) -> str:
    with open(os.path.join(cluster.tmp, "kubeconfig")) as f:
        doc = json.load(f)
    ca = doc["clusters"][0]["cluster"]["certificate-authority"]
    return ca if os.path.isabs(ca) else os.path.join(cluster.tmp, ca)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--node-state"], {"NODE_NAME": "n"}, "--node-state needs --watch"),
        (["--watch", "--network-config=x"], {}, "--network-config needs --node-state, or --mode shim"),
        (["--watch", "--metrics-listen=127.0.0.1:0"], {}, "--metrics-listen need --node-state"),
        (
            ["--watch", "--node-state", "--metrics-listen=nowhere"],
            {"NODE_NAME": "n"},
            "'nowhere': expected ADDR",
        ),
        (
            ["--watch", "--node-state", "--metrics-listen=203.0.113.1:2"],
            {"NODE_NAME": "n"},
            "node agent: cannot serve metrics on 203.0.113.1:2: ",
        ),
        (
            ["--watch", "--node-state"],
            {"NODE_NAME": "Bad_Name"},
            "NODE_NAME 'Bad_Name' is not a valid node name",
        ),
        (["--watch", "--node-state"], {}, "NODE_NAME '' is not a valid node name"),
        (
            ["--watch", "--node-state", "--network-config=/nonexistent/net.conf"],
            {"NODE_NAME": "n"},
            "cannot read network config /nonexistent/net.conf",
        ),
    ],
)
def test_install_refuses_a_bad_agent_setup(
    tmp_path: Any, args: list[str], env: dict[str, str], message: str
) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("t")
    (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    source = tmp_path / "src"
    source.write_bytes(b"x")
    proc = subprocess.run(
        [
            *plugin_command(),
            "install",
            *args,
            f"--source={source}",
            f"--cni-bin-dir={tmp_path / 'bin'}",
            f"--kubeconfig-path={tmp_path / 'kc'}",
            f"--serviceaccount-dir={sa}",
            "--max-iterations=1",
            "--interval=0.1",
        ],
        env={
            "PATH": os.environ["PATH"],
            "PYTHONPATH": REPO,
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": "6443",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode in (1, 2), proc.stderr
    assert message in proc.stderr


def test_the_node_lock_is_never_held_across_an_api_call(cluster: Cluster) -> None:
    name = node_name()
    cluster.api.add_node(name)
    agent = make_agent(cluster, name)
    # Pods without Kubernetes arguments: ADD itself then never waits for the (hanging) API.
    conf = cluster.conf(ipam=None)
    first, second = ({**cluster.pod(None), "CNI_ARGS": "IgnoreUnknown=true"} for _ in range(2))
    with running(agent):
        wait_for(lambda: published(cluster, name), 10, "the first publish")
        before = patches(cluster, name)
        cluster.api.hang(4.0)
        try:
            assert cluster.run_inproc("ADD", first, conf).ok
            # The agent notices, reads the node and sends its PATCH, which now hangs.
            wait_for(lambda: patches(cluster, name) > before, 5, "the agent's PATCH to arrive")
            started = time.monotonic()
            assert cluster.run_inproc("ADD", second, conf).ok
            took = time.monotonic() - started
        finally:
            cluster.api.hang(0)
        assert took < 2.0, f"ADD waited {took:.1f} s for the node lock while the agent talked to the API"
        for pod in (first, second):
            assert cluster.run_inproc("DEL", pod, conf).ok


@pytest.mark.parametrize("case", ["shared pf", "no kubelet registry"])
def test_install_refuses_a_bad_dra_setup(tmp_path: Any, case: str) -> None:
    def conflist(name: str, **fields: Any) -> str:
        path = tmp_path / f"{name}.conflist"
        entry = {
            "type": "rdma-cni",
            "stateDir": str(tmp_path / "state"),
            "lockFile": str(tmp_path / "lock"),
            **fields,
        }
        path.write_text(json.dumps({"cniVersion": "1.1.0", "name": name, "plugins": [entry]}))
        return f"--network-config={path}"

    args = ["--watch", "--node-state", conflist("rdma-dra", pfs=["p0"], dra=True)]
    if case == "shared pf":
        args.append(conflist("rdma-net", pfs=["p0", "p1"]))
        message = (
            "node agent: PF p0 is in DRA network rdma-dra and in network rdma-net: a PF belongs to one path"
        )
    else:
        (tmp_path / "registry").write_text("a file where kubelet's plugin registry should be")
        args.append(f"--kubelet-registry-dir={tmp_path / 'registry'}")
        args.append(f"--kubelet-plugin-dir={tmp_path / 'plugin'}")
        message = "node agent: DRA kubelet plugin: "
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("t")
    (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    source = tmp_path / "src"
    source.write_bytes(b"x")
    proc = subprocess.run(
        [
            *plugin_command(),
            "install",
            *args,
            f"--source={source}",
            f"--cni-bin-dir={tmp_path / 'bin'}",
            f"--kubeconfig-path={tmp_path / 'kc'}",
            f"--serviceaccount-dir={sa}",
            "--nri-socket=",
            "--max-iterations=1",
            "--interval=0.1",
        ],
        env={
            "PATH": os.environ["PATH"],
            "PYTHONPATH": REPO,
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": "6443",
            "NODE_NAME": "n",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert message in proc.stderr
