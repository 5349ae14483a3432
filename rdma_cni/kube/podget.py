"""Read a pod from the Kubernetes API server.

The plugin needs exactly one thing from Kubernetes: the pod being attached, to
read its annotations. This module finds credentials (a kubeconfig file or the
in-cluster service account) and fetches the pod over HTTPS.

Only the standard library is used for the one GET (http.client and ssl):
``requests`` and urllib3 cost ~60 ms of imports on every cold start for a
request that needs none of their sessions, redirects, proxies or cookies.
PyYAML is optional and imported only for a kubeconfig that is not JSON.

Secrets (bearer tokens, client keys) never appear in exception messages, log
lines or ``repr`` output: anything derived from foreign text passes through a
redaction step before it leaves this module.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import http.client
import json
import logging
import os
import re
import ssl
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rdma_cni import __version__
from rdma_cni.cni.errors import InvalidConfig, KubernetesError, TryAgainLater

log = logging.getLogger("rdma_cni.k8s")

SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SERVICEACCOUNT_DIR_ENV = "RDMA_CNI_SERVICEACCOUNT_DIR"

# Kubernetes object-name grammars (k8s.io/apimachinery validation). A namespace
# is a DNS-1123 label; a pod name is a DNS-1123 subdomain.
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

# RFC 6750 token68-ish: anything printable without whitespace. Anything else
# would be refused by the HTTP client with an error that quotes the header
# value, i.e. the token, so it is refused up front instead.
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")

# Longest piece of server-supplied text copied into an error message.
_MAX_FOREIGN_TEXT = 300
# Largest answer read from the API server: a Pod is a few KiB, at most ~1.5 MiB (etcd's limit).
_MAX_BODY = 8 << 20


@dataclass(frozen=True)
class ClusterCredentials:
    """Where the API server is and how to authenticate to it.

    ``source`` describes where the credentials came from, for error messages.
    File paths are absolute. Inline data (``*_data``) is PEM bytes that
    :func:`get_pod` writes to private temporary files for the duration of a
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


# --------------------------------------------------------------------------
# Credentials


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


