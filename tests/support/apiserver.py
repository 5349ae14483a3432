"""A small HTTPS stand-in for the Kubernetes API server, for tests.

It serves what rdma-cni's components read and write, with the real API
server's semantics for the parts it implements:

- Pods: ``GET``/``DELETE /api/v1/namespaces/{ns}/pods/{name}``, LIST and WATCH
  of ``/api/v1/pods`` and ``/api/v1/namespaces/{ns}/pods`` (``fieldSelector``
  on ``spec.nodeName``, ``metadata.name``, ``metadata.namespace``,
  ``status.phase``, ``spec.schedulerName``; ``labelSelector``), and
  ``POST .../pods/{name}/binding`` (201; 404 when the pod is gone; 409 when it
  is already bound or ``metadata.uid`` names another incarnation).
- Nodes: ``GET`` and merge ``PATCH /api/v1/nodes/{name}`` (404, 409 on a stale
  ``metadata.resourceVersion``, 400 for a body that is not JSON, 415 for
  another patch type, 422 for a result that is not a valid Node, including
  annotations over 256 KiB), LIST and WATCH of ``/api/v1/nodes``; merge
  ``PATCH /api/v1/nodes/{name}/status``, which changes the status only.
- Lists carry a ``resourceVersion`` (one global counter, bumped by every
  change, like etcd's revision) and page with ``limit``/``continue``. Asked by
  ``Accept: application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1``
  they answer metadata only.
- WATCH (``?watch=1&resourceVersion=N&allowWatchBookmarks=true``) streams
  newline-delimited JSON events (ADDED, MODIFIED, DELETED, BOOKMARK) over a
  chunked response; a version older than the kept history gets an ERROR event
  carrying a 410 ``Expired`` Status. Test hooks: :meth:`ApiServer.drop_watches`
  cuts every watch connection, :meth:`ApiServer.compact` forgets history,
  :meth:`ApiServer.send_bookmarks` makes watches send a bookmark now.
- Events: ``POST /api/v1/namespaces/{ns}/events`` (core v1; 201 with the stored
  Event, named from ``metadata.generateName``; 422 without ``involvedObject.name``
  or ``reason``, or with a namespace other than the URL's). Read them with
  :meth:`ApiServer.events`; :meth:`ApiServer.hold_events` keeps their answers waiting.
- Unauthenticated ``/healthz``, ``/readyz``, ``/livez`` and ``/version``.

Everything runs over real TLS with a certificate authority it generates
itself, with bearer token or client certificate authentication. Switches make
it fail (any status, on any path), hang, answer garbage or refuse a namespace.

Standard library only, plus the ``openssl`` command-line tool to generate the
certificates, so that it also runs inside a minimal test VM.

Use from Python::

    with ApiServer() as api:
        api.add_pod("default", "web-0", {"example.com/key": "value"})
        api.add_node("node-1", labels={"zone": "a"}, images=40)
        kubeconfig = api.write_kubeconfig(tmp / "kubeconfig", mode="client-cert-data")

Use as a script::

    python3 tests/support/apiserver.py --dir DIR [--port PORT] [--host ADDR]
                                       [--pods PODS.json] [--nodes NODES.json]
                                       [--token TOKEN]

The script generates its certificates in DIR (``ca.crt``, ``server.crt``,
``client.crt`` and their keys), starts serving, writes ``DIR/kubeconfig`` (JSON,
bearer token, CA by file) and ``DIR/token``, prints ``ready <url>`` on stdout
and serves until SIGTERM or SIGINT. ``--port 0`` (the default) picks a free
port; read it from the ``ready`` line or the kubeconfig. PODS.json is a JSON
list of objects with ``namespace`` and ``name`` and optionally
``annotations`` (a string-to-string mapping), ``uid`` and ``nodeName``.
NODES.json is a JSON list of objects with ``name`` and optionally ``labels``,
``annotations`` and ``images`` (a count).
"""

from __future__ import annotations

import argparse
import base64
import bisect
import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import socketserver
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["MAX_ANNOTATIONS_BYTES", "ApiServer", "SeenRequest", "make_ca", "make_cert", "make_node"]

KUBECONFIG_MODES = ("token", "token-file", "client-cert-files", "client-cert-data", "insecure")

_POD_PATH = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)")

# One openssl config for every certificate we make, so that the result does
# not depend on the system's openssl.cnf defaults.
_OPENSSL_CNF = """\
[req]
distinguished_name = dn
prompt = no

[dn]
CN = rdma-cni test

[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash

[server_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = {sans}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer

[client_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer
"""


# --------------------------------------------------------------------------
# Certificates


def _openssl(directory: str, *args: str) -> None:
    proc = subprocess.run(["openssl", *args], cwd=directory, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {proc.stderr.strip()}")


def _write_cnf(directory: str, sans: str) -> str:
    path = os.path.join(directory, "openssl.cnf")
    with open(path, "w", encoding="ascii") as f:
        f.write(_OPENSSL_CNF.format(sans=sans))
    return path


def _new_key_args(key_path: str) -> list[str]:
    # EC keys: generating them is near-instant, unlike RSA.
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key_path]


def make_ca(directory: str, stem: str = "ca", common_name: str = "rdma-cni test CA") -> tuple[str, str]:
    """Create a self-signed CA as ``{stem}.crt`` and ``{stem}.key`` in ``directory``.

    Returns the (certificate, key) paths. Useful on its own to get a CA that
    does not match the server, for TLS failure tests.
    """
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    cnf = _write_cnf(directory, "DNS:localhost")
    crt = os.path.join(directory, f"{stem}.crt")
    key = os.path.join(directory, f"{stem}.key")
    _openssl(
        directory,
        "req", "-x509", "-config", cnf, "-extensions", "ca_ext", *_new_key_args(key),
        "-out", crt, "-days", "30", "-subj", f"/CN={common_name}",
    )  # fmt: skip
    return crt, key


def _issue(
    directory: str,
    ca: tuple[str, str],
    stem: str,
    common_name: str,
    extensions: str,
    sans: str,
) -> tuple[str, str]:
    """Issue a certificate signed by ``ca``; returns (certificate, key) paths."""
    cnf = _write_cnf(directory, sans)
    crt = os.path.join(directory, f"{stem}.crt")
    key = os.path.join(directory, f"{stem}.key")
    csr = os.path.join(directory, f"{stem}.csr")
    _openssl(directory, "req", "-new", "-config", cnf, *_new_key_args(key), "-out", csr, "-subj", common_name)
    _openssl(
        directory,
        "x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1],
        "-set_serial", str(secrets.randbits(63)), "-days", "30",
        "-extfile", cnf, "-extensions", extensions, "-out", crt,
    )  # fmt: skip
    os.unlink(csr)
    return crt, key


def make_cert(
    directory: str, ca: tuple[str, str], stem: str, subject: str, *, client: bool, sans: str = ""
) -> tuple[str, str]:
    """Issue ``{stem}.crt``/``{stem}.key`` signed by ``ca`` (``make_ca``'s pair): a client certificate
    (extendedKeyUsage clientAuth) or a server one (serverAuth, for ``sans``); ``subject`` as
    ``/CN=name``. Returns the (certificate, key) paths."""
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    if client:
        paths = _issue(directory, ca, stem, subject, "client_ext", "")
    else:
        paths = _issue(directory, ca, stem, subject, "server_ext", sans or "IP:127.0.0.1,DNS:localhost")
    os.unlink(os.path.join(directory, "openssl.cnf"))
    return paths


_CA_CNF = """\
[ca]
default_ca = tier

[tier]
database = index.txt
new_certs_dir = .
serial = serial
default_md = sha256
policy = anything
unique_subject = no

[anything]
commonName = supplied
"""


