"""A Pending pod the extender refused for want of room is retried once its node publishes the room.

kube-scheduler parks a pod the extender refused (its pseudo-plugin
``Extender`` among the pod's rejectors) and tries it again on the next
cluster event. When a node publishes room, kube-scheduler's Node informer and
the extender's node watch each see the update, in either order. When
kube-scheduler's comes first, it retries the pod at once, the extender answers
from the state before the update, and no later event comes: before the
extender made kube-scheduler retry such pods itself, the pod stayed Pending
for up to kube-scheduler's five-minute flush (issue 36, item 6:
docs/scheduling.md, "Retried when room frees").

The race is lost every time here: the extender reaches kube-apiserver through a
relay that holds every byte towards it for :data:`LAG` seconds, so its watch
trails kube-scheduler's by that much (kube-scheduler reaches kube-apiserver
directly; nothing of the extender is changed). The module runs its own control
plane: any other cluster event retries every parked pod and would hide the
miss (another module's namespace being deleted is enough).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rdma_cni.shared import nodestate
from tests.cluster.conftest import failed_scheduling, strays_deleted, unique, wait_for_service_account
from tests.support import sched_objects as so
from tests.support.kube.applyconf import apply_conf
from tests.support.kube.controlplane import ControlPlane
from tests.support.kube.objects import create, create_node, pod_doc
from tests.support.kube.rdmascheduler import RdmaScheduler, start_rdma_scheduler
from tests.support.kube.relay import Relay
from tests.support.waiting import wait_for

ANNOTATION = "rdma_interfaces_required"
NETWORKS = "k8s.v1.cni.cncf.io/networks"
SCHEDULER = "rdma-scheduler"
NAD = "default/rdma-net"
# Seconds the extender's view of kube-apiserver trails kube-scheduler's.
LAG = 1.0
# How long a pod may stay Pending after its node published room: the extender's watch (LAG), its
# retry pass and status write, then kube-scheduler's backoff for the pod (1 s doubling per attempt,
# at most 10 s; these pods reach 8 s at most), with room for a busy machine.
BOUND = 15.0
# Trials of the race: each alone in the cluster, one after the other.
TRIALS = 20
PREEMPT_TRIALS = 5
# A parked pod: kube-scheduler has not called the extender about it for this long.
QUIET = 3.0


@dataclass
class Lagging:
    cp: ControlPlane
    rs: RdmaScheduler
    relay: Relay
    namespace: str


@pytest.fixture(scope="module")
def lagging(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lagging]:
    """A control plane of its own with conf/ applied, and rdma-scheduler whose extender lags by LAG."""
    cp = ControlPlane(str(tmp_path_factory.mktemp("retry")), default_scheduler=False)
    relay: Relay | None = None
    rs: RdmaScheduler | None = None
    try:
        cp.start()
        wait_for_service_account(cp, "default", "default")
        apply_conf(cp)
        strays_deleted(cp)  # conf/pod.yaml's sample pod would take the room the trials free
        relay = Relay(("127.0.0.1", cp.api_port))
        rs = start_rdma_scheduler(cp, tag="lagging", extender_api_port=relay.port)
        namespace = unique("retry")
        cp.kubectl("create", "namespace", namespace)
        wait_for_service_account(cp, namespace, "default")
        relay.delay = LAG
        yield Lagging(cp, rs, relay, namespace)
    finally:
        if rs is not None:
            rs.stop()
        if relay is not None:
            relay.close()
        cp.stop()


def judged(c: Lagging, node: str) -> None:
    """Wait until the extender's filter passes a pod of one VF without a rate on ``node``."""
    probe = so.rdma_pod(unique("probe"), [(0, 0)])
    del probe["metadata"]["uid"]  # no hold for a pod that is never bound (docs/scheduling.md, "Holds")

    def passes() -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", c.rs.extender_port, timeout=30)
        try:
            conn.request("POST", "/filter", body=json.dumps(so.args_names(probe, [node])))
            return bool(json.loads(conn.getresponse().read()).get("NodeNames") == [node])
        finally:
            conn.close()

    wait_for(passes, 60, f"the extender to judge {node}")


def publish(c: Lagging, node: str, state: nodestate.NodeState) -> None:
    """The node's agent publishes ``state`` (a new generation, stamped now)."""
    text = nodestate.encode(dataclasses.replace(state, updated=so.stamp()))
    c.cp.kubectl("annotate", "node", node, "--overwrite", f"{nodestate.ANNOTATION}={text}")


def rdma_pod(c: Lagging, name: str, rate: int, node: str, **kw: Any) -> None:
    """A pod of rdma-scheduler asking one interface of ``rate`` Mbit/s, pinned to ``node``."""
    annotations = {NETWORKS: NAD, ANNOTATION: json.dumps([{"min_tx_rate": rate}])}
    create(c.cp, pod_doc(c.namespace, name, annotations=annotations, scheduler=SCHEDULER, on_node=node, **kw))


def pod(c: Lagging, name: str) -> dict[str, Any]:
    found = c.cp.kubectl("get", "pod", name, "-n", c.namespace, "-o", "json", check=False)
    return json.loads(found.stdout) if found.returncode == 0 else {}


def node_of(c: Lagging, name: str) -> str:
    return str(pod(c, name).get("spec", {}).get("nodeName") or "")


def filters(c: Lagging, name: str) -> int:
    """How many filter calls kube-scheduler made about pod ``name``."""
    key = f"{c.namespace}/{name}"
    with c.rs.recorder.lock:
        return sum(1 for call in c.rs.recorder.calls if call.verb == "filter" and call.pod == key)


