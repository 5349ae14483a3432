"""The node agent's Prometheus metrics, served on their own port (``rdma-cni install --metrics-listen``).

Imported by the agent only (``rdma-cni install --watch --node-state``): never
on the CNI plugin's cold path. Labels: the publish outcome, the API client's
error class (a fixed set), and per PF gauges labelled by this node's name and
the PF's name, read at scrape time from the state last published, so the
figures are exactly what the extender sees.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rdma_cni.httpd import exporter

__all__ = ["REGISTRY", "api_error", "orphans_released", "publish_done", "serve", "watch", "watch_nri"]

REGISTRY = CollectorRegistry(auto_describe=True)

OUTCOMES = frozenset({"written", "unchanged", "failed"})
# rdma_cni.kube.client's error classes.
ERROR_CLASSES = frozenset({"NotFound", "Conflict", "Gone", "Invalid", "Unavailable", "ApiError"})

_SECONDS = Histogram(
    "rdma_cni_agent_publish_seconds",
    "Time of a publish attempt (read of the Node when needed, then the merge patch)",
    registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
_PUBLISHES = Counter(
    "rdma_cni_agent_publishes_total",
    "Publish attempts by outcome (written, unchanged: nothing to write, failed)",
    ["outcome"],
    registry=REGISTRY,
)
_LAST_SUCCESS = Gauge(
    "rdma_cni_agent_last_publish_timestamp_seconds",
    "Unix time of the last successful write of the node state",
    registry=REGISTRY,
)
_API_ERRORS = Counter(
    "rdma_cni_agent_api_errors_total",
    "API errors while publishing, by class (NotFound, Conflict, Gone, Invalid, Unavailable, ApiError)",
    ["class"],
    registry=REGISTRY,
)


_ORPHANS_RELEASED = Counter(
    "rdma_cni_agent_orphans_released_total",
    "Attachments released in this boot because their pod network namespace was gone and their VFs "
    "back in the host though no DEL came (a DEL lost by another component: rdma_cni.node.orphans)",
    registry=REGISTRY,
)


def orphans_released(count: int) -> None:
    """``count`` attachments were released by the same-boot pass (:mod:`rdma_cni.agent.orphanpass`)."""
    _ORPHANS_RELEASED.inc(count)


def publish_done(outcome: str, started: float) -> None:
    """A publish attempt begun at ``started`` (time.monotonic) ended with ``outcome``."""
    _SECONDS.observe(time.monotonic() - started)
    _PUBLISHES.labels(outcome if outcome in OUTCOMES else "other").inc()
    if outcome == "written":
        _LAST_SUCCESS.set(time.time())


def api_error(exc: Exception) -> None:
    """Count an API error by its class."""
    name = type(exc).__name__
    _API_ERRORS.labels(name if name in ERROR_CLASSES else "other").inc()


class _PublisherCollector(Collector):
    """Per PF gauges from what a :class:`rdma_cni.agent.publish.Publisher` last wrote."""

    def __init__(self, publisher: Any) -> None:
        self.publisher = publisher

    def collect(self) -> Iterator[Any]:
        state = self.publisher.published
        node = self.publisher.node
        families = {
            "capacity_mbps": GaugeMetricFamily(
                "rdma_cni_node_pf_capacity_mbps", "PF capacity in Mbit/s, as published", labels=["node", "pf"]
            ),
            "used_mbps": GaugeMetricFamily(
                "rdma_cni_node_pf_used_mbps",
                "Sum of min_tx_rate held on the PF, as published",
                labels=["node", "pf"],
            ),
            "capacity_vfs": GaugeMetricFamily(
                "rdma_cni_node_pf_capacity_vfs",
                "VFs ADD may hand out on the PF, held or not",
                labels=["node", "pf"],
            ),
            "used_vfs": GaugeMetricFamily(
                "rdma_cni_node_pf_used_vfs", "VFs held by pods", labels=["node", "pf"]
            ),
        }
        for pf in state.pfs if state is not None else ():
            labels = [node, pf.name]
            if pf.capacity_tx_rate is not None:
                families["capacity_mbps"].add_metric(labels, pf.capacity_tx_rate)
            families["used_mbps"].add_metric(labels, pf.used_tx_rate)
            families["capacity_vfs"].add_metric(labels, pf.capacity_vfs)
            families["used_vfs"].add_metric(labels, pf.used_vfs)
        yield from families.values()


class _ServingCollector(Collector):
    """Which of the parts a second agent on the node waits for this agent holds (rdma_cni.agent.takeover)."""

    def collect(self) -> Iterator[Any]:
        from rdma_cni.agent.takeover import HELD

        family = GaugeMetricFamily(
            "rdma_cni_agent_serving",
            "1 when this agent holds the part (cni: the CNI server's socket, metrics: this port, nri: the "
            "NRI registration), 0 while another agent on the node still does",
            labels=["part"],
        )
        for part, held in sorted(HELD.items()):
            family.add_metric([part], 1 if held else 0)
        yield family


class _NriCollector(Collector):
    """Whether the agent's NRI plugin is registered with the runtime (it gives pods their RDMA devices).

    ``rdma_cni_agent_serving{part="nri"}`` says only that this agent, not another on the node, may
    register; this says it did. 0 while the runtime has no NRI socket, is restarting, or refused the
    plugin: pods created meanwhile get no ``/dev/infiniband`` from rdma-cni. Absent when NRI is off
    (``--nri-socket=``): nothing is expected then.
    """

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin

    def collect(self) -> Iterator[Any]:
        from rdma_cni.node.nristate import REGISTERED

        yield GaugeMetricFamily(
            "rdma_cni_agent_nri_registered",
            "1 while the agent's NRI plugin is registered with the container runtime, 0 otherwise",
            value=1.0 if self.plugin.state == REGISTERED else 0.0,
        )


REGISTRY.register(_ServingCollector())
_SLOT = exporter.CollectorSlot(REGISTRY)
_NRI_SLOT = exporter.CollectorSlot(REGISTRY)


def watch_nri(plugin: Any) -> None:
    """Report whether ``plugin`` (an :class:`rdma_cni.agent.nri.plugin.NriPlugin`) is registered."""
    _NRI_SLOT.watch(_NriCollector(plugin))


def watch(publisher: Any) -> None:
    """Report the PFs of what ``publisher`` wrote (replacing a publisher watched before)."""
    _SLOT.watch(_PublisherCollector(publisher))


def serve(address: tuple[str, int]) -> Any:
    """Serve ``/metrics`` on ``address`` in a daemon thread; returns the server (``shutdown()`` stops it)."""
    return exporter.serve(REGISTRY, address)
