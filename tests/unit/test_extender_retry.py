"""The retrier: a pod filter refused for want of room is retried once a node it named has room.

kube-scheduler's side is what the pod writes mean to it (any update of a parked pod retries it);
here the API is a stand-in holding pods, and every path of a pass is driven by hand (``run_once``).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from typing import Any

import pytest

from rdma_cni.extender import retry, wire
from rdma_cni.extender.decide import Decider, NodeView
from rdma_cni.extender.demand import Demands
from rdma_cni.extender.podwatch import PodWatch
from rdma_cni.extender.reservations import Reservations
from rdma_cni.extender.retry import CONDITION, NODES_KEPT, Retrier, room_grew
from rdma_cni.extender.settings import Settings
from rdma_cni.extender.verbs import Extender
from rdma_cni.kube import client as kubeapi
from rdma_cni.shared import nodestate
from tests.support import sched_objects as so

ANNOTATION = "rdma_interfaces_required"
PF = ("ens1f0", 40_000, 4)
FULL = so.state([PF], [("holder", [("ens1f0", 40_000, 0)])])
FREE = so.state([PF], generation=2)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Api:
    """Pods as stored, and the status patches the retrier sends (conditions merged by type)."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.get_error: kubeapi.ApiError | None = None
        self.patch_error: kubeapi.ApiError | None = None

    def add(self, pod: dict[str, Any]) -> dict[str, Any]:
        pod = copy.deepcopy(pod)
        self.pods[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = pod
        return pod

    def _key(self, path: str) -> tuple[str, str]:
        parts = path.split("/")
        return parts[4], parts[6]

    def get(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.get_error is not None:
            raise self.get_error
        pod = self.pods.get(self._key(path))
        if pod is None:
            raise kubeapi.NotFound(404, "NotFound", "pods not found")
        return copy.deepcopy(pod)

    def patch_strategic(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert path.endswith("/status")
        self.patches.append((path, body))
        if self.patch_error is not None:
            raise self.patch_error
        pod = self.pods[self._key(path)]
        if body["metadata"]["resourceVersion"] != pod["metadata"]["resourceVersion"]:
            raise kubeapi.Conflict(409, "Conflict", "the object has been modified")
        kept = [c for c in pod["status"].get("conditions", []) if c["type"] != CONDITION]
        pod["status"]["conditions"] = kept + body["status"]["conditions"]
        pod["metadata"]["resourceVersion"] = str(int(pod["metadata"]["resourceVersion"]) + 1)
        return copy.deepcopy(pod)


class Rig:
    """A retrier on a watched cache of its own (``views``), reservations, a clock and the API."""

    def __init__(self, states: dict[str, nodestate.NodeState], max_state_age: float | None = None) -> None:
        self.clock = Clock()
        self.decider = Decider(max_state_age=max_state_age)
        self.views: dict[str, NodeView] = {}
        self.api = Api()
        self.reservations = Reservations(600, self.clock)
        self.demands = Demands(annotation=ANNOTATION)
        self.retrier = Retrier(
            self.api,
            self.decider,
            self.demands,
            self.reservations,
            lambda: self.views,
            {"rdma-scheduler"},
            clock=self.clock,
        )
        for name, state in states.items():
            self.publish(name, state)

    def publish(self, name: str, state: nodestate.NodeState) -> None:
        """The node cache applies a view, as its watch does: views first, then the callback."""
        view = self.decider.view(nodestate.encode(state))
        self.views[name] = view
        self.retrier.viewed(name, view)

    def refuse(self, pod: dict[str, Any], names: list[str], mark: retry.Mark | None = None) -> None:
        demand = self.demands.of_pod(pod)
        assert demand is not None
        self.retrier.refused(pod, demand, names, mark or self.retrier.mark())

    def conditions(self, pod: dict[str, Any]) -> list[dict[str, Any]]:
        meta = pod["metadata"]
        stored = self.api.pods[(meta["namespace"], meta["name"])]
        return [c for c in stored["status"].get("conditions", []) if c["type"] == CONDITION]

    def later(self, seconds: float) -> None:
        self.clock.t += seconds


def pinned(name: str = "p", rate: int = 30_000, **kw: Any) -> dict[str, Any]:
    return so.rdma_pod(name, [(rate, 0)], **kw)


@pytest.fixture
def rig() -> Rig:
    return Rig({"n1": FULL, "n2": FULL})


def test_a_refused_pod_is_retried_when_its_node_publishes_room(rig: Rig) -> None:
    pod = rig.api.add(pinned())
    rig.refuse(pod, ["n1"])
    assert len(rig.retrier) == 1
    assert rig.retrier.run_once() == 0  # nothing changed: nothing written
    rig.publish("n1", FREE)
    assert rig.retrier.run_once() == 1
    (written,) = rig.conditions(pod)
    assert written["status"] == "True" and written["reason"] == "NodeHasRoom"
    assert "node n1 has room" in written["message"]
    path, body = rig.api.patches[0]
    assert path == "/api/v1/namespaces/team-a/pods/p/status"
    # The uid and the version read: a pod replaced or changed meanwhile is not written.
    assert body["metadata"] == {"uid": pod["metadata"]["uid"], "resourceVersion": "99"}
    assert rig.retrier.outcomes["retried"] == 1
    # Written once: nothing more is owed until the pod is refused again.
    rig.later(60)
    assert rig.retrier.run_once() == 0


def test_room_on_a_node_the_pod_did_not_name_writes_nothing(rig: Rig) -> None:
    pod = rig.api.add(pinned())
    rig.refuse(pod, ["n1"])
    rig.publish("n2", FREE)
    assert rig.retrier.run_once() == 0 and not rig.api.patches


def test_room_that_is_not_enough_writes_nothing(rig: Rig) -> None:
    pod = rig.api.add(pinned())
    rig.refuse(pod, ["n1"])
    rig.publish("n1", so.state([PF], [("holder", [("ens1f0", 20_000, 0)])]))  # 20000 free, 30000 asked
    assert rig.retrier.run_once() == 0 and not rig.api.patches


def test_a_view_with_more_room_during_the_refusing_filter_is_judged_again(rig: Rig) -> None:
    """kube-scheduler's view first: its filter read the old view, the room came before it answered."""
    pod = rig.api.add(pinned())
    mark = rig.retrier.mark()  # the filter starts, and reads n1's full view
    rig.publish("n1", FREE)
    assert rig.retrier.run_once() == 0  # the pod is not known yet when the pass sees the room
    rig.refuse(pod, ["n1"], mark)  # ... then the filter answers: refused
    assert rig.retrier.run_once() == 1


def test_a_refusal_after_the_room_judged_on_it_is_not_judged_again(rig: Rig) -> None:
    """A refusal whose filter saw the room already (a mark after it) owes nothing for it."""
    pod = rig.api.add(pinned(rate=45_000))  # more than the PF has, even empty
    rig.publish("n1", FREE)
    rig.retrier.run_once()
    rig.refuse(pod, ["n1"])
    assert rig.retrier.run_once() == 0


def test_reservations_that_end_free_room(rig: Rig) -> None:
    """A bound pod deleted before its node published it: its reservation ends in the pod watch."""
    rig.publish("n1", FREE)
    rig.reservations.add("bound-uid", "team-a", "b", "n1", (("ens1f0", 1, 20_000),))
    rig.retrier.run_once()
    pod = rig.api.add(pinned())
    rig.refuse(pod, ["n1"])
    assert rig.retrier.run_once() == 0
    rig.reservations.drop("bound-uid", "the pod is gone")
    assert rig.retrier.run_once() == 1


def test_a_reservation_ended_during_the_refusing_filter_is_judged_again(rig: Rig) -> None:
    rig.publish("n1", FREE)
    rig.publish("n2", FREE)
    for node in ("n1", "n2"):
        rig.reservations.add(f"bound-{node}", "team-a", node, node, (("ens1f0", 1, 20_000),))
    rig.retrier.run_once()
    pod = rig.api.add(pinned())
    mark = rig.retrier.mark()  # the filter starts and judges n2 with the reservation
    for node in ("n1", "n2"):  # n1 is not the pod's: judged again all the same, and passed over
        rig.reservations.drop(f"bound-{node}", "the pod is gone")
    assert rig.retrier.run_once() == 0  # the pod is not known yet when the pass sees the room
    rig.refuse(pod, ["n2"], mark)
    assert rig.retrier.run_once() == 1


def test_a_hold_given_up_frees_room(rig: Rig) -> None:
    rig.publish("n1", FREE)
    rig.reservations.hold("other-uid", "team-a", "o", "n1", (("ens1f0", 1, 20_000),))
    pod = rig.api.add(pinned())
    rig.refuse(pod, ["n1"])
    assert rig.retrier.run_once() == 0
    rig.reservations.release("other-uid")
    assert rig.retrier.run_once() == 1


def test_a_reservation_that_grows_frees_nothing(rig: Rig) -> None:
    rig.publish("n1", FREE)
    pod = rig.api.add(pinned(rate=15_000))
    rig.reservations.add("a", "team-a", "a", "n1", (("ens1f0", 1, 20_000),))
    rig.reservations.add("b", "team-a", "b", "n1", (("ens1f0", 1, 10_000),))
    rig.refuse(pod, ["n1"])
    rig.retrier.run_once()
    rig.reservations.add("c", "team-a", "c", "n1", (("ens1f0", 1, 5_000),))
    assert rig.retrier.run_once() == 0 and not rig.api.patches


def test_a_pod_refused_on_many_nodes_is_retried_for_any_node(rig: Rig) -> None:
    names = [f"x{i}" for i in range(NODES_KEPT + 1)]
    pod = rig.api.add(pinned())
    rig.refuse(pod, names)
    rig.publish("n2", FREE)  # not sent, but a long list is kept as "any node"
    assert rig.retrier.run_once() == 1


def test_many_nodes_gaining_room_judge_all_of_a_pods_nodes_at_once() -> None:
    rig = Rig({f"m{i}": FULL for i in range(NODES_KEPT + 2)})
    pod = rig.api.add(pinned())
    rig.refuse(pod, [f"x{i}" for i in range(NODES_KEPT + 1)])
    mark = rig.retrier.mark()
    for i in range(NODES_KEPT + 2):  # more nodes to judge again than a set keeps: all of them
        rig.publish(f"m{i}", FREE)
    rig.refuse(pod, [f"x{i}" for i in range(NODES_KEPT + 1)], mark)
    assert rig.retrier.run_once() == 1


def test_a_pod_is_written_at_most_once_per_interval(rig: Rig) -> None:
    pod = rig.api.add(pinned())
    rig.refuse(pod, ["n1", "n2"])
    rig.publish("n1", FREE)
    assert rig.retrier.run_once() == 1
    # Refused again (the room went to another pod), then another node has room at once.
    rig.publish("n1", FULL)
    rig.refuse(pod, ["n1", "n2"])
    rig.publish("n2", FREE)
    assert rig.retrier.run_once() == 0
    rig.later(retry.NUDGE_EVERY)
    assert rig.retrier.run_once() == 1
    assert len(rig.api.patches) == 2


def test_writes_are_rate_limited(rig: Rig) -> None:
    count = int(retry.WRITES_PER_SECOND) + 5
    for i in range(count):
        rig.refuse(rig.api.add(pinned(f"p{i}", rate=1_000)), ["n1"])
    rig.publish("n1", FREE)
    assert rig.retrier.run_once() == retry.WRITES_PER_SECOND
    assert rig.retrier.run_once() == 0  # no time passed: no budget
    rig.later(1.0)
    assert rig.retrier.run_once() == 5


@pytest.mark.parametrize(
    ("change", "outcome"),
    [
        (lambda pod: pod["spec"].update(nodeName="n1"), "bound"),
        (lambda pod: pod["metadata"].update(uid="another"), "gone"),
        (lambda pod: pod["metadata"].update(deletionTimestamp="2026-11-28T00:00:00Z"), "gone"),
        (lambda pod: pod["spec"].update(schedulerName="default-scheduler"), "gone"),
        (lambda pod: pod["status"].update(phase="Failed"), "gone"),
        (lambda pod: pod["metadata"]["annotations"].pop(ANNOTATION), "gone"),
        (lambda pod: pod["metadata"]["annotations"].update({ANNOTATION: "[{"}), "gone"),
    ],
)
def test_a_pod_that_is_no_longer_the_one_refused_is_forgotten(rig: Rig, change: Any, outcome: str) -> None:
    pod = rig.api.add(pinned())
    rig.refuse(pod, ["n1"])
    change(rig.api.pods[("team-a", "p")])
    rig.publish("n1", FREE)
    assert rig.retrier.run_once() == 0
    assert rig.retrier.outcomes[outcome] == 1 and not rig.api.patches
    assert len(rig.retrier) == 0


def test_a_deleted_pod_is_forgotten(rig: Rig) -> None:
    pod = rig.api.add(pinned())
    rig.refuse(pod, ["n1"])
    del rig.api.pods[("team-a", "p")]
    rig.publish("n1", FREE)
    rig.retrier.run_once()
    assert rig.retrier.outcomes["gone"] == 1 and len(rig.retrier) == 0


def test_the_pods_own_annotation_decides_not_the_refused_request(rig: Rig) -> None:
    """A request may claim any demand for a pod: the write follows the pod as stored."""
    stored = rig.api.add(pinned(rate=45_000))  # fits no PF of 40000
    claimed = pinned(rate=30_000, uid=stored["metadata"]["uid"])
    rig.refuse(claimed, ["n1"])
    rig.publish("n1", FREE)
    assert rig.retrier.run_once() == 0 and not rig.api.patches
    assert rig.retrier.outcomes["no_room"] == 1
    assert len(rig.retrier) == 1  # still pending: owed a retry when room comes


def test_a_pod_changed_after_it_was_read_is_not_written(rig: Rig) -> None:
    pod = rig.api.add(pinned())
    rig.refuse(pod, ["n1"])
    rig.publish("n1", FREE)
    rig.api.patch_error = kubeapi.Conflict(409, "Conflict", "modified")
    assert rig.retrier.run_once() == 0
    assert rig.retrier.outcomes["changed"] == 1
    rig.api.patch_error = None
    rig.later(60)
    assert rig.retrier.run_once() == 0  # the change retried it: nothing is owed


@pytest.mark.parametrize(
    ("error", "outcome", "kept"),
    [
        (kubeapi.NotFound(404, "NotFound", "gone"), "gone", False),
        (kubeapi.Invalid(422, "Invalid", "metadata.uid: field is immutable"), "gone", False),
        (kubeapi.ApiError(403, "Forbidden", "denied"), "failed", True),
    ],
)
def test_a_refused_patch(rig: Rig, error: kubeapi.ApiError, outcome: str, kept: bool) -> None:
    pod = rig.api.add(pinned())
    rig.refuse(pod, ["n1"])
    rig.publish("n1", FREE)
    rig.api.patch_error = error
    assert rig.retrier.run_once() == 0
    assert rig.retrier.outcomes[outcome] == 1
    assert (len(rig.retrier) == 1) is kept
    if kept:  # tried again once the interval has passed
        rig.api.patch_error = None
        rig.later(retry.NUDGE_EVERY)
        assert rig.retrier.run_once() == 1


def test_a_failed_read_is_tried_again(rig: Rig) -> None:
    pod = rig.api.add(pinned())
    rig.refuse(pod, ["n1"])
    rig.publish("n1", FREE)
    rig.api.get_error = kubeapi.Unavailable(503, "ServiceUnavailable", "try later")
    assert rig.retrier.run_once() == 0
    assert rig.retrier.outcomes["failed"] == 1
    rig.api.get_error = None
    rig.later(retry.NUDGE_EVERY)
    assert rig.retrier.run_once() == 1


@pytest.mark.parametrize(
    "pod",
    [
        {**so.rdma_pod("no-uid", [(1, 0)]), "metadata": {"name": "no-uid", "namespace": "team-a"}},
        {"metadata": "not an object", "spec": {}},
        {**so.rdma_pod("other", [(1, 0)]), "spec": {"schedulerName": "default-scheduler"}},
        {**so.rdma_pod("no-spec", [(1, 0)]), "spec": None},
    ],
)
def test_pods_that_are_not_remembered(rig: Rig, pod: dict[str, Any]) -> None:
    demand = Demands(annotation=ANNOTATION).of_pod(so.rdma_pod("d", [(1, 0)]))
    assert demand is not None
    rig.retrier.refused(pod, demand, ["n1"], rig.retrier.mark())
    assert len(rig.retrier) == 0


def test_pods_refused_long_ago_are_forgotten(rig: Rig) -> None:
    rig.refuse(rig.api.add(pinned()), ["n1"])
    rig.later(retry.FORGET_AFTER + 1)
    rig.retrier.run_once()
    assert len(rig.retrier) == 0


def test_the_table_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "PODS", 3)
    rig = Rig({"n1": FULL})
    for i in range(5):
        rig.refuse(pinned(f"p{i}"), ["n1"])
    assert len(rig.retrier) == 3


def test_passed_and_gone_pods_are_forgotten(rig: Rig) -> None:
    pod = pinned()
    rig.refuse(pod, ["n1"])
    rig.retrier.passed(pod["metadata"]["uid"])
    assert len(rig.retrier) == 0
    rig.retrier.passed("")  # a pod without a uid: nothing
    # The pod watch tells it of pods that went.
    rig.refuse(pod, ["n1"])
    watch = PodWatch(None, rig.reservations, "rdma-scheduler", on_gone=rig.retrier.passed)
    watch.apply({"type": "DELETED", "object": {"metadata": {"uid": pod["metadata"]["uid"]}}})
    assert len(rig.retrier) == 0


def test_a_pass_out_of_time_leaves_the_rest_to_the_next(monkeypatch: pytest.MonkeyPatch, rig: Rig) -> None:
    monkeypatch.setattr(retry, "PASS_BUDGET", -1.0)
    pod = rig.api.add(pinned())
    rig.refuse(pod, ["n1"])
    rig.publish("n1", FREE)
    assert rig.retrier.run_once() == 0
    monkeypatch.setattr(retry, "PASS_BUDGET", 0.05)
    assert rig.retrier.run_once() == 1


def test_a_bulk_judgement_out_of_time_is_judged_again(monkeypatch: pytest.MonkeyPatch, rig: Rig) -> None:
    monkeypatch.setattr(retry, "PASS_BUDGET", 0.0)  # the clock stands still: the bulk deadline is 0 s
    pod = rig.api.add(pinned())
    rig.refuse(pod, [f"x{i}" for i in range(NODES_KEPT + 1)])
    mark = (-1, rig.reservations.version)  # older than any change kept: judged on all nodes
    rig.publish("n1", FREE)
    rig.refuse(pod, [f"x{i}" for i in range(NODES_KEPT + 1)], mark)
    assert rig.retrier.run_once() == 0
    monkeypatch.setattr(retry, "PASS_BUDGET", 0.05)
    assert rig.retrier.run_once() == 1


def test_a_mark_older_than_the_kept_changes_judges_all_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "_CHANGES_LIMIT", 2)
    rig = Rig({f"n{i}": FULL for i in range(4)})
    pod = rig.api.add(pinned())
    mark = rig.retrier.mark()
    for i in range(4):
        rig.publish(f"n{i}", FREE)
    rig.retrier.run_once()
    rig.refuse(pod, ["n0"], mark)  # n0's change is no longer kept: all its nodes again
    assert rig.retrier.run_once() == 1


def test_reservation_changes_past_what_they_remember_judge_all_nodes(rig: Rig) -> None:
    pod = rig.api.add(pinned())
    rig.publish("n1", FREE)
    rig.reservations.add("a", "team-a", "a", "n1", (("ens1f0", 1, 20_000),))
    mark = rig.retrier.mark()
    rig.reservations.drop("a", "gone")
    rig.reservations._forgotten = rig.reservations.version  # as after _TOUCHED_LIMIT changes
    rig.retrier._res_version = -1
    rig.refuse(pod, ["n1"], mark)
    assert rig.retrier.run_once() == 1


def test_views_seen_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "_SEEN_LIMIT", 2)
    rig = Rig({"n1": FULL, "n2": FULL})
    pod = rig.api.add(pinned())
    rig.refuse(pod, ["n1"])
    rig.publish("n3", FULL)  # over the limit: what was seen is forgotten
    rig.publish("n1", FULL)  # the same state, but unknown now: judged again (it does not fit)
    assert rig.retrier.run_once() == 0 and rig.retrier.outcomes["retried"] == 0


