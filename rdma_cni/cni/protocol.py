"""The CNI protocol: verbs, versions, environment, and result documents.

Standard library only, so VERSION and every error path stay cheap to start.
The environment is parsed and validated here, once, into :class:`CniEnv`;
nothing downstream reads ``CNI_*`` variables itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rdma_cni.cni.errors import DecodeFailure, IncompatibleVersion, InvalidConfig, InvalidEnvironment

# The interface-name rule lives in shared.names (the pod request uses it too); callers of the
# CNI edge keep importing IFNAMSIZ and valid_ifname from here.
from rdma_cni.shared.jsondepth import MAX_DEPTH, depth_over
from rdma_cni.shared.names import (
    IFNAME_RULE,
    IFNAMSIZ,
    LABEL_RULE,
    SUBDOMAIN_RULE,
    dns_label,
    dns_subdomain,
    valid_ifname,
)
from rdma_cni.shared.quote import quote

# 0.1.0 and 0.2.0 results hold a single ip4/ip6 pair and no interface list, so
# they cannot describe a pod with several VFs: refused on purpose.
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
LATEST_VERSION = SUPPORTED_VERSIONS[-1]

VERBS: tuple[str, ...] = ("ADD", "DEL", "CHECK", "VERSION", "STATUS", "GC")

# The oldest config version in which each verb exists.
MIN_VERSION_FOR_VERB: dict[str, str] = {"CHECK": "0.4.0", "STATUS": "1.1.0", "GC": "1.1.0"}

# Required variables per verb (CNI_COMMAND itself is checked first). CNI_PATH
# is required only when IPAM is delegated, which the config decides, so the
# commands ask for it through CniEnv.require_path().
REQUIRED_ENV: dict[str, tuple[str, ...]] = {
    "ADD": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"),
    "CHECK": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"),
    "DEL": ("CNI_CONTAINERID", "CNI_IFNAME"),
    "GC": ("CNI_PATH",),
    "STATUS": (),
    "VERSION": (),
}

# The variables each verb reads; only these are parsed and validated, so a
# value a verb ignores cannot fail it. libcni probes VERSION with
# CNI_NETNS=dummy, CNI_IFNAME=dummy and CNI_PATH=dummy, and GC/STATUS may
# inherit a runtime's leftovers. CNI_ARGS is read by ADD alone (the pod and
# MAC=): DEL must not fail over a malformed CNI_ARGS it has no use for.
USED_ENV: dict[str, frozenset[str]] = {
    "ADD": frozenset({"CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH"}),
    "CHECK": frozenset({"CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"}),
    "DEL": frozenset({"CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"}),
    "GC": frozenset({"CNI_PATH"}),
    "STATUS": frozenset({"CNI_PATH"}),
    "VERSION": frozenset(),
}

# Container IDs name record files: a conservative character set with no
# separators, starting with an alphanumeric so "." and ".." are impossible.
_CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}")

# The largest network configuration read from stdin. Real ones (with a
# prevResult and runtimeConfig) are a few kilobytes; the bound keeps a hostile
# one from costing seconds of parsing and validation under every verb.
MAX_CONFIG_BYTES = 1 << 20


def version_tuple(version: str) -> tuple[int, int, int]:
    """Parse ``X.Y.Z`` into a comparable tuple; raise ValueError otherwise."""
    parts = version.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a semantic version: {version!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


def check_version(version: object, verb: str) -> str:
    """Return ``version`` if this plugin can speak it for ``verb``; else raise code 1."""
    supported = ", ".join(SUPPORTED_VERSIONS)
    if not isinstance(version, str) or version not in SUPPORTED_VERSIONS:
        raise IncompatibleVersion(
            f"incompatible CNI version {quote(version)}: supported versions are {supported}",
            "0.1.0 and 0.2.0 cannot describe several interfaces and are not supported",
        )
    minimum = MIN_VERSION_FOR_VERB.get(verb)
    if minimum and version_tuple(version) < version_tuple(minimum):
        raise IncompatibleVersion(
            f"CNI_COMMAND {verb} needs cniVersion {minimum} or later, the config says {version}",
        )
    return version


def decode_stdin(raw: bytes) -> dict[str, Any]:
    """Decode the network configuration from stdin: a JSON object, else code 6 (7: too large or deep)."""
    if len(raw) > MAX_CONFIG_BYTES:
        raise InvalidConfig(
            f"the network configuration on stdin is larger than {MAX_CONFIG_BYTES} bytes (1 MiB), "
            "the limit for a single plugin's configuration"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeFailure(
            "failed to decode the network configuration on stdin: not UTF-8", str(exc)
        ) from exc
    depth = depth_over(text)
    if depth is not None:
        # A pod's Multus cni-args arrive as args.cni: the one part of the config a tenant writes.
        raise InvalidConfig(
            f"the network configuration on stdin is nested {depth} levels deep, more than the {MAX_DEPTH} "
            "rdma-cni reads (a pod's Multus cni-args arrive as args.cni)"
        )
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        # RecursionError: kept for a caller whose stack leaves the parser less room than MAX_DEPTH.
        raise DecodeFailure(
            "failed to decode the network configuration on stdin: not JSON", str(exc)
        ) from exc
    if not isinstance(doc, dict):
        raise DecodeFailure(
            "failed to decode the network configuration on stdin: expected a JSON object, "
            f"got {type(doc).__name__}"
        )
    return doc


def validate_ifname(name: str, what: str) -> str:
    """Check a Linux interface name (:data:`~rdma_cni.shared.names.IFNAME_RULE`); ``what`` names its source.

    The name may be a pod's choice (Multus passes a selection's ``interface``
    as CNI_IFNAME): the error quotes it bounded.
    """
    if not name:
        raise InvalidEnvironment(f"{what} is empty: an interface name is 1-{IFNAMSIZ} characters")
    if not valid_ifname(name):
        raise InvalidEnvironment(f"{what}={quote(name)} is not a valid interface name ({IFNAME_RULE})")
    return name


# A pod's UID as Kubernetes makes one: a UUID (the API server's, 8-4-4-4-12 hex digits) or the
# same 128 bits as 32 hex digits, which is what kubelet gives a static pod (an md5 of its manifest).
_POD_UID = re.compile(r"[0-9A-Fa-f]{8}(-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}|[0-9A-Fa-f]{32}")
POD_UID_RULE = "a UUID: 8-4-4-4-12 hex digits, or the 32 hex digits kubelet gives a static pod"


def parse_cni_args(raw: str) -> dict[str, str]:
    """Parse ``K=V;K=V`` and check the pod it names (:func:`check_pod_args`).

    Unknown keys are kept (runtimes send several).
    """
    args: dict[str, str] = {}
    for item in raw.split(";"):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidEnvironment(f"CNI_ARGS is malformed: {quote(item)} is not KEY=VALUE")
        args[key] = value
    check_pod_args(args)
    return args


def check_pod_args(args: Mapping[str, str]) -> None:
    """Refuse (code 4, the key named) a pod in CNI_ARGS that Kubernetes could not have named.

    The pod's namespace and name go into the API server's URL, the
    allocation record and the node state the agent publishes (whose readers
    refuse a whole state over one bad name), so they are checked before
    anything uses them: ``K8S_POD_NAMESPACE`` a DNS-1123 label,
    ``K8S_POD_NAME`` a DNS-1123 subdomain, ``K8S_POD_UID`` a UUID. An empty
    namespace names no pod (manual use), and without a namespace
    ``K8S_POD_NAME`` is not a pod's name but podman's container name
    (``My_Ctr`` is one), which nothing reads: neither is checked then.
    """
    namespace = args.get("K8S_POD_NAMESPACE", "")
    if namespace:
        if not dns_label(namespace):
            raise InvalidEnvironment(
                f"CNI_ARGS K8S_POD_NAMESPACE={quote(namespace)} is not a namespace's name: {LABEL_RULE}"
            )
        name = args.get("K8S_POD_NAME", "")
        if not name:
            raise InvalidEnvironment(
                f"CNI_ARGS names namespace {namespace} but no pod: K8S_POD_NAME is missing or empty"
            )
        if not dns_subdomain(name):
            raise InvalidEnvironment(
                f"CNI_ARGS K8S_POD_NAME={quote(name)} is not a pod's name: {SUBDOMAIN_RULE}"
            )
    uid = args.get("K8S_POD_UID", "")
    if uid and not _POD_UID.fullmatch(uid):
        raise InvalidEnvironment(f"CNI_ARGS K8S_POD_UID={quote(uid)} is not {POD_UID_RULE}")


@dataclass(frozen=True)
class PodRef:
    """The Kubernetes pod an attachment belongs to, from CNI_ARGS."""

    namespace: str
    name: str
    uid: str = ""

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class CniEnv:
    """The validated CNI environment of one invocation."""

    command: str
    container_id: str = ""
    netns: str = ""
    ifname: str = ""
    args: Mapping[str, str] = field(default_factory=dict)
    path: tuple[str, ...] = ()
    # The raw environment, for IPAM delegation (which must see the same one).
    environ: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def pod(self) -> PodRef | None:
        """The pod from K8S_POD_NAMESPACE/K8S_POD_NAME (:func:`check_pod_args`), or None for manual use."""
        ns = self.args.get("K8S_POD_NAMESPACE", "")
        name = self.args.get("K8S_POD_NAME", "")
        if ns and name:
            return PodRef(ns, name, self.args.get("K8S_POD_UID", ""))
        return None

    def require_path(self) -> tuple[str, ...]:
        """CNI_PATH as a list of directories; code 4 when IPAM needs it and it is missing."""
        if not self.path:
            raise InvalidEnvironment(
                f"CNI_PATH is not set: it is needed to find the IPAM plugin for {self.command}"
            )
        return self.path


def parse_env(environ: Mapping[str, str]) -> CniEnv:
    """Validate the CNI environment for the verb in CNI_COMMAND.

    Only the variables that verb reads (:data:`USED_ENV`) are validated and
    set on the result; the others are left empty there (``environ`` keeps
    them all, for IPAM delegation).
    """
    command = environ.get("CNI_COMMAND", "")
    if not command:
        raise InvalidEnvironment("CNI_COMMAND is not set: expected one of " + ", ".join(VERBS))
    if command not in VERBS:
        raise InvalidEnvironment(
            f"CNI_COMMAND={quote(command)} is not a CNI verb: expected one of " + ", ".join(VERBS)
        )
    for var in REQUIRED_ENV[command]:
        if not environ.get(var):
            raise InvalidEnvironment(f"{var} is required for {command} but is not set")
    used = USED_ENV[command]

    def read(var: str) -> str:
        return environ.get(var, "") if var in used else ""

    container_id = read("CNI_CONTAINERID")
    if container_id and not _CONTAINER_ID.fullmatch(container_id):
        raise InvalidEnvironment(
            f"CNI_CONTAINERID={quote(container_id)} is invalid: use 1-200 characters from "
            "[A-Za-z0-9_.-], starting with a letter or digit"
        )
    ifname = read("CNI_IFNAME")
    if ifname:
        validate_ifname(ifname, "CNI_IFNAME")
    netns = read("CNI_NETNS")
    if netns and not netns.startswith("/"):
        raise InvalidEnvironment(f"CNI_NETNS={quote(netns)} must be an absolute path")
    path = tuple(p for p in read("CNI_PATH").split(":") if p)
    return CniEnv(
        command=command,
        container_id=container_id,
        netns=netns,
        ifname=ifname,
        args=parse_cni_args(read("CNI_ARGS")),
        path=path,
        environ=dict(environ),
    )


# ---------------------------------------------------------------------------
# Results


@dataclass
class Interface:
    """An interface in a result; ``sandbox`` is the netns path for pod-side ones."""

    name: str
    mac: str = ""
    sandbox: str = ""
    mtu: int | None = None
    pci_id: str = ""


@dataclass
class IPConfig:
    """An address from IPAM, attached to the result interface at ``interface``."""

    address: str  # CIDR notation, e.g. 10.1.0.5/24
    gateway: str = ""
    interface: int | None = None

    @property
    def family(self) -> str:
        return "6" if ":" in self.address else "4"


@dataclass
class Route:
    """A route from IPAM; the 1.1.0 extras are emitted only in 1.1.0."""

    dst: str
    gw: str = ""
    mtu: int | None = None
    advmss: int | None = None
    priority: int | None = None
    table: int | None = None
    scope: int | None = None


@dataclass
class Result:
    """A CNI ADD result in version-neutral form; :meth:`to_dict` shapes it."""

    interfaces: list[Interface] = field(default_factory=list)
    ips: list[IPConfig] = field(default_factory=list)
    routes: list[Route] = field(default_factory=list)
    dns: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, version: str) -> dict[str, Any]:
        """Serialize for ``version``: 0.3.x/0.4.0 carry ips[].version, 1.1.0 adds mtu/pciID."""
        v = version_tuple(version)
        modern = v >= (1, 1, 0)
        interfaces = []
        for itf in self.interfaces:
            doc: dict[str, Any] = {"name": itf.name}
            if itf.mac:
                doc["mac"] = itf.mac
            if itf.sandbox:
                doc["sandbox"] = itf.sandbox
            if modern and itf.mtu:
                doc["mtu"] = itf.mtu
            if modern and itf.pci_id:
                doc["pciID"] = itf.pci_id
            interfaces.append(doc)
        ips = []
        for ip in self.ips:
            ipdoc: dict[str, Any] = {}
            if v < (1, 0, 0):
                ipdoc["version"] = ip.family
            ipdoc["address"] = ip.address
            if ip.gateway:
                ipdoc["gateway"] = ip.gateway
            if ip.interface is not None:
                ipdoc["interface"] = ip.interface
            ips.append(ipdoc)
        routes = []
        for r in self.routes:
            rdoc: dict[str, Any] = {"dst": r.dst}
            if r.gw:
                rdoc["gw"] = r.gw
            if modern:
                for key in ("mtu", "advmss", "priority", "table", "scope"):
                    val = getattr(r, key)
                    if val is not None:
                        rdoc[key] = val
            routes.append(rdoc)
        out: dict[str, Any] = {"cniVersion": version, "interfaces": interfaces, "ips": ips}
        if routes:
            out["routes"] = routes
        out["dns"] = dict(self.dns)
        return out

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Result:
        """Read a result of any supported version (an IPAM answer or a prevResult)."""
        if not isinstance(doc, Mapping):
            raise DecodeFailure("a CNI result must be a JSON object")
        try:
            interfaces = [
                Interface(
                    name=str(i["name"]),
                    mac=str(i.get("mac", "")),
                    sandbox=str(i.get("sandbox", "")),
                    mtu=i.get("mtu"),
                    pci_id=str(i.get("pciID", "")),
                )
                for i in doc.get("interfaces") or []
            ]
            ips = [
                IPConfig(
                    address=str(i["address"]), gateway=str(i.get("gateway", "")), interface=i.get("interface")
                )
                for i in doc.get("ips") or []
            ]
            routes = [
                Route(
                    dst=str(r["dst"]),
                    gw=str(r.get("gw", "")),
                    mtu=r.get("mtu"),
                    advmss=r.get("advmss"),
                    priority=r.get("priority"),
                    table=r.get("table"),
                    scope=r.get("scope"),
                )
                for r in doc.get("routes") or []
            ]
        except (KeyError, TypeError, AttributeError) as exc:
            raise DecodeFailure("malformed CNI result", f"{type(exc).__name__}: {exc}") from exc
        dns = doc.get("dns") or {}
        if not isinstance(dns, Mapping):
            raise DecodeFailure("malformed CNI result: dns must be an object")
        return cls(interfaces=interfaces, ips=ips, routes=routes, dns=dict(dns))


def version_document(cni_version: str) -> dict[str, Any]:
    """The VERSION answer."""
    return {"cniVersion": cni_version, "supportedVersions": list(SUPPORTED_VERSIONS)}
