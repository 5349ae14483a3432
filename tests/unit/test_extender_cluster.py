"""The extender against the API stand-in over real HTTPS: node cache, bind, reservations, restart.

kube-scheduler's side is played by HTTP requests shaped as it sends them
(NodeNames mode, nodeCacheCapable: true); the API server's by
tests/support/apiserver.py with the real API's list/watch/binding semantics.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.extender.service import Service
from rdma_cni.kube import client as kubeapi
from rdma_cni.shared import nodestate, placement
from rdma_cni.shared.nodestate import NodeState
from tests.support import sched_objects as so
from tests.support.apiserver import ApiServer

PFS = [("ens1f0", 25_000, 4), ("ens1f1", 25_000, 4)]
ANNOTATION = "rdma_interfaces_required"
SCHED = "rdma-scheduler"


def wait_for(what: str, check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class Scheduler:
    """kube-scheduler's HTTP side: one keep-alive connection per thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._local = threading.local()

    def post(self, verb: str, doc: Any) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("POST", f"/{verb}", body=json.dumps(doc), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 200, body
        return json.loads(body)

    def get(self, path: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.request("GET", path)
        status = conn.getresponse().status
        conn.close()
        return status

    def bind(self, pod: dict[str, Any], node: str) -> str:
        meta = pod["metadata"]
        doc = {
            "PodName": meta["name"],
            "PodNamespace": meta["namespace"],
            "PodUID": meta["uid"],
            "Node": node,
        }
        return str(self.post("bind", doc)["Error"])


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        yield server


class Harness:
    def __init__(self, api: ApiServer, tmp: Path) -> None:
        self.api = api
        self.kubeconfig = api.write_kubeconfig(tmp / "kubeconfig")
        self.services: list[Service] = []

    def start(
        self, *, ready: bool = True, client_timeout: float = 10.0, **kw: Any
    ) -> tuple[Service, Scheduler]:
        kw.setdefault("backoff", (0.05, 0.2))
        kw.setdefault("sweep_interval", 0.05)
        client = kubeapi.ApiClient.from_kubeconfig(self.kubeconfig, timeout=client_timeout)
        service = Service(client, listen=("127.0.0.1", 0), **kw).start()
        self.services.append(service)
        if ready:
            wait_for("readiness", service.extender.ready.is_set)
        return service, Scheduler(service.address[1])

    def publish(self, node: str, state: NodeState) -> None:
        self.api.set_node_annotations(node, {nodestate.ANNOTATION: nodestate.encode(state)})

    def add_node(self, node: str, state: NodeState | None) -> None:
        annotations = {} if state is None else {nodestate.ANNOTATION: nodestate.encode(state)}
        self.api.add_node(node, annotations=annotations, images=40)

    def add_pod(self, name: str, rates: list[tuple[int, int]], node: str | None = None) -> dict[str, Any]:
        value = json.dumps([{"min_tx_rate": lo, "max_tx_rate": hi} for lo, hi in rates])
        return self.api.add_pod("team-a", name, {ANNOTATION: value}, node_name=node, scheduler_name=SCHED)

    def stop(self) -> None:
        for service in self.services:
            service.stop()


@pytest.fixture
def harness(api: ApiServer, tmp_path: Path) -> Iterator[Harness]:
    h = Harness(api, tmp_path)
    try:
        yield h
    finally:
        h.stop()


def test_node_names_mode_field_by_field(harness: Harness) -> None:
    harness.add_node("free", so.state(PFS))
    harness.add_node("busy", so.state(PFS, [("u1", [("ens1f0", 20_000, 0), ("ens1f1", 18_000, 0)])]))
    harness.add_node("small", so.state([("ens2f0", 10_000, 8)]))
    harness.add_node("agentless", None)
    _, sched = harness.start(max_state_age=120)
    pod = harness.add_pod("trainer", [(15_000, 20_000), (5_000, 0)])
    names = ["free", "busy", "small", "agentless", "unknown"]
    out = sched.post("filter", so.args_names(pod, names))
    assert out["Nodes"] is None and out["Error"] == ""
    assert out["NodeNames"] == ["free"]
    assert list(out["FailedNodes"]) == ["busy"]
    assert out["FailedNodes"]["busy"] == (
        "rdma-cni: needs 15000 Mbit/s free on one PF with a free VF and capacity of at least 20000 Mbit/s"
    )
    unresolvable = out["FailedAndUnresolvableNodes"]
    assert sorted(unresolvable) == ["agentless", "small", "unknown"]
    assert unresolvable["unknown"] == "rdma-cni: node is not known to the extender yet"
    prio = sched.post("prioritize", so.args_names(pod, names))
    # Only "free" fits; the others score 0, which kube-scheduler assumes for a node left out.
    assert [h["Host"] for h in prio] == ["free"] and prio[0]["Score"] > 0


def test_cache_follows_the_watch_through_drops_and_410(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state(PFS, [("u1", [("ens1f0", 25_000, 0), ("ens1f1", 25_000, 0)])]))
    service, sched = harness.start()
    pod = harness.add_pod("p", [(10_000, 0)])

    def passes() -> bool:
        return sched.post("filter", so.args_names(pod, ["n1"]))["NodeNames"] == ["n1"]

    assert not passes()
    harness.publish("n1", so.state(PFS, generation=2))
    wait_for("the freed node through the watch", passes)
    # The connection drops (API server restart): the watch resumes from its resourceVersion.
    reconnects = service.cache.reconnects
    relists = service.cache.relists
    api.drop_watches()
    harness.publish(
        "n1", so.state(PFS, [("u1", [("ens1f0", 25_000, 0), ("ens1f1", 25_000, 0)])], generation=3)
    )
    wait_for("the full node after the drop", lambda: not passes())
    assert service.cache.relists == relists
    # History compacted while disconnected: 410 Gone, then a relist.
    wait_for("a new watch", lambda: api.watch_count > 0)
    api.drop_watches()  # the extender reconnects after its backoff (50 ms here) ...
    harness.publish("n1", so.state(PFS, generation=4))
    api.compact()  # ... by when the change it missed is out of the history
    wait_for("the relist after 410 Gone", lambda: service.cache.relists > relists)
    wait_for("the freed node after the relist", passes)
    assert service.cache.reconnects >= reconnects
    # Deleted nodes leave the cache; bookmarks keep the resourceVersion moving.
    api.remove_node("n1")
    wait_for("the node's removal", lambda: "n1" not in service.cache.views)
    # The same node list as before: the lookup kept from it must not be reused.
    gone = sched.post("filter", so.args_names(pod, ["n1"]))["FailedAndUnresolvableNodes"]
    assert gone == {"n1": "rdma-cni: node is not known to the extender yet"}
    rv = service.cache.resource_version
    api.add_node("other")
    api.send_bookmarks()
    wait_for("a newer resourceVersion", lambda: service.cache.resource_version != rv)


def test_bind_reserves_then_the_publication_ends_it(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 4)]))
    service, sched = harness.start(best_nodes=1)  # as conf/ runs it
    a = harness.add_pod("a", [(15_000, 0)])
    b = harness.add_pod("b", [(15_000, 0)])
    # a's filter passes one node, which kube-scheduler takes without prioritize: a holds it until its
    # bind, so b's filter, sent before that bind lands, already counts a (no collision at bind).
    assert sched.post("filter", so.args_names(a, ["n1"]))["NodeNames"] == ["n1"]
    early = sched.post("filter", so.args_names(b, ["n1"]))
    assert early["NodeNames"] == [] and "n1" in early["FailedNodes"]
    assert sched.bind(a, "n1") == ""
    assert service.reservations.held(a["metadata"]["uid"]) is None  # the reservation replaced the hold
    assert api.get_pod("team-a", "a")["spec"]["nodeName"] == "n1"  # type: ignore[index]
    res = service.reservations.get(a["metadata"]["uid"])
    assert res is not None and res.node == "n1" and res.use == (("ens1f0", 1, 15_000),)
    error = sched.bind(b, "n1")
    assert error.startswith("rdma-cni: pod team-a/b no longer fits node n1: needs 15000 Mbit/s free")
    assert error.endswith(
        "(ens1f0: 3 VFs, 10000 of 25000 Mbit/s free)"
    )  # the node's detail, in bind's refusal
    assert "spec" not in api.get_pod("team-a", "b") or "nodeName" not in api.get_pod("team-a", "b")["spec"]  # type: ignore[index,operator]
    # Later filters count the reservation too.
    out = sched.post("filter", so.args_names(b, ["n1"]))
    assert out["NodeNames"] == [] and out["FailedNodes"]["n1"] == (
        "rdma-cni: needs 15000 Mbit/s free on one PF with a free VF"
    )
    # The node agent publishes a's allocation: the reservation ends, the published use counts instead.
    uses = [(a["metadata"]["uid"], [("ens1f0", 15_000, 0)])]
    harness.publish("n1", so.state([("ens1f0", 25_000, 4)], uses, generation=2))
    wait_for("the reservation to end", lambda: service.reservations.get(a["metadata"]["uid"]) is None)
    assert sched.post("filter", so.args_names(b, ["n1"]))["NodeNames"] == []


