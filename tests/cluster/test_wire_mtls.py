"""The mutual-TLS variant against the real kube-scheduler: its ``tlsConfig`` calls the extender.

A control plane of its own, without the tier's default kube-scheduler: the
cluster's default scheduler here is the one configured from
conf/kube-scheduler-default.yaml (the profile ``default-scheduler``), set up by
docs/deploy.md's steps run as written (tests/support/kube/mtlsscheduler.py).
An RDMA pod (declaring ``rdma-cni.io/vf`` and ``rdma-cni.io/bandwidth``, the
configuration's managedResources, which the nodes' agents advertise in their
status) is filtered, prioritized and bound through mutual TLS; one whose node
has not advertised them waits with kube-scheduler's reason and is bound once
the node's agent advertises them; conf/pod.yaml without its schedulerName
reaches the extender by its declaration; a client without a certificate, with
one of another CA, or with one of the right CA but another name gets no answer.
"""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from rdma_cni.shared import nodestate
from tests.cluster.conftest import failed_scheduling, unique, wait_for_service_account
from tests.support import sched_objects as so
from tests.support.apiserver import make_ca, make_cert
from tests.support.kube.controlplane import REPO, ControlPlane
from tests.support.kube.mtlsscheduler import (
    DefaultScheduler,
    MtlsExtender,
    Operator,
    ServiceRelays,
    docs_blocks,
)
from tests.support.kube.mtlsscheduler import advertise as agent_advertise
from tests.support.kube.mtlsscheduler import rdma_pod as declaring_pod
from tests.support.kube.objects import create, create_node, pod_doc
from tests.support.waiting import wait_for

SERVICE_NAME = "rdma-cni-scheduler-extender.kube-system.svc"
VFS, BANDWIDTH = nodestate.VF_RESOURCE, nodestate.BANDWIDTH_RESOURCE
ANNOTATION = "rdma_interfaces_required"


@dataclass
class Pair:
    """The running pair, as the old fixture named its parts."""

    extender: MtlsExtender
    scheduler: DefaultScheduler

    @property
    def extender_port(self) -> int:
        return self.extender.port

    @property
    def metrics_port(self) -> int:
        return self.extender.ports["--metrics-listen"]

    @property
    def config(self) -> dict[str, Any]:
        return self.scheduler.config


@dataclass
class Mtls:
    cp: ControlPlane
    rs: Pair
    certs: Path
    namespace: str


@pytest.fixture(scope="module")
def mtls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mtls]:
    root = tmp_path_factory.mktemp("mtls")
    cp = ControlPlane(str(root / "cluster"), default_scheduler=False)
    relays = extender = scheduler = None
    try:
        cp.start()
        operator = Operator(cp, root / "operator")
        operator.prepare()
        openssl, extender_side, scheduler_side, _renewal = docs_blocks()
        for block in (openssl, extender_side, scheduler_side):
            operator.run(block)
        extender = MtlsExtender(cp, root / "operator")
        extender.start()
        relays = ServiceRelays(cp, extender.port)
        scheduler = DefaultScheduler(cp, operator, relays)
        scheduler.start()
        namespace = unique("mtls")
        cp.kubectl("create", "namespace", namespace)
        wait_for_service_account(cp, namespace, "default")
        yield Mtls(cp, Pair(extender, scheduler), operator.certs, namespace)
    finally:
        if scheduler is not None:
            scheduler.stop()
        if extender is not None:
            extender.stop()
        if relays is not None:
            relays.close()
        cp.stop()


def calls(rs: Pair) -> dict[str, float]:
    """Requests the extender answered, by verb (its /metrics)."""
    conn = http.client.HTTPConnection("127.0.0.1", rs.metrics_port, timeout=10)
    conn.request("GET", "/metrics")
    page = conn.getresponse().read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == "rdma_cni_extender_request_seconds_count":
                counts[s.labels["verb"]] = counts.get(s.labels["verb"], 0) + s.value
    return counts


def rdma_pod(m: Mtls, name: str, request: list[dict[str, int]], on_node: str | None = None) -> None:
    """An RDMA pod of the default scheduler that declares its request as conf/pod.yaml does."""
    declaring_pod(m.cp, m.namespace, name, request, on_node)


def advertise(m: Mtls, node: str, state: nodestate.NodeState) -> None:
    """The node's agent advertises ``state``'s RDMA resources (conf/base/node/rbac.yaml's RBAC and policy)."""
    agent_advertise(m.cp, node, state, unique("agent"))


