"""The shared-algorithm claim, as a property: the extender's verdict for a node is the outcome of ADD there.

For a random node (PF capacities, rdmaIsolation) brought to a random state by
real ADDs, the node agent's snapshot is published (encoded and decoded as the
annotation), the extender's filter decides whether a random request fits, and
then the plugin's ADD runs that request on the same node: it must succeed
exactly when the extender said the pod fits, and otherwise refuse with code
100. `required` isolation is left out: on this kernel (no RDMA stack) ADD
refuses it for a reason no capacity explains; its VF counting is covered by
tests/integration/test_agent_snapshot.py.

Bounded to about a minute: ADD and DEL run in this process (the same code as
the binary, without an interpreter start per call) and without IPAM.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdma_cni.agent import snapshot
from rdma_cni.extender.decide import Decider, Verdict
from rdma_cni.extender.demand import Demand
from rdma_cni.shared import nodestate
from rdma_cni.shared.podrequest import parse_request
from tests.integration.conftest import Cluster, assert_node_pristine
from tests.support.simnode import SimPf

LAYOUT = [SimPf("simpf0", 3, 25000), SimPf("simpf1", 3, 10000), SimPf("simpf2", 2, None)]

RATES = st.sampled_from([0, 0, 1000, 2500, 5000, 8000, 10000, 15000, 20000])


@st.composite
def interface(draw: st.DrawFn) -> dict[str, int]:
    lo = draw(RATES)
    hi = draw(st.sampled_from([0, 0, lo, lo + 5000, 30000]))
    entry = {}
    if lo:
        entry["min_tx_rate"] = lo
    if hi:
        entry["max_tx_rate"] = max(hi, lo)
    return entry


REQUEST = st.lists(interface(), min_size=1, max_size=4)


@st.composite
def constrained_interface(draw: st.DrawFn, rails: bool = True) -> dict[str, Any]:
    """An interface that may name a PF (sometimes one the node lacks) or a rail (sometimes unknown)."""
    entry: dict[str, Any] = draw(interface())
    where = draw(st.sampled_from(["none", "none", "pf", "rail", "rail"] if rails else ["none", "pf"]))
    if where == "pf":
        entry["pf"] = draw(st.sampled_from(["simpf0", "simpf1", "simpf2", "simpf9"]))
    elif where == "rail":
        entry["rail"] = draw(st.sampled_from(["rail-0", "rail-1", "rail-1", "rail-9"]))
    return entry


@st.composite
def constrained_request(draw: st.DrawFn, rails: bool = True) -> Any:
    """A request in either form: the original list, or the object with ``different_pfs``."""
    interfaces = draw(st.lists(constrained_interface(rails), min_size=1, max_size=4))
    if draw(st.booleans()):
        return {"interfaces": interfaces, "different_pfs": draw(st.booleans())}
    return interfaces


# The rails the operator labels PFs with in the network configs (pfs entries as objects).
RAILS = {"simpf0": "rail-0", "simpf1": "rail-1", "simpf2": "rail-1"}
CAPACITY = st.fixed_dictionaries(
    {},
    optional={
        "simpf0": st.sampled_from([5000, 20000, 25000, 40000]),
        "simpf1": st.sampled_from([2000, 10000, 30000]),
        "simpf2": st.sampled_from([15000, 25000]),
    },
)


DECIDER = Decider()


def extender_verdict(state: nodestate.NodeState, request: Any) -> Verdict:
    """The extender's filter verdict for the node, from the annotation as the agent publishes it."""
    text = nodestate.encode(dataclasses.replace(state, generation=1, updated="2026-01-01T00:00:00Z"))
    view = DECIDER.view(text)
    assert DECIDER.unusable(view, DECIDER.now()) == ""
    demand = Demand.of(parse_request(json.dumps(request), "probe"), "probe")
    return DECIDER.verdict(demand, view)


