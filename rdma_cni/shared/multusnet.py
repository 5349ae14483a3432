"""Multus' network annotations read exactly as Multus reads them, or refused.

Multus (v4.3.0, ``pkg/k8sclient``: ``parsePodNetworkAnnotation``, and
``tryLoadK8sPodDefaultNetwork`` for ``v1.multus-cni.io/default-network``)
decodes ``k8s.v1.cni.cncf.io/networks`` with Go's ``encoding/json`` into its
``NetworkSelectionElement``, or splits the comma form. The extender must count
what Multus will attach, so this module repeats Go's rules rather than
Python's: keys match a field exactly or by Go's simple case folding (``Name``,
``CNI-ARGS``, ``cni-arg`` with U+017F for s), a repeated string field keeps
the last non-null value, a repeated ``cni-args`` object merges into the same
map, a type error anywhere fails the whole annotation, numbers in ``cni-args``
become float64 (an overflow fails it), lone surrogate escapes become U+FFFD.

Each reading ends in one of three ways:

- a list of :class:`Selection` (what Multus selects), with ``doubt`` set when
  Multus may refuse the pod for a value not checked here exactly as Go checks
  it (an ``ips`` or ``default-route`` address that is not plain, a ``mac`` in
  no ParseMAC form, an address list given twice): the caller refuses the pod if
  it selects an rdma-cni network, so a doubt never under-counts;
- :class:`MultusFails`: Multus fails the pod's sandbox on this text (a parse
  error, a type error, a panic in Multus): nothing of the pod is attached;
- :class:`UnreadableNetworks` (an :class:`InvalidPodRequest`): the text cannot
  be read here exactly as Multus would, or past this reader's bounds (nested
  deeper than :data:`~rdma_cni.shared.jsondepth.MAX_DEPTH` levels, over the API
  server's 256 KiB, more than :data:`MAX_ELEMENTS` networks): the extender
  refuses the pod.

``tests/integration/test_multus_differential.py`` checks this against
Multus' own code, built from the module at the version above.
"""

from __future__ import annotations

import decimal
import ipaddress
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rdma_cni.shared.errors import InvalidPodRequest
from rdma_cni.shared.jsondepth import MAX_DEPTH, depth_over

__all__ = [
    "DEFAULT_NETWORK_ANNOTATION",
    "MAX_ANNOTATIONS_BYTES",
    "MAX_ELEMENTS",
    "MULTUS_VERSION",
    "NETWORKS_ANNOTATION",
    "MultusFails",
    "Reading",
    "Selection",
    "UnreadableNetworks",
    "read_default_network",
    "read_networks",
]

MULTUS_VERSION = "v4.3.0"
NETWORKS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
DEFAULT_NETWORK_ANNOTATION = "v1.multus-cni.io/default-network"
# The API server refuses a pod whose annotations (keys and values) exceed 256 KiB in all:
# no real annotation is longer, so a longer text did not come through it.
MAX_ANNOTATIONS_BYTES = 256 * 1024
# Networks one annotation may select, any network (each is an interface in the pod): the reader's
# work is per element, and 256 KiB of "a,a,..." is 131,072 of them.
MAX_ELEMENTS = 1024

