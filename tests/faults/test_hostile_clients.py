"""The fault tier's hostile clients: forged binds, forged full-Node views and forged memos (issue 21).

Any pod that reaches the extender can send it what kube-scheduler sends. Here
seeded threads mix kube-scheduler's own traffic (filter by node name, then
bind to a passing node) with a tenant's: binds of pods of another scheduler
or namespace, of pods already bound, to nodes that do not exist or publish
nothing, with no uid or a wrong one; full-Node filters that say a node has
4,096 VFs and a state stamped in 2099; filters carrying another pod's
identity without its annotation or with a huge one; preempts with made-up
victims. The verdict is read from the API stand-in's pods and the nodes'
watched states only: no node holds more than its published state has room
for, and every pod bound is one the extender serves, on a node it knows.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import random
import subprocess
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.shared import nodestate, placement
from tests.faults.knobs import SEED, STATS, scaled
from tests.support import sched_objects as so
from tests.support.apiserver import ApiServer
from tests.support.extenderproc import start_extender, wait_ready

if not os.environ.get("RDMA_CNI_BINARY"):
    pytest.skip(
        "the fault tier drives the built binary (make faults sets RDMA_CNI_BINARY)", allow_module_level=True
    )

FAMILY = "hostile clients (binds, views, memos)"
ANNOTATION = "rdma_interfaces_required"
SERVED = "rdma-scheduler"
# Nodes with an agent: (PFs (name, Mbit/s, VFs), pods already published (uid, [(pf, min, max)])).
NODES: dict[str, tuple[list[tuple[str, int | None, int]], list[Any]]] = {
    "w0": ([("ens1f0", 25_000, 2)], []),
    "w1": ([("ens1f0", 25_000, 1)], []),
    "w2": ([("ens1f0", 25_000, 4), ("ens1f1", 25_000, 4)], [("old-0", [("ens1f0", 20_000, 0)])]),
    "w3": ([("ens1f0", 100_000, 2)], []),
}
# A node without the agent (a control plane), and names no node has.
NO_AGENT = "control-plane"
GHOSTS = ["no-such-node", "", "w0 ", "W0", "../w0"]
SHAPES = [[(10_000, 0)], [(20_000, 0)], [(1_000, 0)], [(0, 0)], [(5_000, 0), (5_000, 0)], [(0, 30_000)]]
PER_THREAD_ROUNDS = 60
THREADS = 3


def _value(rates: list[tuple[int, int]]) -> str:
    return json.dumps([{"min_tx_rate": lo, "max_tx_rate": hi} for lo, hi in rates])


class Client:
    """kube-scheduler's side (and the tenant's): one keep-alive connection per thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.local = threading.local()
        self.requests = 0
        self.lock = threading.Lock()

    def post(self, verb: str, doc: Any) -> Any:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("POST", f"/{verb}", body=json.dumps(doc), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        with self.lock:
            self.requests += 1
        assert resp.status == 200, raw
        return json.loads(raw)


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        yield server


def _start(tmp: Path, api: ApiServer) -> tuple[subprocess.Popen[str], int]:
    kubeconfig = api.write_kubeconfig(tmp / "kubeconfig")
    return start_extender(kubeconfig, "--max-state-age", "900", "--scheduler-name", SERVED)


def _forged_node(rng: random.Random, name: str) -> dict[str, Any]:
    pfs = [("ens1f0", rng.choice([400_000, 25_000, None]), rng.choice([4096, 64, 8]))]
    state = so.state(pfs)
    if rng.random() < 0.7:
        state = dataclasses.replace(state, updated="2099-01-01T00:00:00Z")
    return so.node(name, nodestate.encode(state))


class Tenant:
    """One thread's mix of kube-scheduler's traffic and a hostile client's."""

    def __init__(self, api: ApiServer, client: Client, rng: random.Random, tag: str, stats: Counter[str]):
        self.api, self.client, self.rng, self.tag, self.stats = api, client, rng, tag, stats
        self.n = 0

    def _pod(
        self, *, scheduler: str = SERVED, namespace: str = "team-a", rdma: bool = True
    ) -> dict[str, Any]:
        self.n += 1
        annotations = {ANNOTATION: _value(self.rng.choice(SHAPES))} if rdma else None
        return self.api.add_pod(
            namespace, f"{self.tag}-{self.n}", annotations, node_name=None, scheduler_name=scheduler
        )

    def _bind(self, pod: dict[str, Any], node: str, uid: str | None = None) -> str:
        meta = pod["metadata"]
        doc = {
            "PodName": meta["name"],
            "PodNamespace": meta["namespace"],
            "PodUID": meta["uid"] if uid is None else uid,
            "Node": node,
        }
        return str(self.client.post("bind", doc)["Error"])

    def scheduler(self) -> None:
        """kube-scheduler: filter by node name, bind to a passing node."""
        pod = self._pod(rdma=self.rng.random() < 0.85)
        out = self.client.post("filter", so.args_names(pod, [*NODES, NO_AGENT]))
        self.stats["cycles"] += 1
        passing = out.get("NodeNames") or []
        if passing:
            self._bind(pod, self.rng.choice(passing))

    def forged_bind(self) -> None:
        rng = self.rng
        kind = rng.randrange(6)
        node = rng.choice([*NODES, NO_AGENT, *GHOSTS])
        if kind == 0:
            pod = self._pod(scheduler=rng.choice(["default-scheduler", "other", ""]), rdma=rng.random() < 0.5)
            self._bind(pod, rng.choice([*NODES, NO_AGENT]))
        elif kind == 1:
            pod = self._pod(namespace="kube-system", scheduler="default-scheduler", rdma=False)
            self._bind(pod, NO_AGENT)
        elif kind == 2:
            self._bind(self._pod(), node, uid="")  # an RDMA pod without a uid
        elif kind == 3:
            self._bind(self._pod(), node, uid=str(uuid.UUID(int=rng.getrandbits(128))))
        elif kind == 4:
            self._bind(self._pod(rdma=rng.random() < 0.5), rng.choice([NO_AGENT, *GHOSTS]))
        else:  # a pod already bound (by the extender or anyone): bound again, elsewhere
            pod = self._pod()
            first = rng.choice(list(NODES))
            self._bind(pod, first)
            self._bind(pod, rng.choice(list(NODES)))

    def forged_view(self) -> None:
        pod = self._pod()
        names = self.rng.sample(list(NODES), k=self.rng.randint(1, len(NODES)))
        self.client.post("filter", so.args_nodes(pod, [_forged_node(self.rng, n) for n in names]))
        # Then kube-scheduler's bind of that pod to a node the forged view said had room.
        self._bind(pod, self.rng.choice(names))

    def forged_memo(self) -> None:
        victim = self._pod()
        forged = json.loads(json.dumps(victim))
        annotations = forged["metadata"].setdefault("annotations", {})
        if self.rng.random() < 0.5:
            annotations.pop(ANNOTATION, None)
        else:
            annotations[ANNOTATION] = _value([(25_000, 0)] * 8)
        self.client.post("filter", so.args_names(forged, list(NODES)))
        self.client.post("prioritize", so.args_names(forged, list(NODES)))
        # The victim's real scheduling follows.
        out = self.client.post("filter", so.args_names(victim, list(NODES)))
        passing = out.get("NodeNames") or []
        self._bind(victim, self.rng.choice(passing or list(NODES)))

    def forged_preempt(self) -> None:
        pod = self._pod()
        victims = {
            n: {"Pods": [{"UID": self.rng.choice(["old-0", "made-up", ""])}], "NumPDBViolations": 0}
            for n in self.rng.sample([*NODES, NO_AGENT, "no-such-node"], 2)
        }
        self.client.post("preempt", {"Pod": pod, "NodeNameToVictims": None, "NodeNameToMetaVictims": victims})

    def run(self, rounds: int) -> None:
        actions = [self.scheduler, self.forged_bind, self.forged_view, self.forged_memo, self.forged_preempt]
        weights = [3, 3, 2, 2, 1]
        for _ in range(rounds):
            action = self.rng.choices(actions, weights)[0]
            if action != self.scheduler:
                self.stats["inputs"] += 1
            action()


def judge(api: ApiServer, before: set[tuple[str, str]]) -> list[str]:
    """Violations, from the API's pods and the nodes' published (watched) states only."""
    problems: list[str] = []
    per_node: dict[str, list[placement.Request]] = {}
    for pod in api.pods():
        meta, spec = pod["metadata"], pod.get("spec") or {}
        key = (meta["namespace"], meta["name"])
        node = spec.get("nodeName")
        if not node or key in before:
            continue
        who = f"pod {key[0]}/{key[1]} on {node!r}"
        if spec.get("schedulerName") != SERVED:
            problems.append(f"{who}: bound though its schedulerName is {spec.get('schedulerName')!r}")
        if node not in NODES and node != NO_AGENT:
            problems.append(f"{who}: bound to a node the cluster does not have")
            continue
        raw = (meta.get("annotations") or {}).get(ANNOTATION)
        if raw is not None and node not in NODES:
            problems.append(f"{who}: an RDMA pod bound to a node that publishes no state")
        elif raw is not None:
            for item in json.loads(raw):
                per_node.setdefault(node, []).append(
                    placement.Request(item.get("min_tx_rate", 0), item.get("max_tx_rate", 0))
                )
    for node, requests in per_node.items():
        text = (api.get_node(node) or {})["metadata"]["annotations"][nodestate.ANNOTATION]
        pfs = nodestate.pf_states(nodestate.decode(text))
        try:
            placement.place(tuple(requests), pfs)
        except placement.NoFit as exc:
            problems.append(f"node {node} over-committed: {len(requests)} interfaces bound: {exc.message}")
    return problems


def test_hostile_clients_never_overcommit_nor_bind_what_is_not_served(tmp_path: Path, api: ApiServer) -> None:
    stats = STATS.setdefault(FAMILY, Counter())
    for name, (pfs, uses) in NODES.items():
        api.add_node(name, annotations={nodestate.ANNOTATION: nodestate.encode(so.state(pfs, uses))})
    api.add_node(NO_AGENT, annotations={})
    # Pods bound before the run (by someone else): the tenants try to bind them again.
    before = {("team-a", "prebound")}
    api.add_pod(
        "team-a", "prebound", {ANNOTATION: _value([(1_000, 0)])}, node_name="w3", scheduler_name=SERVED
    )
    proc, port = _start(tmp_path, api)
    try:
        wait_ready(port)
        client = Client(port)
        counters = [Counter[str]() for _ in range(THREADS)]
        tenants = [
            Tenant(api, client, random.Random(f"{SEED}:hostile:{i}"), f"t{i}", counters[i])
            for i in range(THREADS)
        ]
        prebound = (api.get_pod("team-a", "prebound") or {})["metadata"]
        doc = {"PodName": "prebound", "PodNamespace": "team-a", "PodUID": prebound["uid"], "Node": "w0"}
        assert (
            client.post("bind", doc)["Error"] == "rdma-cni: pod team-a/prebound is already bound to node w3"
        )
        errors: list[BaseException] = []

        def run(tenant: Tenant) -> None:
            try:
                tenant.run(scaled(PER_THREAD_ROUNDS))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(t,)) for t in tenants]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not errors, errors
        assert proc.poll() is None, "the extender died"
        for c in counters:
            stats.update(c)
        stats["runs"] += client.requests
        problems = judge(api, before)
        stats["violations"] += len(problems)
        assert not problems, "\n".join(problems[:20])
    finally:
        proc.kill()
        proc.wait(10)