def make_cert_dated(
    directory: str,
    ca: tuple[str, str],
    stem: str,
    subject: str,
    *,
    client: bool,
    start: str,
    end: str,
    sans: str = "",
) -> tuple[str, str]:
    """As :func:`make_cert`, valid from ``start`` to ``end`` (``YYYYMMDDHHMMSSZ``, UTC): an expired
    certificate, or one that expires soon. ``openssl x509 -req`` (OpenSSL 3.0) takes only ``-days``
    from now; ``openssl ca`` takes both dates."""
    directory = os.path.abspath(directory)
    work = os.path.join(directory, f".{stem}-ca")
    os.makedirs(work)
    with open(os.path.join(work, "ca.cnf"), "w", encoding="ascii") as f:
        f.write(_CA_CNF)
    open(os.path.join(work, "index.txt"), "w").close()
    with open(os.path.join(work, "serial"), "w") as f:
        f.write("1000\n")
    cnf = _write_cnf(work, sans or "IP:127.0.0.1,DNS:localhost")
    crt = os.path.join(directory, f"{stem}.crt")
    key = os.path.join(directory, f"{stem}.key")
    csr = os.path.join(work, f"{stem}.csr")
    _openssl(work, "req", "-new", "-config", cnf, *_new_key_args(key), "-out", csr, "-subj", subject)
    _openssl(
        work,
        "ca", "-batch", "-notext", "-config", "ca.cnf", "-cert", ca[0], "-keyfile", ca[1], "-in", csr,
        "-out", crt, "-startdate", start, "-enddate", end, "-extfile", cnf,
        "-extensions", "client_ext" if client else "server_ext",
    )  # fmt: skip
    shutil.rmtree(work)
    return crt, key


def _san_for(host: str) -> str:
    names = ["IP:127.0.0.1", "DNS:localhost"]
    if host not in ("127.0.0.1", "localhost", ""):
        try:
            ipaddress.ip_address(host)
            names.append(f"IP:{host}")
        except ValueError:
            names.append(f"DNS:{host}")
    return ",".join(names)


# --------------------------------------------------------------------------
# HTTP plumbing


@dataclass(frozen=True)
class SeenRequest:
    """One request as the server saw it."""

    method: str
    path: str
    authorization: str | None
    client_cert_cn: str | None
    user_agent: str | None
    accept: str | None
    content_type: str | None = None
    body: bytes = b""
    client_port: int = 0  # the client's TCP port: one per connection


class _HttpsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], api: ApiServer, context: ssl.SSLContext) -> None:
        self.api = api
        self.tls_context = context
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup for the server name,
        # which can stall for seconds in a VM without DNS; it is not needed.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = super().get_request()
        # Go sets TCP_NODELAY on every TCP connection, so the real API server
        # does too. Without it, the response waits behind the unacknowledged
        # TLS session tickets until the client's delayed ACK (~40 ms per pod
        # GET), a stall no real API server adds.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The handshake runs later, in the request's own thread, so one slow
        # or broken client cannot stall the accept loop.
        return self.tls_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Failed handshakes and clients that time out and hang up are
        # expected in tests; tracebacks on stderr would only be noise.
        pass


class _Handler(BaseHTTPRequestHandler):
    server: _HttpsServer
    protocol_version = "HTTP/1.1"
    server_version = "rdma-cni-apiserver-stand-in"
    sys_version = ""

    def setup(self) -> None:
        self.request.settimeout(15)
        self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _dispatch(self) -> None:
        self.server.api._handle(self)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _dispatch

    def send_body(self, status: int, body: bytes, content_type: str) -> None:
        """Send a complete response with a Content-Length (we speak HTTP/1.1)."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, status: int, doc: dict[str, Any]) -> None:
        """Send ``doc`` as a JSON response."""
        self.send_body(status, json.dumps(doc).encode(), "application/json")

    def start_stream(self) -> None:
        """Start a chunked 200 response, as the API server answers a watch."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def send_chunk(self, data: bytes) -> None:
        """Send one chunk of a chunked response; empty ``data`` ends the stream."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def _status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Kubernetes ``Status`` object, as the API server sends with errors."""
    doc: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        doc["details"] = details
    return doc


def _peer_cn(cert: dict[str, Any] | None) -> str | None:
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


# --------------------------------------------------------------------------
# Stored objects, selectors and patches

_NODE_PATH = re.compile(r"/api/v1/nodes/([^/]+)")
_NODE_STATUS_PATH = re.compile(r"/api/v1/nodes/([^/]+)/status")
_NS_PODS_PATH = re.compile(r"/api/v1/namespaces/([^/]+)/pods")
_BINDING_PATH = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/binding")
_EVENTS_PATH = re.compile(r"/api/v1/namespaces/([^/]+)/events")

# apimachinery's TotalAnnotationSizeLimitB: keys plus values of one object.
MAX_ANNOTATIONS_BYTES = 256 * 1024
# The API server refuses request bodies over 3 MiB.
MAX_BODY_BYTES = 3 * 1024 * 1024
# The real API server ends a watch after a random 30-60 minutes.
DEFAULT_WATCH_SECONDS = 1800

_KINDS = {"nodes": ("Node", "NodeList"), "pods": ("Pod", "PodList")}
_META_KIND = "PartialObjectMetadata"
_META_API = "meta.k8s.io/v1"

_QUALIFIED_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class _ApiFailure(Exception):
    """A refused request, answered with a Status of ``code``."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        """The Status body the API server would send."""
        return _status(self.code, self.reason, self.message, self.details)


def _not_found(resource: str, name: str) -> _ApiFailure:
    return _ApiFailure(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource})


def _invalid(kind: str, name: str, field_path: str, reason: str, detail: str) -> _ApiFailure:
    return _ApiFailure(
        422,
        "Invalid",
        f'{kind} "{name}" is invalid: {field_path}: {detail}',
        {"name": name, "kind": kind, "causes": [{"reason": reason, "message": detail, "field": field_path}]},
    )


def _compact_json(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


class _Stored:
    """One version of one object; its encodings are made on first use and then reused.

    Lists of thousands of nodes are joins of these cached encodings, which is
    what keeps a 5,000-node LIST well under a second. Stored documents are
    never mutated: a change stores a new version.
    """

    __slots__ = ("_full", "_item", "_meta", "doc", "kind")

    def __init__(self, kind: str, doc: dict[str, Any]) -> None:
        self.kind = kind
        self.doc = doc
        self._full: bytes | None = None
        self._item: bytes | None = None
        self._meta: bytes | None = None

    @property
    def metadata(self) -> dict[str, Any]:
        """The object's metadata mapping."""
        meta: dict[str, Any] = self.doc["metadata"]
        return meta

    def full(self) -> bytes:
        """The object as GET and watch events send it (with kind and apiVersion)."""
        if self._full is None:
            self._full = _compact_json(self.doc)
        return self._full

    def item(self) -> bytes:
        """The object as a list item (typed lists leave out kind and apiVersion)."""
        if self._item is None:
            self._item = _compact_json({k: v for k, v in self.doc.items() if k not in ("kind", "apiVersion")})
        return self._item

    def meta(self) -> bytes:
        """The object as a PartialObjectMetadata."""
        if self._meta is None:
            self._meta = _compact_json(
                {"kind": _META_KIND, "apiVersion": _META_API, "metadata": self.metadata}
            )
        return self._meta


@dataclass(frozen=True)
class _Event:
    rv: int
    resource: str
    type: str
    obj: _Stored
    prev: _Stored | None


def _dig(doc: dict[str, Any], dotted: str) -> str:
    value: Any = doc
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# The field selectors the real API server supports for these resources (a
# subset for pods); anything else is refused as it refuses it.
_FIELDS = {
    "pods": (
        "metadata.name",
        "metadata.namespace",
        "spec.nodeName",
        "spec.schedulerName",
        "spec.restartPolicy",
        "spec.serviceAccountName",
        "status.phase",
    ),
    "nodes": ("metadata.name", "spec.unschedulable"),
}