# Go's unicode.IsSpace (strings.TrimSpace trims these): ASCII space and \t\n\v\f\r, NEL, NBSP and
# the White_Space property's others. Python's str.strip() differs (it also strips \x1c-\x1f).
_GO_SPACE = frozenset(
    "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
# The runes outside ASCII whose Go fold (smallest rune of the unicode.SimpleFold orbit) is ASCII:
# encoding/json matches a key to a field name through this fold. Computed with Go 1.26 over every
# rune; the differential test feeds both to Multus.
_GO_FOLD = {"\u017f": "S", "\u212a": "K"}
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_IFNAME_BAD = frozenset(" \t\n\v\f\r/")
_IFNAMSIZ = 15
# Python's parser stops at its recursion limit, about 1,000 levels less its caller's, and Go's
# allows 10,000: text deeper than MAX_DEPTH is measured before the parse and refused rather than
# read differently. RecursionError stays caught, should a caller's stack be deeper than expected.
_SURROGATE = re.compile("[\ud800-\udfff]")
_MAC = re.compile(r"[0-9A-Fa-f]{2}(?:([:-])[0-9A-Fa-f]{2})(?:\1[0-9A-Fa-f]{2})*")
_MAC_DOTS = re.compile(r"[0-9A-Fa-f]{4}(?:\.[0-9A-Fa-f]{4})*")
_PLAIN_IP = re.compile(r"[0-9A-Fa-f:.]+(/(0|[1-9][0-9]{0,2}))?")

# NetworkSelectionElement's JSON names (Go struct tags), by Go fold.
_STRING_FIELDS = ("name", "namespace", "interface", "interfaceRequest", "mac", "infiniband-guid", "deviceID")
# PortMapEntry and BandwidthEntry: Multus does not check their values, only Go's types.
_PORT_MAP = {"hostPort": int, "containerPort": int, "protocol": str, "hostIP": str}
_BANDWIDTH = {"ingressRate": int, "ingressBurst": int, "egressRate": int, "egressBurst": int}
_SMALL_INT = re.compile(r"-?[1-9][0-9]{0,14}|0")
_INT64 = re.compile(r"-?(0|[1-9][0-9]{0,18})")


class MultusFails(Exception):
    """Multus fails the pod's sandbox on this annotation: none of the pod's networks is attached."""


class UnreadableNetworks(InvalidPodRequest):
    """The annotation cannot be read here exactly as Multus reads it: the extender refuses the pod."""


@dataclass(frozen=True)
class Selection:
    """One network Multus attaches: a NetworkSelectionElement's namespace, name, interface and cni-args."""

    namespace: str
    name: str
    cni_args: dict[str, Any] | None = field(default=None, compare=False)
    interface: str = ""


@dataclass(frozen=True)
class Reading:
    """What an annotation selects; ``doubt`` says why Multus may refuse it instead (None: it will not)."""

    selections: tuple[Selection, ...]
    doubt: str | None = None


class _Num:
    """A JSON number's text, converted only where Go converts it (unknown keys are skipped unread)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _fold(key: str) -> str:
    return "".join(_GO_FOLD.get(c, c.upper() if c.isascii() else c) for c in key)


_FIELDS = {
    _fold(name): name
    for name in (*_STRING_FIELDS, "ips", "cni-args", "portMappings", "bandwidth", "default-route")
}


def _go_trim(text: str) -> str:
    start, end = 0, len(text)
    while start < end and text[start] in _GO_SPACE:
        start += 1
    while end > start and text[end - 1] in _GO_SPACE:
        end -= 1
    return text[start:end]


def _go_string(text: str) -> str:
    # Go decodes a lone surrogate escape to U+FFFD; Python keeps the surrogate.
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


def _go_scalar(value: Any, where: str) -> Any:
    if isinstance(value, _Num):
        if _SMALL_INT.fullmatch(value.text):
            return int(value.text)  # exact in a float64 as it is
        number = float(value.text)
        if math.isinf(number):
            raise MultusFails(f"{where}: number {value.text[:40]} overflows float64")
        if number.is_integer() and abs(number) < 1e21:
            # Go marshals such a float64 as an integer of its shortest digits (1.2345678901234567e19
            # is 12345678901234567000): what the plugin's args.cni will hold.
            return int(decimal.Decimal(repr(number)))
        return number
    if isinstance(value, str):
        return _go_string(value)
    return value  # true, false, null


def _go_value(value: Any, where: str) -> Any:
    """A JSON value as Go's interface{} holds it, and so as Go marshals it into the plugin's args.cni.

    Walked with a stack of its own, not recursion: as deep as the parser went.
    """

    def made(item: Any, todo: list[tuple[Any, Any]]) -> Any:
        if isinstance(item, _Object):
            todo.append((item, {}))
        elif isinstance(item, list):
            todo.append((item, []))
        else:
            return _go_scalar(item, where)
        return todo[-1][1]

    todo: list[tuple[Any, Any]] = []
    root = made(value, todo)
    while todo:
        source, target = todo.pop()
        if isinstance(target, dict):  # an object: Go keeps the last of a repeated key
            for key, item in source:
                target[_go_string(key)] = made(item, todo)
        else:
            for item in source:
                target.append(made(item, todo))
    return root


class _Object(list):  # type: ignore[type-arg]
    """An object's (key, value) pairs in order, duplicates kept (Go sees every one)."""


def _loads(text: str) -> Any:
    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(
            text, object_pairs_hook=_Object, parse_int=_Num, parse_float=_Num, parse_constant=constant
        )
    except ValueError as exc:
        raise MultusFails(f"not valid JSON: {str(exc)[:120]}") from None


def _element(item: Any, index: int) -> tuple[Selection, str | None]:
    """One JSON element decoded as Go decodes it, and the doubt it leaves (None: none)."""
    where = f"element {index}"
    if item is None:
        raise MultusFails(f"{where} is null (Multus dereferences it and panics)")
    if not isinstance(item, _Object):
        raise MultusFails(f"{where} is not an object")
    strings: dict[str, str] = dict.fromkeys(_STRING_FIELDS, "")
    args: dict[str, Any] | None = None
    doubt: str | None = None
    addresses: dict[str, list[Any]] = {}  # ips, default-route: every value given, in order
    for key, value in item:
        name = _FIELDS.get(_fold(key))
        if name is None:
            continue  # Go skips an unknown key's value without converting it
        if name in _STRING_FIELDS:
            if isinstance(value, str):
                strings[name] = _go_string(value)
            elif value is not None:  # null leaves a Go string as it was
                raise MultusFails(f"{where}: {name} is not a string")
        elif name == "cni-args":
            if value is None:
                args = None
            elif isinstance(value, _Object):
                # Go decodes into the map the pointer already holds: a repeated object merges.
                args = {} if args is None else args
                for k, v in value:
                    args[_go_string(k)] = _go_value(v, f"{where} cni-args")
            else:
                raise MultusFails(f"{where}: cni-args is not an object")
        elif name in ("ips", "default-route"):
            _go_list(value, where, name, lambda v: _string_or_null(v, where))
            addresses.setdefault(name, []).append(value)
        elif name == "portMappings":
            _go_list(value, where, name, lambda v: _go_struct(v, _PORT_MAP, where, "portMappings"))
        else:
            _go_struct(value, _BANDWIDTH, where, name)
    for name, values in addresses.items():
        doubt = _addresses(values, name, where) or doubt
    for mac in ("mac", "infiniband-guid"):
        if strings[mac] and not _clearly_mac(strings[mac]):
            doubt = f"{where}: {mac} is not a plain colon or dash separated address"
    # Multus takes the pre-3.2 interfaceRequest when interface is empty.
    interface = strings["interface"] or strings["interfaceRequest"]
    return Selection(strings["namespace"], strings["name"], args, interface), doubt


def _go_list(value: Any, where: str, name: str, each: Callable[[Any], None]) -> None:
    """A Go slice: null or a list (any other JSON value is a type error), ``each`` run on its items."""
    if value is None:
        return
    if not isinstance(value, list) or isinstance(value, _Object):
        raise MultusFails(f"{where}: {name} is not a list")
    for item in value:
        each(item)


def _go_struct(value: Any, fields: dict[str, type], where: str, name: str) -> None:
    """Type errors of a pointer to a struct of int and string fields (null: a nil pointer)."""
    if value is None:
        return
    if not isinstance(value, _Object):
        raise MultusFails(f"{where}: {name} is not an object")
    folded = {_fold(k): t for k, t in fields.items()}
    for key, item in value:
        kind = folded.get(_fold(key))
        if kind is None or item is None:
            continue
        if kind is int and not (isinstance(item, _Num) and _go_int(item.text)):
            raise MultusFails(f"{where}: {name}.{key[:40]} is not an integer Go's int holds")
        if kind is str and not isinstance(item, str):
            raise MultusFails(f"{where}: {name}.{key[:40]} is not a string")


def _go_int(text: str) -> bool:
    return _INT64.fullmatch(text) is not None and -(2**63) <= int(text) < 2**63


def _string_or_null(item: Any, where: str) -> None:
    if item is not None and not isinstance(item, str):
        raise MultusFails(f"{where}: an address is not a string")


def _addresses(values: list[Any], name: str, where: str) -> str | None:
    """Multus' check of ``ips`` ([]string) or ``default-route`` (*[]net.IP), types checked; the doubt left."""
    if len(values) > 1:
        # A second list is decoded over the first one's elements (null keeps an old one): not modelled.
        return f"{where}: {name} is repeated"
    for item in values[0] or ():
        if name == "ips" and not item:
            raise MultusFails(f"{where}: ips holds an empty address")  # null decodes as ""
        if item and not _clearly_ip(item, prefix=name == "ips"):
            return f"{where}: {name} holds an address the extender does not check as Go does"
    return None


def _clearly_mac(text: str) -> bool:
    """Forms Go's net.ParseMAC accepts: 6, 8 or 20 octets, by twos with one separator, or by fours."""
    if _MAC.fullmatch(text) is not None:
        return (len(text) + 1) // 3 in (6, 8, 20)
    return _MAC_DOTS.fullmatch(text) is not None and (len(text) + 1) // 5 in (3, 4, 10)


def _clearly_ip(text: str, prefix: bool) -> bool:
    """Plain addresses (and prefixes, when allowed) that Go's net.ParseIP / ParseCIDR surely accept."""
    if _PLAIN_IP.fullmatch(text) is None or ("/" in text and not prefix):
        return False
    try:
        if "/" in text:
            ipaddress.ip_network(text, strict=False)
        else:
            ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _comma_item(item: str) -> Selection:
    """``[namespace/]name[@interface]`` as Multus' parsePodNetworkObjectName splits and checks it."""
    item = _go_trim(item)
    parts = item.split("/")
    if len(parts) > 2:
        raise MultusFails("a comma-form item has more than one '/'")
    namespace = _go_trim(parts[0]) if len(parts) == 2 else ""
    ats = parts[-1].split("@")
    if len(ats) > 2:
        raise MultusFails("a comma-form item has more than one '@'")
    name = _go_trim(ats[0])
    interface = _go_trim(ats[1]) if len(ats) == 2 else ""
    for part in (namespace, name):
        if part and _DNS_LABEL.fullmatch(part) is None:
            raise MultusFails("a comma-form namespace or name is not a DNS-1123 label")
    if interface and (len(interface.encode()) > _IFNAMSIZ or any(c in _IFNAME_BAD for c in interface)):
        raise MultusFails("a comma-form interface name is over 15 bytes or holds '/' or a space")
    return Selection(namespace, name, None, interface)


def read_networks(value: str | None, default_namespace: str) -> Reading:
    """The networks ``k8s.v1.cni.cncf.io/networks`` selects, as Multus' parsePodNetworkAnnotation does.

    An absent or empty annotation selects nothing. Raises :class:`MultusFails`
    when Multus fails the pod on it, :class:`UnreadableNetworks` when it cannot
    be read here as Multus reads it.
    """
    if not value:
        return Reading(())
    _check_size(value)
    if any(c in value for c in '[{"'):  # Multus' own test for the JSON form
        depth = depth_over(value)
        if depth is not None:
            raise UnreadableNetworks(f"is nested {depth} levels deep; the extender reads at most {MAX_DEPTH}")
        try:
            return _json_form(value, default_namespace)
        except RecursionError:
            raise UnreadableNetworks("is nested deeper than the parser goes on this call's stack") from None
    _check_count(value.count(",") + 1)
    selections = [_comma_item(item) for item in value.split(",")]
    return Reading(tuple(_in_namespace(s, default_namespace) for s in selections))


def _in_namespace(selection: Selection, default_namespace: str) -> Selection:
    if selection.namespace:
        return selection
    return Selection(default_namespace, selection.name, selection.cni_args, selection.interface)


def _json_form(value: str, default_namespace: str) -> Reading:
    """The JSON form, decoded as Go decodes it into []*NetworkSelectionElement."""
    items = _loads(value)
    if items is None:
        return Reading(())
    if not isinstance(items, list) or isinstance(items, _Object):
        raise MultusFails("the JSON form is not a list")
    _check_count(len(items))
    doubt = None
    selections = []
    for index, item in enumerate(items):
        selection, element_doubt = _element(item, index)
        doubt = doubt or element_doubt
        selections.append(_in_namespace(selection, default_namespace))
    return Reading(tuple(selections), doubt)


def read_default_network(value: str | None, multus_namespace: str) -> Reading | None:
    """The pod's default network (its eth0) from ``v1.multus-cni.io/default-network``; None when absent.

    As Multus' tryLoadK8sPodDefaultNetwork: the text is read as the networks
    annotation with Multus' namespace as the default; empty text, more than
    one network or none (Multus then indexes an empty list and panics) fail
    the pod.
    """
    if value is None:
        return None
    if value == "":
        raise MultusFails("the default-network annotation is empty")
    reading = read_networks(value, multus_namespace)
    if len(reading.selections) != 1:
        raise MultusFails(f"the default-network annotation names {len(reading.selections)} networks, not one")
    return reading


def _check_size(value: str) -> None:
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        raise UnreadableNetworks("holds a lone surrogate, which no API server sends") from None
    if size > MAX_ANNOTATIONS_BYTES:
        raise UnreadableNetworks(
            f"is {size} bytes, over the API server's {MAX_ANNOTATIONS_BYTES} for all of a pod's annotations"
        )


def _check_count(count: int) -> None:
    if count > MAX_ELEMENTS:
        raise UnreadableNetworks(f"selects {count} networks; the extender reads at most {MAX_ELEMENTS}")