def node_of(m: Mtls, pod: str) -> str | None:
    return m.cp.get("pod", pod, "-n", m.namespace)["spec"].get("nodeName")


def test_an_rdma_pod_is_filtered_prioritized_and_bound_through_mutual_tls(mtls: Mtls) -> None:
    m = mtls
    # Two nodes where 20000 fits (prioritize runs only with more than one) and one where it does not.
    fits = {unique("mtls-big"): ("ens1f0", 100_000, 4), unique("mtls-mid"): ("ens1f0", 25_000, 2)}
    small = unique("mtls-small")
    for name, pf in [*fits.items(), (small, ("ens1f0", 10_000, 2))]:
        state = so.state([pf])
        create_node(m.cp, name, {nodestate.ANNOTATION: nodestate.encode(state)})
        advertise(m, name, state)
    # The extender judges a node only once its watch delivered it.
    wait_for(lambda: _watched(m.rs) >= 3, 60, "the extender's node cache to hold the three nodes")
    before = calls(m.rs)
    pod = unique("rdma")
    rdma_pod(m, pod, [{"min_tx_rate": 20_000}])
    node = wait_for(lambda: node_of(m, pod), 90, f"{pod} bound")
    assert node in fits
    after = calls(m.rs)
    for verb in ("filter", "prioritize", "bind"):
        assert after.get(verb, 0) > before.get(verb, 0), (verb, before, after)
    # Over mutual TLS only: the urlPrefix is https, and the listener has no other way in.
    assert m.rs.config["extenders"][0]["urlPrefix"].startswith("https://")


def test_a_declaring_pod_waits_with_a_reason_until_its_node_advertises_capacity(mtls: Mtls) -> None:
    """Nodes advertise what the pod declares; a node whose agent has not (yet) fits no such pod, and
    kube-scheduler says so. The agent's write of the Node's status is what lets the pod be bound."""
    m = mtls
    node = unique("mtls-late")
    state = so.state([("ens1f0", 40_000, 4)])
    watched = _watched(m.rs)
    create_node(m.cp, node, {nodestate.ANNOTATION: nodestate.encode(state)})
    wait_for(lambda: _watched(m.rs) > watched, 60, "the extender's node cache to hold the new node")
    before = calls(m.rs)
    pod = unique("early")
    rdma_pod(m, pod, [{"min_tx_rate": 10_000}], on_node=node)
    reasons = wait_for(
        lambda: [r for r in failed_scheduling(m.cp, m.namespace, pod) if f"Insufficient {VFS}" in r],
        90,
        f"{pod}'s FailedScheduling event",
    )
    assert f"Insufficient {BANDWIDTH}" in reasons[0], reasons
    assert node_of(m, pod) is None
    # kube-scheduler's own filter refused the node: the extender was not asked.
    assert calls(m.rs).get("filter", 0) == before.get("filter", 0)
    advertise(m, node, state)
    assert wait_for(lambda: node_of(m, pod), 90, f"{pod} bound once {node} advertised") == node
    assert calls(m.rs).get("bind", 0) > before.get("bind", 0)


def test_the_sample_pod_without_its_scheduler_name_is_placed_through_the_extender(mtls: Mtls) -> None:
    """conf/pod.yaml as docs/deploy.md says to run it under this variant (no schedulerName): its
    declaration routes it to the extender and fits a node that advertises room for it."""
    m = mtls
    node = unique("mtls-sample")
    state = so.state([("ens1f0", 40_000, 4)])
    watched = _watched(m.rs)
    create_node(m.cp, node, {nodestate.ANNOTATION: nodestate.encode(state)})
    advertise(m, node, state)
    wait_for(lambda: _watched(m.rs) > watched, 60, "the extender's node cache to hold the new node")
    with open(os.path.join(REPO, "conf", "pod.yaml")) as f:
        doc = yaml.safe_load(f)
    del doc["spec"]["schedulerName"]
    # This module's namespace, a unique name; the declaration and the annotation as shipped.
    pod = unique("sample")
    doc["metadata"].update(name=pod, namespace=m.namespace)
    before = calls(m.rs)
    create(m.cp, doc)
    assert wait_for(lambda: node_of(m, pod), 90, f"{pod} bound")
    after = calls(m.rs)
    for verb in ("filter", "bind"):
        assert after.get(verb, 0) > before.get(verb, 0), (verb, before, after)


