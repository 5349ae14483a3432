"""rdma-scheduler (kube-scheduler from conf/ with the extender sidecar) places pods as promised.

Nodes are created directly (Ready, no kubelet) and their states published in
the node-state annotation; pods ask in the annotation (and, where conf/'s
extender names the network in ``--networks``, in Multus ``cni-args``). Checked
from the API server's side only: where each pod is bound, its events, and the
published states the bound pods must fit (placement's independent oracle).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rdma_cni.agent import capacity, publish
from rdma_cni.shared import nodestate
from rdma_cni.shared.placement import PfState, Request
from tests.cluster.conftest import failed_scheduling, strays_deleted, unique, wait_for_service_account
from tests.support import sched_objects as so
from tests.support.kube.controlplane import REPO, ControlPlane
from tests.support.kube.objects import client_for_token, create, create_node, pod_doc
from tests.support.kube.rdmascheduler import RdmaScheduler, container, find, manifest
from tests.support.placement_oracle import reference_fits
from tests.support.waiting import wait_for

ANNOTATION = "rdma_interfaces_required"
NETWORKS = "k8s.v1.cni.cncf.io/networks"
SCHEDULER = "rdma-scheduler"
# conf/'s NetworkAttachmentDefinition, in namespace default: pods elsewhere name its namespace.
NAD = "default/rdma-net"


@dataclass
class Cluster:
    cp: ControlPlane
    rs: RdmaScheduler
    namespace: str
    states: dict[str, nodestate.NodeState]


@pytest.fixture(scope="module")
def cluster(applied: ControlPlane, rdma_scheduler: RdmaScheduler) -> Iterator[Cluster]:
    namespace = unique("sched")
    strays_deleted(applied)
    applied.kubectl("create", "namespace", namespace)
    wait_for_service_account(applied, namespace, "default")
    # Three nodes, one PF each: 3 pods of 8000 fit on big (4 VFs, 25000),
    # 1 on small (2 VFs, 10000), 1 on onevf (1 VF, 25000).
    layout = {"big": ("ens1f0", 25_000, 4), "small": ("ens2f0", 10_000, 2), "onevf": ("ens3f0", 25_000, 1)}
    cluster = Cluster(applied, rdma_scheduler, namespace, {})
    for role, pf in layout.items():
        published_node(cluster, unique(f"sched-{role}"), so.state([pf]))
    yield cluster
    applied.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    # Including the nodes tests added: no later module schedules onto them.
    applied.kubectl("delete", "node", *cluster.states, "--wait=false", check=False)


def published_node(c: Cluster, name: str, state: nodestate.NodeState, **kw: Any) -> None:
    """Create a Node with ``state`` published and wait until the extender judges it.

    kube-scheduler tries a pod once when it is created and then only on
    cluster events: a pod filtered before the extender's watch delivered the
    Node would wait for the next event (up to 5 minutes when none comes).
    """
    create_node(c.cp, name, {nodestate.ANNOTATION: nodestate.encode(state)}, **kw)
    c.states[name] = state
    probe = so.rdma_pod(unique("probe"), [(0, 0)])
    # Without a uid: a filter that passes one node holds it for its pod (docs/scheduling.md, "Holds"),
    # and this probe is no pod that will ever be bound.
    del probe["metadata"]["uid"]

    def judged() -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", c.rs.extender_port, timeout=30)
        try:
            conn.request("POST", "/filter", body=json.dumps(so.args_names(probe, [name])))
            return bool(json.loads(conn.getresponse().read()).get("NodeNames") == [name])
        finally:
            conn.close()

    wait_for(judged, 60, f"the extender to judge {name}")


@pytest.fixture(autouse=True)
def _pending_pods_deleted(cluster: Cluster) -> Iterator[None]:
    # A pod a test leaves Pending would take the room a later test's node offers.
    yield
    pending = [n for n, p in pods(cluster).items() if not p["spec"].get("nodeName")]
    if pending:
        cluster.cp.kubectl("delete", "pod", *pending, "-n", cluster.namespace, "--grace-period=0", "--force")
        wait_for(lambda: not set(pending) & set(pods(cluster)), 60, "pending pods deleted")


def rdma_pod(c: Cluster, name: str, request: list[dict[str, int]], **kw: Any) -> None:
    annotations = {NETWORKS: NAD, ANNOTATION: json.dumps(request)}
    create(c.cp, pod_doc(c.namespace, name, annotations=annotations, scheduler=SCHEDULER, **kw))


def pods(c: Cluster) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in c.cp.get("pods", "-n", c.namespace)["items"]}


def scheduled_by(c: Cluster, pod: str) -> set[str]:
    events = c.cp.get(
        "events", "-n", c.namespace, "--field-selector", f"involvedObject.name={pod},reason=Scheduled"
    )
    return {e.get("reportingComponent") or e.get("source", {}).get("component", "") for e in events["items"]}


def extender_calls(rs: RdmaScheduler) -> dict[str, float]:
    counts = {}
    for family in text_string_to_metric_families(rs.metrics()):
        for s in family.samples:
            if s.name == "rdma_cni_extender_request_seconds_count":
                counts[s.labels["verb"]] = s.value
    return counts


def requests_of(pod: dict[str, Any]) -> list[Request]:
    raw = json.loads(pod["metadata"]["annotations"][ANNOTATION])
    return [Request(r.get("min_tx_rate", 0), r.get("max_tx_rate", 0)) for r in raw]


def assert_not_over_committed(c: Cluster) -> dict[str, list[str]]:
    """Each node's bound pods fit its published state together; returns pod names by node."""
    by_node: dict[str, list[str]] = {}
    for name, pod in pods(c).items():
        node = pod["spec"].get("nodeName")
        if node and pod["spec"].get("schedulerName") == SCHEDULER:
            by_node.setdefault(node, []).append(name)
    for node, names in by_node.items():
        assert node in c.states, f"{names} bound to {node}, which publishes no state"
        pfs = [PfState(p.name, p.free_vfs, p.capacity_tx_rate, p.used_tx_rate) for p in c.states[node].pfs]
        wanted = [r for n in names for r in requests_of(pods(c)[n])]
        assert reference_fits(wanted, pfs), f"{node} over-committed by {names}"
    return by_node