def _from_kubeconfig(path: str) -> ClusterCredentials:
    doc = _parse_kubeconfig(path)
    base_dir = os.path.dirname(os.path.abspath(path))

    def bad(field_name: str, problem: str) -> InvalidConfig:
        return InvalidConfig(f"kubeconfig {path}: {field_name} {problem}")

    context_name = doc.get("current-context")
    if not isinstance(context_name, str) or not context_name:
        raise bad("current-context", "is missing")
    context = _named_entry(doc, "contexts", "context", context_name, bad)
    ctx_field = f'contexts[name="{context_name}"].context'
    cluster_name = context.get("cluster")
    user_name = context.get("user")
    if not isinstance(cluster_name, str) or not cluster_name:
        raise bad(f"{ctx_field}.cluster", "is missing")
    if not isinstance(user_name, str) or not user_name:
        raise bad(f"{ctx_field}.user", "is missing")
    cluster = _named_entry(doc, "clusters", "cluster", cluster_name, bad)
    user = _named_entry(doc, "users", "user", user_name, bad)
    cl_field = f'clusters[name="{cluster_name}"].cluster'
    us_field = f'users[name="{user_name}"].user'

    server = cluster.get("server")
    if not isinstance(server, str) or not server:
        raise bad(f"{cl_field}.server", "is missing")
    server, userinfo = split_userinfo(server)
    if userinfo is not None:
        log.warning(
            "kubeconfig %s: %s.server carries user information; ignored (the API server takes the "
            "token or client certificate)",
            path,
            cl_field,
        )
    parsed = urllib.parse.urlsplit(server)
    if parsed.scheme not in ("https", "http") or not parsed.hostname:
        raise bad(f"{cl_field}.server", f"is not an http(s) URL: {server[:100]!r}")

    def opt_str(section: dict[str, Any], sec_field: str, key: str) -> str | None:
        value = section.get(key)
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise bad(f"{sec_field}.{key}", "must be a string")
        return value

    def opt_file(section: dict[str, Any], sec_field: str, key: str) -> str | None:
        value = opt_str(section, sec_field, key)
        if value is None:
            return None
        resolved = os.path.normpath(os.path.join(base_dir, os.path.expanduser(value)))
        if not os.path.isfile(resolved):
            raise bad(f"{sec_field}.{key}", f"names a file that does not exist: {resolved}")
        return resolved

    def opt_pem(section: dict[str, Any], sec_field: str, key: str, marker: bytes) -> bytes | None:
        value = opt_str(section, sec_field, key)
        if value is None:
            return None
        try:
            data = base64.b64decode("".join(value.split()), validate=True)
        except (binascii.Error, ValueError):
            raise bad(f"{sec_field}.{key}", "is not valid base64") from None
        if b"-----BEGIN" not in data or marker not in data:
            raise bad(f"{sec_field}.{key}", "does not decode to a PEM block")
        return data

    insecure = cluster.get("insecure-skip-tls-verify", False)
    if not isinstance(insecure, bool):
        raise bad(f"{cl_field}.insecure-skip-tls-verify", "must be true or false")
    ca_file = opt_file(cluster, cl_field, "certificate-authority")
    ca_data = opt_pem(cluster, cl_field, "certificate-authority-data", b"CERTIFICATE")
    if insecure and (ca_file or ca_data):
        # kubectl refuses this combination too: it is almost certainly a mistake.
        raise bad(cl_field, "sets both insecure-skip-tls-verify and a certificate authority")

    token = opt_str(user, us_field, "token")
    token_file = opt_str(user, us_field, "tokenFile")
    if token_file is not None:
        resolved = os.path.normpath(os.path.join(base_dir, os.path.expanduser(token_file)))
        try:
            token = _read_token_file(resolved, f"kubeconfig {path}: {us_field}.tokenFile {resolved}")
        except InvalidConfig:
            # As in client-go, a readable tokenFile wins over token; only
            # without a fallback is an unreadable one fatal.
            if token is None:
                raise
    if token is not None:
        _check_token(token, f"kubeconfig {path}: {us_field}.token")

    cert_file = opt_file(user, us_field, "client-certificate")
    key_file = opt_file(user, us_field, "client-key")
    cert_data = opt_pem(user, us_field, "client-certificate-data", b"CERTIFICATE")
    key_data = opt_pem(user, us_field, "client-key-data", b"PRIVATE KEY")
    has_cert = cert_file is not None or cert_data is not None
    has_key = key_file is not None or key_data is not None
    if has_cert and not has_key:
        raise bad(us_field, "has a client certificate but no client-key or client-key-data")
    if has_key and not has_cert:
        raise bad(us_field, "has a client key but no client-certificate or client-certificate-data")
    if cert_file and cert_data:
        raise bad(us_field, "sets both client-certificate and client-certificate-data")
    if key_file and key_data:
        raise bad(us_field, "sets both client-key and client-key-data")

    if token is None and not has_cert:
        unsupported = [k for k in ("exec", "auth-provider", "username", "password") if k in user]
        hint = f" ({', '.join(unsupported)} is not supported)" if unsupported else ""
        raise bad(us_field, f"has no token, tokenFile or client certificate{hint}")

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


def _named_entry(
    doc: dict[str, Any],
    list_key: str,
    item_key: str,
    name: str,
    bad: Callable[[str, str], InvalidConfig],
) -> dict[str, Any]:
    """Find ``doc[list_key][i][item_key]`` for the entry whose name is ``name``."""
    entries = doc.get(list_key)
    if not isinstance(entries, list):
        raise bad(list_key, "is missing or not a list")
    for entry in entries:
        if isinstance(entry, dict) and entry.get("name") == name:
            body = entry.get(item_key)
            if not isinstance(body, dict):
                raise bad(f'{list_key}[name="{name}"].{item_key}', "is missing or not a mapping")
            return body
    raise bad(f'{list_key}[name="{name}"]', "is missing")


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


def _check_token(token: str, what: str) -> None:
    if not _TOKEN_CHARS.fullmatch(token):
        # Deliberately not quoting the value: it is a secret.
        raise InvalidConfig(f"{what} contains whitespace or non-printable characters")


# --------------------------------------------------------------------------
# Fetching a pod


