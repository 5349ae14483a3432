"""What a pod asks of the extender: its RDMA request, or None when it is not an RDMA pod.

The request comes from the same rule and parser as the plugin's ADD
(:mod:`rdma_cni.shared.attachments`, :mod:`rdma_cni.shared.podrequest`: same
precedence, limits and error text). Each network of ``--networks`` the pod
selects in Multus' network annotation is one attachment: its ``cni-args``
request, else the pod-wide annotation, else ``--default-request`` (as the plugin
would use the network's ``defaultRequest``); the pod's demand is all of them. A
pod with the annotation that selects none of them counts it once; any other pod
is not ours.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

from rdma_cni.extender import declared
from rdma_cni.extender.bounded import Bounded
from rdma_cni.extender.wire import pod_annotations, pod_identity
from rdma_cni.shared import placement
from rdma_cni.shared.attachments import ARGS_KEY, Selection, attachment_request, pod_selections, selections
from rdma_cni.shared.multusnet import NETWORKS_ANNOTATION
from rdma_cni.shared.podrequest import PodRequest, parse_request

__all__ = ["NETWORKS_ANNOTATION", "Demand", "Demands", "selected_networks"]

# Annotation texts whose parse is kept, and the bytes they may hold: an annotation is up to 256 KiB
# (the API's limit for all of a pod's annotations), so a count alone would let 4,096 of them hold 1 GiB.
_MEMO_LIMIT = 4096
_MEMO_BYTES = 16 * 1024 * 1024
# A parsed interface's objects, estimated (a PodRequest, its InterfaceRequest, their strings).
_INTERFACE_BYTES = 512


@dataclass(frozen=True)
class Demand:
    """A pod's interfaces as placement requests; ``key`` identifies the request up to order.

    ``networks`` says which network each run of ``requests`` is for, as
    ``(network name, number of requests)`` in order; empty when the pod named
    none of ``--networks`` (judged on all the node's PFs, as a version 1 state is).
    """

    requests: tuple[placement.Request, ...]
    key: tuple[Any, ...]
    source: str
    networks: tuple[tuple[str, int], ...] = ()
    # Per attachment (per entry of ``networks``, or one when it is empty): each interface on its own PF.
    different_pfs: tuple[bool, ...] = ()
    # Derived once, read per node: (min, max) largest first (best fit's order), the min rates' sum.
    wants: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    # ``wants`` without repeats (same order): what the necessary conditions check per node.
    distinct_wants: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    min_total: int = field(init=False, repr=False, compare=False)
    # One attachment without constraints: judged by the fast paths that know only rates.
    simple: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rates = sorted((r.min_tx_rate, r.max_tx_rate) for r in self.requests)
        object.__setattr__(self, "wants", tuple(rates[::-1]))
        object.__setattr__(self, "distinct_wants", tuple(dict.fromkeys(self.wants)))
        object.__setattr__(self, "min_total", sum(low for low, _ in rates))
        constrained = any(self.different_pfs) or any(
            r.pf is not None or r.rail is not None for r in self.requests
        )
        object.__setattr__(self, "simple", len(self.networks) <= 1 and not constrained)

    @classmethod
    def of(cls, request: PodRequest, source: str) -> Demand:
        """From a validated request."""
        reqs = _requests(request)
        key = _shape(request)
        if request.different_pfs:
            key = (*key, "different_pfs")
        return cls(reqs, key, source, (), (request.different_pfs,))

    @classmethod
    def joint(cls, parts: Sequence[tuple[str, PodRequest, str]]) -> Demand:
        """The demand of a pod's attachments, ``(network, request, source)`` each, in ADD order."""
        reqs = tuple(r for _, request, _ in parts for r in _requests(request))
        networks = tuple((network, len(request.interfaces)) for network, request, _ in parts)
        # The ADDs run one after the other, each on what the ones before left: order matters. Runs of
        # the same attachment are one entry with their count: a key's size does not grow with repeats.
        key = tuple(
            (part, len(list(run)))
            for part, run in groupby(
                (network, request.different_pfs, _shape(request)) for network, request, _ in parts
            )
        )
        sources = {source: None for _, _, source in parts}
        return cls(
            reqs, key, "; ".join(sources), networks, tuple(request.different_pfs for _, request, _ in parts)
        )

    def attachments(self) -> list[tuple[str | None, tuple[placement.Request, ...], bool]]:
        """(network or None, requests, different_pfs) of each attachment, in the order ADD runs them.

        Built once per demand (decisions read it per node state); callers must not change the list.
        """
        got = self.__dict__.get("_attachments")
        if got is None:
            got = self._attachments()
            object.__setattr__(self, "_attachments", got)
        return got

    def _attachments(self) -> list[tuple[str | None, tuple[placement.Request, ...], bool]]:
        if not self.networks:
            return [(None, self.requests, any(self.different_pfs))]
        out = []
        at = 0
        for k, (network, count) in enumerate(self.networks):
            different = self.different_pfs[k] if k < len(self.different_pfs) else False
            out.append((network, self.requests[at : at + count], different))
            at += count
        return out

    def by_network(self) -> dict[str, list[placement.Request]]:
        """The requests of each network (empty when the demand names no networks)."""
        out: dict[str, list[placement.Request]] = {}
        for network, requests, _ in self.attachments():
            if network is not None:
                out.setdefault(network, []).extend(requests)
        return out


def _requests(request: PodRequest) -> tuple[placement.Request, ...]:
    return tuple(placement.Request(i.min_tx_rate, i.max_tx_rate, i.pf, i.rail) for i in request.interfaces)


def _shape(request: PodRequest) -> tuple[Any, ...]:
    """The request up to the order of its interfaces, which does not change what fits or what is used."""
    return tuple(
        sorted(
            (i.min_tx_rate, i.max_tx_rate)
            if i.pf is None and i.rail is None
            else (i.min_tx_rate, i.max_tx_rate, i.pf or "", i.rail or "")
            for i in request.interfaces
        )
    )


def selected_networks(pod_namespace: str, value: Any) -> list[tuple[str, str]]:
    """(namespace, name) of each network a Multus ``networks`` annotation selects (both forms)."""
    return [(sel.namespace, sel.name) for sel in selections(pod_namespace, value)]


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
        self._memo: Bounded[str, PodRequest] = Bounded(_MEMO_LIMIT, _MEMO_BYTES)

    def _ours(self, who: str, namespace: str, annotations: Mapping[str, Any]) -> list[Selection]:
        return pod_selections(who, namespace, annotations, self._is_ours)

    def _is_ours(self, sel: Selection) -> bool:
        if sel.name in self.networks or f"{sel.namespace}/{sel.name}" in self.networks:
            return True
        # An unqualified default network is looked up in Multus' namespace, which the extender
        # is not told: it counts as ours in any namespace (never fewer than Multus attaches).
        return not sel.namespace and any(n.rpartition("/")[2] == sel.name for n in self.networks)

    def _parse(self, raw: Any, source: str) -> PodRequest:
        request = self._memo.get(raw) if isinstance(raw, str) else None
        if request is None:
            request = parse_request(raw, source)
            if isinstance(raw, str):
                weight = sys.getsizeof(raw) + _INTERFACE_BYTES * (1 + len(request.interfaces))
                self._memo.put(raw, request, weight)
        return request

    def of_pod(self, pod: Mapping[str, Any], *, check_declared: bool = True) -> Demand | None:
        """The pod's demand, None when it is not an RDMA pod; InvalidPodRequest when malformed.

        Malformed includes RDMA resources declared in the pod's containers that are not exactly
        its demand (:mod:`rdma_cni.extender.declared`): every verb and bind see a pod through
        here. ``check_declared=False`` is for pods already bound, whose ADD will use the demand
        whatever they declared.
        """
        demand = self._of_pod(pod)
        if check_declared:
            namespace, name, _ = pod_identity(pod)
            declared.check(pod, demand, f"pod {namespace}/{name}")
        return demand

    def _of_pod(self, pod: Mapping[str, Any]) -> Demand | None:
        """The demand the pod's annotations and networks make.

        Each selected network of ``--networks`` is one attachment, one ADD: its
        request is decided as ADD decides it
        (:func:`rdma_cni.shared.attachments.attachment_request`) and the demand
        is all of them together. A pod with the annotation that selects none of
        ``--networks`` (or an extender run without them) counts it once.
        """
        namespace, name, _ = pod_identity(pod)
        annotations = pod_annotations(pod)
        raw = annotations.get(self.annotation)
        annotation_source = f"pod {namespace}/{name} annotation {self.annotation}"
        default_source = f"defaultRequest (pod {namespace}/{name})"

        def pod_wide() -> tuple[Any, str]:
            return (raw, annotation_source) if raw is not None else (None, default_source)

        ours = self._ours(f"pod {namespace}/{name}", namespace, annotations)
        if not ours:
            if raw is None:
                return None
            return Demand.of(self._parse(raw, annotation_source), annotation_source)
        parts: list[tuple[str, PodRequest, str]] = []
        for sel in ours:
            request, source = attachment_request(
                sel.cni_args,
                f"pod {namespace}/{name} network {sel.namespace}/{sel.name} cni-args.{ARGS_KEY}",
                pod_wide,
                self.default_request,
                self._parse,
            )
            if request is not None:
                parts.append((sel.name, request, source))
        if not parts:
            return None
        return Demand.joint(parts)
