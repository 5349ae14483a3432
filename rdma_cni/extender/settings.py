"""The extender's settings: one frozen object, each field with its default and its flag, handed down whole.

Every field says how the command line sets it, next to its default: an
:func:`option` (its flag, checked as it is parsed, and its help) or
:func:`internal` (no flag: the service's housekeeping, which tests shorten).
:mod:`rdma_cni.extender.options` builds the parser from these fields, so a
flag always sets the field it was declared on and its default is the
field's; ``main`` hands the object to
:class:`~rdma_cni.extender.service.Service`, which hands it to the parts
that read it (:class:`~rdma_cni.extender.decide.Decider`,
:mod:`rdma_cni.extender.rules`, :class:`~rdma_cni.extender.verbs.Extender`).
A new option is a field here and its use in the one module that needs it.

Standard library and ``shared/`` only (the ``ADDR:PORT`` parser is
:mod:`rdma_cni.httpd.exporter`'s, which loads nothing at import), and nothing of
the HTTP side: the verbs read it.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

from rdma_cni.httpd.exporter import address_option
from rdma_cni.shared.errors import InvalidPodRequest
from rdma_cni.shared.names import annotation_key
from rdma_cni.shared.podrequest import PodRequest, parse_request

__all__ = ["DECISION_SHARE", "Flag", "Settings", "flag_of", "internal", "option"]

# The share of kube-scheduler's httpTimeout a filter or prioritize may spend deciding: past it the
# request is abandoned (answered with an Error), well before kube-scheduler gives up on the answer.
DECISION_SHARE = 0.5


@dataclass(frozen=True)
class Flag:
    """How the command line sets one field: argparse's arguments for its flag (``dest`` is the field).

    ``help`` may say ``%(default)s``: the field's default (a repeatable flag's, its names joined by
    commas). ``collect`` turns what a repeatable flag gathered (a list, None when it was not given)
    into the field's value.
    """

    help: str
    flag: str = ""  # "": --<the field's name, '_' as '-'>
    type: Callable[[str], Any] | None = None
    action: str | None = None
    choices: tuple[str, ...] | None = None
    required: bool = False
    collect: Callable[[list[Any]], Any] | None = None


def option(default: Any, help: str, **flag: Any) -> Any:
    """A field the command line sets: its default and its :class:`Flag`."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, **flag)})


def internal(default: Any) -> Any:
    """A field no flag sets (the service's housekeeping; tests change it)."""
    return dataclasses.field(default=default, metadata={"flag": None})


def flag_of(field: dataclasses.Field[Any]) -> Flag | None:
    """The field's :class:`Flag` (None: :func:`internal`); a field that says neither is a mistake,
    refused here, so that no field can be left without a way to be set."""
    if "flag" not in field.metadata:
        raise TypeError(f"Settings.{field.name}: declare it with option() or internal()")
    return field.metadata["flag"]


# -- what each flag accepts, checked as it is parsed (argparse exits with code 2 otherwise) ------------


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0 or number != number or number == float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds")
    return number