def test_bind_of_a_pod_filter_never_saw_reads_it_from_the_api(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 1)]))
    service, sched = harness.start()
    pod = harness.add_pod("a", [(1_000, 0)])
    assert sched.bind(pod, "n1") == ""
    assert service.reservations.get(pod["metadata"]["uid"]) is not None
    web = api.add_pod("team-a", "web", None, node_name=None, scheduler_name=SCHED)
    assert sched.bind(web, "n1") == ""  # not an RDMA pod: bound without a reservation
    assert len(service.reservations) == 1
    ghost = so.rdma_pod("ghost", [(1, 0)])
    assert sched.bind(ghost, "n1").startswith("rdma-cni: cannot read pod team-a/ghost to check it")


def test_api_down_during_bind_leaks_no_reservation(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 2)]))
    service, sched = harness.start()
    pod = harness.add_pod("a", [(20_000, 0)])
    assert sched.post("filter", so.args_names(pod, ["n1"]))["NodeNames"] == ["n1"]
    api.fail_next(20, 503)
    error = sched.bind(pod, "n1")
    api.reset()
    assert error.startswith("rdma-cni: cannot read pod team-a/a to check it against node n1")
    assert len(service.reservations) == 0
    assert sched.post("filter", so.args_names(pod, ["n1"]))["NodeNames"] == ["n1"]
    # The pod is gone when the bind arrives: 404 from the API, nothing held.
    api.remove_pod("team-a", "a")
    assert sched.bind(pod, "n1").startswith("rdma-cni: cannot read pod team-a/a to check it against node n1")
    assert len(service.reservations) == 0


