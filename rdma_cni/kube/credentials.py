"""Credentials for the Kubernetes API: a kubeconfig file or the in-cluster service account.

Both Kubernetes clients (the plugin's pod GET in :mod:`rdma_cni.kube.podget`
and the long-running components' :mod:`rdma_cni.kube.client`) start from the
:class:`ClusterCredentials` that :func:`load_credentials` returns, so they
accept the same kubeconfigs and refuse the same mistakes, naming the file and
field at fault.

PyYAML is optional and imported only for a kubeconfig that is not JSON.

Secrets (bearer tokens, client keys, a password in the server URL) never
appear in exception messages, log lines or ``repr`` output: :func:`redact`
hides them in any text derived from foreign input before it leaves the
clients.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from rdma_cni.cni.errors import InvalidConfig, KubernetesError

# The plugin's Kubernetes logger since before the split (log configurations name it).
log = logging.getLogger("rdma_cni.k8s")

SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SERVICEACCOUNT_DIR_ENV = "RDMA_CNI_SERVICEACCOUNT_DIR"

# RFC 6750 token68-ish: anything printable without whitespace. Anything else
# would be refused by the HTTP client with an error that quotes the header
# value, i.e. the token, so it is refused up front instead.
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True)
class ClusterCredentials:
    """Where the API server is and how to authenticate to it.

    ``source`` describes where the credentials came from, for error messages.
    File paths are absolute. Inline data (``*_data``) is PEM bytes that
    the clients write to private temporary files for the duration of a
    request. Secret fields are left out of ``repr``.
    """

    server: str  # never carries userinfo: safe to print
    source: str
    ca_file: str | None = None
    ca_data: bytes | None = None
    insecure_skip_tls_verify: bool = False
    token: str | None = field(default=None, repr=False)
    client_cert_file: str | None = None
    client_key_file: str | None = None
    client_cert_data: bytes | None = field(default=None, repr=False)
    client_key_data: bytes | None = field(default=None, repr=False)
    # ``user:password`` found in the kubeconfig's server URL: never sent (see
    # split_userinfo), kept only so that redaction also hides it.
    server_userinfo: str | None = field(default=None, repr=False)

    def secrets(self) -> list[str]:
        """The secret strings that must never be shown, for redaction."""
        found: list[str] = []
        if self.token:
            found.append(self.token)
        # load_credentials moves userinfo out of the server URL; credentials built
        # by hand may still carry it there.
        userinfo = self.server_userinfo or urllib.parse.urlsplit(self.server).netloc.rpartition("@")[0]
        if userinfo:
            # Longest first: the whole userinfo, then the password alone, raw and decoded.
            found.append(userinfo)
            password = userinfo.partition(":")[2]
            found.extend(p for p in (password, urllib.parse.unquote(password)) if p)
        if self.client_key_data:
            text = self.client_key_data.decode("ascii", "replace")
            found.append(text)
            # The base64 form is what sits in the kubeconfig; hide it too.
            found.append(base64.b64encode(self.client_key_data).decode("ascii"))
        return found


def load_credentials(kubeconfig: str | None) -> ClusterCredentials:
    """Load API server credentials from a kubeconfig file or the service account.

    With a path, the kubeconfig is read (JSON always; YAML only if PyYAML is
    installed) and its ``current-context`` selects the cluster and user.
    Relative file paths in it are resolved against the kubeconfig's directory.
    Supported user credentials: ``token``, ``tokenFile`` (which wins over
    ``token`` when readable), ``client-certificate``/``client-key`` files and
    their inline ``-data`` forms.

    With ``None`` or an empty string, the in-cluster service account is used:
    ``KUBERNETES_SERVICE_HOST`` and ``KUBERNETES_SERVICE_PORT`` locate the API
    server, and ``token`` and ``ca.crt`` are read from
    ``/var/run/secrets/kubernetes.io/serviceaccount``, or from the directory
    named by the ``RDMA_CNI_SERVICEACCOUNT_DIR`` environment variable (meant
    for tests).

    Raises :class:`InvalidConfig` naming the file and field that is missing or
    malformed.
    """
    if kubeconfig:
        return _from_kubeconfig(kubeconfig)
    return _from_service_account()


def _from_service_account() -> ClusterCredentials:
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "").strip()
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "").strip()
    for var, value in (("KUBERNETES_SERVICE_HOST", host), ("KUBERNETES_SERVICE_PORT", port)):
        if not value:
            raise InvalidConfig(
                f"no kubeconfig given and {var} is not set: cannot find the API server",
                "set 'kubeconfig' in the network configuration when not running in a pod",
            )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidConfig(f"KUBERNETES_SERVICE_PORT is not a port number: {port[:20]!r}")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # bare IPv6 address
    sa_dir = os.environ.get(SERVICEACCOUNT_DIR_ENV) or SERVICEACCOUNT_DIR
    token_path = os.path.join(sa_dir, "token")
    ca_path = os.path.join(sa_dir, "ca.crt")
    token = _read_token_file(token_path, f"service account token {token_path}")
    if not os.path.isfile(ca_path):
        raise InvalidConfig(f"service account CA certificate {ca_path} is missing")
    return ClusterCredentials(
        server=f"https://{host}:{port}",
        source=f"in-cluster service account ({sa_dir})",
        ca_file=os.path.abspath(ca_path),
        token=token,
    )


class _Kubeconfig:
    """One kubeconfig document, read field by field: every problem names the file and the field."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.doc = _parse_kubeconfig(path)
        self.base_dir = os.path.dirname(os.path.abspath(path))

    def bad(self, field_name: str, problem: str) -> InvalidConfig:
        """The error for ``field_name`` of this kubeconfig."""
        return InvalidConfig(f"kubeconfig {self.path}: {field_name} {problem}")

    def name(self, section: dict[str, Any], sec_field: str, key: str) -> str:
        """A required, non-empty string field."""
        value = section.get(key)
        if not isinstance(value, str) or not value:
            raise self.bad(f"{sec_field}.{key}" if sec_field else key, "is missing")
        return value

    def entry(self, list_key: str, item_key: str, name: str) -> dict[str, Any]:
        """Find ``doc[list_key][i][item_key]`` for the entry whose name is ``name``."""
        entries = self.doc.get(list_key)
        if not isinstance(entries, list):
            raise self.bad(list_key, "is missing or not a list")
        for entry in entries:
            if isinstance(entry, dict) and entry.get("name") == name:
                body = entry.get(item_key)
                if not isinstance(body, dict):
                    raise self.bad(f'{list_key}[name="{name}"].{item_key}', "is missing or not a mapping")
                return body
        raise self.bad(f'{list_key}[name="{name}"]', "is missing")

    def opt_str(self, section: dict[str, Any], sec_field: str, key: str) -> str | None:
        """An optional string field (None when absent or empty)."""
        value = section.get(key)
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise self.bad(f"{sec_field}.{key}", "must be a string")
        return value

    def resolve(self, value: str) -> str:
        """A path from the kubeconfig, relative to the kubeconfig's directory."""
        return os.path.normpath(os.path.join(self.base_dir, os.path.expanduser(value)))

    def opt_file(self, section: dict[str, Any], sec_field: str, key: str) -> str | None:
        """An optional path field naming a file that exists, made absolute."""
        value = self.opt_str(section, sec_field, key)
        if value is None:
            return None
        resolved = self.resolve(value)
        if not os.path.isfile(resolved):
            raise self.bad(f"{sec_field}.{key}", f"names a file that does not exist: {resolved}")
        return resolved

    def opt_pem(self, section: dict[str, Any], sec_field: str, key: str, marker: bytes) -> bytes | None:
        """An optional base64 field that must decode to a PEM block holding ``marker``."""
        value = self.opt_str(section, sec_field, key)
        if value is None:
            return None
        try:
            data = base64.b64decode("".join(value.split()), validate=True)
        except (binascii.Error, ValueError):
            raise self.bad(f"{sec_field}.{key}", "is not valid base64") from None
        if b"-----BEGIN" not in data or marker not in data:
            raise self.bad(f"{sec_field}.{key}", "does not decode to a PEM block")
        return data