_Match = Callable[[dict[str, Any]], bool]


def _split_top_level(text: str) -> list[str]:
    """Split a selector on commas that are not inside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _field_selector(resource: str, text: str) -> list[_Match]:
    tests: list[_Match] = []
    for term in _split_top_level(text):
        m = re.fullmatch(r"([A-Za-z.]+)\s*(==|!=|=)\s*(.*)", term)
        if m is None:
            raise _ApiFailure(400, "BadRequest", f"invalid selector: '{text}'; can't understand '{term}'")
        path, op, value = m.groups()
        if path not in _FIELDS[resource]:
            raise _ApiFailure(400, "BadRequest", f"field label not supported: {path}")
        if op == "!=":
            tests.append(lambda doc, p=path, v=value: _dig(doc, p) != v)
        else:
            tests.append(lambda doc, p=path, v=value: _dig(doc, p) == v)
    return tests


def _labels_of(doc: dict[str, Any]) -> dict[str, str]:
    labels = doc.get("metadata", {}).get("labels")
    return labels if isinstance(labels, dict) else {}


def _label_selector(text: str) -> list[_Match]:
    tests: list[_Match] = []
    key = r"([A-Za-z0-9][-A-Za-z0-9_./]*)"
    for term in _split_top_level(text):
        if m := re.fullmatch(rf"(!?)\s*{key}", term):
            neg, k = m.groups()
            tests.append(lambda doc, k=k, neg=bool(neg): (k in _labels_of(doc)) != neg)
        elif m := re.fullmatch(rf"{key}\s*(==|!=|=)\s*([-A-Za-z0-9_.]*)", term):
            k, op, v = m.groups()
            if op == "!=":
                tests.append(lambda doc, k=k, v=v: _labels_of(doc).get(k) != v)
            else:
                tests.append(lambda doc, k=k, v=v: _labels_of(doc).get(k) == v)
        elif m := re.fullmatch(rf"{key}\s+(in|notin)\s+\(([^()]*)\)", term):
            k, op, values = m.groups()
            allowed = {v.strip() for v in values.split(",")}
            if op == "in":
                tests.append(lambda doc, k=k, a=allowed: _labels_of(doc).get(k) in a)
            else:
                tests.append(lambda doc, k=k, a=allowed: _labels_of(doc).get(k) not in a)
        else:
            raise _ApiFailure(400, "BadRequest", f"unable to parse requirement: {term!r}")
    return tests


def _selector(resource: str, params: dict[str, str]) -> _Match:
    tests = _field_selector(resource, params.get("fieldSelector", "")) + _label_selector(
        params.get("labelSelector", "")
    )
    return lambda doc: all(test(doc) for test in tests)


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch; ``target`` is left untouched."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def _validate_metadata(kind: str, name: str, metadata: Any) -> None:
    """Refuse, as the API server's validation does, metadata that no object may carry."""
    if not isinstance(metadata, dict):
        raise _invalid(kind, name, "metadata", "FieldValueInvalid", "Invalid value: must be an object")
    labels = metadata.get("labels", {})
    if not isinstance(labels, dict):
        raise _invalid(kind, name, "metadata.labels", "FieldValueInvalid", "Invalid value: must be a map")
    for key, value in labels.items():
        if not _qualified_name(key):
            raise _invalid(kind, name, "metadata.labels", "FieldValueInvalid", f'Invalid value: "{key}"')
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            raise _invalid(kind, name, f"metadata.labels.{key}", "FieldValueInvalid", "Invalid value")
    annotations = metadata.get("annotations", {})
    if not isinstance(annotations, dict):
        raise _invalid(
            kind, name, "metadata.annotations", "FieldValueInvalid", "Invalid value: must be a map"
        )
    total = 0
    for key, value in annotations.items():
        if not _qualified_name(key):
            raise _invalid(kind, name, "metadata.annotations", "FieldValueInvalid", f'Invalid value: "{key}"')
        if not isinstance(value, str):
            raise _invalid(
                kind,
                name,
                f"metadata.annotations.{key}",
                "FieldValueInvalid",
                "Invalid value: must be a string",
            )
        total += len(key) + len(value)
    if total > MAX_ANNOTATIONS_BYTES:
        raise _invalid(
            kind,
            name,
            "metadata.annotations",
            "FieldValueTooLong",
            f"Too long: must have at most {MAX_ANNOTATIONS_BYTES} bytes",
        )


def _qualified_name(key: object) -> bool:
    if not isinstance(key, str):
        return False
    prefix, _, local = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _SUBDOMAIN.fullmatch(prefix)):
        return False
    return len(local) <= 63 and bool(_QUALIFIED_NAME.fullmatch(local))


def _media_wants_metadata(accept: str | None, list_kind: bool | None) -> bool:
    """Whether ``Accept`` asks for PartialObjectMetadata(List); 406 when nothing offered can be served.

    ``list_kind`` None (a watch) takes either form, as the API server does.
    """
    if not accept:
        return False
    for offer in accept.split(","):
        media, *raw_params = (part.strip() for part in offer.split(";"))
        if media not in ("application/json", "application/*", "*/*"):
            continue
        params = dict(p.split("=", 1) for p in raw_params if "=" in p)
        as_kind = params.get("as")
        if as_kind is None:
            return False
        wanted = {
            True: ("PartialObjectMetadataList",),
            False: (_META_KIND,),
            None: (_META_KIND, "PartialObjectMetadataList"),
        }
        if params.get("g") == "meta.k8s.io" and params.get("v") == "v1" and as_kind in wanted[list_kind]:
            return True
    raise _ApiFailure(
        406,
        "NotAcceptable",
        "only the following media types are accepted: application/json, "
        "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1 and its List form",
    )


def make_node(
    name: str,
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    images: int | list[dict[str, Any]] = 0,
) -> dict[str, Any]:
    """A Node object shaped like a kubelet-registered one (no resourceVersion or uid yet).

    ``images`` is a list of ``status.images`` entries or a count of made-up
    ones (two names each, as kubelet reports a digest and a tag). Labels are
    added to the usual kubelet and cloud-provider ones.
    """
    digest = hashlib.sha256(name.encode()).hexdigest()
    octets = int(digest[:6], 16)
    address = f"10.{(octets >> 16) & 255}.{(octets >> 8) & 255}.{octets & 255}"
    if isinstance(images, int):
        image_list = []
        for i in range(images):
            image_hash = hashlib.sha256(f"image-{i}".encode()).hexdigest()
            repo = f"registry.example.com/team-{i % 7}/service-{i}"
            image_list.append(
                {
                    "names": [f"{repo}@sha256:{image_hash}", f"{repo}:v1.{i}.0"],
                    "sizeBytes": 12_000_000 + i * 1_234_567,
                }
            )
    else:
        image_list = [dict(image) for image in images]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    all_labels = {
        "beta.kubernetes.io/arch": "amd64",
        "beta.kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "node.kubernetes.io/instance-type": "rdma.x86.64c512g",
        "topology.kubernetes.io/region": "region-1",
        "topology.kubernetes.io/zone": f"zone-{octets % 3}",
        **(labels or {}),
    }
    metadata: dict[str, Any] = {"name": name, "labels": all_labels, "creationTimestamp": now}
    metadata["annotations"] = {
        "node.alpha.kubernetes.io/ttl": "0",
        "volumes.kubernetes.io/controller-managed-attach-detach": "true",
        **(annotations or {}),
    }

    def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
        return {
            "type": kind,
            "status": status,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
            "reason": reason,
            "message": message,
        }

    resources = {"cpu": "64", "memory": "527952244Ki", "pods": "110", "ephemeral-storage": "1844609580Ki"}
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": metadata,
        "spec": {
            "podCIDR": f"10.244.{octets % 250}.0/24",
            "podCIDRs": [f"10.244.{octets % 250}.0/24"],
            "providerID": f"baremetal://{name}",
        },
        "status": {
            "capacity": {**resources, "hugepages-1Gi": "0", "hugepages-2Mi": "0"},
            "allocatable": {**resources, "cpu": "63500m", "memory": "526903668Ki"},
            "conditions": [
                condition(
                    "MemoryPressure",
                    "False",
                    "KubeletHasSufficientMemory",
                    "kubelet has sufficient memory available",
                ),
                condition(
                    "DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"
                ),
                condition(
                    "PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"
                ),
                condition("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
            ],
            "addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": digest[:32],
                "systemUUID": str(uuid.UUID(digest[32:64])),
                "bootID": str(uuid.UUID(digest[:32])),
                "kernelVersion": "6.1.0-27-amd64",
                "osImage": "Debian GNU/Linux 12 (bookworm)",
                "containerRuntimeVersion": "containerd://1.6.20",
                "kubeletVersion": "v1.30.6",
                "kubeProxyVersion": "v1.30.6",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
            "images": image_list,
        },
    }


