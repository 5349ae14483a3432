"""The pod's interface request: its model and the parser for the annotation.

Shared by the CNI plugin (ADD reads the pod's annotation) and the scheduler
extender (filter reads the same annotation from the Pod it is sent), so both
apply the same limits and answer the same error text. It does not depend on
the network configuration model. pydantic is imported here; the extender pays
that once at start-up.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from rdma_cni.shared.errors import InvalidPodRequest
from rdma_cni.shared.jsondepth import MAX_DEPTH, depth_over
from rdma_cni.shared.names import IFNAME_RULE, RAIL_RULE, valid_ifname, valid_rail
from rdma_cni.shared.quote import quote

__all__ = [
    "DEFAULT_ANNOTATION",
    "MAX_INTERFACES",
    "MAX_RATE_MBPS",
    "MAX_REQUEST_BYTES",
    "InterfaceRequest",
    "PodRequest",
    "RailLabel",
    "format_errors",
    "parse_request",
    "valid_rail",
]
# valid_rail and RAIL_RULE live in shared.names (the node state checks rail labels too).

MAX_INTERFACES = 32
# 10 Tbit/s: far above any NIC, low enough that sums cannot overflow anything.
MAX_RATE_MBPS = 10_000_000
# The largest pod request (annotation text) accepted, in bytes.
MAX_REQUEST_BYTES = 64 * 1024
DEFAULT_ANNOTATION = "rdma_interfaces_required"

Rate = Annotated[StrictInt, Field(ge=0, le=MAX_RATE_MBPS)]


def _rail_label(value: str) -> str:
    if not valid_rail(value):
        raise ValueError(f"{quote(value)} is not a rail label ({RAIL_RULE})")
    return value


# The one check of a rail label, for the network config's ``pfs`` entries and a request's interfaces.
RailLabel = Annotated[str, AfterValidator(_rail_label)]


class InterfaceRequest(BaseModel):
    """One requested RDMA interface: rates in Mbit/s, an optional pod-side name, and where it may go.

    ``pf`` names the PF it must go on, ``rail`` the rail (the ``rail`` label of
    PFs in the network's ``pfs`` list); at most one of them. A name this
    node's network does not have is a no-fit on that node, not an error:
    PF names and rails are facts of each node.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_tx_rate: Rate = 0
    max_tx_rate: Rate = 0
    name: str | None = None
    pf: str | None = None
    rail: RailLabel | None = None

    @field_validator("pf")
    @classmethod
    def _pf_is_ifname(cls, v: str | None) -> str | None:
        if v is not None and not valid_ifname(v):
            raise ValueError(f"{quote(v)} is not a valid PF interface name ({IFNAME_RULE})")
        return v

    @model_validator(mode="after")
    def _pf_or_rail(self) -> InterfaceRequest:
        if self.pf is not None and self.rail is not None:
            raise ValueError(f"names both pf {quote(self.pf)} and rail {quote(self.rail)}: name one of them")
        return self

    @field_validator("name")
    @classmethod
    def _name_is_ifname(cls, v: str | None) -> str | None:
        if v is not None and not valid_ifname(v):
            raise ValueError(f"{quote(v)} is not a valid interface name ({IFNAME_RULE})")
        return v

    @model_validator(mode="after")
    def _max_not_below_min(self) -> InterfaceRequest:
        if self.max_tx_rate and self.max_tx_rate < self.min_tx_rate:
            raise ValueError(
                f"max_tx_rate {self.max_tx_rate} is below min_tx_rate {self.min_tx_rate} (0 means no cap)"
            )
        return self


class PodRequest(BaseModel):
    """The validated list of interfaces a pod asks for (1 to 32); ``different_pfs``: each on its own PF."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    interfaces: Annotated[list[InterfaceRequest], Field(min_length=1, max_length=MAX_INTERFACES)]
    different_pfs: StrictBool = False

    @model_validator(mode="after")
    def _names_unique(self) -> PodRequest:
        seen: dict[str, int] = {}
        for index, entry in enumerate(self.interfaces):
            if entry.name is None:
                continue
            if entry.name in seen:
                raise ValueError(
                    f"interface names must be unique: entries {seen[entry.name]} and {index} "
                    f"are both named {quote(entry.name)}"
                )
            seen[entry.name] = index
        return self


# Errors listed at most: a request (or config) with thousands of bad keys gets a message of bounded size.
MAX_ERRORS = 8


def _loc_part(part: str | int) -> str:
    # A location holds a key the author chose (an unknown key under extra="forbid"): quoted when
    # it is not a plain identifier, so its size and characters are bounded like any quoted value.
    if isinstance(part, int) or (part.isidentifier() and len(part) <= 64):
        return str(part)
    return quote(part)


def format_errors(exc: ValidationError, prefix: str = "") -> str:
    """pydantic's errors as one line: ``field.path: reason; ...``, at most :data:`MAX_ERRORS` of them.

    Keys in locations are quoted bounded; pydantic's own texts quote no input
    values (``include_input`` is off), the validators here quote theirs bounded.
    """
    parts = []
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    for err in errors[:MAX_ERRORS]:
        loc = ".".join(_loc_part(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        # A model-level check has no location; its message names the fields.
        parts.append(f"{prefix}{loc}: {msg}" if loc else f"{prefix}{msg}")
    if len(errors) > MAX_ERRORS:
        parts.append(f"and {len(errors) - MAX_ERRORS} more")
    return "; ".join(parts)


def _json_type(value: Any) -> str:
    if isinstance(value, dict):
        return (
            'an object without "interfaces" (wrap a single interface in a list: [{...}], '
            'or use {"interfaces": [{...}], "different_pfs": true})'
        )
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def parse_request(raw: Any, source: str) -> PodRequest:
    """Validate a pod's request; ``source`` (e.g. "pod ns/name annotation X") names it in errors.

    ``raw`` is the annotation string (JSON) or an already decoded value from
    the config's ``args``; either way a list of interface objects (the
    original form), or an object ``{"interfaces": [...], "different_pfs": bool}``
    for requests that set ``different_pfs``. Raises
    :class:`~rdma_cni.shared.errors.InvalidPodRequest` (code 101). Every value of the
    request an error repeats is quoted bounded (:func:`~rdma_cni.shared.quote.quote`), so
    the message's size does not grow with the request's.
    """
    value = raw
    if isinstance(raw, str):
        size = len(raw.encode("utf-8", "surrogatepass"))
        if size > MAX_REQUEST_BYTES:
            raise InvalidPodRequest(f"{source}: value is {size} bytes, the limit is {MAX_REQUEST_BYTES}")
        depth = depth_over(raw)
        if depth is not None:
            raise InvalidPodRequest(f"{source}: nested {depth} levels deep, the limit is {MAX_DEPTH}")
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise InvalidPodRequest(f"{source}: not valid JSON: {exc}") from exc
    options: dict[str, Any] = {}
    prefix = "entry "
    if isinstance(value, dict) and "interfaces" in value:
        options = {k: v for k, v in value.items() if k != "interfaces"}
        value = value["interfaces"]
        prefix = "interfaces entry "
        if not isinstance(value, list):
            raise InvalidPodRequest(f"{source}: interfaces: expected a JSON list of interface objects")
    if not isinstance(value, list):
        raise InvalidPodRequest(
            f"{source}: expected a JSON list of interface objects like "
            '[{"min_tx_rate": 1000, "max_tx_rate": 2000}, {}], got ' + _json_type(value)
        )
    if not value:
        raise InvalidPodRequest(
            f"{source}: asks for no interfaces; remove the network attachment instead of requesting zero"
        )
    if len(value) > MAX_INTERFACES:
        raise InvalidPodRequest(f"{source}: asks for {len(value)} interfaces, the limit is {MAX_INTERFACES}")
    try:
        return PodRequest(interfaces=value, **options)
    except ValidationError as exc:
        detail = format_errors(exc).replace("interfaces.", prefix)
        raise InvalidPodRequest(f"{source}: {detail}") from exc