def _from_kubeconfig(path: str) -> ClusterCredentials:
    kc = _Kubeconfig(path)
    context_name = kc.name(kc.doc, "", "current-context")
    context = kc.entry("contexts", "context", context_name)
    ctx_field = f'contexts[name="{context_name}"].context'
    cluster_name = kc.name(context, ctx_field, "cluster")
    user_name = kc.name(context, ctx_field, "user")
    cluster = kc.entry("clusters", "cluster", cluster_name)
    user = kc.entry("users", "user", user_name)
    server, userinfo, ca_file, ca_data, insecure = _cluster(
        kc, cluster, f'clusters[name="{cluster_name}"].cluster'
    )
    us_field = f'users[name="{user_name}"].user'
    token = _user_token(kc, user, us_field)
    cert_file, key_file, cert_data, key_data = _client_certificate(kc, user, us_field)
    if token is None and cert_file is None and cert_data is None:
        unsupported = [k for k in ("exec", "auth-provider", "username", "password") if k in user]
        hint = f" ({', '.join(unsupported)} is not supported)" if unsupported else ""
        raise kc.bad(us_field, f"has no token, tokenFile or client certificate{hint}")
    return ClusterCredentials(
        server=server.rstrip("/"),
        source=f"kubeconfig {path} (context {context_name})",
        ca_file=ca_file,
        ca_data=ca_data,
        insecure_skip_tls_verify=insecure,
        token=token,
        client_cert_file=cert_file,
        client_key_file=key_file,
        client_cert_data=cert_data,
        client_key_data=key_data,
        server_userinfo=userinfo,
    )