def get_pod(
    creds: ClusterCredentials,
    namespace: str,
    name: str,
    *,
    timeout: float | tuple[float, float] = (3.05, 10),
    retries: int = 3,
    backoff: float = 0.2,
) -> dict[str, Any]:
    """Fetch ``/api/v1/namespaces/{namespace}/pods/{name}`` and return the Pod.

    ``timeout`` is (connect, read) in seconds, or one value for both; the TLS
    handshake counts as connecting. Connection failures, timeouts, HTTP 429
    and 5xx answers are retried up to ``retries`` more times after the first
    attempt, sleeping ``backoff * 2**n`` seconds in between. Redirects are not
    followed and proxy variables are ignored (a runtime's proxy settings are
    meant for image pulls).

    Raises:
        TryAgainLater: the API server stayed unreachable, slow or failing.
        KubernetesError: the names are not valid Kubernetes names, the pod does
            not exist, the credentials were refused, TLS verification failed,
            or the answer was not a Pod object.
    """
    _check_name("namespace", namespace, _DNS1123_LABEL, 63)
    _check_name("pod name", name, _DNS1123_SUBDOMAIN, 253)

    # Names are validated above, so quoting changes nothing; it is a second
    # line of defence should the grammar ever be loosened.
    path = "/api/v1/namespaces/{}/pods/{}".format(
        urllib.parse.quote(namespace, safe=""), urllib.parse.quote(name, safe="")
    )
    url = creds.server + path
    target = _target(creds)
    pod_ref = f"{namespace}/{name}"
    headers = {"Accept": "application/json", "User-Agent": f"rdma-cni/{__version__}"}
    if creds.token:
        headers["Authorization"] = f"Bearer {creds.token}"
    connect_timeout, read_timeout = timeout if isinstance(timeout, tuple) else (timeout, timeout)

    attempts = max(1, retries + 1)
    last_error = "no attempt made"
    context = client_context(creds)
    for attempt in range(attempts):
        if attempt:
            delay = backoff * (2 ** (attempt - 1))
            log.info("retrying GET pod %s in %.2fs after: %s", pod_ref, delay, last_error)
            time.sleep(delay)
        log.debug("GET %s (attempt %d of %d)", url, attempt + 1, attempts)
        try:
            status, body = _get(target, path, headers, context, connect_timeout, read_timeout)
        except ssl.SSLError as exc:
            # A bad certificate does not heal by retrying.
            raise KubernetesError(
                f"TLS connection to API server {creds.server} failed",
                _redact(f"{_describe(exc)}; check the certificate authority in {creds.source}", creds),
            ) from exc
        except TimeoutError as exc:
            last_error = _redact(f"Timeout: {exc or 'timed out'}", creds)
            continue
        except (OSError, http.client.HTTPException) as exc:
            last_error = _redact(f"ConnectionError: {_describe(exc)}", creds)
            continue

        if status == 200:
            return _decode_pod(body, creds, pod_ref)
        server_says = _status_message(body, creds)
        if status >= 500 or status == 429:
            last_error = f"HTTP {status}" + (f": {server_says}" if server_says else "")
            continue
        if status == 404:
            raise KubernetesError(f"pod {pod_ref} not found", server_says)
        if status in (401, 403):
            raise KubernetesError(
                f"API server {creds.server} refused the credentials from {creds.source} "
                f"(HTTP {status}) reading pod {pod_ref}",
                server_says,
            )
        raise KubernetesError(
            f"API server {creds.server} answered HTTP {status} reading pod {pod_ref}", server_says
        )

    log.warning("giving up on API server %s after %d attempts: %s", creds.server, attempts, last_error)
    raise TryAgainLater(
        f"API server {creds.server} unavailable reading pod {pod_ref} after {attempts} attempts",
        f"last error: {last_error}",
    )


@dataclass(frozen=True)
class _Target:
    tls: bool
    host: str
    port: int
    prefix: str


def _target(creds: ClusterCredentials) -> _Target:
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
    return _Target(tls, parts.hostname, port, parts.path.rstrip("/"))


# Client TLS contexts by the digest of what they were built from (the CA, the
# client certificate and key: their content, never their paths). A warm
# server fills this for the kubeconfigs its children used (keep_context), so
# each later child inherits a built context instead of parsing certificates
# again; a changed file has another digest, so a context is never stale.
_CONTEXTS: dict[bytes, ssl.SSLContext] = {}
_MAX_CONTEXTS = 8
# Set by a warm server's child: where to say that a kubeconfig's context was not
# there (see note_context_miss); -1 otherwise.
context_hint_fd = -1
_missed: str | None = None


