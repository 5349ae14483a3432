"""The extender's settings: one frozen object, built from the options once, handed down whole.

:mod:`rdma_cni.extender.options` builds it from the command line (every
field an option of the same name sets; the others keep their default) and
``main`` hands it to :class:`~rdma_cni.extender.service.Service`, which hands
it to the parts that read it (:class:`~rdma_cni.extender.decide.Decider`,
:class:`~rdma_cni.extender.verbs.Extender`). A new option is a field here,
its flag in ``options``, and its use in the one module that needs it.

Standard library only, and nothing of the HTTP side: the verbs read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["DECISION_SHARE", "Settings"]

# The share of kube-scheduler's httpTimeout a filter or prioritize may spend deciding: past it the
# request is abandoned (answered with an Error), well before kube-scheduler gives up on the answer.
DECISION_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class Settings:
    """Every setting of ``rdma-cni scheduler-extender`` (see docs/scheduling.md for the options)."""

    listen: tuple[str, int] = ("127.0.0.1", 8888)
    probe_listen: tuple[str, int] | None = None
    metrics_listen: tuple[str, int] | None = None
    events: bool = True
    kubeconfig: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    client_ca: str | None = None
    client_names: frozenset[str] = frozenset()
    policy: Literal["binpack", "spread"] = "binpack"
    networks: frozenset[str] = frozenset()
    # A PodRequest (typed loosely: this module imports no parser).
    default_request: Any = None
    max_state_age: float | None = None
    reservation_ttl: float = 300.0
    annotation: str = "rdma_interfaces_required"
    scheduler_names: frozenset[str] = frozenset({"rdma-scheduler"})
    max_connections: int = 256
    # kube-scheduler's httpTimeout for this extender, in seconds (conf/ sets 10 s).
    http_timeout: float = 10.0
    # Filter passes at most this many fitting nodes, the policy's best (0: every fitting node).
    best_nodes: int = 0
    # kube-scheduler's percentageOfNodesToScore for the profile that calls this extender (0: its
    # adaptive default); says when a list of nodes is a sample (see resample).
    percentage_of_nodes_to_score: int = 0
    log_level: str = "info"
    # Not options: the service's housekeeping periods and the API's retry backoff (tests shorten them),
    # and whether pod watches end reservations (tests of the pod reads turn them off).
    sweep_interval: float = 1.0
    pod_check_interval: float = 10.0
    pod_watch: bool = True
    backoff: tuple[float, float] = (0.2, 10.0)

    @property
    def decision_timeout(self) -> float:
        """Seconds a filter or prioritize may spend deciding before it is abandoned."""
        return self.http_timeout * DECISION_SHARE
