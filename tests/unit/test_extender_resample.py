"""A pod that fits none of the nodes kube-scheduler sampled but fits one it left out is sent back for more.

kube-scheduler's side is played in-process: filter calls with NodeNames, as many of the cache's
nodes as kube-scheduler's default ``percentageOfNodesToScore`` stops at, or fewer (a list its own
filters cut short), as kube-scheduler sends them.
The real kube-scheduler's retry with its next nodes is tests/cluster/test_sampling.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest

from rdma_cni.extender import metrics, resample
from rdma_cni.extender.options import settings
from rdma_cni.extender.resample import Resampler, sample_size
from tests.support import sched_objects as so
from tests.unit.test_extender_holds import Clock, make

FREE = so.state([("ens1f0", 25_000, 4)])
FULL = so.state([("ens1f0", 25_000, 1)], [("u0", [("ens1f0", 25_000, 0)])])


def full_node(i: int) -> str:
    return f"full-{i:03}"


def fulls(count: int) -> list[str]:
    return [full_node(i) for i in range(count)]


class Fits(NamedTuple):
    fits: bool


def cluster(full: int, free: list[str]) -> dict[str, Any]:
    states = {full_node(i): FULL for i in range(full)}
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


def test_the_sample_kube_scheduler_stops_at() -> None:
    # kube-scheduler v1.37's numFeasibleNodesToFind, by its own examples and bounds.
    assert [sample_size(n) for n in (50, 99, 100, 250, 400, 1000, 5000, 20000)] == [
        50,
        99,
        100,
        120,
        188,
        420,
        500,
        1000,
    ]
    assert sample_size(5000, 100) == 5000 and sample_size(1000, 30) == 300 and sample_size(1000, 1) == 100


def test_a_fit_outside_the_sample_is_an_error_that_names_it_and_counts_the_retries() -> None:
    ext, _, _ = make(cluster(399, ["spare"]))
    pod = so.rdma_pod("p", [(10_000, 0)])
    sample = fulls(188)  # kube-scheduler's sample of 400 nodes
    before = decided("resample")
    answers = [filter_names(ext, pod, sample) for _ in range(3)]
    # 212 nodes left out, samples of 188: two samples cover them, so two retries; the third
    # miss is answered as fitting nowhere, with every node's reason.
    for n, answer in enumerate(answers[:2], 1):
        assert answer["NodeNames"] is None and answer["FailedNodes"] == {}
        assert "none of the 188 nodes kube-scheduler sampled fits" in answer["Error"]
        assert "node 'spare' outside them does" in answer["Error"]
        assert answer["Error"].endswith(f"({n} of at most 2)")
    assert answers[2]["Error"] == "" and answers[2]["NodeNames"] == []
    assert sorted(answers[2]["FailedNodes"]) == sample
    assert decided("resample") - before == 2


def test_a_list_shorter_than_the_sample_is_every_node_and_is_answered_at_once() -> None:
    # A pod its selector pins to five nodes: kube-scheduler looked at every node; the pod gets its
    # answer (and preemption) now, whatever fits elsewhere.
    ext, _, _ = make(cluster(399, ["spare"]))
    pod = so.rdma_pod("p", [(10_000, 0)])
    answer = filter_names(ext, pod, fulls(5))
    assert answer["Error"] == "" and sorted(answer["FailedNodes"]) == fulls(5)
    # One node short of the sample (kube-scheduler may count a node the cache has not seen yet).
    assert filter_names(ext, pod, fulls(186))["Error"].endswith("(1 of at most 2)")
    assert filter_names(ext, so.rdma_pod("q", [(10_000, 0)]), fulls(185))["Error"] == ""


def test_a_profile_that_scores_every_node_is_never_sampled() -> None:
    ext, _, _ = make(cluster(399, ["spare"]), percentage=100)
    answer = filter_names(ext, so.rdma_pod("p", [(10_000, 0)]), fulls(188))
    assert answer["Error"] == "" and answer["NodeNames"] == []
    assert (
        settings(
            ["--listen", "127.0.0.1:0", "--percentage-of-nodes-to-score", "100"]
        ).percentage_of_nodes_to_score
        == 100
    )
    for bad in ("101", "-1", "ten"):
        with pytest.raises(SystemExit):
            settings(["--listen", "127.0.0.1:0", "--percentage-of-nodes-to-score", bad])


def test_the_retry_with_the_fitting_node_passes_it_and_starts_the_count_afresh() -> None:
    ext, _, _ = make(cluster(399, ["spare"]))
    pod = so.rdma_pod("p", [(10_000, 0)])
    first = fulls(188)
    assert filter_names(ext, pod, first)["Error"].endswith("(1 of at most 2)")
    assert filter_names(ext, pod, [*fulls(187), "spare"])["NodeNames"] == ["spare"]
    # Found its node: a later miss (the node taken since) is counted from one again.
    assert filter_names(ext, pod, first)["Error"].endswith("(1 of at most 2)")


def test_nothing_is_retried_when_the_list_held_every_node_or_nothing_outside_fits() -> None:
    ext, _, views = make(cluster(120, []))
    pod = so.rdma_pod("p", [(10_000, 0)])
    everyone = sorted(views)
    answer = filter_names(ext, pod, everyone)
    assert answer["Error"] == "" and answer["NodeNames"] == []
    some = everyone[:100]  # the sample of 120 nodes; the other 20 are full too
    answer = filter_names(ext, pod, some)
    assert answer["Error"] == "" and sorted(answer["FailedNodes"]) == some


def test_a_node_held_for_another_pod_is_not_a_fit_outside() -> None:
    # spare has room for one such pod; another pod's hold takes it (best-nodes holds the lone node).
    ext, _, _ = make(cluster(199, ["spare"]))
    holder = so.rdma_pod("holder", [(25_000, 0)])
    assert filter_names(ext, holder, ["spare"])["NodeNames"] == ["spare"]
    late = so.rdma_pod("late", [(25_000, 0)])
    answer = filter_names(ext, late, fulls(100))
    assert answer["Error"] == "" and answer["NodeNames"] == []


def test_a_pod_without_a_uid_is_never_retried() -> None:
    ext, _, _ = make(cluster(199, ["spare"]))
    pod = so.rdma_pod("p", [(10_000, 0)])
    del pod["metadata"]["uid"]
    answer = filter_names(ext, pod, fulls(100))
    assert answer["Error"] == "" and answer["NodeNames"] == []


def test_retries_are_counted_per_period_then_afresh() -> None:
    clock = Clock()
    calls: list[int] = []

    def judge(demand: Any, names: list[str], views: list[Any], deadline: Any = None) -> list[Any]:
        calls.append(len(names))
        return [Fits(name == "spare") for name in names]

    cache = {f"n{i}": None for i in range(599)} | {"spare": None}
    sampler = Resampler(judge, clock=clock)  # type: ignore[arg-type]
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
    sent = [f"n{i}" for i in range(680)]  # kube-scheduler's sample of 2,000 nodes
    assert sampler.outside("u", None, sent, cache) == ("n680", 1, 2)  # type: ignore[arg-type]
    assert calls == [256]


def test_remembered_pods_are_bounded() -> None:
    sampler = Resampler(lambda demand, names, views, deadline=None: [Fits(True) for _ in names])
    cache = {f"n{i}": None for i in range(200)}
    sent = [f"n{i}" for i in range(100)]
    assert sampler.outside("first", None, sent, cache) == ("n100", 1, 1)  # type: ignore[arg-type]
    for n in range(resample._PODS):
        sampler.outside(f"u{n}", None, sent, cache)  # type: ignore[arg-type]
    assert len(sampler._tries) == resample._PODS
    # The least recently retried went first: counted afresh.
    assert sampler.outside("first", None, sent, cache) == ("n100", 1, 1)  # type: ignore[arg-type]
