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

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rdma_cni.shared.podrequest import MAX_REQUEST_BYTES, PodRequest, parse_request

__all__ = ["ARGS_KEY", "Selection", "args_request", "attachment_request", "selections"]

# The key in ``args.cni`` (Multus: the selection element's ``cni-args``).
ARGS_KEY = "rdma_interfaces_required"

Parser = Callable[[Any, str], PodRequest]
# Looked up only when the attachment has no request of its own (ADD saves an API round trip):
# returns (raw annotation value or None, a phrase naming the annotation or, when absent, the default).
PodWide = Callable[[], tuple[Any, str]]


@dataclass(frozen=True)
class Selection:
    """One element of a pod's Multus ``networks`` annotation."""

    namespace: str
    name: str
    cni_args: dict[str, Any] | None = field(default=None, compare=False)


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
    :class:`~rdma_cni.cni.errors.InvalidPodRequest` for a malformed request.
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

    Both forms Multus accepts: ``"a, ns/b, c@net2"`` and a JSON list of
    ``{"name", "namespace", "interface", "cni-args"}``. A malformed value
    selects nothing (Multus refuses such a pod anyway).
    """
    if not isinstance(value, str) or len(value) > MAX_REQUEST_BYTES:
        return []
    text = value.strip()
    out: list[Selection] = []
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
                args = item.get("cni-args")
                out.append(
                    Selection(
                        namespace if isinstance(namespace, str) and namespace else pod_namespace,
                        item["name"],
                        args if isinstance(args, dict) else None,
                    )
                )
        return out
    for entry in text.split(","):
        entry = entry.strip().split("@", 1)[0]
        if not entry:
            continue
        namespace, _, name = entry.rpartition("/")
        out.append(Selection(namespace or pod_namespace, name))
    return out
