"""The mutual-TLS variant cannot stop the cluster's scheduling: the real kube-scheduler, harmed and restarted.

A control plane of its own, whose default scheduler is the real kube-scheduler v1.37.2 started
from the file docs/deploy.md's steps wrote (tests/support/kube/mtlsscheduler.py runs them as
written). Each test harms one thing kube-scheduler's extender depends on (the operator's
certificate files, the extender's Secret, its Service, its serving certificate, kube-scheduler's
client certificate), restarts kube-scheduler, and checks that it starts, that a pod without RDMA
resources is scheduled, and what becomes of an RDMA pod (scheduled, or waiting with the failure
in its FailedScheduling event); then mends it and sees the RDMA pod bound. The last test shows
what does stop kube-scheduler: a configuration it cannot read (inline data that does not match),
and a file-based ``tlsConfig`` with a file missing, the design this variant left.
"""

from __future__ import annotations

import base64
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from rdma_cni.shared import nodestate
from tests.cluster.conftest import failed_scheduling, unique, wait_for_service_account
from tests.support import sched_objects as so
from tests.support.apiserver import make_cert_dated
from tests.support.kube.controlplane import ControlPlane
from tests.support.kube.mtlsscheduler import (
    DefaultScheduler,
    MtlsExtender,
    Operator,
    ServiceRelays,
    VolumeMissing,
    advertise,
    cluster_ip,
    docs_blocks,
    rdma_pod,
)
from tests.support.kube.objects import create, create_node, pod_doc
from tests.support.waiting import wait_for

SECRET = "rdma-cni-scheduler-extender-tls"


@dataclass
class Variant:
    cp: ControlPlane
    operator: Operator
    extender: MtlsExtender
    scheduler: DefaultScheduler
    relays: ServiceRelays
    namespace: str
    blocks: list[str]


@pytest.fixture(scope="module")
def variant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Variant]:
    root = tmp_path_factory.mktemp("robust")
    cp = ControlPlane(str(root / "cluster"), default_scheduler=False)
    relays = extender = scheduler = None
    try:
        cp.start()
        operator = Operator(cp, root / "operator")
        operator.prepare()
        blocks = docs_blocks()
        for block in blocks[:3]:  # openssl, the extender's side, kube-scheduler's configuration
            operator.run(block)
        extender = MtlsExtender(cp, root / "operator")
        extender.start()
        relays = ServiceRelays(cp, extender.port)
        scheduler = DefaultScheduler(cp, operator, relays)
        scheduler.start()
        namespace = unique("robust")
        cp.kubectl("create", "namespace", namespace)
        wait_for_service_account(cp, namespace, "default")
        # Two RDMA nodes, their capacity advertised by the agent's own code.
        for n in range(2):
            node = f"robust-rdma-{n}"
            state = so.state([("ens1f0", 100_000, 8)])
            create_node(cp, node, {nodestate.ANNOTATION: nodestate.encode(state)})
            advertise(cp, node, state, unique("agent"))
        wait_for(lambda: extender.metrics().get("rdma_cni_extender_watched_nodes") == 2, 60, "nodes watched")
        yield Variant(cp, operator, extender, scheduler, relays, namespace, blocks)
    finally:
        if scheduler is not None:
            scheduler.stop()
        if extender is not None:
            extender.stop()
        if relays is not None:
            relays.close()
        cp.stop()


def node_of(v: Variant, pod: str) -> str | None:
    return v.cp.get("pod", pod, "-n", v.namespace)["spec"].get("nodeName")


def restarted_and_scheduling(v: Variant) -> None:
    """kube-scheduler restarted starts, and a pod without RDMA resources is scheduled."""
    v.scheduler.restart()
    pod = unique("plain")
    create(v.cp, pod_doc(v.namespace, pod))
    wait_for(lambda: node_of(v, pod), 60, f"{pod} (no RDMA resources) scheduled")
    assert v.scheduler.component is not None and v.scheduler.component.alive()


