"""rdma_cni.kube.client against the real HTTPS API stand-in: verbs, watches, every error type, redaction."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rdma_cni import __version__
from rdma_cni.cni.errors import InvalidConfig
from rdma_cni.kube import client as kubeapi
from rdma_cni.kube import credentials, pool
from rdma_cni.kube.client import ApiClient, ApiError, Conflict, Gone, Invalid, NotFound, Unavailable

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.support.apiserver import ApiServer, make_ca  # noqa: E402

STATE = "rdma-cni.io/node-state"


@pytest.fixture(scope="module")
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        yield server


@pytest.fixture(autouse=True)
def _clean_server(api: ApiServer) -> Iterator[None]:
    api.reset()
    api.bookmark_interval = 60.0
    yield
    api.drop_watches()
    api.reset()


@pytest.fixture
def client(api: ApiServer, tmp_path: Path) -> Iterator[ApiClient]:
    with ApiClient.from_kubeconfig(api.write_kubeconfig(tmp_path / "kubeconfig"), timeout=3.0) as c:
        yield c


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _collect(
    events: Iterator[dict[str, Any]], into: list[dict[str, Any]], errors: list[BaseException]
) -> None:
    try:
        for event in events:
            into.append(event)
    except ApiError as exc:
        errors.append(exc)


def _wait(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert predicate()


# -- verbs


def test_get_sends_token_and_user_agent(api: ApiServer, client: ApiClient) -> None:
    api.add_node("node-a", images=3)
    node = client.get("/api/v1/nodes/node-a")
    assert node["metadata"]["name"] == "node-a" and len(node["status"]["images"]) == 3
    seen = api.requests_seen[-1]
    assert seen.authorization == f"Bearer {api.token}"
    assert seen.user_agent == f"rdma-cni/{__version__}"
    assert seen.accept == "application/json"


def test_one_keep_alive_connection_for_many_requests(api: ApiServer, client: ApiClient) -> None:
    api.add_node("node-a")
    api.reset()
    for _ in range(5):
        client.get("/api/v1/nodes/node-a")
    assert len({seen.client_port for seen in api.requests_seen}) == 1


def test_list_full_and_metadata_only(api: ApiServer, client: ApiClient) -> None:
    api.add_node("node-a", annotations={STATE: "{}"}, images=2)
    api.add_node("node-b")
    full = client.list("/api/v1/nodes")
    assert full["kind"] == "NodeList" and len(full["items"]) == 2
    meta = client.list("/api/v1/nodes", metadata_only=True)
    assert api.requests_seen[-1].accept == kubeapi.METADATA_LIST_ACCEPT
    assert meta["kind"] == "PartialObjectMetadataList"
    assert meta["items"][0]["metadata"]["annotations"][STATE] == "{}"
    assert meta["metadata"]["resourceVersion"] == str(api.resource_version)
    page = client.list("/api/v1/nodes", {"limit": 1}, metadata_only=True)
    assert len(page["items"]) == 1 and page["metadata"]["continue"]


def test_patch_strategic_says_its_patch_type(api: ApiServer, client: ApiClient) -> None:
    # The stand-in merges JSON merge patches only: what is checked is the type the client names.
    api.add_node("node-a")
    with pytest.raises(kubeapi.ApiError) as info:
        client.patch_strategic("/api/v1/nodes/node-a", {"metadata": {"annotations": {STATE: "{}"}}})
    assert api.requests_seen[-1].content_type == "application/strategic-merge-patch+json"
    assert info.value.status == 415


def test_patch_merge_and_post_binding(api: ApiServer, client: ApiClient) -> None:
    api.add_node("node-a")
    node = client.patch_merge("/api/v1/nodes/node-a", {"metadata": {"annotations": {STATE: '{"v":1}'}}})
    assert node["metadata"]["annotations"][STATE] == '{"v":1}'
    assert api.requests_seen[-1].content_type == "application/merge-patch+json"
    pod = api.add_pod("ns", "p", node_name=None)
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "p", "uid": pod["metadata"]["uid"]},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "node-a"},
    }
    status = client.post("/api/v1/namespaces/ns/pods/p/binding", binding)
    assert status["status"] == "Success" and status["code"] == 201
    assert api.get_pod("ns", "p")["spec"]["nodeName"] == "node-a"


def test_client_certificate_data_files_live_until_close(api: ApiServer, tmp_path: Path) -> None:
    api.add_node("node-a")
    client = ApiClient.from_kubeconfig(
        api.write_kubeconfig(tmp_path / "kc", mode="client-cert-data", ca="data")
    )
    client.get("/api/v1/nodes/node-a")
    assert api.requests_seen[-1].client_cert_cn == "rdma-cni-test-client"
    verify = client._open().verify
    assert os.path.isfile(verify) and (os.stat(verify).st_mode & 0o777) == 0o600
    client.close()
    assert not os.path.exists(verify)
    # A closed client reopens on use.
    assert client.get("/api/v1/nodes/node-a")["metadata"]["name"] == "node-a"
    client.close()


def test_in_cluster_service_account(api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text(api.token + "\n")
    (sa / "ca.crt").write_bytes(Path(api.ca_path).read_bytes())
    monkeypatch.setenv(credentials.SERVICEACCOUNT_DIR_ENV, str(sa))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
    api.add_node("node-a")
    with ApiClient.from_kubeconfig(None) as c:
        assert c.get("/api/v1/nodes/node-a")["metadata"]["name"] == "node-a"


def test_bad_kubeconfig_is_invalid_config(tmp_path: Path) -> None:
    (tmp_path / "kc").write_text("{}")
    with pytest.raises(InvalidConfig, match="current-context"):
        ApiClient.from_kubeconfig(str(tmp_path / "kc"))


def test_concurrent_use_from_threads(api: ApiServer, client: ApiClient) -> None:
    for i in range(8):
        api.add_node(f"node-{i}")
    results: list[str] = []
    failures: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(10):
                results.append(client.get(f"/api/v1/nodes/node-{i}")["metadata"]["name"])
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    assert sorted(results) == sorted(f"node-{i}" for i in range(8) for _ in range(10))


def test_path_must_be_absolute(client: ApiClient) -> None:
    with pytest.raises(ValueError, match="must start with '/'"):
        client.get("api/v1/nodes")


# -- errors, typed by status


def test_not_found(client: ApiClient) -> None:
    with pytest.raises(NotFound) as info:
        client.get("/api/v1/nodes/missing")
    assert info.value.status == 404 and info.value.reason == "NotFound"
    assert info.value.message == 'GET /api/v1/nodes/missing: HTTP 404 NotFound: nodes "missing" not found'


def test_conflict_on_stale_resource_version(api: ApiServer, client: ApiClient) -> None:
    rv = api.add_node("node-a")["metadata"]["resourceVersion"]
    api.set_node_annotations("node-a", {"other": "writer"})
    with pytest.raises(Conflict) as info:
        client.patch_merge(
            "/api/v1/nodes/node-a", {"metadata": {"resourceVersion": rv, "annotations": {"a": "b"}}}
        )
    assert info.value.status == 409 and "the object has been modified" in info.value.message


def test_invalid_patch_is_invalid(api: ApiServer, client: ApiClient) -> None:
    api.add_node("node-a")
    with pytest.raises(Invalid) as info:
        client.patch_merge("/api/v1/nodes/node-a", {"metadata": {"annotations": {STATE: "x" * 300_000}}})
    assert info.value.status == 422 and "Too long" in info.value.message


def test_gone_on_expired_continue_token(api: ApiServer, client: ApiClient) -> None:
    api.add_node("node-a")
    api.add_node("node-b")
    token = client.list("/api/v1/nodes", {"limit": 1})["metadata"]["continue"]
    api.add_node("node-c")
    api.compact()
    with pytest.raises(Gone) as info:
        client.list("/api/v1/nodes", {"limit": 1, "continue": token})
    assert info.value.status == 410 and info.value.reason == "Expired"


@pytest.mark.parametrize("status", [429, 500, 503, 504])
def test_overload_and_server_errors_are_unavailable(api: ApiServer, client: ApiClient, status: int) -> None:
    api.fail_next(1, status=status)
    with pytest.raises(Unavailable) as info:
        client.list("/api/v1/nodes")
    assert info.value.status == status
    assert client.list("/api/v1/nodes")["kind"] == "NodeList"  # no retry inside: the next call works


def test_connection_refused_is_unavailable_with_status_0(tmp_path: Path) -> None:
    creds = credentials.ClusterCredentials(
        server=f"https://127.0.0.1:{_closed_port()}", source="test", token="t"
    )
    with ApiClient(creds, timeout=1.0) as c, pytest.raises(Unavailable) as info:
        c.get("/api/v1/nodes")
    assert info.value.status == 0 and info.value.reason == "NoAnswer"


def test_hanging_server_times_out_as_unavailable(api: ApiServer, tmp_path: Path) -> None:
    api.add_node("node-a")
    api.hang(10)
    with ApiClient.from_kubeconfig(api.write_kubeconfig(tmp_path / "kc"), timeout=0.5) as c:
        start = time.monotonic()
        with pytest.raises(Unavailable) as info:
            c.get("/api/v1/nodes/node-a")
        assert time.monotonic() - start < 3
    assert info.value.status == 0


@pytest.mark.parametrize(
    ("action", "status", "reason"),
    [
        ("bad-selector", 400, "BadRequest"),
        ("wrong-token", 401, "Unauthorized"),
        ("forbidden", 403, "Forbidden"),
        ("method", 405, "MethodNotAllowed"),
    ],
)
def test_other_refusals_are_plain_api_errors(
    api: ApiServer, tmp_path: Path, action: str, status: int, reason: str
) -> None:
    token = "wrong-token-value" if action == "wrong-token" else None
    kubeconfig = api.write_kubeconfig(tmp_path / "kc", token=token)
    with ApiClient.from_kubeconfig(kubeconfig) as c, pytest.raises(ApiError) as info:
        if action == "bad-selector":
            c.list("/api/v1/pods", {"fieldSelector": "spec.bogus=1"})
        elif action == "forbidden":
            api.forbid_namespace("locked")
            c.list("/api/v1/namespaces/locked/pods")
        elif action == "method":
            c.post("/api/v1/nodes/node-a", {})
        else:
            c.list("/api/v1/nodes")
    assert type(info.value) is ApiError
    assert info.value.status == status and info.value.reason == reason
    assert "wrong-token-value" not in str(info.value)


def test_tls_failure_is_not_unavailable(api: ApiServer, tmp_path: Path) -> None:
    other_ca, _ = make_ca(str(tmp_path / "other"))
    creds = credentials.ClusterCredentials(
        server=api.url, source="test creds", ca_file=other_ca, token=api.token
    )
    with ApiClient(creds) as c, pytest.raises(ApiError) as info:
        c.get("/api/v1/nodes")
    assert type(info.value) is ApiError and info.value.reason == "TLSError" and info.value.status == 0
    assert "test creds" in info.value.message


def test_answer_that_is_not_json(api: ApiServer, client: ApiClient) -> None:
    api.add_pod("ns", "p")
    api.malform_next(1)
    with pytest.raises(ApiError) as info:
        client.get("/api/v1/namespaces/ns/pods/p")
    assert info.value.reason == "InvalidResponse" and "502 Bad Gateway" in info.value.message


def test_secrets_are_redacted_from_messages(api: ApiServer, client: ApiClient) -> None:
    # The server quotes the (secret-bearing) name back in its 404 message.
    with pytest.raises(NotFound) as info:
        client.get(f"/api/v1/nodes/{api.token}")
    assert api.token not in str(info.value) and "<redacted>" in str(info.value)


def test_url_userinfo_is_never_sent_nor_shown(api: ApiServer, tmp_path: Path) -> None:
    api.add_node("node-a")
    server = api.url.replace("https://", "https://admin:hunter2pass@")
    creds = credentials.ClusterCredentials(server=server, source="test", ca_file=api.ca_path, token=api.token)
    with ApiClient(creds) as c:
        assert c.server == api.url
        c.get("/api/v1/nodes/node-a")
        assert api.requests_seen[-1].authorization == f"Bearer {api.token}"
        with pytest.raises(NotFound) as info:
            c.get("/api/v1/nodes/admin:hunter2pass")
    assert "hunter2pass" not in str(info.value)


def test_importing_kubeapi_does_not_import_requests() -> None:
    code = "import sys, rdma_cni.kube.client; print('requests' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=_ROOT)
    assert out.stdout.strip() == "False"


# -- watch


def test_watch_streams_events_and_bookmarks(api: ApiServer, client: ApiClient) -> None:
    api.add_node("node-a")
    since = client.list("/api/v1/nodes", metadata_only=True)["metadata"]["resourceVersion"]
    events: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    stream = client.watch("/api/v1/nodes", {"resourceVersion": since}, metadata_only=True, timeout_seconds=30)
    reader = threading.Thread(target=_collect, args=(stream, events, errors), daemon=True)
    reader.start()
    _wait(lambda: api.watch_count == 1)
    seen = api.requests_seen[-1]
    assert seen.accept == kubeapi.METADATA_ACCEPT
    assert "allowWatchBookmarks=true" in seen.path and "timeoutSeconds=30" in seen.path
    api.set_node_annotations("node-a", {STATE: "1"})
    api.add_node("node-watch-new")
    api.send_bookmarks()
    _wait(lambda: len(events) >= 3)
    assert [e["type"] for e in events] == ["MODIFIED", "ADDED", "BOOKMARK"]
    assert events[0]["object"]["metadata"]["annotations"][STATE] == "1"
    assert events[2]["object"]["metadata"]["resourceVersion"] == str(api.resource_version)
    api.drop_watches()
    reader.join(5)
    assert isinstance(errors[0], Unavailable)


def test_watch_ends_when_the_server_ends_it(api: ApiServer, client: ApiClient) -> None:
    events = list(
        client.watch("/api/v1/nodes", {"resourceVersion": str(api.resource_version)}, timeout_seconds=1)
    )
    assert events == []


def test_watch_from_a_compacted_version_raises_gone(api: ApiServer, client: ApiClient) -> None:
    api.add_node("node-a")
    old = api.resource_version
    api.add_node("node-b")
    api.compact()
    with pytest.raises(Gone) as info:
        list(client.watch("/api/v1/nodes", {"resourceVersion": str(old)}))
    assert info.value.status == 410 and "too old resource version" in info.value.message


def test_dropped_watch_is_unavailable(api: ApiServer, client: ApiClient) -> None:
    events: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    stream = client.watch("/api/v1/nodes", {"resourceVersion": str(api.resource_version)})
    reader = threading.Thread(target=_collect, args=(stream, events, errors), daemon=True)
    reader.start()
    _wait(lambda: api.watch_count == 1)
    api.drop_watches()
    reader.join(5)
    assert not reader.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], Unavailable)
    assert errors[0].reason == "WatchInterrupted"


def test_silent_watch_hits_the_read_timeout(api: ApiServer, tmp_path: Path) -> None:
    api.hang(10)  # headers never come
    with ApiClient.from_kubeconfig(api.write_kubeconfig(tmp_path / "kc"), timeout=0.3) as c:
        start = time.monotonic()
        with pytest.raises(Unavailable):
            list(c.watch("/api/v1/nodes", timeout_seconds=1))
        assert time.monotonic() - start < 5


def test_watch_refused_before_streaming_is_typed(api: ApiServer, client: ApiClient) -> None:
    api.fail_next(1, status=503)
    with pytest.raises(Unavailable):
        list(client.watch("/api/v1/nodes"))
    with pytest.raises(ApiError) as info:
        list(client.watch("/api/v1/nodes", {"resourceVersion": "x"}))
    assert info.value.status == 400


class _Scripted(BaseHTTPRequestHandler):
    """Plain-HTTP server answering every GET with one scripted status and body."""

    protocol_version = "HTTP/1.1"
    status = 200
    body = b""

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def scripted(body: bytes, status: int = 200) -> Iterator[ApiClient]:
    """A client of a server that answers ``status`` and ``body`` to everything."""
    handler = type("Scripted", (_Scripted,), {"body": body, "status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        creds = credentials.ClusterCredentials(
            server=f"http://127.0.0.1:{server.server_address[1]}", source="t", token="scripted-token-0123"
        )
        with ApiClient(creds) as c:
            yield c
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("body", "error", "status"),
    [
        (b"this is not json\n", ApiError, 0),
        (b'{"type": "ADDED"}\n', ApiError, 0),
        (b'{"type": "ADDED", "object": {}}' + b" " * (17 * 1024 * 1024) + b"\n", ApiError, 0),
        (
            json.dumps({"type": "ERROR", "object": {"kind": "Status", "code": 500, "message": "x"}}).encode(),
            Unavailable,
            500,
        ),
        (
            json.dumps(
                {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Gone"}}
            ).encode(),
            Gone,
            410,
        ),
    ],
)
def test_malformed_and_error_watch_events(body: bytes, error: type[ApiError], status: int) -> None:
    with scripted(body) as c, pytest.raises(error) as info:
        list(c.watch("/api/v1/nodes"))
    assert info.value.status == status
    assert len(info.value.message) < 1000


def test_answer_that_is_json_but_not_an_object() -> None:
    with scripted(b"[1, 2]") as c, pytest.raises(ApiError) as info:
        c.get("/api/v1/nodes/x")
    assert info.value.reason == "InvalidResponse" and info.value.status == 200


def test_error_answer_without_a_status_body() -> None:
    with scripted(b"<html>bad gateway</html>", status=502) as c, pytest.raises(Unavailable) as info:
        c.get("/api/v1/nodes/x")
    assert info.value.status == 502 and "bad gateway" in info.value.message
    with scripted(b"nope", status=418) as c, pytest.raises(ApiError) as info:
        c.get("/api/v1/nodes/x")
    assert type(info.value) is ApiError and info.value.status == 418


def test_request_that_cannot_be_made() -> None:
    creds = credentials.ClusterCredentials(
        server="https://127.0.0.1:99999", source="t", token="scripted-token-0123"
    )
    with ApiClient(creds) as c, pytest.raises(ApiError) as info:
        c.get("/api/v1/nodes")
    assert type(info.value) is ApiError and info.value.reason == "RequestFailed"


# -- the keep-alive connections of requests that are not watches


class _Connections(socketserver.ThreadingTCPServer):
    """A plain-HTTP server whose connections misbehave on purpose, counting connections and requests.

    ``answer_close``: each answer says ``Connection: close``. ``close_idle``: the
    server closes the connection right after its first answer (an idle timeout).
    ``drop_second``: it reads a connection's second request and closes without answering.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self.requests: list[str] = []
        super().__init__(("127.0.0.1", 0), _ConnectionsHandler)


