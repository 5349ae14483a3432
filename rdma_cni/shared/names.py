"""The rules for names: interfaces, rail labels, Kubernetes object names. Standard library only.

One home for each rule, so the CNI edge, the pod request, the network
configuration and the node state cannot drift apart:

- an interface name rdma-cni accepts from a pod, a runtime or a config
  (:func:`valid_ifname`): printable ASCII, stricter than the kernel;
- an interface name the kernel may report (:func:`kernel_ifname`): the
  kernel's own ``dev_valid_name``, for PF names read back from a node state
  (a PF is whatever the host calls it);
- a rail label (:func:`valid_rail`): a Kubernetes label value;
- a network's name (:func:`valid_network_name`): the CNI specification's;
- a Kubernetes object name (:func:`dns_subdomain`, :func:`dns_label`);
- a Kubernetes annotation key (:func:`annotation_key`): the pod annotation the
  plugin's ``annotation`` and the extender's ``--annotation`` name.
"""

from __future__ import annotations

import re

__all__ = [
    "ANNOTATION_KEY_RULE",
    "IFNAME_RULE",
    "IFNAMSIZ",
    "KERNEL_IFNAME_RULE",
    "LABEL_RULE",
    "NETWORK_NAME_PATTERN",
    "NETWORK_RULE",
    "RAIL_RULE",
    "SUBDOMAIN_RULE",
    "annotation_key",
    "dns_label",
    "dns_subdomain",
    "kernel_ifname",
    "valid_ifname",
    "valid_network_name",
    "valid_rail",
]

# The kernel's IFNAMSIZ is 16 bytes with the terminating NUL.
IFNAMSIZ = 15

# What rdma-cni itself accepts: printable ASCII, none of '/', ':' (the kernel's rule) nor '%'
# (the kernel would take it as a template for a numbered name).
_IFNAME_FORBIDDEN = re.compile(r"[^\x21-\x7e]|[/:%]")
IFNAME_RULE = f"1-{IFNAMSIZ} printable ASCII characters; no '/', ':', '%', whitespace, '.' or '..'"

# net/core/dev.c dev_valid_name(): not empty, shorter than IFNAMSIZ bytes, not "." or "..", and
# no byte that is '/', ':' or isspace() in the kernel's ctype (lib/ctype.c), which counts the
# Latin-1 no-break space 0xa0 besides \t \n \v \f \r and ' '.
_KERNEL_FORBIDDEN = frozenset(b"/: \t\n\v\f\r\xa0")
KERNEL_IFNAME_RULE = (
    f"1-{IFNAMSIZ} bytes of UTF-8, not '.' or '..', no NUL, '/', ':' or whitespace "
    "(the kernel's dev_valid_name)"
)

# A rail label: what a Kubernetes label value allows (1-63 characters), so that operators can
# reuse their node or NIC labels.
_RAIL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")
RAIL_RULE = "1-63 characters: letters, digits, '-', '_' or '.', beginning and ending with a letter or digit"

# A network's name, as the CNI specification has it: the configuration's `name` (cni/config) and the
# node state's network names (shared/nodestate) keep to this one pattern, so an agent can never
# publish a network name that readers refuse.
NETWORK_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"
_NETWORK = re.compile(NETWORK_NAME_PATTERN)
MAX_NETWORK_NAME = 253
NETWORK_RULE = (
    f"1-{MAX_NETWORK_NAME} letters, digits, '_', '.' or '-', beginning with a letter or digit "
    "(a CNI network name)"
)

# Kubernetes' DNS-1123 names (apimachinery's IsDNS1123Subdomain and IsDNS1123Label).
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_RULE = "1-63 characters: lower-case letters, digits or '-', beginning and ending with a letter or digit"
SUBDOMAIN_RULE = (
    "1-253 characters: lower-case letters, digits, '-' or '.', each dot-separated part beginning "
    "and ending with a letter or digit"
)
# An annotation key: an optional prefix (a DNS subdomain, at most 253 characters) and '/', then a name
# of at most 63 characters (apimachinery's ValidateAnnotations).
_ANNOTATION_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
ANNOTATION_KEY_RULE = (
    "an optional prefix (1-253 lower-case letters, digits, '-' or '.') and '/', then 1-63 letters, digits, "
    "'-', '_' or '.' beginning and ending with a letter or digit"
)


def valid_ifname(name: object) -> bool:
    """Whether ``name`` is an interface name rdma-cni accepts (:data:`IFNAME_RULE`)."""
    if not isinstance(name, str) or not 0 < len(name) <= IFNAMSIZ or name in (".", ".."):
        return False
    # Past this check the name is ASCII, so len() counted bytes.
    return _IFNAME_FORBIDDEN.search(name) is None


def kernel_ifname(name: object) -> bool:
    """Whether the kernel would accept ``name`` for an interface (:data:`KERNEL_IFNAME_RULE`)."""
    if not isinstance(name, str) or len(name) > IFNAMSIZ:
        return False
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no bytes the kernel could have reported
        return False
    if not raw or len(raw) > IFNAMSIZ or raw in (b".", b"..") or 0 in raw:
        return False
    return not _KERNEL_FORBIDDEN.intersection(raw)


def valid_rail(value: object) -> bool:
    """Whether ``value`` is a rail label (:data:`RAIL_RULE`)."""
    return isinstance(value, str) and _RAIL.fullmatch(value) is not None


def valid_network_name(value: object) -> bool:
    """Whether ``value`` is a network's name (:data:`NETWORK_RULE`)."""
    return isinstance(value, str) and len(value) <= MAX_NETWORK_NAME and _NETWORK.fullmatch(value) is not None


def dns_label(value: object) -> bool:
    """Whether ``value`` is a Kubernetes DNS-1123 label (a namespace's name): :data:`LABEL_RULE`."""
    return isinstance(value, str) and _LABEL.fullmatch(value) is not None


def dns_subdomain(value: object) -> bool:
    """Whether ``value`` is a DNS-1123 subdomain (a Pod's or NAD's name): :data:`SUBDOMAIN_RULE`."""
    return isinstance(value, str) and len(value) <= 253 and _SUBDOMAIN.fullmatch(value) is not None


def annotation_key(value: object) -> bool:
    """Whether ``value`` is a Kubernetes annotation key (:data:`ANNOTATION_KEY_RULE`)."""
    return isinstance(value, str) and _ANNOTATION_KEY.fullmatch(value) is not None
