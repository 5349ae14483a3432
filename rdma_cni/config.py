"""Typed models for the network configuration and the pod's interface request.

Everything untrusted is validated here, at the edge: the netconf a runtime
sends on stdin, and the pod annotation a user writes. Errors name the field
path and the reason. pydantic is imported by this module, so only verbs that
need a full config import it.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from rdma_cni.errors import InvalidConfig, InvalidPodRequest, UnsupportedField
from rdma_cni.protocol import IFNAMSIZ, SUPPORTED_VERSIONS, valid_ifname

log = logging.getLogger("rdma_cni.config")

MAX_INTERFACES = 32
# 10 Tbit/s: far above any NIC, low enough that sums cannot overflow anything.
MAX_RATE_MBPS = 10_000_000
# The largest pod request (annotation text) accepted, in bytes.
MAX_REQUEST_BYTES = 64 * 1024
DEFAULT_ANNOTATION = "rdma_interfaces_required"
DEFAULT_STATE_DIR = "/var/lib/cni/rdma-cni"
DEFAULT_LOCK_FILE = "/run/rdma-cni/rdma-cni.lock"

Rate = Annotated[StrictInt, Field(ge=0, le=MAX_RATE_MBPS)]


class InterfaceRequest(BaseModel):
    """One requested RDMA interface: rates in Mbit/s and an optional pod-side name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_tx_rate: Rate = 0
    max_tx_rate: Rate = 0
    name: str | None = None

    @field_validator("name")
    @classmethod
    def _name_is_ifname(cls, v: str | None) -> str | None:
        if v is not None and not valid_ifname(v):
            raise ValueError(
                f"{v!r} is not a valid interface name (1-{IFNAMSIZ} printable ASCII characters, "
                "no '/', ':', '%', '.' or '..')"
            )
        return v

    @model_validator(mode="after")
    def _max_not_below_min(self) -> InterfaceRequest:
        if self.max_tx_rate and self.max_tx_rate < self.min_tx_rate:
            raise ValueError(
                f"max_tx_rate {self.max_tx_rate} is below min_tx_rate {self.min_tx_rate} (0 means no cap)"
            )
        return self


