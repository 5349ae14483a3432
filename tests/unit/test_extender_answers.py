"""Answers kept per request shape: after any mix of changes, the same answer a full pass gives."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest

from rdma_cni.extender import wire
from rdma_cni.extender.decide import Decider, NodeView
from rdma_cni.extender.demand import Demands
from rdma_cni.extender.reservations import Reservations
from rdma_cni.extender.verbs import Extender
from rdma_cni.shared import nodestate
from tests.support import sched_objects as so

PFS = [("ens1f0", 25_000, 4), ("ens1f1", 25_000, 4)]
SHAPES = ([(5_000, 10_000)], [(15_000, 0)], [(10_000, 0), (10_000, 0)], [(0, 0)] * 3)


class Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        import time

        return time.time() + self.offset


def random_state(rng: random.Random, uid: str, age: float = 0.0) -> str:
    pods = []
    for i in range(rng.randint(0, 5)):
        pf = rng.choice(("ens1f0", "ens1f1"))
        pods.append((f"{uid}-{i}", [(pf, rng.choice((0, 2_000, 5_000, 10_000)), 0)]))
    # Keep each PF within its VFs and bandwidth: the agent never publishes more.
    kept: list[so.PodUse] = []
    used = {"ens1f0": [0, 0], "ens1f1": [0, 0]}
    for uid_, uses in pods:
        pf, lo, _ = uses[0]
        if used[pf][0] < 4 and used[pf][1] + lo <= 25_000:
            used[pf][0] += 1
            used[pf][1] += lo
            kept.append((uid_, uses))
    return nodestate.encode(so.state(PFS, kept, age=age))


def make(max_age: float | None = 120.0, holds: bool = False) -> tuple[Extender, dict[str, NodeView], Clock]:
    """An extender on ``views``; without ``holds``, prioritize holds nothing (the tests of how kept
    answers are re-judged count what changed, and a hold is a change)."""
    decider = Decider(max_state_age=max_age)
    clock = Clock()
    decider.now = clock.now  # type: ignore[method-assign]
    views: dict[str, NodeView] = {}
    ext = Extender(
        decider=decider,
        demands=Demands(annotation="rdma_interfaces_required"),
        reservations=Reservations(600, holds_max=1024 if holds else 0),
        cache_views=lambda: views,
    )
    ext.ready.set()
    return ext, views, clock


def full_pass(ext: Extender, pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The answer without any kept state: every node judged now."""
    demand = ext.demands.of_pod(pod)
    assert demand is not None
    # As a new filter of the pod does: its own hold (from ask's prioritize) does not count against it.
    ext.reservations.release(wire.pod_identity(pod)[2])
    views = ext._cache_views()
    passing, failed, unresolvable, scores = ext._decide(demand, names, [views.get(n) for n in names])
    out = wire.filter_result(wire.parse_filter(so.args_names(pod, names)), passing, failed, unresolvable)
    return {"filter": out, "prioritize": one_top(passing, scores)}


def one_top(passing: list[str], scores: dict[str, int]) -> list[dict[str, Any]]:
    """Prioritize's answer: the best-scored node (first of ``passing`` among equals) alone on top."""
    if not passing:
        return []
    top = min(passing, key=lambda n: (-scores[n], passing.index(n)))
    best = max(1, scores[top])
    out = [(n, best if n == top else min(scores[n], best - 1)) for n in passing]
    return [{"Host": n, "Score": s} for n, s in out if s]


