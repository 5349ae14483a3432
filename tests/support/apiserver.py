"""A small HTTPS stand-in for the Kubernetes API server, for tests.

It serves just what rdma-cni reads: ``GET /api/v1/namespaces/{ns}/pods/{name}``
(plus unauthenticated ``/healthz``, ``/readyz``, ``/livez`` and ``/version``),
over real TLS with a certificate authority it generates itself, and with bearer
token or client certificate authentication. Switches let tests make it fail
(5xx), hang, answer garbage or refuse a namespace.

Standard library only, plus the ``openssl`` command-line tool to generate the
certificates, so that it also runs inside a minimal test VM.

Use from Python::

    with ApiServer() as api:
        api.add_pod("default", "web-0", {"example.com/key": "value"})
        kubeconfig = api.write_kubeconfig(tmp / "kubeconfig", mode="client-cert-data")

Use as a script::

    python3 tests/support/apiserver.py --dir DIR [--port PORT] [--host ADDR]
                                       [--pods PODS.json] [--token TOKEN]

The script generates its certificates in DIR (``ca.crt``, ``server.crt``,
``client.crt`` and their keys), starts serving, writes ``DIR/kubeconfig`` (JSON,
bearer token, CA by file) and ``DIR/token``, prints ``ready <url>`` on stdout
and serves until SIGTERM or SIGINT. ``--port 0`` (the default) picks a free
port; read it from the ``ready`` line or the kubeconfig. PODS.json is a JSON
list of objects with ``namespace`` and ``name`` and optionally
``annotations`` (a string-to-string mapping), ``uid`` and ``nodeName``.
"""

from __future__ import annotations

import argparse
import base64
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
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["ApiServer", "SeenRequest", "make_ca"]

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

    def do_GET(self) -> None:
        self.server.api._handle(self)

    def _not_allowed(self) -> None:
        # The request body is never read, so the connection cannot be reused.
        self.close_connection = True
        self.server.api._handle(self)

    do_POST = do_PUT = do_PATCH = do_DELETE = _not_allowed

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
# The server