def _cluster(
    kc: _Kubeconfig, cluster: dict[str, Any], cl_field: str
) -> tuple[str, str | None, str | None, bytes | None, bool]:
    """The cluster's server URL (without userinfo), that userinfo, the CA file or data, and insecure."""
    server, userinfo = split_userinfo(kc.name(cluster, cl_field, "server"))
    if userinfo is not None:
        log.warning(
            "kubeconfig %s: %s.server carries user information; ignored (the API server takes the "
            "token or client certificate)",
            kc.path,
            cl_field,
        )
    parsed = urllib.parse.urlsplit(server)
    if parsed.scheme not in ("https", "http") or not parsed.hostname:
        raise kc.bad(f"{cl_field}.server", f"is not an http(s) URL: {server[:100]!r}")
    insecure = cluster.get("insecure-skip-tls-verify", False)
    if not isinstance(insecure, bool):
        raise kc.bad(f"{cl_field}.insecure-skip-tls-verify", "must be true or false")
    ca_file = kc.opt_file(cluster, cl_field, "certificate-authority")
    ca_data = kc.opt_pem(cluster, cl_field, "certificate-authority-data", b"CERTIFICATE")
    if insecure and (ca_file or ca_data):
        # kubectl refuses this combination too: it is almost certainly a mistake.
        raise kc.bad(cl_field, "sets both insecure-skip-tls-verify and a certificate authority")
    return server, userinfo, ca_file, ca_data, insecure


def _user_token(kc: _Kubeconfig, user: dict[str, Any], us_field: str) -> str | None:
    """The user's bearer token: ``tokenFile`` when readable, else ``token``."""
    token = kc.opt_str(user, us_field, "token")
    token_file = kc.opt_str(user, us_field, "tokenFile")
    if token_file is not None:
        resolved = kc.resolve(token_file)
        try:
            token = _read_token_file(resolved, f"kubeconfig {kc.path}: {us_field}.tokenFile {resolved}")
        except InvalidConfig:
            # As in client-go, a readable tokenFile wins over token; only
            # without a fallback is an unreadable one fatal.
            if token is None:
                raise
    if token is not None:
        _check_token(token, f"kubeconfig {kc.path}: {us_field}.token")
    return token


