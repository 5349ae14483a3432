"""``rdma-cni scheduler-extender``: parse the options, start the node cache, rebuild reservations, serve.

Start-up order matters for the no-over-commit guarantee: the server answers
from the start (``/healthz``, and full-Node filters need nothing else), but it
reports ready and accepts binds only after the node cache is synced and the
reservations of pods bound before a restart are rebuilt from the API.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import ssl
import sys
import threading
import time
from typing import Any, TextIO

from rdma_cni.cni.errors import InvalidPodRequest
from rdma_cni.extender.bind import DEFAULT_SCHEDULER_NAMES
from rdma_cni.extender.cache import NodeCache
from rdma_cni.extender.decide import Decider, Policy
from rdma_cni.extender.demand import Demand, Demands
from rdma_cni.extender.listener import UnauthenticatedListener, check_listener
from rdma_cni.extender.reservations import Reservations
from rdma_cni.extender.server import MAX_CONNECTIONS, ExtenderServer
from rdma_cni.extender.verbs import Extender
from rdma_cni.shared import placement
from rdma_cni.shared.podrequest import PodRequest, parse_request

__all__ = ["Service", "main", "parser", "rebuild_reservations"]

log = logging.getLogger("rdma_cni.extender")

_ANNOTATION_KEY = r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"--listen {value!r}: expected ADDR:PORT, e.g. 127.0.0.1:8888")
    return host.strip("[]") or "0.0.0.0", int(port)


def _metrics_listen(value: str) -> tuple[str, int]:
    try:
        return _listen(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"--metrics-listen {value!r}: expected ADDR:PORT, e.g. 0.0.0.0:9474"
        ) from None


class MetricsListenError(OSError):
    """The metrics port cannot be served (the message names it)."""


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0 or number != number or number == float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds")
    return number


def _connections(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= 100_000:
        raise argparse.ArgumentTypeError(f"--max-connections {value!r}: expected a number from 1 to 100000")
    return int(value)


def _default_request(value: str) -> PodRequest:
    try:
        return parse_request(value, "--default-request")
    except InvalidPodRequest as exc:
        raise argparse.ArgumentTypeError(exc.msg) from exc


def _annotation(value: str) -> str:
    if not re.fullmatch(_ANNOTATION_KEY, value):
        raise argparse.ArgumentTypeError(f"--annotation {value!r} is not a valid Kubernetes annotation key")
    return value


def _scheduler_name(value: str) -> str:
    # A profile's schedulerName: a DNS subdomain, as the API validates spec.schedulerName.
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", value):
        raise argparse.ArgumentTypeError(f"--scheduler-name {value!r} is not a valid scheduler name")
    return value


def parser() -> argparse.ArgumentParser:
    """The subcommand's options."""
    p = argparse.ArgumentParser(
        prog="rdma-cni scheduler-extender",
        description="kube-scheduler extender placing RDMA pods on nodes whose published state fits them.",
    )
    p.add_argument(
        "--listen",
        type=_listen,
        required=True,
        help="ADDR:PORT to serve on; any address but loopback (127.0.0.0/8, [::1]) needs --client-ca",
    )
    p.add_argument(
        "--probe-listen",
        type=_listen,
        default=None,
        help="ADDR:PORT serving only GET /healthz and /readyz in plain HTTP, for the kubelet's probes",
    )
    p.add_argument(
        "--metrics-listen",
        type=_metrics_listen,
        default=None,
        help="ADDR:PORT to serve Prometheus /metrics on, plain HTTP (default: off)",
    )
    p.add_argument(
        "--no-events",
        dest="events",
        action="store_false",
        help="do not post a BindingRefused Event on pods whose bind is refused",
    )
    p.add_argument("--kubeconfig", help="kubeconfig file (default: the in-cluster service account)")
    p.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", help="... and this key (PEM)")
    p.add_argument(
        "--client-ca",
        help="require a client certificate signed by this CA (PEM): kube-scheduler's extender "
        "tlsConfig certFile/keyFile; needs --tls-cert and --tls-key",
    )
    p.add_argument(
        "--client-name",
        action="append",
        default=[],
        help="accept only client certificates with this subject CN or DNS/URI SAN (repeatable)",
    )
    p.add_argument("--policy", choices=("binpack", "spread"), default="binpack", help="prioritize policy")
    p.add_argument(
        "--networks",
        default="",
        help="comma-separated network names (or ns/name); pods selecting one without the annotation "
        "get --default-request",
    )
    p.add_argument("--default-request", type=_default_request, default=None, help="JSON request, e.g. '[{}]'")
    p.add_argument("--max-state-age", type=_positive, default=None, help="seconds; older node states fail")
    p.add_argument("--reservation-ttl", type=_positive, default=300.0, help="seconds (default 300)")
    p.add_argument(
        "--annotation", type=_annotation, default="rdma_interfaces_required", help="pod annotation key"
    )
    p.add_argument(
        "--scheduler-name",
        type=_scheduler_name,
        action="append",
        dest="scheduler_names",
        default=None,
        help="spec.schedulerName of the pods bind accepts (repeatable; default rdma-scheduler)",
    )
    p.add_argument(
        "--max-connections",
        type=_connections,
        default=MAX_CONNECTIONS,
        help=f"connections served at once (default {MAX_CONNECTIONS}); half-open ones give way to new ones",
    )
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return p


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
            demand: Demand | None = demands.of_pod(pod)
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
        reservations.add(uid, meta.get("namespace") or "default", meta.get("name") or "", node, use)
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
        *,
        listen: tuple[str, int],
        tls: ssl.SSLContext | None = None,
        client_names: frozenset[str] = frozenset(),
        probe_listen: tuple[str, int] | None = None,
        policy: Policy = "binpack",
        networks: frozenset[str] = frozenset(),
        default_request: PodRequest | None = None,
        max_state_age: float | None = None,
        reservation_ttl: float = 300.0,
        annotation: str = "rdma_interfaces_required",
        scheduler_names: frozenset[str] = DEFAULT_SCHEDULER_NAMES,
        sweep_interval: float = 1.0,
        pod_check_interval: float = 10.0,
        backoff: tuple[float, float] = (0.2, 10.0),
        max_connections: int = MAX_CONNECTIONS,
        metrics_listen: tuple[str, int] | None = None,
        events: Any = None,
    ) -> None:
        self.client = client
        self.decider = Decider(policy=policy, max_state_age=max_state_age)
        self.demands = Demands(annotation=annotation, networks=networks, default_request=default_request)
        self.reservations = Reservations(reservation_ttl)
        self.cache = NodeCache(
            client,
            self.decider,
            on_view=lambda name, view: self.reservations.observe(name, view.uids),
            backoff=backoff,
        )
        self.extender = Extender(
            decider=self.decider,
            demands=self.demands,
            reservations=self.reservations,
            client=client,
            cache_views=lambda: self.cache.views,
            cache_generation=lambda: self.cache.generation,
            scheduler_names=scheduler_names,
        )
        self.server = ExtenderServer(
            listen, self.extender, tls, client_names, max_connections=max_connections
        )
        self.probe_server: ExtenderServer | None = None
        if probe_listen is not None:
            try:
                self.probe_server = ExtenderServer(probe_listen, self.extender, probes_only=True)
            except BaseException:
                self.server.server_close()
                raise
        self.events = events  # an rdma_cni.kube.events.EventSink, or None
        if events is not None:
            self.extender.binder.on_refused = self._tell_refused
        self.metrics_server: Any = None
        if metrics_listen is not None:
            from rdma_cni.extender import metrics

            metrics.watch(self)
            try:
                self.metrics_server = metrics.serve(metrics_listen)
            except OSError as exc:
                self.server.server_close()
                if self.probe_server is not None:
                    self.probe_server.server_close()
                where = "{}:{}".format(*metrics_listen)
                raise MetricsListenError(f"cannot serve metrics on {where}: {exc}") from exc
        self.sweep_interval = sweep_interval
        self.pod_check_interval = pod_check_interval
        self.backoff = backoff
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> tuple[str, int]:
        """The address served (the port is the real one when 0 was asked)."""
        host, port = self.server.server_address[:2]
        return str(host), int(port)

    @property
    def probe_address(self) -> tuple[str, int] | None:
        """The address of the probes' listener, if any."""
        if self.probe_server is None:
            return None
        host, port = self.probe_server.server_address[:2]
        return str(host), int(port)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where /metrics is served (None: not served)."""
        if self.metrics_server is None:
            return None
        host, port = self.metrics_server.server_address[:2]
        return str(host), int(port)

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
        """End reservations by TTL, and those whose pod is gone (checked less often: API calls)."""
        last_check = time.monotonic()
        while not self.stopping.wait(self.sweep_interval):
            self.reservations.expire()
            if time.monotonic() - last_check >= self.pod_check_interval:
                last_check = time.monotonic()
                self.check_pods()

    def check_pods(self) -> None:
        """End the reservations of pods deleted, replaced (other uid) or finished."""
        from rdma_cni.kube import client as kubeapi

        for res in self.reservations.all():
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


def main(argv: list[str], out: TextIO) -> int:
    """Entry point of ``rdma-cni scheduler-extender``."""
    args = parser().parse_args(argv)
    root = logging.getLogger("rdma_cni")
    root.setLevel(args.log_level.upper())
    for handler in root.handlers:
        handler.setLevel(args.log_level.upper())  # a long-running server logs at the chosen level
    if bool(args.tls_cert) != bool(args.tls_key):
        sys.stderr.write("rdma-cni scheduler-extender: --tls-cert and --tls-key go together\n")
        return 2
    if args.client_ca and not args.tls_cert:
        sys.stderr.write("rdma-cni scheduler-extender: --client-ca needs --tls-cert and --tls-key\n")
        return 2
    if args.client_name and not args.client_ca:
        sys.stderr.write("rdma-cni scheduler-extender: --client-name needs --client-ca\n")
        return 2
    if not args.client_ca:
        try:
            check_listener(args.listen[0], None)  # before anything is loaded or bound
        except UnauthenticatedListener as exc:
            sys.stderr.write(f"rdma-cni scheduler-extender: {exc}\n")
            return 2
    networks = frozenset(n.strip() for n in args.networks.split(",") if n.strip())
    if networks and args.default_request is None:
        args.default_request = parse_request("[{}]", "--default-request")
    from rdma_cni.cni.errors import CniError
    from rdma_cni.kube import client as kubeapi
    from rdma_cni.kube.events import EventSink

    tls = None
    if args.tls_cert:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            tls.load_cert_chain(args.tls_cert, args.tls_key)
        except (OSError, ssl.SSLError) as exc:
            sys.stderr.write(f"rdma-cni scheduler-extender: cannot load --tls-cert/--tls-key: {exc}\n")
            return 1
        if args.client_ca:
            try:
                tls.load_verify_locations(cafile=args.client_ca)
            except (OSError, ssl.SSLError) as exc:
                sys.stderr.write(f"rdma-cni scheduler-extender: cannot load --client-ca: {exc}\n")
                return 1
            tls.verify_mode = ssl.CERT_REQUIRED
    try:
        client = kubeapi.ApiClient.from_kubeconfig(args.kubeconfig)
    except CniError as exc:
        sys.stderr.write(f"rdma-cni scheduler-extender: {exc.msg}\n")
        return 1
    try:
        service = Service(
            client,
            listen=args.listen,
            tls=tls,
            policy=args.policy,
            networks=networks,
            default_request=args.default_request,
            max_state_age=args.max_state_age,
            reservation_ttl=args.reservation_ttl,
            annotation=args.annotation,
            scheduler_names=frozenset(args.scheduler_names or DEFAULT_SCHEDULER_NAMES),
            client_names=frozenset(args.client_name),
            probe_listen=args.probe_listen,
            max_connections=args.max_connections,
            metrics_listen=args.metrics_listen,
            events=EventSink(client.post, "rdma-cni-extender") if args.events else None,
        )
    except UnauthenticatedListener as exc:  # a host name that resolved to a non-loopback address
        sys.stderr.write(f"rdma-cni scheduler-extender: {exc}\n")
        client.close()
        return 2
    except MetricsListenError as exc:
        sys.stderr.write(f"rdma-cni scheduler-extender: {exc}\n")
        return 1
    except OSError as exc:
        where = "{}:{}".format(*args.listen)
        if args.probe_listen is not None:
            where += " or --probe-listen {}:{}".format(*args.probe_listen)
        sys.stderr.write(f"rdma-cni scheduler-extender: cannot listen on {where}: {exc}\n")
        return 1
    done = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    service.start()
    host, port = service.address
    announced: dict[str, Any] = {
        "listening": f"{host}:{port}",
        "tls": tls is not None,
        "client_ca": bool(args.client_ca),
    }
    if service.probe_address is not None:
        announced["probes"] = "{}:{}".format(*service.probe_address)
    if service.metrics_address is not None:
        announced["metrics"] = "{}:{}".format(*service.metrics_address)
    out.write(json.dumps(announced) + "\n")
    out.flush()
    while not done.wait(1.0):
        pass
    service.stop()
    client.close()
    return 0
