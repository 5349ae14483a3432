"""The extender's parts wired together: node cache, reservations, decisions, HTTP servers, metrics.

Start-up order matters for the no-over-commit guarantee: the server answers
from the start (``/healthz``, and full-Node filters need nothing else), but it
reports ready and accepts binds only after the node cache is synced and the
reservations of pods bound before a restart are rebuilt from the API
(:func:`rebuild_reservations`).
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from dataclasses import replace
from typing import Any

from rdma_cni.cni.errors import InvalidPodRequest
from rdma_cni.extender.cache import NodeCache
from rdma_cni.extender.certs import ServingTls
from rdma_cni.extender.decide import Decider
from rdma_cni.extender.demand import Demand, Demands
from rdma_cni.extender.podwatch import PodWatch
from rdma_cni.extender.reservations import Reservations
from rdma_cni.extender.retry import Retrier
from rdma_cni.extender.server import ExtenderServer
from rdma_cni.extender.settings import Settings
from rdma_cni.extender.verbs import Extender
from rdma_cni.shared import placement

__all__ = ["MetricsListenError", "Service", "rebuild_reservations"]

# The extender's logger since before the split (log configurations name it).
log = logging.getLogger("rdma_cni.extender")


def _bound(server: Any) -> tuple[str, int] | None:
    """The (host, port) ``server`` is bound to; None without a server."""
    if server is None:
        return None
    host, port = server.server_address[:2]
    return str(host), int(port)


class MetricsListenError(OSError):
    """The metrics port cannot be served (the message names it)."""


def rebuild_reservations(
    client: Any, cache: NodeCache, demands: Demands, decider: Decider, reservations: Reservations
) -> int:
    """Reserve for pods bound to a node whose published allocations do not list them yet.

    Run after the node cache is synced and before the extender reports ready;
    returns how many reservations were made.
    """
    doc = client.list("/api/v1/pods", {"fieldSelector": "spec.nodeName!="})
    made = 0
    for pod in doc.get("items") or []:
        meta = pod.get("metadata") or {}
        node = (pod.get("spec") or {}).get("nodeName")
        uid = meta.get("uid")
        if not node or not uid or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        try:
            # Bound already: its ADD takes the annotation's demand, whatever the pod declared.
            demand: Demand | None = demands.of_pod(pod, check_declared=False)
        except (InvalidPodRequest, ValueError):
            continue
        view = cache.views.get(node)
        if demand is None or view is None or view.state is None or uid in view.uids:
            continue
        verdict = decider.verdict(demand, view, reservations.extra(node))
        if not verdict.fits:
            # Bound before the restart but not fitting now: ADD will refuse it; nothing to hold.
            log.warning(
                "pod %s/%s is bound to %s but does not fit its state: %s",
                meta.get("namespace"),
                meta.get("name"),
                node,
                verdict.reason,
            )
            continue
        try:
            use = decider.use(demand, view, reservations.extra(node))
        except placement.NoFit:
            continue
        scheduler = (pod.get("spec") or {}).get("schedulerName") or "default-scheduler"
        reservations.add(
            uid, meta.get("namespace") or "default", meta.get("name") or "", node, use, scheduler=scheduler
        )
        made += 1
    return made


class Service:
    """The extender's parts wired together: node cache, reservations, decisions, HTTP server.

    ``start`` serves at once and becomes ready once the cache is synced and
    the reservations are rebuilt; the subcommand and the tests use the same wiring.
    """

    def __init__(
        self,
        client: Any,
        settings: Settings | None = None,
        *,
        tls: ssl.SSLContext | None = None,
        serving_tls: ServingTls | None = None,
        events: Any = None,
        **overrides: Any,
    ) -> None:
        """Wire the parts for ``settings`` (handed down whole); ``overrides`` replace some of its fields
        (tests), ``tls`` is the server's context, or ``serving_tls`` its files (re-read when they
        change), and ``events`` an EventSink (or None)."""
        settings = replace(settings or Settings(), **overrides)
        self.serving_tls = serving_tls
        if serving_tls is not None:
            tls = serving_tls.context
        self.settings = settings
        self.client = client
        self.decider = Decider(settings=settings)
        self.demands = Demands(
            annotation=settings.annotation,
            networks=settings.networks,
            default_request=settings.default_request,
        )
        self.reservations = Reservations(settings.reservation_ttl)
        self.cache = NodeCache(client, self.decider, on_view=self._viewed, backoff=settings.backoff)
        # Makes kube-scheduler retry a pod filter refused once a node has room (docs/scheduling.md).
        self.retrier = Retrier(
            client,
            self.decider,
            self.demands,
            self.reservations,
            lambda: self.cache.views,
            settings.scheduler_names,
        )
        self.extender = Extender(
            decider=self.decider,
            demands=self.demands,
            reservations=self.reservations,
            client=client,
            cache_views=lambda: self.cache.views,
            cache_generation=lambda: self.cache.generation,
            settings=settings,
            retrier=self.retrier,
        )
        self.server = ExtenderServer(
            settings.listen,
            self.extender,
            tls,
            settings.client_names,
            max_connections=settings.max_connections,
        )
        if serving_tls is not None:
            # The expiry of kube-scheduler's client certificate, for the metric: seen at each handshake.
            self.server.peer_seen = serving_tls.seen_client
        self.probe_server: ExtenderServer | None = None
        if settings.probe_listen is not None:
            try:
                self.probe_server = ExtenderServer(settings.probe_listen, self.extender, probes_only=True)
            except BaseException:
                self.server.server_close()
                raise
        self.events = events  # an rdma_cni.kube.events.EventSink, or None
        if events is not None:
            self.extender.binder.on_refused = self._tell_refused
        self.metrics_server: Any = None
        if settings.metrics_listen is not None:
            self._serve_metrics(settings.metrics_listen)
        # One pod watch per scheduler name served: a pod deleted or finished ends its reservation at once.
        self.pod_watches = [
            PodWatch(client, self.reservations, name, backoff=settings.backoff, on_gone=self.retrier.passed)
            for name in sorted(settings.scheduler_names)
            if settings.pod_watch
        ]
        self.sweep_interval = settings.sweep_interval
        self.pod_check_interval = settings.pod_check_interval
        self.backoff = settings.backoff
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def _viewed(self, name: str, view: Any) -> None:
        """The node cache applied a view: the node's published pods end their reservations, and a
        node with more room may owe pods a retry."""
        self.reservations.observe(name, view.uids)
        self.retrier.viewed(name, view)

    def _serve_metrics(self, address: tuple[str, int]) -> None:
        """Serve /metrics on ``address``; else close the servers and raise :class:`MetricsListenError`."""
        from rdma_cni.extender import metrics

        metrics.watch(self)
        try:
            self.metrics_server = metrics.serve(address)
        except OSError as exc:
            self.server.server_close()
            if self.probe_server is not None:
                self.probe_server.server_close()
            where = "{}:{}".format(*address)
            raise MetricsListenError(f"cannot serve metrics on {where}: {exc}") from exc

    @property
    def address(self) -> tuple[str, int]:
        """The address served (the port is the real one when 0 was asked)."""
        bound = _bound(self.server)
        assert bound is not None
        return bound

    @property
    def probe_address(self) -> tuple[str, int] | None:
        """The address of the probes' listener, if any."""
        return _bound(self.probe_server)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where /metrics is served (None: not served)."""
        return _bound(self.metrics_server)

    def _tell_refused(self, args: Any, reason: str, error: str) -> None:
        """A Warning Event on the pod whose bind was refused: queued, never waited for."""
        self.events.emit(
            kind="Pod",
            namespace=args.pod_namespace,
            name=args.pod_name,
            uid=args.pod_uid,
            reason="BindingRefused",
            message=f"{error} [{reason}]",
        )

    def start(self) -> Service:
        """Serve in background threads; readiness follows the cache and the rebuild."""
        targets = [
            (self.server.serve_forever, "http"),
            (self._startup, "startup"),
            (self._housekeeping, "housekeeping"),
        ]
        if self.probe_server is not None:
            targets.append((self.probe_server.serve_forever, "probes"))
        for target, name in targets:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop serving and following the API."""
        self.stopping.set()
        self.cache.stop()
        self.retrier.stop()
        for watch in self.pod_watches:
            watch.stop()
        self.server.shutdown()
        self.server.server_close()
        if self.probe_server is not None:
            self.probe_server.shutdown()
            self.probe_server.server_close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        if self.events is not None:
            self.events.close()

    def _startup(self) -> None:
        from rdma_cni.kube import client as kubeapi

        self.cache.start()
        for watch in self.pod_watches:
            watch.start()
        self.retrier.start()
        delay = self.backoff[0]
        while not self.stopping.is_set():
            if not self.cache.synced.wait(0.2):
                continue
            try:
                made = rebuild_reservations(
                    self.client, self.cache, self.demands, self.decider, self.reservations
                )
            except kubeapi.ApiError as exc:
                log.warning("rebuilding reservations failed (%s); retrying in %.1f s", exc, delay)
                self.stopping.wait(delay)
                delay = min(self.backoff[1], delay * 2)
                continue
            log.info("ready: %d nodes, %d reservations rebuilt", len(self.cache.views), made)
            self.extender.ready.set()
            return

    def _housekeeping(self) -> None:
        """End reservations by TTL, and those whose pod is gone (checked less often: API calls); serve
        a rotated certificate once its files change."""
        last_check = last_tls = time.monotonic()
        while not self.stopping.wait(self.sweep_interval):
            self.reservations.expire()
            if time.monotonic() - last_check >= self.pod_check_interval:
                last_check = time.monotonic()
                self.check_pods()
            if (
                self.serving_tls is not None
                and time.monotonic() - last_tls >= self.settings.tls_check_interval
            ):
                last_tls = time.monotonic()
                self.check_tls()

    def check_tls(self) -> bool:
        """Reload the TLS files if they changed; the next connection gets the new context (True)."""
        if self.serving_tls is None or not self.serving_tls.check():
            return False
        self.server.tls = self.serving_tls.context
        return True

    def check_pods(self) -> None:
        """End the reservations of pods deleted, replaced (other uid) or finished, that no pod watch
        covers; and settle Bindings whose outcome was unknown, by reading their pods."""
        from rdma_cni.kube import client as kubeapi

        watched = {watch.scheduler for watch in self.pod_watches if watch.synced.is_set()}
        for res in self.reservations.all():
            if res.confirmed and res.scheduler in watched:
                continue  # its pod watch ends it when the pod goes
            try:
                pod = self.client.get(f"/api/v1/namespaces/{res.namespace}/pods/{res.name}")
            except kubeapi.NotFound:
                self.reservations.drop(res.uid, "the pod is gone")
                continue
            except kubeapi.ApiError as exc:
                log.debug("cannot check pod %s/%s: %s", res.namespace, res.name, exc)
                continue
            meta = pod.get("metadata") or {}
            if meta.get("uid") != res.uid or (pod.get("status") or {}).get("phase") in (
                "Succeeded",
                "Failed",
            ):
                self.reservations.drop(res.uid, "the pod is gone")
            elif not res.confirmed:
                # A Binding whose answer was lost: the pod read back says whether it was applied.
                node = (pod.get("spec") or {}).get("nodeName")
                if node == res.node:
                    self.reservations.confirm(res.uid)
                else:
                    self.reservations.drop_exact(res, "read back: the Binding was not applied")
