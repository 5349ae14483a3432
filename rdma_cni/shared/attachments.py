"""Which request applies to each rdma-cni attachment of a pod: the one rule ADD and the extender share.

A pod may attach several rdma-cni networks (one per rail, typically). Multus
passes each network selection element's ``cni-args`` to that attachment as the
config's ``args.cni``, so a request there (``rdma_interfaces_required``) belongs
to that attachment alone and wins over the pod-wide annotation. The pod-wide
annotation applies to each attachment that has no request of its own (for a
pod with one rdma-cni network that is its original meaning). Without either,
the network's default applies. ADD (:mod:`rdma_cni.node.podmeta`) and the
extender (:mod:`rdma_cni.extender.demand`) both decide through
:func:`attachment_request`, so the scheduler half counts exactly what the
ADDs will allocate: one request per selected network.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rdma_cni.shared.errors import InvalidPodRequest
from rdma_cni.shared.multusnet import (
    DEFAULT_NETWORK_ANNOTATION,
    NETWORKS_ANNOTATION,
    MultusFails,
    Selection,
    UnreadableNetworks,
    read_default_network,
    read_networks,
)
from rdma_cni.shared.podrequest import PodRequest, parse_request

__all__ = [
    "ARGS_KEY",
    "MAX_ATTACHMENTS",
    "Selection",
    "TooManyAttachments",
    "args_request",
    "attachment_request",
    "pod_selections",
    "selections",
]

# The key in ``args.cni`` (Multus: the selection element's ``cni-args``).
ARGS_KEY = "rdma_interfaces_required"

Parser = Callable[[Any, str], PodRequest]
# Looked up only when the attachment has no request of its own (ADD saves an API round trip):
# returns (raw annotation value or None, a phrase naming the annotation or, when absent, the default).
PodWide = Callable[[], tuple[Any, str]]


# rdma-cni attachments per pod (each one ADD, each a placement for the extender). Multus has no
# limit of its own and names them net1.. (IFNAMSIZ holds any count); 32 is MAX_INTERFACES, the VFs
# one attachment may ask for, so a pod never asks for more than 32 x 32 interfaces in all.
MAX_ATTACHMENTS = 32
_CANNOT = "cannot be read exactly as Multus reads it"


class TooManyAttachments(InvalidPodRequest):
    """The pod selects rdma-cni networks more than :data:`MAX_ATTACHMENTS` times."""


def args_request(cni_args: Any) -> tuple[bool, Any]:
    """(present, raw value) of the per-attachment request in an ``args.cni`` mapping."""
    if isinstance(cni_args, dict) and ARGS_KEY in cni_args:
        return True, cni_args[ARGS_KEY]
    return False, None


def attachment_request(
    cni_args: Any,
    args_source: str,
    pod_wide: PodWide,
    default: PodRequest | None,
    parse: Parser = parse_request,
) -> tuple[PodRequest | None, str]:
    """The request of one attachment and a phrase naming where it came from.

    In order: ``args.cni.rdma_interfaces_required`` (this attachment's own),
    the pod-wide annotation (from ``pod_wide``), then ``default`` (None when the
    caller has none: the attachment then asks for nothing). Raises
    :class:`~rdma_cni.shared.errors.InvalidPodRequest` for a malformed request.
    """
    present, raw = args_request(cni_args)
    if present:
        return parse(raw, args_source), args_source
    raw, source = pod_wide()
    if raw is not None:
        return parse(raw, source), source
    return default, source


def selections(pod_namespace: str, value: Any) -> list[Selection]:
    """The networks a Multus ``networks`` annotation selects, with each one's ``cni-args``.

    Read by :func:`rdma_cni.shared.multusnet.read_networks`, as Multus reads
    it; a value Multus fails the pod on selects nothing. Raises
    :class:`~rdma_cni.shared.multusnet.UnreadableNetworks` for a value that
    cannot be read as Multus reads it.
    """
    if value is not None and not isinstance(value, str):
        raise UnreadableNetworks(f"annotation {NETWORKS_ANNOTATION} is not a string")
    try:
        return list(read_networks(value, pod_namespace).selections)
    except MultusFails:
        return []


def pod_selections(
    who: str,
    namespace: str,
    annotations: Mapping[str, Any],
    is_ours: Callable[[Selection], bool],
    multus_namespace: str = "",
) -> list[Selection]:
    """The pod's rdma-cni attachments, as Multus will make them, in the order it ADDs them.

    The default network (``v1.multus-cni.io/default-network``, the pod's
    eth0) comes first, then ``k8s.v1.cni.cncf.io/networks`` in order;
    ``is_ours`` says which are rdma-cni networks. A pod Multus fails (either
    annotation malformed in a way Multus refuses) has none: Multus attaches
    nothing. ``multus_namespace`` is where Multus looks for an unqualified
    default network; "" when unknown (``is_ours`` then matches the name in
    any namespace). Raises :class:`~rdma_cni.shared.multusnet.UnreadableNetworks`
    when either annotation cannot be read as Multus reads it, or when one
    that selects an rdma-cni network may be refused by Multus for a field
    not modelled here, and :class:`TooManyAttachments` past
    :data:`MAX_ATTACHMENTS`.
    """
    readings = []
    for key, read in (
        (DEFAULT_NETWORK_ANNOTATION, lambda v: read_default_network(v, multus_namespace)),
        (NETWORKS_ANNOTATION, lambda v: read_networks(v, namespace)),
    ):
        value = annotations.get(key)
        if value is not None and not isinstance(value, str):
            raise UnreadableNetworks(f"{who} annotation {key} is not a string")
        try:
            readings.append((key, read(value)))
        except MultusFails:
            return []  # Multus fails the pod's sandbox: nothing is attached
        except UnreadableNetworks as exc:
            raise UnreadableNetworks(f"{who} annotation {key} {_CANNOT}: {exc.msg}") from None
    ours = [s for _, reading in readings if reading is not None for s in reading.selections if is_ours(s)]
    for key, reading in readings:
        if ours and reading is not None and reading.doubt:
            raise UnreadableNetworks(f"{who} annotation {key} {_CANNOT}: {reading.doubt}")
    if len(ours) > MAX_ATTACHMENTS:
        raise TooManyAttachments(
            f"{who} selects rdma-cni networks {len(ours)} times (default network and "
            f"{NETWORKS_ANNOTATION}); a pod may have at most {MAX_ATTACHMENTS} rdma-cni attachments"
        )
    return ours