class ApiServer:
    """An HTTPS Kubernetes API stand-in serving pods from memory.

    ``directory`` holds the generated certificates; without one a temporary
    directory is made and removed by :meth:`stop`. Bearer ``token`` defaults
    to a random string. Requests authenticate with that token or with a client
    certificate signed by this server's CA (:attr:`client_cert_path`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        token: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self._own_dir = directory is None
        self.directory = os.path.abspath(
            tempfile.mkdtemp(prefix="apiserver-") if directory is None else os.fspath(directory)
        )
        self.token = token if token is not None else secrets.token_urlsafe(32)
        self.host = host
        self._requested_port = port
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._forbidden: set[str] = set()
        self._fail: list[int] = []
        self._malformed = 0
        self._hang = 0.0
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
        """Stop serving, release hanging requests and remove a temporary directory."""
        if self._httpd is not None:
            self._wake.set()
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

    def add_pod(
        self,
        namespace: str,
        name: str,
        annotations: dict[str, str] | None = None,
        *,
        uid: str | None = None,
        node_name: str = "node-1",
    ) -> dict[str, Any]:
        """Add (or replace) a pod; returns the Pod object that will be served."""
        metadata: dict[str, Any] = {
            "name": name,
            "namespace": namespace,
            "uid": uid or str(uuid.uuid4()),
            "resourceVersion": str(secrets.randbelow(10**6) + 1),
            "creationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "labels": {"app": name},
        }
        # Like the real API server, an empty map is left out entirely.
        if annotations:
            metadata["annotations"] = dict(annotations)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": metadata,
            "spec": {
                "nodeName": node_name,
                "restartPolicy": "Always",
                "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.9"}],
            },
            "status": {"phase": "Pending", "qosClass": "BestEffort"},
        }
        with self._lock:
            self._pods[(namespace, name)] = pod
        return json.loads(json.dumps(pod))

    def remove_pod(self, namespace: str, name: str) -> None:
        """Forget a pod; later GETs answer 404."""
        with self._lock:
            self._pods.pop((namespace, name), None)

    def forbid_namespace(self, namespace: str) -> None:
        """Answer 403 Forbidden to authenticated reads of pods in ``namespace``."""
        with self._lock:
            self._forbidden.add(namespace)

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

    def reset(self) -> None:
        """Clear the fault switches, forbidden namespaces and request records (pods stay)."""
        with self._lock:
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
        with self._lock:
            self._seen.append(
                SeenRequest(
                    method=handler.command,
                    path=handler.path,
                    authorization=handler.headers.get("Authorization"),
                    client_cert_cn=_peer_cn(peer_cert),
                    user_agent=handler.headers.get("User-Agent"),
                    accept=handler.headers.get("Accept"),
                )
            )
            hang = self._hang
            wake = self._wake
            fail = self._fail.pop(0) if self._fail else None

        if hang:
            wake.wait(hang)
        if fail is not None:
            reason = "ServiceUnavailable" if fail == 503 else "InternalError"
            handler.send_json(fail, _status(fail, reason, f"injected failure (HTTP {fail})"))
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

        match = _POD_PATH.fullmatch(path)
        if match is None:
            handler.send_json(
                404, _status(404, "NotFound", "the server could not find the requested resource")
            )
            return
        if handler.command != "GET":
            handler.send_json(
                405, _status(405, "MethodNotAllowed", f"{handler.command} is not supported by the stand-in")
            )
            return
        namespace, name = (urllib.parse.unquote(part) for part in match.groups())
        with self._lock:
            pod = self._pods.get((namespace, name))
            forbidden = namespace in self._forbidden
            malformed = self._malformed > 0
            if malformed:
                self._malformed -= 1
        if forbidden:
            who = _peer_cn(peer_cert) or "system:serviceaccount:kube-system:rdma-cni"
            handler.send_json(
                403,
                _status(
                    403,
                    "Forbidden",
                    f'pods "{name}" is forbidden: User "{who}" cannot get resource "pods" '
                    f'in API group "" in the namespace "{namespace}"',
                    {"name": name, "kind": "pods"},
                ),
            )
            return
        if malformed:
            handler.send_body(200, b"<html><body>502 Bad Gateway</body></html>", "text/html")
            return
        if pod is None:
            handler.send_json(
                404, _status(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
            )
            return
        handler.send_json(200, pod)

    def _authenticated(self, handler: _Handler, peer_cert: dict[str, Any] | None) -> bool:
        # CERT_OPTIONAL: a certificate the CA did not sign fails the handshake,
        # so any certificate that reaches this point is a valid one.
        if peer_cert:
            return True
        header = handler.headers.get("Authorization") or ""
        return hmac.compare_digest(header.encode(), f"Bearer {self.token}".encode())


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


def main(argv: list[str] | None = None) -> int:
    """Run the stand-in until SIGTERM or SIGINT (see the module docstring)."""
    parser = argparse.ArgumentParser(description="HTTPS Kubernetes API stand-in for rdma-cni tests")
    parser.add_argument("--dir", required=True, help="where to write certificates and the kubeconfig")
    parser.add_argument("--port", type=int, default=0, help="TCP port (0: pick a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--pods", help="JSON list of pods to serve")
    parser.add_argument("--token", help="bearer token to accept (default: random)")
    args = parser.parse_args(argv)

    pods = _load_pods(args.pods) if args.pods else []
    api = ApiServer(args.dir, token=args.token, host=args.host, port=args.port)
    for pod in pods:
        api.add_pod(
            pod["namespace"],
            pod["name"],
            pod.get("annotations") or {},
            uid=pod.get("uid"),
            node_name=pod.get("nodeName", "node-1"),
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