def _client_certificate(
    kc: _Kubeconfig, user: dict[str, Any], us_field: str
) -> tuple[str | None, str | None, bytes | None, bytes | None]:
    """The user's client certificate and key: (cert file, key file, cert data, key data), each pair whole."""
    cert_file = kc.opt_file(user, us_field, "client-certificate")
    key_file = kc.opt_file(user, us_field, "client-key")
    cert_data = kc.opt_pem(user, us_field, "client-certificate-data", b"CERTIFICATE")
    key_data = kc.opt_pem(user, us_field, "client-key-data", b"PRIVATE KEY")
    has_cert = cert_file is not None or cert_data is not None
    has_key = key_file is not None or key_data is not None
    if has_cert and not has_key:
        raise kc.bad(us_field, "has a client certificate but no client-key or client-key-data")
    if has_key and not has_cert:
        raise kc.bad(us_field, "has a client key but no client-certificate or client-certificate-data")
    if cert_file and cert_data:
        raise kc.bad(us_field, "sets both client-certificate and client-certificate-data")
    if key_file and key_data:
        raise kc.bad(us_field, "sets both client-key and client-key-data")
    return cert_file, key_file, cert_data, key_data


def split_userinfo(url: str) -> tuple[str, str | None]:
    """``url`` without its ``user:password@`` part, and that part (None if absent).

    A password in a URL must never reach an error document or a log, so the
    credentials keep the URL without it and every message prints that one. It
    is not sent either: Kubernetes has no basic authentication since 1.19, and
    requests would let it replace the bearer token.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url, None
    # The authority ends at the first '/', '?' or '#'; userinfo ends at its last '@'.
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority = rest[:end]
    if "@" not in authority:
        return url, None
    userinfo, _, host = authority.rpartition("@")
    return f"{scheme}://{host}{rest[end:]}", userinfo


def _parse_kubeconfig(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfig(f"kubeconfig {path} cannot be read: {exc.__class__.__name__}: {exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = _parse_yaml(path, text)
    if not isinstance(doc, dict):
        raise InvalidConfig(f"kubeconfig {path}: the document is not a mapping")
    return doc


def _parse_yaml(path: str, text: str) -> Any:
    try:
        import yaml  # optional dependency: JSON kubeconfigs need nothing extra
    except ImportError:
        raise InvalidConfig(
            f"kubeconfig {path} is not JSON, and PyYAML is not installed to read it as YAML",
            "write the kubeconfig as JSON or install PyYAML",
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # Problem marks carry a line/column but never quote a whole value.
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        raise InvalidConfig(f"kubeconfig {path} is neither valid JSON nor valid YAML{at}") from None


def _read_token_file(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfig(f"{what} cannot be read: {exc.__class__.__name__}") from None
    if not token:
        raise InvalidConfig(f"{what} is empty")
    _check_token(token, what)
    return token


def token_is_valid(token: str) -> bool:
    """Whether ``token`` can be sent as a bearer token: printable ASCII, no whitespace."""
    return _TOKEN_CHARS.fullmatch(token) is not None


def _check_token(token: str, what: str) -> None:
    if not token_is_valid(token):
        # Deliberately not quoting the value: it is a secret.
        raise InvalidConfig(f"{what} contains whitespace or non-printable characters")


@dataclass(frozen=True)
class ApiTarget:
    """Where requests go: TLS or not, host, port and the path prefix of the server URL."""

    tls: bool
    host: str
    port: int
    prefix: str


def api_target(creds: ClusterCredentials) -> ApiTarget:
    """Scheme, host, port and path prefix of the API server URL."""
    parts = urllib.parse.urlsplit(creds.server)
    tls = parts.scheme == "https"
    try:
        port = parts.port or (443 if tls else 80)
    except ValueError:
        port = -1
    if parts.scheme not in ("https", "http") or not parts.hostname or port < 1:
        raise KubernetesError(
            f"API server address {creds.server!r} from {creds.source} is not an http(s)://host[:port] URL"
        )
    return ApiTarget(tls, parts.hostname, port, parts.path.rstrip("/"))


def redact(text: str, creds: ClusterCredentials) -> str:
    """``text`` with every secret of ``creds`` replaced by ``<redacted>``."""
    for secret in creds.secrets():
        if secret:
            text = text.replace(secret, "<redacted>")
    return text