def _material(creds: ClusterCredentials) -> tuple[bytes, ClusterCredentials] | None:
    """The digest of what :func:`_ssl_context` would be built from, and ``creds`` with those bytes inline.

    Building from the inline copy means the context is made of exactly the
    bytes the digest names, even if a file changes meanwhile. None when it
    cannot be cached: the system trust store (its content is not read here),
    or a file that cannot be read now (building the context reports that).
    """
    if not creds.insecure_skip_tls_verify and creds.ca_data is None and creds.ca_file is None:
        return None

    def content(data: bytes | None, path: str | None) -> bytes | None:
        if data is None and path is not None:
            with open(path, "rb") as f:
                return f.read()
        return data

    try:
        ca = None if creds.insecure_skip_tls_verify else content(creds.ca_data, creds.ca_file)
        cert = content(creds.client_cert_data, creds.client_cert_file)
        key = content(creds.client_key_data, creds.client_key_file)
    except OSError:
        return None
    import hashlib  # here: only a warm server and its children keep contexts (~1.5 ms of a cold start)

    digest = hashlib.sha256()
    for part in (ca, cert, key):
        digest.update(b"-" if part is None else b"+" + len(part).to_bytes(8, "big") + part)
    inline = dataclasses.replace(
        creds,
        ca_file=None,
        ca_data=ca,
        client_cert_file=None,
        client_cert_data=cert,
        client_key_file=None,
        client_key_data=key,
    )
    return digest.digest(), inline


def _build_context(creds: ClusterCredentials) -> ssl.SSLContext:
    with _tls_files(creds, ca_in_memory=True) as (verify, cert):
        return _ssl_context(verify, cert, creds.ca_data)


def client_context(creds: ClusterCredentials) -> ssl.SSLContext:
    """The client TLS context for ``creds``: one built for the same content before, else a new one."""
    global _missed
    # Only a warm server keeps contexts, and only its children can say they
    # built one: a cold start reads and hashes nothing for them.
    material = _material(creds) if _CONTEXTS or context_hint_fd >= 0 else None
    context = _CONTEXTS.get(material[0]) if material is not None else None
    if context is not None:
        return context
    _missed = creds.source if material is not None else None
    return _build_context(creds)


def keep_context(creds: ClusterCredentials) -> bool:
    """Build and keep the context of ``creds`` for later :func:`client_context` calls (a warm server)."""
    material = _material(creds)
    if material is None or material[0] in _CONTEXTS:
        return False
    key, inline = material
    context = _build_context(inline)
    if len(_CONTEXTS) >= _MAX_CONTEXTS:
        del _CONTEXTS[next(iter(_CONTEXTS))]  # the oldest: a kubeconfig since rotated, most likely
    _CONTEXTS[key] = context
    return True


def note_context_miss(kubeconfig: str) -> None:
    """Tell the warm server, if any, that ``kubeconfig``'s context had to be built (it builds it too)."""
    global _missed
    if _missed is None or context_hint_fd < 0:
        return
    _missed = None
    line = os.fsencode(kubeconfig) + b"\n"
    if len(line) <= 512 and b"\n" not in line[:-1]:
        with contextlib.suppress(OSError):  # a full pipe or a gone server: only a lost hint
            os.write(context_hint_fd, line)


def _ssl_context(
    verify: str | bool, cert: tuple[str, str] | None, ca_data: bytes | None = None
) -> ssl.SSLContext:
    """The client TLS context: the CA (``ca_data`` PEM, else the file ``verify`` names, else the
    system trust store), an optional client certificate."""
    if verify is False:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        try:
            if ca_data is not None:
                # PEM blocks are ASCII; text around them (a CA file's comments)
                # may not be, and OpenSSL skips it when it reads a file itself.
                context = ssl.create_default_context(cadata=ca_data.decode("ascii", errors="ignore"))
            else:
                context = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
        except (ValueError, OSError) as exc:  # ssl.SSLError is an OSError: no certificate in it
            raise KubernetesError(
                "cannot load the API server's certificate authority", _describe(exc)
            ) from exc
    if cert is not None:
        try:
            context.load_cert_chain(cert[0], cert[1])
        except (OSError, ssl.SSLError) as exc:
            raise KubernetesError(
                "cannot load the client certificate and key for the API server", _describe(exc)
            ) from exc
    return context


def _get(
    target: _Target,
    path: str,
    headers: dict[str, str],
    context: ssl.SSLContext,
    connect_timeout: float,
    read_timeout: float,
) -> tuple[int, bytes]:
    """One GET over a fresh HTTPS connection; the status and the body (bounded)."""
    conn = (
        http.client.HTTPSConnection(target.host, target.port, timeout=connect_timeout, context=context)
        if target.tls
        else http.client.HTTPConnection(target.host, target.port, timeout=connect_timeout)
    )
    try:
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(read_timeout)
        conn.request("GET", target.prefix + path, headers=headers)
        resp = conn.getresponse()
        body = resp.read(_MAX_BODY + 1)
        if len(body) > _MAX_BODY:
            raise KubernetesError(f"the API server's answer is larger than {_MAX_BODY} bytes")
        return resp.status, body
    finally:
        conn.close()


