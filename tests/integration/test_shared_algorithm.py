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
CAPACITY = st.fixed_dictionaries(
    {},
    optional={
        "simpf0": st.sampled_from([5000, 20000, 25000, 40000]),
        "simpf1": st.sampled_from([2000, 10000, 30000]),
        "simpf2": st.sampled_from([15000, 25000]),
    },
)


DECIDER = Decider()


def extender_verdict(state: nodestate.NodeState, request: list[dict[str, int]]) -> Verdict:
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
    before=st.lists(REQUEST, max_size=5),
    probe=REQUEST,
)
def test_extender_verdict_equals_add_outcome(
    cluster: Cluster,
    capacity: dict[str, int],
    isolation: str,
    before: list[list[dict[str, int]]],
    probe: list[dict[str, int]],
) -> None:
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
