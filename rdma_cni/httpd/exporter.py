"""Prometheus ``/metrics`` for the long-running components: what the node agent and the extender share.

Each component keeps its own registry and metrics (:mod:`rdma_cni.agent.metrics`,
:mod:`rdma_cni.extender.metrics`); this module holds what they do alike: a
collector slot that reads a running object at scrape time (watching a new
object replaces the old), serving a registry on a port of its own, and the
``ADDR:PORT`` option naming that port. ``prometheus_client`` is imported only
to serve: ``rdma-cni install`` parses its options with the standard library.

The page is served by the extender's own bounded listener
(:mod:`rdma_cni.httpd.serve`: a connection cap, a deadline per phase), not by
``prometheus_client``'s server, which keeps a thread per connection for as
long as the client holds it; ``prometheus_client`` only renders the page.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


class CollectorSlot:
    """At most one collector of ``registry`` at a time: watching another replaces it."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self.collector: Any = None

    def watch(self, collector: Any) -> None:
        """Register ``collector``, unregistering the one watched before (if any)."""
        if self.collector is not None:
            self.registry.unregister(self.collector)
        self.collector = collector
        self.registry.register(collector)


# Scrapers are few (one or two Prometheus replicas, an operator's curl): a small cap. A scraper that has
# been answered once is never pushed out by connections that stall; the deadlines are the extender's.
MAX_CONNECTIONS = 16


def serve(
    registry: Any, address: tuple[str, int], *, max_connections: int = MAX_CONNECTIONS, **timeouts: float
) -> Any:
    """Serve ``registry`` on ``address`` in a daemon thread; returns the server (``shutdown()`` stops it).

    ``timeouts`` are :class:`rdma_cni.httpd.serve.BoundedServer`'s (``request_timeout``, ``idle_timeout``).
    """
    import threading

    from rdma_cni.httpd import metricspage

    server = metricspage.MetricsServer(address, registry, max_connections=max_connections, **timeouts)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def address_option(flag: str, example: str) -> Callable[[str], tuple[str, int]]:
    """An argparse ``type`` for ``flag ADDR:PORT`` (an empty address is 0.0.0.0; ``[::1]`` drops brackets)."""

    def parse(value: str) -> tuple[str, int]:
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise argparse.ArgumentTypeError(f"{flag} {value!r}: expected ADDR:PORT, e.g. {example}")
        return host.strip("[]") or "0.0.0.0", int(port)

    return parse