def test_stale_state_fails_the_node(harness: Harness) -> None:
    harness.add_node("old", so.state(PFS, age=900))
    harness.add_node("new", so.state(PFS))
    _, sched = harness.start(max_state_age=60)
    pod = harness.add_pod("a", [(1, 0)])
    out = sched.post("filter", so.args_names(pod, ["old", "new"]))
    assert out["NodeNames"] == ["new"]
    assert "node state is older than 60 s" in out["FailedAndUnresolvableNodes"]["old"]
    assert sched.bind(pod, "old").startswith("rdma-cni: node state is older than 60 s")


def test_reservation_ttl_and_pod_gone(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 4)]))
    service, sched = harness.start(reservation_ttl=0.5, pod_check_interval=0.1)
    a = harness.add_pod("a", [(1_000, 0)])
    assert sched.bind(a, "n1") == ""
    assert service.reservations.get(a["metadata"]["uid"]) is not None
    wait_for("TTL expiry", lambda: service.reservations.get(a["metadata"]["uid"]) is None, timeout=5)
    other, sched2 = harness.start(reservation_ttl=60, pod_check_interval=0.1)
    b = harness.add_pod("b", [(1_000, 0)])
    assert sched2.bind(b, "n1") == ""
    assert other.reservations.get(b["metadata"]["uid"]) is not None
    api.remove_pod("team-a", "b")
    wait_for(
        "the deleted pod's reservation to end", lambda: other.reservations.get(b["metadata"]["uid"]) is None
    )


def test_restart_rebuilds_reservations_before_ready(harness: Harness, api: ApiServer) -> None:
    published = harness.add_pod("published", [(10_000, 0)], node="n1")
    harness.add_pod("pending", [(10_000, 0)], node="n1")
    harness.add_pod("unbound", [(10_000, 0)])
    api.add_pod("team-a", "web", None, node_name="n1")
    uses = [(published["metadata"]["uid"], [("ens1f0", 10_000, 0)])]
    harness.add_node("n1", so.state([("ens1f0", 25_000, 4)], uses))
    api.hang(0.5)  # slow API: the extender must not be ready before its rebuild
    service, sched = harness.start(ready=False)
    assert sched.get("/readyz") == 503
    assert sched.get("/healthz") == 200
    api.hang(0)
    wait_for("readiness", service.extender.ready.is_set)
    assert sched.get("/readyz") == 200
    held = service.reservations.all()
    assert [(r.name, r.node, r.use) for r in held] == [("pending", "n1", (("ens1f0", 1, 10_000),))]
    c = harness.add_pod("c", [(10_000, 0)])
    assert sched.bind(c, "n1").startswith("rdma-cni: pod team-a/c no longer fits node n1")