def pod_annotation(pod: dict[str, Any], key: str) -> str | None:
    """The value of annotation ``key`` on ``pod``, or None when it is absent."""
    metadata = pod.get("metadata")
    if not isinstance(metadata, dict):
        return None
    annotations = metadata.get("annotations")
    if not isinstance(annotations, dict):
        return None
    value = annotations.get(key)
    return value if isinstance(value, str) else None


def _check_name(what: str, value: object, grammar: re.Pattern[str], max_len: int) -> None:
    if isinstance(value, str) and len(value) <= max_len and grammar.fullmatch(value):
        return
    shown = repr(value)[:80]
    raise KubernetesError(
        f"invalid {what} {shown}: not a valid Kubernetes name",
        f"a {what} must be at most {max_len} lowercase letters, digits, '-'"
        + (" or '.'" if grammar is _DNS1123_SUBDOMAIN else ""),
    )


@contextlib.contextmanager
def _tls_files(
    creds: ClusterCredentials, ca_in_memory: bool = False
) -> Iterator[tuple[str | bool, tuple[str, str] | None]]:
    """Yield the CA (a path, True for the system store, False for none) and the client cert and key paths.

    ``load_cert_chain`` only accepts file paths, so inline data goes into a fresh 0700
    directory as 0600 files, removed when the block exits. With ``ca_in_memory``
    inline CA data stays in memory (the caller passes it to :func:`_ssl_context`):
    the usual kubeconfig (a token and inline CA data, as ``rdma-cni install``
    writes it) then needs no files, nor tempfile's imports in a cold ADD.
    """
    tmpdir: str | None = None

    def materialise(filename: str, data: bytes) -> str:
        nonlocal tmpdir
        if tmpdir is None:
            import tempfile  # here: most kubeconfigs never need it (~2 ms of a cold start)

            tmpdir = tempfile.mkdtemp(prefix="rdma-cni-k8s-")  # mkdtemp creates it 0700
        target = os.path.join(tmpdir, filename)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return target

    try:
        verify: str | bool
        if creds.insecure_skip_tls_verify:
            verify = False
        elif creds.ca_data is not None:
            verify = True if ca_in_memory else materialise("ca.crt", creds.ca_data)
        elif creds.ca_file is not None:
            verify = creds.ca_file
        else:
            verify = True  # the system trust store
        cert_path = creds.client_cert_file
        if creds.client_cert_data is not None:
            cert_path = materialise("client.crt", creds.client_cert_data)
        key_path = creds.client_key_file
        if creds.client_key_data is not None:
            key_path = materialise("client.key", creds.client_key_data)
        cert = (cert_path, key_path) if cert_path and key_path else None
        yield verify, cert
    finally:
        if tmpdir is not None:
            import shutil

            shutil.rmtree(tmpdir, ignore_errors=True)


def _decode_pod(body: bytes, creds: ClusterCredentials, pod_ref: str) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except ValueError:
        raise KubernetesError(
            f"API server {creds.server} answered pod {pod_ref} with something that is not JSON",
            _snippet(_redact(body.decode(errors="replace"), creds)),
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("metadata"), dict):
        raise KubernetesError(f"API server {creds.server} answered pod {pod_ref} with a malformed object")
    kind = doc.get("kind")
    if kind is not None and kind != "Pod":
        raise KubernetesError(
            f"API server {creds.server} answered pod {pod_ref} with a {str(kind)[:40]!r}, not a Pod"
        )
    return doc


def _status_message(body: bytes, creds: ClusterCredentials) -> str:
    """The ``message`` of a Kubernetes Status body, else a snippet of the body."""
    try:
        doc = json.loads(body)
    except ValueError:
        return _snippet(_redact(body.decode(errors="replace"), creds))
    if isinstance(doc, dict) and isinstance(doc.get("message"), str):
        return _snippet(_redact(doc["message"], creds))
    return ""


def _describe(exc: BaseException) -> str:
    return f"{exc.__class__.__name__}: {exc}"


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    if len(text) > _MAX_FOREIGN_TEXT:
        return text[:_MAX_FOREIGN_TEXT] + "..."
    return text


def _redact(text: str, creds: ClusterCredentials) -> str:
    for secret in creds.secrets():
        if secret:
            text = text.replace(secret, "<redacted>")
    return text


# Shared with rdma_cni.kube.client, the long-running components' client, so that
# both clients materialise TLS files and redact secrets the same way.
tls_files = _tls_files
redact = _redact
snippet = _snippet
describe = _describe
target = _target
ssl_context = _ssl_context
