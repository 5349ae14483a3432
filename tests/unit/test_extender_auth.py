"""Only kube-scheduler can call the extender (issue 21, finding 1).

The extender holds cluster-wide ``pods/binding``. It serves either on loopback
(kube-scheduler's sidecar) or with client certificates signed by a CA it is
given; any other listener is refused before it is bound. Real HTTPS here: a
client without a certificate, or with one from another CA, gets no answer.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdma_cni.extender.decide import Decider
from rdma_cni.extender.demand import Demands
from rdma_cni.extender.listener import UnauthenticatedListener, check_listener, is_loopback
from rdma_cni.extender.reservations import Reservations
from rdma_cni.extender.server import ExtenderServer
from rdma_cni.extender.verbs import Extender
from tests.support.apiserver import make_ca, make_cert


def _extender() -> Extender:
    ext = Extender(
        decider=Decider(),
        demands=Demands(annotation="rdma_interfaces_required"),
        reservations=Reservations(60),
    )
    ext.ready.set()
    return ext


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("127.255.255.254", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("", False),
        ("::", False),
        ("10.0.0.1", False),
        ("203.0.113.1", False),
        ("::ffff:10.0.0.1", False),
        ("fe80::1%eth0", False),
        ("128.0.0.1", False),
        ("localhost", False),  # a name: judged by the address it binds, not by its spelling
    ],
)
def test_what_counts_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def _server_context(directory: Path, ca: tuple[str, str] | None, verify: int) -> ssl.SSLContext:
    server_ca = make_ca(str(directory), "server-ca", "extender serving CA")
    crt, key = make_cert(str(directory), server_ca, "server", "/CN=localhost", client=False)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(crt, key)
    if ca is not None:
        tls.load_verify_locations(cafile=ca[0])
    tls.verify_mode = verify
    return tls


@pytest.mark.parametrize("host", ["0.0.0.0", "", "10.0.0.1", "203.0.113.1", "::"])
def test_a_network_listener_without_client_certificates_is_refused_before_binding(
    host: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound: list[object] = []
    monkeypatch.setattr(ExtenderServer, "server_bind", lambda self: bound.append(self))
    with pytest.raises(UnauthenticatedListener, match="without client authentication"):
        ExtenderServer((host, 0), _extender())
    # TLS that does not ask who calls is no better than plain HTTP.
    tls = _server_context(tmp_path, None, ssl.CERT_NONE)
    with pytest.raises(UnauthenticatedListener, match="--client-ca"):
        ExtenderServer((host, 0), _extender(), tls)
    optional = _server_context(tmp_path, make_ca(str(tmp_path), "ca"), ssl.CERT_OPTIONAL)
    with pytest.raises(UnauthenticatedListener):
        ExtenderServer((host, 0), _extender(), optional)
    assert bound == []


def test_a_host_name_is_judged_by_the_address_it_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    server = ExtenderServer(("localhost", 0), _extender())  # resolves to 127.0.0.1
    server.server_close()
    closed: list[bool] = []
    real_close = ExtenderServer.server_close
    monkeypatch.setattr(ExtenderServer, "server_close", lambda self: closed.append(True) or real_close(self))
    monkeypatch.setattr(
        ExtenderServer, "server_bind", lambda self: setattr(self, "server_address", ("10.1.2.3", 8888))
    )
    with pytest.raises(UnauthenticatedListener, match=r"10\.1\.2\.3"):
        ExtenderServer(("scheduler.example", 8888), _extender())
    assert closed == [True]  # the socket bound is closed again


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost"])
def test_loopback_is_served_without_certificates(host: str) -> None:
    server = ExtenderServer((host, 0), _extender())
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        conn = http.client.HTTPConnection(str(server.server_address[0]), server.server_address[1], timeout=10)
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        server.shutdown()
        server.server_close()


def test_ipv6_loopback_is_served() -> None:
    try:
        server = ExtenderServer(("::1", 0), _extender())
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        conn = http.client.HTTPConnection("::1", server.server_address[1], timeout=10)
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        server.shutdown()
        server.server_close()


def test_check_listener_accepts_client_certificates_anywhere(tmp_path: Path) -> None:
    tls = _server_context(tmp_path, make_ca(str(tmp_path), "ca"), ssl.CERT_REQUIRED)
    check_listener("0.0.0.0", tls)
    check_listener("10.0.0.1", tls)
    check_listener("127.0.0.1", None)
    with pytest.raises(UnauthenticatedListener):
        check_listener("0.0.0.0", None)


# -- mutual TLS over a real listener on 0.0.0.0


class Pki:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = make_ca(str(root), "client-ca", "kube-scheduler client CA")
        self.other_ca = make_ca(str(root), "other-ca", "someone else's CA")
        self.server_ca = make_ca(str(root), "server-ca", "extender serving CA")
        self.server = make_cert(str(root), self.server_ca, "server", "/CN=localhost", client=False)
        self.scheduler = make_cert(
            str(root), self.ca, "scheduler", "/CN=rdma-cni-kube-scheduler", client=True
        )
        self.kubelet = make_cert(str(root), self.ca, "kubelet", "/CN=system:node:n1", client=True)
        self.forged = make_cert(
            str(root), self.other_ca, "forged", "/CN=rdma-cni-kube-scheduler", client=True
        )

    def server_context(self) -> ssl.SSLContext:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(*self.server)
        tls.load_verify_locations(cafile=self.ca[0])
        tls.verify_mode = ssl.CERT_REQUIRED
        return tls

    def client_context(self, cert: tuple[str, str] | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.server_ca[0])
        if cert is not None:
            ctx.load_cert_chain(*cert)
        return ctx


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(params=[frozenset(), frozenset({"rdma-cni-kube-scheduler"})], ids=["any-name", "client-name"])
def mtls(pki: Pki, request: pytest.FixtureRequest) -> Iterator[tuple[ExtenderServer, int]]:
    server = ExtenderServer(("0.0.0.0", 0), _extender(), pki.server_context(), request.param)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _bind(pki: Pki, port: int, cert: tuple[str, str] | None) -> tuple[int, bytes]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=pki.client_context(cert))
    try:
        body = json.dumps({"PodName": "p", "PodNamespace": "team-a", "PodUID": "u", "Node": "n1"})
        conn.request("POST", "/bind", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_mtls_serves_kube_schedulers_certificate(pki: Pki, mtls: tuple[ExtenderServer, int]) -> None:
    status, body = _bind(pki, mtls[1], pki.scheduler)
    assert status == 200 and "Error" in json.loads(body)


@pytest.mark.parametrize("who", ["no certificate", "another CA"])
def test_mtls_refuses_a_client_without_a_certificate_of_the_ca(
    pki: Pki, mtls: tuple[ExtenderServer, int], who: str
) -> None:
    cert = None if who == "no certificate" else pki.forged
    # TLS 1.3: the client's handshake may end before the server checks its certificate, so
    # the refusal can come on the first read; either way no request is ever answered.
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
        _bind(pki, mtls[1], cert)
    # A raw socket that sends a request and no handshake gets no HTTP answer either.
    with socket.create_connection(("127.0.0.1", mtls[1]), timeout=10) as raw:
        raw.sendall(b"POST /bind HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        try:
            answer = raw.recv(100)
        except ConnectionError:
            answer = b""
        assert not answer.startswith(b"HTTP/")
    assert _bind(pki, mtls[1], pki.scheduler)[0] == 200  # and the server goes on


def test_client_name_restricts_certificates_of_the_same_ca(
    pki: Pki, mtls: tuple[ExtenderServer, int]
) -> None:
    server, port = mtls
    if not server.client_names:
        assert _bind(pki, port, pki.kubelet)[0] == 200  # any certificate of the CA, without --client-name
        return
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
        _bind(pki, port, pki.kubelet)
    assert _bind(pki, port, pki.scheduler)[0] == 200


def test_client_names_without_client_certificates_are_refused() -> None:
    with pytest.raises(UnauthenticatedListener, match="--client-ca"):
        ExtenderServer(("127.0.0.1", 0), _extender(), None, frozenset({"kube-scheduler"}))


def test_the_probe_listener_serves_probes_on_any_address_and_no_verb() -> None:
    ext = _extender()
    ext.ready.clear()
    server = ExtenderServer(("0.0.0.0", 0), ext, probes_only=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:

        def ask(method: str, path: str, body: bytes | None = None) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
            try:
                conn.request(method, path, body=body)
                return conn.getresponse().status
            finally:
                conn.close()

        assert ask("GET", "/healthz") == 200
        assert ask("GET", "/readyz") == 503
        ext.ready.set()
        assert ask("GET", "/readyz") == 200
        for verb in ("/filter", "/prioritize", "/preempt", "/bind"):
            assert ask("POST", verb, b"{}") == 404
    finally:
        server.shutdown()
        server.server_close()
