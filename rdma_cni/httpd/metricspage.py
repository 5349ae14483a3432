"""``GET /metrics`` on a bounded listener: the page ``prometheus_client`` renders, nothing else.

Plain HTTP, no TLS: the page is read-only and carries no secrets
(docs/operations.md). Connections, their phases and their deadlines are bounded
by :class:`rdma_cni.httpd.serve.BoundedServer`, so connections that never finish
their headers hold no more than the cap's threads and give way to a scraper.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rdma_cni.httpd.serve import BUSY, BoundedHandler, BoundedServer

__all__ = ["MetricsServer"]


class _Handler(BoundedHandler):
    server: MetricsServer

    def serve_one(self) -> bool:
        request = self.next_request()
        if request is None:
            return False
        if request.method != "GET":
            self.send(405, b"GET only\n", "text/plain", close=True)
            return False
        # A body nobody reads: the stream cannot be reused.
        keep = request.keep and not request.length and not request.chunked
        if request.path != "/metrics":
            self.send(404, b"not found: the page is /metrics\n", "text/plain", close=not keep)
            return keep
        self.conn.phase = BUSY
        page = generate_latest(self.server.registry)
        self.send(200, page, CONTENT_TYPE_LATEST, close=not keep)
        return keep


class MetricsServer(BoundedServer):
    """Serves ``registry`` at ``/metrics`` on ``address`` (plain HTTP), bounded as every BoundedServer is."""

    def __init__(self, address: tuple[str, int], registry: Any, **bounds: Any) -> None:
        self.registry = registry
        super().__init__(address, _Handler, **bounds)
