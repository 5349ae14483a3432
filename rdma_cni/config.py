"""Typed model for the network configuration.

The netconf a runtime sends on stdin is validated here, at the edge (the pod's
request has its own module, :mod:`rdma_cni.podrequest`). Errors name the field
path and the reason. pydantic is imported by this module, so only verbs that
need a full config import it.
"""

from __future__ import annotations

import difflib
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

from rdma_cni.errors import InvalidConfig, UnsupportedField
from rdma_cni.podrequest import (
    DEFAULT_ANNOTATION,
    MAX_INTERFACES,
    MAX_RATE_MBPS,
    InterfaceRequest,
    format_errors,
)
from rdma_cni.protocol import SUPPORTED_VERSIONS, valid_ifname

log = logging.getLogger("rdma_cni.config")

DEFAULT_STATE_DIR = "/var/lib/cni/rdma-cni"
DEFAULT_LOCK_FILE = "/run/rdma-cni/rdma-cni.lock"


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


def suggest_field(key: str) -> str | None:
    """The known field an unknown key probably meant, or None if it looks unrelated."""
    known = {_norm(name): name for name in NetConf.model_fields}
    n = _norm(key)
    if n in _HINTS:
        return _HINTS[n]
    if n in known and known[n] != key:
        return known[n]
    close = difflib.get_close_matches(n, list(known), n=1, cutoff=0.85)
    return known[close[0]] if close else None


def load_netconf(doc: dict[str, Any]) -> NetConf:
    """Validate a decoded network configuration.

    Invalid values raise code 7 naming the field; a key that looks like a
    misspelling of a known one raises code 2 naming both.
    """
    for key in doc:
        if key in NetConf.model_fields or key in RUNTIME_KEYS:
            continue
        meant = suggest_field(key)
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
        raise InvalidConfig("invalid network configuration: " + format_errors(exc)) from exc
    for key in conf.unknown_keys:
        if key not in RUNTIME_KEYS:
            log.info("ignoring unknown network configuration key %r", key)
    return conf