class PodRequest(BaseModel):
    """The validated list of interfaces a pod asks for (1 to 32)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    interfaces: Annotated[list[InterfaceRequest], Field(min_length=1, max_length=MAX_INTERFACES)]

    @model_validator(mode="after")
    def _names_unique(self) -> PodRequest:
        seen: dict[str, int] = {}
        for index, entry in enumerate(self.interfaces):
            if entry.name is None:
                continue
            if entry.name in seen:
                raise ValueError(
                    f"interface names must be unique: entries {seen[entry.name]} and {index} "
                    f"are both named {entry.name!r}"
                )
            seen[entry.name] = index
        return self


class IpamConfig(BaseModel):
    """The IPAM section: only ``type`` matters to us, the rest goes to the IPAM plugin."""

    model_config = ConfigDict(extra="allow")

    type: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]


class DnsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nameservers: list[str] = []
    domain: str = ""
    search: list[str] = []
    options: list[str] = []


_ANNOTATION_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)


class NetConf(BaseModel):
    """The network configuration rdma-cni reads. Field names are the JSON keys."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    cniVersion: Literal["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]
    type: str = "rdma-cni"
    ipam: IpamConfig | None = None
    dns: DnsConfig = DnsConfig()
    args: dict[str, Any] = {}
    runtimeConfig: dict[str, Any] = {}
    prevResult: dict[str, Any] | None = None
    capabilities: dict[str, bool] = {}

    pfs: list[str] | None = None
    annotation: str = DEFAULT_ANNOTATION
    defaultRequest: Annotated[list[InterfaceRequest], Field(min_length=1, max_length=MAX_INTERFACES)] = [
        InterfaceRequest()
    ]
    kubeconfig: str | None = None
    rdmaIsolation: Literal["auto", "required", "off"] = "auto"
    stateDir: str = DEFAULT_STATE_DIR
    lockFile: str = DEFAULT_LOCK_FILE
    lockTimeoutSeconds: Annotated[float, Field(gt=0, le=600)] = 60.0
    ipamTimeoutSeconds: Annotated[float, Field(gt=0, le=600)] = 30.0
    capacityMbps: dict[str, Annotated[StrictInt, Field(ge=0, le=MAX_RATE_MBPS)]] = {}

    vlan: Annotated[StrictInt, Field(ge=0, le=4095)] | None = None
    vlanQoS: Annotated[StrictInt, Field(ge=0, le=7)] | None = None
    spoofchk: bool | None = None
    trust: bool | None = None
    linkState: Literal["auto", "enable", "disable"] | None = None
    mtu: Annotated[StrictInt, Field(ge=68, le=65535)] | None = None

    logFile: str | None = None
    logLevel: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("pfs")
    @classmethod
    def _pfs_are_ifnames(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            if not v:
                raise ValueError("must list at least one PF, or be omitted to use every SR-IOV PF")
            bad = [p for p in v if not valid_ifname(p)]
            if bad:
                raise ValueError(f"not interface names: {bad}")
        return v

    @field_validator("capacityMbps")
    @classmethod
    def _capacity_keys(cls, v: dict[str, int]) -> dict[str, int]:
        bad = [p for p in v if not valid_ifname(p)]
        if bad:
            raise ValueError(f"keys must be PF interface names, not {bad}")
        return v

    @field_validator("annotation")
    @classmethod
    def _annotation_key(cls, v: str) -> str:
        if not _ANNOTATION_KEY.fullmatch(v):
            raise ValueError(f"{v!r} is not a valid Kubernetes annotation key")
        return v

    @field_validator("stateDir", "lockFile", "kubeconfig", "logFile")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or "\0" in v):
            raise ValueError(f"must be an absolute path, got {v!r}")
        return v

    @model_validator(mode="after")
    def _vlan_qos_needs_vlan(self) -> NetConf:
        if self.vlanQoS and not self.vlan:
            raise ValueError("vlanQoS needs a non-zero vlan")
        return self

    @property
    def unknown_keys(self) -> list[str]:
        """Keys the config carried that this model does not define."""
        return sorted((self.model_extra or {}).keys())

    def vf_settings(self) -> dict[str, Any]:
        """The PF-side VF settings this network applies to every VF (only those configured)."""
        out: dict[str, Any] = {}
        if self.vlan is not None:
            out["vlan"] = [self.vlan, self.vlanQoS or 0]
        if self.spoofchk is not None:
            out["spoofchk"] = self.spoofchk
        if self.trust is not None:
            out["trust"] = self.trust
        if self.linkState is not None:
            out["link_state"] = self.linkState
        return out


# Keys runtimes and Multus add on their own: ignored without a warning.
RUNTIME_KEYS = frozenset({"deviceID", "pciBusID", "plugins", "disableCheck", "disableGC", "cniVersions"})

# Keys that users carry over from sriov-cni or the original plugin, mapped to
# what they should write instead.
_HINTS = {
    "mintxrate": "defaultRequest[].min_tx_rate (rates are per interface; pods set them in the annotation)",
    "maxtxrate": "defaultRequest[].max_tx_rate (rates are per interface; pods set them in the annotation)",
    "linkstate": "linkState",
    "vlanqos": "vlanQoS",
    "loglevel": "logLevel",
    "logfile": "logFile",
}


def _norm(key: str) -> str:
    return re.sub(r"[-_\s]", "", key).lower()


@functools.cache
def _known_fields() -> dict[str, str]:
    return {_norm(name): name for name in NetConf.model_fields}


_CUTOFF = 0.85
_LONGEST_FIELD = max(len(_norm(name)) for name in NetConf.model_fields)


