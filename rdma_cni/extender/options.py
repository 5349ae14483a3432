"""The options of ``rdma-cni scheduler-extender``, each checked as it is parsed, as one :class:`Settings`."""

from __future__ import annotations

import argparse
import dataclasses
import re

from rdma_cni import exporter
from rdma_cni.cni.errors import InvalidPodRequest
from rdma_cni.extender.server import MAX_CONNECTIONS
from rdma_cni.extender.settings import Settings
from rdma_cni.shared.podrequest import PodRequest, parse_request

__all__ = ["parser", "settings"]

_ANNOTATION_KEY = r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"

_listen = exporter.address_option("--listen", "127.0.0.1:8888")
_metrics_listen = exporter.address_option("--metrics-listen", "0.0.0.0:9474")


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


def _best_nodes(value: str) -> int:
    if not value.isdigit() or not 0 <= int(value) <= 100_000:
        raise argparse.ArgumentTypeError(f"--best-nodes {value!r}: expected a number from 0 to 100000")
    return int(value)


def _percentage(value: str) -> int:
    if not value.isdigit() or not 0 <= int(value) <= 100:
        raise argparse.ArgumentTypeError(
            f"--percentage-of-nodes-to-score {value!r}: expected a number from 0 to 100"
        )
    return int(value)


def _timeout(value: str) -> float:
    seconds = _positive(value)
    if seconds > 600:
        raise argparse.ArgumentTypeError(f"--http-timeout {value!r}: at most 600 seconds")
    return seconds


def _networks(value: str) -> frozenset[str]:
    return frozenset(n.strip() for n in value.split(",") if n.strip())


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
        type=_networks,
        default=frozenset(),
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
    p.add_argument(
        "--http-timeout",
        type=_timeout,
        default=10.0,
        help="seconds: kube-scheduler's httpTimeout for this extender (default 10, as conf/ sets it); "
        "a filter or prioritize still deciding after half of it is abandoned",
    )
    p.add_argument(
        "--best-nodes",
        type=_best_nodes,
        default=Settings().best_nodes,
        help=f"filter passes at most this many fitting nodes, the policy's best (default "
        f"{Settings().best_nodes}; 0: every fitting node)",
    )
    p.add_argument(
        "--percentage-of-nodes-to-score",
        type=_percentage,
        default=Settings().percentage_of_nodes_to_score,
        help="the percentageOfNodesToScore of kube-scheduler's profile (default 0: its adaptive "
        "default; 100: kube-scheduler sends every feasible node)",
    )
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return p


def settings(argv: list[str]) -> Settings:
    """The options of ``argv`` as settings (argparse exits with code 2 on a bad one).

    Every option sets the field of its name; fields without an option keep their default.
    """
    args = parser().parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings) if hasattr(args, f.name)}
    given["client_names"] = frozenset(args.client_name)
    given["scheduler_names"] = frozenset(args.scheduler_names or Settings().scheduler_names)
    if given["networks"] and given["default_request"] is None:
        # A network selected without a request gets one VF of no rate, as the plugin's default.
        given["default_request"] = parse_request("[{}]", "--default-request")
    return Settings(**given)