def ask(ext: Extender, pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    body = ext.filter_encoded(so.args_names(pod, names))
    assert isinstance(body, bytes)
    out = json.loads(body)
    assert ext.filter(so.args_names(pod, names)) == out  # the decoded form, for callers in-process
    prio = json.loads(ext.prioritize(so.args_names(pod, out["NodeNames"])))
    return {"filter": out, "prioritize": prio}


@pytest.mark.parametrize("seed", range(6))
def test_kept_answers_equal_a_full_pass_after_any_changes(seed: int) -> None:
    rng = random.Random(seed)
    ext, views, clock = make(holds=True)  # each pod's prioritize holds its top node for the next pods
    names = [f"n{i:02d}" for i in range(40)]
    for name in names:
        views[name] = ext.decider.view(random_state(rng, name))
    views.pop("n39")  # a node the cache does not know
    views["n38"] = ext.decider.view(None)  # no agent
    for step in range(60):
        action = rng.random()
        name = rng.choice(names[:38])
        if action < 0.3:
            views[name] = ext.decider.view(random_state(rng, f"{name}-{step}", age=rng.choice((0, 0, 100))))
        elif action < 0.55:
            ext.reservations.add(
                f"r{step}", "team-a", f"r{step}", name, (("ens1f0", 1, rng.choice((0, 8_000))),)
            )
        elif action < 0.7 and len(ext.reservations):
            ext.reservations.drop(rng.choice(ext.reservations.all()).uid, "test")
        elif action < 0.8:
            clock.offset += rng.choice((10, 30))  # states age; some turn stale
        rates = rng.choice(SHAPES)
        pod = so.rdma_pod(f"p{step}", rates)
        assert ask(ext, pod, names) == full_pass(ext, pod, names), f"step {step}"
    # Most requests were answered by re-judging a few nodes, not all of them.
    assert ext.answers.rejudged < 60 * len(names) / 4


def test_one_reservation_rejudges_one_node() -> None:
    ext, views, _ = make()
    names = ["a", "b", "c"]
    for name in names:
        views[name] = ext.decider.view(nodestate.encode(so.state(PFS)))
    pod = so.rdma_pod("p", [(20_000, 0)])
    first = ask(ext, pod, names)
    assert first["filter"]["NodeNames"] == names and ext.answers.full_passes == 1
    assert ask(ext, so.rdma_pod("q", [(20_000, 0)]), names) == first  # nothing changed: nothing re-judged
    assert ext.answers.rejudged == 0
    ext.reservations.add("u1", "team-a", "x", "b", (("ens1f0", 1, 20_000), ("ens1f1", 1, 20_000)))
    second = ask(ext, so.rdma_pod("r", [(20_000, 0)]), names)
    assert ext.answers.full_passes == 1 and ext.answers.rejudged == 1
    assert second["filter"]["NodeNames"] == ["a", "c"] and list(second["filter"]["FailedNodes"]) == ["b"]
    ext.reservations.drop("u1", "test")
    assert ask(ext, so.rdma_pod("s", [(20_000, 0)]), names) == first
    assert ext.answers.rejudged == 2
    # Another node list is a full pass.
    ask(ext, so.rdma_pod("t", [(20_000, 0)]), ["c", "a"])
    assert ext.answers.full_passes == 2


def test_a_state_turning_stale_without_any_change_is_noticed() -> None:
    ext, views, clock = make(max_age=120)
    views["old"] = ext.decider.view(nodestate.encode(so.state(PFS, age=100)))
    views["new"] = ext.decider.view(nodestate.encode(so.state(PFS)))
    pod = so.rdma_pod("p", [(1_000, 0)])
    assert ask(ext, pod, ["old", "new"])["filter"]["NodeNames"] == ["old", "new"]
    clock.offset = 30  # "old" is now 130 s old: nothing else changed
    out = ask(ext, so.rdma_pod("q", [(1_000, 0)]), ["old", "new"])["filter"]
    assert out["NodeNames"] == ["new"] and "older than 120 s" in out["FailedAndUnresolvableNodes"]["old"]


def test_reservation_history_forgotten_means_a_full_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    from rdma_cni.extender import reservations

    monkeypatch.setattr(reservations, "_TOUCHED_LIMIT", 2)
    ext, views, _ = make()
    views["a"] = ext.decider.view(nodestate.encode(so.state(PFS)))
    version = ext.reservations.version
    for i, node in enumerate(("x", "y", "a")):
        ext.reservations.add(f"u{i}", "team-a", f"p{i}", node, (("ens1f0", 1, 25_000),))
    assert ext.reservations.changed_since(version)[1] is None
    assert ext.reservations.changed_since(ext.reservations.version) == (ext.reservations.version, set())
    pod = so.rdma_pod("p", [(25_000, 0)])
    assert ask(ext, pod, ["a"]) == full_pass(ext, pod, ["a"])


def test_each_failed_nodes_free_capacity_is_in_the_debug_log(caplog: pytest.LogCaptureFixture) -> None:
    ext, views, _ = make()
    views["busy"] = ext.decider.view(nodestate.encode(so.state(PFS, [("u", [("ens1f0", 5_000, 0)])])))
    views["gone"] = ext.decider.view(None)
    ext.reservations.add("r", "team-a", "r", "busy", (("ens1f1", 1, 20_000),))
    pod = so.rdma_pod("p", [(24_000, 0)])
    ask(ext, pod, ["busy", "gone"])
    assert not [r for r in caplog.records if r.name == "rdma_cni.extender.server"]  # not at INFO
    caplog.set_level("DEBUG", logger="rdma_cni.extender.server")
    ask(ext, pod, ["busy", "gone"])
    # ask() filters twice (encoded and decoded): the same one line each time.
    (line,) = {r.getMessage() for r in caplog.records if r.name == "rdma_cni.extender.server"}
    assert line.startswith("filter team-a/p: busy: rdma-cni: needs 24000 Mbit/s free on one PF")
    # The reservation counts: ens1f1 shows 5000 free, not 25000.
    assert line.endswith(
        "(ens1f0: 3 VFs, 20000 of 25000 Mbit/s free; ens1f1: 3 VFs, 5000 of 25000 Mbit/s free)"
    )


def test_a_repeated_node_name_is_answered_as_a_full_pass_would() -> None:
    ext, views, _ = make()
    views["a"] = ext.decider.view(nodestate.encode(so.state(PFS)))
    views["b"] = ext.decider.view(nodestate.encode(so.state(PFS)))
    names = ["a", "b", "a"]
    pod = so.rdma_pod("p", [(20_000, 0)])
    assert ask(ext, pod, names) == full_pass(ext, pod, names)
    ext.reservations.add("u1", "team-a", "x", "a", (("ens1f0", 1, 20_000), ("ens1f1", 1, 20_000)))
    out = ask(ext, pod, names)
    assert out == full_pass(ext, pod, names) and out["filter"]["NodeNames"] == ["b"]


def as_sets(answer: dict[str, Any]) -> tuple[Any, ...]:
    """An answer as kube-scheduler reads it: names as a set, the failed maps, scores per host."""
    out = answer["filter"]
    return (
        set(out["NodeNames"]),
        out["FailedNodes"],
        out["FailedAndUnresolvableNodes"],
        out["Error"],
        # Which of the nodes tied on the best score is put alone on top depends on the order (the
        # kept answer's, or this request's): the scores as a multiset, with one node on top.
        sorted(p["Score"] for p in answer["prioritize"]),
    )


def test_the_same_nodes_in_any_order_reuse_the_kept_answer() -> None:
    # kube-scheduler sends NodeNames in the order its parallel filters finish: another order per pod.
    rng = random.Random(7)
    ext, views, _ = make()
    names = [f"node-{i:04d}" for i in range(5_000)]
    for name in names:
        views[name] = ext.decider.view(random_state(rng, name))
    del views["node-0001"]  # a node the cache does not know
    shape = [(10_000, 0)]
    for step in range(4):
        order = names[:]
        rng.shuffle(order)
        pod = so.rdma_pod(f"p{step}", shape)
        if step == 2:  # one reservation: one node judged again, in the kept order
            ext.reservations.add("u1", "team-a", "x", "node-0042", (("ens1f0", 1, 25_000),))
        assert as_sets(ask(ext, pod, order)) == as_sets(full_pass(ext, pod, order)), f"step {step}"
    assert ext.answers.full_passes == 1
    assert ext.answers.rejudged == 1
    # A list with one node left out, or one name twice, is another set: a full pass.
    ask(ext, so.rdma_pod("q", shape), names[1:])
    assert ext.answers.full_passes == 2
    ask(ext, so.rdma_pod("r", shape), names[1:] + names[1:2])
    assert ext.answers.full_passes == 4  # ask() filters twice; a list with a repeat is never updated


@pytest.mark.parametrize(("seed", "best"), [(0, 1), (1, 1), (2, 3), (3, 5)])
def test_the_best_nodes_after_any_changes_are_a_full_pass_s_best(seed: int, best: int) -> None:
    rng = random.Random(seed)
    ext, views, _ = make(holds=True)
    ext.settings = dataclasses.replace(ext.settings, best_nodes=best)
    names = [f"n{i:02d}" for i in range(40)]
    for name in names:
        views[name] = ext.decider.view(random_state(rng, name))
    for step in range(60):
        name = rng.choice(names)
        if rng.random() < 0.4:
            views[name] = ext.decider.view(random_state(rng, f"{name}-{step}"))
        elif rng.random() < 0.5:
            ext.reservations.add(f"r{step}", "team-a", f"r{step}", name, (("ens1f0", 1, 2_000),))
        pod = so.rdma_pod(f"p{step}", rng.choice(SHAPES))
        got = ext.filter(so.args_names(pod, names))
        # The pod's own hold (the one node passed) does not count for the full pass, as for its retry.
        expected = full_pass(ext, pod, names)
        scores = {p["Host"]: p["Score"] for p in expected["prioritize"]}
        passing = expected["filter"]["NodeNames"]
        demand = ext.demands.of_pod(pod)
        assert demand is not None
        judged = ext._decide(demand, passing, [views[n] for n in passing])[3] if passing else {}
        ranked = sorted(passing, key=lambda n: (-judged[n], names.index(n)))
        assert got["NodeNames"] == ranked[:best], f"step {step}"
        if ranked:  # a node passes: the failed maps, which nobody reads then, are left out
            assert got["FailedNodes"] == got["FailedAndUnresolvableNodes"] == {}
        else:
            assert got == expected["filter"], f"step {step}"
        assert scores.keys() <= set(passing)


def test_a_list_of_the_same_nodes_in_another_order_is_looked_up_once() -> None:
    rng = random.Random(3)
    views: dict[str, NodeView] = {}
    generation = [1]
    decider = Decider()
    ext = Extender(
        decider=decider,
        demands=Demands(annotation="rdma_interfaces_required"),
        reservations=Reservations(600, holds_max=0),
        cache_views=lambda: views,
        cache_generation=lambda: generation[0],
    )
    ext.ready.set()
    names = [f"node-{i:04d}" for i in range(300)]
    for name in names:
        views[name] = decider.view(random_state(rng, name))
    pod = so.rdma_pod("p", [(5_000, 0)])
    first = ext.filter(so.args_names(pod, names))
    for _ in range(3):
        order = names[:]
        rng.shuffle(order)
        again = ext.filter(so.args_names(pod, order))
        assert again == first  # the kept order, read by kube-scheduler as sets
    assert ext.answers.full_passes == 1 and ext.answers.rejudged == 0
    # The cache changed: the views are looked up again (in the kept order) and the change is judged.
    views["node-0007"] = decider.view(
        nodestate.encode(so.state(PFS, [("x", [("ens1f0", 25_000, 0)]), ("y", [("ens1f1", 25_000, 0)])]))
    )
    generation[0] += 1
    order = names[::-1]
    out = ext.filter(so.args_names(pod, order))
    assert "node-0007" in out["FailedNodes"] and ext.answers.full_passes == 1
    assert out == as_filter(full_pass(ext, pod, names))
    # A list with a name repeated, or another node, is not the same set.
    assert "node-0007" not in ext.filter(so.args_names(pod, [*names[1:], "node-0002"]))["NodeNames"]


def as_filter(answer: dict[str, Any]) -> dict[str, Any]:
    return dict(answer["filter"])


def test_answers_not_encoded_until_read_are_still_a_full_pass_s() -> None:
    rng = random.Random(7)
    ext, views, _ = make()
    names = [f"n{i:02d}" for i in range(30)]
    for name in names:
        views[name] = ext.decider.view(random_state(rng, name))
    answers = ext.answers
    seen: set[Any] = set()
    for step in range(40):
        name = rng.choice(names)
        if rng.random() < 0.5:
            views[name] = ext.decider.view(random_state(rng, f"{name}-{step}"))
        else:
            ext.reservations.add(f"r{step}", "team-a", f"r{step}", name, (("ens1f0", 1, 2_000),))
        pod = so.rdma_pod(f"p{step}", rng.choice(SHAPES))
        demand = ext.demands.of_pod(pod)
        assert demand is not None
        encoded = rng.random() < 0.4  # a shape kept unencoded is encoded when a request wants it
        answer = answers.filter(demand, names, [views[n] for n in names], ext.decider.now(), encoded=encoded)
        if encoded:
            assert answer.encoded[0] is not None
        elif demand.key not in seen:
            assert answer.encoded[0] is None  # a shape's first answer, not asked encoded: not encoded
        seen.add(demand.key)
        expected = full_pass(ext, pod, names)
        assert json.loads(answer.filter_body) == expected["filter"], f"step {step}"
        assert answer.passing == expected["filter"]["NodeNames"]
