"""The extender's HTTP(S) server: POST /filter /prioritize /preempt /bind, GET /healthz /readyz.

Requests are read by :mod:`rdma_cni.httpd.serve` (h11, a deadline per phase of
a connection, a cap on connections that lets half-open ones give way); this
adds body limits and a budget of bodies in flight, ``Expect: 100-continue``
answered only once a body fits (:class:`ExtenderServer`). Who
may connect is :mod:`rdma_cni.extender.listener`'s; what a request means is
:mod:`rdma_cni.extender.verbs`'. Every verb answers 200 with its result
document, never a 500, so kube-scheduler shows a reason in the pod's events.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import ssl
import threading
import time
from collections.abc import Callable
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
from rdma_cni.httpd.serve import (
    BUSY,
    HANDSHAKE_TIMEOUT,
    IDLE_TIMEOUT,
    MAX_CONNECTIONS,
    REQUEST_TIMEOUT,
    BoundedHandler,
    BoundedServer,
    Request,
)

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


class _Handler(BoundedHandler):
    """HTTP/1.1 with keep-alive: what kube-scheduler's Go client and the kubelet's probes send.

    The head is read by :class:`rdma_cni.httpd.serve.BoundedHandler` (h11); this
    routes it, bounds the body before any of it is read and answers.
    """

    server: ExtenderServer

    def check_peer(self) -> None:
        server = self.server
        if server.peer_seen is not None or server.client_names:
            cert = self.request.getpeercert() or {}
            if server.peer_seen is not None and cert.get("notAfter"):
                with contextlib.suppress(ValueError):
                    server.peer_seen(float(ssl.cert_time_to_seconds(cert["notAfter"])))
        if server.client_names:
            names = peer_names(cert)
            if not names & server.client_names:
                log.warning(
                    "%s: client certificate names %s, none of --client-name: connection closed",
                    self.client_address[0],
                    sorted(names) or "nothing",
                )
                raise ConnectionRefusedError("client certificate name not accepted")

    def serve_one(self) -> bool:
        server = self.server
        request = self.next_request()
        if request is None:
            return False
        method, path, keep, length = request.method, request.path, request.keep, request.length
        if request.chunked:
            # kube-scheduler sends a Content-Length; a chunked body would have to be read to go on.
            self.send(411, b"a Content-Length is required, not a chunked body\n", "text/plain", close=True)
            return False
        if method == "GET":
            if length:  # a body nobody reads: the stream cannot be reused
                keep = False
            if path == "/healthz":
                self.send(200, b"ok\n", "text/plain", close=not keep)
            elif path == "/readyz":
                ready = server.extender.ready.is_set()
                self.send(
                    200 if ready else 503, b"ok\n" if ready else b"not ready\n", "text/plain", close=not keep
                )
            else:
                self.send(404, b"not found\n", "text/plain", close=not keep)
            return keep
        verb = server.verbs.get(path.rstrip("/")) if method == "POST" else None
        if verb is None:
            # Its body is not read: the stream cannot be reused.
            status = 404 if method == "POST" else 405
            self.send(status, b"not found\n" if status == 404 else b"GET or POST\n", "text/plain", close=True)
            return False
        if length is None or length > server.max_body:
            # Refused before any of the body is read, and before any 100 Continue.
            self.send(
                411 if length is None else 413,
                f"a Content-Length up to {server.max_body} bytes is required\n".encode(),
                "text/plain",
                close=True,
            )
            return False
        if not server.budget.acquire(length, min(_BUDGET_WAIT, server.request_timeout / 2), self.conn.proven):
            self.send(503, b"too many request bodies at once; retry\n", "text/plain", close=True)
            return False
        try:
            return self._serve(request, verb)
        finally:
            server.budget.release(length)

    def _serve(self, request: Request, verb: Verb) -> bool:
        server = self.server
        path = request.path
        if request.expect:
            self.request.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        started = time.perf_counter()
        raw = self.body(request.length or 0)
        if raw is None:
            return False  # the client went away mid-body
        self.conn.phase = BUSY
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
                answer = verb(doc, hung_up(self.request))
        except Exception as exc:  # a bug: still answer in the verb's format
            log.exception("%s failed", path)
            answer = error_answer(path, f"rdma-cni: internal error: {type(exc).__name__}: {exc}")
        del doc
        body = answer if isinstance(answer, bytes) else json.dumps(answer, separators=(",", ":")).encode()
        self.send(200, body, close=not request.keep)
        metrics.request(path, time.perf_counter() - started)
        log.debug(
            "%s: %d bytes in, %d out, %.2f ms",
            path,
            len(raw),
            len(body),
            (time.perf_counter() - started) * 1e3,
        )
        return request.keep


# A verb: the request's document and a check of whether its caller hung up -> the answer.
Verb = Callable[[Any, Callable[[], bool]], Any]


def hung_up(sock: Any) -> Callable[[], bool]:
    """A check of whether the peer of ``sock`` has closed its side (kube-scheduler gave up waiting).

    POLLRDHUP reports the peer's FIN even with bytes still unread, and works the same under TLS
    (a TLS close is a close_notify followed by that FIN), without reading anything of the stream.
    """
    try:
        fd = sock.fileno()
    except (OSError, ValueError):
        return lambda: True
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP | select.POLLHUP | select.POLLERR)

    def gone() -> bool:
        return bool(poller.poll(0))

    return gone


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


class ExtenderServer(BoundedServer):
    """A threaded HTTP server for an :class:`Extender`, optionally TLS, bounded under attack.

    Connections, their phases and their deadlines are bounded as every
    :class:`rdma_cni.httpd.serve.BoundedServer` is: so a flood of half-open
    connections never pushes out kube-scheduler's kept-alive one. Request bodies
    are limited to ``max_body`` bytes each and ``body_budget`` bytes at once, of
    which ``body_reserve`` only for connections that completed a request before.

    It refuses (:class:`UnauthenticatedListener`, before it binds) an address
    other than loopback unless ``tls`` requires client certificates, and
    checks the address it actually bound too (a host name may resolve anywhere).
    With ``client_names``, a verified client certificate must also carry one of
    them as its subject CN or a DNS/URI SAN. With ``probes_only`` it serves
    ``GET /healthz`` and ``/readyz`` and no verb, on any address, in plain HTTP:
    the kubelet's probes reach it where they cannot reach a loopback or
    client-certificate listener, and it gives nobody any power.
    """

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
        # Told the notAfter of each verified client certificate (extender/certs.py, for the metric).
        self.peer_seen: Callable[[float], None] | None = None
        self.verbs: dict[str, Callable[[Any, Callable[[], bool]], Any]] = (
            {} if probes_only else extender.routes()
        )
        if client_names and not authenticates_clients(tls):
            raise UnauthenticatedListener("client names need client certificates (--client-ca)")
        self.client_names = client_names
        self.decoder = ArgsDecoder()
        self.max_body = max_body
        self.max_nodes = max_nodes
        self.budget = _Budget(max(body_budget, max_body + body_reserve), body_reserve)
        _tune_malloc()
        host = address[0]
        if not probes_only and (not host or is_address(host)):
            check_listener(host, tls)  # an address: refused before anything is bound
        super().__init__(
            address,
            _Handler,
            tls=tls,
            max_connections=max_connections,
            handshake_timeout=handshake_timeout,
            request_timeout=request_timeout,
            idle_timeout=idle_timeout,
            bind_and_activate=False,
        )
        try:
            self.server_bind()
            if not probes_only:
                check_listener(str(self.server_address[0]), tls)  # what a name (or "") resolved to
            self.server_activate()
        except BaseException:
            self.server_close()
            raise