@pytest.mark.node(LAYOUT)
@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    capacity=CAPACITY,
    isolation=st.sampled_from(["auto", "off"]),
    before=st.lists(REQUEST | constrained_request(rails=False), max_size=5),
    probe=REQUEST | constrained_request(rails=False),
)
def test_extender_verdict_equals_add_outcome(
    cluster: Cluster,
    capacity: dict[str, int],
    isolation: str,
    before: list[Any],
    probe: Any,
) -> None:
    """Requests with a ``pf`` and with ``different_pfs`` too: the extender knows the PFs' names.

    (A pod's rails need its network: see the multi-network property below.)
    """
    conf = cluster.conf(ipam=None, capacityMbps=capacity, rdmaIsolation=isolation)
    path = os.path.join(cluster.tmp, "property-conf.json")
    with open(path, "w") as f:
        json.dump(conf, f)
    view = snapshot.load_view(path)
    added: list[dict[str, str]] = []
    try:
        for request in before:
            pod = cluster.pod(request)
            outcome = cluster.run_inproc("ADD", pod, conf)
            assert outcome.ok or (outcome.doc or {}).get("code") == 100, outcome.doc
            if outcome.ok:
                added.append(pod)
        state = snapshot.snapshot([view])
        verdict = extender_verdict(state, probe)
        assert not verdict.exhausted  # such small nodes never exhaust the search budget
        fits = verdict.fits
        pod = cluster.pod(probe)
        outcome = cluster.run_inproc("ADD", pod, conf)
        if outcome.ok:
            added.append(pod)
        assert outcome.ok == fits, (fits, outcome.doc, state)
        if not outcome.ok:
            assert (outcome.doc or {}).get("code") == 100, outcome.doc
    finally:
        for pod in added:
            assert cluster.run_inproc("DEL", pod, conf).ok
        _forget_netns(cluster)
    assert_node_pristine(cluster)


def _forget_netns(cluster: Cluster) -> None:
    from tests.support.simnode import del_netns

    for ns in cluster.netns_names:
        del_netns(ns)
    cluster.netns_names.clear()


# -- several networks per node and per pod ----------------------------------

# (PFs of net-a, PFs of net-b): disjoint, or the same list (None: every PF).
NETWORK_PFS = st.sampled_from(
    [
        (["simpf0"], ["simpf1", "simpf2"]),
        (["simpf0", "simpf2"], ["simpf1"]),
        (None, None),
        (["simpf0", "simpf1"], ["simpf0", "simpf1"]),
        # Partly overlapping: the extender must follow the ADDs' sequence, not the union.
        (["simpf0", "simpf1"], ["simpf1", "simpf2"]),
        (["simpf1", "simpf2"], ["simpf0", "simpf1", "simpf2"]),
    ]
)
NETWORKS = ("net-a", "net-b")
# Per attachment: its own request (cni-args), or None for the pod-wide annotation / the default.
ATTACHMENTS = st.lists(
    st.tuples(st.sampled_from(NETWORKS), st.none() | REQUEST | constrained_request()),
    min_size=1,
    max_size=2,
    unique_by=lambda a: a[0],
)
POD = st.tuples(ATTACHMENTS, st.none() | REQUEST | constrained_request())


def _railed(pfs: list[str] | None, railed: bool) -> list[Any] | None:
    """A network's pfs with the operator's rails as objects (every PF when None), or as given."""
    if not railed:
        return pfs
    return [{"name": pf, "rail": RAILS[pf]} for pf in (pfs or sorted(RAILS))]


def _multi_pod_verdict(
    state: nodestate.NodeState, attachments: list[tuple[str, Any]], annotation: Any
) -> tuple[Verdict, Any]:
    from rdma_cni.extender.demand import Demands
    from tests.support import sched_objects as so

    selection = [
        {"name": net, **({"cni-args": {"rdma_interfaces_required": req}} if req is not None else {})}
        for net, req in attachments
    ]
    annotations = {"k8s.v1.cni.cncf.io/networks": json.dumps(selection)}
    if annotation is not None:
        annotations["rdma_interfaces_required"] = json.dumps(annotation)
    demands = Demands(
        annotation="rdma_interfaces_required",
        networks=frozenset(NETWORKS),
        default_request=parse_request("[{}]", "--default-request"),
    )
    demand = demands.of_pod(so.pod("probe", annotations))
    assert demand is not None
    text = nodestate.encode(dataclasses.replace(state, generation=1, updated="2026-01-01T00:00:00Z"))
    return DECIDER.verdict(demand, DECIDER.view(text)), demand