def parked(c: Lagging, name: str, reason: str) -> None:
    """Wait until kube-scheduler has refused ``name`` with ``reason`` and stopped retrying it.

    Its first refusal writes the pod's PodScheduled condition, which retries it once more; after
    that kube-scheduler leaves it in its unschedulable pool until an event.
    """
    wait_for(
        lambda: any(reason in m for m in failed_scheduling(c.cp, c.namespace, name)), 60, f"{name} refused"
    )
    seen, since = filters(c, name), time.monotonic()
    deadline = since + 60
    while time.monotonic() - since < QUIET:
        assert time.monotonic() < deadline, f"kube-scheduler kept retrying {name}"
        time.sleep(0.2)
        now = filters(c, name)
        if now != seen:
            seen, since = now, time.monotonic()


def bound_within(c: Lagging, name: str, node: str, timeout: float) -> float | None:
    """Seconds until ``name`` is bound to ``node``, or None when it is still not after ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if node_of(c, name) == node:
            return time.monotonic() - started
        time.sleep(0.1)
    return None


def retries(c: Lagging) -> dict[str, float]:
    """The extender's retry counter by outcome."""
    return {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(c.rs.metrics())
        for s in family.samples
        if s.name == "rdma_cni_extender_retries_total"
    }


def deleted(c: Lagging, pods: list[str], node: str) -> None:
    """Delete a trial's pods, then its node, and wait until they are gone: their events must not
    retry the next trial's pod."""
    if pods:
        c.cp.kubectl("delete", "pod", *pods, "-n", c.namespace, "--grace-period=0", "--force", check=False)
    c.cp.kubectl("delete", "node", node, check=False)


def report(results: list[float | None], what: str) -> str:
    missed = [i for i, took in enumerate(results) if took is None]
    times = sorted(t for t in results if t is not None)
    spread = f"{times[0]:.1f}-{times[-1]:.1f} s" if times else "none"
    return (
        f"{len(missed)} of {len(results)} {what} stayed Pending past {BOUND:.0f} s after the node "
        f"published room (trials {missed}); the others were bound in {spread}"
    )


def test_a_pod_refused_for_room_is_retried_when_its_node_publishes_room(lagging: Lagging) -> None:
    """The issue's case: a node whose only PF is full, a pod pinned to it asking 30000 Mbit/s."""
    c = lagging
    results: list[float | None] = []
    for _ in range(TRIALS):
        node = unique("retry-node")
        full = so.state([("ens1f0", 40_000, 4)], [(unique("holder"), [("ens1f0", 40_000, 0)])])
        create_node(c.cp, node, {nodestate.ANNOTATION: nodestate.encode(full)})
        judged(c, node)
        name = unique("retry")
        rdma_pod(c, name, 30_000, node)
        parked(c, name, "rdma-cni: needs 30000 Mbit/s free on one PF with a free VF")
        publish(c, node, so.state([("ens1f0", 40_000, 4)], generation=2))
        results.append(bound_within(c, name, node, BOUND))
        deleted(c, [name], node)
    print(report(results, "pods"), retries(c))
    assert all(took is not None for took in results), f"{report(results, 'pods')}; retries {retries(c)}"


def test_a_preemptor_whose_victim_went_before_the_node_republished_is_retried(lagging: Lagging) -> None:
    """Preemption's case: the victim is deleted, kube-scheduler retries the preemptor on the node that
    still publishes the victim's bandwidth, and the node republishes without it only later, as a
    real node's agent does after the victim's CNI DEL."""
    c = lagging
    low, high = unique("low"), unique("high")
    for pc, value in ((low, 100), (high, 1000)):
        c.cp.kubectl("create", "priorityclass", pc, f"--value={value}")
    results = [preemption_trial(c, low, high) for _ in range(PREEMPT_TRIALS)]
    print(report(results, "preemptors"), retries(c))
    assert all(took is not None for took in results), f"{report(results, 'preemptors')}; retries {retries(c)}"


def preemption_trial(c: Lagging, low: str, high: str) -> float | None:
    """One node, two low pods on it, a high pod that preempts one: seconds until the preemptor is
    bound after the node republished without its victim (None: not within BOUND)."""
    node = unique("retry-preempt")
    pf = ("ens8f0", 40_000, 4)
    create_node(c.cp, node, {nodestate.ANNOTATION: nodestate.encode(so.state([pf]))}, cpu="1")
    judged(c, node)
    big, small = unique("v25"), unique("v10")
    # One at a time, each bound before the next is created.
    for name, rate, cpu in ((big, 25_000, "600m"), (small, 10_000, "100m")):
        rdma_pod(c, name, rate, node, priority_class=low, cpu=cpu)
        wait_for(lambda name=name: node_of(c, name) == node, 90, f"low pod {name} bound")
    uids = {name: pod(c, name)["metadata"]["uid"] for name in (big, small)}
    # The node's agent publishes both pods after their ADDs.
    both = [(uids[big], [("ens8f0", 25_000, 0)]), (uids[small], [("ens8f0", 10_000, 0)])]
    publish(c, node, so.state([pf], both, generation=2))
    # 600m of CPU: kube-scheduler must evict the 600m pod, whose 25000 Mbit/s also makes room (the
    # preempt verb keeps the node for it).
    preemptor = unique("preemptor")
    rdma_pod(c, preemptor, 25_000, node, priority_class=high, cpu="600m")
    wait_for(lambda: not pod(c, big), 60, "the victim's eviction")
    # kube-scheduler retried the preemptor when the victim went; the node still publishes it.
    parked(c, preemptor, "rdma-cni: needs 25000 Mbit/s free on one PF with a free VF")
    assert not node_of(c, preemptor)
    publish(c, node, so.state([pf], both[1:], generation=3))
    took = bound_within(c, preemptor, node, BOUND)
    assert pod(c, small) and not pod(c, small)["metadata"].get("deletionTimestamp")
    deleted(c, [small, preemptor], node)
    return took