def _count(flag: str, low: int, high: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        if not value.isdigit() or not low <= int(value) <= high:
            raise argparse.ArgumentTypeError(f"{flag} {value!r}: expected a number from {low} to {high}")
        return int(value)

    return parse


def _default_request(value: str) -> PodRequest:
    try:
        return parse_request(value, "--default-request")
    except InvalidPodRequest as exc:
        raise argparse.ArgumentTypeError(exc.msg) from exc


def _timeout(value: str) -> float:
    seconds = _positive(value)
    if seconds > 600:
        raise argparse.ArgumentTypeError(f"--http-timeout {value!r}: at most 600 seconds")
    return seconds


def _networks(value: str) -> frozenset[str]:
    return frozenset(n.strip() for n in value.split(",") if n.strip())


def _annotation(value: str) -> str:
    if not annotation_key(value):
        raise argparse.ArgumentTypeError(f"--annotation {value!r} is not a valid Kubernetes annotation key")
    return value


def _scheduler_name(value: str) -> str:
    # A profile's schedulerName: a DNS subdomain, as the API validates spec.schedulerName.
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", value):
        raise argparse.ArgumentTypeError(f"--scheduler-name {value!r} is not a valid scheduler name")
    return value


def _names(given: Collection[str]) -> frozenset[str]:
    return frozenset(given)


@dataclass(frozen=True, slots=True)
class Settings:
    """Every setting of ``rdma-cni scheduler-extender`` (see docs/scheduling.md for the options)."""

    listen: tuple[str, int] = option(
        ("127.0.0.1", 8888),
        "ADDR:PORT to serve on; any address but loopback (127.0.0.0/8, [::1]) needs --client-ca",
        type=address_option("--listen", "127.0.0.1:8888"),
        required=True,
    )
    probe_listen: tuple[str, int] | None = option(
        None,
        "ADDR:PORT serving only GET /healthz and /readyz in plain HTTP, for the kubelet's probes",
        type=address_option("--probe-listen", "127.0.0.1:8888"),
    )
    metrics_listen: tuple[str, int] | None = option(
        None,
        "ADDR:PORT to serve Prometheus /metrics on, plain HTTP (default: off)",
        type=address_option("--metrics-listen", "0.0.0.0:9474"),
    )
    events: bool = option(
        True,
        "do not post a BindingRefused Event on pods whose bind is refused",
        flag="--no-events",
        action="store_false",
    )
    kubeconfig: str | None = option(None, "kubeconfig file (default: the in-cluster service account)")
    tls_cert: str | None = option(None, "serve HTTPS with this certificate (PEM)")
    tls_key: str | None = option(None, "... and this key (PEM)")
    client_ca: str | None = option(
        None,
        "require a client certificate signed by this CA (PEM): kube-scheduler's extender "
        "tlsConfig certFile/keyFile; needs --tls-cert and --tls-key",
    )
    client_names: frozenset[str] = option(
        frozenset(),
        "accept only client certificates with this subject CN or DNS/URI SAN (repeatable)",
        flag="--client-name",
        action="append",
        collect=_names,
    )
    policy: Literal["binpack", "spread"] = option(
        "binpack", "prioritize policy", choices=("binpack", "spread")
    )
    networks: frozenset[str] = option(
        frozenset(),
        "comma-separated network names (or ns/name); pods selecting one without the annotation "
        "get --default-request",
        type=_networks,
    )
    default_request: PodRequest | None = option(None, "JSON request, e.g. '[{}]'", type=_default_request)
    max_state_age: float | None = option(None, "seconds; older node states fail", type=_positive)
    reservation_ttl: float = option(300.0, "seconds (default %(default)s)", type=_positive)
    annotation: str = option("rdma_interfaces_required", "pod annotation key", type=_annotation)
    scheduler_names: frozenset[str] = option(
        frozenset({"rdma-scheduler"}),
        "spec.schedulerName of the pods bind accepts (repeatable; default %(default)s)",
        flag="--scheduler-name",
        type=_scheduler_name,
        action="append",
        collect=_names,
    )
    max_connections: int = option(
        256,
        "connections served at once (default %(default)s); half-open ones give way to new ones",
        type=_count("--max-connections", 1, 100_000),
    )
    # kube-scheduler's httpTimeout for this extender, in seconds (conf/ sets 10 s).
    http_timeout: float = option(
        10.0,
        "seconds: kube-scheduler's httpTimeout for this extender (default %(default)s, as conf/ sets it); "
        "a filter or prioritize still deciding after half of it is abandoned",
        type=_timeout,
    )
    # Filter passes at most this many fitting nodes, the policy's best (0: every fitting node).
    best_nodes: int = option(
        0,
        "filter passes at most this many fitting nodes, the policy's best (default %(default)s; "
        "0: every fitting node)",
        type=_count("--best-nodes", 0, 100_000),
    )
    # kube-scheduler's percentageOfNodesToScore for the profile that calls this extender (0: its
    # adaptive default); says when a list of nodes is a sample (see resample).
    percentage_of_nodes_to_score: int = option(
        0,
        "the percentageOfNodesToScore of kube-scheduler's profile (default 0: its adaptive "
        "default; 100: kube-scheduler sends every feasible node)",
        type=_count("--percentage-of-nodes-to-score", 0, 100),
    )
    log_level: str = option(
        "info", "log level (default %(default)s)", choices=("debug", "info", "warning", "error")
    )
    # Not options: the service's housekeeping periods and the API's retry backoff (tests shorten them),
    # and whether pod watches end reservations (tests of the pod reads turn them off).
    sweep_interval: float = internal(1.0)
    # How often the TLS files are looked at for a rotated certificate (a stat each; extender/certs.py).
    tls_check_interval: float = internal(10.0)
    pod_check_interval: float = internal(10.0)
    pod_watch: bool = internal(True)
    backoff: tuple[float, float] = internal((0.2, 10.0))

    @property
    def decision_timeout(self) -> float:
        """Seconds a filter or prioritize may spend deciding before it is abandoned."""
        return self.http_timeout * DECISION_SHARE