def test_preempt_with_meta_victims_that_would_not_free_enough(harness: Harness) -> None:
    pods = [("v-big", [("ens1f0", 20_000, 0)]), ("v-small", [("ens1f1", 2_000, 0)])]
    harness.add_node("n1", so.state([("ens1f0", 25_000, 2), ("ens1f1", 25_000, 2)], pods))
    harness.add_node("n2", so.state([("ens1f0", 25_000, 2), ("ens1f1", 25_000, 2)], pods))
    _, sched = harness.start()
    pod = harness.add_pod("big", [(24_000, 0), (24_000, 0)])
    doc = {
        "Pod": pod,
        "NodeNameToVictims": None,
        "NodeNameToMetaVictims": {
            "n1": {"Pods": [{"UID": "v-big"}], "NumPDBViolations": 0},
            "n2": {"Pods": [{"UID": "v-big"}, {"UID": "v-small"}], "NumPDBViolations": 1},
        },
    }
    out = sched.post("preempt", doc)
    assert out == {
        "NodeNameToMetaVictims": {
            "n2": {"Pods": [{"UID": "v-big"}, {"UID": "v-small"}], "NumPDBViolations": 1}
        }
    }


def test_concurrent_filter_then_bind_never_overcommits(harness: Harness, api: ApiServer) -> None:
    nodes = {
        "n1": so.state([("ens1f0", 25_000, 4), ("ens1f1", 10_000, 2)]),
        "n2": so.state([("ens2f0", 40_000, 3)]),
        "n3": so.state([("ens3f0", 25_000, 8)], [("x", [("ens3f0", 20_000, 0)])]),
    }
    for name, state in nodes.items():
        harness.add_node(name, state)
    service, _ = harness.start()
    rates = [(9_000, 0), (6_000, 12_000), (0, 0), (4_000, 0), (11_000, 0)]
    pods = [harness.add_pod(f"p{i}", [rates[i % len(rates)]] * (1 + i % 2)) for i in range(48)]
    results: dict[str, tuple[str, str]] = {}
    lock = threading.Lock()

    filtered = threading.Barrier(8)

    def run(chunk: list[dict[str, Any]]) -> None:
        sched = Scheduler(service.address[1])
        # Every pod is filtered before any is bound, and without prioritize (whose holds would make
        # later filters see earlier picks): all 48 pass on the published states, which hold 17 VFs,
        # so the binds certainly race for more than fits, however the threads are scheduled.
        chosen = []
        for pod in chunk:
            out = sched.post("filter", so.args_names(pod, list(nodes)))
            if out["NodeNames"]:
                chosen.append((pod, out["NodeNames"][0]))
        filtered.wait(timeout=60)
        for pod, node in chosen:
            error = sched.bind(pod, node)
            with lock:
                results[pod["metadata"]["name"]] = (node, error)

    threads = [threading.Thread(target=run, args=(pods[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bound = {name: node for name, (node, error) in results.items() if not error}
    refused = [error for _, error in results.values() if error]
    assert bound and refused  # the race really happened: more passed filter than fit
    assert all("no longer fits" in e for e in refused)
    for name, node in bound.items():
        assert api.get_pod("team-a", name)["spec"]["nodeName"] == node  # type: ignore[index]
    by_name = {p["metadata"]["name"]: p for p in pods}
    for node, state in nodes.items():
        on_node = [by_name[n] for n, where in bound.items() if where == node]
        requests = [
            placement.Request(i["min_tx_rate"], i["max_tx_rate"])
            for p in on_node
            for i in json.loads(p["metadata"]["annotations"][ANNOTATION])
        ]
        # Everything bound to the node fits its published state together.
        placement.place(requests, nodestate.pf_states(state), max_steps=None)
        held = [r for r in service.reservations.all() if r.node == node]
        assert len(held) == len(on_node)


def test_bind_edges(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 4)]))
    harness.add_node("n2", so.state([("ens1f0", 25_000, 4)]))
    service, sched = harness.start()
    a = harness.add_pod("a", [(1_000, 0)])
    assert sched.bind(a, "n1") == ""
    # A pod already bound is refused (no second Binding), on any node; its reservation stays.
    assert sched.bind(a, "n1") == "rdma-cni: pod team-a/a is already bound to node n1"
    assert sched.bind(a, "n2") == "rdma-cni: pod team-a/a is already bound to node n1"
    assert service.reservations.get(a["metadata"]["uid"]).node == "n1"  # type: ignore[union-attr]
    # The pod the scheduler means was replaced (same name, new uid).
    b = harness.add_pod("b", [(1_000, 0)])
    stale = json.loads(json.dumps(b))
    stale["metadata"]["uid"] = "old-uid"
    assert sched.bind(stale, "n1").startswith(
        "rdma-cni: cannot read pod team-a/b to check it against node n1"
    )
    # A malformed annotation read at bind time answers the parser's message.
    api.add_pod("team-a", "bad", {ANNOTATION: "[{"}, node_name=None, scheduler_name=SCHED)
    bad = api.get_pod("team-a", "bad")
    assert sched.bind(bad, "n1").startswith(  # type: ignore[arg-type]
        "rdma-cni: pod team-a/bad annotation rdma_interfaces_required: not valid JSON"
    )
    # Already published on the node (the agent was faster than the bind): nothing to reserve.
    c = harness.add_pod("c", [(1_000, 0)])
    harness.publish("n2", so.state([("ens1f0", 25_000, 4)], [(c["metadata"]["uid"], [("ens1f0", 1_000, 0)])]))
    wait_for("n2's new state", lambda: c["metadata"]["uid"] in service.cache.views["n2"].uids)
    assert sched.bind(c, "n2") == ""
    assert service.reservations.get(c["metadata"]["uid"]) is None


def test_pods_replaced_or_finished_end_their_reservations(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 8)]))
    # The pod reads, for reservations no pod watch covers (see the pod watch's tests below).
    service, sched = harness.start(pod_check_interval=3600, pod_watch=False)
    pods = [harness.add_pod(name, [(1_000, 0)]) for name in ("replaced", "finished", "alive", "unreadable")]
    for pod in pods:
        assert sched.bind(pod, "n1") == ""
    api.remove_pod("team-a", "replaced")
    harness.add_pod("replaced", [(1_000, 0)], node="n1")
    api.add_pod(
        "team-a",
        "finished",
        {ANNOTATION: "[{}]"},
        uid=pods[1]["metadata"]["uid"],
        node_name="n1",
        phase="Succeeded",
    )
    api.forbid_namespace("team-a")  # every pod read now answers 403: reservations stay
    service.check_pods()
    assert len(service.reservations) == 4
    api.reset()
    api.remove_pod("team-a", "unreadable")
    api.add_pod("team-a", "unreadable", {ANNOTATION: "[{}]"}, uid=pods[3]["metadata"]["uid"], node_name="n1")
    service.check_pods()
    assert sorted(r.name for r in service.reservations.all()) == ["alive", "unreadable"]