def _copy(doc: dict[str, Any]) -> dict[str, Any]:
    copied: dict[str, Any] = json.loads(json.dumps(doc))
    return copied


# --------------------------------------------------------------------------
# The server


class ApiServer:
    """An HTTPS Kubernetes API stand-in serving pods and nodes from memory.

    ``directory`` holds the generated certificates; without one a temporary
    directory is made and removed by :meth:`stop`. Bearer ``token`` defaults
    to a random string. Requests authenticate with that token or with a client
    certificate signed by this server's CA (:attr:`client_cert_path`).
    ``history`` is how many change events watches can resume from (older
    versions answer 410 Gone). :attr:`bookmark_interval` is how often a watch
    that asked for bookmarks gets one (the real API server: about a minute).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        token: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        history: int = 10_000,
    ) -> None:
        self._own_dir = directory is None
        self.directory = os.path.abspath(
            tempfile.mkdtemp(prefix="apiserver-") if directory is None else os.fspath(directory)
        )
        self.token = token if token is not None else secrets.token_urlsafe(32)
        self.host = host
        self._requested_port = port
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pods: dict[tuple[str, str], _Stored] = {}
        self._nodes: dict[str, _Stored] = {}
        self._rv = 1
        self._history: list[_Event] = []
        self._history_rvs: list[int] = []
        self._history_limit = max(2, history)
        self._oldest_rv = self._rv
        self._watch_epoch = 0
        self._bookmark_epoch = 0
        self._watching = 0
        self.bookmark_interval = 60.0
        self._forbidden: set[str] = set()
        self._fail: list[int] = []
        self._malformed = 0
        self._hang = 0.0
        self._late_bindings = 0.0
        self._events: list[dict[str, Any]] = []
        self._hold_events = threading.Event()
        self._hold_events.set()
        self.events_held = 0  # Event POSTs waiting on hold_events
        self._wake = threading.Event()
        self._seen: list[SeenRequest] = []
        self._httpd: _HttpsServer | None = None
        self._thread: threading.Thread | None = None
        self.ca_path = os.path.join(self.directory, "ca.crt")
        self.ca_key_path = os.path.join(self.directory, "ca.key")
        self.server_cert_path = os.path.join(self.directory, "server.crt")
        self.server_key_path = os.path.join(self.directory, "server.key")
        self.client_cert_path = os.path.join(self.directory, "client.crt")
        self.client_key_path = os.path.join(self.directory, "client.key")

    # -- lifecycle

    def start(self) -> ApiServer:
        """Generate certificates, bind and serve in a background thread."""
        if self._httpd is not None:
            raise RuntimeError("already started")
        os.makedirs(self.directory, exist_ok=True)
        ca = make_ca(self.directory)
        _issue(self.directory, ca, "server", "/CN=localhost", "server_ext", _san_for(self.host))
        _issue(self.directory, ca, "client", "/O=system:nodes/CN=rdma-cni-test-client", "client_ext", "")
        os.unlink(os.path.join(self.directory, "openssl.cnf"))

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.server_cert_path, self.server_key_path)
        context.load_verify_locations(self.ca_path)
        context.verify_mode = ssl.CERT_OPTIONAL

        self._wake = threading.Event()
        self._httpd = _HttpsServer((self.host, self._requested_port), self, context)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="apiserver", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, release hanging requests and watches, and remove a temporary directory."""
        if self._httpd is not None:
            self._wake.set()
            self._hold_events.set()
            self.drop_watches()
            self._httpd.shutdown()
            self._httpd.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._httpd = None
            self._thread = None
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The bound TCP port."""
        if self._httpd is None:
            raise RuntimeError("not started")
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """The base URL, e.g. ``https://127.0.0.1:34567``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.port}"

    # -- content

    @property
    def resource_version(self) -> int:
        """The current global resourceVersion (bumped by every change)."""
        with self._lock:
            return self._rv

    def add_pod(
        self,
        namespace: str,
        name: str,
        annotations: dict[str, str] | None = None,
        *,
        uid: str | None = None,
        node_name: str | None = "node-1",
        labels: dict[str, str] | None = None,
        scheduler_name: str = "default-scheduler",
        phase: str = "Pending",
    ) -> dict[str, Any]:
        """Add (or replace) a pod; returns the Pod object that will be served.

        ``node_name`` None or empty leaves the pod unbound (no ``spec.nodeName``).
        """
        metadata: dict[str, Any] = {
            "name": name,
            "namespace": namespace,
            "uid": uid or str(uuid.uuid4()),
            "creationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "labels": dict(labels) if labels is not None else {"app": name},
        }
        # Like the real API server, an empty map is left out entirely.
        if annotations:
            metadata["annotations"] = dict(annotations)
        spec: dict[str, Any] = {
            "restartPolicy": "Always",
            "schedulerName": scheduler_name,
            "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.9"}],
        }
        if node_name:
            spec["nodeName"] = node_name
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": metadata,
            "spec": spec,
            "status": {"phase": phase, "qosClass": "BestEffort"},
        }
        with self._lock:
            stored = self._store("pods", (namespace, name), pod)
        return _copy(stored.doc)

    def remove_pod(self, namespace: str, name: str) -> None:
        """Forget a pod (a DELETED event for watches); later GETs answer 404."""
        with self._lock:
            self._delete("pods", (namespace, name))

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A copy of the pod as stored now, or None."""
        with self._lock:
            stored = self._pods.get((namespace, name))
        return None if stored is None else _copy(stored.doc)

    def pods(self) -> list[dict[str, Any]]:
        """Every pod, as GETs would serve them now."""
        with self._lock:
            return [_copy(stored.doc) for stored in self._pods.values()]

    def add_node(
        self,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        images: int | list[dict[str, Any]] = 0,
        node: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Create or replace a Node (see :func:`make_node`); returns it as served.

        ``node`` gives the whole object instead (its ``metadata.name`` must be
        ``name``). A replaced node keeps its uid, as an update would.
        """
        doc = (
            _copy(node)
            if node is not None
            else make_node(name, labels=labels, annotations=annotations, images=images)
        )
        if doc.get("metadata", {}).get("name") != name:
            raise ValueError(f"node object is not named {name!r}")
        with self._lock:
            stored = self._store("nodes", name, doc)
        return _copy(stored.doc)

    def remove_node(self, name: str) -> None:
        """Delete a node (a DELETED event for watches)."""
        with self._lock:
            self._delete("nodes", name)

    def get_node(self, name: str) -> dict[str, Any] | None:
        """A copy of the node as stored now, or None."""
        with self._lock:
            stored = self._nodes.get(name)
        return None if stored is None else _copy(stored.doc)

    def set_node_annotations(self, name: str, changes: dict[str, str | None]) -> dict[str, Any]:
        """Merge ``changes`` into a node's annotations (None deletes a key), as a PATCH would."""
        with self._lock:
            stored = self._nodes.get(name)
            if stored is None:
                raise KeyError(name)
            doc = _merge_patch(stored.doc, {"metadata": {"annotations": changes}})
            stored = self._store("nodes", name, doc)
        return _copy(stored.doc)

    def forbid_namespace(self, namespace: str) -> None:
        """Answer 403 Forbidden to authenticated requests on pods in ``namespace``."""
        with self._lock:
            self._forbidden.add(namespace)

    # -- storage (callers hold self._lock)

    def _store(self, resource: str, key: Any, doc: dict[str, Any]) -> _Stored:
        table: dict[Any, _Stored] = getattr(self, f"_{resource}")
        prev = table.get(key)
        # Own copy: the previous version may share this mapping, and it must not change.
        metadata = doc["metadata"] = dict(doc["metadata"])
        if prev is not None:
            metadata.setdefault("uid", prev.metadata.get("uid"))
            metadata.setdefault("creationTimestamp", prev.metadata.get("creationTimestamp"))
        else:
            metadata.setdefault("uid", str(uuid.uuid4()))
        self._rv += 1
        metadata["resourceVersion"] = str(self._rv)
        stored = _Stored(_KINDS[resource][0], doc)
        table[key] = stored
        self._record(_Event(self._rv, resource, "ADDED" if prev is None else "MODIFIED", stored, prev))
        return stored

    def _delete(self, resource: str, key: Any) -> _Stored | None:
        table: dict[Any, _Stored] = getattr(self, f"_{resource}")
        prev = table.pop(key, None)
        if prev is None:
            return None
        # The DELETED event carries the object at the deletion's own version.
        self._rv += 1
        doc = dict(prev.doc)
        doc["metadata"] = {**prev.metadata, "resourceVersion": str(self._rv)}
        gone = _Stored(prev.kind, doc)
        self._record(_Event(self._rv, resource, "DELETED", gone, prev))
        return gone

    def _record(self, event: _Event) -> None:
        self._history.append(event)
        self._history_rvs.append(event.rv)
        if len(self._history) > self._history_limit:
            cut = len(self._history) - self._history_limit // 2
            self._oldest_rv = self._history_rvs[cut - 1]
            del self._history[:cut]
            del self._history_rvs[:cut]
        self._changed.notify_all()

    # -- watch control

    def compact(self) -> None:
        """Forget all change history, as etcd compaction does: watches from older versions get 410 Gone."""
        with self._lock:
            self._oldest_rv = self._rv
            self._history.clear()
            self._history_rvs.clear()
            self._changed.notify_all()

    def drop_watches(self) -> None:
        """Cut every open watch connection abruptly (no end of stream), as an API server restart would."""
        with self._lock:
            self._watch_epoch += 1
            self._changed.notify_all()

    def send_bookmarks(self) -> None:
        """Make every watch that allows bookmarks send one now."""
        with self._lock:
            self._bookmark_epoch += 1
            self._changed.notify_all()

    @property
    def watch_count(self) -> int:
        """How many watch streams are open."""
        with self._lock:
            return self._watching

    # -- fault injection

    def fail_next(self, n: int, status: int = 503) -> None:
        """Answer the next ``n`` requests with ``status`` (a 5xx, typically)."""
        with self._lock:
            self._fail.extend([status] * n)

    def malform_next(self, n: int = 1) -> None:
        """Answer the next ``n`` pod reads with HTTP 200 and a body that is not JSON."""
        with self._lock:
            self._malformed += n

    def hang(self, seconds: float = 30.0) -> None:
        """Make every request wait ``seconds`` before it is answered; 0 turns it off.

        Waiting requests are released early by :meth:`reset` and :meth:`stop`.
        """
        with self._lock:
            self._hang = max(0.0, seconds)

    def late_bindings(self, seconds: float) -> None:
        """Apply each Binding at once but answer it only after ``seconds`` (0 turns it off).

        A client whose timeout is shorter sees no answer for a Binding that was applied.
        Released early by :meth:`reset` and :meth:`stop`, like :meth:`hang`.
        """
        with self._lock:
            self._late_bindings = max(0.0, seconds)

    def hold_events(self, hold: bool = True) -> None:
        """Keep every Event POST unanswered until called with False, :meth:`reset` or :meth:`stop`."""
        if hold:
            self._hold_events.clear()
        else:
            self._hold_events.set()

    def events(self) -> list[dict[str, Any]]:
        """The Events created, in order."""
        with self._lock:
            return [_copy(event) for event in self._events]

    def reset(self) -> None:
        """Clear the fault switches, forbidden namespaces and request records (pods stay)."""
        self._hold_events.set()
        with self._lock:
            self._late_bindings = 0.0
            self._fail.clear()
            self._malformed = 0
            self._hang = 0.0
            self._forbidden.clear()
            self._seen.clear()
            self._wake.set()
            self._wake = threading.Event()

    # -- observations

    @property
    def request_count(self) -> int:
        """How many HTTP requests were received (since start or the last reset)."""
        with self._lock:
            return len(self._seen)

    @property
    def auth_headers(self) -> list[str | None]:
        """The Authorization header of each request received, None when absent."""
        with self._lock:
            return [seen.authorization for seen in self._seen]

    @property
    def requests_seen(self) -> list[SeenRequest]:
        """Every request received, in order."""
        with self._lock:
            return list(self._seen)

    # -- kubeconfig

    def write_kubeconfig(
        self,
        path: str | os.PathLike[str],
        *,
        mode: str = "token",
        ca: str = "file",
        token: str | None = None,
    ) -> str:
        """Write a JSON kubeconfig for this server and return its path.

        ``mode`` picks the credentials: ``token`` (inline), ``token-file``
        (written next to the kubeconfig as ``<name>.token`` and referenced
        relatively), ``client-cert-files``, ``client-cert-data`` (inline base64)
        or ``insecure`` (token, no CA, ``insecure-skip-tls-verify``). ``ca`` is
        ``file`` or ``data``. Files living in the kubeconfig's own directory are
        referenced by relative name, others by absolute path. ``token``
        overrides the token written (e.g. a wrong one).
        """
        if mode not in KUBECONFIG_MODES:
            raise ValueError(f"unknown kubeconfig mode {mode!r}; choose from {KUBECONFIG_MODES}")
        if ca not in ("file", "data"):
            raise ValueError(f"unknown ca style {ca!r}; choose 'file' or 'data'")
        path = os.path.abspath(os.fspath(path))
        base = os.path.dirname(path)

        def ref(file_path: str) -> str:
            return os.path.basename(file_path) if os.path.dirname(file_path) == base else file_path

        def b64(file_path: str) -> str:
            with open(file_path, "rb") as f:
                return base64.b64encode(f.read()).decode("ascii")

        cluster: dict[str, Any] = {"server": self.url}
        if mode == "insecure":
            cluster["insecure-skip-tls-verify"] = True
        elif ca == "file":
            cluster["certificate-authority"] = ref(self.ca_path)
        else:
            cluster["certificate-authority-data"] = b64(self.ca_path)

        bearer = self.token if token is None else token
        user: dict[str, Any]
        if mode in ("token", "insecure"):
            user = {"token": bearer}
        elif mode == "token-file":
            token_path = path + ".token"
            with open(token_path, "w", encoding="ascii") as f:
                f.write(bearer + "\n")  # a trailing newline, as `kubectl create token > f` leaves
            user = {"tokenFile": ref(token_path)}
        elif mode == "client-cert-files":
            user = {"client-certificate": ref(self.client_cert_path), "client-key": ref(self.client_key_path)}
        else:
            user = {
                "client-certificate-data": b64(self.client_cert_path),
                "client-key-data": b64(self.client_key_path),
            }

        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "preferences": {},
            "clusters": [{"name": "stand-in", "cluster": cluster}],
            "users": [{"name": "stand-in-user", "user": user}],
            "contexts": [
                {
                    "name": "stand-in",
                    "context": {"cluster": "stand-in", "user": "stand-in-user", "namespace": "default"},
                }
            ],
            "current-context": "stand-in",
        }
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
        return path

    # -- request handling (runs in the per-connection threads)

    def _handle(self, handler: _Handler) -> None:
        peer_cert = handler.request.getpeercert()
        split = urllib.parse.urlsplit(handler.path)
        body = self._read_body(handler)
        with self._lock:
            self._seen.append(
                SeenRequest(
                    method=handler.command,
                    path=handler.path,
                    authorization=handler.headers.get("Authorization"),
                    client_cert_cn=_peer_cn(peer_cert),
                    user_agent=handler.headers.get("User-Agent"),
                    accept=handler.headers.get("Accept"),
                    content_type=handler.headers.get("Content-Type"),
                    body=body or b"",
                    client_port=int(handler.client_address[1]),
                )
            )
            hang = self._hang
            wake = self._wake
            fail = self._fail.pop(0) if self._fail else None

        if hang:
            wake.wait(hang)
        if fail is not None:
            reason = _FAILURE_REASONS.get(fail, "InternalError")
            handler.send_json(fail, _status(fail, reason, f"injected failure (HTTP {fail})"))
            return
        if body is None:
            handler.close_connection = True
            handler.send_json(413, _status(413, "RequestEntityTooLarge", "request entity too large"))
            return

        path = split.path
        if path in ("/healthz", "/readyz", "/livez"):
            handler.send_body(200, b"ok", "text/plain; charset=utf-8")
            return
        if path == "/version":
            handler.send_json(200, {"major": "1", "minor": "30", "gitVersion": "v1.30.0-stand-in"})
            return

        if not self._authenticated(handler, peer_cert):
            handler.send_json(401, _status(401, "Unauthorized", "Unauthorized"))
            return

        params = {
            key: values[-1]
            for key, values in urllib.parse.parse_qs(split.query, keep_blank_values=True).items()
        }
        try:
            self._route(handler, path, params, body, peer_cert)
        except _ApiFailure as failure:
            handler.send_json(failure.code, failure.status())

    @staticmethod
    def _read_body(handler: _Handler) -> bytes | None:
        """The request body (empty without one); None when it is over the size limit."""
        length_text = handler.headers.get("Content-Length")
        if not length_text:
            return b""
        try:
            length = int(length_text)
        except ValueError:
            handler.close_connection = True
            return b""
        if length > MAX_BODY_BYTES:
            # Drained, so that the client gets to read the 413 answer.
            while length > 0:
                chunk = handler.rfile.read(min(length, 1 << 20))
                if not chunk:
                    break
                length -= len(chunk)
            return None
        return handler.rfile.read(length) if length > 0 else b""

    def _route(
        self,
        handler: _Handler,
        path: str,
        params: dict[str, str],
        body: bytes,
        peer_cert: dict[str, Any] | None,
    ) -> None:
        method = handler.command
        unquote = urllib.parse.unquote
        if path == "/api/v1/nodes":
            self._require(method, "GET")
            self._collection(handler, "nodes", None, params)
        elif match := _NODE_STATUS_PATH.fullmatch(path):
            self._require(method, "PATCH")
            self._patch_node(handler, unquote(match.group(1)), body, status=True)
        elif match := _NODE_PATH.fullmatch(path):
            name = unquote(match.group(1))
            if method == "GET":
                self._get_node(handler, name)
            else:
                self._require(method, "PATCH")
                self._patch_node(handler, name, body)
        elif path == "/api/v1/pods":
            self._require(method, "GET")
            self._collection(handler, "pods", None, params)
        elif match := _NS_PODS_PATH.fullmatch(path):
            namespace = unquote(match.group(1))
            self._require(method, "GET")
            self._check_namespace(namespace, "", "list", peer_cert)
            self._collection(handler, "pods", namespace, params)
        elif match := _POD_PATH.fullmatch(path):
            namespace, name = (unquote(part) for part in match.groups())
            if method == "DELETE":
                self._check_namespace(namespace, name, "delete", peer_cert)
                self._delete_pod(handler, namespace, name)
            else:
                self._require(method, "GET")
                self._get_pod(handler, namespace, name, peer_cert)
        elif match := _EVENTS_PATH.fullmatch(path):
            self._require(method, "POST")
            self._create_event(handler, unquote(match.group(1)), body)
        elif match := _BINDING_PATH.fullmatch(path):
            namespace, name = (unquote(part) for part in match.groups())
            self._require(method, "POST")
            self._check_namespace(namespace, name, "create", peer_cert)
            self._bind(handler, namespace, name, body)
        else:
            raise _ApiFailure(404, "NotFound", "the server could not find the requested resource")

    @staticmethod
    def _require(method: str, allowed: str) -> None:
        if method != allowed:
            raise _ApiFailure(405, "MethodNotAllowed", f"{method} is not supported by the stand-in")

    def _check_namespace(
        self, namespace: str, name: str, verb: str, peer_cert: dict[str, Any] | None
    ) -> None:
        with self._lock:
            forbidden = namespace in self._forbidden
        if forbidden:
            who = _peer_cn(peer_cert) or "system:serviceaccount:kube-system:rdma-cni"
            subject = f'pods "{name}"' if name else "pods"
            raise _ApiFailure(
                403,
                "Forbidden",
                f'{subject} is forbidden: User "{who}" cannot {verb} resource "pods" '
                f'in API group "" in the namespace "{namespace}"',
                {"name": name, "kind": "pods"},
            )

    def _get_pod(
        self, handler: _Handler, namespace: str, name: str, peer_cert: dict[str, Any] | None
    ) -> None:
        self._check_namespace(namespace, name, "get", peer_cert)
        with self._lock:
            stored = self._pods.get((namespace, name))
            malformed = self._malformed > 0
            if malformed:
                self._malformed -= 1
        if malformed:
            handler.send_body(200, b"<html><body>502 Bad Gateway</body></html>", "text/html")
            return
        if stored is None:
            raise _not_found("pods", name)
        meta = _media_wants_metadata(handler.headers.get("Accept"), False)
        handler.send_body(200, stored.meta() if meta else stored.full(), "application/json")

    def _get_node(self, handler: _Handler, name: str) -> None:
        meta = _media_wants_metadata(handler.headers.get("Accept"), False)
        with self._lock:
            stored = self._nodes.get(name)
        if stored is None:
            raise _not_found("nodes", name)
        handler.send_body(200, stored.meta() if meta else stored.full(), "application/json")

    @staticmethod
    def _json_body(handler: _Handler, body: bytes, accepted: tuple[str, ...]) -> Any:
        media = (handler.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if media not in accepted:
            raise _ApiFailure(
                415,
                "UnsupportedMediaType",
                "the body of the request was in an unknown format - accepted media types include: "
                + ", ".join(accepted),
            )
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _ApiFailure(400, "BadRequest", f"error decoding request body: {exc}") from None

    def _patch_node(self, handler: _Handler, name: str, body: bytes, *, status: bool = False) -> None:
        patch = self._json_body(handler, body, ("application/merge-patch+json",))
        if not isinstance(patch, dict):
            raise _ApiFailure(400, "BadRequest", "json: cannot unmarshal a merge patch that is not an object")
        with self._lock:
            stored = self._nodes.get(name)
            if stored is None:
                raise _not_found("nodes", name)
            patch_meta = patch.get("metadata")
            wanted_rv = patch_meta.get("resourceVersion") if isinstance(patch_meta, dict) else None
            current_rv = stored.metadata["resourceVersion"]
            if wanted_rv is not None and wanted_rv != current_rv:
                raise _ApiFailure(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on nodes "{name}": the object has been modified; '
                    "please apply your changes to the latest version and try again",
                    {"name": name, "kind": "nodes"},
                )
            doc = _merge_patch(stored.doc, patch)
            if status:
                # The status subresource changes the status alone (metadata and spec kept).
                doc = {**stored.doc, "status": doc.get("status", {})}
            # PATCH of the main resource cannot change status (that is the
            # status subresource's job); the server silently keeps the old one.
            elif "status" in stored.doc:
                doc["status"] = stored.doc["status"]
            else:
                doc.pop("status", None)
            self._validate_node(name, stored, doc)
            doc["metadata"]["resourceVersion"] = current_rv
            # A no-op update is not written: no new version, no event.
            result = stored if doc == stored.doc else self._store("nodes", name, doc)
        handler.send_body(200, result.full(), "application/json")

    @staticmethod
    def _validate_node(name: str, stored: _Stored, doc: Any) -> None:
        if (
            not isinstance(doc, dict)
            or doc.get("kind", "Node") != "Node"
            or doc.get("apiVersion", "v1") != "v1"
        ):
            raise _ApiFailure(400, "BadRequest", "the patch changes the object's kind or apiVersion")
        metadata = doc.get("metadata")
        _validate_metadata("Node", name, metadata)
        for immutable in ("name", "uid", "creationTimestamp"):
            if metadata.get(immutable) != stored.metadata.get(immutable):
                raise _invalid(
                    "Node",
                    name,
                    f"metadata.{immutable}",
                    "FieldValueInvalid",
                    "Invalid value: field is immutable",
                )
        if not isinstance(doc.get("spec", {}), dict):
            raise _invalid("Node", name, "spec", "FieldValueInvalid", "Invalid value: must be an object")

    def _delete_pod(self, handler: _Handler, namespace: str, name: str) -> None:
        # Deleted at once, as with gracePeriodSeconds=0; the answer is the
        # object as deleted, like the real API server's.
        with self._lock:
            gone = self._delete("pods", (namespace, name))
        if gone is None:
            raise _not_found("pods", name)
        handler.send_body(200, gone.full(), "application/json")

    def _create_event(self, handler: _Handler, namespace: str, body: bytes) -> None:
        event = self._json_body(handler, body, ("application/json",))
        if not isinstance(event, dict) or event.get("kind", "Event") != "Event":
            raise _ApiFailure(400, "BadRequest", "the request body is not an Event")
        meta = event.get("metadata") if isinstance(event.get("metadata"), dict) else {}
        involved = event.get("involvedObject") if isinstance(event.get("involvedObject"), dict) else {}
        name = meta.get("name") or ""
        if meta.get("namespace", namespace) != namespace:
            raise _invalid(
                "Event", name, "metadata.namespace", "FieldValueInvalid", "does not match the URL's"
            )
        for where, value in (("involvedObject.name", involved.get("name")), ("reason", event.get("reason"))):
            if not isinstance(value, str) or not value:
                raise _invalid("Event", name, where, "FieldValueRequired", "Required value")
        with self._lock:
            self.events_held += 1
        try:
            self._hold_events.wait(60)
        finally:
            with self._lock:
                self.events_held -= 1
        with self._lock:
            doc = _copy(event)
            doc["metadata"] = {**meta, "namespace": namespace}
            if not name:
                doc["metadata"]["name"] = f"{meta.get('generateName') or 'event.'}{secrets.token_hex(5)}"
            self._events.append(doc)
        handler.send_json(201, doc)

    def _bind(self, handler: _Handler, namespace: str, name: str, body: bytes) -> None:
        binding = self._json_body(handler, body, ("application/json",))
        if not isinstance(binding, dict) or binding.get("kind", "Binding") != "Binding":
            raise _ApiFailure(400, "BadRequest", "the request body is not a Binding")
        metadata = binding.get("metadata") or {}
        if not isinstance(metadata, dict) or metadata.get("name", name) not in (name, ""):
            raise _ApiFailure(400, "BadRequest", "name in URL does not match name in Binding object")
        target = binding.get("target")
        node = target.get("name") if isinstance(target, dict) else None
        if not isinstance(node, str) or not node:
            raise _invalid("Binding", name, "target.name", "FieldValueRequired", "Required value")
        if target.get("kind", "Node") not in ("Node", ""):
            raise _invalid(
                "Binding", name, "target.kind", "FieldValueNotSupported", 'Unsupported value: must be "Node"'
            )
        with self._lock:
            stored = self._pods.get((namespace, name))
            if stored is None:
                raise _not_found("pods", name)
            conflict = f'Operation cannot be fulfilled on pods/binding "{name}": '
            uid = metadata.get("uid")
            if uid and uid != stored.metadata.get("uid"):
                raise _ApiFailure(
                    409,
                    "Conflict",
                    conflict + f"Precondition failed: UID in precondition: {uid}, "
                    f"UID in object meta: {stored.metadata.get('uid')}",
                    {"name": name, "kind": "pods/binding"},
                )
            bound_to = stored.doc.get("spec", {}).get("nodeName")
            if bound_to:
                raise _ApiFailure(
                    409,
                    "Conflict",
                    conflict + f'pod {name} is already assigned to node "{bound_to}"',
                    {"name": name, "kind": "pods/binding"},
                )
            doc = _copy(stored.doc)
            doc["spec"]["nodeName"] = node
            status = doc.setdefault("status", {})
            conditions = [c for c in status.get("conditions", []) if c.get("type") != "PodScheduled"]
            conditions.append(
                {
                    "type": "PodScheduled",
                    "status": "True",
                    "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
            )
            status["conditions"] = conditions
            self._store("pods", (namespace, name), doc)
            late = self._late_bindings
            wake = self._wake
        if late:
            wake.wait(late)
        handler.send_json(
            201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
        )

    # -- LIST and WATCH

    def _collection(
        self, handler: _Handler, resource: str, namespace: str | None, params: dict[str, str]
    ) -> None:
        if params.get("watch") in ("1", "true"):
            self._watch(handler, resource, namespace, params)
        else:
            self._list(handler, resource, namespace, params)

    def _objects(self, resource: str, namespace: str | None, after: Any = None) -> list[tuple[Any, _Stored]]:
        """The stored objects of ``resource`` (caller holds the lock), in key order."""
        table: dict[Any, _Stored] = getattr(self, f"_{resource}")
        items = sorted(table.items(), key=lambda kv: kv[0])
        if namespace is not None:
            items = [kv for kv in items if kv[0][0] == namespace]
        if after is not None:
            items = [kv for kv in items if kv[0] > after]
        return items

    def _list(self, handler: _Handler, resource: str, namespace: str | None, params: dict[str, str]) -> None:
        meta = _media_wants_metadata(handler.headers.get("Accept"), True)
        matches = _selector(resource, params)
        limit = _int_param(params, "limit", 0)
        after: Any = None
        token = params.get("continue")
        with self._lock:
            rv = self._rv
            if token:
                list_rv, after = _decode_continue(token, resource)
                if list_rv < self._oldest_rv:
                    raise _ApiFailure(
                        410,
                        "Expired",
                        "The provided continue parameter is too old to display a consistent list result. "
                        "You can start a new list without the continue parameter.",
                    )
            candidates = self._objects(resource, namespace, after)
        selected = [kv for kv in candidates if matches(kv[1].doc)]
        list_meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if limit and len(selected) > limit:
            list_meta["continue"] = _encode_continue(rv, selected[limit - 1][0])
            list_meta["remainingItemCount"] = len(selected) - limit
            selected = selected[:limit]
        if meta:
            head = {"kind": "PartialObjectMetadataList", "apiVersion": _META_API}
            items = [stored.meta() for _, stored in selected]
        else:
            head = {"kind": _KINDS[resource][1], "apiVersion": "v1"}
            items = [stored.item() for _, stored in selected]
        prefix = _compact_json({**head, "metadata": list_meta})[:-1]
        handler.send_body(200, prefix + b',"items":[' + b",".join(items) + b"]}", "application/json")

    def _watch(self, handler: _Handler, resource: str, namespace: str | None, params: dict[str, str]) -> None:
        meta = _media_wants_metadata(handler.headers.get("Accept"), None)
        matches = _selector(resource, params)
        timeout = min(_int_param(params, "timeoutSeconds", DEFAULT_WATCH_SECONDS), 2 * DEFAULT_WATCH_SECONDS)
        bookmarks = params.get("allowWatchBookmarks") in ("1", "true")
        since = params.get("resourceVersion", "")
        if since not in ("", "0") and not since.isdigit():
            raise _ApiFailure(400, "BadRequest", f'invalid resource version "{since}"')

        def visible(stored: _Stored | None) -> bool:
            if stored is None:
                return False
            if namespace is not None and stored.metadata.get("namespace") != namespace:
                return False
            return matches(stored.doc)

        def event_line(kind: str, stored: _Stored) -> bytes:
            return b'{"type":"%s","object":%s}\n' % (kind.encode(), stored.meta() if meta else stored.full())

        def bookmark_line(rv: int) -> bytes:
            kind, api = (_META_KIND, _META_API) if meta else (_KINDS[resource][0], "v1")
            obj = {"kind": kind, "apiVersion": api, "metadata": {"resourceVersion": str(rv)}}
            return _compact_json({"type": "BOOKMARK", "object": obj}) + b"\n"

        with self._lock:
            epoch = self._watch_epoch
            bookmark_epoch = self._bookmark_epoch
            if since in ("", "0"):
                # "Start at most recent": synthetic ADDED events for what exists now.
                initial = [stored for _, stored in self._objects(resource, namespace)]
                position = self._rv
            else:
                initial = []
                position = int(since)
            self._watching += 1
        try:
            handler.start_stream()
            lines = [event_line("ADDED", stored) for stored in initial if visible(stored)]
            for start in range(0, len(lines), 256):
                handler.send_chunk(b"".join(lines[start : start + 256]))
            deadline = time.monotonic() + timeout
            next_bookmark = time.monotonic() + self.bookmark_interval
            while True:
                with self._lock:
                    while True:
                        if self._watch_epoch != epoch:
                            handler.close_connection = True  # cut: no end-of-stream chunk
                            return
                        if position < self._oldest_rv:
                            expired = _status(
                                410, "Expired", f"too old resource version: {position} ({self._oldest_rv})"
                            )
                            handler.send_chunk(_compact_json({"type": "ERROR", "object": expired}) + b"\n")
                            handler.send_chunk(b"")
                            return
                        start = bisect.bisect_right(self._history_rvs, position)
                        events = self._history[start:]
                        now = time.monotonic()
                        forced = self._bookmark_epoch != bookmark_epoch
                        if events or forced or now >= deadline or (bookmarks and now >= next_bookmark):
                            break
                        wait_until = min(deadline, next_bookmark) if bookmarks else deadline
                        self._changed.wait(max(0.0, wait_until - now))
                    current = self._rv
                    bookmark_epoch = self._bookmark_epoch
                out: list[bytes] = []
                for event in events:
                    if event.resource != resource:
                        continue
                    now_visible = event.type != "DELETED" and visible(event.obj)
                    was_visible = visible(event.prev)
                    if event.type == "DELETED":
                        if was_visible:
                            out.append(event_line("DELETED", event.obj))
                    elif now_visible:
                        out.append(event_line("MODIFIED" if was_visible else "ADDED", event.obj))
                    elif was_visible:
                        # Left the selection: watchers see it go.
                        out.append(event_line("DELETED", event.obj))
                position = current
                if bookmarks and (forced or time.monotonic() >= next_bookmark):
                    out.append(bookmark_line(position))
                    next_bookmark = time.monotonic() + self.bookmark_interval
                if out:
                    handler.send_chunk(b"".join(out))
                if time.monotonic() >= deadline:
                    handler.send_chunk(b"")
                    return
        except OSError:
            handler.close_connection = True  # the client went away
        finally:
            with self._lock:
                self._watching -= 1

    def _authenticated(self, handler: _Handler, peer_cert: dict[str, Any] | None) -> bool:
        # CERT_OPTIONAL: a certificate the CA did not sign fails the handshake,
        # so any certificate that reaches this point is a valid one.
        if peer_cert:
            return True
        header = handler.headers.get("Authorization") or ""
        return hmac.compare_digest(header.encode(), f"Bearer {self.token}".encode())


_FAILURE_REASONS = {
    409: "Conflict",
    410: "Expired",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def _int_param(params: dict[str, str], name: str, default: int) -> int:
    text = params.get(name)
    if text is None or text == "":
        return default
    if not text.isdigit():
        raise _ApiFailure(400, "BadRequest", f'invalid {name} "{text}": must be a non-negative integer')
    return int(text)


def _encode_continue(rv: int, key: Any) -> str:
    raw = json.dumps({"rv": rv, "start": list(key) if isinstance(key, tuple) else key})
    return base64.urlsafe_b64encode(raw.encode()).decode("ascii")


def _decode_continue(token: str, resource: str) -> tuple[int, Any]:
    try:
        doc = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
        rv = int(doc["rv"])
        start = doc["start"]
        key = tuple(start) if resource == "pods" else str(start)
    except (ValueError, KeyError, TypeError, UnicodeError):
        raise _ApiFailure(400, "BadRequest", "continue key is not valid") from None
    return rv, key


# --------------------------------------------------------------------------
# Script entry point


def _load_pods(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        pods = json.load(f)
    if not isinstance(pods, list):
        raise SystemExit(f"{path}: expected a JSON list of pods")
    for i, pod in enumerate(pods):
        if not isinstance(pod, dict) or not pod.get("namespace") or not pod.get("name"):
            raise SystemExit(f"{path}: entry {i} needs 'namespace' and 'name'")
    return pods


def _load_nodes(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        nodes = json.load(f)
    if not isinstance(nodes, list):
        raise SystemExit(f"{path}: expected a JSON list of nodes")
    for i, node in enumerate(nodes):
        if not isinstance(node, dict) or not node.get("name"):
            raise SystemExit(f"{path}: entry {i} needs 'name'")
        if not isinstance(node.get("images", 0), int):
            raise SystemExit(f"{path}: entry {i}: 'images' is a count")
    return nodes


def main(argv: list[str] | None = None) -> int:
    """Run the stand-in until SIGTERM or SIGINT (see the module docstring)."""
    parser = argparse.ArgumentParser(description="HTTPS Kubernetes API stand-in for rdma-cni tests")
    parser.add_argument("--dir", required=True, help="where to write certificates and the kubeconfig")
    parser.add_argument("--port", type=int, default=0, help="TCP port (0: pick a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--pods", help="JSON list of pods to serve")
    parser.add_argument("--nodes", help="JSON list of nodes to serve")
    parser.add_argument("--token", help="bearer token to accept (default: random)")
    args = parser.parse_args(argv)

    pods = _load_pods(args.pods) if args.pods else []
    nodes = _load_nodes(args.nodes) if args.nodes else []
    api = ApiServer(args.dir, token=args.token, host=args.host, port=args.port)
    for pod in pods:
        api.add_pod(
            pod["namespace"],
            pod["name"],
            pod.get("annotations") or {},
            uid=pod.get("uid"),
            node_name=pod.get("nodeName", "node-1"),
            scheduler_name=pod.get("schedulerName", "default-scheduler"),
        )

    for node in nodes:
        api.add_node(
            node["name"],
            labels=node.get("labels"),
            annotations=node.get("annotations"),
            images=node.get("images", 0),
        )

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    api.start()
    try:
        api.write_kubeconfig(os.path.join(api.directory, "kubeconfig"), mode="token", ca="file")
        token_path = os.path.join(api.directory, "token")
        with open(token_path, "w", encoding="ascii") as f:
            f.write(api.token + "\n")
        print(f"ready {api.url}", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        api.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
