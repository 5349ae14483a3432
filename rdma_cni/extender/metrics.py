"""The extender's Prometheus metrics, served on their own port (``--metrics-listen``).

Imported by the extender process only: ``prometheus_client`` never enters the
CNI plugin's cold path. Every label has a fixed, small set of values (verbs,
outcomes, refusal reasons); node and pod names never become labels here.
Counters and histograms are updated at the call sites (one line each);
the figures that are states (reservations held, watched nodes, state ages,
watch restarts and relists) are read from the running service at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rdma_cni.httpd import exporter

__all__ = ["REGISTRY", "bind_refused", "decided", "preempted", "request", "serve", "watch"]

REGISTRY = CollectorRegistry(auto_describe=True)

VERBS = frozenset({"filter", "prioritize", "preempt", "bind"})
OUTCOMES = frozenset(
    {"fits", "no_fit", "resample", "not_rdma", "error", "bound", "refused", "kept", "none_kept"}
)
# Why bind refused a pod: the reason label of the refusal counter and of the pod's Event.
REFUSAL_REASONS = frozenset(
    {
        "not_ready",
        "bad_request",
        "unknown_node",
        "pod_unreadable",
        "pod_replaced",
        "other_scheduler",
        "already_bound",
        "bad_annotation",
        "no_pod_uid",
        "state_unusable",
        "no_fit",
        "api_refused",
        "outcome_unknown",
    }
)

_LATENCY = Histogram(
    "rdma_cni_extender_request_seconds",
    "Time to answer an extender request, by verb (body read to answer written)",
    ["verb"],
    registry=REGISTRY,
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
_DECISIONS = Counter(
    "rdma_cni_extender_decisions_total",
    "Answers by verb and outcome (fits/no_fit/not_rdma/error for filter; bound/refused for bind; "
    "kept/none_kept/not_rdma/error for preempt)",
    ["verb", "outcome"],
    registry=REGISTRY,
)
_REFUSALS = Counter(
    "rdma_cni_extender_bind_refusals_total",
    "Binds refused, by reason",
    ["reason"],
    registry=REGISTRY,
)
_PREEMPT_NODES = Counter(
    "rdma_cni_extender_preempt_nodes_total",
    "Nodes proposed to preempt, and those kept (evicting their victims makes the pod fit)",
    ["answer"],
    registry=REGISTRY,
)


# Children looked up once: labels() takes a lock and builds a tuple per call, on the filter path.
_LATENCY_BY_PATH = {f"/{verb}": _LATENCY.labels(verb) for verb in VERBS}
_DECISIONS_BY_KEY: dict[tuple[str, str], Any] = {}


def request(path: str, seconds: float) -> None:
    """A request to ``path`` was answered in ``seconds``."""
    child = _LATENCY_BY_PATH.get(path.rstrip("/"))
    (child if child is not None else _LATENCY.labels("other")).observe(seconds)


def decided(verb: str, outcome: str) -> None:
    """One answer of ``verb`` with ``outcome`` (one of :data:`OUTCOMES`)."""
    child = _DECISIONS_BY_KEY.get((verb, outcome))
    if child is None:
        key = (verb if verb in VERBS else "other", outcome if outcome in OUTCOMES else "other")
        child = _DECISIONS_BY_KEY[(verb, outcome)] = _DECISIONS.labels(*key)
    child.inc()


def bind_refused(reason: str) -> None:
    """A bind was refused for ``reason`` (one of :data:`REFUSAL_REASONS`)."""
    _REFUSALS.labels(reason if reason in REFUSAL_REASONS else "other").inc()
    decided("bind", "refused")


def preempted(proposed: int, kept: int, outcome: str | None = None) -> None:
    """A preempt answer: ``proposed`` nodes came in, ``kept`` went back."""
    _PREEMPT_NODES.labels("proposed").inc(proposed)
    _PREEMPT_NODES.labels("kept").inc(kept)
    decided("preempt", outcome or ("kept" if kept else "none_kept"))


class _ServiceCollector(Collector):
    """The states of a running :class:`rdma_cni.extender.service.Service`, read at scrape time."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        service = self.service
        views = service.cache.views  # one dict: replaced wholesale, never mutated mid-read by a relist
        yield GaugeMetricFamily(
            "rdma_cni_extender_reservations",
            "Reservations held (bound, not yet published by the node)",
            value=len(service.reservations),
        )
        yield GaugeMetricFamily(
            "rdma_cni_extender_watched_nodes", "Nodes in the watched node cache", value=len(views)
        )
        stamps = [
            view.updated for view in list(views.values()) if view.state is not None and view.updated > 0
        ]
        now = time.time()
        ages = GaugeMetricFamily(
            "rdma_cni_extender_node_state_age_seconds",
            "Age of the freshest and the stalest node state in the cache (by its updated stamp)",
            labels=["which"],
        )
        if stamps:
            ages.add_metric(["freshest"], max(0.0, now - max(stamps)))
            ages.add_metric(["stalest"], max(0.0, now - min(stamps)))
        yield ages
        yield CounterMetricFamily(
            "rdma_cni_extender_watch_restarts",
            "Node list/watch failures followed by a reconnect",
            value=service.cache.reconnects,
        )
        yield CounterMetricFamily(
            "rdma_cni_extender_relists",
            "Full lists of Nodes (start-up and 410 Gone)",
            value=service.cache.relists,
        )
        retrier = service.retrier
        yield GaugeMetricFamily(
            "rdma_cni_extender_refused_pods",
            "Pods the filter refused for want of room, remembered to be retried when a node has room",
            value=len(retrier),
        )
        retries = CounterMetricFamily(
            "rdma_cni_extender_retries",
            "Refused pods a node had room for, by what became of them (retried: kube-scheduler was made "
            "to retry the pod; gone, bound: nothing to do; no_room: room taken again before the write; "
            "changed: the pod changed meanwhile; failed: the API refused)",
            labels=["outcome"],
        )
        for outcome, count in retrier.outcomes.items():
            retries.add_metric([outcome], count)
        yield retries
        yield GaugeMetricFamily(
            "rdma_cni_extender_ready",
            "1 once the node cache is synced and reservations rebuilt",
            value=1.0 if service.extender.ready.is_set() else 0.0,
        )
        yield from _certificates(service.serving_tls)


