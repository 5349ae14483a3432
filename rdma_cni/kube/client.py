"""A small Kubernetes API client for the long-running components (node agent, scheduler extender).

The plugin itself reads one pod per run (:mod:`rdma_cni.kube.podget`); the node agent
and the extender instead keep one client for their lifetime: GET, LIST (full
or metadata only), WATCH, merge PATCH and POST over one keep-alive session.
Credentials and secret redaction are :mod:`rdma_cni.kube.credentials`', TLS files and
contexts :mod:`rdma_cni.kube.tls`', what a status means :mod:`rdma_cni.kube.status`':
the plugin's pod GET uses the same three, so both clients accept the same kubeconfigs,
classify answers alike and leak nothing either.

Failures are typed by what the caller can do about them: :class:`NotFound`
(404), :class:`Conflict` (409: re-read and retry), :class:`Gone` (410: relist),
:class:`Invalid` (422: the request is wrong), :class:`Unavailable` (no answer,
a timeout, 429 or 5xx: back off and retry) and :class:`ApiError` for the rest
(refused credentials, TLS failures, malformed answers). Nothing is retried
here: the callers own their backoff loops.

Requests that are not watches (GET, LIST, PATCH, POST) go over a small pool of
keep-alive ``http.client`` connections: a Binding POST through ``requests``
costs about three times the CPU (the scheduler extender creates one per pod).
Watches stream through ``requests``, imported on first use (as ``http.client``
and ``ssl`` are), keeping this module cheap to import.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

from rdma_cni import __version__
from rdma_cni.kube import credentials, tls
from rdma_cni.kube.pool import POOL_SIZE, Pool
from rdma_cni.kube.status import Status, classify, describe, snippet

log = logging.getLogger("rdma_cni.kubeapi")

METADATA_LIST_ACCEPT = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
METADATA_ACCEPT = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"

# Longest watch event accepted: a Node with 256 KiB of annotations fits easily.
_MAX_EVENT_BYTES = 16 * 1024 * 1024


class ApiError(Exception):
    """The API server refused a request or could not be used.

    ``status`` is the HTTP status (0 when there was no answer), ``reason`` the
    Kubernetes Status reason (``NotFound``, ``Conflict``, ...) or a
    description of the local failure, ``message`` a redacted explanation.
    """

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


class NotFound(ApiError):
    """404: the object does not exist."""


class Conflict(ApiError):
    """409: a stale resourceVersion, or the change conflicts (e.g. a pod already bound)."""


class Gone(ApiError):
    """410: the resourceVersion or continue token is too old; list again."""


class Invalid(ApiError):
    """422: the server refused the object or patch as invalid."""


class Unavailable(ApiError):
    """No usable answer: connection failure, timeout (status 0), 429 or 5xx. Retry with backoff."""


# Kept unquoted in request paths (requests' choice); everything else is percent-encoded.
_URL_SAFE = "!#$%&'()*+,/:;=?@[]~"
# A reused connection failing this way was most likely closed by the server while idle.
_STALE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


def _text(body: bytes) -> str:
    return body.decode("utf-8", errors="replace")


# The status classifier's kinds that have an exception class of their own; the rest are ApiError.
_ERROR_CLASSES: dict[Status, type[ApiError]] = {
    Status.NOT_FOUND: NotFound,
    Status.CONFLICT: Conflict,
    Status.GONE: Gone,
    Status.INVALID: Invalid,
    Status.RETRY: Unavailable,
}


def _error_class(status: int) -> type[ApiError]:
    return _ERROR_CLASSES.get(classify(status), ApiError)


class ApiClient:
    """One API server, one keep-alive session.

    Thread-safe: threads may share a client; concurrent requests each take a
    pooled connection (at most 16 at once, kept alive; a request beyond waits for one), and a
    watch holds one for as long as it is iterated. ``timeout`` bounds connecting and each
    read of an answer. :meth:`close` releases the connections and any private
    copies of inline TLS material; a closed client reopens on next use.
    """

    def __init__(
        self,
        creds: credentials.ClusterCredentials,
        *,
        timeout: float = 10.0,
        user_agent: str = f"rdma-cni/{__version__}",
    ) -> None:
        self._creds = creds
        self._timeout = timeout
        self._user_agent = user_agent
        parts = urllib.parse.urlsplit(creds.server)
        # userinfo is never sent (requests would turn it into Basic auth in
        # place of the token) and never shown.
        netloc = parts.netloc.rpartition("@")[2]
        self.server = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        self._lock = threading.Lock()
        self._session: Any = None
        self._pool: Pool | None = None
        # TLS material as files (inline kubeconfig data written out), shared by both transports.
        self._files: contextlib.ExitStack | None = None
        self._tls: tuple[str | bool, tuple[str, str] | None] = (True, None)

    @classmethod
    def from_kubeconfig(cls, path: str | None, **kwargs: Any) -> ApiClient:
        """A client for the kubeconfig at ``path``, or the in-cluster service account when None.

        Raises :class:`rdma_cni.cni.errors.InvalidConfig` naming what is wrong with
        the credentials (see :func:`rdma_cni.kube.credentials.load_credentials`).
        """
        return cls(credentials.load_credentials(path), **kwargs)

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the session's connections and remove private TLS files."""
        with self._lock:
            session, pool, files = self._session, self._pool, self._files
            self._session = self._pool = self._files = None
        if session is not None:
            session.close()
        if pool is not None:
            pool.close()
        if files is not None:
            files.close()

    # -- verbs

    def get(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """GET one object (or any JSON document) at ``path``."""
        return self._json("GET", path, params=params)

    def list(
        self, path: str, params: dict[str, Any] | None = None, *, metadata_only: bool = False
    ) -> dict[str, Any]:
        """LIST a collection; ``metadata_only`` asks for a PartialObjectMetadataList.

        Paging is the caller's: pass ``limit`` and ``continue`` in ``params``.
        """
        accept = METADATA_LIST_ACCEPT if metadata_only else "application/json"
        return self._json("GET", path, params=params, accept=accept)

    def patch_merge(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Apply a JSON merge patch (RFC 7386) and return the object as stored."""
        return self._json("PATCH", path, body=body, content_type="application/merge-patch+json")

    def patch_strategic(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Apply a strategic merge patch and return the object as stored.

        Kubernetes' own patch type for built-in kinds: lists with a merge key (a pod's conditions,
        by type) are merged entry by entry, where a JSON merge patch would replace the whole list.
        """
        return self._json("PATCH", path, body=body, content_type="application/strategic-merge-patch+json")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` (e.g. a Binding) and return the answer."""
        return self._json("POST", path, body=body, content_type="application/json")

    def put(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """PUT ``body`` (its ``metadata.resourceVersion`` the precondition); return it as stored."""
        return self._json("PUT", path, body=body, content_type="application/json")

    def delete(self, path: str) -> dict[str, Any]:
        """DELETE the object at ``path``; returns the answer (the object or a Status)."""
        return self._json("DELETE", path)

    def watch(
        self,
        path: str,
        params: dict[str, Any] | None = None,
        *,
        metadata_only: bool = False,
        timeout_seconds: int = 300,
    ) -> Iterator[dict[str, Any]]:
        """Stream watch events ``{"type": ..., "object": ...}`` as they arrive, BOOKMARK included.

        Bookmarks are asked for unless ``params`` says otherwise. The request
        is sent when iteration starts; the iterator ends when the server ends
        the watch (after ``timeout_seconds``), and closing it closes the stream.
        Raises :class:`Gone` for a 410 (an answer or an ERROR event: relist),
        :class:`Unavailable` when the stream breaks or stays silent past
        ``timeout_seconds`` plus the client's timeout, and the error typed by
        its code for any other ERROR event.
        """
        query = {
            "allowWatchBookmarks": "true",
            **(params or {}),
            "watch": "1",
            "timeoutSeconds": str(timeout_seconds),
        }
        accept = METADATA_ACCEPT if metadata_only else "application/json"
        read_timeout = timeout_seconds + self._timeout
        return self._events(path, query, accept, read_timeout)

    # -- plumbing

    def _events(
        self, path: str, query: dict[str, Any], accept: str, read_timeout: float
    ) -> Iterator[dict[str, Any]]:
        import requests  # deferred: see the module docstring

        resp = self._send("GET", path, params=query, accept=accept, stream=True, read_timeout=read_timeout)
        try:
            for line in resp.iter_lines(chunk_size=64 * 1024):
                if not line:
                    continue
                if len(line) > _MAX_EVENT_BYTES:
                    raise ApiError(
                        0, "InvalidResponse", f"watch {path}: an event over {_MAX_EVENT_BYTES} bytes"
                    )
                event = self._decode_event(path, line)
                if event["type"] == "ERROR":
                    raise self._status_error("watch", path, event["object"])
                yield event
        except requests.exceptions.RequestException as exc:
            # Broken chunked stream, reset connection or read timeout: the
            # watch is gone and must be resumed from the last version seen.
            raise Unavailable(
                0, "WatchInterrupted", self._clean(f"watch {path} interrupted: {describe(exc)}")
            ) from None
        finally:
            resp.close()

    def _decode_event(self, path: str, line: bytes) -> dict[str, Any]:
        try:
            event = json.loads(line)
        except ValueError:
            raise ApiError(
                0, "InvalidResponse", self._clean(f"watch {path}: an event that is not JSON: {line[:200]!r}")
            ) from None
        if (
            not isinstance(event, dict)
            or not isinstance(event.get("type"), str)
            or not isinstance(event.get("object"), dict)
        ):
            raise ApiError(0, "InvalidResponse", f"watch {path}: an event without a type and an object")
        return event

    def _status_error(self, verb: str, path: str, status: dict[str, Any]) -> ApiError:
        code = status.get("code")
        code = code if isinstance(code, int) else 500
        reason = status.get("reason") if isinstance(status.get("reason"), str) else ""
        message = status.get("message") if isinstance(status.get("message"), str) else ""
        text = f"{verb} {path}: HTTP {code} {reason}".rstrip() + (f": {snippet(message)}" if message else "")
        return _error_class(code)(code, reason or "Unknown", self._clean(text))

    def _json(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: dict[str, Any] | None = None,
        content_type: str | None = None,
        accept: str = "application/json",
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        status, raw = self._request(method, path, params, data, content_type, accept)
        if status >= 400:
            raise self._answer_error(method, path, status, raw)
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested past the parser's stack
            raise ApiError(
                status,
                "InvalidResponse",
                self._clean(f"{method} {path}: an answer that is not JSON: {snippet(_text(raw))}"),
            ) from None
        if not isinstance(doc, dict):
            raise ApiError(status, "InvalidResponse", f"{method} {path}: an answer that is not an object")
        return doc

    def _headers(self, accept: str, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": accept, "User-Agent": self._user_agent}
        if self._creds.token:
            headers["Authorization"] = f"Bearer {self._creds.token}"
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def _request(
        self,
        method: str,
        path: str,
        params: dict[str, Any] | None,
        data: bytes | None,
        content_type: str | None,
        accept: str,
    ) -> tuple[int, bytes]:
        """One request over a pooled keep-alive connection: (status, body). Errors typed as for _send."""
        import http.client  # deferred: see the module docstring
        import ssl

        if not path.startswith("/"):
            raise ValueError(f"API path must start with '/': {path[:80]!r}")
        pool = self._connections()
        # As requests would send it: characters a URL may not hold are quoted, the rest kept.
        url = pool.prefix + urllib.parse.quote(path, safe=_URL_SAFE)
        if params:
            url += "?" + urllib.parse.urlencode(params, doseq=True)
        headers = self._headers(accept, content_type)
        while True:
            conn, reused = pool.take()
            # Given back (pool.give) only with its answer read in full; otherwise closed here and
            # told to the pool as lost (the finally), which frees its place for a waiting request.
            kept = False
            try:
                conn.request(method, url, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                if resp.will_close:
                    conn.close()
                else:
                    pool.give(conn)
                    kept = True
                return resp.status, raw
            except ssl.SSLError as exc:  # before OSError, which it is: a certificate does not heal
                conn.close()
                raise self._tls_error(method, path, exc) from None
            except http.client.InvalidURL as exc:
                conn.close()
                raise ApiError(0, "RequestFailed", self._clean(f"{method} {path}: {describe(exc)}")) from None
            except ValueError:
                # http.client refuses a header value with a line break: its text quotes the value
                # escaped, which redaction would not recognise, so it is not shown.
                conn.close()
                raise ApiError(
                    0,
                    "RequestFailed",
                    f"{method} {path}: a header HTTP cannot carry; check the credentials in "
                    f"{self._creds.source}",
                ) from None
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                if reused and method == "GET" and isinstance(exc, _STALE):
                    # The server closed an idle connection as we reused it: a read is safe to resend.
                    continue
                raise Unavailable(
                    0,
                    "NoAnswer",
                    self._clean(f"{method} {path}: no answer from {self.server}: {describe(exc)}"),
                ) from None
            finally:
                if not kept:
                    pool.lost()

    def _tls_error(self, method: str, path: str, exc: BaseException) -> ApiError:
        return ApiError(
            0,
            "TLSError",
            self._clean(
                f"{method} {path}: TLS connection to {self.server} failed: {describe(exc)}; "
                f"check the certificate authority in {self._creds.source}"
            ),
        )

    def _send(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        data: bytes | None = None,
        content_type: str | None = None,
        accept: str = "application/json",
        stream: bool = False,
        read_timeout: float | None = None,
    ) -> Any:
        import requests  # deferred: see the module docstring

        if not path.startswith("/"):
            raise ValueError(f"API path must start with '/': {path[:80]!r}")
        headers = self._headers(accept, content_type)
        timeout = (self._timeout, self._timeout if read_timeout is None else read_timeout)
        try:
            resp = self._open().request(
                method,
                self.server + path,
                params=params,
                data=data,
                headers=headers,
                timeout=timeout,
                allow_redirects=False,
                stream=stream,
            )
        except requests.exceptions.SSLError as exc:
            # A certificate problem does not heal by retrying: not Unavailable.
            raise self._tls_error(method, path, exc) from None
        except (
            requests.exceptions.ConnectionError,
            requests.exceptions.Timeout,
            requests.exceptions.ChunkedEncodingError,
        ) as exc:
            raise Unavailable(
                0,
                "NoAnswer",
                self._clean(f"{method} {path}: no answer from {self.server}: {describe(exc)}"),
            ) from None
        except requests.exceptions.RequestException as exc:
            raise ApiError(0, "RequestFailed", self._clean(f"{method} {path}: {describe(exc)}")) from None
        if resp.status_code >= 400:
            try:
                raise self._answer_error(method, path, resp.status_code, resp.content)
            finally:
                resp.close()
        return resp

    def _answer_error(self, method: str, path: str, status: int, body: bytes) -> ApiError:
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and doc.get("kind") == "Status":
            # The HTTP status is authoritative over the body's code.
            return self._status_error(method, path, {**doc, "code": status})
        text = f"{method} {path}: HTTP {status}: {snippet(_text(body))}"
        return _error_class(status)(status, "Unknown", self._clean(text))

    def _open(self) -> Any:
        with self._lock:
            if self._session is None:
                self._session = self._new_session()
            return self._session

    def _connections(self) -> Pool:
        with self._lock:
            if self._pool is None:
                self._pool = self._new_pool()
            return self._pool

    def _materialise(self) -> tuple[str | bool, tuple[str, str] | None]:
        # Called under self._lock; the files live until close().
        if self._files is None:
            files = contextlib.ExitStack()
            self._tls = files.enter_context(tls.tls_files(self._creds))
            self._files = files
            if self._tls[0] is False:
                log.warning("TLS verification of %s is disabled by %s", self.server, self._creds.source)
        return self._tls

    def _new_pool(self) -> Pool:
        from rdma_cni.cni.errors import CniError

        verify, cert = self._materialise()
        try:
            target = credentials.api_target(self._creds)
        except CniError as exc:  # not an http(s)://host:port URL
            raise ApiError(0, "RequestFailed", self._clean(exc.msg)) from None
        try:
            context = tls.ssl_context(verify, cert) if target.tls else None
        except CniError as exc:  # the certificate authority, client certificate or key cannot be loaded
            raise ApiError(0, "TLSError", self._clean(f"{exc.msg}: {exc.details}")) from None
        return Pool(target.host, target.port, target.prefix, context, self._timeout)

    def _new_session(self) -> Any:
        import requests  # deferred: see the module docstring
        import urllib3

        verify, cert = self._materialise()
        session = requests.Session()
        # As in the plugin's pod GET (rdma_cni.kube.podget): proxy variables, .netrc and REQUESTS_CA_BUNDLE
        # from the environment must not change where or how we connect.
        session.trust_env = False
        session.verify = verify
        if cert is not None:
            session.cert = cert
        if verify is False:
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=POOL_SIZE)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        return session

    def _clean(self, text: str) -> str:
        return credentials.redact(text, self._creds)