class _ConnectionsHandler(socketserver.StreamRequestHandler):
    server: _Connections

    def _read_request(self) -> str | None:
        line = self.rfile.readline()
        if not line:
            return None
        length = 0
        while (header := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = header.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        self.rfile.read(length)
        return line.decode("latin-1").split(" ")[0]

    def handle(self) -> None:
        self.server.connections += 1
        method = self._read_request()
        if method is None:
            return
        self.server.requests.append(method)
        body = b'{"kind": "Status", "status": "Success"}'
        close = "Connection: close\r\n" if self.server.mode == "answer_close" else ""
        head = (
            f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{close}\r\n"
        )
        self.wfile.write(head.encode() + body)
        self.wfile.flush()
        if self.server.mode == "drop_second":
            second = self._read_request()
            if second is not None:
                self.server.requests.append(second)
        # Every mode ends the connection here: after the answer, or after an unanswered request.


@contextlib.contextmanager
def connections(mode: str) -> Iterator[tuple[_Connections, ApiClient]]:
    server = _Connections(mode)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    creds = credentials.ClusterCredentials(
        server=f"http://127.0.0.1:{server.server_address[1]}", source="t", token="t0"
    )
    try:
        with ApiClient(creds, timeout=3.0) as c:
            yield server, c
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("mode", ["answer_close", "close_idle"])
def test_a_connection_the_server_closed_is_not_reused(mode: str) -> None:
    with connections(mode) as (server, c):
        for _ in range(3):
            assert c.get("/api/v1/nodes/a")["status"] == "Success"
            if mode == "close_idle":
                time.sleep(0.05)  # the server's close reaches the client while the connection is idle
        assert c.post("/api/v1/namespaces/a/pods/p/binding", {})["status"] == "Success"
        assert server.connections == 4 and server.requests == ["GET"] * 3 + ["POST"]


def test_a_read_on_a_connection_dropped_under_it_is_sent_again_a_write_is_not() -> None:
    with connections("drop_second") as (server, c):
        c.get("/api/v1/nodes/a")
        # The pooled connection looks alive; the server drops it on the next request.
        assert c.get("/api/v1/nodes/a")["status"] == "Success"
        assert server.requests == ["GET", "GET", "GET"] and server.connections == 2
        with pytest.raises(Unavailable) as info:
            c.post("/api/v1/namespaces/a/pods/p/binding", {})
        # A Binding may have been applied: the caller decides (bind checks the pod on a 409).
        assert info.value.reason == "NoAnswer" and server.requests[-1] == "POST"
        assert server.requests.count("POST") == 1


def test_at_most_the_pool_size_of_idle_connections_is_kept() -> None:
    closed: list[int] = []

    class Conn:
        def __init__(self, i: int) -> None:
            self.i = i

        def close(self) -> None:
            closed.append(self.i)

    idle = pool.Pool("127.0.0.1", 1, "", None, 1.0)
    for i in range(pool.POOL_SIZE + 2):
        idle.give(Conn(i))
    assert closed == [pool.POOL_SIZE, pool.POOL_SIZE + 1]
    idle.close()
    assert sorted(closed) == list(range(pool.POOL_SIZE + 2))


def test_a_client_certificate_that_cannot_be_loaded_is_a_tls_error(api: ApiServer, tmp_path: Path) -> None:
    (tmp_path / "bad.crt").write_text("not a certificate\n")
    creds = credentials.ClusterCredentials(
        server=api.url,
        source="test creds",
        ca_file=api.ca_path,
        client_cert_file=str(tmp_path / "bad.crt"),
        client_key_file=str(tmp_path / "bad.crt"),
    )
    with ApiClient(creds) as c, pytest.raises(ApiError) as info:
        c.get("/api/v1/nodes")
    assert type(info.value) is ApiError and info.value.reason == "TLSError" and info.value.status == 0
    assert "client certificate" in info.value.message


def test_a_request_http_cannot_carry_is_refused_before_sending(api: ApiServer, tmp_path: Path) -> None:
    api.reset()
    creds = credentials.ClusterCredentials(
        server=api.url, source="t", ca_file=api.ca_path, token="secret\r\nX-Evil: 1"
    )
    with ApiClient(creds) as c, pytest.raises(ApiError) as info:
        c.get("/api/v1/nodes")
    assert type(info.value) is ApiError and info.value.reason == "RequestFailed"
    assert "secret" not in info.value.message and not api.requests_seen


def test_paths_and_parameters_are_quoted_as_requests_quotes_them(api: ApiServer, client: ApiClient) -> None:
    api.reset()
    with pytest.raises(NotFound):
        client.get("/api/v1/nodes/a b", {"labelSelector": "a in (x,y)", "limit": 2})
    assert api.requests_seen[-1].path == "/api/v1/nodes/a%20b?labelSelector=a+in+%28x%2Cy%29&limit=2"


def test_a_server_path_http_cannot_carry_is_refused(api: ApiServer) -> None:
    api.reset()
    creds = credentials.ClusterCredentials(
        server=api.url + "/a b", source="t", ca_file=api.ca_path, token="t"
    )
    with ApiClient(creds) as c, pytest.raises(ApiError) as info:
        c.get("/api/v1/nodes")
    assert type(info.value) is ApiError and info.value.reason == "RequestFailed"
    assert "InvalidURL" in info.value.message and not api.requests_seen


@pytest.mark.parametrize("content", ["not a certificate\n", ""])
def test_a_ca_file_that_holds_no_certificate_is_a_tls_error(
    api: ApiServer, tmp_path: Path, content: str
) -> None:
    (tmp_path / "ca.crt").write_text(content)
    creds = credentials.ClusterCredentials(
        server=api.url, source="test creds", ca_file=str(tmp_path / "ca.crt"), token="secret-token-0123"
    )
    with ApiClient(creds) as c, pytest.raises(ApiError) as info:
        c.get("/api/v1/nodes")
    assert type(info.value) is ApiError and info.value.reason == "TLSError" and info.value.status == 0
    assert "certificate authority" in info.value.message


class _SlowKeepAlive(ThreadingHTTPServer):
    """Answers every GET after ``delay`` seconds on a kept-alive connection; counts connections
    and the most requests it held at once."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.connections = 0
        self.busy = 0
        self.most_busy = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _SlowKeepAliveHandler)


class _SlowKeepAliveHandler(BaseHTTPRequestHandler):
    server: _SlowKeepAlive
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.connections += 1

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.busy += 1
            self.server.most_busy = max(self.server.most_busy, self.server.busy)
        time.sleep(self.server.delay)
        with self.server.lock:
            self.server.busy -= 1
        body = b'{"kind": "Status", "status": "Success"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_concurrent_requests_beyond_the_pool_wait_for_a_kept_connection() -> None:
    """A burst of requests (the extender's binds) uses at most POOL_SIZE connections: the rest
    wait for one to come back rather than each opening (and, over TLS, handshaking) one more that
    would be closed again on its return."""
    server = _SlowKeepAlive(0.05)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    creds = credentials.ClusterCredentials(
        server=f"http://127.0.0.1:{server.server_address[1]}", source="t", token="t0"
    )
    answers: list[str] = []
    try:
        with ApiClient(creds, timeout=5.0) as c:
            threads = [
                threading.Thread(target=lambda: answers.append(c.get("/api/v1/nodes/a")["status"]))
                for _ in range(3 * pool.POOL_SIZE)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
    finally:
        server.shutdown()
        server.server_close()
    assert answers == ["Success"] * (3 * pool.POOL_SIZE)
    assert server.connections <= pool.POOL_SIZE
    assert server.most_busy <= pool.POOL_SIZE


class _Idle:
    """A kept connection whose socket has nothing to read (so the pool may hand it out again)."""

    def __init__(self) -> None:
        self.sock, self.peer = socket.socketpair()

    def close(self) -> None:
        self.sock.close()
        self.peer.close()


def _full_pool_and_a_waiter() -> tuple[pool.Pool, list[tuple[Any, bool]], threading.Thread]:
    """A pool with every connection taken, and a thread already waiting in a take (what it got)."""
    kept = pool.Pool("127.0.0.1", 1, "", None, 5.0)
    for _ in range(pool.POOL_SIZE):
        kept.take()
    got: list[tuple[Any, bool]] = []
    waiter = threading.Thread(target=lambda: got.append(kept.take()))
    waiter.start()
    waiter.join(0.3)
    assert not got  # waiting, not opening a connection past the pool
    return kept, got, waiter


def test_a_take_with_every_connection_in_use_gets_the_next_one_given_back() -> None:
    kept, got, waiter = _full_pool_and_a_waiter()
    back = _Idle()
    kept.give(back)
    waiter.join(5)
    assert got == [(back, True)] and kept.opened == pool.POOL_SIZE
    back.close()


def test_a_connection_lost_by_its_caller_frees_its_place() -> None:
    kept, got, waiter = _full_pool_and_a_waiter()
    kept.lost()
    waiter.join(5)
    assert len(got) == 1 and got[0][1] is False and kept.opened == pool.POOL_SIZE + 1


def test_a_take_that_waited_the_timeout_opens_one_more() -> None:
    """Delayed, never refused: past the client's timeout a request gets a connection of its own."""
    kept = pool.Pool("127.0.0.1", 1, "", None, 0.2)
    for _ in range(pool.POOL_SIZE):
        kept.take()
    started = time.monotonic()
    _, reused = kept.take()
    assert 0.15 <= time.monotonic() - started < 3 and not reused and kept.opened == pool.POOL_SIZE + 1
