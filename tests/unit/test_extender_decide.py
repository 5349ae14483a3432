"""The extender's pure parts: demands from pods, verdicts and scores, reservations, preemption."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdma_cni.cni.errors import InvalidPodRequest
from rdma_cni.extender import decide
from rdma_cni.extender.decide import Decider, cannot_fit, greedy_fits
from rdma_cni.extender.demand import Demand, Demands, selected_networks
from rdma_cni.extender.preempt import keep_nodes
from rdma_cni.extender.reservations import Reservations, Reserved
from rdma_cni.shared import nodestate, placement
from rdma_cni.shared.podrequest import parse_request
from tests.support import sched_objects as so

TWO_PFS = [("p0", 25_000, 4), ("p1", 25_000, 4)]


def demand(*rates: tuple[int, int]) -> Demand:
    return Demand.of(parse_request([{"min_tx_rate": lo, "max_tx_rate": hi} for lo, hi in rates], "t"), "t")


def view(decider: Decider, *a: Any, **kw: Any) -> Any:
    return decider.view(nodestate.encode(so.state(*a, **kw)))


# -- demands --------------------------------------------------------------


def test_demand_from_the_annotation_with_the_plugins_parser_and_text() -> None:
    demands = Demands(annotation="rdma_interfaces_required")
    got = demands.of_pod(so.rdma_pod("p", [(15000, 20000), (0, 0)]))
    assert got is not None and got.requests == (placement.Request(15000, 20000), placement.Request(0, 0))
    assert got.key == ((0, 0), (15000, 20000))
    assert got.source == "pod team-a/p annotation rdma_interfaces_required"
    bad = so.pod("q", {"rdma_interfaces_required": '[{"min_tx_rate": "fast"}]'})
    with pytest.raises(InvalidPodRequest) as err:
        demands.of_pod(bad)
    with pytest.raises(InvalidPodRequest) as plugin_err:
        parse_request('[{"min_tx_rate": "fast"}]', "pod team-a/q annotation rdma_interfaces_required")
    assert err.value.msg == plugin_err.value.msg


def test_memoized_parse_still_names_each_pod() -> None:
    demands = Demands(annotation="rdma_interfaces_required")
    a = demands.of_pod(so.rdma_pod("a", [(1, 0)]))
    b = demands.of_pod(so.rdma_pod("b", [(1, 0)]))
    assert a is not None and b is not None and a.key == b.key and b.source.startswith("pod team-a/b ")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("rdma-net", [("team-a", "rdma-net")]),
        # Multus keeps the empty item after the last comma (an empty name, which no network has).
        (" other/rdma-net@net2 , x ,", [("other", "rdma-net"), ("team-a", "x"), ("team-a", "")]),
        (
            '[{"name": "rdma-net", "interface": "net1"}, {"name": "y", "namespace": "ns"}]',
            [("team-a", "rdma-net"), ("ns", "y")],
        ),
        ("[not json", []),
        ('{"name": "x"}', []),  # not a list: Multus fails the pod
        (None, []),
        ("x" * 70_000, [("team-a", "x" * 70_000)]),  # Multus reads a name of any length
    ],
)
def test_selected_networks_both_forms(value: Any, expected: list[tuple[str, str]]) -> None:
    assert selected_networks("team-a", value) == expected


def test_default_request_only_for_pods_selecting_our_networks() -> None:
    default = parse_request('[{"min_tx_rate": 1000}]', "--default-request")
    demands = Demands(
        annotation="rdma_interfaces_required",
        networks=frozenset({"rdma-net", "infra/fast"}),
        default_request=default,
    )
    selecting = so.pod("a", {"k8s.v1.cni.cncf.io/networks": "rdma-net"})
    got = demands.of_pod(selecting)
    assert got is not None and got.requests == (placement.Request(1000, 0),)
    assert demands.of_pod(
        so.pod("b", {"k8s.v1.cni.cncf.io/networks": json.dumps([{"name": "fast", "namespace": "infra"}])})
    )
    assert demands.of_pod(so.pod("c", {"k8s.v1.cni.cncf.io/networks": "fast"})) is None  # other namespace
    assert demands.of_pod(so.pod("d", {"k8s.v1.cni.cncf.io/networks": "macvlan"})) is None
    assert demands.of_pod(so.pod("e")) is None
    assert Demands(annotation="rdma_interfaces_required").of_pod(selecting) is None


def test_a_pod_on_two_of_our_networks_is_two_demands() -> None:
    """The pod-wide annotation applies to each attachment: ADD allocates it once per network."""
    demands = Demands(annotation="rdma_interfaces_required", networks=frozenset({"rdma-a", "rdma-b"}))
    annotations = {
        "rdma_interfaces_required": '[{"min_tx_rate": 10000}]',
        "k8s.v1.cni.cncf.io/networks": "rdma-a, rdma-b, macvlan",
    }
    got = demands.of_pod(so.pod("p", annotations))
    assert got is not None and got.requests == (placement.Request(10000, 0),) * 2
    assert got.min_total == 20000 and got.source == "pod team-a/p annotation rdma_interfaces_required"
    one = demands.of_pod(so.pod("q", {**annotations, "k8s.v1.cni.cncf.io/networks": "rdma-a"}))
    assert one is not None and one.requests == (placement.Request(10000, 0),)


def test_cni_args_are_each_attachments_own_request() -> None:
    default = parse_request("[{}]", "--default-request")
    demands = Demands(
        annotation="rdma_interfaces_required",
        networks=frozenset({"rail-0", "rail-1", "rail-2"}),
        default_request=default,
    )
    selection = [
        {
            "name": "rail-0",
            "cni-args": {"rdma_interfaces_required": [{"min_tx_rate": 1}, {"min_tx_rate": 2}]},
        },
        {"name": "rail-1", "cni-args": {"other": "x"}},
        {"name": "rail-2"},
    ]
    pod = so.pod(
        "p",
        {
            "k8s.v1.cni.cncf.io/networks": json.dumps(selection),
            "rdma_interfaces_required": '[{"min_tx_rate": 5}]',
        },
    )
    got = demands.of_pod(pod)
    assert got is not None and sorted(r.min_tx_rate for r in got.requests) == [1, 2, 5, 5]
    assert "network team-a/rail-0 cni-args.rdma_interfaces_required" in got.source
    # Without the annotation the attachments without a request take --default-request.
    del pod["metadata"]["annotations"]["rdma_interfaces_required"]
    got = demands.of_pod(pod)
    assert got is not None and sorted(r.min_tx_rate for r in got.requests) == [0, 0, 1, 2]
    # Without --default-request either, only the attachment with its own request counts.
    bare = Demands(annotation="rdma_interfaces_required", networks=demands.networks).of_pod(pod)
    assert bare is not None and sorted(r.min_tx_rate for r in bare.requests) == [1, 2]
    bad = so.pod(
        "b",
        {
            "k8s.v1.cni.cncf.io/networks": json.dumps(
                [{"name": "rail-0", "cni-args": {"rdma_interfaces_required": []}}]
            )
        },
    )
    with pytest.raises(InvalidPodRequest, match=r"network team-a/rail-0 cni-args\.rdma_interfaces_required"):
        demands.of_pod(bad)


def test_add_and_the_extender_decide_with_the_same_function(tmp_path: Any) -> None:
    """ADD on each attachment allocates exactly the interfaces the extender counts."""
    from rdma_cni.cni.config import load_netconf
    from rdma_cni.cni.protocol import parse_env
    from rdma_cni.node.podmeta import CRI_ANNOTATIONS, resolve_request

    annotations = {"rdma_interfaces_required": '[{"min_tx_rate": 3}, {}]'}
    selection = [
        {"name": "rail-0"},
        {"name": "rail-1", "cni-args": {"rdma_interfaces_required": [{"max_tx_rate": 9}]}},
    ]
    pod = so.pod("p", {**annotations, "k8s.v1.cni.cncf.io/networks": json.dumps(selection)})
    counted = Demands(annotation="rdma_interfaces_required", networks=frozenset({"rail-0", "rail-1"})).of_pod(
        pod
    )
    added: dict[str, list[tuple[int, int]]] = {}
    for element in selection:
        doc = {
            "cniVersion": "1.0.0",
            "name": element["name"],
            "type": "rdma-cni",
            "kubeconfig": str(tmp_path / "none"),
            "runtimeConfig": {CRI_ANNOTATIONS: annotations},
            # What Multus makes of the selection element: its cni-args as args.cni.
            **({"args": {"cni": element["cni-args"]}} if "cni-args" in element else {}),
        }
        env = parse_env(
            {
                "CNI_COMMAND": "ADD",
                "CNI_CONTAINERID": "c1",
                "CNI_NETNS": "/x",
                "CNI_IFNAME": "net1",
                "CNI_ARGS": "K8S_POD_NAMESPACE=team-a;K8S_POD_NAME=p",
                "CNI_PATH": "/opt/cni/bin",
            }
        )
        request, _ = resolve_request(env, load_netconf(doc))
        added[element["name"]] = [(i.min_tx_rate, i.max_tx_rate) for i in request.interfaces]
    assert counted is not None
    assert {
        n: [(r.min_tx_rate, r.max_tx_rate) for r in rs] for n, rs in counted.by_network().items()
    } == added


# -- verdicts -------------------------------------------------------------


def test_fit_and_score_binpack_prefers_the_fuller_node() -> None:
    decider = Decider()
    empty = view(decider, TWO_PFS)
    busy = view(decider, TWO_PFS, [("u1", [("p0", 10_000, 0), ("p1", 10_000, 0)])])
    d = demand((5_000, 0))
    a, b = decider.verdict(d, empty), decider.verdict(d, busy)
    assert a.fits and b.fits and b.score > a.score
    assert decider.use(d, empty) in ((("p0", 1, 5_000),), (("p1", 1, 5_000),))
    spread = Decider(policy="spread")
    assert spread.verdict(d, spread.view(nodestate.encode(so.state(TWO_PFS)))).score == 10 - a.score
    assert 0 <= a.score <= 10 and 0 <= b.score <= 10


def test_full_node_fails_with_placements_reason_and_is_resolvable() -> None:
    decider = Decider()
    full = view(decider, TWO_PFS, [("u1", [("p0", 20_000, 0), ("p1", 20_000, 0)])])
    v = decider.verdict(demand((15_000, 0)), full)
    assert not v.fits and not v.unresolvable
    # Short and the same on every node failing this way: the free capacity goes to the log.
    assert v.reason == "rdma-cni: needs 15000 Mbit/s free on one PF with a free VF"


@pytest.mark.parametrize(
    ("rates", "pfs", "reason"),
    [
        ([(0, 0)] * 3, [("p0", 1, 25_000, 0), ("p1", 1, None, 0)], "needs 3 free VFs, the node has 2"),
        ([(0, 0)] * 2, [("p0", 1, 25_000, 0), ("p1", 0, 25_000, 0)], "needs 2 free VFs, the node has 1"),
        (
            [(0, 40_000)],
            [("p0", 2, 25_000, 0)],
            "needs a PF with a free VF and capacity of at least 40000 Mbit/s",
        ),
        (
            [(10_000, 20_000)],
            [("p0", 2, 25_000, 20_000), ("p1", 0, 25_000, 0)],
            "needs 10000 Mbit/s free on one PF with a free VF and capacity of at least 20000 Mbit/s",
        ),
        ([(1_000, 0)], [("p0", 2, None, 0)], "needs 1000 Mbit/s free on one PF with a free VF"),
        (
            [(10_000, 0), (10_000, 0)],
            [("p0", 1, 25_000, 11_000), ("p1", 1, 25_000, 20_000)],
            "needs 20000 Mbit/s free in total on the PFs with free VFs",
        ),
    ],
)
def test_cheap_conditions_give_short_reasons_placement_agrees_with(
    rates: list[tuple[int, int]], pfs: list[tuple[str, int, int | None, int]], reason: str
) -> None:
    d = demand(*rates)
    states = [placement.PfState(n, vfs, cap, used) for n, vfs, cap, used in pfs]
    assert cannot_fit(d, states) == f"rdma-cni: {reason}"
    with pytest.raises(placement.NoFit):
        placement.place(d.requests, states, max_steps=None)


def test_no_min_rate_fits_a_pf_reserved_beyond_its_capacity() -> None:
    # The link renegotiated down: no bandwidth left, but a VF without a min rate still fits.
    pfs = [placement.PfState("p0", 1, 10_000, 25_000)]
    assert cannot_fit(demand((0, 0)), pfs) == ""
    assert Decider()._compute(demand((0, 0)), tuple(pfs), 1).fits


def test_placement_reason_without_the_free_summary() -> None:
    # Fits in total and each request alone, but not PF by PF: placement's search says so.
    decider = Decider()
    d = demand((15_000, 0), (15_000, 0))
    pfs = (placement.PfState("p0", 2, 25_000, 0), placement.PfState("p1", 2, 25_000, 15_000))
    assert cannot_fit(d, pfs) == ""
    v = decider._compute(d, pfs, 4)
    assert not v.fits and v.reason.startswith(
        "rdma-cni: 2 interfaces requested (min rates 15000, 15000 Mbit/s): "
    )
    assert "of 25000 Mbit/s free" not in v.reason and placement.free_summary(pfs) not in v.reason


def test_too_large_for_the_empty_node_is_unresolvable() -> None:
    decider = Decider()
    v = decider.verdict(demand((30_000, 0)), view(decider, TWO_PFS))
    assert not v.fits and v.unresolvable
    v = decider.verdict(demand(*[(0, 0)] * 9), view(decider, TWO_PFS))
    assert not v.fits and v.unresolvable and v.reason == "rdma-cni: needs 9 free VFs, the node has 8"


def test_verdicts_are_cached_by_state_not_by_node(monkeypatch: pytest.MonkeyPatch) -> None:
    decider = Decider()
    calls = []
    real = decide.greedy_fits
    monkeypatch.setattr(decide, "greedy_fits", lambda *a: calls.append(1) or real(*a))
    text = nodestate.encode(so.state(TWO_PFS))
    v1, v2 = decider.view(text), decider.view(text)
    assert v1 is v2
    other = decider.view(nodestate.encode(so.state(TWO_PFS, generation=9)))  # same PFs, other generation
    assert other.fp == v1.fp
    d = demand((1_000, 0), (2_000, 0))
    for v in (v1, other):
        assert decider.verdict(d, v).fits
    assert decider.verdict(demand((2_000, 0), (1_000, 0)), v1).fits  # same request, other order
    assert len(calls) == 1


def test_reservations_count_in_the_verdict() -> None:
    decider = Decider()
    v = view(decider, [("p0", 25_000, 2)])
    d = demand((15_000, 0))
    assert decider.verdict(d, v).fits
    assert not decider.verdict(d, v, {"p0": (1, 15_000)}).fits
    assert not decider.verdict(demand((0, 0)), v, {"p0": (2, 0)}).fits


def test_states_with_reservations_are_shared_per_view_and_reservations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text = nodestate.encode(so.state([("p0", 25_000, 2), ("p1", 25_000, 2)]))
    small, large = demand((10_000, 0)), demand((20_000, 0))
    # What filter looks up: a node's kept Reserved, the same object until its reservations change.
    one = Reserved({"p0": (1, 15_000)}, kept=True)
    two = Reserved({"p0": (1, 15_000), "p1": (1, 10_000)}, kept=True)

    def fresh(d: Demand, extra: Reserved) -> decide.Verdict:
        other = Decider()  # has seen nothing
        return other.verdict(d, other.view(text), dict(extra))

    expected = {(id(d), id(e)): fresh(d, e) for d in (small, large) for e in (one, two)}
    decider = Decider()
    v = decider.view(text)
    built = []
    real = nodestate.pf_states
    monkeypatch.setattr(nodestate, "pf_states", lambda *a: built.append(a[1:]) or real(*a))
    for extra in (one, one, two, two):
        for d in (small, large):
            assert decider.verdict(d, v, extra) == expected[id(d), id(extra)]
    # Built once per view and Reserved, not per request shape or repeat.
    assert built == [(one,), (two,)]
    # Another view with the same reservations gets its own states.
    full = view(decider, [("p0", 25_000, 2), ("p1", 25_000, 2)], [("u", [("p1", 20_000, 0)])])
    assert not decider.verdict(large, full, one).fits
    assert decider.verdict(large, v, one).fits
    # Any other mapping (bind's and preempt's one-off Reserved) is applied afresh, and leaves the kept
    # states alone.
    built.clear()
    plain = Reserved({"p0": (1, 15_000)})
    for _ in range(2):
        assert decider.verdict(small, v, plain) == expected[id(small), id(one)]
    assert built == [(plain,), (plain,)]
    assert decider.verdict(large, v, one).fits and built == [(plain,), (plain,)]


def test_views_without_usable_state() -> None:
    decider = Decider(max_state_age=60)
    now = decider.now()
    assert "no rdma-cni.io/node-state annotation" in decider.unusable(decider.view(None), now)
    bad = decider.view('{"version": 1}')
    assert decider.unusable(bad, now) == "rdma-cni: invalid node state: node state: missing 'generation'"
    old = view(decider, TWO_PFS, age=300)
    assert decider.unusable(old, now) == (
        "rdma-cni: node state is older than 60 s: is the rdma-cni node agent running?"
    )
    assert decider.unusable(view(decider, TWO_PFS, age=5), now) == ""
    assert decider.unusable(None, now) == "rdma-cni: node is not known to the extender yet"
    assert decider.view("{}").updated == 0.0


def test_search_limit_is_not_unresolvable(monkeypatch: pytest.MonkeyPatch) -> None:
    decider = Decider()

    def exhausted(requests: Any, pfs: Any, **kw: Any) -> Any:
        raise placement.NoFit(
            "ran out", reason="search_limit", requested=(), free_vfs=0, free_mbps={}, largest_unplaced=None
        )

    monkeypatch.setattr(placement, "place", exhausted)
    monkeypatch.setattr(decide, "greedy_fits", lambda requests, pfs: False)
    v = decider.verdict(demand((1, 0)), view(decider, TWO_PFS))
    assert not v.fits and not v.unresolvable and v.exhausted


def test_unknown_policy_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy 'pack'"):
        Decider(policy="pack")  # type: ignore[arg-type]


# -- reservations ---------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reservations_sum_per_pf_and_end() -> None:
    clock = Clock()
    res = Reservations(30, clock)
    res.add("u1", "ns", "a", "n1", (("p0", 1, 5_000),))
    res.add("u2", "ns", "b", "n1", (("p0", 2, 1_000), ("p1", 1, 0)))
    res.add(
        "u3",
        "ns",
        "c",
        "n2",
        (
            (
                "p0",
                1,
                7,
            ),
        ),
    )
    assert res.extra("n1") == {"p0": (3, 6_000), "p1": (1, 0)}
    assert res.extra("n1", without=("u2",)) == {"p0": (1, 5_000)}
    assert res.has_node("n2") and not res.has_node("n3") and len(res) == 3
    res.observe("n1", frozenset({"u1", "u3"}))  # u3 is on another node: unaffected
    assert res.get("u1") is None and res.get("u3") is not None
    res.add("u2", "ns", "b", "n3", ())  # a re-bind moves it
    assert not res.has_node("n1") and res.get("u2").node == "n3"  # type: ignore[union-attr]
    clock.now += 29
    assert res.expire() == []
    clock.now += 2
    assert {r.uid for r in res.expire()} == {"u2", "u3"} and len(res) == 0
    assert res.drop("nope", "test") is None
    with pytest.raises(ValueError, match="TTL must be positive"):
        Reservations(0)


# -- preemption -----------------------------------------------------------


def test_preempt_keeps_only_nodes_where_eviction_frees_enough() -> None:
    decider = Decider()
    pods = [("v-big", [("p0", 20_000, 0)]), ("v-small", [("p1", 2_000, 0)]), ("v-plain", [("p1", 0, 0)])]
    n1 = view(decider, [("p0", 25_000, 2), ("p1", 25_000, 2)], pods)
    views = {"n1": n1, "n2": n1, "n3": n1, "n4": decider.view(None)}
    res = Reservations(60)
    d = demand((22_000, 0), (22_000, 0))
    kept = keep_nodes(
        d,
        {"n1": ("v-big",), "n2": ("v-small", "v-plain"), "n3": ("v-big", "v-small"), "n4": ("x",)},
        views.get,
        res,
        decider,
    )
    # n1: p1 still has only 23000 free; n2: p0 holds 20000; n3 frees both; n4 has no state.
    assert kept == {"n3": ("v-big", "v-small")}
    # A reservation of a victim bound but not yet published is released too; others' are counted.
    res.add("v-new", "ns", "x", "n1", (("p1", 1, 3_000),))
    assert keep_nodes(d, {"n1": ("v-big", "v-small")}, views.get, res, decider) == {}
    assert keep_nodes(d, {"n1": ("v-big", "v-small", "v-new")}, views.get, res, decider) == {
        "n1": ("v-big", "v-small", "v-new")
    }


pf_strategy = st.builds(
    lambda i, vfs, cap, used: placement.PfState(f"p{i}", vfs, cap, used if cap is not None else 0),
    st.integers(0, 9),
    st.integers(0, 3),
    st.none() | st.sampled_from([10_000, 25_000, 40_000, 100_000]),
    st.sampled_from([0, 5_000, 10_000, 24_000, 30_000, 120_000]),
)
request_strategy = st.builds(
    lambda lo, extra: placement.Request(lo, lo + extra if extra is not None else 0),
    st.sampled_from([0, 1_000, 5_000, 10_000, 20_000, 25_000]),
    st.none() | st.sampled_from([0, 5_000, 30_000, 90_000]),
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(pf_strategy, max_size=5, unique_by=lambda p: p.name),
    st.lists(request_strategy, min_size=1, max_size=5),
)
def test_greedy_fit_is_a_proof_and_verdicts_match_placement(
    pfs: list[placement.PfState], reqs: list[placement.Request]
) -> None:
    try:
        placement.place(reqs, pfs, max_steps=None)
        fits = True
    except placement.NoFit:
        fits = False
    greedy = greedy_fits(sorted(((r.min_tx_rate, r.max_tx_rate) for r in reqs), reverse=True), pfs)
    if greedy:
        assert fits
    if len(reqs) == 1:
        assert greedy == fits  # one interface: the greedy check is exact
    decider = Decider()
    d = Demand(tuple(reqs), tuple(sorted((r.min_tx_rate, r.max_tx_rate) for r in reqs)), "t")
    assert decider._compute(d, tuple(pfs), sum(p.free_vfs for p in pfs) or 1).fits == fits
    if cannot_fit(d, pfs):
        assert not fits  # a short reason is a proof too


def test_v1_and_v2_states_get_the_same_verdicts() -> None:
    """Agents upgrade node by node: the extender reads both versions (v2 read as the PFs' union here)."""
    decider = Decider()
    state = so.state(TWO_PFS, [("u1", [("p0", 20_000, 0), ("p1", 1_000, 0)])])
    v2 = dataclasses.replace(
        state,
        version=nodestate.VERSION_2,
        networks=(nodestate.Network("rdma-a", ("p0", "p1"), (None, None)),),
    )
    v1_view, v2_view = decider.view(nodestate.encode(state)), decider.view(nodestate.encode(v2))
    assert v2_view.problem == "" and v2_view.state is not None and v2_view.state.version == 2
    assert v2_view.uids == v1_view.uids == frozenset({"u1"})
    for rates in ([(5_000, 0)], [(24_000, 0)], [(25_000, 0)], [(0, 0)] * 7, [(0, 0)] * 6):
        d = demand(*rates)
        assert decider.verdict(d, v1_view).fits == decider.verdict(d, v2_view).fits
    assert not decider.verdict(demand((25_000, 0)), v2_view).fits
    assert decider.verdict(demand((24_000, 0)), v2_view).fits


def _rails(state: nodestate.NodeState, **networks: tuple[str, ...]) -> str:
    listed = tuple(nodestate.Network(n, pfs, (None,) * len(pfs)) for n, pfs in networks.items())
    return nodestate.encode(dataclasses.replace(state, version=nodestate.VERSION_2, networks=listed))


def _on(*parts: tuple[str, list[tuple[int, int]]]) -> Demand:
    return Demand.joint(
        [
            (net, parse_request([{"min_tx_rate": lo, "max_tx_rate": hi} for lo, hi in rates], "t"), "t")
            for net, rates in parts
        ]
    )


def test_v2_judges_each_network_on_its_own_pfs() -> None:
    """p0 (rail-a) is full, p1 (rail-b) empty: a pod on rail-a fits only the union of a v1 state."""
    decider = Decider()
    state = so.state(TWO_PFS, [("u1", [("p0", 0, 0)] * 4)])
    v1 = decider.view(nodestate.encode(state))
    v2 = decider.view(_rails(state, **{"rail-a": ("p0",), "rail-b": ("p1",)}))
    on_a = _on(("rail-a", [(0, 0)]))
    assert decider.verdict(on_a, v1).fits  # a version 1 state: the union, as before
    got = decider.verdict(on_a, v2)
    assert not got.fits and got.reason.endswith("(on the PFs of network rail-a)")
    assert got.unresolvable is False  # the empty node would hold it: preemption can help
    assert decider.verdict(_on(("rail-b", [(0, 0)] * 4)), v2).fits
    assert not decider.verdict(_on(("rail-b", [(0, 0)] * 4), ("rail-a", [(0, 0)])), v2).fits
    # The filter's fast path (fill) agrees.
    assert not decider.fill(on_a, v2, decider.table(on_a)).fits
    # A network the state does not list is judged on every PF, as a version 1 state is.
    assert decider.verdict(_on(("rail-x", [(0, 0)])), v2).fits


def test_networks_sharing_pfs_are_judged_together() -> None:
    decider = Decider()
    state = so.state(TWO_PFS, [("u1", [("p0", 0, 0)] * 4 + [("p1", 0, 0)] * 3)])  # one VF free, on p1
    shared = decider.view(_rails(state, **{"a": ("p0", "p1"), "b": ("p1", "p0")}))
    assert decider.verdict(_on(("a", [(0, 0)])), shared).fits
    assert not decider.verdict(_on(("a", [(0, 0)]), ("b", [(0, 0)])), shared).fits
    demand_ab = _on(("a", [(0, 0)]), ("b", [(0, 0)]))
    assert demand_ab.key != _on(("a", [(0, 0), (0, 0)])).key  # cached apart


def test_reservations_go_on_the_networks_pfs() -> None:
    decider = Decider()
    state = so.state([("p0", 25_000, 4), ("p1", 25_000, 4), ("p2", 25_000, 4)], [("u1", [("p1", 20_000, 0)])])
    view_ = decider.view(_rails(state, **{"rail-a": ("p0",), "rail-b": ("p1",)}))
    use = decider.use(_on(("rail-a", [(1_000, 0)]), ("rail-b", [(5_000, 0)])), view_)
    assert use == (("p0", 1, 1_000), ("p1", 1, 5_000))
    with pytest.raises(placement.NoFit):
        decider.use(_on(("rail-b", [(6_000, 0)])), view_)


# -- attachments judged as their ADDs run; constrained requests --------------


def _with_rails(state: nodestate.NodeState, **networks: tuple[tuple[str, str | None], ...]) -> str:
    listed = tuple(
        nodestate.Network(n, tuple(pf for pf, _ in pfs), tuple(rail for _, rail in pfs))
        for n, pfs in networks.items()
    )
    return nodestate.encode(dataclasses.replace(state, version=nodestate.VERSION_2, networks=listed))


def _constrained(*parts: tuple[str, Any]) -> Demand:
    return Demand.joint([(net, parse_request(raw, "t"), "t") for net, raw in parts])


def test_partly_overlapping_networks_are_judged_as_the_sequence_of_adds() -> None:
    """a = {p0, p1}, b = {p1, p2}: a's ADD takes p1 (best fit), and then b finds no room.

    Judging both on the union (the old approximation) passes the node: a on p0 and b on p1.
    """
    decider = Decider()
    state = so.state([("p0", 20_000, 2), ("p1", 10_000, 2), ("p2", 25_000, 0)])
    view = decider.view(_rails(state, a=("p0", "p1"), b=("p1", "p2")))
    pod = _on(("a", [(5_000, 0)]), ("b", [(10_000, 0)]))
    got = decider.verdict(pod, view)
    assert not got.fits and got.reason.endswith("(on the PFs of network b)"), got
    # What a's ADD takes is what placement takes on a's PFs alone.
    assert placement.place([placement.Request(5_000)], nodestate.pf_states(state)[:2]).pfs == ("p1",)
    # In the other order b's ADD goes first, takes p1, and a's goes on p0: both succeed.
    assert decider.verdict(_on(("b", [(10_000, 0)]), ("a", [(5_000, 0)])), view).fits
    assert decider.use(_on(("b", [(10_000, 0)]), ("a", [(5_000, 0)])), view) == (
        ("p0", 1, 5_000),
        ("p1", 1, 10_000),
    )
    with pytest.raises(placement.NoFit):
        decider.use(pod, view)


def test_rails_come_from_the_networks_of_the_state() -> None:
    decider = Decider()
    state = so.state([("p0", 25_000, 4), ("p1", 25_000, 4)], [("u1", [("p1", 0, 0)] * 4)])  # p1 is full
    view = decider.view(_with_rails(state, net=(("p0", "rail-0"), ("p1", "rail-1"))))
    on_rail_0 = _constrained(("net", '[{"rail": "rail-0"}]'))
    on_rail_1 = _constrained(("net", '[{"rail": "rail-1"}]'))
    assert decider.verdict(on_rail_0, view).fits
    got = decider.verdict(on_rail_1, view)
    assert not got.fits and not got.unresolvable  # the empty node holds it: preemption can help
    assert "(rail 'rail-1')" in got.reason and got.reason.endswith("(on the PFs of network net)")
    # The filter's fast path knows only rates: it must not pass the node.
    assert not decider.fill(on_rail_1, view, decider.table(on_rail_1)).fits
    assert decider.use(on_rail_0, view) == (("p0", 1, 0),)
    # A rail the network does not have: a no-fit that no preemption cures.
    unknown = decider.verdict(_constrained(("net", '[{"rail": "rail-7"}]')), view)
    assert not unknown.fits and unknown.unresolvable
    assert "entry 0.rail: no PF of the network here has rail 'rail-7'" in unknown.reason
    # A version 1 state has no rails: a rail request fits none of its nodes.
    assert not decider.verdict(
        Demand.of(parse_request('[{"rail": "rail-0"}]', "t"), "t"), decider.view(nodestate.encode(state))
    ).fits
    # A PF by name works on either version.
    by_pf = Demand.of(parse_request('[{"pf": "p0"}]', "t"), "t")
    assert decider.verdict(by_pf, decider.view(nodestate.encode(state))).fits
    assert not decider.verdict(Demand.of(parse_request('[{"pf": "p1"}]', "t"), "t"), view).fits


def test_different_pfs_is_judged_per_attachment_and_cached_apart() -> None:
    decider = Decider()
    state = so.state([("p0", 25_000, 4), ("p1", 25_000, 4)], [("u1", [("p1", 0, 0)] * 4)])  # p1 is full
    view = decider.view(nodestate.encode(state))
    two = Demand.of(parse_request("[{}, {}]", "t"), "t")
    spread = Demand.of(parse_request('{"interfaces": [{}, {}], "different_pfs": true}', "t"), "t")
    assert two.key != spread.key and not spread.simple and two.simple
    assert decider.verdict(two, view).fits
    got = decider.verdict(spread, view)
    assert (
        not got.fits
        and "each on a different PF" in got.reason
        and "the node has 1 PF with a free VF" in got.reason
    )
    assert not decider.fill(spread, view, decider.table(spread)).fits
    # Per attachment: two attachments of one interface each may share a PF.
    joint = _constrained(
        ("a", '{"interfaces": [{}], "different_pfs": true}'),
        ("b", '{"interfaces": [{}], "different_pfs": true}'),
    )
    assert decider.verdict(joint, view).fits


def test_constrained_requests_are_kept_apart_in_the_verdict_cache() -> None:
    plain = Demand.of(parse_request("[{}]", "t"), "t")
    railed = Demand.of(parse_request('[{"rail": "r"}]', "t"), "t")
    pinned = Demand.of(parse_request('[{"pf": "r"}]', "t"), "t")
    assert len({plain.key, railed.key, pinned.key}) == 3
    # The order of a request's interfaces does not matter; the order of attachments does.
    assert (
        Demand.of(parse_request('[{"rail": "a"}, {"pf": "b"}]', "t"), "t").key
        == Demand.of(parse_request('[{"pf": "b"}, {"rail": "a"}]', "t"), "t").key
    )
    assert _on(("a", [(1, 0)]), ("b", [(2, 0)])).key != _on(("b", [(2, 0)]), ("a", [(1, 0)])).key


@pytest.mark.parametrize("seed", range(4))
def test_admit_all_is_admit_node_by_node(seed: int) -> None:
    """Filter's bulk verdicts (cached verdicts looked up first) are the per-node rule's, whatever the
    caches hold: views unknown, without a state, stale, stamped ahead, with and without reservations,
    judged again after the reservations change."""
    import random

    rng = random.Random(seed)
    pfs = [("p0", 25_000, 4), ("p1", 10_000, 2)]
    unknown = object()
    texts: list[Any] = [unknown, None, "{not json"]
    for i in range(40):
        rates = (0, 2_000, 5_000)
        pods = [(f"u{i}-{k}", [(rng.choice(("p0", "p1")), rng.choice(rates), 0)]) for k in range(3)]
        state = so.state(pfs, pods[: rng.randint(0, 3)], age=rng.choice((0, 0, 0, 90, -120)))
        texts.append(nodestate.encode(state))

    decider = Decider(max_state_age=60)
    views = [None if t is unknown else decider.view(t) for t in texts]
    demands = [demand((5_000, 0)), demand((8_000, 0), (2_000, 0)), demand((0, 0), (0, 0), (0, 0))]
    now = decider.now()
    for _ in range(6):
        held: list[Any] = [
            Reserved({"p0": (1, rng.choice((0, 4_000, 9_000)))}) if rng.random() < 0.4 else None
            for _ in views
        ]
        for d in demands:
            for _ in range(2):  # the second time from warm caches
                got = decider.admit_all(d, views, held, now)
                # Each node by the rule alone, on a decider that has seen nothing.
                expected = []
                for i, h in enumerate(held):
                    fresh = Decider(max_state_age=60)
                    text = texts[i]
                    expected.append(fresh.admit(d, None if text is unknown else fresh.view(text), now, h))
                assert got == expected


def test_a_deadline_asks_whether_its_caller_left_at_most_every_gone_every() -> None:
    asked = []

    def gone() -> bool:
        asked.append(1)
        return len(asked) > 1

    deadline = decide.Deadline(60, gone)
    for _ in range(1000):  # a filter's checks: none asks within GONE_EVERY of the start
        deadline.check()
    assert not asked
    time.sleep(decide.GONE_EVERY * 1.2)
    for _ in range(1000):
        deadline.check()
    assert len(asked) == 1  # asked once (still there), not per check
    time.sleep(decide.GONE_EVERY * 1.2)
    with pytest.raises(decide.Abandoned):
        deadline.check()
    with pytest.raises(decide.Abandoned):
        decide.Deadline(0).check()  # the time itself is read at every check


def test_use_places_each_pod_on_the_same_states_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """filter's hold asks where a pod goes on the node it passes, pod after pod, on states that
    come back: placed once per requests, PF states and networks, then looked up."""
    decider = Decider()
    calls: list[int] = []
    attach = decider._attach_all

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return attach(*args, **kw)

    monkeypatch.setattr(decider, "_attach_all", counted)
    a = view(decider, TWO_PFS, [("u1", [("p0", 10_000, 0)])])
    b = view(decider, TWO_PFS, [("u2", [("p0", 10_000, 0)])])  # another node, the same PF states
    d = demand((5_000, 0))
    first = decider.use(d, a)
    assert decider.use(d, a) == first and decider.use(demand((5_000, 0)), b) == first
    assert len(calls) == 1
    # What the node holds beyond its state is part of what is placed on.
    held = decider.use(d, a, {"p0": (2, 15_000)})
    assert len(calls) == 2
    assert decider.use(d, a, {"p0": (2, 15_000)}) == held and len(calls) == 2


def test_use_keeps_placements_apart_by_the_order_of_the_requests() -> None:
    """Two demands of one key (equal up to order) place as their ADDs run, each in its own order."""
    decider = Decider()
    state = so.state([("p0", 20_000, 2), ("p1", 10_000, 2), ("p2", 25_000, 0)])
    shared = decider.view(_rails(state, a=("p0", "p1"), b=("p1", "p2")))
    ba = _on(("b", [(10_000, 0)]), ("a", [(5_000, 0)]))
    assert decider.use(ba, shared) == (("p0", 1, 5_000), ("p1", 1, 10_000))
    with pytest.raises(placement.NoFit):
        decider.use(_on(("a", [(5_000, 0)]), ("b", [(10_000, 0)])), shared)
    assert decider.use(ba, shared) == (("p0", 1, 5_000), ("p1", 1, 10_000))
