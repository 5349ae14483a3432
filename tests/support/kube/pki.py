"""Certificates and keys for one run of the real control plane, made with openssl.

One CA signs the API server's serving certificate and every client
certificate (the admin, kube-controller-manager, kube-scheduler); the
service-account signing key pair is separate. All of it is made anew for each
run in the run's own folder and never leaves it.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from tests.support.apiserver import make_ca, make_cert


@dataclass(frozen=True)
class ClientCert:
    """A client certificate and its key."""

    cert: str
    key: str


@dataclass(frozen=True)
class Pki:
    """Paths of everything one control plane needs."""

    directory: str
    ca: str
    ca_key: str
    server_cert: str
    server_key: str
    sa_key: str
    sa_pub: str
    admin: ClientCert
    controller_manager: ClientCert
    scheduler: ClientCert

    def client(self, stem: str, subject: str) -> ClientCert:
        """Another client certificate from the same CA (``subject`` as ``/CN=user/O=group``)."""
        return ClientCert(*make_cert(self.directory, (self.ca, self.ca_key), stem, subject, client=True))


def make_pki(directory: str, address: str = "127.0.0.1") -> Pki:
    """Generate the CA, the serving and client certificates and the service-account keys.

    The serving certificate names 127.0.0.1 and ``address``, where kube-apiserver listens.
    """
    os.makedirs(directory, mode=0o700, exist_ok=True)
    ca = make_ca(directory, common_name="rdma-cni cluster tier CA")
    server = make_cert(
        directory,
        ca,
        "apiserver",
        "/CN=kube-apiserver",
        client=False,
        sans=",".join(
            dict.fromkeys(
                [
                    "IP:127.0.0.1",
                    f"IP:{address}",
                    "DNS:localhost",
                    "DNS:kubernetes",
                    "DNS:kubernetes.default.svc",
                ]
            )
        ),
    )

    def client(stem: str, subject: str) -> ClientCert:
        return ClientCert(*make_cert(directory, ca, stem, subject, client=True))

    sa_key = os.path.join(directory, "sa.key")
    sa_pub = os.path.join(directory, "sa.pub")
    # RSA: kube-apiserver signs service-account tokens with RS256 for RSA keys.
    subprocess.run(
        ["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", sa_key],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        ["openssl", "pkey", "-in", sa_key, "-pubout", "-out", sa_pub], check=True, capture_output=True
    )
    return Pki(
        directory=directory,
        ca=ca[0],
        ca_key=ca[1],
        server_cert=server[0],
        server_key=server[1],
        sa_key=sa_key,
        sa_pub=sa_pub,
        admin=client("admin", "/CN=rdma-cni-admin/O=system:masters"),
        controller_manager=client("controller-manager", "/CN=system:kube-controller-manager"),
        scheduler=client("scheduler", "/CN=system:kube-scheduler"),
    )