def test_pods_fill_the_nodes_and_never_over_commit(cluster: Cluster) -> None:
    c = cluster
    before = extender_calls(c.rs)
    names = [unique("fill") for _ in range(7)]
    for name in names:
        rdma_pod(c, name, [{"min_tx_rate": 8000}])

    # Five fit (3 + 1 + 1); the other two stay Pending, told why by the extender.
    def settled() -> dict[str, list[str]] | None:
        current = pods(c)
        bound = [n for n in names if current[n]["spec"].get("nodeName")]
        pending = [n for n in names if n not in bound]
        if len(bound) == 5 and all(failed_scheduling(c.cp, c.namespace, n) for n in pending):
            return {"bound": bound, "pending": pending}
        return None

    result = wait_for(settled, 90, "5 pods bound and 2 told why they are pending")
    by_node = assert_not_over_committed(c)
    assert sorted(len(v) for v in by_node.values()) == [1, 1, 3], by_node
    for name in result["pending"]:
        messages = failed_scheduling(c.cp, c.namespace, name)
        assert any("rdma-cni: needs 8000 Mbit/s free on one PF with a free VF" in m for m in messages), (
            messages
        )
    # kube-scheduler never binds: every bind went to the extender, which
    # created the Binding (its metrics count the calls it answered).
    after = extender_calls(c.rs)
    assert after.get("bind", 0) - before.get("bind", 0) >= 5
    bound_through_extender = c.rs.recorder.pods("bind")
    for name in result["bound"]:
        assert f"{c.namespace}/{name}" in bound_through_extender
        assert scheduled_by(c, name) == {SCHEDULER}