def test_rebuild_skips_what_holds_nothing_and_retries_api_failures(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 2)]))
    harness.add_pod("fits", [(20_000, 0)], node="n1")
    harness.add_pod("too-big", [(20_000, 0)], node="n1")  # fits alone, not beside "fits"
    harness.add_pod("elsewhere", [(1, 0)], node="unknown-node")
    api.add_pod("team-a", "done", {ANNOTATION: "[{}]"}, node_name="n1", phase="Succeeded")
    api.add_pod("team-a", "malformed", {ANNOTATION: "nope"}, node_name="n1")
    harness.add_node("n1", so.state([("ens1f0", 25_000, 2)]))
    client = kubeapi.ApiClient.from_kubeconfig(harness.kubeconfig)
    real_list = client.list
    failures = []

    def flaky_list(path: str, params: Any = None, **kw: Any) -> Any:
        if path == "/api/v1/pods" and not failures:
            failures.append(path)
            raise kubeapi.Unavailable(503, "ServiceUnavailable", "try later")
        return real_list(path, params, **kw)

    client.list = flaky_list  # type: ignore[method-assign]
    service = Service(client, listen=("127.0.0.1", 0), backoff=(0.05, 0.1), sweep_interval=0.05).start()
    harness.services.append(service)
    wait_for("readiness after a failed rebuild", service.extender.ready.is_set)
    assert failures == ["/api/v1/pods"]
    names = sorted(r.name for r in service.reservations.all())
    assert len(names) == 1 and names[0] in ("fits", "too-big")


# -- issue 21: bind trusts no request body (each test fails on the code before it)


def bindings_posted(api: ApiServer) -> list[str]:
    return [r.path for r in api.requests_seen if r.method == "POST" and r.path.endswith("/binding")]


def unbound(api: ApiServer, name: str) -> bool:
    return not (api.get_pod("team-a", name) or {}).get("spec", {}).get("nodeName")