def rdma_bound(v: Variant, pod: str | None = None) -> str:
    """An RDMA pod (a new one, or ``pod``) bound, through the extender."""
    if pod is None:
        pod = unique("rdma")
        rdma_pod(v.cp, v.namespace, pod, [{"min_tx_rate": 1000}])
    return str(wait_for(lambda: node_of(v, pod), 90, f"{pod} (RDMA) bound"))


# A call to an extender with nothing behind the address: kube-proxy rejects it (connection refused);
# the tier's relay, which stands for the ClusterIP, accepts and then closes (EOF, reset).
NOTHING_THERE = ("connection refused", "EOF", "connection reset by peer")


def rdma_waits(v: Variant, *why: str) -> str:
    """A new RDMA pod stays Pending, its FailedScheduling event naming the failed call to the extender
    with one of ``why``; returns its name."""
    pod = unique("rdma")
    rdma_pod(v.cp, v.namespace, pod, [{"min_tx_rate": 1000}])
    events = wait_for(
        lambda: [
            e
            for e in failed_scheduling(v.cp, v.namespace, pod)
            if '/filter"' in e and any(w in e for w in why)
        ],
        90,
        f"{pod}'s FailedScheduling event saying one of {why!r}",
    )
    assert node_of(v, pod) is None, events
    return pod


def test_the_docs_steps_leave_a_working_variant(variant: Variant) -> None:
    v = variant
    written = yaml.safe_load(v.operator.config.read_text())
    # The operator's profile (with its plugin setting) kept, the extender merged in, nothing read from a file.
    assert written["profiles"] == yaml.safe_load(v.operator.config.read_text())["profiles"]
    assert written["profiles"][0]["plugins"] == {"score": {"disabled": [{"name": "ImageLocality"}]}}
    (ext,) = written["extenders"]
    assert set(ext["tlsConfig"]) == {"serverName", "caData", "certData", "keyData"}
    assert ext["urlPrefix"] == f"https://{cluster_ip(v.cp)}:443"
    assert v.operator.config.stat().st_mode & 0o077 == 0
    rdma_bound(v)
    restarted_and_scheduling(v)


def test_the_operators_certificate_files_removed(variant: Variant, tmp_path: Path) -> None:
    """Nothing of them is read by kube-scheduler: it starts, and RDMA pods are still scheduled."""
    v = variant
    kept = tmp_path / "kept"
    shutil.copytree(v.operator.certs, kept, symlinks=True)
    for path in v.operator.certs.iterdir():
        if path.is_file():
            path.unlink()
    try:
        restarted_and_scheduling(v)
        rdma_bound(v)
    finally:
        for path in kept.iterdir():
            if path.is_file():
                shutil.copy(path, v.operator.certs / path.name)


def test_the_extenders_secret_deleted_and_its_pod_restarted(variant: Variant) -> None:
    """The extender's pod cannot start (the kubelet cannot mount the Secret): the extender is down."""
    v = variant
    v.cp.kubectl("-n", "kube-system", "delete", "secret", SECRET)
    v.extender.stop()
    with pytest.raises(VolumeMissing):
        v.extender.start()
    restarted_and_scheduling(v)
    waiting = rdma_waits(v, *NOTHING_THERE)
    # Mended: the Secret made again as step 3 makes it, the pod started.
    v.operator.run(
        "kubectl -n kube-system create secret tls rdma-cni-scheduler-extender-tls "
        "--cert=extender.crt --key=extender.key\n"
    )
    v.extender.start()
    rdma_bound(v, waiting)


