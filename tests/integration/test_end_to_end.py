"""End to end: node agent -> API stand-in -> extender (a real process) -> bind -> ADD -> republish.

kube-scheduler's part is played by HTTP requests shaped as it sends them in
nodeCacheCapable mode; everything else is real: the agent reads the
simulated node and publishes over HTTPS, the extender process lists and
watches Nodes and creates the Binding, the plugin's ADD runs for the bound
pod, and the agent's republication ends the extender's reservation.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.conftest import REPO, Cluster, plugin_command
from tests.integration.test_agent_publish import make_agent, node_name, published, running, wait_for
from tests.support import sched_objects as so


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Extender:
    """The extender process and kube-scheduler's HTTP side of it."""

    def __init__(self, cluster: Cluster) -> None:
        self.port = free_port()
        self.log = open(os.path.join(cluster.tmp, "extender.log"), "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                *plugin_command(),
                "scheduler-extender",
                f"--listen=127.0.0.1:{self.port}",
                f"--kubeconfig={os.path.join(cluster.tmp, 'kubeconfig')}",
            ],
            env={**os.environ, "PYTHONPATH": REPO},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def status(self, path: str) -> int:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            conn.request("GET", path)
            return conn.getresponse().status
        except OSError:
            return 0

    def post(self, verb: str, doc: Any) -> Any:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("POST", f"/{verb}", body=json.dumps(doc), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 200, body
        return json.loads(body)

    def stop(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.seek(0)
        text = self.log.read()
        self.log.close()
        return text


@pytest.fixture
def extender(cluster: Cluster) -> Iterator[Extender]:
    ext = Extender(cluster)
    try:
        yield ext
    finally:
        ext.stop()


def rdma_pod(
    cluster: Cluster, name: str, request: list[dict[str, int]]
) -> tuple[dict[str, Any], dict[str, str]]:
    """A pod in the API (for the scheduler) with its netns (for ADD)."""
    env = cluster.pod(request, name=name)
    made = cluster.api.get_pod("default", name)
    assert made is not None
    # Not scheduled yet, and of the profile the extender serves: the extender binds it.
    pod = cluster.api.add_pod(
        "default",
        name,
        made["metadata"]["annotations"],
        uid=made["metadata"]["uid"],
        node_name=None,
        scheduler_name="rdma-scheduler",
    )
    return pod, env


def test_agent_extender_bind_add_republish(cluster: Cluster, extender: Extender) -> None:
    node = node_name()
    cluster.api.add_node(node, labels={"kubernetes.io/hostname": node}, images=40)
    agent = make_agent(cluster, node)
    conf = cluster.conf()
    pid = os.getpid()
    # The simulated node: 2 PFs x 4 VFs, 25 and 10 Gbit/s.
    a, a_env = rdma_pod(cluster, f"a{pid}", [{"min_tx_rate": 15000, "max_tx_rate": 20000}, {}, {}])
    b, _ = rdma_pod(cluster, f"b{pid}", [{}] * 5)  # fits the 5 VFs a leaves
    c, _ = rdma_pod(cluster, f"c{pid}", [{}] * 6)  # fits the empty node, not with a's 3 VFs held
    with running(agent):
        wait_for(lambda: published(cluster, node), 10, "the agent's first publish")
        wait_for(lambda: extender.status("/readyz") == 200, 30, "the extender to be ready")

        def filtered(pod: dict[str, Any]) -> dict[str, Any]:
            return extender.post("filter", so.args_names(pod, [node]))

        # The extender's cache follows the watch: wait until it has the node's state.
        wait_for(lambda: filtered(a)["NodeNames"] == [node], 10, "a to pass filter")
        assert filtered(c)["NodeNames"] == [node]
        (score,) = extender.post("prioritize", so.args_names(a, [node]))
        assert score["Host"] == node and 0 <= score["Score"] <= 10

        bind = {
            "PodName": a["metadata"]["name"],
            "PodNamespace": "default",
            "PodUID": a["metadata"]["uid"],
            "Node": node,
        }
        assert extender.post("bind", bind) == {"Error": ""}
        assert cluster.api.get_pod("default", a["metadata"]["name"])["spec"]["nodeName"] == node
        # The reservation holds a's 3 VFs: c no longer fits, b still does.
        out = filtered(c)
        assert out["NodeNames"] == [] and node in out["FailedNodes"]
        assert filtered(b)["NodeNames"] == [node]

        # kubelet runs the plugin for the bound pod on the node.
        assert cluster.run("ADD", a_env, conf).ok
        state = wait_for(lambda: (s := published(cluster, node)) and s.allocations and s, 5, "a published")
        assert [(x.name, x.uid) for x in state.allocations] == [(a["metadata"]["name"], a["metadata"]["uid"])]
        assert sum(p.used_vfs for p in state.pfs) == 3
        # The reservation ended with the publication: b fits the published 5 free VFs. Were a
        # still reserved too, only 2 would count as free.
        wait_for(lambda: filtered(b)["NodeNames"] == [node], 10, "the reservation to end")
        assert filtered(c)["NodeNames"] == []
        assert cluster.run("DEL", a_env, conf).ok
        wait_for(lambda: filtered(c)["NodeNames"] == [node], 10, "the DEL to reach the extender")