def test_bind_refuses_pods_of_other_schedulers(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 4)]))
    service, sched = harness.start()
    # Another namespace, another scheduler, no RDMA request, never filtered: refused all the same.
    web = api.add_pod("kube-system", "web", None, node_name=None)
    assert sched.bind(web, "n1") == (
        "rdma-cni: pod kube-system/web has schedulerName 'default-scheduler',"
        " which this extender does not serve"
    )
    rdma = api.add_pod("team-a", "r", {ANNOTATION: "[{}]"}, node_name=None, scheduler_name="other")
    assert "schedulerName 'other'" in sched.bind(rdma, "n1")
    assert bindings_posted(api) == [] and len(service.reservations) == 0
    assert not (api.get_pod("kube-system", "web") or {})["spec"].get("nodeName") and unbound(api, "r")
    # The names served are a flag: a second profile's pods are accepted.
    _, other = harness.start(scheduler_names=frozenset({"rdma-scheduler", "other"}))
    assert other.bind(rdma, "n1") == ""


def test_bind_refuses_pods_already_bound(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 4)]))
    service, sched = harness.start()
    pod = harness.add_pod("a", [(1_000, 0)], node="n1")
    assert sched.bind(pod, "n1") == "rdma-cni: pod team-a/a is already bound to node n1"
    assert bindings_posted(api) == [] and len(service.reservations) == 0


def test_bind_refuses_nodes_it_does_not_know(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 4)]))
    _, sched = harness.start()
    web = api.add_pod("team-a", "web", None, node_name=None, scheduler_name=SCHED)
    assert sched.bind(web, "no-such-node") == (
        "rdma-cni: node no-such-node is not known to the extender (binding pod team-a/web)"
    )
    assert bindings_posted(api) == [] and unbound(api, "web")


def test_bind_refuses_rdma_pods_without_a_uid(harness: Harness, api: ApiServer) -> None:
    # The attack: four 10 Gbit/s pods bound with PodUID "" to a node with 2 VFs and 25 Gbit/s.
    harness.add_node("n1", so.state([("ens1f0", 25_000, 2)]))
    _, sched = harness.start()
    for i in range(4):
        pod = harness.add_pod(f"p{i}", [(10_000, 0)])
        doc = {"PodName": f"p{i}", "PodNamespace": "team-a", "PodUID": "", "Node": "n1"}
        assert sched.post("bind", doc)["Error"] == (
            f"rdma-cni: pod team-a/p{i} asks for RDMA interfaces but the bind names no pod uid"
        )
        assert unbound(api, pod["metadata"]["name"])
    assert bindings_posted(api) == []
    assert sched.post("filter", so.args_names(pod, ["n1"]))["NodeNames"] == ["n1"]


def test_bind_refuses_a_uid_the_api_does_not_have(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 4)]))
    _, sched = harness.start()
    pod = harness.add_pod("a", [(1_000, 0)])
    forged = json.loads(json.dumps(pod))
    forged["metadata"]["uid"] = "forged-uid"
    # A filter with the forged uid first: nothing it says is remembered for the bind.
    sched.post("filter", so.args_names(forged, ["n1"]))
    error = sched.bind(forged, "n1")
    assert error.endswith(f"now has uid {pod['metadata']['uid']}, not forged-uid")
    assert bindings_posted(api) == [] and unbound(api, "a")


def test_a_forged_full_node_view_changes_nothing_bind_believes(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 2)]))
    _, sched = harness.start()
    lie = dataclasses.replace(so.state([("ens1f0", 400_000, 4096)]), updated="2099-01-01T00:00:00Z")
    pods = [harness.add_pod(f"p{i}", [(10_000, 0)]) for i in range(5)]
    for pod in pods:
        out = sched.post("filter", so.args_nodes(pod, [so.node("n1", nodestate.encode(lie))]))
        # The forged view shapes that answer only.
        assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == ["n1"]
    errors = [sched.bind(pod, "n1") for pod in pods]
    assert errors[:2] == ["", ""]
    assert all("no longer fits node n1" in e for e in errors[2:])
    assert sum(not unbound(api, f"p{i}") for i in range(5)) == 2
    # Preempt too decides from the watched state: evicting nothing frees nothing.
    doc = {"Pod": pods[4], "NodeNameToVictims": None, "NodeNameToMetaVictims": {"n1": {"Pods": []}}}
    assert sched.post("preempt", doc) == {"NodeNameToMetaVictims": {}}


def test_a_filter_without_the_victims_annotation_does_not_skip_its_bind(
    harness: Harness, api: ApiServer
) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 2)]))
    service, sched = harness.start()
    victim = harness.add_pod("victim", [(20_000, 0)])
    other = harness.add_pod("other", [(20_000, 0)])
    forged = json.loads(json.dumps(victim))
    del forged["metadata"]["annotations"]
    sched.post("filter", so.args_names(forged, ["n1"]))  # "not an RDMA pod", says the body
    assert sched.bind(victim, "n1") == ""
    assert service.reservations.get(victim["metadata"]["uid"]) is not None
    assert sched.bind(other, "n1").startswith("rdma-cni: pod team-a/other no longer fits node n1")
    assert unbound(api, "other")