def test_the_service_deleted(variant: Variant) -> None:
    """Its ClusterIP answers no more; a Service made again has another, which step 4 run again writes."""
    v = variant
    old_ip = cluster_ip(v.cp)
    v.cp.kubectl("-n", "kube-system", "delete", "service", "rdma-cni-scheduler-extender")
    v.relays.drop(old_ip)  # kube-proxy's rules go with the Service
    restarted_and_scheduling(v)
    waiting = rdma_waits(v, *NOTHING_THERE)
    v.operator.run("kubectl apply -f conf/base/extender-mtls/scheduler-extender-mtls.yaml\n")
    new_ip = cluster_ip(v.cp)
    assert new_ip != old_ip
    v.operator.run(v.blocks[2])  # step 4, as written: the new ClusterIP
    restarted_and_scheduling(v)
    rdma_bound(v, waiting)


def _swap_secret(v: Variant, cert: str, key: str, cwd: Path) -> None:
    """The docs' renewal block run in ``cwd``, whose extender.crt/extender.key are ``cert``/``key``;
    then the kubelet's sync of the mounted Secret."""
    shutil.copy(cert, cwd / "extender.crt")
    shutil.copy(key, cwd / "extender.key")
    v.operator.run(v.blocks[3], cwd=cwd)
    v.extender.sync()


def test_a_serving_certificate_that_does_not_load(variant: Variant, tmp_path: Path) -> None:
    """The running extender keeps serving its certificate; restarted, it cannot start."""
    v = variant
    certs = v.operator.certs
    # A key of another certificate: kubectl create secret tls would refuse it, the API server does not.
    bad = v.cp.kubectl(
        "-n", "kube-system", "create", "secret", "generic", SECRET, "--type=kubernetes.io/tls",
        f"--from-file=tls.crt={certs / 'extender.crt'}", f"--from-file=tls.key={certs / 'client.key'}",
        "--dry-run=client", "-o", "yaml",
    ).stdout  # fmt: skip
    v.cp.kubectl("apply", "-f", "-", input=bad)
    v.extender.sync()
    wait_for(
        lambda: v.extender.metrics().get("rdma_cni_extender_certificate_reload_failed") == 1.0,
        60,
        "the extender to say it could not load the new files",
    )
    restarted_and_scheduling(v)
    rdma_bound(v)
    # Restarted, the extender cannot load them: down, and RDMA pods wait.
    v.extender.stop()
    with pytest.raises(AssertionError, match="cannot load --tls-cert/--tls-key"):
        v.extender.start()
    waiting = rdma_waits(v, *NOTHING_THERE)
    _swap_secret(v, str(certs / "extender.crt"), str(certs / "extender.key"), tmp_path)
    v.extender.start()
    rdma_bound(v, waiting)


