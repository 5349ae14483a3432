"""The extender's HTTP(S) server: POST /filter /prioritize /preempt /bind, GET /healthz /readyz.

A hand-written HTTP/1.1 reader (:class:`_Handler`), bounded under attack: body
limits and a budget of bodies in flight, ``Expect: 100-continue`` answered
only once a body fits, a deadline per phase of a connection, a cap on
connections that lets half-open ones give way (:class:`ExtenderServer`). Who
may connect is :mod:`rdma_cni.extender.listener`'s; what a request means is
:mod:`rdma_cni.extender.verbs`'. Every verb answers 200 with its result
document, never a 500, so kube-scheduler shows a reason in the pod's events.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from typing import Any

from rdma_cni.extender import metrics
from rdma_cni.extender.listener import (
    UnauthenticatedListener,
    authenticates_clients,
    check_listener,
    is_address,
    peer_names,
)
from rdma_cni.extender.rawargs import ArgsDecoder
from rdma_cni.extender.verbs import Extender, error_answer

__all__ = ["ExtenderServer"]

log = logging.getLogger("rdma_cni.extender.server")

# kube-scheduler in NodeNames mode sends the pod and the names: at 5,000 nodes of ~64-byte names about
# 0.4 MB, at 15,000 nodes of 253-byte names (the longest) about 4 MB. Full-Node mode (a few KiB per Node)
# is for small clusters: 16 MiB still carries ~1,500 Nodes. Decoded, a body takes several times its size
# in memory, so 16 MiB x BODY_BUDGET_BODIES stays well inside the Deployment's 512 MiB limit.
MAX_BODY = 8 * 1024 * 1024
# Bodies read and decoded at once, in bytes of Content-Length; a request that finds no room within
# _BUDGET_WAIT seconds gets 503 (kube-scheduler sends one filter at a time, and binds are small).
# Decoded JSON takes up to ~25 times its text (``[{},{},...]``: a 64-byte dict per 3 bytes), so
# 12 MiB in flight is at most ~300 MiB decoded: with the bounded caches, under the 512 MiB limit.
# The last 4 MiB (kube-scheduler's filter at 15,000 nodes of the longest names) are kept for connections
# that completed a request before (see _Budget).
BODY_BUDGET = 12 * 1024 * 1024
BODY_RESERVE = 4 * 1024 * 1024
# Nodes in one request: work and answers take ~0.4 KB per node whatever its name's length, so a body of
# short names must not multiply that. kube-scheduler supports 5,000 nodes; 20,000 leaves room.
MAX_NODES = 20_000
_BUDGET_WAIT = 2.0
# Connections served at once (one thread each); see ExtenderServer.verify_request for who makes room.
MAX_CONNECTIONS = 256
# Seconds: a TLS handshake; a request (line, headers and body) from its first byte; an idle keep-alive
# connection (longer than the 90 s after which Go's client closes its own idle ones, so that the server
# never closes a connection the client is about to reuse).
HANDSHAKE_TIMEOUT = 5.0
REQUEST_TIMEOUT = 10.0
IDLE_TIMEOUT = 120.0
# Request line and header limits, as http.server's.
_MAX_LINE = 65536
_MAX_HEADERS = 100


class _BadRequest(Exception):
    """The request cannot be read: answer ``status`` and close the connection."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


class _Budget:
    """Bytes of request bodies held at once: a body is read only once its Content-Length fits.

    Connections that never completed a request may fill ``total - reserve``;
    the last ``reserve`` bytes are for connections that did (kube-scheduler's
    kept-alive ones), so that bodies trickling in from strangers never keep its
    filters waiting.
    """

    def __init__(self, total: int, reserve: int) -> None:
        self.total = total
        self.reserve = min(reserve, total)
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, size: int, timeout: float, proven: bool) -> bool:
        limit = self.total if proven else self.total - self.reserve
        with self._cond:
            if not self._cond.wait_for(lambda: self.used + size <= limit, timeout):
                return False
            self.used += size
            self.peak = max(self.peak, self.used)
            return True

    def release(self, size: int) -> None:
        with self._cond:
            self.used -= size
            self._cond.notify_all()


# What a connection is doing, for the reaper and for eviction at the cap.
_HANDSHAKE, _IDLE, _READING, _BUSY, _WRITING = range(5)


