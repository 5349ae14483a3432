"""A pod that fits none of the nodes kube-scheduler sampled but fits one it left out is sent back for more.

kube-scheduler's side is played in-process: filter calls with NodeNames, a part of the cache's
nodes each (kube-scheduler's default ``percentageOfNodesToScore``), as kube-scheduler sends them.
The real kube-scheduler's retry with its next nodes is tests/cluster/test_sampling.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from rdma_cni.extender import metrics, resample
from rdma_cni.extender.resample import Resampler
from tests.support import sched_objects as so
from tests.unit.test_extender_holds import Clock, make

FREE = so.state([("ens1f0", 25_000, 4)])
FULL = so.state([("ens1f0", 25_000, 1)], [("u0", [("ens1f0", 25_000, 0)])])


class Fits(NamedTuple):
    fits: bool


def cluster(full: int, free: list[str]) -> dict[str, Any]:
    states = {f"full-{i:03}": FULL for i in range(full)}
    states.update({name: FREE for name in free})
    return states


def filter_names(ext: Any, pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return ext.filter(so.args_names(pod, names))


def decided(outcome: str) -> float:
    return (
        metrics.REGISTRY.get_sample_value(
            "rdma_cni_extender_decisions_total", {"verb": "filter", "outcome": outcome}
        )
        or 0.0
    )


def test_a_fit_outside_the_nodes_sent_is_an_error_that_names_it_and_counts_the_retries() -> None:
    ext, _, _ = make(cluster(30, ["spare"]))
    pod = so.rdma_pod("p", [(10_000, 0)])
    sample = [f"full-{i:03}" for i in range(10)]
    before = decided("resample")
    answers = [filter_names(ext, pod, sample) for _ in range(4)]
    # 21 nodes left out, lists of 10: three lists cover them, so three retries; the fourth
    # miss is answered as fitting nowhere, with every node's reason.
    for n, answer in enumerate(answers[:3], 1):
        assert answer["NodeNames"] is None and answer["FailedNodes"] == {}
        assert "none of the 10 nodes kube-scheduler sampled fits" in answer["Error"]
        assert "node 'spare' outside them does" in answer["Error"]
        assert answer["Error"].endswith(f"({n} of at most 3)")
    assert answers[3]["Error"] == "" and answers[3]["NodeNames"] == []
    assert sorted(answers[3]["FailedNodes"]) == sample
    assert decided("resample") - before == 3


def test_the_retry_with_the_fitting_node_passes_it_and_starts_the_count_afresh() -> None:
    ext, _, _ = make(cluster(30, ["spare"]))
    pod = so.rdma_pod("p", [(10_000, 0)])
    first = [f"full-{i:03}" for i in range(10)]
    assert filter_names(ext, pod, first)["Error"].endswith("(1 of at most 3)")
    assert filter_names(ext, pod, ["full-011", "spare"])["NodeNames"] == ["spare"]
    # Found its node: a later miss (the node taken since) is counted from one again.
    assert filter_names(ext, pod, first)["Error"].endswith("(1 of at most 3)")


def test_nothing_is_retried_when_the_list_held_every_node_or_nothing_outside_fits() -> None:
    ext, _, views = make(cluster(12, []))
    pod = so.rdma_pod("p", [(10_000, 0)])
    everyone = sorted(views)
    answer = filter_names(ext, pod, everyone)
    assert answer["Error"] == "" and answer["NodeNames"] == []
    some = everyone[:4]
    answer = filter_names(ext, pod, some)  # the other 8 are full too
    assert answer["Error"] == "" and sorted(answer["FailedNodes"]) == some


def test_a_node_held_for_another_pod_is_not_a_fit_outside() -> None:
    # spare has room for one such pod; another pod's hold takes it (best-nodes holds the lone node).
    ext, _, _ = make(cluster(20, ["spare"]))
    holder = so.rdma_pod("holder", [(25_000, 0)])
    assert filter_names(ext, holder, ["spare"])["NodeNames"] == ["spare"]
    late = so.rdma_pod("late", [(25_000, 0)])
    answer = filter_names(ext, late, [f"full-{i:03}" for i in range(5)])
    assert answer["Error"] == "" and answer["NodeNames"] == []


def test_a_pod_without_a_uid_is_never_retried() -> None:
    ext, _, _ = make(cluster(20, ["spare"]))
    pod = so.rdma_pod("p", [(10_000, 0)])
    del pod["metadata"]["uid"]
    answer = filter_names(ext, pod, [f"full-{i:03}" for i in range(5)])
    assert answer["Error"] == "" and answer["NodeNames"] == []


def test_retries_are_counted_per_period_then_afresh() -> None:
    clock = Clock()
    calls: list[int] = []

    def judge(demand: Any, names: list[str], views: list[Any], deadline: Any = None) -> list[Any]:
        calls.append(len(names))
        return [Fits(name == "spare") for name in names]

    cache = {f"n{i}": None for i in range(599)} | {"spare": None}
    sampler = Resampler(judge, clock)  # type: ignore[arg-type]
    sent = [f"n{i}" for i in range(300)]
    assert sampler.outside("u", None, sent, cache) == ("spare", 1, 1)  # type: ignore[arg-type]
    assert sampler.outside("u", None, sent, cache) is None  # type: ignore[arg-type]
    # The search judged the 300 others in chunks of 256, and stopped at the chunk with spare.
    assert calls == [256, 44]
    clock.t += resample.PERIOD + 1
    assert sampler.outside("u", None, sent, cache) == ("spare", 1, 1)  # type: ignore[arg-type]


def test_the_search_stops_at_the_first_chunk_with_a_fit() -> None:
    calls: list[int] = []

    def judge(demand: Any, names: list[str], views: list[Any], deadline: Any = None) -> list[Any]:
        calls.append(len(names))
        return [Fits(True) for _ in names]

    cache = {f"n{i}": None for i in range(2000)}
    sampler = Resampler(judge)  # type: ignore[arg-type]
    assert sampler.outside("u", None, ["n0"], cache) == ("n1", 1, 1999)  # type: ignore[arg-type]
    assert calls == [256]


def test_remembered_pods_are_bounded() -> None:
    sampler = Resampler(lambda demand, names, views, deadline=None: [Fits(True) for _ in names])
    cache = {"a": None, "b": None, "c": None}
    assert sampler.outside("first", None, ["a"], cache) == ("b", 1, 2)  # type: ignore[arg-type]
    for n in range(resample._PODS):
        sampler.outside(f"u{n}", None, ["a"], cache)  # type: ignore[arg-type]
    assert len(sampler._tries) == resample._PODS
    # The least recently retried went first: counted afresh.
    assert sampler.outside("first", None, ["a"], cache) == ("b", 1, 2)  # type: ignore[arg-type]