def test_the_thread_runs_passes_and_survives_a_failing_one(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig({"n1": FULL})
    rig.retrier.clock = time.monotonic
    rig.retrier._refilled = rig.retrier.clock()
    calls = []
    done = threading.Event()
    real = rig.retrier.run_once

    def flaky() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        got = real()
        if got:
            done.set()
        return got

    monkeypatch.setattr(rig.retrier, "run_once", flaky)
    monkeypatch.setattr(retry, "IDLE", 0.01)
    rig.retrier.start()
    try:
        pod = rig.api.add(pinned())
        rig.refuse(pod, ["n1"])
        rig.publish("n1", FREE)
        assert done.wait(10)
    finally:
        rig.retrier.stop()
        assert rig.retrier._thread is not None
        rig.retrier._thread.join(5)
    assert not rig.retrier._thread.is_alive()


NODE = so.state([PF])


@pytest.mark.parametrize(
    ("old", "new", "grew"),
    [
        (None, NODE, True),
        (FULL, FREE, True),
        (FREE, FULL, False),
        (FREE, dataclasses.replace(FREE, generation=3), False),  # another text, the same PF states
        (so.state([PF]), so.state([PF, ("ens2f0", 10_000, 1)]), True),  # a new PF
        (so.state([("ens1f0", 40_000, 2)]), so.state([("ens1f0", 40_000, 3)]), True),  # more VFs
        (so.state([("ens1f0", None, 2)]), so.state([("ens1f0", 40_000, 2)]), True),  # a capacity
        (so.state([PF], numa=0), so.state([PF], numa=1), True),
        (so.state([PF, ("ens2f0", 10_000, 1)]), so.state([PF]), False),  # a PF gone
    ],
)
def test_room_grew(old: nodestate.NodeState | None, new: nodestate.NodeState, grew: bool) -> None:
    decider = Decider()
    before = decider.view(nodestate.encode(old)) if old is not None else None
    after = decider.view(nodestate.encode(new))
    assert room_grew(before, after, decider.now(), None) is grew


def test_room_grew_for_states_without_room_or_age() -> None:
    decider = Decider(max_state_age=100)
    now = decider.now()
    fresh = decider.view(nodestate.encode(so.state([PF])))
    stale = decider.view(nodestate.encode(so.state([PF], age=200)))
    missing = decider.view(None)
    assert room_grew(stale, fresh, now, 100) and room_grew(missing, fresh, now, 100)
    assert not room_grew(fresh, stale, now, 100) and not room_grew(fresh, missing, now, 100)
    assert not room_grew(fresh, fresh, now, 100)
    other = so.state([PF])
    networks = dataclasses.replace(
        other, version=2, networks=(nodestate.Network("rdma-net", ("ens1f0",), (None,)),)
    )
    assert room_grew(fresh, decider.view(nodestate.encode(networks)), now, 100)


def test_the_condition_changes_at_every_write() -> None:
    from datetime import UTC, datetime, timedelta

    now = datetime(2026, 11, 28, 6, 0, 0, tzinfo=UTC)
    first = retry.condition("n1", now)
    second = retry.condition("n1", now + timedelta(seconds=retry.NUDGE_EVERY))
    assert first["type"] == CONDITION and first != second


# -- through the verbs --------------------------------------------------------------------------


def extender(rig: Rig, best_nodes: int = 1) -> Extender:
    ext = Extender(
        decider=rig.decider,
        demands=rig.demands,
        reservations=rig.reservations,
        client=rig.api,
        cache_views=lambda: rig.views,
        settings=Settings(best_nodes=best_nodes),
        retrier=rig.retrier,
    )
    ext.ready.set()
    return ext


def test_filter_remembers_refused_pods_and_forgets_passed_ones(rig: Rig) -> None:
    ext = extender(rig)
    pod = rig.api.add(pinned())
    answer = ext.filter(so.args_names(pod, ["n1"]))
    assert not answer["NodeNames"] and len(rig.retrier) == 1
    rig.publish("n1", FREE)
    assert rig.retrier.run_once() == 1
    answer = ext.filter(so.args_names(pod, ["n1"]))
    assert answer["NodeNames"] == ["n1"] and len(rig.retrier) == 0


def test_full_node_filters_are_remembered_and_judged_on_the_watched_views(rig: Rig) -> None:
    ext = extender(rig, best_nodes=0)
    pod = rig.api.add(pinned())
    # The request says n1 is full (as kube-scheduler's copy did): refused.
    answer = ext.filter(so.args_nodes(pod, [so.node("n1", nodestate.encode(FULL))]))
    assert not answer["Nodes"]["items"] and len(rig.retrier) == 1
    rig.publish("n1", FREE)
    assert rig.retrier.run_once() == 1
    answer = ext.filter(so.args_nodes(pod, [so.node("n1", nodestate.encode(FREE))]))
    assert [wire.node_name(n) for n in answer["Nodes"]["items"]] == ["n1"] and len(rig.retrier) == 0


def test_a_bound_pod_is_forgotten(rig: Rig) -> None:
    ext = extender(rig)
    pod = rig.api.add(pinned(rate=1_000))
    rig.retrier.refused(pod, rig.demands.of_pod(pod), ["n1"], rig.retrier.mark())  # type: ignore[arg-type]
    rig.publish("n1", FREE)

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        rig.api.pods[("team-a", "p")]["spec"]["nodeName"] = body["target"]["name"]
        return {}

    rig.api.post = post  # type: ignore[attr-defined]
    args = {"PodName": "p", "PodNamespace": "team-a", "PodUID": pod["metadata"]["uid"], "Node": "n1"}
    assert ext.bind(args) == wire.bind_result("")
    assert len(rig.retrier) == 0


def test_service_wires_the_retrier_to_the_watches() -> None:
    from rdma_cni.extender.service import Service

    service = Service(Api(), Settings(listen=("127.0.0.1", 0)))
    try:
        assert service.extender.retrier is service.retrier
        view = service.decider.view(nodestate.encode(FREE))
        service.cache.on_view("n1", view)  # type: ignore[misc]
        assert service.retrier._seen["n1"] is view
        assert all(w.on_gone == service.retrier.passed for w in service.pod_watches)
    finally:
        service.server.server_close()
