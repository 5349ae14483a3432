"""A pod's request as a DRA claim, and the driver's opaque configuration (the cap and the name).

``rdma-cni claim '<annotation JSON>'`` prints the ResourceClaimTemplate asking
for what the annotation asks (:func:`claim_template`), so that a pod moving
from the annotation to DRA writes nothing by hand: one request per interface,
in the annotation's order, named ``if0``, ``if1``, ...; its ``min_tx_rate`` a
capacity request for ``bandwidth``; ``pf`` and ``rail`` CEL selectors; a cap a
selector too (the PF's capacity must reach it, placement's rule) and, with the
interface's ``name``, the request's opaque configuration; ``different_pfs`` a
``distinctAttribute`` constraint on the PF. Every request also selects the
network the pod attaches (its NetworkAttachmentDefinition's name), since a
device is one network's share of a PF.

The opaque configuration is pod-written text that reaches the driver through
the API server: :func:`parse_config` holds it to a strict, bounded model, as
the annotation's parser holds the annotation, and says which field is wrong
(code 101, ``InvalidPodRequest``). It only ever lowers what a pod gets (a cap,
a name): the bandwidth a VF is guaranteed is the amount the allocation
consumed, never a number in it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from rdma_cni.shared.dra import (
    ATTR_MAX_TX_RATE,
    ATTR_NETWORK,
    ATTR_PF,
    ATTR_RAIL,
    BANDWIDTH,
    DEVICE_CLASS,
    DRIVER,
)
from rdma_cni.shared.dra import RESOURCE_API as API_VERSION
from rdma_cni.shared.errors import InvalidPodRequest
from rdma_cni.shared.jsondepth import depth_over
from rdma_cni.shared.names import IFNAME_RULE, valid_ifname
from rdma_cni.shared.podrequest import MAX_RATE_MBPS, PodRequest, format_errors
from rdma_cni.shared.quote import quote

__all__ = [
    "CONFIG_API_VERSION",
    "CONFIG_KIND",
    "MAX_CONFIG_BYTES",
    "VfConfig",
    "claim_template",
    "configs_of",
    "parse_config",
    "request_name",
]

CONFIG_API_VERSION = "rdma-cni.io/v1alpha1"
CONFIG_KIND = "VfConfig"
# The API server's own bound on opaque parameters (OpaqueParametersMaxLength, 10 KiB); real ones
# are under 200 bytes.
MAX_CONFIG_BYTES = 10 * 1024
# Opaque parameters nest one level; anything deeper is refused before pydantic sees it.
_MAX_CONFIG_DEPTH = 4


class VfConfig(BaseModel):
    """The opaque configuration of one or more of a claim's requests (each an interface).

    ``max_tx_rate``: the VF's transmit cap in Mbit/s (0: none); it must be 0
    or at least the bandwidth the allocation consumed, and at most the PF's
    capacity (checked when the claim is prepared). ``name``: the interface's
    name in the pod (the first interface is always ``CNI_IFNAME``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    apiVersion: Literal["rdma-cni.io/v1alpha1"]
    kind: Literal["VfConfig"]
    max_tx_rate: Annotated[StrictInt, Field(ge=0, le=MAX_RATE_MBPS)] = 0
    name: str | None = None

    @field_validator("name")
    @classmethod
    def _name_is_ifname(cls, v: str | None) -> str | None:
        if v is not None and not valid_ifname(v):
            raise ValueError(f"{quote(v)} is not a valid interface name ({IFNAME_RULE})")
        return v


def parse_config(parameters: Any, where: str) -> VfConfig:
    """Validate one opaque configuration's ``parameters``; ``where`` names it in errors.

    Raises :class:`~rdma_cni.shared.errors.InvalidPodRequest` (code 101) saying
    which field is wrong; parameters over :data:`MAX_CONFIG_BYTES` encoded, or
    nested deeper than a configuration ever is, are refused before they are read.
    """
    try:
        text = json.dumps(parameters, separators=(",", ":"), sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        raise InvalidPodRequest(f"{where}: parameters are not a JSON object") from None
    if len(text.encode()) > MAX_CONFIG_BYTES:
        raise InvalidPodRequest(
            f"{where}: parameters are {len(text.encode())} bytes, the limit is {MAX_CONFIG_BYTES}"
        )
    if depth_over(text, _MAX_CONFIG_DEPTH) is not None:
        raise InvalidPodRequest(f"{where}: parameters nest deeper than {_MAX_CONFIG_DEPTH} levels")
    if not isinstance(parameters, dict):
        raise InvalidPodRequest(f"{where}: parameters must be an object like " + _example())
    try:
        return VfConfig.model_validate(parameters)
    except ValidationError as exc:
        raise InvalidPodRequest(f"{where}: {format_errors(exc)}") from None


def _example() -> str:
    return json.dumps({"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, "max_tx_rate": 20000})


def request_name(index: int) -> str:
    """The claim request of the annotation's interface ``index``: ``if0``, ``if1``, ..."""
    return f"if{index}"


def _cel_string(value: str) -> str:
    # A JSON string literal is a CEL string literal (CEL has the same escapes, \uXXXX included).
    return json.dumps(value, ensure_ascii=True)


def _ours(attribute: str) -> str:
    return f"device.attributes[{_cel_string(DRIVER)}].{attribute}"


def _selector(expression: str) -> dict[str, Any]:
    return {"cel": {"expression": expression}}


def claim_template(
    request: PodRequest,
    *,
    name: str,
    network: str,
    namespace: str | None = None,
    device_class: str = DEVICE_CLASS,
) -> dict[str, Any]:
    """The ResourceClaimTemplate for ``request`` on ``network`` (see the module docstring)."""
    requests: list[dict[str, Any]] = []
    configs: list[dict[str, Any]] = []
    for i, entry in enumerate(request.interfaces):
        selectors = [_selector(f"{_ours(ATTR_NETWORK)} == {_cel_string(network)}")]
        if entry.pf is not None:
            selectors.append(_selector(f"{_ours(ATTR_PF)} == {_cel_string(entry.pf)}"))
        if entry.rail is not None:
            # Optional: a PF without a rail label has no rail attribute (an unguarded read would abort
            # the allocation, not skip the device).
            rail = f'device.attributes[{_cel_string(DRIVER)}].?{ATTR_RAIL}.orValue("")'
            selectors.append(_selector(f"{rail} == {_cel_string(entry.rail)}"))
        if entry.max_tx_rate:
            # Placement's rule: a cap may not exceed the PF's capacity; a PF of unknown capacity takes any.
            cap = entry.max_tx_rate
            largest = f"device.attributes[{_cel_string(DRIVER)}].?{ATTR_MAX_TX_RATE}.orValue({cap})"
            selectors.append(_selector(f"{largest} >= {cap}"))
        exactly: dict[str, Any] = {"deviceClassName": device_class, "selectors": selectors}
        if entry.min_tx_rate:
            exactly["capacity"] = {"requests": {BANDWIDTH: str(entry.min_tx_rate)}}
        requests.append({"name": request_name(i), "exactly": exactly})
        parameters: dict[str, Any] = {"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND}
        if entry.max_tx_rate:
            parameters["max_tx_rate"] = entry.max_tx_rate
        if entry.name is not None:
            parameters["name"] = entry.name
        if len(parameters) > 2:
            configs.append(
                {"requests": [request_name(i)], "opaque": {"driver": DRIVER, "parameters": parameters}}
            )
    devices: dict[str, Any] = {"requests": requests}
    if request.different_pfs:
        devices["constraints"] = [{"distinctAttribute": f"{DRIVER}/{ATTR_PF}"}]
    if configs:
        devices["config"] = configs
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": metadata,
        "spec": {"spec": {"devices": devices}},
    }


def configs_of(allocation_config: Any, requests: list[str], where: str) -> Mapping[str, VfConfig]:
    """Each request's configuration from an allocation's ``devices.config`` (this driver's entries only).

    Entries apply in order, the class's (``FromClass``) before the claim's
    (``FromClaim``), a later one replacing an earlier one for the requests it
    names (all of ``requests`` when it names none): Kubernetes' order.
    Raises :class:`InvalidPodRequest` naming the entry and field.
    """
    entries = allocation_config if isinstance(allocation_config, list) else []
    ordered = [e for e in entries if isinstance(e, dict) and e.get("source") == "FromClass"]
    ordered += [e for e in entries if isinstance(e, dict) and e.get("source") != "FromClass"]
    out: dict[str, VfConfig] = {}
    for entry in ordered:
        opaque = entry.get("opaque")
        if not isinstance(opaque, dict) or opaque.get("driver") != DRIVER:
            continue
        k = entries.index(entry)
        named = entry.get("requests") or list(requests)
        if not isinstance(named, list):
            raise InvalidPodRequest(f"{where}: config[{k}].requests: expected a list of request names")
        config = parse_config(opaque.get("parameters"), f"{where}: config[{k}] ({entry.get('source', '')})")
        for request in named:
            # A subrequest reference (request/subrequest) configures its request.
            base = request.split("/", 1)[0] if isinstance(request, str) else request
            if base in requests:
                out[base] = config
    return out
