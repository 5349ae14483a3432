"""Holds: a pod's best node is held from the extender's answer until its bind, so the next pod,
filtered before that bind lands, is judged with it (no collision at bind), and nothing is over-committed.

kube-scheduler's side is played in-process (filter, prioritize and bind as it sends them, in the
order its scheduling and binding cycles do: the next pod's filter before the previous pod's bind).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from rdma_cni.extender import wire
from rdma_cni.extender.decide import Decider, NodeView
from rdma_cni.extender.demand import Demands
from rdma_cni.extender.reservations import Reservations
from rdma_cni.extender.settings import Settings
from rdma_cni.extender.verbs import Extender
from rdma_cni.kube import client as kubeapi
from rdma_cni.shared import nodestate
from tests.support import sched_objects as so

ANNOTATION = "rdma_interfaces_required"
ONE_PF = [("ens1f0", 25_000, 4)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Api:
    """The API's side of bind: the pods as stored, Bindings applied to them.

    ``cached`` plays kube-apiserver's watch cache where it trails etcd: a pod's entry there (None:
    not arrived yet) is what a read at resourceVersion 0 gets instead of the stored pod.
    """

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.cached: dict[str, dict[str, Any] | None] = {}
        self.reads: list[str] = []  # "cache" or "etcd", per read

    def add(self, pod: dict[str, Any]) -> dict[str, Any]:
        pod["spec"]["schedulerName"] = "rdma-scheduler"
        self.pods[pod["metadata"]["name"]] = pod
        return pod

    def get(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        name = path.rsplit("/", 1)[1]
        from_cache = params == {"resourceVersion": "0"}
        self.reads.append("cache" if from_cache else "etcd")
        pod = self.cached.get(name, self.pods[name]) if from_cache else self.pods[name]
        if pod is None:
            raise kubeapi.NotFound(404, "NotFound", f"pods {name!r} not found")
        return json.loads(json.dumps(pod))

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.pods[body["metadata"]["name"]]["spec"]["nodeName"] = body["target"]["name"]
        return {}


def make(
    states: dict[str, Any], best_nodes: int = 1, clock: Clock | None = None, percentage: int = 0
) -> tuple[Extender, Api, dict[str, NodeView]]:
    decider = Decider()
    views = {name: decider.view(nodestate.encode(state)) for name, state in states.items()}
    api = Api()
    reservations = Reservations(600, clock or Clock())
    ext = Extender(
        decider=decider,
        demands=Demands(annotation=ANNOTATION),
        reservations=reservations,
        client=api,
        cache_views=lambda: views,
        settings=Settings(best_nodes=best_nodes, percentage_of_nodes_to_score=percentage),
    )
    ext.ready.set()
    return ext, api, views


def bind(ext: Extender, pod: dict[str, Any], node: str) -> str:
    meta = pod["metadata"]
    doc = {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node}
    return str(ext.bind(doc)["Error"])


def uid(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["uid"])


def test_consecutive_pods_binpacked_onto_one_node_do_not_collide_at_bind() -> None:
    # "full" has room for exactly one more such pod; binpack scores it highest for both.
    states = {
        "full": so.state(ONE_PF, [("old", [("ens1f0", 15_000, 0)])]),
        "idle": so.state(ONE_PF),
    }
    ext, api, _ = make(states)
    a, b = (api.add(so.rdma_pod(name, [(10_000, 0)])) for name in ("a", "b"))
    names = ["idle", "full"]
    assert ext.filter(so.args_names(a, names))["NodeNames"] == ["full"]  # the best node only
    # kube-scheduler's next scheduling cycle runs before a's binding cycle reaches bind.
    out = ext.filter(so.args_names(b, names))
    assert out["NodeNames"] == ["idle"], "b was sent to the node a holds"
    c = api.add(so.rdma_pod("c", [(16_000, 0)]))  # fits nowhere beside a's and b's holds: told why
    assert ext.filter(so.args_names(c, names)) == {
        "Nodes": None,
        "NodeNames": [],
        "FailedNodes": {
            "idle": "rdma-cni: needs 16000 Mbit/s free on one PF with a free VF",
            "full": "rdma-cni: needs 16000 Mbit/s free on one PF with a free VF",
        },
        "FailedAndUnresolvableNodes": {},
        "Error": "",
    }
    assert bind(ext, a, "full") == ""
    assert bind(ext, b, "idle") == ""
    assert ext.reservations.holds() == 0 and len(ext.reservations) == 2


def test_the_best_node_is_the_policy_s_and_the_one_node_that_fits_is_always_found() -> None:
    states = {f"n{i:04d}": so.state(ONE_PF, [(f"u{i}", [("ens1f0", 24_000, 0)])]) for i in range(5_000)}
    states["n4321"] = so.state(ONE_PF)  # the only node with 10 Gbit/s free
    states["n0007"] = so.state(ONE_PF, [("x", [("ens1f0", 12_000, 0)])])  # fits too, and is fuller
    ext, api, _ = make(states)
    names = sorted(states)
    big = api.add(so.rdma_pod("big", [(10_000, 0)]))
    out = ext.filter(so.args_names(big, names))
    # binpack: the fuller of the two that fit; with a node passed, the failed ones are not listed
    assert out["NodeNames"] == ["n0007"] and out["FailedNodes"] == {}
    ext.reservations.add("x2", "team-a", "x2", "n0007", (("ens1f0", 1, 5_000),))
    again = api.add(so.rdma_pod("again", [(10_000, 0)]))
    assert ext.filter(so.args_names(again, names))["NodeNames"] == ["n4321"]  # the one node of 5,000
    assert bind(ext, again, "n4321") == ""
    huge = api.add(so.rdma_pod("huge", [(16_000, 0)]))
    assert len(ext.filter(so.args_names(huge, names))["FailedNodes"]) == 5_000  # fits nowhere: all, why


def test_a_retried_pod_never_meets_its_own_hold() -> None:
    ext, api, _ = make({"only": so.state(ONE_PF, [("old", [("ens1f0", 15_000, 0)])])})
    pod = api.add(so.rdma_pod("p", [(10_000, 0)]))
    assert ext.filter(so.args_names(pod, ["only"]))["NodeNames"] == ["only"]
    assert ext.reservations.held(uid(pod)) is not None
    # Its attempt failed after filter (kube-scheduler retries it): its hold does not count against it.
    assert ext.filter(so.args_names(pod, ["only"]))["NodeNames"] == ["only"]
    other = api.add(so.rdma_pod("q", [(10_000, 0)]))
    assert ext.filter(so.args_names(other, ["only"]))["NodeNames"] == []


def test_holds_never_refuse_a_bind_and_never_over_commit() -> None:
    ext, api, _ = make({"n": so.state(ONE_PF, [("old", [("ens1f0", 15_000, 0)])])})
    a, b = (api.add(so.rdma_pod(name, [(10_000, 0)])) for name in ("a", "b"))
    assert ext.filter(so.args_names(a, ["n"]))["NodeNames"] == ["n"]  # a holds the last 10 Gbit/s
    # b's bind (kube-scheduler placed it on an older answer) is decided on reservations alone...
    assert bind(ext, b, "n") == ""
    # ...and a's, when it comes, finds b's reservation: refused, the node is never over-committed.
    assert "no longer fits" in bind(ext, a, "n")
    assert ext.reservations.held(uid(a)) is None  # a refused bind ends the hold: a is filtered afresh
    assert [r.name for r in ext.reservations.all()] == ["b"]


def test_prioritize_puts_one_node_alone_on_top_and_holds_it() -> None:
    states = {
        "a": so.state(ONE_PF, [("x", [("ens1f0", 5_000, 0)])]),
        "b": so.state(ONE_PF, [("y", [("ens1f0", 5_000, 0)])]),
        "c": so.state(ONE_PF),
    }
    ext, api, _ = make(states, best_nodes=0)  # every fitting node passes: prioritize chooses
    pod = api.add(so.rdma_pod("p", [(10_000, 0)]))
    assert ext.filter(so.args_names(pod, ["c", "b", "a"]))["NodeNames"] == ["c", "b", "a"]
    scores = {p["Host"]: p["Score"] for p in json.loads(ext.prioritize(so.args_names(pod, ["c", "b", "a"])))}
    # a and b tie (binpack: 60% used after the pod); the first in the filter's order is alone on top.
    assert scores == {"b": 6, "a": 5, "c": 4}
    held = ext.reservations.held(uid(pod))
    assert held is not None and held.node == "b" and held.use == (("ens1f0", 1, 10_000),)
    # kube-scheduler chose another node after all: the reservation lands there, the hold ends.
    assert bind(ext, pod, "c") == ""
    assert ext.reservations.held(uid(pod)) is None and ext.reservations.get(uid(pod)).node == "c"  # type: ignore[union-attr]


def test_prioritize_without_kept_scores_also_puts_one_on_top() -> None:
    """Also when the best score is 0 (spread's on a full node): the top then gets 1."""
    ext, api, _ = make({"a": so.state(ONE_PF), "b": so.state(ONE_PF)}, best_nodes=0)
    pod = api.add(so.rdma_pod("p", [(0, 0)]))
    # No filter before (or a filter of another shape): prioritize judges the nodes itself.
    out = json.loads(ext.prioritize(so.args_names(pod, ["a", "b"])))
    # Both score 2 (one VF of four taken): the first is alone on top, the other one under it.
    assert out == [{"Host": "a", "Score": 2}, {"Host": "b", "Score": 1}]
    assert ext.reservations.held(uid(pod)).node == "a"  # type: ignore[union-attr]


def test_holds_expire_are_bounded_and_only_replace_nothing_bound() -> None:
    clock = Clock()
    res = Reservations(600, clock, hold_ttl=5, holds_max=3)
    use = (("ens1f0", 1, 1_000),)
    for i in range(4):
        res.hold(f"u{i}", "team-a", f"p{i}", "n", use)
    assert res.holds() == 3 and res.held("u0") is None  # the oldest gave way
    assert res.extra("n") == {"ens1f0": (3, 3_000)} and res.extra("n", holds=False) == {}
    assert res.nodes() == frozenset({"n"}) and res.has_node("n")
    res.add("u1", "team-a", "p1", "m", use)  # the bind: the reservation replaces the hold
    assert res.held("u1") is None and res.extra("n") == {"ens1f0": (2, 2_000)}
    assert res.hold("u1", "team-a", "p1", "n", use) is None  # bound: nothing to hold
    assert res.hold("", "team-a", "p", "n", use) is None and res.hold("u9", "team-a", "p", "n", ()) is None
    clock.t += 4
    res.hold("u5", "team-a", "p5", "n", use)
    clock.t += 1.5
    res.expire()
    assert res.held("u2") is None and res.held("u3") is None and res.held("u5") is not None
    assert len(res) == 1  # reservations are not holds
    version = res.version
    assert res.release("u5") is not None and res.version > version and res.release("u5") is None
    assert not res.has_node("n")
    off = Reservations(600, clock, holds_max=0)
    assert off.hold("u", "team-a", "p", "n", use) is None
    with pytest.raises(ValueError):
        Reservations(600, clock, hold_ttl=0)


def test_a_hold_on_a_node_whose_state_changed_meanwhile_is_not_made() -> None:
    ext, api, views = make({"n": so.state(ONE_PF)})
    pod = api.add(so.rdma_pod("p", [(10_000, 0)]))
    demand = ext.demands.of_pod(pod)
    assert demand is not None
    views["n"] = ext.decider.view(nodestate.encode(so.state(ONE_PF, [("x", [("ens1f0", 20_000, 0)])])))
    ext._hold(pod, demand, "n")  # judged on the old state: it no longer fits
    ext._hold(pod, demand, "unknown")
    assert ext.reservations.holds() == 0


def test_full_node_requests_hold_nothing() -> None:
    ext, api, _ = make({"n": so.state(ONE_PF)})
    pod = api.add(so.rdma_pod("p", [(1_000, 0)]))
    nodes = [so.node("n", nodestate.encode(so.state(ONE_PF)))]
    assert wire.parse_filter(so.args_nodes(pod, nodes)).node_names is None
    assert [wire.node_name(n) for n in ext.filter(so.args_nodes(pod, nodes))["Nodes"]["items"]] == ["n"]
    assert json.loads(ext.prioritize(so.args_nodes(pod, nodes))) == [{"Host": "n", "Score": 2}]
    assert ext.reservations.holds() == 0  # a request body's nodes are never held on


def test_a_best_score_of_zero_is_raised_to_one() -> None:
    decider = Decider(policy="spread")
    states = {name: so.state(ONE_PF, [("x", [("ens1f0", 24_000, 0)])]) for name in ("a", "b")}
    views = {name: decider.view(nodestate.encode(state)) for name, state in states.items()}
    ext = Extender(
        decider=decider,
        demands=Demands(annotation=ANNOTATION),
        reservations=Reservations(600),
        cache_views=lambda: views,
        settings=Settings(best_nodes=0),
    )
    ext.ready.set()
    pod = so.rdma_pod("p", [(1_000, 0)])  # the nodes are full after it: spread scores both 0
    assert json.loads(ext.prioritize(so.args_names(pod, ["b", "a"]))) == [{"Host": "b", "Score": 1}]


TWO_PF = [("ens1f0", 25_000, 4), ("ens1f1", 25_000, 4)]


def test_bind_reserves_the_pfs_its_hold_took() -> None:
    ext, api, views = make({"n": so.state(TWO_PF)})
    pod = api.add(so.rdma_pod("p", [(15_000, 0)]))
    demand = ext.demands.of_pod(pod)
    assert demand is not None
    fresh = ext.decider.use(demand, views["n"])
    other = "ens1f1" if fresh[0][0] == "ens1f0" else "ens1f0"
    # Its filter placed it on the other PF (other pods' holds were there then; they are gone now):
    # later filters were judged with that PF taken, so that is what bind reserves.
    ext.reservations.hold(uid(pod), "team-a", "p", "n", ((other, 1, 15_000),), views["n"])
    assert bind(ext, pod, "n") == ""
    assert ext.reservations.get(uid(pod)).use == ((other, 1, 15_000),)  # type: ignore[union-attr]


def test_bind_places_afresh_when_the_hold_no_longer_applies() -> None:
    ext, api, views = make({"n": so.state(TWO_PF), "m": so.state(TWO_PF)})
    a, b, c, d = (api.add(so.rdma_pod(name, [(15_000, 0)])) for name in ("a", "b", "c", "d"))
    demand = ext.demands.of_pod(a)
    assert demand is not None
    fresh = ext.decider.use(demand, views["n"])
    other = "ens1f1" if fresh[0][0] == "ens1f0" else "ens1f0"
    held = ((other, 1, 15_000),)
    ext.reservations.hold(uid(a), "team-a", "a", "m", held, views["m"])  # held on another node
    ext.reservations.hold(uid(b), "team-a", "b", "n", held, object())  # on a state since replaced
    ext.reservations.hold(uid(d), "team-a", "d", "n", (("gone", 1, 1),), views["n"])  # a PF not there
    for pod in (a, b, d):
        assert bind(ext, pod, "n") == ""
        assert ext.reservations.get(uid(pod)).use == fresh  # type: ignore[union-attr]
        ext.reservations.drop(uid(pod), "test")
    ext.reservations.add("x", "team-a", "x", "n", held)
    ext.reservations.hold(uid(c), "team-a", "c", "n", held, views["n"])  # its PF has no room left now
    assert bind(ext, c, "n") == ""
    assert ext.reservations.get(uid(c)).use == fresh  # type: ignore[union-attr]


def test_without_best_nodes_a_lone_node_is_not_held_by_filter() -> None:
    ext, api, _ = make({"n": so.state(ONE_PF)}, best_nodes=0)
    pod = api.add(so.rdma_pod("p", [(10_000, 0)]))
    assert ext.filter(so.args_names(pod, ["n"]))["NodeNames"] == ["n"]
    assert ext.reservations.holds() == 0
    # Its prioritize (kube-scheduler asks it only with several nodes) still holds its top node.
    json.loads(ext.prioritize(so.args_names(pod, ["n"])))
    assert ext.reservations.held(uid(pod)).node == "n"  # type: ignore[union-attr]


def test_bind_reads_the_pod_from_the_api_servers_cache_and_from_etcd_only_when_the_cache_trails() -> None:
    ext, api, _ = make({"a": so.state(ONE_PF), "b": so.state(ONE_PF), "c": so.state(ONE_PF)})
    plain = api.add(so.rdma_pod("plain", [(10_000, 0)]))
    assert bind(ext, plain, "a") == "" and api.reads == ["cache"]
    # Created a moment ago: not in the cache yet (404), read again from etcd and bound.
    new = api.add(so.rdma_pod("new", [(10_000, 0)]))
    api.cached["new"] = None
    api.reads.clear()
    assert bind(ext, new, "b") == "" and api.reads == ["cache", "etcd"]
    # Replaced under the same name: the cache still has the old pod (another uid), etcd the new one.
    again = api.add(so.rdma_pod("again", [(10_000, 0)]))
    api.cached["again"] = {**again, "metadata": {**again["metadata"], "uid": "the-old-pod"}}
    api.reads.clear()
    assert bind(ext, again, "c") == "" and api.reads == ["cache", "etcd"]
    assert api.pods["again"]["spec"]["nodeName"] == "c"


def test_reservations_expire_oldest_first_a_renewed_one_last() -> None:
    clock = Clock()
    res = Reservations(30, clock)
    use = (("ens1f0", 1, 1_000),)
    res.add("a", "team-a", "a", "n1", use)
    clock.t += 10
    res.add("b", "team-a", "b", "n1", use)
    clock.t += 10
    res.add("a", "team-a", "a", "n2", use)  # a bind again: its TTL starts over
    clock.t += 25  # b (made 35 s ago) is past its 30 s, a (25 s) is not
    assert [r.uid for r in res.expire()] == ["b"]
    assert res.get("a") is not None and res.get("b") is None
    clock.t += 20
    assert [r.uid for r in res.expire()] == ["a"] and len(res) == 0


def test_what_a_node_holds_is_one_object_until_it_changes() -> None:
    res = Reservations(600, Clock())
    held_on = res.held_on()
    assert held_on("n1") is None and res.extra("n1") == {}
    res.add("a", "team-a", "a", "n1", (("ens1f0", 1, 1_000),))
    first = held_on("n1")
    assert first == {"ens1f0": (1, 1_000)} and held_on("n1") is first and res.extra("n1") is first
    res.hold("h", "team-a", "h", "n1", (("ens1f0", 1, 500), ("ens1f1", 1, 0)))
    second = held_on("n1")
    assert second is not first and second == {"ens1f0": (2, 1_500), "ens1f1": (1, 0)}
    assert first == {"ens1f0": (1, 1_000)}  # never changed once built
    # Bind's view leaves out holds and the pod bound; neither changes what filter looks up.
    assert res.extra("n1", without=("a",), holds=False) == {}
    assert res.extra("n1", holds=False) == {"ens1f0": (1, 1_000)} and held_on("n1") is second
    res.release("h")
    res.drop("a", "test")
    assert held_on("n1") is None and not res.has_node("n1") and res.nodes() == frozenset()
