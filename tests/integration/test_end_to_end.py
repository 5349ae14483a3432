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

    def __init__(self, cluster: Cluster, *extra: str) -> None:
        self.port = free_port()
        self.log = open(os.path.join(cluster.tmp, "extender.log"), "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                *plugin_command(),
                "scheduler-extender",
                f"--listen=127.0.0.1:{self.port}",
                f"--kubeconfig={os.path.join(cluster.tmp, 'kubeconfig')}",
                *extra,
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
        scheduler_name="rdma-scheduler",  # the name bind serves by default
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


# -- two networks: one ADD per attachment, judged on each network's PFs --------


def _multi_pod(
    cluster: Cluster, name: str, attachments: list[tuple[str, list[dict[str, int]]]]
) -> tuple[dict[str, Any], dict[str, str]]:
    """A pod selecting networks with a request per attachment (Multus' JSON form, ``cni-args``)."""
    env = cluster.pod(None, name=name)
    made = cluster.api.get_pod("default", name)
    assert made is not None
    selection = [{"name": net, "cni-args": {"rdma_interfaces_required": req}} for net, req in attachments]
    pod = cluster.api.add_pod(
        "default",
        name,
        {"k8s.v1.cni.cncf.io/networks": json.dumps(selection)},
        uid=made["metadata"]["uid"],
        node_name=None,
        scheduler_name="rdma-scheduler",
    )
    return pod, env


@pytest.mark.parametrize("layout", ["disjoint", "shared"])
def test_two_networks_agent_extender_bind_one_add_per_network(cluster: Cluster, layout: str) -> None:
    from rdma_cni.agent import loop

    node = node_name()
    cluster.api.add_node(node, labels={"kubernetes.io/hostname": node}, images=40)
    # The simulated node: simpf0 and simpf1, 4 VFs each.
    pfs = (
        {"net-a": ["simpf0"], "net-b": ["simpf1"]} if layout == "disjoint" else {"net-a": None, "net-b": None}
    )
    confs = {net: cluster.conf(name=net, pfs=p) for net, p in pfs.items()}
    paths = []
    for net, conf in confs.items():
        paths.append(os.path.join(cluster.tmp, f"{net}.conf"))
        with open(paths[-1], "w") as f:
            json.dump(conf, f)
    agent = loop.setup_agent(
        node_name=node, network_configs=paths, kubeconfig=os.path.join(cluster.tmp, "kubeconfig"), period=30.0
    )
    pid = os.getpid()
    p, p_env = _multi_pod(cluster, f"p{pid}", [("net-a", [{}, {}, {}]), ("net-b", [{}])])
    # net-b alone: 4 interfaces. Disjoint: simpf1 has 3 free once p holds one (the union has 4).
    # Shared: 8 VFs, p holds 4, so 4 are left for q.
    q, _ = _multi_pod(cluster, f"q{pid}", [("net-b", [{}] * 4)])
    r, _ = _multi_pod(cluster, f"r{pid}", [("net-a", [{}]), ("net-b", [{}] * 4)])  # one more than is left
    extender = Extender(cluster, "--networks=net-a,net-b")
    try:
        with running(agent):
            wait_for(lambda: published(cluster, node), 10, "the agent's first publish")
            state = published(cluster, node)
            assert state is not None and [n.name for n in state.networks] == ["net-a", "net-b"]
            wait_for(lambda: extender.status("/readyz") == 200, 30, "the extender to be ready")

            def passes(pod: dict[str, Any]) -> bool:
                out = extender.post("filter", so.args_names(pod, [node]))
                return bool(out["NodeNames"] == [node])

            wait_for(lambda: passes(p), 10, "p to pass filter")
            bind = {
                "PodName": p["metadata"]["name"],
                "PodNamespace": "default",
                "PodUID": p["metadata"]["uid"],
            }
            assert extender.post("bind", {**bind, "Node": node}) == {"Error": ""}
            assert passes(q) is (layout == "shared")
            assert not passes(r)
            # kubelet via Multus: one ADD per attachment, each with its cni-args as args.cni.
            for k, (net, req) in enumerate([("net-a", [{}, {}, {}]), ("net-b", [{}])]):
                conf = {**confs[net], "args": {"cni": {"rdma_interfaces_required": req}}}
                assert cluster.run("ADD", {**p_env, "CNI_IFNAME": f"net{k + 1}"}, conf).ok

            # The agent publishes after each ADD, so its first state with an allocation may hold
            # only net1's three VFs: wait for p's allocation to list both attachments' interfaces
            # (one per VF, from the records), then judge the PF counts of that same state.
            def both_adds(s: Any) -> bool:
                return bool(s and s.allocations and sum(len(a.interfaces) for a in s.allocations) == 4)

            got = wait_for(
                lambda: (s := published(cluster, node)) and both_adds(s) and s, 10, "both ADDs published"
            )
            assert sum(pf.used_vfs for pf in got.pfs) == 4
            if layout == "disjoint":
                assert [(pf.name, pf.used_vfs) for pf in got.pfs] == [("simpf0", 3), ("simpf1", 1)]
            # Reservation ended, the published state judged per network: the same verdicts.
            assert passes(q) is (layout == "shared")
            assert not passes(r)
            for k, net in enumerate(["net-a", "net-b"]):
                assert cluster.run("DEL", {**p_env, "CNI_IFNAME": f"net{k + 1}"}, confs[net]).ok
            wait_for(lambda: passes(r), 10, "the DELs to reach the extender")
    finally:
        extender.stop()