def test_a_pod_that_fits_nowhere_stays_pending_with_the_extenders_reason(cluster: Cluster) -> None:
    c = cluster
    name = unique("huge")
    rdma_pod(c, name, [{"min_tx_rate": 26_000}])
    messages = wait_for(lambda: failed_scheduling(c.cp, c.namespace, name), 60, "a FailedScheduling event")
    assert any("rdma-cni: needs 26000 Mbit/s" in m for m in messages), messages
    time.sleep(2)
    assert not pods(c)[name]["spec"].get("nodeName")


def test_pods_of_the_default_scheduler_are_never_sent_to_the_extender(cluster: Cluster) -> None:
    c = cluster
    name = unique("default")
    annotations = {NETWORKS: NAD, ANNOTATION: json.dumps([{"min_tx_rate": 26_000}])}
    create(c.cp, pod_doc(c.namespace, name, annotations=annotations))
    node = wait_for(lambda: pods(c)[name]["spec"].get("nodeName"), 60, "the default scheduler's bind")
    assert node  # its RDMA request would fit nowhere: the extender was not asked
    assert scheduled_by(c, name) == {"default-scheduler"}
    # rdma-scheduler's pods went through the extender meanwhile; this one never did.
    ours = f"{c.namespace}/{name}"
    for verb in ("filter", "prioritize", "preempt", "bind"):
        assert ours not in c.rs.recorder.pods(verb), verb
    assert c.rs.recorder.count("filter") > 0


def test_requests_in_multus_cni_args_are_placed_too(cluster: Cluster) -> None:
    c = cluster
    ext = container(
        find(manifest("base/extender/scheduler-extender.yaml"), "Deployment", "rdma-scheduler"), "extender"
    )
    # Shipped on: without --networks the extender would judge cni-args blind (issue 30's defaults).
    assert any(a.startswith("--networks") for a in ext.get("command", []) + ext.get("args", []))
    name = unique("cniargs")
    request = {ANNOTATION: [{"min_tx_rate": 26_000}]}
    networks = [{"namespace": "default", "name": "rdma-net", "cni-args": request}]
    create(
        c.cp, pod_doc(c.namespace, name, annotations={NETWORKS: json.dumps(networks)}, scheduler=SCHEDULER)
    )
    messages = wait_for(lambda: failed_scheduling(c.cp, c.namespace, name), 60, "a FailedScheduling event")
    assert any("rdma-cni: needs 26000 Mbit/s" in m for m in messages), messages


def test_preemption_for_bandwidth_alone_evicts_nobody(cluster: Cluster) -> None:
    """What kube-scheduler v1.37 really does when only RDMA bandwidth is short.

    Its preemption picks victims with its own filters, which know CPU, memory
    and pods but not VFs or bandwidth: every victim is reprieved, a node
    without victims is no candidate ("expected at least one victim pod"), and
    the extender's preempt verb is never called. No pod is evicted; the
    preemptor waits until bandwidth is freed otherwise (docs/scheduling.md).
    """
    c = cluster
    low, high = unique("low"), unique("high")
    for pc, value in ((low, 100), (high, 1000)):
        c.cp.kubectl("create", "priorityclass", pc, f"--value={value}")
    # One PF of 40000, filled by low pods held there by a nodeSelector.
    node = unique("sched-preempt")
    state = so.state([("ens9f0", 40_000, 4)])
    published_node(c, node, state)
    victims = {unique("v25"): 25_000, unique("v10"): 10_000, unique("v5"): 5_000}
    # One at a time, so each is bound at its first try: created together, a later one's filter can
    # pass before an earlier one's bind reserved (the collision docs/scheduling.md counts), and the
    # refused pod is retried only after kube-scheduler's backoff. Preemption is the subject here.
    for name, rate in victims.items():
        rdma_pod(c, name, [{"min_tx_rate": rate}], priority_class=low, on_node=node)
        wait_for(lambda name=name: pods(c)[name]["spec"].get("nodeName") == node, 90, f"low pod {name} bound")
    preempts = c.rs.recorder.count("preempt")
    # 25000 more would fit once the 25000 pod were gone.
    preemptor = unique("preemptor")
    rdma_pod(c, preemptor, [{"min_tx_rate": 25_000}], priority_class=high, on_node=node)
    messages = wait_for(
        lambda: [m for m in failed_scheduling(c.cp, c.namespace, preemptor) if "preemption:" in m],
        60,
        "the preemption's verdict",
    )
    assert any("rdma-cni: needs 25000 Mbit/s" in m for m in messages), messages
    time.sleep(3)
    current = pods(c)
    assert all(n in current and not current[n]["metadata"].get("deletionTimestamp") for n in victims)
    assert not current[preemptor]["spec"].get("nodeName")
    assert c.rs.recorder.count("preempt") == preempts
    assert_not_over_committed(c)