def test_a_filter_with_a_forged_huge_demand_does_not_fail_the_victims_bind(
    harness: Harness, api: ApiServer
) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 2)]))
    service, sched = harness.start()
    victim = harness.add_pod("victim", [(1_000, 0)])
    forged = json.loads(json.dumps(victim))
    forged["metadata"]["annotations"][ANNOTATION] = json.dumps([{"min_tx_rate": 25_000}] * 8)
    sched.post("filter", so.args_names(forged, ["n1"]))
    assert sched.bind(victim, "n1") == ""
    res = service.reservations.get(victim["metadata"]["uid"])
    assert res is not None and res.use == (("ens1f0", 1, 1_000),)


def test_a_binding_answered_late_keeps_its_reservation(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 1)]))
    service, sched = harness.start(client_timeout=0.5)
    a = harness.add_pod("a", [(1_000, 0)])
    b = harness.add_pod("b", [(1_000, 0)])
    api.late_bindings(3.0)  # applied at once, answered after the client gave up
    assert sched.bind(a, "n1") == ""  # read back: bound
    assert api.get_pod("team-a", "a")["spec"]["nodeName"] == "n1"  # type: ignore[index]
    assert service.reservations.get(a["metadata"]["uid"]) is not None
    assert sched.bind(b, "n1").startswith("rdma-cni: pod team-a/b no longer fits node n1: needs 1 free VFs")
    api.reset()
    assert unbound(api, "b")


class _Flaky:
    """The extender's API client, with the Binding's answer and the read-back replaced."""

    def __init__(self, real: Any, post_error: Exception | None, get_fails_after_post: bool) -> None:
        self.real = real
        self.post_error = post_error
        self.get_fails = get_fails_after_post
        self.posted = False

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        if self.posted and self.get_fails:
            raise kubeapi.Unavailable(0, "NoAnswer", f"GET {path}: no answer")
        return self.real.get(path, params)

    def post(self, path: str, body: Any) -> Any:
        self.posted = True
        if self.post_error is None:
            return self.real.post(path, body)
        if self.post_error.args and self.post_error.args[0] == "apply":
            self.real.post(path, body)
            raise kubeapi.Unavailable(0, "NoAnswer", f"POST {path}: no answer")
        raise self.post_error


def test_an_unknown_binding_outcome_keeps_the_reservation_until_the_pod_is_read_back(
    harness: Harness, api: ApiServer
) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 4)]))
    service, sched = harness.start()
    binder = service.extender.binder
    real = binder.client
    # Applied, no answer, and the read-back fails too: kept, unconfirmed, until a read-back succeeds.
    a = harness.add_pod("a", [(1_000, 0)])
    binder.client = _Flaky(real, RuntimeError("apply"), get_fails_after_post=True)
    assert "outcome unknown" in sched.bind(a, "n1")
    res = service.reservations.get(a["metadata"]["uid"])
    assert res is not None and not res.confirmed
    service.check_pods()
    res = service.reservations.get(a["metadata"]["uid"])
    assert res is not None and res.confirmed
    # Not applied (a 503 from a proxy), read back unbound: dropped.
    b = harness.add_pod("b", [(1_000, 0)])
    binder.client = _Flaky(real, kubeapi.Unavailable(503, "ServiceUnavailable", "proxy"), False)
    assert sched.bind(b, "n1").startswith("rdma-cni: binding pod team-a/b to n1 failed")
    assert service.reservations.get(b["metadata"]["uid"]) is None
    # Not applied, and the read-back fails: kept; the next read-back drops it.
    c = harness.add_pod("c", [(1_000, 0)])
    binder.client = _Flaky(real, kubeapi.Unavailable(0, "NoAnswer", "reset"), True)
    assert "outcome unknown" in sched.bind(c, "n1")
    assert service.reservations.get(c["metadata"]["uid"]) is not None
    service.check_pods()
    assert service.reservations.get(c["metadata"]["uid"]) is None
    # A clear 4xx refusal drops it at once.
    d = harness.add_pod("d", [(1_000, 0)])
    binder.client = _Flaky(real, kubeapi.Invalid(422, "Invalid", "no"), True)
    assert sched.bind(d, "n1").startswith("rdma-cni: binding pod team-a/d to n1 failed")
    assert service.reservations.get(d["metadata"]["uid"]) is None


