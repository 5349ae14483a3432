"""Keep-alive ``http.client`` connections to one API server, for the long-running client's requests.

A Binding POST through ``requests`` costs about three times the CPU of one over
a kept ``http.client`` connection (the scheduler extender makes one per pod):
:class:`rdma_cni.kube.client.ApiClient` sends every request that is not a watch
through a :class:`Pool`.

At most POOL_SIZE connections are in use at once: a request beyond them waits
for one to come back instead of opening one more. Opening more did not make the
API server answer sooner and cost a TLS handshake on both sides each time, and
the extra connections were closed again as they came back (only POOL_SIZE are
kept idle): in a burst of binds the extender opened a connection (and a
handshake) for most of them (docs/performance.md, "The extender, second").
"""

from __future__ import annotations

import threading
import time
from typing import Any

# Connections one client keeps alive, and uses at once, for concurrent requests.
POOL_SIZE = 16


class Pool:
    """Keep-alive connections to one API server, at most POOL_SIZE of them in use. Thread-safe.

    Every :meth:`take` is matched by one :meth:`give` (the answer was read in full: kept for
    the next request) or one :meth:`lost` (the caller closed the connection). A take that finds
    all POOL_SIZE in use waits for one, up to ``timeout`` seconds (the client's own bound on a
    request); past that it opens one more, so a request is never refused for want of a
    connection, only delayed.
    """

    def __init__(self, host: str, port: int, prefix: str, context: Any, timeout: float) -> None:
        self.host = host
        self.port = port
        self.prefix = prefix
        self.context = context
        self.timeout = timeout
        self._cond = threading.Condition(threading.Lock())
        self._idle: list[Any] = []
        self._busy = 0  # taken and not yet given back or lost
        self.opened = 0  # connections made, over the pool's life (the tests read it)

    def take(self) -> tuple[Any, bool]:
        """A connection, and whether it was used before (new ones connect on first request)."""
        import http.client

        deadline = None
        while True:
            with self._cond:
                while not self._idle and self._busy >= POOL_SIZE:
                    if deadline is None:
                        deadline = time.monotonic() + self.timeout
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._cond.wait(left):
                        break  # waited the client's timeout: one more connection rather than none
                conn = self._idle.pop() if self._idle else None
                self._busy += 1
                if conn is None:
                    self.opened += 1
            if conn is None:
                break
            if not _dropped(conn.sock):
                return conn, True
            conn.close()
            self.lost()
        # The timeout bounds connecting and each read, as requests' (connect, read) pair does.
        if self.context is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout), False
        return (
            http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self.context),
            False,
        )

    def give(self, conn: Any) -> None:
        """Return a connection whose answer was read in full."""
        with self._cond:
            self._busy -= 1
            if len(self._idle) < POOL_SIZE:
                self._idle.append(conn)
                self._cond.notify()
                return
            self._cond.notify()
        conn.close()

    def lost(self) -> None:
        """A taken connection was closed by its caller (an error, or the server said close)."""
        with self._cond:
            self._busy -= 1
            self._cond.notify()

    def close(self) -> None:
        """Close every idle connection."""
        with self._cond:
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