class _Conn:
    """One served connection: its phase, when that phase must end, and whether it ever completed a request."""

    __slots__ = ("dead", "deadline", "phase", "proven", "since", "sock")

    def __init__(self, sock: Any, deadline: float) -> None:
        self.sock = sock
        self.phase = _HANDSHAKE
        self.deadline = deadline
        self.since = time.monotonic()
        self.proven = False  # served a whole request: kube-scheduler's keep-alive connections
        self.dead = False


def _nodes_in(doc: Any) -> int:
    """How many nodes a decoded ExtenderArgs / ExtenderPreemptionArgs names (0 for anything else)."""
    if not isinstance(doc, dict):
        return 0
    count = 0
    for key in ("NodeNames", "NodeNameToVictims", "NodeNameToMetaVictims"):
        value = doc.get(key)
        if isinstance(value, (list, dict)):
            count = max(count, len(value))
    nodes = doc.get("Nodes")
    items = nodes.get("items") if isinstance(nodes, dict) else None
    return max(count, len(items)) if isinstance(items, list) else count


class _Handler(socketserver.StreamRequestHandler):
    """HTTP/1.1 with keep-alive: what kube-scheduler's Go client and the kubelet's probes send.

    BaseHTTPRequestHandler parses headers through the email package and
    formats a date and a log line per request: about 0.2 ms of CPU, three
    times per pod scheduled. This reads the request line and the headers
    into a dict, with the same limits as http.server (64 KiB lines, 100 headers).
    Every phase has a deadline (see :class:`ExtenderServer`): the TLS handshake
    runs here, on the connection's thread, never in the accept loop.
    """

    rbufsize = 64 * 1024
    # Status line, headers and body leave in one sendall: with two small writes,
    # Nagle's algorithm and the client's delayed ACK add ~40 ms.
    wbufsize = 0
    server: ExtenderServer
    conn: _Conn

    def setup(self) -> None:
        server = self.server
        self.conn = server.tracked(self.request)
        self.request.settimeout(server.handshake_timeout)
        if server.tls is not None:
            self.request.do_handshake()  # an error ends the connection in handle_error, quietly
            if server.client_names:
                names = peer_names(self.request.getpeercert() or {})
                if not names & server.client_names:
                    log.warning(
                        "%s: client certificate names %s, none of --client-name: connection closed",
                        self.client_address[0],
                        sorted(names) or "nothing",
                    )
                    raise ConnectionRefusedError("client certificate name not accepted")
        super().setup()

    def handle(self) -> None:
        try:
            while self._one():
                self.conn.proven = True
        except (OSError, ValueError) as exc:  # reset connections, TLS failures, timeouts, a closed file
            log.debug("%s: connection ended: %s", self.client_address[0], exc)

    def _phase(self, phase: int, seconds: float) -> None:
        # The reaper ends the phase at the deadline; the socket timeout bounds each wait as well.
        self.conn.phase = phase
        self.conn.deadline = time.monotonic() + seconds
        self.request.settimeout(seconds)

    def _one(self) -> bool:
        """Serve one request; False when the connection is to be closed."""
        server = self.server
        self._phase(_IDLE, server.idle_timeout)
        if not self.rfile.peek(1):
            return False
        self._phase(_READING, server.request_timeout)
        line = self.rfile.readline(_MAX_LINE + 1)
        if not line:
            return False
        try:
            method, path, keep, length, expect = self._head(line)
        except _BadRequest as bad:
            self._send(bad.status, bad.text.encode() + b"\n", "text/plain", close=True)
            return False
        if method == "GET":
            if length:  # a body nobody reads: the stream cannot be reused
                keep = False
            if path == "/healthz":
                self._send(200, b"ok\n", "text/plain", close=not keep)
            elif path == "/readyz":
                ready = server.extender.ready.is_set()
                self._send(
                    200 if ready else 503, b"ok\n" if ready else b"not ready\n", "text/plain", close=not keep
                )
            else:
                self._send(404, b"not found\n", "text/plain", close=not keep)
            return keep
        verb = server.verbs.get(path.rstrip("/")) if method == "POST" else None
        if verb is None:
            # Its body is not read: the stream cannot be reused.
            status = 404 if method == "POST" else 405
            self._send(
                status, b"not found\n" if status == 404 else b"GET or POST\n", "text/plain", close=True
            )
            return False
        if length is None or length > server.max_body:
            # Refused before any of the body is read, and before any 100 Continue.
            self._send(
                411 if length is None else 413,
                f"a Content-Length up to {server.max_body} bytes is required\n".encode(),
                "text/plain",
                close=True,
            )
            return False
        if not server.budget.acquire(length, min(_BUDGET_WAIT, server.request_timeout / 2), self.conn.proven):
            self._send(503, b"too many request bodies at once; retry\n", "text/plain", close=True)
            return False
        try:
            return self._serve(path, verb, length, keep, expect)
        finally:
            server.budget.release(length)

    def _serve(self, path: str, verb: Callable[[Any], Any], length: int, keep: bool, expect: bool) -> bool:
        server = self.server
        if expect:
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        started = time.perf_counter()
        raw = self.rfile.read(length)
        if len(raw) < length:
            return False  # the client went away mid-body
        self.conn.phase = _BUSY
        try:
            doc = server.decoder.loads(raw)
        except (ValueError, RecursionError) as exc:
            doc = exc
        try:
            if isinstance(doc, Exception):
                answer: Any = error_answer(path, f"rdma-cni: request body is not JSON: {doc}")
            elif _nodes_in(doc) > server.max_nodes:
                answer = error_answer(path, f"rdma-cni: more than {server.max_nodes} nodes in one request")
            else:
                answer = verb(doc)
        except Exception as exc:  # a bug: still answer in the verb's format
            log.exception("%s failed", path)
            answer = error_answer(path, f"rdma-cni: internal error: {type(exc).__name__}: {exc}")
        del doc
        body = answer if isinstance(answer, bytes) else json.dumps(answer, separators=(",", ":")).encode()
        self._send(200, body, close=not keep)
        metrics.request(path, time.perf_counter() - started)
        log.debug(
            "%s: %d bytes in, %d out, %.2f ms",
            path,
            len(raw),
            len(body),
            (time.perf_counter() - started) * 1e3,
        )
        return keep

    def _head(self, line: bytes) -> tuple[str, str, bool, int | None, bool]:
        """(method, path without query, keep-alive, Content-Length, Expect: 100-continue) from the
        request line and headers."""
        if len(line) > _MAX_LINE:
            raise _BadRequest(414, "request line too long")
        words = line.split()
        if len(words) != 3 or not words[2].startswith(b"HTTP/1."):
            raise _BadRequest(400, "not an HTTP/1.x request line")
        headers: dict[bytes, bytes] = {}
        for _ in range(_MAX_HEADERS + 1):
            header = self.rfile.readline(_MAX_LINE + 1)
            if len(header) > _MAX_LINE:
                raise _BadRequest(431, "header line too long")
            if header in (b"\r\n", b"\n", b""):
                break
            name, colon, value = header.partition(b":")
            if not colon or not name or name != name.strip():
                raise _BadRequest(400, "malformed header line")
            headers[name.lower()] = value.strip()
        else:
            raise _BadRequest(431, f"more than {_MAX_HEADERS} headers")
        if b"transfer-encoding" in headers:
            # kube-scheduler sends a Content-Length; a chunked body would have to be read to go on.
            raise _BadRequest(411, "a Content-Length is required, not a chunked body")
        connection = headers.get(b"connection", b"").lower()
        keep = connection != b"close" if words[2] == b"HTTP/1.1" else connection == b"keep-alive"
        length: int | None = None
        if b"content-length" in headers:
            text = headers[b"content-length"]
            if not text.isdigit():
                raise _BadRequest(400, "Content-Length is not a number")
            length = int(text)
        expect = headers.get(b"expect", b"").lower() == b"100-continue"
        target = words[1].decode("latin-1")
        return words[0].decode("latin-1"), target.split("?", 1)[0], keep, length, expect

    def _send(self, status: int, body: bytes, content_type: str = "application/json", *, close: bool) -> None:
        close_header = "Connection: close\r\n" if close else ""
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{close_header}\r\n"
        )
        self._phase(_WRITING, self.server.request_timeout)
        self.wfile.write(head.encode("latin-1") + body)


