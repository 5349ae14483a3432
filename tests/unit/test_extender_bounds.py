"""What one pod can make the extender spend: answer bytes, memory, steps and time (issue 29 items 2, 3, 5).

Each test names the bound it checks; each fails on the code before its fix.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from rdma_cni.extender import decide, demand, verbs, wire
from rdma_cni.extender.decide import Abandoned, Deadline, Decider, NodeView
from rdma_cni.extender.demand import Demands
from rdma_cni.extender.reservations import Reservations
from rdma_cni.extender.settings import Settings
from rdma_cni.extender.verbs import Extender
from rdma_cni.shared import nodestate, placement
from rdma_cni.shared.podrequest import parse_request
from tests.support import sched_objects as so

NETWORKS = "k8s.v1.cni.cncf.io/networks"
NODES = 5_000


def make(nodes: int = NODES, *, http_timeout: float = 10.0, vfs: int = 64) -> tuple[Extender, list[str]]:
    """An extender whose cache holds ``nodes`` nodes, each in its own PF state (no verdict is shared)."""
    decider = Decider(max_state_age=600)
    views: dict[str, NodeView] = {}
    names = [f"node-{i:05d}" for i in range(nodes)]
    for i, name in enumerate(names):
        # A different capacity per node: a different fingerprint, so caching cannot help.
        state = so.state([("ens1f0", 100_000 + i, vfs), ("ens1f1", 25_000, vfs)])
        views[name] = decider.view(nodestate.encode(state))
    ext = Extender(
        decider=decider,
        demands=Demands(
            annotation="rdma_interfaces_required",
            networks=frozenset({"rdma-a", "rdma-b"}),
            default_request=parse_request("[{}]", "--default-request"),
        ),
        reservations=Reservations(600),
        cache_views=lambda: views,
        settings=Settings(http_timeout=http_timeout),
    )
    ext.ready.set()
    return ext, names


def filter_bytes(ext: Extender, pod: dict[str, Any], names: list[str]) -> tuple[bytes, float]:
    started = time.perf_counter()
    answer = ext.filter_encoded(so.args_names(pod, names))
    took = time.perf_counter() - started
    body = answer if isinstance(answer, bytes) else json.dumps(answer, separators=(",", ":")).encode()
    return body, took


# -- item 2: answers


def test_an_oversized_name_at_5000_nodes_is_one_short_error() -> None:
    # Was 301 MB: the parser's message (quoting all 60,000 characters) on each of 5,000 nodes.
    ext, names = make()
    pod = so.pod("p", {"rdma_interfaces_required": json.dumps([{"name": "x" * 60_000}])})
    body, _ = filter_bytes(ext, pod, names)
    assert len(body) < 2 * wire.MAX_REASON, len(body)
    out = json.loads(body)
    assert out["FailedAndUnresolvableNodes"] == {} and out["Error"].startswith("rdma-cni: pod team-a/p")
    # Bounded twice over: the parser quotes the name by its prefix and length, the answer clips the rest.
    assert "entry 0.name" in out["Error"] and "x" * 100 not in out["Error"]


def test_every_reason_in_a_filter_answer_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    # Defence in depth: whatever a reason quotes, an answer is at most nodes x (name + MAX_REASON).
    ext, names = make(1_000)
    long = decide.Verdict(False, True, "rdma-cni: " + "y" * 100_000, 0)
    monkeypatch.setattr(Decider, "admit_all", lambda self, demand, views, *args, **kw: [long] * len(views))
    for pod in (so.rdma_pod("p", [(0, 0)]), so.rdma_pod("q", [(1, 0)])):
        body, _ = filter_bytes(ext, pod, names)
        assert len(body) <= len(names) * (len(names[0]) + wire.MAX_REASON + 8), len(body)
        reasons = json.loads(body)["FailedAndUnresolvableNodes"].values()
        assert {len(r) // 10 for r in reasons} == {wire.MAX_REASON // 10}
    full = ext.filter(so.args_nodes(so.rdma_pod("r", [(0, 0)]), [so.node("n", None)]))
    assert wire.MAX_REASON - 10 < len(full["FailedAndUnresolvableNodes"]["n"]) <= wire.MAX_REASON


def test_clip_keeps_short_texts_and_says_what_it_cut() -> None:
    assert wire.clip("short") == "short"
    long = wire.clip("z" * 5_000)
    assert len(long) == wire.MAX_REASON and long.endswith(" characters cut]")
    assert wire.bind_result("e" * 9_999)["Error"] == wire.clip("e" * 9_999)


# -- item 3: one budget, no repeated work, abandoned when the caller has gone


def test_the_attachments_of_a_pod_share_one_step_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each placement "spends" 600 steps: the second attachment gets what is left, the third one step.
    seen: list[int | None] = []

    def spend(requests: Any, pfs: Any, *, max_steps: int | None = None, **kw: Any) -> placement.Placement:
        seen.append(max_steps)
        if max_steps == 1:
            raise placement.NoFit(
                "gave up",
                reason="search_limit",
                requested=(),
                free_vfs=0,
                free_mbps={},
                largest_unplaced=None,
            )
        return placement.Placement(tuple(pf.name for pf, _ in zip(pfs, requests, strict=False)), steps=600)

    monkeypatch.setattr(placement, "place", spend)
    decider = Decider()
    view = decider.view(nodestate.encode(so.state([("a", 100_000, 8), ("b", 100_000, 8)])))
    parts = [("rdma-a", parse_request('[{"min_tx_rate": 1}]', "s"), "s")] * 2
    last = '{"interfaces": [{"min_tx_rate": 2}, {"min_tx_rate": 3}], "different_pfs": true}'
    parts += [("rdma-b", parse_request(last, "s"), "s")]
    got = decider.verdict(demand.Demand.joint(parts), view)
    assert seen[:2] == [placement.DEFAULT_MAX_STEPS, placement.DEFAULT_MAX_STEPS - 600]
    assert not got.fits and got.exhausted


def test_repeated_selections_of_one_network_cost_no_placement_per_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 30 selections of rdma-a on 5,000 different states: one check per state, not 29 placements.
    ext, names = make()
    calls = []
    real = placement.place
    monkeypatch.setattr(placement, "place", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    pod = so.pod("p", {NETWORKS: ",".join(["rdma-a"] * 30)})
    out = json.loads(filter_bytes(ext, pod, names)[0])
    assert len(out["NodeNames"]) == NODES and not calls
    # And the same answer as the ADDs one by one would give, where a node has fewer VFs than asked.
    few = so.pod("q", {NETWORKS: ",".join(["rdma-a"] * 30)})
    small, small_names = make(3, vfs=10)
    assert json.loads(filter_bytes(small, few, small_names)[0])["NodeNames"] == []


def test_a_pod_asking_more_than_any_node_has_fails_in_one_pass() -> None:
    # 3,000 selections of one network (whatever bound the reader puts on them) at 5,000 states.
    ext, names = make()
    pod = so.pod("p", {NETWORKS: ",".join(["rdma-a", "rdma-b"] * 1_500)})
    body, took = filter_bytes(ext, pod, names)
    assert took < ext.settings.decision_timeout + 1.0, took
    out = json.loads(body)
    # Answered, not abandoned: refused outright (a bound on attachments) or by the whole pod's count.
    assert "took too long" not in out["Error"]
    if not out["Error"]:
        assert not out["NodeNames"] and set(out["FailedNodes"]) | set(
            out["FailedAndUnresolvableNodes"]
        ) == set(names)
        assert "needs 3000 free VFs" in next(iter(out["FailedAndUnresolvableNodes"].values()))
    # The key does not grow with the count: the same run is one entry.
    one = ext.demands.of_pod(so.pod("r", {NETWORKS: "rdma-a,rdma-a"}))
    many = ext.demands.of_pod(so.pod("s", {NETWORKS: ",".join(["rdma-a"] * 20)}))
    assert one is not None and many is not None and len(one.key) == len(many.key) == 1


def test_a_filter_past_its_deadline_is_abandoned_and_its_progress_kept() -> None:
    ext, names = make(http_timeout=0.2)
    # Constrained requests on two networks: no fast path, a placement per attachment per state.
    pod = so.pod(
        "p",
        {
            NETWORKS: "rdma-a,rdma-b," * 10,
            "rdma_interfaces_required": json.dumps(
                {"interfaces": [{"min_tx_rate": 700}, {"min_tx_rate": 300}], "different_pfs": True}
            ),
        },
    )
    body, took = filter_bytes(ext, pod, names)
    assert took < 0.2 + 0.5, took
    assert "took too long" in json.loads(body)["Error"]
    got = ext.demands.of_pod(pod)
    assert got is not None
    judged = len(ext.decider.table(got))
    assert 0 < judged < NODES
    # The caller gone (its connection closed) ends it at once, too.
    with pytest.raises(Abandoned):
        ext._judge(got, names, [ext.view_of(n) for n in names], Deadline(60, gone=lambda: True))


def test_a_deadline_with_time_left_changes_nothing() -> None:
    deadline = Deadline(60)
    deadline.check()
    decide.NEVER.check()
    with pytest.raises(Abandoned, match="within 0 s"):
        Deadline(0).check()


# -- item 5: request-fed caches bounded in bytes


def test_the_request_memo_is_bounded_in_bytes() -> None:
    # 3,000 distinct valid 60 KB annotations once left +176 MiB resident.
    demands = Demands(annotation="rdma_interfaces_required")
    for i in range(3_000):
        text = "[{}]" + " " * (60_000 + i)
        demands.of_pod(so.pod(f"p{i}", {"rdma_interfaces_required": text}))
    assert demands._memo.weight <= demand._MEMO_BYTES
    assert len(demands._memo) <= demand._MEMO_BYTES // 60_000


def test_kept_scores_are_bounded_in_bytes() -> None:
    # 1,024 pods' scores at 5,000 nodes could hold ~1 GiB; a byte bound keeps far fewer.
    ext, names = make()
    for i in range(300):
        # Distinct large valid annotations, one shape: each filter answered from the kept answer.
        text = '[{"min_tx_rate": 1}]' + " " * (60_000 + i)
        pod = so.pod(f"p{i}", {"rdma_interfaces_required": text}, uid=f"uid-{i}")
        ext.filter_encoded(so.args_names(pod, names))
    assert ext._scores.weight <= verbs._SCORES_BYTES
    assert len(ext._scores) < 300


# -- style: one settings object, one per-node rule


def test_every_option_is_a_setting_and_reaches_the_parts() -> None:
    from dataclasses import fields

    from rdma_cni.extender.options import parser, settings
    from rdma_cni.extender.settings import flag_of

    options = {f.name for f in fields(Settings) if flag_of(f) is not None}
    assert {a.dest for a in parser()._actions if a.dest != "help"} == options
    got = settings(
        ["--listen", "127.0.0.1:0", "--http-timeout", "4", "--networks", "a, b", "--policy", "spread"]
    )
    assert got.http_timeout == 4 and got.decision_timeout == 2 and got.networks == frozenset({"a", "b"})
    assert got.default_request is not None  # a network without a request gets [{}]
    decider = Decider(settings=got)
    assert decider.policy == "spread" and decider.settings is got
    with pytest.raises(SystemExit):
        settings(["--listen", "127.0.0.1:0", "--http-timeout", "9999"])


def test_a_prioritize_past_its_deadline_scores_nothing() -> None:
    ext, names = make(600)
    pod = so.pod("p", {NETWORKS: "rdma-a,rdma-b," * 8, "rdma_interfaces_required": '[{"min_tx_rate": 5}]'})
    assert ext.prioritize(so.args_names(pod, names), Deadline(0)) == b"[]"
    assert json.loads(ext.prioritize(so.args_names(pod, names[:3])))  # with time left: scores


def test_a_bind_refusal_quoting_the_pod_is_capped() -> None:
    ext, names = make(2)

    class Api:
        def get(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
            pod = so.pod("p", {"rdma_interfaces_required": json.dumps([{"name": "x" * 60_000}])}, uid="u")
            return pod

    from rdma_cni.extender.bind import Binder
    from rdma_cni.extender.wire import BindArgs

    binder = Binder(Api(), ext.decider, ext.demands, ext.reservations, ext.view_of)
    error = binder.bind(BindArgs("p", "team-a", "u", names[0]))
    assert error.startswith("rdma-cni: pod team-a/p annotation") and len(error) <= wire.MAX_REASON