def _certificates(tls: Any) -> Iterator[Any]:
    """The expiry of each certificate the mutual-TLS extender depends on, and how its reloads went
    (extender/certs.py); nothing without TLS (the sidecar on loopback has no certificate)."""
    if tls is None:
        return
    expiry = GaugeMetricFamily(
        "rdma_cni_extender_certificate_expiry_timestamp_seconds",
        "Unix time at which a certificate ends: serving (this extender's, as served), client_ca (the "
        "earliest of --client-ca), client (the one kube-scheduler last presented)",
        labels=["certificate"],
    )
    for name, seconds in sorted(tls.expiry.items()):
        expiry.add_metric([name], seconds)
    yield expiry
    reloads = CounterMetricFamily(
        "rdma_cni_extender_certificate_reloads",
        "Reloads of the TLS files after they changed, by outcome (loaded, failed: the previous "
        "certificate is still served)",
        labels=["outcome"],
    )
    for outcome, count in sorted(tls.reloads.items()):
        reloads.add_metric([outcome], count)
    yield reloads
    yield GaugeMetricFamily(
        "rdma_cni_extender_certificate_reload_failed",
        "1 while the TLS files changed but do not load: the previous certificate is still served",
        value=1.0 if tls.failing else 0.0,
    )


_SLOT = exporter.CollectorSlot(REGISTRY)


def watch(service: Any) -> None:
    """Report the states of ``service`` (replacing a service watched before)."""
    _SLOT.watch(_ServiceCollector(service))


def serve(address: tuple[str, int]) -> Any:
    """Serve ``/metrics`` on ``address`` in a daemon thread; returns the server (``shutdown()`` stops it)."""
    return exporter.serve(REGISTRY, address)