def _tune_malloc() -> None:
    """Have glibc give the memory of large bodies back (a no-op elsewhere).

    glibc raises its mmap threshold to the size of each large block freed, up
    to 32 MiB: after a few large bodies, later ones come from the heap and stay
    resident when freed (one 128 MiB body once left 530 MiB). A fixed threshold
    keeps every block over 256 KiB in its own mapping, unmapped when freed, and
    two arenas keep the connection threads from holding a heap each.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD
    mallopt(-8, 2)  # M_ARENA_MAX


class ExtenderServer(ThreadingHTTPServer):
    """A threaded HTTP server for an :class:`Extender`, optionally TLS, bounded under attack.

    At most ``max_connections`` connections (threads) are served. Each phase of a
    connection has a deadline: the TLS handshake ``handshake_timeout``, a request
    from its first byte to its last ``request_timeout``, the wait for the next
    request ``idle_timeout``; the accept loop's reaper (:meth:`service_actions`)
    shuts down connections past their deadline. A new connection over the cap
    takes the place of the oldest one that never completed a request and is not
    being answered (a handshake, or headers or a body trickling in); when there
    is none, the new one is closed at once. So a flood of half-open connections
    never pushes out kube-scheduler's kept-alive one. Request bodies are limited
    to ``max_body`` bytes each and ``body_budget`` bytes at once, of which
    ``body_reserve`` only for connections that completed a request before.

    It refuses (:class:`UnauthenticatedListener`, before it binds) an address
    other than loopback unless ``tls`` requires client certificates, and
    checks the address it actually bound too (a host name may resolve anywhere).
    With ``client_names``, a verified client certificate must also carry one of
    them as its subject CN or a DNS/URI SAN. With ``probes_only`` it serves
    ``GET /healthz`` and ``/readyz`` and no verb, on any address, in plain HTTP:
    the kubelet's probes reach it where they cannot reach a loopback or
    client-certificate listener, and it gives nobody any power.
    """

    daemon_threads = True
    request_queue_size = 1024

    def __init__(
        self,
        address: tuple[str, int],
        extender: Extender,
        tls: ssl.SSLContext | None = None,
        client_names: frozenset[str] = frozenset(),
        *,
        probes_only: bool = False,
        max_connections: int = MAX_CONNECTIONS,
        max_body: int = MAX_BODY,
        body_budget: int = BODY_BUDGET,
        body_reserve: int = BODY_RESERVE,
        max_nodes: int = MAX_NODES,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        request_timeout: float = REQUEST_TIMEOUT,
        idle_timeout: float = IDLE_TIMEOUT,
    ) -> None:
        self.extender = extender
        self.verbs: dict[str, Callable[[Any], Any]] = {} if probes_only else extender.routes()
        if client_names and not authenticates_clients(tls):
            raise UnauthenticatedListener("client names need client certificates (--client-ca)")
        self.tls = tls
        self.client_names = client_names
        self.decoder = ArgsDecoder()
        self.max_connections = max_connections
        self.max_body = max_body
        self.max_nodes = max_nodes
        self.budget = _Budget(max(body_budget, max_body + body_reserve), body_reserve)
        self.handshake_timeout = handshake_timeout
        self.request_timeout = request_timeout
        self.idle_timeout = idle_timeout
        self._conns: dict[Any, _Conn] = {}
        self._conns_lock = threading.Lock()
        # Counters (tests and the fault tier read them).
        self.evicted = 0
        self.refused = 0
        self.reaped = 0
        _tune_malloc()
        host = address[0]
        if not probes_only and (not host or is_address(host)):
            check_listener(host, tls)  # an address: refused before anything is bound
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler, bind_and_activate=False)
        try:
            self.server_bind()
            if not probes_only:
                check_listener(str(self.server_address[0]), tls)  # what a name (or "") resolved to
            self.server_activate()
        except BaseException:
            self.server_close()
            raise

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
                victims = [c for c in live if not c.proven and c.phase in (_HANDSHAKE, _IDLE, _READING)]
                # Threads of connections shut down but not yet ended count too: at most a quarter more.
                if not victims or len(self._conns) >= self.max_connections + max(
                    1, self.max_connections // 4
                ):
                    self.refused += 1
                    return False
                self._kill(min(victims, key=lambda c: c.since))
                self.evicted += 1
            self._conns[request] = _Conn(request, now + self.handshake_timeout)
        return True

    def tracked(self, request: Any) -> _Conn:
        with self._conns_lock:
            conn = self._conns.get(request)
            if conn is None:  # not admitted through verify_request (a test calling the handler)
                conn = self._conns[request] = _Conn(request, time.monotonic() + self.handshake_timeout)
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
    def _kill(conn: _Conn) -> None:
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
                if not conn.dead and conn.phase != _BUSY and now > conn.deadline:
                    self._kill(conn)
                    self.reaped += 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A failed or timed-out TLS handshake, a reset: not worth a traceback.
        log.debug("%s: connection failed", client_address[0] if client_address else "?", exc_info=True)
