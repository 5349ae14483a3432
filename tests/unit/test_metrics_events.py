"""Metrics and Events of the extender and the node agent, scraped and read back from the API stand-in.

Each test does real work against tests/support/apiserver.py (filters, binds,
preempts, publishes), scrapes the process's /metrics over HTTP and checks the
figures against what was done. The registries are per process and shared by
the tests of this session, so counters are compared as differences.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rdma_cni.agent import metrics as agent_metrics
from rdma_cni.agent.publish import Publisher
from rdma_cni.kube import client as kubeapi
from rdma_cni.kube.events import EventSink
from rdma_cni.shared import nodestate
from tests.support import sched_objects as so
from tests.support.apiserver import ApiServer
from tests.unit.test_extender_cluster import Harness, wait_for

PFS = [("ens1f0", 25_000, 4), ("ens1f1", 25_000, 4)]


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        yield server


@pytest.fixture
def harness(api: ApiServer, tmp_path: Path) -> Iterator[Harness]:
    h = Harness(api, tmp_path)
    try:
        yield h
    finally:
        h.stop()


def scrape(address: tuple[str, int]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the /metrics page at ``address``: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_extender_metrics_count_what_was_done(harness: Harness, api: ApiServer) -> None:
    harness.add_node("roomy", so.state(PFS, age=5))
    harness.add_node("full", so.state([("ens1f0", 25_000, 1)], [("u0", [("ens1f0", 25_000, 0)])], age=40))
    client = kubeapi.ApiClient.from_kubeconfig(harness.kubeconfig)
    service, sched = harness.start(
        metrics_listen=("127.0.0.1", 0), events=EventSink(client.post, "rdma-cni-extender")
    )
    assert service.metrics_address is not None
    before = scrape(service.metrics_address)
    pods = [harness.add_pod(f"p{i}", [(10_000, 0)]) for i in range(3)]
    for pod in pods:
        assert sched.post("filter", so.args_names(pod, ["roomy", "full"]))["NodeNames"] == ["roomy"]
    plain = api.add_pod("team-a", "plain", {}, scheduler_name="rdma-scheduler")
    sched.post("filter", so.args_names(plain, ["roomy"]))
    sched.post("prioritize", so.args_names(pods[0], ["roomy"]))
    assert sched.bind(pods[0], "roomy") == ""
    refused = sched.bind(pods[1], "full")
    assert "no longer fits node full" in refused
    victims = {"full": {"Pods": [{"UID": "u0"}], "NumPDBViolations": 0}}
    sched.post("preempt", {"Pod": pods[2], "NodeNameToVictims": None, "NodeNameToMetaVictims": victims})
    after = scrape(service.metrics_address)

    assert delta(before, after, "rdma_cni_extender_request_seconds_count", verb="filter") == 4
    assert delta(before, after, "rdma_cni_extender_request_seconds_count", verb="prioritize") == 1
    assert delta(before, after, "rdma_cni_extender_request_seconds_count", verb="bind") == 2
    assert delta(before, after, "rdma_cni_extender_request_seconds_count", verb="preempt") == 1
    assert delta(before, after, "rdma_cni_extender_decisions_total", verb="filter", outcome="fits") == 3
    assert delta(before, after, "rdma_cni_extender_decisions_total", verb="filter", outcome="not_rdma") == 1
    assert delta(before, after, "rdma_cni_extender_decisions_total", verb="bind", outcome="bound") == 1
    assert delta(before, after, "rdma_cni_extender_decisions_total", verb="bind", outcome="refused") == 1
    assert delta(before, after, "rdma_cni_extender_bind_refusals_total", reason="no_fit") == 1
    assert (
        sum(
            delta(before, after, "rdma_cni_extender_bind_refusals_total", reason=r)
            for r in ("not_ready", "unknown_node", "state_unusable", "api_refused")
        )
        == 0
    )
    # Evicting u0 frees the one VF and 25 Gbit/s: the node is kept.
    assert delta(before, after, "rdma_cni_extender_decisions_total", verb="preempt", outcome="kept") == 1
    assert delta(before, after, "rdma_cni_extender_preempt_nodes_total", answer="proposed") == 1
    assert delta(before, after, "rdma_cni_extender_preempt_nodes_total", answer="kept") == 1
    assert value(after, "rdma_cni_extender_reservations") == 1
    assert value(after, "rdma_cni_extender_watched_nodes") == 2
    assert value(after, "rdma_cni_extender_ready") == 1
    freshest = value(after, "rdma_cni_extender_node_state_age_seconds", which="freshest")
    stalest = value(after, "rdma_cni_extender_node_state_age_seconds", which="stalest")
    assert 4 <= freshest < 30 and 39 <= stalest < 70, (freshest, stalest)
    assert value(after, "rdma_cni_extender_relists_total") == 1
    assert value(after, "rdma_cni_extender_watch_restarts_total") == 0
    # The refused pod carries the answer, where `kubectl describe pod` shows it.
    service.events.flush()
    (event,) = api.events()
    assert event["metadata"]["namespace"] == "team-a"
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "p1",
        "namespace": "team-a",
        "uid": pods[1]["metadata"]["uid"],
    }
    assert event["reason"] == "BindingRefused" and event["type"] == "Warning"
    assert event["message"] == f"{refused} [no_fit]"


def test_refused_pods_and_their_retries_are_shown(harness: Harness, api: ApiServer) -> None:
    harness.add_node("full", so.state([("ens1f0", 25_000, 1)], [("u0", [("ens1f0", 25_000, 0)])]))
    service, sched = harness.start(metrics_listen=("127.0.0.1", 0))
    assert service.metrics_address is not None
    pod = harness.add_pod("p", [(10_000, 0)])
    assert not sched.post("filter", so.args_names(pod, ["full"]))["NodeNames"]
    after = scrape(service.metrics_address)
    assert value(after, "rdma_cni_extender_refused_pods") == 1
    for outcome in ("retried", "gone", "bound", "no_room", "changed", "failed"):
        assert ("rdma_cni_extender_retries_total", (("outcome", outcome),)) in after, outcome


def test_watch_restarts_and_relists_are_counted(harness: Harness, api: ApiServer) -> None:
    harness.add_node("n1", so.state(PFS))
    service, _ = harness.start(metrics_listen=("127.0.0.1", 0))
    assert service.metrics_address is not None
    wait_for("a watch", lambda: api.watch_count > 0)
    api.drop_watches()  # the extender reconnects after its backoff ...
    harness.publish("n1", so.state(PFS, generation=2))
    api.compact()  # ... by when the change it missed is out of the history: 410 Gone, a relist
    wait_for("the relist", lambda: service.cache.relists > 1)
    after = scrape(service.metrics_address)
    assert value(after, "rdma_cni_extender_relists_total") == service.cache.relists >= 2
    assert value(after, "rdma_cni_extender_watch_restarts_total") == service.cache.reconnects


def test_a_blocked_event_sink_delays_no_bind(harness: Harness, api: ApiServer) -> None:
    harness.add_node("full", so.state([("ens1f0", 25_000, 1)], [("u0", [("ens1f0", 25_000, 0)])]))
    client = kubeapi.ApiClient.from_kubeconfig(harness.kubeconfig)
    sink = EventSink(client.post, "rdma-cni-extender", capacity=2)
    _, sched = harness.start(events=sink)
    pods = [harness.add_pod(f"p{i}", [(10_000, 0)]) for i in range(6)]
    api.hold_events()  # the API takes every Event and answers none for 60 s
    started = time.monotonic()
    assert "no longer fits" in sched.bind(pods[0], "full")
    # The sender has taken p0's Event and is stuck posting it; then the queue fills.
    wait_for("p0's Event posted", lambda: api.events_held == 1)
    for pod in pods[1:]:
        assert "no longer fits" in sched.bind(pod, "full")
    took = time.monotonic() - started
    # One Event is being posted (held), two wait in the queue, the rest are dropped. A bind
    # that waited on the sink would take the 60 s the API holds the post.
    assert took < 20.0, took
    wait_for("the drops", lambda: sink.dropped == 3)
    api.hold_events(False)
    assert sink.flush()
    assert [e["involvedObject"]["name"] for e in api.events()] == ["p0", "p1", "p2"]


def test_event_sink_rate_limits_by_key(api: ApiServer, tmp_path: Path) -> None:
    client = kubeapi.ApiClient.from_kubeconfig(api.write_kubeconfig(tmp_path / "kubeconfig"))
    now = [1000.0]
    sink = EventSink(client.post, "rdma-cni-agent", min_interval=600.0, clock=lambda: now[0])
    said = [sink.emit(kind="Node", name="n1", reason="R", message="m", key="n1") for _ in range(5)]
    said.append(sink.emit(kind="Node", name="n2", reason="R", message="m", key="n2"))
    now[0] += 599.0
    said.append(sink.emit(kind="Node", name="n1", reason="R", message="m", key="n1"))
    now[0] += 1.0
    said.append(sink.emit(kind="Node", name="n1", reason="R", message="m", key="n1"))
    assert said == [True, False, False, False, False, True, False, True]
    assert sink.flush() and sink.limited == 5
    events = api.events()
    assert [e["involvedObject"]["name"] for e in events] == ["n1", "n2", "n1"]
    # Nodes are cluster-scoped: their events live in "default", as the kubelet's do.
    assert {e["metadata"]["namespace"] for e in events} == {"default"}
    assert all(e["involvedObject"]["kind"] == "Node" for e in events)


@pytest.fixture
def agent_metrics_address() -> Iterator[tuple[str, int]]:
    server = agent_metrics.serve(("127.0.0.1", 0))
    host, port = server.server_address[:2]
    yield str(host), int(port)
    server.shutdown()
    server.server_close()


def test_agent_metrics_and_its_node_event(
    api: ApiServer, tmp_path: Path, agent_metrics_address: tuple[str, int]
) -> None:
    api.add_node("n1")
    client = kubeapi.ApiClient.from_kubeconfig(api.write_kubeconfig(tmp_path / "kubeconfig"))
    publisher = Publisher(client, "n1", min_backoff=0.01, max_backoff=0.02)
    publisher.events = EventSink(client.post, "rdma-cni-agent", host="n1", min_interval=600.0)
    agent_metrics.watch(publisher)
    address = agent_metrics_address
    before = scrape(address)
    state = so.state(
        [("ens1f0", 25_000, 8), ("ens1f1", None, 4)],
        [("u1", [("ens1f0", 10_000, 0), ("ens1f0", 2_000, 0)]), ("u2", [("ens1f1", 0, 0)])],
    )
    publisher.offer(state)
    assert publisher.step()
    publisher.offer(state)
    assert not publisher.step()  # same content: nothing written
    written_at = time.time()
    after = scrape(address)
    assert delta(before, after, "rdma_cni_agent_publishes_total", outcome="written") == 1
    assert delta(before, after, "rdma_cni_agent_publishes_total", outcome="unchanged") == 1
    assert delta(before, after, "rdma_cni_agent_publish_seconds_count") == 2
    assert written_at - 5 < value(after, "rdma_cni_agent_last_publish_timestamp_seconds") <= written_at
    published = nodestate.decode(api.get_node("n1")["metadata"]["annotations"][nodestate.ANNOTATION])
    for pf in published.pfs:
        labels = {"node": "n1", "pf": pf.name}
        assert value(after, "rdma_cni_node_pf_used_mbps", **labels) == pf.used_tx_rate
        assert value(after, "rdma_cni_node_pf_capacity_vfs", **labels) == pf.capacity_vfs
        assert value(after, "rdma_cni_node_pf_used_vfs", **labels) == pf.used_vfs
    assert value(after, "rdma_cni_node_pf_capacity_mbps", node="n1", pf="ens1f0") == 25_000
    assert ("rdma_cni_node_pf_capacity_mbps", (("node", "n1"), ("pf", "ens1f1"))) not in after  # unknown
    assert value(after, "rdma_cni_node_pf_used_vfs", node="n1", pf="ens1f0") == 2

    # The Node is gone: errors by class, failed attempts, and one Node event however many retries.
    api.remove_node("n1")
    publisher.offer(so.state(PFS))
    for _ in range(3):
        time.sleep(0.03)
        publisher.step()
    failed = scrape(address)
    assert delta(after, failed, "rdma_cni_agent_publishes_total", outcome="failed") == 3
    assert delta(after, failed, "rdma_cni_agent_api_errors_total", **{"class": "NotFound"}) == 3
    assert publisher.events.flush()
    (event,) = api.events()
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "n1"}
    assert event["reason"] == "NodeStatePublishFailed" and event["type"] == "Warning"
    assert event["source"] == {"component": "rdma-cni-agent", "host": "n1"}
    assert "NotFound" in event["message"]
    assert publisher.events.limited == 2


def test_agent_nri_registration_gauge(agent_metrics_address: tuple[str, int]) -> None:
    """rdma_cni_agent_nri_registered follows the NRI plugin's state, read at scrape time."""
    from rdma_cni.node.nristate import REGISTERED

    class Plugin:
        state = "not injecting: no NRI socket at /var/run/nri/nri.sock (No such file or directory)"

    plugin = Plugin()
    agent_metrics.watch_nri(plugin)
    assert value(scrape(agent_metrics_address), "rdma_cni_agent_nri_registered") == 0
    plugin.state = REGISTERED
    assert value(scrape(agent_metrics_address), "rdma_cni_agent_nri_registered") == 1
