"""Per-node admission rules (rdma_cni/extender/rules.py): one set of rule objects for every path.

Filter judges nodes in bulk (``Decider.admit_all``), bind, preemption and ``nodes --fits`` one at
a time (``Decider.admit``); a rule added to ``rules.RULES`` must hold on all of them, and what a
rule about pods needs (which pods a node has, published, reserved or leaving) must reach it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdma_cni.extender import preempt, rules
from rdma_cni.extender.bind import Binder
from rdma_cni.extender.decide import Decider, NodeView
from rdma_cni.extender.demand import Demand, Demands
from rdma_cni.extender.reservations import Reservations, Reserved
from rdma_cni.extender.settings import Settings
from rdma_cni.extender.verbs import Extender
from rdma_cni.extender.wire import BindArgs
from rdma_cni.shared import nodestate
from rdma_cni.shared.podrequest import parse_request
from tests.support import sched_objects as so

AGE = 60.0
# Settings under which every rule of rules.RULES is on: the property below covers each of them.
EVERY_RULE = Settings(max_state_age=AGE)
PFS = [("p0", 25_000, 4), ("p1", 10_000, 2)]


def demand(*rates: tuple[int, int]) -> Demand:
    return Demand.of(parse_request([{"min_tx_rate": lo, "max_tx_rate": hi} for lo, hi in rates], "t"), "t")


def test_every_rule_is_on_in_the_property_below() -> None:
    # A new rule that these settings leave off would pass the property untested: turn it on here.
    assert len(rules.node_rules(EVERY_RULE)) == len(rules.RULES)
    assert isinstance(rules.node_rules(EVERY_RULE)[0], rules.StateUsable)


# A node as a text (None: no annotation; "unknown": not in the cache) and the age of its state,
# exactly on the bounds of the usable window and just beyond them.
_AGES = [0.0, 5.0, AGE, AGE + 1e-6, AGE + 30, -rules.FUTURE_SKEW, -rules.FUTURE_SKEW - 1e-6, -600.0]
_RATES = (0, 2_000, 5_000, 9_000)


@st.composite
def nodes(draw: Any) -> tuple[Any, float, Reserved | None]:
    kind = draw(st.sampled_from(["state", "state", "state", "unknown", "none", "invalid"]))
    if kind == "unknown":
        text: Any = "unknown"
    elif kind == "none":
        text = None
    elif kind == "invalid":
        text = '{"version": 1}'
    else:
        pods = [
            (f"u{k}", [(draw(st.sampled_from(("p0", "p1"))), draw(st.sampled_from(_RATES)), 0)])
            for k in range(draw(st.integers(0, 3)))
        ]
        text = nodestate.encode(so.state(PFS, pods))
    age = draw(st.sampled_from(_AGES))
    held = None
    if draw(st.booleans()):
        by_pf = {"p0": (draw(st.integers(-1, 2)), draw(st.sampled_from((-2_000, 0, 4_000, 9_000))))}
        pods_held = frozenset(draw(st.lists(st.sampled_from(["r1", "r2", "u0"]), max_size=2)))
        gone = frozenset(draw(st.lists(st.sampled_from(["u0", "u1", "x"]), max_size=2)))
        held = Reserved(by_pf if draw(st.booleans()) else {}, pods_held, gone=gone, kept=draw(st.booleans()))
    return text, age, held


def _view(decider: Decider, text: Any, age: float, now: float) -> NodeView | None:
    if text == "unknown":
        return None
    view = decider.view(text)
    return dataclasses.replace(view, updated=now - age) if view.state is not None else view


@settings(max_examples=300, deadline=None)
@given(st.lists(nodes(), min_size=1, max_size=12), st.sampled_from([(5_000, 0), (12_000, 0), (0, 0)]))
def test_the_bulk_path_is_each_rule_then_the_fit_node_by_node(
    spec: list[tuple[Any, float, Reserved | None]], rates: tuple[int, int]
) -> None:
    """admit_all (filter) gives every node what admit (bind, preempt) gives it alone: every rule of
    RULES on, a rule's bulk refusal is its refusal of that node alone, and a node no rule refuses
    gets the fit of its PF states with what it holds, as a decider that has seen nothing finds it."""
    d = demand(rates, (2_000, 0)) if rates[0] else demand(rates)
    decider = Decider(settings=EVERY_RULE)
    now = decider.now()
    views = [_view(decider, text, age, now) for text, age, _ in spec]
    held = [h for _, _, h in spec]
    for _ in range(2):  # the second time from warm caches
        got = decider.admit_all(d, views, held, now)
        for i, (view, extra) in enumerate(zip(views, held, strict=True)):
            assert got[i] == decider.admit(d, view, now, extra)
            refusals = [r for rule in decider.rules for _, r in rule.refuse(d, [view], [extra], now)]
            # The first rule's C-speed test agrees with the reason it gives, on the window's bounds too.
            assert bool(decider.unusable(view, now)) == any(
                isinstance(rule, rules.StateUsable) and list(rule.refuse(d, [view], [extra], now))
                for rule in decider.rules
            )
            if refusals:
                assert (got[i].fits, got[i].reason, got[i].unresolvable) == (
                    False,
                    refusals[0].reason,
                    refusals[0].unresolvable,
                )
                continue
            fresh = Decider(settings=EVERY_RULE)
            text, age, _ = spec[i]
            other = _view(fresh, text, age, now)
            assert other is not None
            assert got[i] == fresh.verdict(d, other, extra or None)


class _NoPodNamed(rules.NodeRule):
    """A rule as a newcomer would add one: no node that has (or is about to have) pod ``uid``."""

    def __init__(self, uid: str) -> None:
        self.uid = uid

    def check(
        self, demand: Demand, view: NodeView, held: Reserved | None, now: float
    ) -> rules.Refusal | None:
        if self.uid in rules.pods(view, held):
            return rules.Refusal(f"rdma-cni: node has pod {self.uid}", False)
        return None


def test_a_rule_added_to_rules_holds_in_filter_prioritize_bind_and_preempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One line in RULES: filter's bulk path (and its kept answers), prioritize, bind's check and
    preemption all honour it, and it sees pods published, reserved, held and leaving."""
    monkeypatch.setattr(rules, "RULES", [*rules.RULES, lambda s: _NoPodNamed("taboo")])
    decider = Decider(max_state_age=600)
    # "free" first: "published" is in the same PF states (its pod holds no VF), so its verdict is
    # found cached, and the rule must still refuse it.
    names = ["free", "published", "reserved", "held", "other"]
    views = {
        name: decider.view(nodestate.encode(so.state(PFS, [("taboo" if name == "published" else "x", [])])))
        for name in names
    }
    reservations = Reservations(600)
    ext = Extender(
        decider=decider,
        demands=Demands(annotation="rdma_interfaces_required"),
        reservations=reservations,
        cache_views=lambda: views,
        cache_generation=lambda: 1,
        settings=Settings(max_state_age=600),
    )
    ext.ready.set()
    reservations.add("taboo", "team-a", "t", "reserved", (("p0", 1, 0),))
    reservations.hold("taboo-2", "team-a", "t2", "held", (("p0", 1, 0),))
    refused = {"published", "reserved"}
    pod = so.rdma_pod("p", [(1_000, 0)])
    for _ in range(2):  # the second answer from filter's kept answers
        answer = ext.filter(so.args_names(pod, names))
        assert answer["FailedNodes"] == {n: "rdma-cni: node has pod taboo" for n in refused}
        assert set(answer["NodeNames"]) == set(names) - refused
    assert {entry["Host"] for entry in json.loads(ext.prioritize(so.args_names(pod, names)))} <= set(
        names
    ) - refused
    # A hold is a pod too: a rule about another pod's uid sees it.
    assert decider.rules[-1].check(demand((0, 0)), views["held"], reservations.extra("held"), 0.0) is None
    assert "taboo-2" in rules.pods(views["held"], reservations.extra("held"))
    got = ext.demands.of_pod(pod)
    assert got is not None
    binder = Binder(None, decider, ext.demands, reservations, ext.view_of)
    problem, reason = binder._reserve(BindArgs("p", "team-a", "uid-p", "published"), got)
    assert reason == "no_fit" and "node has pod taboo" in problem
    assert binder._reserve(BindArgs("p", "team-a", "uid-p", "free"), got) == ("", "")
    # Preemption: evicting the pod the rule is about makes the node eligible, published or reserved.
    kept = preempt.keep_nodes(got, {n: ("taboo",) for n in names}, ext.view_of, reservations, decider)
    assert set(kept) == set(names)
    kept = preempt.keep_nodes(got, {n: ("x",) for n in names}, ext.view_of, reservations, decider)
    assert set(kept) == set(names) - refused


