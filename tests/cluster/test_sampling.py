"""kube-scheduler's sample of nodes: a pod whose only fitting node a sample left out still lands on it.

conf/ leaves ``percentageOfNodesToScore`` to kube-scheduler's default, so with
100 nodes or more kube-scheduler asks the extender only about the first
feasible nodes it finds (docs/scheduling.md, "Sampled nodes"). Here 250 Nodes
publish states that fit nothing but one spare node (every fifth Node is
tainted too, as nodes kube-scheduler's own filters reject are in real
clusters). Pods are created one at a time. kube-scheduler starts each search
where the last one stopped, so samples of about 150 of the 250 nodes leave the
spare node out two times in five: such a pod must be sent back for the next
nodes, never told it fits nowhere (which also runs preemption, and leaves it to
wait for a cluster event), and bound to the spare node within a minute.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rdma_cni.shared import nodestate
from tests.cluster.conftest import failed_scheduling, strays_deleted, unique, wait_for_service_account
from tests.support import sched_objects as so
from tests.support.kube.applyconf import apply_conf
from tests.support.kube.controlplane import ControlPlane
from tests.support.kube.objects import NOT_READY_TAINT, create, node_doc, pod_doc
from tests.support.kube.rdmascheduler import RdmaScheduler, start_rdma_scheduler
from tests.support.waiting import wait_for

ANNOTATION = "rdma_interfaces_required"
SCHEDULER = "rdma-scheduler"
NODES = 250
SPARE_AT = 125
ELSEWHERE_TAINT = "rdma-cni.io/test-elsewhere"
# At most this many pods: each is a new sample (kube-scheduler's start moves on by ~150 of 250
# nodes), so the spare node is left out of two samples in five.
PODS = 10
RESAMPLED = "kube-scheduler sampled fits this pod"
FULL = so.state([("ens1f0", 25_000, 1)], [("u0", [("ens1f0", 25_000, 0)])])
SPARE = so.state([("ens1f0", 100_000, PODS)])


@dataclass
class Sampled:
    cp: ControlPlane
    rs: RdmaScheduler
    namespace: str
    label: str
    spare: str


@pytest.fixture(scope="module")
def isolated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlane, RdmaScheduler]]:
    """A control plane of its own with conf/ applied, and rdma-scheduler called directly.

    Every failed attempt's event is checked here, so nothing but kube-scheduler and the extender
    may stand between them: the session's rdma-scheduler calls the extender through the test's
    recorder (in this process, beside the other modules' relays and servers), and its
    kube-scheduler also retries other modules' Pending pods on every Node this module creates.
    A filter reset on the hop to that recorder, 5 s after the module before closed its relay,
    was once the event of this test's first pod (CI, 2026-11-28).
    """
    cp = ControlPlane(str(tmp_path_factory.mktemp("sampling")), default_scheduler=False)
    rs: RdmaScheduler | None = None
    try:
        cp.start()
        wait_for_service_account(cp, "default", "default")
        apply_conf(cp)
        strays_deleted(cp)  # conf/pod.yaml's sample pod would take the spare node's room
        rs = start_rdma_scheduler(cp, tag="sampling", record=False)
        yield cp, rs
    finally:
        if rs is not None:
            rs.stop()
        cp.stop()


@pytest.fixture(scope="module")
def sampled(isolated: tuple[ControlPlane, RdmaScheduler]) -> Iterator[Sampled]:
    applied, rdma_scheduler = isolated
    namespace = unique("sample")
    label = unique("s")
    selector = f"rdma-cni.io/test-sample={label}"
    applied.kubectl("create", "namespace", namespace)
    wait_for_service_account(applied, namespace, "default")
    names = [f"{label}-{i:03d}" for i in range(NODES)]
    items = []
    for i, name in enumerate(names):
        doc = node_doc(name, {nodestate.ANNOTATION: nodestate.encode(SPARE if i == SPARE_AT else FULL)})
        doc["metadata"]["labels"]["rdma-cni.io/test-sample"] = label
        if i % 5 == 1:
            doc["spec"] = {"taints": [{"key": ELSEWHERE_TAINT, "effect": "NoSchedule"}]}
        items.append(doc)
    try:
        # In this order (one create after another): every sample of 100 nodes or more has tainted ones.
        listed = {"apiVersion": "v1", "kind": "List", "items": items}
        applied.kubectl("create", "-f", "-", input=json.dumps(listed))
        # TaintNodesByCondition put the not-ready taint on each at create (no node lifecycle controller).
        applied.kubectl("taint", "nodes", "-l", selector, f"{NOT_READY_TAINT}:NoSchedule-")
        wait_for(lambda: watched(rdma_scheduler) >= NODES, 120, f"the extender to watch {NODES} nodes")
        yield Sampled(applied, rdma_scheduler, namespace, label, names[SPARE_AT])
    finally:
        applied.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        applied.kubectl("delete", "nodes", "-l", selector, "--wait=false", check=False)


def metric(rs: RdmaScheduler, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(rs.metrics()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def watched(rs: RdmaScheduler) -> float:
    return metric(rs, "rdma_cni_extender_watched_nodes")


def resampled(rs: RdmaScheduler) -> float:
    return metric(rs, "rdma_cni_extender_decisions_total", verb="filter", outcome="resample")


def bound_node(s: Sampled, pod: str) -> str:
    doc = s.cp.get("pod", pod, "-n", s.namespace)
    return str(doc["spec"].get("nodeName") or "")


def test_a_pod_whose_only_fitting_node_a_sample_left_out_is_placed_on_it(sampled: Sampled) -> None:
    s = sampled
    start = resampled(s.rs)
    for i in range(PODS):
        name = f"p{i}"
        doc = pod_doc(s.namespace, name, annotations={ANNOTATION: json.dumps([{"min_tx_rate": 1000}])})
        doc["spec"]["schedulerName"] = SCHEDULER
        doc["spec"]["nodeSelector"] = {"rdma-cni.io/test-sample": s.label}
        create(s.cp, doc)
        node = wait_for(lambda name=name: bound_node(s, name), 60, f"{name} bound")
        assert node == s.spare, f"{name} bound to {node}, which fits nothing"
    # kube-scheduler records an attempt that failed, a FitError or an extender's error, as an event.
    left_out = {}
    for i in range(PODS):
        if messages := failed_scheduling(s.cp, s.namespace, f"p{i}"):
            left_out[f"p{i}"] = messages
    assert left_out, f"the spare node was in kube-scheduler's first sample for all {PODS} pods"
    seen = f"resampled {resampled(s.rs) - start:.0f} times; events: {json.dumps(left_out, indent=1)}"
    for pod, messages in left_out.items():
        for message in messages:
            # Not "0/250 nodes are available: ... preemption: ...": that is a pod told it fits nowhere.
            assert RESAMPLED in message and f"node '{s.spare}' outside them does" in message, (pod, seen)
    assert resampled(s.rs) - start >= len(left_out)
