"""A threaded HTTP/1.1 server bounded under attack: what the extender and both ``/metrics`` pages share.

One thread per connection, at most ``max_connections`` of them; each phase of
a connection (TLS handshake, waiting for a request, reading it, writing the
answer) has a deadline enforced by the accept loop's reaper as well as by the
socket's timeout; a newcomer over the cap pushes out the oldest connection
that never completed a request and is not being answered, so a flood of
stalled connections never holds more threads than the cap nor pushes out a
client that has been served before (kube-scheduler, Prometheus).

A request's head is read by :mod:`rdma_cni.httpd.head` (h11); one it refuses is
answered 400 (414, 431) and the connection closed. Bodies are read here, by
their ``Content-Length``, and answers written in one ``sendall``. What a
request means is the subclasses' (:mod:`rdma_cni.extender.server`,
:mod:`rdma_cni.httpd.metricspage`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import threading
import time
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from typing import Any

from rdma_cni.httpd.head import HEAD_END, MAX_HEAD, BadRequest, Heads, Request, too_long

__all__ = ["BoundedHandler", "BoundedServer", "Request"]

log = logging.getLogger("rdma_cni.httpserve")

# Connections served at once (one thread each); see BoundedServer.verify_request for who makes room.
MAX_CONNECTIONS = 256
# Seconds: a TLS handshake; a request (line, headers and body) from its first byte; an idle keep-alive
# connection (longer than the 90 s after which Go's client closes its own idle ones, so that the server
# never closes a connection the client is about to reuse).
HANDSHAKE_TIMEOUT = 5.0
REQUEST_TIMEOUT = 10.0
IDLE_TIMEOUT = 120.0
# Bytes asked of the socket at once: a head, or a slice of a body.
_RECV = 64 * 1024
_BODY_RECV = 1024 * 1024

# What a connection is doing, for the reaper and for eviction at the cap.
HANDSHAKE, IDLE, READING, BUSY, WRITING = range(5)


class Conn:
    """One served connection: its phase, when that phase must end, and whether it ever completed a request."""

    __slots__ = ("dead", "deadline", "phase", "proven", "since", "sock")

    def __init__(self, sock: Any, deadline: float) -> None:
        self.sock = sock
        self.phase = HANDSHAKE
        self.deadline = deadline
        self.since = time.monotonic()
        self.proven = False  # served a whole request: a client that has been answered before
        self.dead = False


class BoundedHandler(socketserver.BaseRequestHandler):
    """A connection of a :class:`BoundedServer`: subclasses answer requests in :meth:`serve_one`.

    The TLS handshake runs here, on the connection's thread, never in the accept
    loop; :meth:`check_peer` may then refuse the connection.
    """

    server: BoundedServer
    conn: Conn

    def setup(self) -> None:
        server = self.server
        self.conn = server.tracked(self.request)
        self.pending = b""  # received past the last request: the start of the next one
        self.rest = b""  # received past the head of the request being read: the start of its body
        self.request.settimeout(server.handshake_timeout)
        if server.tls is not None:
            self.request.do_handshake()  # an error ends the connection in handle_error, quietly
            self.check_peer()

    def check_peer(self) -> None:
        """Raise to close a TLS connection whose peer may not call (the handshake is done)."""

    def serve_one(self) -> bool:
        """Read and answer one request; False when the connection is to be closed."""
        raise NotImplementedError

    def handle(self) -> None:
        try:
            while self.serve_one():
                self.conn.proven = True
        except (OSError, ValueError) as exc:  # reset connections, TLS failures, timeouts, a closed file
            log.debug("%s: connection ended: %s", self.client_address[0], exc)

    def phase(self, phase: int, seconds: float) -> None:
        """Enter ``phase``, which must end within ``seconds`` (the reaper and the socket timeout)."""
        self.conn.phase = phase
        self.conn.deadline = time.monotonic() + seconds
        self.request.settimeout(seconds)

    def next_request(self) -> Request | None:
        """Wait for the next request and read its head; None when the connection is to be closed.

        A head that cannot be read is answered here (400, 414, 431) and gives None. Only the head
        goes through h11 (it ends where h11's own reader ends it, at the first blank line): the
        body, read by :meth:`body`, is never copied through its buffers.
        """
        server = self.server
        data = self.pending
        if not data:
            self.phase(IDLE, server.idle_timeout)
            data = self.request.recv(_RECV)
            if not data:
                return None
        self.phase(READING, server.request_timeout)
        end = HEAD_END.search(data)
        if end is None:
            # A head in pieces (as small as a byte each): gathered in a bytearray, whose appends
            # do not copy what came before, and searched only where a piece may end it.
            gathered = bytearray(data)
            while end is None:
                if len(gathered) > MAX_HEAD:
                    self._refuse(too_long(bytes(gathered[: MAX_HEAD + 1])))
                    return None
                more = self.request.recv(_RECV)
                if not more:
                    return None  # the client went away mid-head
                gathered += more
                end = HEAD_END.search(gathered, max(0, len(gathered) - len(more) - 2))
            data = bytes(gathered)
        head, self.rest = data[: end.end()], data[end.end() :]
        self.pending = b""
        try:
            request = server.heads.parse(head, end.start())
        except BadRequest as bad:
            self._refuse(bad)
            return None
        if not request.length and not request.chunked:
            self.pending, self.rest = self.rest, b""  # pipelined: the next request's first bytes
        return request

    def _refuse(self, bad: BadRequest) -> None:
        self.send(bad.status, bad.text.encode() + b"\n", "text/plain", close=True)

    def body(self, length: int) -> bytes | None:
        """The ``length`` bytes of the request read last (its Content-Length, which h11 validated and
        the caller bounded); None if the client went away first."""
        have, self.rest = self.rest, b""
        parts = [have[:length]]
        got = len(parts[0])
        while got < length:
            data = self.request.recv(min(length - got, _BODY_RECV))
            if not data:
                return None
            parts.append(data)
            got += len(data)
        self.pending = have[length:]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def send(self, status: int, body: bytes, content_type: str = "application/json", *, close: bool) -> None:
        """Answer: status line, headers and body in one write (two writes meet Nagle and delayed ACKs)."""
        close_header = "Connection: close\r\n" if close else ""
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{close_header}\r\n"
        )
        self.phase(WRITING, self.server.request_timeout)
        self.request.sendall(head.encode("latin-1") + body)


class BoundedServer(ThreadingHTTPServer):
    """A threaded HTTP server whose connections (threads) and their phases are bounded.

    At most ``max_connections`` connections are served. Each phase of a
    connection has a deadline: the TLS handshake ``handshake_timeout``, a request
    from its first byte to its last ``request_timeout``, the wait for the next
    request ``idle_timeout``; the accept loop's reaper (:meth:`service_actions`)
    shuts down connections past their deadline. A new connection over the cap
    takes the place of the oldest one that never completed a request and is not
    being answered (a handshake, or headers or a body trickling in); when there
    is none, the new one is closed at once.
    """

    daemon_threads = True
    request_queue_size = 1024

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BoundedHandler],
        *,
        tls: Any = None,
        max_connections: int = MAX_CONNECTIONS,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        request_timeout: float = REQUEST_TIMEOUT,
        idle_timeout: float = IDLE_TIMEOUT,
        bind_and_activate: bool = True,
    ) -> None:
        self.tls = tls
        self.max_connections = max_connections
        self.handshake_timeout = handshake_timeout
        self.request_timeout = request_timeout
        self.idle_timeout = idle_timeout
        self._conns: dict[Any, Conn] = {}
        self._conns_lock = threading.Lock()
        self.heads = Heads()
        # Counters (tests and the fault tier read them).
        self.evicted = 0
        self.refused = 0
        self.reaped = 0
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler, bind_and_activate=bind_and_activate)

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = super().get_request()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            # The handshake happens on the handler's thread, with a timeout, not in the accept loop.
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Admit the connection under the cap, making room if a connection can give way."""
        now = time.monotonic()
        with self._conns_lock:
            live = [c for c in self._conns.values() if not c.dead]
            if len(live) >= self.max_connections:
                victims = [c for c in live if not c.proven and c.phase in (HANDSHAKE, IDLE, READING)]
                # Threads of connections shut down but not yet ended count too: at most a quarter more.
                if not victims or len(self._conns) >= self.max_connections + max(
                    1, self.max_connections // 4
                ):
                    self.refused += 1
                    return False
                self._kill(min(victims, key=lambda c: c.since))
                self.evicted += 1
            self._conns[request] = Conn(request, now + self.handshake_timeout)
        return True

    def tracked(self, request: Any) -> Conn:
        """The :class:`Conn` of ``request`` (made now if it was not admitted through verify_request)."""
        with self._conns_lock:
            conn = self._conns.get(request)
            if conn is None:  # not admitted through verify_request (a test calling the handler)
                conn = self._conns[request] = Conn(request, time.monotonic() + self.handshake_timeout)
            return conn

    def shutdown_request(self, request: Any) -> None:
        # After every connection, admitted or not, its handler failed in the handshake or not.
        with self._conns_lock:
            self._conns.pop(request, None)
        super().shutdown_request(request)

    def connections(self) -> int:
        """Connections being served (threads), including those shut down and ending."""
        with self._conns_lock:
            return len(self._conns)

    @staticmethod
    def _kill(conn: Conn) -> None:
        # Wakes the thread blocked on the socket; its handler then ends and closes it. The plain
        # socket's shutdown (not SSLSocket's, which would also drop its TLS state under the reader).
        conn.dead = True
        with contextlib.suppress(OSError):
            socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)

    def service_actions(self) -> None:
        """The reaper, run by the accept loop between polls: end connections past their deadline."""
        now = time.monotonic()
        with self._conns_lock:
            for conn in self._conns.values():
                if not conn.dead and conn.phase != BUSY and now > conn.deadline:
                    self._kill(conn)
                    self.reaped += 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A failed or timed-out TLS handshake, a reset: not worth a traceback.
        log.debug("%s: connection failed", client_address[0] if client_address else "?", exc_info=True)