@pytest.mark.node(LAYOUT)
@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    capacity=CAPACITY,
    isolation=st.sampled_from(["auto", "off"]),
    layout=NETWORK_PFS,
    railed=st.sampled_from([True, True, False]),
    before=st.lists(POD, max_size=4),
    probe=POD,
)
def test_multi_network_verdict_equals_all_adds_succeeding(
    cluster: Cluster,
    capacity: dict[str, int],
    isolation: str,
    layout: tuple[Any, Any],
    railed: bool,
    before: list[tuple[list[tuple[str, Any]], Any]],
    probe: tuple[list[tuple[str, Any]], Any],
) -> None:
    """One ADD per selected network, each with the request the shared rule gives it.

    Requests may name PFs and rails and ask for different PFs; the networks'
    PF lists may carry rails, and may be disjoint, equal or partly overlapping.
    """
    confs = {
        net: cluster.conf(
            ipam=None, name=net, pfs=_railed(pfs, railed), capacityMbps=capacity, rdmaIsolation=isolation
        )
        for net, pfs in zip(NETWORKS, layout, strict=True)
    }
    views = []
    for net, conf in confs.items():
        path = os.path.join(cluster.tmp, f"property-{net}.json")
        with open(path, "w") as f:
            json.dump(conf, f)
        views.append(snapshot.load_view(path))
    added: list[tuple[dict[str, str], dict[str, Any]]] = []

    def attach(attachments: list[tuple[str, Any]], annotation: Any) -> bool:
        pod = cluster.pod(annotation)
        ok = True
        for k, (net, req) in enumerate(attachments):
            conf = dict(confs[net])
            if req is not None:
                conf["args"] = {"cni": {"rdma_interfaces_required": req}}  # what Multus makes of cni-args
            env = {**pod, "CNI_IFNAME": f"net{k + 1}"}
            outcome = cluster.run_inproc("ADD", env, conf)
            assert outcome.ok or (outcome.doc or {}).get("code") == 100, outcome.doc
            if outcome.ok:
                added.append((env, conf))
            ok = ok and outcome.ok
        return ok

    try:
        for attachments, annotation in before:
            attach(attachments, annotation)
        state = snapshot.snapshot(views)
        verdict, demand = _multi_pod_verdict(state, *probe)
        assert not verdict.exhausted
        assert attach(*probe) == verdict.fits, (verdict, demand, state)
    finally:
        for env, conf in reversed(added):
            assert cluster.run_inproc("DEL", env, conf).ok
        _forget_netns(cluster)
    assert_node_pristine(cluster)


@pytest.mark.node(LAYOUT)
def test_one_interface_per_rail_fits_and_is_placed_on_the_rails(cluster: Cluster) -> None:
    """Two networks on the same railed PFs; the pod asks one interface on each rail, per network."""
    confs = {
        net: cluster.conf(ipam=None, name=net, pfs=_railed(None, True), rdmaIsolation="off")
        for net in NETWORKS
    }
    views = []
    for net, conf in confs.items():
        path = os.path.join(cluster.tmp, f"rails-{net}.json")
        with open(path, "w") as f:
            json.dump(conf, f)
        views.append(snapshot.load_view(path))
    state = snapshot.snapshot(views)
    assert [n.rails for n in state.networks] == [("rail-0", "rail-1", "rail-1")] * 2
    attachments = [
        ("net-a", [{"rail": "rail-0"}]),
        ("net-b", {"interfaces": [{"rail": "rail-1"}] * 2, "different_pfs": True}),
    ]
    verdict, demand = _multi_pod_verdict(state, attachments, None)
    assert verdict.fits, verdict
    use = DECIDER.use(
        demand,
        DECIDER.view(
            nodestate.encode(dataclasses.replace(state, generation=1, updated="2026-01-01T00:00:00Z"))
        ),
    )
    assert use == (("simpf0", 1, 0), ("simpf1", 1, 0), ("simpf2", 1, 0))
    pod = cluster.pod(None)
    added = []
    try:
        for k, (net, req) in enumerate(attachments):
            conf = {**confs[net], "args": {"cni": {"rdma_interfaces_required": req}}}
            env = {**pod, "CNI_IFNAME": f"net{k + 1}"}
            outcome = cluster.run_inproc("ADD", env, conf)
            assert outcome.ok, outcome.doc
            added.append((env, conf))
        after = snapshot.snapshot(views)
        assert sorted(u.pf for a in after.allocations for u in a.interfaces) == ["simpf0", "simpf1", "simpf2"]
        # A third interface on rail-1, each on its own PF, cannot fit: rail-1 has two PFs.
        three = [("net-b", {"interfaces": [{"rail": "rail-1"}] * 3, "different_pfs": True})]
        assert not _multi_pod_verdict(state, three, None)[0].fits
    finally:
        for env, conf in reversed(added):
            assert cluster.run_inproc("DEL", env, conf).ok
        _forget_netns(cluster)
    assert_node_pristine(cluster)
