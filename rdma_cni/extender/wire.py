"""kube-scheduler's extender wire format (k8s.io/kube-scheduler ``extender/v1``), both directions.

The Go structs carry no json tags, so kube-scheduler sends the Go field names
(``Pod``, ``NodeNames``, ``NodeNameToMetaVictims``, ``UID``) and Go's decoder
matches keys without regard to case; we accept any case too. The Kubernetes
objects inside (``Pod``, ``NodeList``) use their usual lower-case json tags.
Parsing is strict about the shapes we use and raises :class:`WireError` with
the field named; the server turns that into the verb's ``Error`` field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

__all__ = [
    "MAX_REASON",
    "BindArgs",
    "FilterArgs",
    "PreemptArgs",
    "WireError",
    "bind_result",
    "clip",
    "filter_result",
    "parse_bind",
    "parse_filter",
    "parse_preempt",
    "preempt_result",
    "priority_json",
    "priority_list",
]

MAX_NODES = 100_000
MAX_VICTIMS = 10_000
# Characters of one reason or Error in an answer. Reasons quote what a pod wrote (a name, a value), and
# a filter answer repeats a node's reason per node: capped here, whatever the parsers upstream bound, an
# answer stays within nodes x (name + MAX_REASON) however long the tenant's input.
MAX_REASON = 1024
_CUT = " [... {} characters cut]"


def clip(text: str) -> str:
    """``text`` cut to at most :data:`MAX_REASON` characters, saying how much was cut."""
    if len(text) <= MAX_REASON:
        return text
    # The count cut has no more digits than the whole length: the text with its mark fits.
    keep = MAX_REASON - len(_CUT.format(len(text)))
    return text[:keep] + _CUT.format(len(text) - keep)


class WireError(ValueError):
    """The request body is not the shape kube-scheduler sends; the message names the field."""


def field(obj: Mapping[str, Any], name: str) -> Any:
    """``obj[name]`` matched like Go's decoder: the exact key first, then any case; None when absent."""
    value = obj.get(name)
    if value is not None or name in obj:
        return value
    lower = name.lower()
    for key, value in obj.items():
        if isinstance(key, str) and key.lower() == lower:
            return value
    return None


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireError(f"{where}: expected an object")
    return value


