"""The plugin's one request to Kubernetes: GET the pod being attached, to read its annotations.

Credentials come from :mod:`rdma_cni.kube.credentials`, the TLS context from
:mod:`rdma_cni.kube.tls` (kept by a warm server), and what an answer's status
means from :mod:`rdma_cni.kube.status`, as for the long-running client.

Only the standard library is used for the one GET (http.client and ssl):
``requests`` and urllib3 cost ~60 ms of imports on every cold start for a
request that needs none of their sessions, redirects, proxies or cookies.

A process that runs many verbs (the agent's verb workers) keeps its
connection to the API server between them (:func:`keep_connections`): an ADD
then spends no TCP connect and no TLS handshake (~3-5 ms, ~2.5 ms of CPU).
A kept connection is used again only for the same API server with the same
TLS context (the same CA and client certificate bytes: :mod:`rdma_cni.kube.tls`),
only if nothing arrived on it while it was idle (the server closing it, say),
and one that fails before an answer is replaced by a fresh one at once, the
GET repeated (it changes nothing); a cold plugin keeps none.

Secrets never appear in exception messages or log lines: anything derived
from foreign text passes through :func:`~rdma_cni.kube.credentials.redact`
before it leaves this module.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import re
import select
import ssl
import time
import urllib.parse
from typing import Any

from rdma_cni import __version__
from rdma_cni.cni.errors import CniError, KubernetesError, TryAgainLater
from rdma_cni.kube import tls
from rdma_cni.kube.credentials import ApiTarget, ClusterCredentials, api_target, redact
from rdma_cni.kube.status import Status, classify, describe, snippet
from rdma_cni.kube.tls import client_context

# The plugin's Kubernetes logger since before the split (log configurations name it).
log = logging.getLogger("rdma_cni.k8s")

# Kubernetes object-name grammars (k8s.io/apimachinery validation). A namespace
# is a DNS-1123 label; a pod name is a DNS-1123 subdomain.
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

# Largest answer read from the API server: a Pod is a few KiB, at most ~1.5 MiB (etcd's limit).
_MAX_BODY = 8 << 20

# Connections kept between verbs (keep_connections): by (host, port, tls, context); a handful at most.
_keep = False
_kept: dict[tuple[str, int, bool, ssl.SSLContext | None], http.client.HTTPConnection] = {}
_MAX_KEPT = 4


def kept_fds() -> set[int]:
    """The descriptors of the connections kept between verbs."""
    return {conn.sock.fileno() for conn in _kept.values() if conn.sock is not None}


def keep_connections(on: bool) -> None:
    """Keep (True) API server connections and TLS contexts between verbs: for a process that runs many."""
    global _keep
    _keep = on
    tls.keep_built = on
    if not on:
        while _kept:
            _kept.popitem()[1].close()


class _Retry(Exception):
    """An attempt that may succeed when tried again; the text says why it failed (redacted)."""


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
    target = api_target(creds)
    pod_ref = f"{namespace}/{name}"
    headers = {"Accept": "application/json", "User-Agent": f"rdma-cni/{__version__}"}
    if creds.token:
        headers["Authorization"] = f"Bearer {creds.token}"
    timeouts = timeout if isinstance(timeout, tuple) else (timeout, timeout)

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
            status, body = _attempt(creds, target, path, headers, context, timeouts)
            return _answer(status, body, creds, pod_ref)
        except _Retry as exc:
            last_error = str(exc)

    log.warning("giving up on API server %s after %d attempts: %s", creds.server, attempts, last_error)
    raise TryAgainLater(
        f"API server {creds.server} unavailable reading pod {pod_ref} after {attempts} attempts",
        f"last error: {last_error}",
    )


def _attempt(
    creds: ClusterCredentials,
    target: ApiTarget,
    path: str,
    headers: dict[str, str],
    context: ssl.SSLContext,
    timeouts: tuple[float, float],
) -> tuple[int, bytes]:
    """One GET: the status and body, :class:`_Retry` for a failure worth retrying."""
    try:
        return _get(target, path, headers, context, *timeouts)
    except ssl.SSLError as exc:
        # A bad certificate does not heal by retrying.
        raise KubernetesError(
            f"TLS connection to API server {creds.server} failed",
            redact(f"{describe(exc)}; check the certificate authority in {creds.source}", creds),
        ) from exc
    except TimeoutError as exc:
        raise _Retry(redact(f"Timeout: {exc or 'timed out'}", creds)) from None
    except (OSError, http.client.HTTPException) as exc:
        raise _Retry(redact(f"ConnectionError: {describe(exc)}", creds)) from None


def _answer(status: int, body: bytes, creds: ClusterCredentials, pod_ref: str) -> dict[str, Any]:
    """The pod from a 200; otherwise the error the status calls for (:class:`_Retry` for 429 and 5xx)."""
    if status == 200:
        return _decode_pod(body, creds, pod_ref)
    server_says = _status_message(body, creds)
    kind = classify(status)
    if kind is Status.RETRY:
        raise _Retry(f"HTTP {status}" + (f": {server_says}" if server_says else ""))
    if kind is Status.NOT_FOUND:
        raise KubernetesError(f"pod {pod_ref} not found", server_says)
    if kind is Status.REFUSED:
        raise KubernetesError(
            f"API server {creds.server} refused the credentials from {creds.source} "
            f"(HTTP {status}) reading pod {pod_ref}",
            server_says,
        )
    raise KubernetesError(
        f"API server {creds.server} answered HTTP {status} reading pod {pod_ref}", server_says
    )


def _get(
    target: ApiTarget,
    path: str,
    headers: dict[str, str],
    context: ssl.SSLContext,
    connect_timeout: float,
    read_timeout: float,
) -> tuple[int, bytes]:
    """One GET, over a kept connection (:func:`keep_connections`) or a fresh one; the status and the body."""
    key = _key(target, context)
    conn = _kept.pop(key, None) if _keep else None
    if conn is not None and not _reusable(conn):
        conn.close()
        conn = None
    if conn is not None:
        with contextlib.suppress(OSError, http.client.HTTPException):
            # A kept connection the server closed meanwhile fails here: a fresh one decides.
            return _exchange(conn, key, target, path, headers, read_timeout)
    conn = _connection(target, context, connect_timeout)
    conn.connect()
    return _exchange(conn, key, target, path, headers, read_timeout)


def _key(target: ApiTarget, context: ssl.SSLContext) -> tuple[str, int, bool, ssl.SSLContext | None]:
    return (target.host, target.port, target.tls, context if target.tls else None)


def _connection(
    target: ApiTarget, context: ssl.SSLContext, connect_timeout: float
) -> http.client.HTTPConnection:
    if target.tls:
        return http.client.HTTPSConnection(target.host, target.port, timeout=connect_timeout, context=context)
    return http.client.HTTPConnection(target.host, target.port, timeout=connect_timeout)


def _keep_conn(key: tuple[str, int, bool, ssl.SSLContext | None], conn: http.client.HTTPConnection) -> None:
    if len(_kept) >= _MAX_KEPT:
        with contextlib.suppress(KeyError):
            _kept.pop(next(iter(_kept))).close()
    _kept[key] = conn


def connect_ahead(creds: ClusterCredentials, timeout: float = 3.05) -> str | None:
    """Open the connection the next GET to ``creds``' API server will use: TLS context and handshake.

    For a process that keeps connections (:func:`keep_connections`) and knows the kubeconfig its
    verbs will name: a verb worker, before it says it is ready, so that the first ADD after an
    agent starts does not pay them (about a third of its time). Nothing is sent. What went wrong,
    redacted, or None; a failure is left for the verb to meet and report as it would have.
    """
    if not _keep:
        return "connections are not kept in this process"
    target = api_target(creds)
    try:
        context = client_context(creds)
        key = _key(target, context)
        if key in _kept:
            return None
        conn = _connection(target, context, timeout)
        try:
            conn.connect()
        except BaseException:
            conn.close()
            raise
    except (OSError, http.client.HTTPException) as exc:  # ssl.SSLError is an OSError
        return redact(f"{type(exc).__name__}: {describe(exc)}", creds)
    except CniError as exc:  # the credentials' files (a CA that cannot be read)
        return redact(f"{exc.msg}: {exc.details}" if exc.details else exc.msg, creds)
    _keep_conn(key, conn)
    return None


def _reusable(conn: http.client.HTTPConnection) -> bool:
    """Whether a kept connection is still open with nothing unread on it (a server closing it is readable)."""
    sock = conn.sock
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    if not readable:
        return True
    if not isinstance(sock, ssl.SSLSocket):
        return False
    # A TLS 1.3 server sends its session tickets after the handshake: records with nothing for
    # us, still unread on a connection opened ahead (connect_ahead). Reading them without
    # waiting tells them from a close or stray data.
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        sock.recv(1)
    except ssl.SSLWantReadError:
        return True
    except OSError:
        return False
    finally:
        sock.settimeout(timeout)
    return False  # the server closed it, or sent what nobody asked for


def _exchange(
    conn: http.client.HTTPConnection,
    key: tuple[str, int, bool, ssl.SSLContext | None],
    target: ApiTarget,
    path: str,
    headers: dict[str, str],
    read_timeout: float,
) -> tuple[int, bytes]:
    """The GET on ``conn`` (connected); kept afterwards when the process keeps connections and it may be."""
    keep = False
    try:
        assert conn.sock is not None
        conn.sock.settimeout(read_timeout)
        conn.request("GET", target.prefix + path, headers=headers)
        resp = conn.getresponse()
        body = resp.read(_MAX_BODY + 1)
        if len(body) > _MAX_BODY:
            raise KubernetesError(f"the API server's answer is larger than {_MAX_BODY} bytes")
        keep = _keep and not resp.will_close and resp.isclosed()
        return resp.status, body
    finally:
        if keep:
            _keep_conn(key, conn)
        else:
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


def _decode_pod(body: bytes, creds: ClusterCredentials, pod_ref: str) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except ValueError:
        raise KubernetesError(
            f"API server {creds.server} answered pod {pod_ref} with something that is not JSON",
            snippet(redact(body.decode(errors="replace"), creds)),
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
        return snippet(redact(body.decode(errors="replace"), creds))
    if isinstance(doc, dict) and isinstance(doc.get("message"), str):
        return snippet(redact(doc["message"], creds))
    return ""
