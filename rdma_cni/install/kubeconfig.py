"""The plugin's kubeconfig, rendered from this pod's service account (token and CA inline).

The secret's mount path exists only inside the installer's container, not on
the host where the plugin runs, so the token and CA are embedded; ``--watch``
rewrites the file when kubelet rotates the token.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Mapping

from rdma_cni.install.common import InstallError, write_bytes_atomic
from rdma_cni.kube.credentials import token_is_valid


def api_server_url(environ: Mapping[str, str]) -> str:
    """The API server URL from KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT."""
    host = environ.get("KUBERNETES_SERVICE_HOST", "").strip()
    port = environ.get("KUBERNETES_SERVICE_PORT", "").strip()
    for var, value in (("KUBERNETES_SERVICE_HOST", host), ("KUBERNETES_SERVICE_PORT", port)):
        if not value:
            raise InstallError(
                f"{var} is not set: cannot tell the plugin where the API server is "
                "(kubelet sets it in every pod; set it in the DaemonSet's env to override)"
            )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InstallError(f"KUBERNETES_SERVICE_PORT is not a port number: {port[:20]!r}")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal needs brackets in a URL
    return f"https://{host}:{int(port)}"


def render_kubeconfig(serviceaccount_dir: str, environ: Mapping[str, str]) -> bytes:
    """The plugin's kubeconfig (JSON) built from a service-account directory and the environment."""
    token_path = os.path.join(serviceaccount_dir, "token")
    ca_path = os.path.join(serviceaccount_dir, "ca.crt")
    token = _read_piece(token_path, "token").decode("utf-8", "replace").strip()
    if not token:
        raise InstallError(f"service account token {token_path} is empty")
    if not token_is_valid(token):  # the grammar the plugin's kubeconfig reader enforces
        # The value is a secret: say what is wrong with it, never what it is.
        raise InstallError(f"service account token {token_path} contains whitespace or non-printable bytes")
    ca = _read_piece(ca_path, "CA certificate")
    if b"-----BEGIN CERTIFICATE-----" not in ca:
        raise InstallError(f"service account CA certificate {ca_path} is not a PEM certificate")
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "kubernetes",
                "cluster": {
                    "server": api_server_url(environ),
                    "certificate-authority-data": base64.b64encode(ca).decode("ascii"),
                },
            }
        ],
        "users": [{"name": "rdma-cni", "user": {"token": token}}],
        "contexts": [{"name": "rdma-cni", "context": {"cluster": "kubernetes", "user": "rdma-cni"}}],
        "current-context": "rdma-cni",
        "preferences": {},
    }
    return (json.dumps(doc, indent=2) + "\n").encode("utf-8")


def _read_piece(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise InstallError(
            f"service account {what} {path} is missing: is a service account token mounted "
            "(automountServiceAccountToken) and is --serviceaccount-dir right?"
        ) from None
    except OSError as exc:
        raise InstallError(f"cannot read service account {what} {path}: {exc.strerror or exc}") from None


def write_kubeconfig(
    path: str,
    serviceaccount_dir: str,
    environ: Mapping[str, str],
    *,
    keep: Callable[[bytes, bytes], str | None] | None = None,
) -> bool:
    """Write the kubeconfig (mode 0600) if its content would change; return True when it was written.

    Comparing content, not timestamps, is what detects a rotated token, and
    it also restores a kubeconfig someone deleted or edited on the host.
    ``keep(current, new)``, given, may name a reason to leave a differing
    file as it is (another live agent pod's, :mod:`.handover`).
    """
    data = render_kubeconfig(serviceaccount_dir, environ)
    try:
        with open(path, "rb") as f:
            current = f.read()
        mode = os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        current, mode = None, None
    if current == data and mode == 0o600:
        return False
    if current is not None and keep is not None and keep(current, data):
        return False
    write_bytes_atomic(path, data, 0o600)
    return True