def republish_and_bind(c: Cluster, node: str, state: nodestate.NodeState, preemptor: str) -> None:
    """Publish ``node``'s state again, as its agent does after the victim's DEL, and wait until the
    preemptor is bound there (failing with its FailedScheduling events).

    First the extender ends the deleted victim's reservation (within 10 s); the republished state
    is then the Node update on which kube-scheduler tries the preemptor again.
    """
    time.sleep(11)
    republished = dataclasses.replace(state, generation=state.generation + 1, updated=so.stamp())
    c.cp.kubectl(
        "annotate", "node", node, "--overwrite", f"{nodestate.ANNOTATION}={nodestate.encode(republished)}"
    )
    try:
        wait_for(
            lambda: pods(c).get(preemptor, {}).get("spec", {}).get("nodeName") == node, 60, "the preemptor"
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {failed_scheduling(c.cp, c.namespace, preemptor)}") from None


def test_preemption_through_the_preempt_verb_evicts_the_victim_that_frees_bandwidth(cluster: Cluster) -> None:
    """CPU makes kube-scheduler preempt; the extender keeps the node only where the victims free bandwidth."""
    c = cluster
    low, high = unique("low"), unique("high")
    for pc, value in ((low, 100), (high, 1000)):
        c.cp.kubectl("create", "priorityclass", pc, f"--value={value}")
    node = unique("sched-cpu")
    state = so.state([("ens8f0", 40_000, 4)])
    published_node(c, node, state, cpu="1")
    big, small = unique("v25"), unique("v10")
    rdma_pod(c, big, [{"min_tx_rate": 25_000}], priority_class=low, on_node=node, cpu="600m")
    rdma_pod(c, small, [{"min_tx_rate": 10_000}], priority_class=low, on_node=node, cpu="100m")
    wait_for(
        lambda: all(pods(c)[n]["spec"].get("nodeName") == node for n in (big, small)), 90, "the low pods"
    )
    preempts = c.rs.recorder.count("preempt")
    # 600m CPU: kube-scheduler must evict the 600m pod, whose 25000 Mbit/s also makes room.
    preemptor = unique("preemptor")
    rdma_pod(c, preemptor, [{"min_tx_rate": 25_000}], priority_class=high, on_node=node, cpu="600m")
    # The victim is deleted (grace 0: at once, as a kubelet would confirm).
    wait_for(lambda: big not in pods(c), 60, "the victim's eviction")
    # Then its CNI DEL runs and the node's agent publishes the freed state.
    republish_and_bind(c, node, state, preemptor)
    current = pods(c)
    assert big not in current
    assert small in current and not current[small]["metadata"].get("deletionTimestamp")
    assert c.rs.recorder.count("preempt") > preempts
    assert_not_over_committed(c)


BANDWIDTH, VFS = nodestate.BANDWIDTH_RESOURCE, nodestate.VF_RESOURCE


def advertised(c: Cluster, node: str, state: nodestate.NodeState) -> None:
    """The node's agent publishes ``state`` and advertises its RDMA resources in the Node's status.

    Through the agent's own publisher, with a token bound to a pod on the node as the DaemonSet's
    is: so through conf/'s RBAC and admission policy. kube-scheduler's filters count them.
    """
    pod = unique("rdma-cni-agent")
    create(c.cp, pod_doc("kube-system", pod, node=node, account="rdma-cni"))
    token = c.cp.token("kube-system", "rdma-cni", "--bound-object-kind=Pod", f"--bound-object-name={pod}")
    with client_for_token(c.cp, token, f"agent-{node}") as client:
        publisher = publish.Publisher(client, node)
        publisher.offer(state)
        assert publisher.step(), publisher.last_error
    wanted = capacity.resources(state)
    assert publisher.capacity.advertised == wanted, publisher.capacity.last_error
    c.cp.kubectl("delete", "pod", pod, "-n", "kube-system", "--wait=false")

    def seen() -> bool:
        allocatable = c.cp.get("node", node)["status"].get("allocatable", {})
        return all(allocatable.get(k) in (v, f"{int(v) // 1000}k") for k, v in wanted.items())

    wait_for(seen, 30, f"{node}'s RDMA resources in its status")


def declaring_pod(c: Cluster, name: str, rate: int, declared: int | None = None, **kw: Any) -> None:
    """An RDMA pod of one interface whose container requests ``declared`` (default ``rate``) Mbit/s."""
    annotations = {NETWORKS: NAD, ANNOTATION: json.dumps([{"min_tx_rate": rate}])}
    doc = pod_doc(c.namespace, name, annotations=annotations, scheduler=SCHEDULER, **kw)
    extended = {BANDWIDTH: str(rate if declared is None else declared), VFS: "1"}
    resources = doc["spec"]["containers"][0]["resources"]
    resources["requests"].update(extended)
    resources["limits"] = dict(extended)  # extended resources: limits equal to requests
    create(c.cp, doc)


def test_preemption_for_declared_bandwidth_evicts_exactly_the_victim_that_frees_it(cluster: Cluster) -> None:
    """Bandwidth and VFs as extended resources: kube-scheduler's own preemption sees them.

    Its filters then reject the preemptor for the bandwidth; SelectVictimsOnNode
    removes every lower-priority pod and reprieves those the preemptor fits
    beside (10000 + 5000 + 25000 fit 40000; the 25000 pod does not), and the
    extender's preempt verb keeps the node because evicting that victim frees
    the PF's bandwidth.
    """
    c = cluster
    low, high = unique("low"), unique("high")
    for pc, value in ((low, 100), (high, 1000)):
        c.cp.kubectl("create", "priorityclass", pc, f"--value={value}")
    node = unique("sched-declared")
    state = so.state([("ens5f0", 40_000, 4)])
    published_node(c, node, state)
    advertised(c, node, state)
    victims = {unique("v25"): 25_000, unique("v10"): 10_000, unique("v5"): 5_000}
    for name, rate in victims.items():  # one at a time, as in the bandwidth-only test
        declaring_pod(c, name, rate, priority_class=low, on_node=node)
        wait_for(lambda name=name: pods(c)[name]["spec"].get("nodeName") == node, 90, f"low pod {name} bound")
    preempts = c.rs.recorder.count("preempt")
    preemptor = unique("preemptor")
    declaring_pod(c, preemptor, 25_000, priority_class=high, on_node=node)
    big = next(iter(victims))
    wait_for(lambda: big not in pods(c), 60, "the victim's eviction")
    assert c.rs.recorder.count("preempt") > preempts
    republish_and_bind(c, node, state, preemptor)
    current = pods(c)
    for name in list(victims)[1:]:
        assert name in current and not current[name]["metadata"].get("deletionTimestamp"), name
    assert_not_over_committed(c)


def test_a_pod_that_declares_less_than_it_asks_preempts_nobody_and_is_told_why(cluster: Cluster) -> None:
    """A pod cannot buy room with a small declaration: preempt keeps no node for it, filter says why."""
    c = cluster
    low, high = unique("low"), unique("high")
    for pc, value in ((low, 100), (high, 1000)):
        c.cp.kubectl("create", "priorityclass", pc, f"--value={value}")
    full = unique("sched-full")
    published_node(c, full, so.state([("ens4f0", 40_000, 4)]))
    advertised(c, full, so.state([("ens4f0", 40_000, 4)]))
    holder = unique("v40")
    declaring_pod(c, holder, 40_000, priority_class=low, on_node=full)
    wait_for(lambda: pods(c)[holder]["spec"].get("nodeName") == full, 90, "the low pod bound")
    preempts = c.rs.recorder.count("preempt")
    # Asks 25000 but declares 5000: kube-scheduler's filters see 5000 too many on the full node
    # (no other node advertises the resources) and its preemption proposes the low pod.
    liar = unique("liar")
    declaring_pod(c, liar, 25_000, declared=5_000, priority_class=high)
    wait_for(lambda: c.rs.recorder.count("preempt") > preempts, 60, "the preempt verb")
    assert f"{c.namespace}/{liar}" in c.rs.recorder.pods("preempt")
    time.sleep(3)
    current = pods(c)
    assert not current[holder]["metadata"].get("deletionTimestamp")
    assert not current[liar]["spec"].get("nodeName")
    # A node with room for what it declares: kube-scheduler's filters pass it, the extender's
    # filter refuses the pod, and its events say why.
    room = unique("sched-room")
    published_node(c, room, so.state([("ens3f0", 40_000, 4)]))
    advertised(c, room, so.state([("ens3f0", 40_000, 4)]))
    messages = wait_for(
        lambda: [m for m in failed_scheduling(c.cp, c.namespace, liar) if "requests 5000 as" in m],
        60,
        "the extender's reason",
    )
    assert f"rdma-cni: pod {c.namespace}/{liar} requests 5000 as {BANDWIDTH}" in messages[0], messages
    assert not pods(c)[liar]["spec"].get("nodeName")
    assert holder in pods(c)
    assert_not_over_committed(c)


def test_the_extender_killed_mid_burst_rebuilds_its_reservations(cluster: Cluster) -> None:
    c = cluster
    node = unique("sched-burst")
    state = so.state([("ens7f0", 20_000, 8)])
    published_node(c, node, state)
    names = [unique("burst") for _ in range(10)]
    for name in names:  # 5 of 4000 fit the 20000
        rdma_pod(c, name, [{"min_tx_rate": 4000}], on_node=node)
    wait_for(lambda: sum(1 for n in names if pods(c)[n]["spec"].get("nodeName")) >= 2, 60, "two binds")
    # SIGKILL mid-burst: the reservations of pods bound but not published live only in the process.
    c.rs.extender.stop(signal.SIGKILL)
    c.rs.extender.start()
    c.rs.extender.wait_ready(c.rs.ready, 90)
    bound = wait_for(
        lambda: (b := [n for n in names if pods(c)[n]["spec"].get("nodeName")]) and len(b) >= 5 and b,
        120,
        "five pods bound",
    )
    time.sleep(5)  # kube-scheduler keeps retrying the other five meanwhile
    assert len([n for n in names if pods(c)[n]["spec"].get("nodeName")]) == len(bound) == 5
    assert_not_over_committed(c)


def test_the_extenders_watch_relists_after_410_when_the_api_server_restarts(cluster: Cluster) -> None:
    c = cluster
    log = Path(c.rs.extender.log)
    relists = log.read_text().count("is too old, relisting")
    # A restarted kube-apiserver's watch cache starts at the current revision:
    # the extender's resumed node watch is older, and the server answers 410.
    c.cp.restart_apiserver()
    wait_for(lambda: log.read_text().count("is too old, relisting") > relists, 90, "the extender's relist")
    # kube-scheduler lost its lease while the server was down and exited, as
    # it does in its pod, where the kubelet starts it again: so here.
    time.sleep(2)
    assert c.rs.restart_exited() in ([], [c.rs.scheduler.name])
    assert c.rs.extender.alive()
    # It follows Nodes again: one published after the restart is judged.
    node = unique("sched-after")
    state = so.state([("ens6f0", 25_000, 2)])
    published_node(c, node, state)
    name = unique("after")
    rdma_pod(c, name, [{"min_tx_rate": 20_000}], on_node=node)
    wait_for(lambda: pods(c)[name]["spec"].get("nodeName") == node, 90, "a bind on the new node")
    assert_not_over_committed(c)


WIRE_FIXTURE = Path(REPO) / "tests" / "unit" / "data" / "kube-scheduler-extender-wire.json"


def _shape(doc: Any) -> Any:
    """The keys of a document, nested (values and the Pod's inner fields left out), for comparing wires."""
    if isinstance(doc, dict):
        shaped = {}
        for k, v in doc.items():
            if k in ("annotations", "labels"):
                continue
            if k == "Pod" and isinstance(v, dict):
                shaped[k] = sorted(v)  # the pod's own fields vary with its history
                continue
            if k in ("NodeNameToMetaVictims", "NodeNameToVictims") and isinstance(v, dict):
                v = {"<node>": next(iter(v.values()))} if v else {}  # keyed by node names
            shaped[k] = _shape(v)
        return shaped
    if isinstance(doc, list):
        return [_shape(doc[0])] if doc else []
    return type(doc).__name__


def test_the_recorded_wire_is_what_kube_scheduler_sends(cluster: Cluster) -> None:
    """The unit tier replays kube-scheduler's calls recorded here; this run's calls have their shape.

    ``RDMA_CNI_RECORD_WIRE=1`` rewrites the fixture from this run (after a
    Kubernetes upgrade). It runs last in this module, after the preemption.
    """
    whole = cluster.rs.recorder.whole
    ext = container(
        find(manifest("base/extender/scheduler-extender.yaml"), "Deployment", "rdma-scheduler"), "extender"
    )
    best_one = "--best-nodes=1" in ext.get("command", []) + ext.get("args", [])
    # conf/'s --best-nodes=1 passes one node per pod, and kube-scheduler scores (and asks prioritize)
    # only among several: that it never asked is what the option promises. The fixture keeps the
    # prioritize call recorded before the option (its shape is kube-scheduler's, not ours).
    verbs = ("filter", "preempt", "bind") if best_one else ("filter", "prioritize", "preempt", "bind")
    missing = [v for v in verbs if not whole.get(v)]
    assert not missing, f"this run made no call of {missing}: the whole module must run before this test"
    if best_one:
        assert not whole.get("prioritize"), "kube-scheduler asked prioritize although one node passed"
    fixture = json.loads(WIRE_FIXTURE.read_text())
    recorded = {v: whole[v][0] for v in verbs}
    if os.environ.get("RDMA_CNI_RECORD_WIRE") == "1":
        calls = {**fixture["calls"], **recorded}
        doc = {"kubernetes": cluster.cp.version, "calls": calls}
        WIRE_FIXTURE.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    fixture = json.loads(WIRE_FIXTURE.read_text())
    assert fixture["kubernetes"] == cluster.cp.version, (
        "re-record the wire: RDMA_CNI_RECORD_WIRE=1 make cluster"
    )
    for verb in verbs:
        assert _shape(recorded[verb]["request"]) == _shape(fixture["calls"][verb]["request"]), verb