def test_a_pod_without_the_resource_is_scheduled_without_the_extender(mtls: Mtls) -> None:
    m = mtls
    name = unique("plain-node")
    create_node(m.cp, name)
    before = calls(m.rs)
    pod = unique("plain")
    create(m.cp, pod_doc(m.namespace, pod))
    wait_for(lambda: node_of(m, pod), 90, f"{pod} bound")
    assert {v: n for v, n in calls(m.rs).items() if v in ("filter", "bind")} == {
        v: n for v, n in before.items() if v in ("filter", "bind")
    }


def _watched(rs: Pair) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", rs.metrics_port, timeout=10)
    conn.request("GET", "/metrics")
    for family in text_string_to_metric_families(conn.getresponse().read().decode()):
        for s in family.samples:
            if s.name == "rdma_cni_extender_watched_nodes":
                return float(s.value)
    return 0.0


def _call(port: int, ca: Path, client: tuple[Path, Path] | None) -> str:
    """POST /filter over TLS as a client with ``client`` (cert, key): the status line, or why none came.

    TLS 1.3 ends the client's handshake before the server has checked the
    client's certificate: the server's verdict comes with the first read. So
    the client listens first (a request already sent would still be unread
    when the server closes, and the kernel's reset would overtake its alert).
    """
    ctx = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        ctx.load_cert_chain(str(client[0]), str(client[1]))
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            ctx.wrap_socket(raw, server_hostname=SERVICE_NAME) as tls,
        ):
            tls.settimeout(2)
            try:
                early = tls.recv(200)
            except TimeoutError:
                early = None  # still open: the server accepted the certificate
            if early is not None:
                return f"closed: {early!r}"
            tls.settimeout(10)
            tls.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            head = tls.recv(200)
    except ssl.SSLError as exc:
        return f"tls: {exc.reason or type(exc).__name__}: {exc}"
    except OSError as exc:
        return f"closed: {exc!r}"
    return head.split(b"\r\n", 1)[0].decode() if head else "closed: no answer"


def _client_cert(directory: Path, ca: tuple[str, str], stem: str, cn: str) -> tuple[Path, Path]:
    cert, key = make_cert(str(directory), ca, stem, f"/CN={cn}", client=True)
    return Path(cert), Path(key)


def test_clients_without_kube_schedulers_certificate_are_refused_at_the_tls_layer(
    mtls: Mtls, tmp_path: Path
) -> None:
    m = mtls
    port, serving_ca = m.rs.extender_port, m.certs / "serving-ca.crt"
    # kube-scheduler's certificate (docs/deploy.md's client.crt) is answered: what follows refuses callers.
    assert _call(port, serving_ca, (m.certs / "client.crt", m.certs / "client.key")).startswith("HTTP/1.1 ")
    # No certificate: the handshake ends with the server's alert.
    bare = _call(port, serving_ca, None)
    assert bare.startswith("tls: TLSV13_ALERT_CERTIFICATE_REQUIRED"), bare
    # kube-scheduler's name, but from another CA.
    other_ca = make_ca(str(tmp_path), common_name="another CA")
    other = _call(port, serving_ca, _client_cert(tmp_path, other_ca, "other", "rdma-cni-kube-scheduler"))
    assert other.startswith("tls: TLSV1_ALERT_UNKNOWN_CA"), other
    # The right CA, another name (--client-name): closed before any answer.
    right_ca = (str(m.certs / "client-ca.crt"), str(m.certs / "client-ca.key"))
    wrong = _call(port, serving_ca, _client_cert(tmp_path, right_ca, "kubelet", "system:node:worker-1"))
    assert wrong == "closed: b''", wrong
    assert m.rs.extender.component is not None
    log = Path(m.rs.extender.component.log).read_text()
    assert "client certificate names ['system:node:worker-1'], none of --client-name" in log


def test_the_docs_steps_made_what_the_manifests_mount(mtls: Mtls) -> None:
    # The serving certificate names the Service; kube-scheduler checked it by serverName over 127.0.0.1.
    text = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(mtls.certs / "extender.crt")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"DNS:{SERVICE_NAME}" in text
    tls = mtls.rs.config["extenders"][0]["tlsConfig"]
    assert tls["serverName"] == SERVICE_NAME
    # kube-scheduler reads no file of ours: its credentials are inline, and the file is 0600.
    assert set(tls) == {"serverName", "caData", "certData", "keyData"}
    written = mtls.certs.parent / "etc" / "kubernetes" / "kube-scheduler-config.yaml"
    assert os.stat(written).st_mode & 0o077 == 0
