"""What a pod asks of the extender: its RDMA request, or None when it is not an RDMA pod.

The request comes from the same annotation and parser as the plugin's ADD
(:mod:`rdma_cni.shared.podrequest`: same limits, same error text). A pod without the
annotation that selects one of ``--networks`` in Multus' network annotation is
placed with ``--default-request``, as the plugin would place it with the
network's ``defaultRequest``; any other pod without it is not ours.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rdma_cni.extender.wire import pod_annotations, pod_identity
from rdma_cni.shared import placement
from rdma_cni.shared.podrequest import MAX_REQUEST_BYTES, PodRequest, parse_request

__all__ = ["NETWORKS_ANNOTATION", "Demand", "Demands", "selected_networks"]

NETWORKS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
_MEMO_LIMIT = 4096


@dataclass(frozen=True)
class Demand:
    """A pod's interfaces as placement requests; ``key`` identifies the request up to order."""

    requests: tuple[placement.Request, ...]
    key: tuple[tuple[int, int], ...]
    source: str
    # Derived once, read per node: (min, max) largest first (best fit's order), the min rates' sum.
    wants: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    min_total: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "wants", self.key[::-1])
        object.__setattr__(self, "min_total", sum(low for low, _ in self.key))

    @classmethod
    def of(cls, request: PodRequest, source: str) -> Demand:
        """From a validated request."""
        reqs = tuple(placement.Request(i.min_tx_rate, i.max_tx_rate) for i in request.interfaces)
        # Whether a request fits does not depend on the order of its interfaces.
        key = tuple(sorted((r.min_tx_rate, r.max_tx_rate) for r in reqs))
        return cls(reqs, key, source)


def selected_networks(pod_namespace: str, value: Any) -> list[tuple[str, str]]:
    """(namespace, name) of each network a Multus ``networks`` annotation selects.

    Both forms Multus accepts: ``"a, ns/b, c@net2"`` and a JSON list of
    ``{"name", "namespace", "interface"}``. A malformed value selects nothing
    (Multus refuses such a pod anyway).
    """
    if not isinstance(value, str) or len(value) > MAX_REQUEST_BYTES:
        return []
    text = value.strip()
    out = []
    if text.startswith("["):
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):
            return []
        if not isinstance(items, list):
            return []
        for item in items:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                namespace = item.get("namespace")
                out.append(
                    (namespace if isinstance(namespace, str) and namespace else pod_namespace, item["name"])
                )
        return out
    for entry in text.split(","):
        entry = entry.strip().split("@", 1)[0]
        if not entry:
            continue
        namespace, _, name = entry.rpartition("/")
        out.append((namespace or pod_namespace, name))
    return out


class Demands:
    """Turns Pod objects into demands; successful parses are memoized by annotation text."""

    def __init__(
        self,
        *,
        annotation: str,
        networks: frozenset[str] = frozenset(),
        default_request: PodRequest | None = None,
    ) -> None:
        self.annotation = annotation
        # "name" matches the network in any namespace, "ns/name" only there.
        self.networks = networks
        self.default_request = default_request
        self._memo: dict[str, PodRequest] = {}

    def _selects(self, namespace: str, annotations: Mapping[str, Any]) -> bool:
        for net_ns, name in selected_networks(namespace, annotations.get(NETWORKS_ANNOTATION)):
            if name in self.networks or f"{net_ns}/{name}" in self.networks:
                return True
        return False

    def of_pod(self, pod: Mapping[str, Any]) -> Demand | None:
        """The pod's demand, None when it is not an RDMA pod; InvalidPodRequest when malformed."""
        namespace, name, _ = pod_identity(pod)
        annotations = pod_annotations(pod)
        raw = annotations.get(self.annotation)
        if raw is None:
            if self.default_request is not None and self._selects(namespace, annotations):
                return Demand.of(self.default_request, f"defaultRequest (pod {namespace}/{name})")
            return None
        source = f"pod {namespace}/{name} annotation {self.annotation}"
        request = self._memo.get(raw) if isinstance(raw, str) else None
        if request is None:
            request = parse_request(raw, source)
            if isinstance(raw, str):
                if len(self._memo) >= _MEMO_LIMIT:
                    self._memo.clear()
                self._memo[raw] = request
        return Demand.of(request, source)
