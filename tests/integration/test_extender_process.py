"""``rdma-cni scheduler-extender`` as a real process (the built binary when RDMA_CNI_BINARY is set).

The API stand-in serves Nodes and Pods over HTTPS; these tests play
kube-scheduler over HTTP(S) and check what the process does at start-up
(rebuilt reservations before ready), for binds, on TLS, on bad options and on
SIGTERM.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.shared import nodestate
from tests.integration.conftest import plugin_command
from tests.support import sched_objects as so
from tests.support.apiserver import ApiServer, make_ca, make_cert

ANNOTATION = "rdma_interfaces_required"


def _request(
    api: ApiServer, name: str, rates: list[tuple[int, int]], node: str | None = None
) -> dict[str, Any]:
    value = json.dumps([{"min_tx_rate": lo, "max_tx_rate": hi} for lo, hi in rates])
    return api.add_pod("team-a", name, {ANNOTATION: value}, node_name=node, scheduler_name="rdma-scheduler")


class Extender:
    def __init__(
        self, proc: subprocess.Popen[str], port: int, tls: ssl.SSLContext | None, announced: dict[str, Any]
    ) -> None:
        self.proc, self.port, self.tls, self.announced = proc, port, tls, announced

    def conn(self) -> http.client.HTTPConnection:
        if self.tls is not None:
            return http.client.HTTPSConnection("127.0.0.1", self.port, timeout=20, context=self.tls)
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)

    def call(self, method: str, path: str, doc: Any = None) -> tuple[int, Any]:
        conn = self.conn()
        body = None if doc is None else json.dumps(doc)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        return resp.status, (json.loads(raw) if method == "POST" else raw)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.call("GET", "/readyz")[0] == 200:
                return
            time.sleep(0.05)
        raise AssertionError("extender never became ready")


def start(tmp: Path, api: ApiServer, *extra: str, tls: bool = False, listen: str = "127.0.0.1:0") -> Extender:
    kubeconfig = api.write_kubeconfig(tmp / "kubeconfig")
    cmd = [
        *plugin_command(),
        "scheduler-extender",
        "--listen",
        listen,
        "--kubeconfig",
        kubeconfig,
        *extra,
    ]
    context = None
    if tls:
        key = os.path.join(api.directory, "server.key")
        cmd += ["--tls-cert", api.server_cert_path, "--tls-key", key]
        context = ssl.create_default_context(cafile=api.ca_path)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise AssertionError(f"extender did not start: {proc.stderr.read() if proc.stderr else ''}")
    announced = json.loads(line)
    assert announced["tls"] is tls
    return Extender(proc, int(announced["listening"].rsplit(":", 1)[1]), context, announced)


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        yield server


@pytest.fixture
def procs() -> Iterator[list[Extender]]:
    started: list[Extender] = []
    yield started
    for ext in started:
        if ext.proc.poll() is None:
            ext.proc.kill()
            ext.proc.wait(10)


def test_process_rebuilds_reservations_then_filters_and_binds(
    tmp_path: Path, api: ApiServer, procs: list[Extender]
) -> None:
    api.add_node(
        "n1",
        annotations={nodestate.ANNOTATION: nodestate.encode(so.state([("ens1f0", 25_000, 4)]))},
        images=40,
    )
    _request(api, "bound-earlier", [(15_000, 0)], node="n1")  # bound before a restart, not yet published
    ext = start(tmp_path, api, "--max-state-age", "600", "--networks", "rdma-net")
    procs.append(ext)
    ext.wait_ready()
    pod = _request(api, "next", [(15_000, 0)])
    status, out = ext.call("POST", "/filter", so.args_names(pod, ["n1"]))
    # Only the rebuilt reservation (15000 of the 25000) keeps 15000 more from fitting.
    assert status == 200 and out["NodeNames"] == []
    assert out["FailedNodes"]["n1"] == "rdma-cni: needs 15000 Mbit/s free on one PF with a free VF"
    small = _request(api, "small", [(5_000, 0)])
    assert ext.call("POST", "/filter", so.args_names(small, ["n1"]))[1]["NodeNames"] == ["n1"]
    meta = small["metadata"]
    bind = {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": "n1"}
    assert ext.call("POST", "/bind", bind)[1] == {"Error": ""}
    assert api.get_pod("team-a", "small")["spec"]["nodeName"] == "n1"  # type: ignore[index]
    # A pod selecting the network without the annotation gets the default request: one plain VF.
    plain = api.add_pod(
        "team-a",
        "plain",
        {"k8s.v1.cni.cncf.io/networks": "rdma-net"},
        node_name=None,
        scheduler_name="rdma-scheduler",
    )
    assert ext.call("POST", "/filter", so.args_names(plain, ["n1"]))[1]["NodeNames"] == ["n1"]
    ext.proc.send_signal(signal.SIGTERM)
    assert ext.proc.wait(15) == 0


def test_process_binds_only_the_schedulers_it_is_told(
    tmp_path: Path, api: ApiServer, procs: list[Extender]
) -> None:
    api.add_node(
        "n1", annotations={nodestate.ANNOTATION: nodestate.encode(so.state([("ens1f0", 25_000, 4)]))}
    )
    ext = start(tmp_path, api, "--scheduler-name", "default-scheduler", "--scheduler-name", "gpu")
    procs.append(ext)
    ext.wait_ready()
    for name, scheduler, error in (
        ("ours", "rdma-scheduler", "rdma-cni: pod team-a/ours has schedulerName 'rdma-scheduler', which"),
        ("default", "default-scheduler", ""),
        ("gpu", "gpu", ""),
    ):
        pod = api.add_pod("team-a", name, {ANNOTATION: "[{}]"}, node_name=None, scheduler_name=scheduler)
        meta = pod["metadata"]
        doc = {"PodName": name, "PodNamespace": "team-a", "PodUID": meta["uid"], "Node": "n1"}
        assert ext.call("POST", "/bind", doc)[1]["Error"].startswith(error)
    assert not api.get_pod("team-a", "ours")["spec"].get("nodeName")  # type: ignore[index]
    assert api.get_pod("team-a", "gpu")["spec"]["nodeName"] == "n1"  # type: ignore[index]


def test_process_serves_metrics_and_posts_refusals_as_events(
    tmp_path: Path, api: ApiServer, procs: list[Extender]
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    api.add_node(
        "n1", annotations={nodestate.ANNOTATION: nodestate.encode(so.state([("ens1f0", 25_000, 1)]))}
    )
    ext = start(tmp_path, api, "--metrics-listen", "127.0.0.1:0")
    procs.append(ext)
    ext.wait_ready()
    pods = [_request(api, name, [(20_000, 0)]) for name in ("a", "b")]
    for pod in pods:
        assert ext.call("POST", "/filter", so.args_names(pod, ["n1"]))[1]["NodeNames"] == ["n1"]
    errors = []
    for pod in pods:
        meta = pod["metadata"]
        doc = {"PodName": meta["name"], "PodNamespace": "team-a", "PodUID": meta["uid"], "Node": "n1"}
        errors.append(ext.call("POST", "/bind", doc)[1]["Error"])
    assert errors[0] == "" and "no longer fits node n1" in errors[1]
    host, port = ext.announced["metrics"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/metrics")
    page = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(conn.getresponse().read().decode())
        for s in family.samples
    }
    conn.close()
    assert page[("rdma_cni_extender_request_seconds_count", (("verb", "filter"),))] == 2
    assert page[("rdma_cni_extender_request_seconds_count", (("verb", "bind"),))] == 2
    assert page[("rdma_cni_extender_decisions_total", (("outcome", "fits"), ("verb", "filter")))] == 2
    assert page[("rdma_cni_extender_decisions_total", (("outcome", "bound"), ("verb", "bind")))] == 1
    assert page[("rdma_cni_extender_bind_refusals_total", (("reason", "no_fit"),))] == 1
    assert page[("rdma_cni_extender_reservations", ())] == 1
    assert page[("rdma_cni_extender_watched_nodes", ())] == 1
    # The refusal, on the pod, as the process's own sink posted it.
    deadline = time.monotonic() + 10
    while not api.events() and time.monotonic() < deadline:
        time.sleep(0.05)
    (event,) = api.events()
    assert event["involvedObject"]["name"] == "b" and event["reason"] == "BindingRefused"
    assert event["message"] == f"{errors[1]} [no_fit]"
    ext.proc.send_signal(signal.SIGTERM)
    assert ext.proc.wait(15) == 0


def test_process_serves_https(tmp_path: Path, api: ApiServer, procs: list[Extender]) -> None:
    api.add_node(
        "n1", annotations={nodestate.ANNOTATION: nodestate.encode(so.state([("ens1f0", 25_000, 4)]))}
    )
    ext = start(tmp_path, api, tls=True)
    procs.append(ext)
    ext.wait_ready()
    pod = _request(api, "p", [(1_000, 0)])
    assert ext.call("POST", "/filter", so.args_names(pod, ["n1"]))[1]["NodeNames"] == ["n1"]
    # A client that does not speak TLS gets the connection closed, and the server goes on.
    with socket.create_connection(("127.0.0.1", ext.port), timeout=10) as plain:
        plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert not plain.recv(100).startswith(b"HTTP/1.1 200")
    assert ext.call("GET", "/healthz")[0] == 200
    assert ext.proc.poll() is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen", "nowhere"], "expected ADDR:PORT"),
        (["--listen", "127.0.0.1:0", "--tls-cert", "/x"], "--tls-cert and --tls-key go together"),
        (
            ["--listen", "127.0.0.1:0", "--default-request", '[{"min_tx_rate": -1}]'],
            "--default-request: entry 0.min_tx_rate",
        ),
        (["--listen", "127.0.0.1:0", "--max-state-age", "0"], "'0' is not a positive number of seconds"),
        (["--listen", "127.0.0.1:0", "--annotation", "bad key!"], "is not a valid Kubernetes annotation key"),
        (["--listen", "127.0.0.1:0", "--policy", "random"], "invalid choice: 'random'"),
        (["--listen", "127.0.0.1:0", "--metrics-listen", "nowhere"], "--metrics-listen 'nowhere': expected"),
        (["--listen", "127.0.0.1:0", "--scheduler-name", ""], "is not a valid scheduler name"),
        (["--listen", "127.0.0.1:0", "--client-ca", "/ca.crt"], "--client-ca needs --tls-cert and --tls-key"),
        (["--listen", "127.0.0.1:0", "--client-name", "x"], "--client-name needs --client-ca"),
        (["--listen", "127.0.0.1:0", "--kubeconfig", "/nonexistent/kubeconfig"], "/nonexistent/kubeconfig"),
        (
            ["--listen", "127.0.0.1:0", "--tls-cert", "/nonexistent.crt", "--tls-key", "/k"],
            "cannot load --tls-cert",
        ),
    ],
)
def test_bad_options_are_refused_by_name(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [*plugin_command(), "scheduler-extender", *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode in (1, 2)
    assert message in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("listen", ["0.0.0.0:8888", ":8888", "10.0.0.1:8888", "[::]:8888"])
@pytest.mark.parametrize("tls", [False, True])
def test_a_network_listener_without_client_certificates_is_refused_at_start_up(
    tmp_path: Path, api: ApiServer, listen: str, tls: bool
) -> None:
    """Whoever reaches the extender could bind any pod anywhere: refused, not warned about."""
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    cmd = [*plugin_command(), "scheduler-extender", "--listen", listen, "--kubeconfig", kubeconfig]
    if tls:
        cmd += ["--tls-cert", api.server_cert_path, "--tls-key", api.server_key_path]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "without client authentication" in proc.stderr and "--client-ca" in proc.stderr
    assert proc.stdout == ""
    assert api.requests_seen == []  # refused before it talks to the API


def test_address_that_cannot_be_served_is_refused(tmp_path: Path, api: ApiServer) -> None:
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    cmd = [
        *plugin_command(), "scheduler-extender", "--listen", "203.0.113.1:1", "--kubeconfig", kubeconfig,
        "--tls-cert", api.server_cert_path, "--tls-key", api.server_key_path, "--client-ca", api.ca_path,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "cannot listen on 203.0.113.1:1" in proc.stderr
    cmd = [*plugin_command(), "scheduler-extender", "--listen", "127.0.0.1:0", "--kubeconfig", kubeconfig]
    cmd += ["--metrics-listen", "203.0.113.1:2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "rdma-cni scheduler-extender: cannot serve metrics on 203.0.113.1:2: " in proc.stderr


def test_process_with_client_ca_serves_only_its_certificates(
    tmp_path: Path, api: ApiServer, procs: list[Extender]
) -> None:
    """On 0.0.0.0 with --client-ca: kube-scheduler's certificate is served, nothing else is."""
    api.add_node(
        "n1", annotations={nodestate.ANNOTATION: nodestate.encode(so.state([("ens1f0", 25_000, 4)]))}
    )
    client_ca = make_ca(str(tmp_path), "client-ca", "kube-scheduler client CA")
    scheduler = make_cert(str(tmp_path), client_ca, "scheduler", "/CN=rdma-cni-kube-scheduler", client=True)
    other = make_cert(str(tmp_path), client_ca, "other", "/CN=system:node:n1", client=True)
    forged = make_cert(
        str(tmp_path),
        make_ca(str(tmp_path), "other-ca"),
        "forged",
        "/CN=rdma-cni-kube-scheduler",
        client=True,
    )
    ext = start(
        tmp_path, api, "--client-ca", client_ca[0], "--client-name", "rdma-cni-kube-scheduler",
        "--probe-listen", "0.0.0.0:0", tls=True, listen="0.0.0.0:0",
    )  # fmt: skip
    procs.append(ext)
    assert ext.tls is not None
    ext.tls.load_cert_chain(*scheduler)
    # The kubelet's probes have no client certificate: they have their own plain-HTTP port, without verbs.
    probes = int(ext.announced["probes"].rsplit(":", 1)[1])
    probe = http.client.HTTPConnection("127.0.0.1", probes, timeout=20)
    probe.request("GET", "/healthz")
    assert probe.getresponse().read() == b"ok\n"
    probe.request("POST", "/bind", body=b"{}")
    assert probe.getresponse().status == 404
    probe.close()
    ext.wait_ready()
    pod = _request(api, "p", [(1_000, 0)])
    assert ext.call("POST", "/filter", so.args_names(pod, ["n1"]))[1]["NodeNames"] == ["n1"]
    for cert in (None, forged, other):
        context = ssl.create_default_context(cafile=api.ca_path)
        if cert is not None:
            context.load_cert_chain(*cert)
        conn = http.client.HTTPSConnection("127.0.0.1", ext.port, timeout=20, context=context)
        meta = pod["metadata"]
        bind = {
            "PodName": meta["name"],
            "PodNamespace": meta["namespace"],
            "PodUID": meta["uid"],
            "Node": "n1",
        }
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
            conn.request("POST", "/bind", body=json.dumps(bind), headers={"Content-Type": "application/json"})
            conn.getresponse().read()
        conn.close()
    assert api.get_pod("team-a", "p")["spec"].get("nodeName") is None  # type: ignore[index]
    assert ext.call("GET", "/healthz")[0] == 200 and ext.proc.poll() is None
