"""The extender's HTTP(S) server: POST /filter /prioritize /preempt /bind, GET /healthz /readyz.

Every verb answers 200 with its result document; bad input becomes the
result's ``Error`` (or, for a malformed pod annotation, a reason on every
node) and never a 500, so kube-scheduler shows the reason in the pod's
events. Both node modes are decided per request by what arrives: full
``Nodes`` carry their own annotations (decoded once per distinct text),
``NodeNames`` are looked up in the node cache.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rdma_cni import nodestate
from rdma_cni.errors import InvalidPodRequest
from rdma_cni.extender import wire
from rdma_cni.extender.answers import Answers
from rdma_cni.extender.bind import Binder, PodMemo
from rdma_cni.extender.decide import Decider, NodeView, Verdict
from rdma_cni.extender.demand import Demand, Demands
from rdma_cni.extender.preempt import keep_nodes
from rdma_cni.extender.rawargs import ArgsDecoder
from rdma_cni.extender.reservations import Reservations

__all__ = ["Extender", "ExtenderServer"]

log = logging.getLogger("rdma_cni.extender.server")

# Scores from a pod's filter, reused by its prioritize when it comes within this many seconds.
_SCORES_FRESH = 5.0
_SCORES_KEPT = 1024
# 5,000 full Node objects with ~40 images each are about 50 MB of JSON.
MAX_BODY = 128 * 1024 * 1024


class Extender:
    """The four verbs on decoded documents; owns the decision state shared by all requests."""

    def __init__(
        self,
        *,
        decider: Decider,
        demands: Demands,
        reservations: Reservations,
        client: Any = None,
        cache_views: Callable[[], dict[str, NodeView]] | None = None,
        cache_generation: Callable[[], int | None] | None = None,
        annotation: str = nodestate.ANNOTATION,
    ) -> None:
        self.decider = decider
        self.demands = demands
        self.reservations = reservations
        self.annotation = annotation
        self._cache_views = cache_views or dict
        # Bumped by the cache after every change of its views; None: lists are never reused.
        self._cache_generation: Callable[[], int | None] = cache_generation or (lambda: None)
        self._last_lookup: tuple[int, list[str], list[NodeView | None]] | None = None
        # Views last seen in full-Node requests: bind and preempt fall back to them.
        self.seen: dict[str, NodeView] = {}
        self.memo = PodMemo()
        # Per pod uid: (when, demand key, score of a node, the passing list and its encoded priorities,
        # if cached).
        self._scores: dict[
            str, tuple[float, tuple[tuple[int, int], ...], Callable[[str], int], list[str] | None, bytes]
        ] = {}
        self.answers = Answers(reservations, self._judge, decider.max_state_age)
        self.binder = Binder(client, decider, demands, reservations, self.view_of, self.memo)
        self.ready = threading.Event()

    def view_of(self, name: str) -> NodeView | None:
        """The freshest view of a node, from the cache or a full-Node request."""
        cached = self._cache_views().get(name)
        seen = self.seen.get(name)
        if cached is None or (
            seen is not None and seen.state and cached.state and seen.updated > cached.updated
        ):
            return seen if seen is not None else cached
        return cached

    def _views(self, args: wire.FilterArgs) -> tuple[list[str], list[NodeView | None]]:
        if args.node_names is not None:
            views = self._cache_views()
            return args.node_names, list(map(views.get, args.node_names))
        names, out = [], []
        for node in args.nodes or ():
            name = wire.node_name(node)
            meta = node.get("metadata") or {}
            annotations = meta.get("annotations") or {}
            text = annotations.get(self.annotation) if isinstance(annotations, dict) else None
            view = self.decider.view(text if isinstance(text, str) else None)
            self.seen[name] = view
            names.append(name)
            out.append(view)
        return names, out

    def _judge(self, demand: Demand, names: list[str], views: list[NodeView | None]) -> list[Verdict]:
        """The verdict per node (``views`` in the order of ``names``): the hot loop of filter."""
        decider = self.decider
        now = decider.now()
        max_age = decider.max_state_age
        reservations = self.reservations
        reserved = reservations.nodes()
        table = decider.table(demand)
        out: list[Verdict] = []
        for name, view in zip(names, views, strict=True):
            if view is None or view.problem or (max_age is not None and now - view.updated > max_age):
                out.append(Verdict(False, True, decider.unusable(view, now), 0))
            elif name in reserved:
                out.append(decider.verdict(demand, view, reservations.extra(name)))
            else:
                verdict = table.get(view.fp)
                out.append(verdict if verdict is not None else decider.fill(demand, view, table))
        return out

    def _decide(
        self, demand: Demand, names: list[str], views: list[NodeView | None]
    ) -> tuple[list[str], dict[str, str], dict[str, str], dict[str, int]]:
        """:meth:`_judge` split into passing nodes, failed ones, unresolvable ones and scores."""
        passing: list[str] = []
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        scores: dict[str, int] = {}
        for name, verdict in zip(names, self._judge(demand, names, views), strict=True):
            if verdict.fits:
                passing.append(name)
                scores[name] = verdict.score
            elif verdict.unresolvable:
                unresolvable[name] = verdict.reason
            else:
                failed[name] = verdict.reason
        return passing, failed, unresolvable, scores

    def _demand(self, pod: dict[str, Any]) -> Demand | None:
        demand = self.demands.of_pod(pod)
        self.memo.remember(pod, demand)
        return demand

    def filter(self, doc: Any) -> dict[str, Any]:
        """ExtenderArgs -> ExtenderFilterResult."""
        answer = self.filter_encoded(doc)
        return json.loads(answer) if isinstance(answer, bytes) else answer

    def filter_encoded(self, doc: Any) -> dict[str, Any] | bytes:
        """:meth:`filter` for the server: already encoded when it came from :class:`Answers`."""
        try:
            args = wire.parse_filter(doc)
        except wire.WireError as exc:
            return wire.filter_error(f"rdma-cni: bad ExtenderArgs: {exc}")
        names = args.names if args.node_names is not None else None
        if names is not None and not self.ready.is_set():
            return wire.filter_result(
                args, [], {}, {}, "rdma-cni: the extender's node cache is not synced yet"
            )
        try:
            demand = self._demand(args.pod)
        except InvalidPodRequest as exc:
            reason = f"rdma-cni: {exc.msg}"
            return wire.filter_result(args, [], {}, {n: reason for n in args.names})
        except wire.WireError as exc:
            return wire.filter_error(f"rdma-cni: bad ExtenderArgs: {exc}")
        if demand is None:
            return wire.filter_result(args, args.names, {}, {})
        uid = wire.pod_identity(args.pod)[2]
        if args.node_names is not None:
            names, views = self._lookup(args.node_names)
            answer = self.answers.filter(demand, names, views, self.decider.now())
            self._remember(uid, demand, answer.score, answer.passing, answer.prioritize_body)
            if log.isEnabledFor(logging.DEBUG):  # first: answer.failed is built per call
                self._log_detail(args.pod, answer.failed, self._cache_views())
            return answer.filter_body
        names, views = self._views(args)
        passing, failed, unresolvable, scores = self._decide(demand, names, views)
        self._remember(uid, demand, lambda node: scores.get(node, 0), None, b"")
        return wire.filter_result(args, passing, failed, unresolvable)

    def _lookup(self, names: list[str]) -> tuple[list[str], list[NodeView | None]]:
        """The cached views of ``names``, and ``names`` as a list equal to it.

        kube-scheduler sends the same node list for pod after pod. When the list
        equals the last one looked up (one C-level comparison) and the cache has
        not changed since, the last lookup's lists are reused: the names as the
        same objects, so that :class:`Answers` compares them by identity, and the
        views without hashing thousands of new strings again.
        """
        # The generation is read before the views: a change after this read bumps it, so lists
        # looked up during a change are never reused (the cache bumps after it changes its views).
        generation = self._cache_generation()
        last = self._last_lookup
        if generation is not None and last is not None and last[0] == generation and last[1] == names:
            return last[1], last[2]
        views = list(map(self._cache_views().get, names))
        if generation is not None:
            self._last_lookup = (generation, names, views)
        return names, views

    def _log_detail(self, pod: dict[str, Any], failed: dict[str, str], views: dict[str, NodeView]) -> None:
        # Reasons are short and shared; what each node has free is here, for whoever debugs.
        from rdma_cni import placement

        namespace, name, _ = wire.pod_identity(pod)
        for node, reason in failed.items():
            view = views.get(node)
            if view is None or view.state is None:
                continue
            pfs = nodestate.pf_states(view.state, self.reservations.extra(node))
            log.debug("filter %s/%s: %s: %s (%s)", namespace, name, node, reason, placement.free_summary(pfs))

    def _remember(
        self,
        uid: str,
        demand: Demand,
        score: Callable[[str], int],
        passing: list[str] | None,
        body: bytes,
    ) -> None:
        # kube-scheduler asks prioritize for the same pod next: its scores are computed now.
        if uid:
            if len(self._scores) >= _SCORES_KEPT:
                self._scores.clear()
            self._scores[uid] = (time.monotonic(), demand.key, score, passing, body)

    def prioritize(self, doc: Any) -> bytes:
        """ExtenderArgs -> HostPriorityList, encoded (0 for nodes that do not fit, and for non-RDMA pods)."""
        try:
            args = wire.parse_filter(doc)
            demand = self._demand(args.pod)
        except (wire.WireError, InvalidPodRequest):
            # Prioritize has no error field; filter already failed such a pod.
            return b"[]"
        if demand is None:
            return wire.priority_json((n, 0) for n in args.names)
        kept = self._scores.pop(wire.pod_identity(args.pod)[2], None)
        if kept is not None and kept[1] == demand.key and time.monotonic() - kept[0] < _SCORES_FRESH:
            if kept[3] is not None and args.names == kept[3]:
                return kept[4]  # the nodes filter passed, as kube-scheduler usually sends them
            score = kept[2]
            return wire.priority_json((n, score(n)) for n in args.names)
        names, views = self._views(args)
        _, _, _, scores = self._decide(demand, names, views)
        return wire.priority_json((n, scores.get(n, 0)) for n in names)

    def preempt(self, doc: Any) -> dict[str, Any]:
        """ExtenderPreemptionArgs -> ExtenderPreemptionResult (only nodes where eviction helps)."""
        try:
            args = wire.parse_preempt(doc)
            demand = self.demands.of_pod(args.pod)
        except (wire.WireError, InvalidPodRequest) as exc:
            log.warning("preempt: %s", getattr(exc, "msg", exc))
            return wire.preempt_result({}, {})
        if demand is None:
            return wire.preempt_result(args.victims, args.pdb_violations)
        kept = keep_nodes(demand, args.victims, self.view_of, self.reservations, self.decider)
        return wire.preempt_result(kept, args.pdb_violations)

    def bind(self, doc: Any) -> dict[str, Any]:
        """ExtenderBindingArgs -> ExtenderBindingResult."""
        try:
            args = wire.parse_bind(doc)
        except wire.WireError as exc:
            return wire.bind_result(f"rdma-cni: bad ExtenderBindingArgs: {exc}")
        if not self.ready.is_set():
            return wire.bind_result("rdma-cni: the extender is not ready (reservations not rebuilt yet)")
        return wire.bind_result(self.binder.bind(args))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body leave in one write (flushed after each request): with
    # two small writes, Nagle's algorithm and the client's delayed ACK add ~40 ms.
    wbufsize = 256 * 1024
    server: ExtenderServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        elif path == "/readyz":
            ready = self.server.extender.ready.is_set()
            self._send(200 if ready else 503, b"ok\n" if ready else b"not ready\n", "text/plain")
        else:
            self._send(404, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        verb = self.server.verbs.get(self.path.split("?", 1)[0].rstrip("/"))
        length = self.headers.get("Content-Length")
        if verb is None:
            self.close_connection = True  # its body is not read: the stream cannot be reused
            self._send(404, b"not found\n", "text/plain")
            return
        if length is None or not length.isdigit() or int(length) > MAX_BODY:
            self.close_connection = True
            self._send(
                411 if length is None else 413, b"a Content-Length up to 128 MiB is required\n", "text/plain"
            )
            return
        started = time.perf_counter()
        raw = self.rfile.read(int(length))
        try:
            doc = self.server.decoder.loads(raw)
        except (ValueError, RecursionError) as exc:
            doc = exc
        try:
            if isinstance(doc, Exception):
                answer: Any = self.server.bad_json(self.path, f"rdma-cni: request body is not JSON: {doc}")
            else:
                answer = verb(doc)
        except Exception as exc:  # a bug: still answer in the verb's format
            log.exception("%s failed", self.path)
            answer = self.server.bad_json(self.path, f"rdma-cni: internal error: {type(exc).__name__}: {exc}")
        body = answer if isinstance(answer, bytes) else json.dumps(answer, separators=(",", ":")).encode()
        self._send(200, body)
        log.debug(
            "%s: %d bytes in, %d out, %.2f ms",
            self.path,
            len(raw),
            len(body),
            (time.perf_counter() - started) * 1e3,
        )


class ExtenderServer(ThreadingHTTPServer):
    """A threaded HTTP server for an :class:`Extender`, optionally TLS."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self, address: tuple[str, int], extender: Extender, tls: ssl.SSLContext | None = None
    ) -> None:
        self.extender = extender
        self.verbs = {
            "/filter": extender.filter_encoded,
            "/prioritize": extender.prioritize,
            "/preempt": extender.preempt,
            "/bind": extender.bind,
        }
        self.tls = tls
        self.decoder = ArgsDecoder()
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = super().get_request()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            # The handshake happens on the handler thread's first read, not in the accept loop.
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def bad_json(self, path: str, message: str) -> Any:
        """The error answer in the format of the verb at ``path``."""
        verb = path.split("?", 1)[0].rstrip("/")
        if verb == "/prioritize":
            return b"[]"
        if verb == "/preempt":
            return wire.preempt_result({}, {})
        if verb == "/bind":
            return wire.bind_result(message)
        return wire.filter_error(message)
