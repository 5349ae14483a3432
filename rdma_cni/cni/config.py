"""Typed model for the network configuration.

The netconf a runtime sends on stdin is validated here, at the edge (the pod's
request has its own module, :mod:`rdma_cni.shared.podrequest`). Errors name the field
path and the reason. pydantic is imported by this module, so only verbs that
need a full config import it.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from rdma_cni.cni.errors import InvalidConfig, UnsupportedField
from rdma_cni.cni.protocol import SUPPORTED_VERSIONS, valid_ifname
from rdma_cni.shared.names import NETWORK_NAME_PATTERN, annotation_key
from rdma_cni.shared.podrequest import (
    DEFAULT_ANNOTATION,
    MAX_INTERFACES,
    MAX_RATE_MBPS,
    InterfaceRequest,
    RailLabel,
    format_errors,
)
from rdma_cni.shared.quote import quote

log = logging.getLogger("rdma_cni.config")

# The network the built-in conflist (install --write-conf), conf/ and the node agent without
# --network-config describe: the plugin's defaults under the sample network's name.
DEFAULT_NETWORK_NAME = "rdma-net"
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


_MAC = re.compile(r"[0-9A-Fa-f]{2}(:[0-9A-Fa-f]{2}){5}")


def parse_mac(value: Any, source: str) -> str:
    """A unicast Ethernet address, lower-cased; code 7 naming ``source`` otherwise.

    The kernel refuses a multicast or all-zero address on a netdev; refusing
    it here keeps the node untouched and names where the value came from.
    """
    if not isinstance(value, str) or not _MAC.fullmatch(value):
        raise InvalidConfig(
            f"{source}: {quote(value)} is not a MAC address (six hex octets separated by ':')"
        )
    mac = value.lower()
    if int(mac[:2], 16) & 1:
        raise InvalidConfig(f"{source}: {mac} is a multicast address, a VF needs a unicast one")
    if mac == "00:00:00:00:00:00":
        raise InvalidConfig(f"{source}: 00:00:00:00:00:00 is not a usable MAC address")
    return mac


def first_interface_mac(conf: NetConf, cni_args: Mapping[str, str]) -> str:
    """The MAC the runtime asks for on the first interface, or "" for none.

    ``runtimeConfig.mac`` (the ``mac`` capability) wins over ``MAC=`` in
    CNI_ARGS (podman's ``--network net:mac=..``) when both are given: it is
    the structured form a runtime sends on purpose; both are validated.
    """
    from_args = parse_mac(cni_args["MAC"], "CNI_ARGS MAC") if "MAC" in cni_args else ""
    if "mac" not in conf.runtimeConfig:
        return from_args
    mac = parse_mac(conf.runtimeConfig["mac"], "runtimeConfig.mac")
    if from_args and from_args != mac:
        log.warning("runtimeConfig.mac %s overrides CNI_ARGS MAC=%s", mac, from_args)
    return mac


class PfEntry(BaseModel):
    """An entry of ``pfs`` written as an object: the PF's name and the operator's rail label for it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    rail: RailLabel | None = None

    @field_validator("name")
    @classmethod
    def _name_is_ifname(cls, v: str) -> str:
        if not valid_ifname(v):
            raise ValueError(f"{v!r} is not an interface name")
        return v


class NetConf(BaseModel):
    """The network configuration rdma-cni reads. Field names are the JSON keys."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    cniVersion: Literal["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
    # The one network-name rule, which the node state checks too.
    name: Annotated[str, Field(min_length=1, pattern=NETWORK_NAME_PATTERN)]
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
    # A DRA network (docs/dra.md): its PFs are published as ResourceSlices instead of in the node
    # state, and ADD gives a pod the VFs its claims were prepared with, not a placement of its own.
    dra: StrictBool = False

    vlan: Annotated[StrictInt, Field(ge=0, le=4095)] | None = None
    vlanQoS: Annotated[StrictInt, Field(ge=0, le=7)] | None = None
    spoofchk: bool | None = None
    trust: bool | None = None
    linkState: Literal["auto", "enable", "disable"] | None = None
    mtu: Annotated[StrictInt, Field(ge=68, le=65535)] | None = None

    logFile: str | None = None
    logLevel: Literal["debug", "info", "warning", "error"] = "info"

    # PF name -> rail, from the entries of ``pfs`` written as {"name", "rail"} objects.
    _rails: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _pf_entries(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> NetConf:
        """Entries of ``pfs`` may be names or ``{"name", "rail"}`` objects; the field keeps the names.

        So every reader of ``pfs`` sees names, as before rails existed, and
        :attr:`rails` has the labels.
        """
        rails: dict[str, str] = {}
        entries = data.get("pfs") if isinstance(data, dict) else None
        if isinstance(entries, list) and any(isinstance(e, dict) for e in entries):
            names: list[Any] = []
            for k, entry in enumerate(entries):
                if not isinstance(entry, dict):
                    names.append(entry)
                    continue
                try:
                    parsed = PfEntry.model_validate(entry)
                except ValidationError as exc:
                    raise ValueError(format_errors(exc, f"pfs.{k}.")) from None
                names.append(parsed.name)
                if parsed.rail is not None:
                    rails[parsed.name] = parsed.rail
            data = {**data, "pfs": names}
        conf = handler(data)
        conf._rails = rails
        return conf

    @property
    def rails(self) -> dict[str, str]:
        """The rail label of each PF that has one (from ``pfs`` entries written as objects)."""
        return dict(self._rails)

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
        if not annotation_key(v):
            raise ValueError(f"{v!r} is not a valid Kubernetes annotation key")
        return v

    @field_validator("stateDir", "lockFile", "kubeconfig", "logFile")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or "\0" in v):
            raise ValueError(f"must be an absolute path, got {v!r}")
        return v

    @model_validator(mode="after")
    def _dra_lists_its_pfs(self) -> NetConf:
        # Each PF is one path's (docs/dra.md): a DRA network names its PFs, never "every PF".
        if self.dra and self.pfs is None:
            raise ValueError('a DRA network ("dra": true) must list its PFs in pfs')
        return self

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
    import difflib  # here: only a config with an unknown key needs it

    close = difflib.get_close_matches(n, list(known), n=1, cutoff=_CUTOFF)
    return known[close[0]] if close else None


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
        raise InvalidConfig("invalid network configuration: " + format_errors(exc)) from exc
    ignored = [key for key in conf.unknown_keys if key not in RUNTIME_KEYS]
    for key in ignored[:LOGGED_UNKNOWN_KEYS]:
        log.info("ignoring unknown network configuration key %r", key)
    if len(ignored) > LOGGED_UNKNOWN_KEYS:
        log.info("ignoring %d more unknown network configuration keys", len(ignored) - LOGGED_UNKNOWN_KEYS)
    return conf