# A config may carry any number of unknown keys (up to the stdin limit): the
# fuzzy match (difflib, the costly part) runs for the first few only, and only
# that many are logged one by one. Exact and normalised matches are always checked.
FUZZY_SUGGESTIONS = 32
LOGGED_UNKNOWN_KEYS = 20


def suggest_field(key: str, fuzzy: bool = True) -> str | None:
    """The known field an unknown key probably meant, or None if it looks unrelated.

    ``fuzzy`` also tries near spellings (difflib); without it only keys equal
    to a field up to case, '-', '_' and spaces (or a known carry-over) match.
    """
    known = _known_fields()
    n = _norm(key)
    if n in _HINTS:
        return _HINTS[n]
    if n in known and known[n] != key:
        return known[n]
    # difflib's ratio is at most 2*len(field)/(len(field)+len(key)): a key much
    # longer than every field cannot reach the cutoff, whatever its letters.
    if not fuzzy or 2 * _LONGEST_FIELD / (_LONGEST_FIELD + len(n)) < _CUTOFF:
        return None
    close = difflib.get_close_matches(n, list(known), n=1, cutoff=_CUTOFF)
    return known[close[0]] if close else None


def _format_errors(exc: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        # A model-level check has no location; its message names the fields.
        parts.append(f"{prefix}{loc}: {msg}" if loc else f"{prefix}{msg}")
    return "; ".join(parts)


def load_netconf(doc: dict[str, Any]) -> NetConf:
    """Validate a decoded network configuration.

    Invalid values raise code 7 naming the field; a key that looks like a
    misspelling of a known one raises code 2 naming both.
    """
    unknown = 0
    for key in doc:
        if key in NetConf.model_fields or key in RUNTIME_KEYS:
            continue
        unknown += 1
        meant = suggest_field(key, fuzzy=unknown <= FUZZY_SUGGESTIONS)
        if meant:
            raise UnsupportedField(
                f"unsupported key {key!r} in network configuration: did you mean {meant}?",
                f"{key}={json.dumps(doc[key])[:200]}",
            )
    if "cniVersion" in doc and doc["cniVersion"] not in SUPPORTED_VERSIONS:
        # Version errors are code 1 and are raised by the protocol layer first;
        # this only guards direct callers of load_netconf.
        raise InvalidConfig(f"cniVersion {doc['cniVersion']!r} is not supported")
    try:
        conf = NetConf.model_validate(doc)
    except ValidationError as exc:
        raise InvalidConfig("invalid network configuration: " + _format_errors(exc)) from exc
    ignored = [key for key in conf.unknown_keys if key not in RUNTIME_KEYS]
    for key in ignored[:LOGGED_UNKNOWN_KEYS]:
        log.info("ignoring unknown network configuration key %r", key)
    if len(ignored) > LOGGED_UNKNOWN_KEYS:
        log.info("ignoring %d more unknown network configuration keys", len(ignored) - LOGGED_UNKNOWN_KEYS)
    return conf


def _json_type(value: Any) -> str:
    if isinstance(value, dict):
        return "an object (wrap a single interface in a list: [{...}])"
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def parse_request(raw: Any, source: str) -> PodRequest:
    """Validate a pod's request; ``source`` (e.g. "pod ns/name annotation X") names it in errors.

    ``raw`` is the annotation string (JSON) or an already decoded value from
    the config's ``args``; either way it must be a list of objects.
    """
    value = raw
    if isinstance(raw, str):
        size = len(raw.encode("utf-8", "surrogatepass"))
        if size > MAX_REQUEST_BYTES:
            raise InvalidPodRequest(f"{source}: value is {size} bytes, the limit is {MAX_REQUEST_BYTES}")
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise InvalidPodRequest(f"{source}: not valid JSON: {exc}") from exc
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
        return PodRequest(interfaces=value)
    except ValidationError as exc:
        detail = _format_errors(exc).replace("interfaces.", "entry ")
        raise InvalidPodRequest(f"{source}: {detail}") from exc
