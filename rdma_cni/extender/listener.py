"""Who may call the extender: loopback, or a client certificate (with an accepted name).

The extender holds cluster-wide ``pods/binding``: whoever can call it can bind
any pod to any node. :func:`check_listener` refuses, before anything is bound,
a listener that anyone on the network could reach; the HTTP server
(:mod:`rdma_cni.extender.server`) checks the address it actually bound too,
and each connection's certificate names against ``--client-name``
(:func:`peer_names`).
"""

from __future__ import annotations

import ipaddress
import ssl
from typing import Any


class UnauthenticatedListener(ValueError):
    """A listener that anyone on the network could call: refused, not warned about."""


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback; False for 0.0.0.0, ::, names and the rest."""
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    return True


def authenticates_clients(tls: ssl.SSLContext | None) -> bool:
    """True when every connection must present a certificate the context verifies."""
    return tls is not None and tls.verify_mode == ssl.CERT_REQUIRED


def check_listener(host: str, tls: ssl.SSLContext | None) -> None:
    """Refuse a listener that is not on loopback and does not require a client certificate.

    The extender holds cluster-wide ``pods/binding``: whoever can call it can
    bind any pod to any node. Only kube-scheduler may: either as its sidecar on
    loopback (127.0.0.0/8, ::1), or with a client certificate signed by the CA
    given with ``--client-ca``.
    """
    if is_loopback(host) or authenticates_clients(tls):
        return
    raise UnauthenticatedListener(
        f"refusing to listen on {host or '0.0.0.0'} without client authentication: the extender binds "
        "pods cluster-wide, so only kube-scheduler may call it; listen on loopback (127.0.0.1, as "
        "kube-scheduler's sidecar) or require client certificates (--tls-cert, --tls-key and --client-ca)"
    )


def peer_names(cert: dict[str, Any]) -> set[str]:
    """The subject common names and DNS/URI subject alternative names of a verified peer certificate."""
    names = {value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"}
    names.update(value for kind, value in cert.get("subjectAltName", ()) if kind in ("DNS", "URI"))
    return names