def test_rotation_and_expiry(variant: Variant, tmp_path: Path) -> None:
    """An expired serving certificate: RDMA pods wait with kube-scheduler's x509 error; a renewed one
    in the Secret is served without restarting the extender. kube-scheduler's own client
    certificate expired: step 4 refuses to write it, and, put in place regardless, the extender
    ends the handshake; step 4 with a renewed one mends it."""
    v = variant
    certs = v.operator.certs
    serving_ca = (str(certs / "serving-ca.crt"), str(certs / "serving-ca.key"))
    svc = "rdma-cni-scheduler-extender.kube-system.svc"
    expired = make_cert_dated(
        str(tmp_path), serving_ca, "expired", f"/CN={svc}", client=False, start="20200101000000Z",
        end="20210101000000Z", sans=f"DNS:{svc}",
    )  # fmt: skip
    assert v.extender.component is not None
    pid = v.extender.component.proc.pid if v.extender.component.proc else None
    _swap_secret(v, *expired, tmp_path)
    wait_for(
        lambda: (
            v.extender.metrics().get(
                "rdma_cni_extender_certificate_expiry_timestamp_seconds{certificate=serving}"
            )
            == 1609459200.0
        ),
        60,
        "the extender to serve the new (expired) certificate",
    )
    restarted_and_scheduling(v)
    waiting = rdma_waits(v, "certificate has expired")
    # Renewed: served within the extender's next look at its files, with no restart.
    renewed = make_cert_dated(
        str(tmp_path), serving_ca, "renewed", f"/CN={svc}", client=False, start="20200101000000Z",
        end="20491231000000Z", sans=f"DNS:{svc}",
    )  # fmt: skip
    _swap_secret(v, *renewed, tmp_path)
    rdma_bound(v, waiting)
    assert v.extender.component.proc is not None and v.extender.component.proc.pid == pid
    assert v.extender.metrics()["rdma_cni_extender_certificate_reloads_total{outcome=loaded}"] >= 2

    # kube-scheduler's client certificate, expired: step 4 refuses it and writes nothing.
    client_ca = (str(certs / "client-ca.crt"), str(certs / "client-ca.key"))
    old_client = make_cert_dated(
        str(tmp_path), client_ca, "old-client", "/CN=rdma-cni-kube-scheduler", client=True,
        start="20200101000000Z", end="20210101000000Z",
    )  # fmt: skip
    before = v.operator.config.read_text()
    run_dir = tmp_path / "step4"
    run_dir.mkdir()
    for name in ("serving-ca.crt",):
        shutil.copy(certs / name, run_dir / name)
    shutil.copy(old_client[0], run_dir / "client.crt")
    shutil.copy(old_client[1], run_dir / "client.key")
    refused = v.operator.run(v.blocks[2], cwd=run_dir, check=False)
    assert refused.returncode != 0 and "expired on 2021-01-01" in refused.stderr, refused.stderr
    assert v.operator.config.read_text() == before
    # Time passes over a file written when it was valid: the same file, the client certificate expired.
    config = yaml.safe_load(before)
    tls = config["extenders"][0]["tlsConfig"]
    tls["certData"] = base64.b64encode(Path(old_client[0]).read_bytes()).decode()
    tls["keyData"] = base64.b64encode(Path(old_client[1]).read_bytes()).decode()
    v.operator.config.write_text(yaml.safe_dump(config))
    try:
        restarted_and_scheduling(v)
        waiting = rdma_waits(v, "remote error: tls")
    finally:
        v.operator.config.write_text(before)
    # Renewed: step 4 as written, with a valid client certificate (the one step 1 made), and a restart.
    v.operator.run(v.blocks[2])
    restarted_and_scheduling(v)
    rdma_bound(v, waiting)
    seen = v.extender.metrics()["rdma_cni_extender_certificate_expiry_timestamp_seconds{certificate=client}"]
    assert seen > time.time()


def test_what_does_stop_kube_scheduler(variant: Variant) -> None:
    """A configuration kube-scheduler cannot read stops it: inline key data that does not match (step 4
    refuses to write that), and, as before this variant's change, a certFile that is missing."""
    v = variant
    good = v.operator.config.read_text()
    config = yaml.safe_load(good)
    tls = config["extenders"][0]["tlsConfig"]
    try:
        certs = v.operator.certs
        tls["keyData"] = base64.b64encode((certs / "extender.key").read_bytes()).decode()
        v.operator.config.write_text(yaml.safe_dump(config))
        v.scheduler.stop()
        log = v.scheduler.exit_log()
        assert "couldn't build extenders" in log and "private key does not match public key" in log, log
        # The files variant: kube-scheduler reads certFile/keyFile/caFile at start; one missing stops it.
        tls.pop("keyData"), tls.pop("certData"), tls.pop("caData")
        tls.update(
            certFile=str(certs / "client.crt"),
            keyFile=str(certs / "gone.key"),
            caFile=str(certs / "serving-ca.crt"),
        )
        v.operator.config.write_text(yaml.safe_dump(config))
        log = v.scheduler.exit_log()
        assert "couldn't build extenders" in log and "gone.key: no such file or directory" in log, log
    finally:
        v.operator.config.write_text(good)
    restarted_and_scheduling(v)
    rdma_bound(v)