def test_a_state_stamped_in_the_future_is_stale(harness: Harness, api: ApiServer) -> None:
    future = dataclasses.replace(so.state(PFS), updated="2099-01-01T00:00:00Z")
    harness.add_node("ahead", future)
    harness.add_node("now", so.state(PFS))
    _, sched = harness.start(max_state_age=900)
    pod = harness.add_pod("a", [(1, 0)])
    out = sched.post("filter", so.args_names(pod, ["ahead", "now"]))
    assert out["NodeNames"] == ["now"]
    assert "stamped more than 60 s in the future" in out["FailedAndUnresolvableNodes"]["ahead"]
    assert sched.bind(pod, "ahead").startswith("rdma-cni: node state is stamped more than 60 s in the future")
    assert unbound(api, "a")


# -- the pod watch: a reservation ends with its pod, at once (no pod reads)


def test_a_deleted_pod_ends_its_reservation_and_hold_at_once(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 4)]))
    harness.add_node("n2", so.state([("ens1f0", 25_000, 4)]))
    # Pod reads every hour: only the watch can end these in time.
    service, sched = harness.start(pod_check_interval=3600, best_nodes=1)
    wait_for("the pod watch", lambda: all(w.synced.is_set() for w in service.pod_watches))
    bound = harness.add_pod("bound", [(20_000, 0)])
    held = harness.add_pod("held", [(1_000, 0)])
    assert sched.bind(bound, "n1") == ""
    assert sched.post("filter", so.args_names(held, ["n2"]))["NodeNames"] == ["n2"]
    assert service.reservations.get(bound["metadata"]["uid"]) is not None
    assert service.reservations.held(held["metadata"]["uid"]) is not None
    started = time.monotonic()
    api.remove_pod("team-a", "bound")
    api.remove_pod("team-a", "held")
    wait_for("the reservation to end", lambda: service.reservations.get(bound["metadata"]["uid"]) is None, 3)
    wait_for("the hold to end", lambda: service.reservations.held(held["metadata"]["uid"]) is None, 3)
    assert time.monotonic() - started < 3  # the 10 s pod reads of before are not what ended them
    # Its capacity is free again for the next pod.
    other = harness.add_pod("other", [(20_000, 0)])
    assert sched.post("filter", so.args_names(other, ["n1"]))["NodeNames"] == ["n1"]


def test_a_finished_pod_ends_its_reservation_and_others_stay(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 4)]))
    service, sched = harness.start(pod_check_interval=3600)
    wait_for("the pod watch", lambda: all(w.synced.is_set() for w in service.pod_watches))
    done = harness.add_pod("done", [(1_000, 0)])
    alive = harness.add_pod("alive", [(1_000, 0)])
    for pod in (done, alive):
        assert sched.bind(pod, "n1") == ""
    api.add_pod(
        "team-a",
        "done",
        {ANNOTATION: "[{}]"},
        uid=done["metadata"]["uid"],
        node_name="n1",
        scheduler_name=SCHED,
        phase="Failed",
    )
    wait_for("the reservation to end", lambda: service.reservations.get(done["metadata"]["uid"]) is None, 3)
    # A pod of another scheduler name is outside the watch: its changes are not even seen.
    api.add_pod("team-a", "web", None, node_name="n1", phase="Succeeded")
    time.sleep(0.3)
    assert [r.name for r in service.reservations.all()] == ["alive"]


def test_the_pod_watch_relists_after_compaction_and_ends_what_went_meanwhile(
    harness: Harness, api: ApiServer
) -> None:
    harness.add_node("n1", so.state([("ens1f0", 25_000, 4)]))
    service, sched = harness.start(pod_check_interval=3600)
    (watch,) = service.pod_watches
    wait_for("the pod watch", watch.synced.is_set)
    pod = harness.add_pod("a", [(1_000, 0)])
    assert sched.bind(pod, "n1") == ""
    relists = watch.relists
    # The pod goes while the watch is away, and the history it would resume from is compacted.
    watch.stop()
    api.drop_watches()
    wait_for("the watch to end", lambda: watch._thread is not None and not watch._thread.is_alive())
    api.remove_pod("team-a", "a")
    api.compact()
    assert service.reservations.get(pod["metadata"]["uid"]) is not None
    watch._stop.clear()
    watch.start()
    wait_for("a relist", lambda: watch.relists > relists)
    wait_for("the reservation to end", lambda: service.reservations.get(pod["metadata"]["uid"]) is None, 3)
