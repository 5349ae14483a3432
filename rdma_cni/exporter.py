"""Prometheus ``/metrics`` for the long-running components: what the node agent and the extender share.

Each component keeps its own registry and metrics (:mod:`rdma_cni.agent.metrics`,
:mod:`rdma_cni.extender.metrics`); this module holds what they do alike: a
collector slot that reads a running object at scrape time (watching a new
object replaces the old), serving a registry on a port of its own, and the
``ADDR:PORT`` option naming that port. ``prometheus_client`` is imported only
to serve: ``rdma-cni install`` parses its options with the standard library.
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


def serve(registry: Any, address: tuple[str, int]) -> Any:
    """Serve ``registry`` on ``address`` in a daemon thread; returns the server (``shutdown()`` stops it)."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(address[1], address[0], registry=registry)
    return server


def address_option(flag: str, example: str) -> Callable[[str], tuple[str, int]]:
    """An argparse ``type`` for ``flag ADDR:PORT`` (an empty address is 0.0.0.0; ``[::1]`` drops brackets)."""

    def parse(value: str) -> tuple[str, int]:
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise argparse.ArgumentTypeError(f"{flag} {value!r}: expected ADDR:PORT, e.g. {example}")
        return host.strip("[]") or "0.0.0.0", int(port)

    return parse
