"""Keep-alive ``http.client`` connections to one API server, for the long-running client's requests.

A Binding POST through ``requests`` costs about three times the CPU of one over
a kept ``http.client`` connection (the scheduler extender makes one per pod):
:class:`rdma_cni.kube.client.ApiClient` sends every request that is not a watch
through a :class:`Pool`.
"""

from __future__ import annotations

import threading
from typing import Any

# Connections one client keeps alive for concurrent requests.
POOL_SIZE = 16


class Pool:
    """Idle keep-alive connections to one API server (at most POOL_SIZE kept). Thread-safe."""

    def __init__(self, host: str, port: int, prefix: str, context: Any, timeout: float) -> None:
        self.host = host
        self.port = port
        self.prefix = prefix
        self.context = context
        self.timeout = timeout
        self._lock = threading.Lock()
        self._idle: list[Any] = []

    def take(self) -> tuple[Any, bool]:
        """A connection, and whether it was used before (new ones connect on first request)."""
        import http.client

        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                break
            if not _dropped(conn.sock):
                return conn, True
            conn.close()
        # The timeout bounds connecting and each read, as requests' (connect, read) pair does.
        if self.context is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout), False
        return (
            http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self.context),
            False,
        )

    def give(self, conn: Any) -> None:
        """Return a connection whose answer was read in full."""
        with self._lock:
            if len(self._idle) < POOL_SIZE:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close every idle connection."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _dropped(sock: Any) -> bool:
    # An idle connection with something to read (EOF, a TLS close, stray bytes) cannot be reused.
    import select

    if sock is None:
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