def test_what_a_node_holds_names_its_pods() -> None:
    res = Reservations(60)
    res.add("a", "ns", "a", "n1", (("p0", 1, 1_000),))
    res.add("b", "ns", "b", "n1", (("p1", 1, 0),))
    res.hold("c", "ns", "c", "n1", (("p0", 1, 500),))
    kept = res.held_on()("n1")
    assert kept is not None and kept.kept and kept.pods == {"a", "b", "c"}
    assert dict(kept) == {"p0": (2, 1_500), "p1": (1, 0)}
    # Bind's: reservations only, the pod itself left out; a one-off, never kept.
    bind = res.extra("n1", without=("b",), holds=False)
    assert not bind.kept and bind.pods == {"a"} and dict(bind) == {"p0": (1, 1_000)}
    assert res.extra("n2").pods == frozenset() and res.held_on()("n2") is None
    # Preemption's: victims leave, what the published ones hold is given back.
    gone = res.extra("n1", without=("a", "v")).releasing({"p0": (1, 4_000)}, ("a", "v"))
    assert dict(gone) == {"p0": (0, -3_500), "p1": (1, 0)} and gone.pods == {"b", "c"}
    assert gone.gone == {"a", "v"} and not gone.kept
    decider = Decider()
    view = decider.view(nodestate.encode(so.state(PFS, [("v", [("p0", 4_000, 0)]), ("w", [])])))
    assert rules.pods(view, None) == {"v", "w"}
    assert rules.pods(view, gone) == {"w", "b", "c"}