def _str(value: Any, where: str, *, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise WireError(f"{where}: expected a non-empty string")
    return value


def pod_identity(pod: Mapping[str, Any]) -> tuple[str, str, str]:
    """The pod's namespace, name and uid from its metadata (empty strings when absent)."""
    meta = pod.get("metadata")
    if not isinstance(meta, dict):
        raise WireError("Pod.metadata: expected an object")
    out = []
    for key in ("namespace", "name", "uid"):
        value = meta.get(key)
        if value is not None and not isinstance(value, str):
            raise WireError(f"Pod.metadata.{key}: expected a string")
        out.append(value or "")
    return out[0] or "default", out[1], out[2]


def pod_annotations(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The pod's annotations (an empty dict when it has none)."""
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, dict) else None
    if annotations is None:
        return {}
    if not isinstance(annotations, dict):
        raise WireError("Pod.metadata.annotations: expected an object")
    return annotations


@dataclass(frozen=True)
class FilterArgs:
    """ExtenderArgs: the pod and either full Node objects (``nodes``) or names (``node_names``)."""

    pod: dict[str, Any]
    nodes: list[dict[str, Any]] | None
    node_names: list[str] | None

    @property
    def names(self) -> list[str]:
        """Node names in request order, whichever form arrived."""
        if self.node_names is not None:
            return self.node_names
        return [node_name(n) for n in self.nodes or ()]


def node_name(node: Mapping[str, Any]) -> str:
    """metadata.name of a Node object."""
    meta = node.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or not name:
        raise WireError("Nodes.items[].metadata.name: expected a non-empty string")
    return name


def parse_filter(doc: Any) -> FilterArgs:
    """ExtenderArgs as sent to ``/filter`` and ``/prioritize``."""
    body = _obj(doc, "ExtenderArgs")
    pod = _obj(field(body, "Pod"), "Pod")
    nodes_doc = field(body, "Nodes")
    names_doc = field(body, "NodeNames")
    nodes: list[dict[str, Any]] | None = None
    names: list[str] | None = None
    if names_doc is not None:
        # set(map(type, ...)) and `in` run in C: this check is per node, per request.
        if (
            not isinstance(names_doc, list)
            or (names_doc and set(map(type, names_doc)) != {str})
            or "" in names_doc
        ):
            raise WireError("NodeNames: expected a list of node names")
        names = names_doc
    elif nodes_doc is not None:
        items = _obj(nodes_doc, "Nodes").get("items")
        if items is None:
            items = []
        if not isinstance(items, list) or not all(isinstance(n, dict) for n in items):
            raise WireError("Nodes.items: expected a list of Node objects")
        nodes = items
    else:
        raise WireError("ExtenderArgs carries neither Nodes nor NodeNames")
    count = len(names if names is not None else nodes or ())
    if count > MAX_NODES:
        raise WireError(f"{count} nodes, the limit is {MAX_NODES}")
    return FilterArgs(pod=pod, nodes=nodes, node_names=names)


def filter_result(
    args: FilterArgs,
    passing: Iterable[str],
    failed: Mapping[str, str],
    unresolvable: Mapping[str, str],
    error: str = "",
) -> dict[str, Any]:
    """ExtenderFilterResult answering in the form the request came in (Nodes or NodeNames)."""
    keep = list(passing)
    out: dict[str, Any] = {
        "Nodes": None,
        "NodeNames": None,
        "FailedNodes": {node: clip(reason) for node, reason in failed.items()},
        "FailedAndUnresolvableNodes": {node: clip(reason) for node, reason in unresolvable.items()},
        "Error": clip(error),
    }
    if args.node_names is not None:
        out["NodeNames"] = keep
    else:
        wanted = set(keep)
        out["Nodes"] = {
            "apiVersion": "v1",
            "kind": "NodeList",
            "metadata": {},
            "items": [n for n in args.nodes or () if node_name(n) in wanted],
        }
    return out


def filter_error(error: str) -> dict[str, Any]:
    """A filter answer that fails the scheduling attempt with ``error`` (bad input, not ready)."""
    return {
        "Nodes": None,
        "NodeNames": None,
        "FailedNodes": {},
        "FailedAndUnresolvableNodes": {},
        "Error": clip(error),
    }


def priority_list(scores: Iterable[tuple[str, int]]) -> list[dict[str, Any]]:
    """HostPriorityList: ``[{"Host": name, "Score": 0..10}]``."""
    return [{"Host": host, "Score": score} for host, score in scores]


def priority_json(scores: Iterable[tuple[str, int]]) -> bytes:
    """:func:`priority_list` already encoded, without the nodes that score 0.

    kube-scheduler adds an extender's score to the nodes the answer lists and
    nothing to the others (``prioritizeNodes``), so a 0 need not travel: at
    thousands of nodes the answer is JSON both sides pay for. Encoded here
    because thousands of small dicts through json.dumps cost milliseconds.
    """
    quote = encode_basestring_ascii
    return (
        "["
        + ",".join(f'{{"Host":{quote(host)},"Score":{int(score)}}}' for host, score in scores if score)
        + "]"
    ).encode()


@dataclass(frozen=True)
class PreemptArgs:
    """ExtenderPreemptionArgs: the pod and, per node, the uids of the victims and PDB violations."""

    pod: dict[str, Any]
    victims: dict[str, tuple[str, ...]]
    pdb_violations: dict[str, int]


def _victim_uids(value: Any, where: str, meta: bool) -> tuple[tuple[str, ...], int]:
    victims = _obj(value, where)
    pods = field(victims, "Pods") or []
    if not isinstance(pods, list) or len(pods) > MAX_VICTIMS:
        raise WireError(f"{where}.Pods: expected a list of at most {MAX_VICTIMS} pods")
    uids = []
    for i, pod in enumerate(pods):
        pod = _obj(pod, f"{where}.Pods[{i}]")
        if meta:
            uids.append(_str(field(pod, "UID"), f"{where}.Pods[{i}].UID"))
        else:
            uids.append(_str(pod_identity(pod)[2], f"{where}.Pods[{i}].metadata.uid"))
    violations = field(victims, "NumPDBViolations") or 0
    if isinstance(violations, bool) or not isinstance(violations, int):
        raise WireError(f"{where}.NumPDBViolations: expected an integer")
    return tuple(uids), violations


def parse_preempt(doc: Any) -> PreemptArgs:
    """ExtenderPreemptionArgs; MetaVictims (uids only, nodeCacheCapable) or full Victims."""
    body = _obj(doc, "ExtenderPreemptionArgs")
    pod = _obj(field(body, "Pod"), "Pod")
    victims: dict[str, tuple[str, ...]] = {}
    violations: dict[str, int] = {}
    meta_doc = field(body, "NodeNameToMetaVictims")
    full_doc = field(body, "NodeNameToVictims")
    # kube-scheduler sends one of the two (MetaVictims when nodeCacheCapable).
    meta = not (full_doc and not meta_doc)
    source = (meta_doc if meta else full_doc) or ({} if meta_doc is None else meta_doc)
    name = "NodeNameToMetaVictims" if meta else "NodeNameToVictims"
    if not isinstance(source, dict) or len(source) > MAX_NODES:
        raise WireError(f"{name}: expected an object mapping node names to victims")
    for node, value in source.items():
        victims[node], violations[node] = _victim_uids(value, f"{name}[{node}]", meta)
    return PreemptArgs(pod=pod, victims=victims, pdb_violations=violations)


def preempt_result(kept: Mapping[str, tuple[str, ...]], violations: Mapping[str, int]) -> dict[str, Any]:
    """ExtenderPreemptionResult: the nodes kept, with their victims as MetaVictims."""
    return {
        "NodeNameToMetaVictims": {
            node: {"Pods": [{"UID": uid} for uid in uids], "NumPDBViolations": violations.get(node, 0)}
            for node, uids in kept.items()
        }
    }


@dataclass(frozen=True)
class BindArgs:
    """ExtenderBindingArgs."""

    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str


def parse_bind(doc: Any) -> BindArgs:
    """ExtenderBindingArgs: ``{"PodName", "PodNamespace", "PodUID", "Node"}``."""
    body = _obj(doc, "ExtenderBindingArgs")
    return BindArgs(
        pod_name=_str(field(body, "PodName"), "PodName"),
        pod_namespace=_str(field(body, "PodNamespace"), "PodNamespace"),
        pod_uid=_str(field(body, "PodUID"), "PodUID", required=False),
        node=_str(field(body, "Node"), "Node"),
    )


def bind_result(error: str = "") -> dict[str, Any]:
    """ExtenderBindingResult."""
    return {"Error": clip(error)}
