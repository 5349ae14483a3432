"""The extender's TLS files: expiry read from the DER, a rotated certificate served without a restart.

Real certificates (openssl), a real TLS server (the extender's own), real handshakes: after the
files change, the next connection is served with the new certificate; files that do not load
leave the old one serving and say so (log, counter, gauge); the expiry of the serving
certificate, the client CA and the client certificate kube-scheduler presented are on /metrics.
"""

from __future__ import annotations

import calendar
import logging
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rdma_cni.extender import metrics
from rdma_cni.extender.certs import (
    CertificateError,
    ServingTls,
    TlsFilesError,
    not_after,
    read_not_after,
)
from rdma_cni.extender.service import Service
from tests.support.apiserver import make_ca, make_cert, make_cert_dated


def _openssl_end(path: Path) -> float:
    """openssl's own reading of a certificate's notAfter, as Unix seconds."""
    text = subprocess.run(
        ["openssl", "x509", "-noout", "-enddate", "-in", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return float(ssl.cert_time_to_seconds(text.split("=", 1)[1]))


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    ca = make_ca(str(tmp_path / "serving"), common_name="serving CA")
    client_ca = make_ca(str(tmp_path / "client"), common_name="client CA")
    cert, key = make_cert(str(tmp_path / "serving"), ca, "server", "/CN=extender", client=False)
    ccert, ckey = make_cert(str(tmp_path / "client"), client_ca, "sched", "/CN=kube-scheduler", client=True)
    return {
        "ca": Path(ca[0]),
        "ca_key": Path(ca[1]),
        "client_ca": Path(client_ca[0]),
        "cert": Path(cert),
        "key": Path(key),
        "client_cert": Path(ccert),
        "client_key": Path(ckey),
    }


def test_not_after_agrees_with_openssl(pki: dict[str, Path], tmp_path: Path) -> None:
    for name in ("ca", "cert", "client_ca", "client_cert"):
        assert read_not_after(str(pki[name])) == [_openssl_end(pki[name])], name
    # GeneralizedTime (years from 2050) and UTCTime both read.
    ca = (str(pki["ca"]), str(pki["ca_key"]))
    late, _ = make_cert_dated(
        str(tmp_path), ca, "late", "/CN=late", client=False, start="20200101000000Z", end="20600101000000Z"
    )
    assert read_not_after(late) == [calendar.timegm((2060, 1, 1, 0, 0, 0))]
    # A bundle: every certificate, in order.
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(pki["cert"].read_bytes() + Path(late).read_bytes())
    assert read_not_after(str(bundle)) == [_openssl_end(pki["cert"]), _openssl_end(Path(late))]


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"not a certificate", "no PEM certificate"),
        (b"-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n", "not base64"),
        (b"-----BEGIN CERTIFICATE-----\nMAIwAA==\n-----END CERTIFICATE-----\n", "no validity"),
        (b"-----BEGIN CERTIFICATE-----\nMIIBAAA=\n-----END CERTIFICATE-----\n", "truncated DER"),
        (b"-----BEGIN CERTIFICATE-----\nAgEB\n-----END CERTIFICATE-----\n", "not a certificate"),
    ],
)
def test_unreadable_certificates_say_why(tmp_path: Path, content: bytes, error: str) -> None:
    path = tmp_path / "c.pem"
    path.write_bytes(content)
    with pytest.raises(CertificateError, match=error):
        read_not_after(str(path))


def test_der_edge_cases() -> None:
    with pytest.raises(CertificateError, match="bad DER length"):
        not_after(b"\x30\x85\x00\x00\x00\x00\x00")
    # A validity time that is not UTC, and one of another type.
    tbs = b"\x02\x01\x01" + b"\x30\x00" + b"\x30\x00"
    for when in (b"\x17\x0b" + b"2001010000Z"[:11], b"\x17\x0d2001010000000", b"\x04\x0f20200101000000Z"):
        validity = b"\x30" + bytes([len(when) * 2]) + when + when
        body = tbs + validity
        der = b"\x30" + bytes([len(body) + 2]) + b"\x30" + bytes([len(body)]) + body
        with pytest.raises(CertificateError, match="bad validity time"):
            not_after(der)


def test_a_file_over_the_bound_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.pem"
    path.write_bytes(b"x" * (1024 * 1024 + 1))
    with pytest.raises(CertificateError, match="over 1048576 bytes"):
        read_not_after(str(path))


def test_files_that_do_not_load_are_refused_at_start(pki: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(TlsFilesError, match="cannot load --tls-cert/--tls-key"):
        ServingTls(str(pki["cert"]), str(pki["client_key"]), str(pki["client_ca"]))
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    with pytest.raises(TlsFilesError, match="cannot load --client-ca"):
        ServingTls(str(pki["cert"]), str(pki["key"]), str(empty))


def _served_end(port: int, pki: dict[str, Path]) -> float:
    """The notAfter of the certificate the server presents now, read by a real client handshake."""
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    ctx.check_hostname = False
    ctx.load_cert_chain(str(pki["client_cert"]), str(pki["client_key"]))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw) as tls,
    ):
        tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert tls.recv(100).startswith(b"HTTP/1.1 200")
        return float(ssl.cert_time_to_seconds(tls.getpeercert()["notAfter"]))


def _samples(name: str) -> dict[str, float]:
    page = generate_latest(metrics.REGISTRY).decode()
    return {
        "/".join(s.labels.values()): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name == name
    }


def _swap(path: Path, content: bytes) -> None:
    """Replace a file as the kubelet does a Secret's: a new file renamed over the name (a new inode)."""
    new = path.with_suffix(".new")
    new.write_bytes(content)
    os.replace(new, path)


def test_a_rotated_certificate_is_served_without_a_restart(
    pki: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    live = tmp_path / "live"
    live.mkdir()
    for name in ("cert", "key", "client_ca"):
        shutil.copy(pki[name], live / name)
    tls = ServingTls(str(live / "cert"), str(live / "key"), str(live / "client_ca"))
    service = Service(
        client=None,
        listen=("127.0.0.1", 0),
        serving_tls=tls,
        pod_watch=False,
    )
    metrics.watch(service)
    service.extender.ready.set()
    # The HTTPS server alone: nothing here needs the API (no cache, no pod watch).
    threading.Thread(target=service.server.serve_forever, daemon=True).start()
    try:
        port = service.address[1]
        first = _served_end(port, pki)
        assert first == _openssl_end(pki["cert"])
        assert not service.check_tls()  # nothing changed
        seen = _samples("rdma_cni_extender_certificate_expiry_timestamp_seconds")
        assert seen == {
            "client": _openssl_end(pki["client_cert"]),
            "client_ca": _openssl_end(pki["client_ca"]),
            "serving": first,
        }

        # A new certificate and key, from the same CA, valid longer: served from the next connection.
        ca = (str(pki["ca"]), str(pki["ca_key"]))
        cert, key = make_cert_dated(
            str(tmp_path),
            ca,
            "next",
            "/CN=extender",
            client=False,
            start="20200101000000Z",
            end="20491231000000Z",
        )
        _swap(live / "key", Path(key).read_bytes())
        _swap(live / "cert", Path(cert).read_bytes())
        assert service.check_tls()
        assert _served_end(port, pki) == calendar.timegm((2049, 12, 31, 0, 0, 0)) != first
        assert _samples("rdma_cni_extender_certificate_reloads_total") == {"failed": 0, "loaded": 1}
        assert _samples("rdma_cni_extender_certificate_expiry_timestamp_seconds")["serving"] == (
            calendar.timegm((2049, 12, 31, 0, 0, 0))
        )

        # A key that does not match: the previous certificate keeps being served, and that is said.
        caplog.set_level(logging.ERROR, logger="rdma_cni.extender")
        _swap(live / "key", pki["client_key"].read_bytes())
        assert not service.check_tls()
        assert _served_end(port, pki) == calendar.timegm((2049, 12, 31, 0, 0, 0))
        assert _samples("rdma_cni_extender_certificate_reload_failed") == {"": 1.0}
        assert _samples("rdma_cni_extender_certificate_reloads_total") == {"failed": 1, "loaded": 1}
        assert "do not load" in caplog.text and "still serving the previous certificate" in caplog.text
        # The same broken files are not tried again; the fix is loaded.
        assert not service.check_tls()
        assert tls.reloads["failed"] == 1
        _swap(live / "key", Path(key).read_bytes())
        assert service.check_tls()
        assert _samples("rdma_cni_extender_certificate_reload_failed") == {"": 0.0}
    finally:
        service.server.shutdown()
        service.server.server_close()


def test_the_housekeeping_thread_reloads_by_itself(pki: dict[str, Path], tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    for name in ("cert", "key"):
        shutil.copy(pki[name], live / name)
    tls = ServingTls(str(live / "cert"), str(live / "key"), None)
    service = Service(
        client=None,
        listen=("127.0.0.1", 0),
        serving_tls=tls,
        pod_watch=False,
        sweep_interval=0.05,
        tls_check_interval=0.1,
        pod_check_interval=3600.0,
    )
    started = service.server.tls
    # The housekeeping thread alone (reservations' TTL, the TLS files): nothing here needs the API.
    threading.Thread(target=service._housekeeping, daemon=True).start()
    try:
        ca = (str(pki["ca"]), str(pki["ca_key"]))
        cert, key = make_cert_dated(
            str(tmp_path),
            ca,
            "next",
            "/CN=extender",
            client=False,
            start="20200101000000Z",
            end="20450101000000Z",
        )
        _swap(live / "key", Path(key).read_bytes())
        _swap(live / "cert", Path(cert).read_bytes())
        deadline = time.monotonic() + 10
        while service.server.tls is started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.server.tls is tls.context is not started
        assert tls.expiry == {"serving": calendar.timegm((2045, 1, 1, 0, 0, 0))}
    finally:
        service.stopping.set()
        service.server.server_close()


def test_a_file_gone_keeps_the_old_context_and_an_unreadable_expiry_is_said(
    pki: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    live = tmp_path / "live"
    live.mkdir()
    for name in ("cert", "key"):
        shutil.copy(pki[name], live / name)
    tls = ServingTls(str(live / "cert"), str(live / "key"), None)
    before = tls.context
    # A Secret deleted: the files go (a pod's mounted files stay, but a hand-made mount may not).
    (live / "key").unlink()
    assert not tls.check() and tls.failing and tls.context is before
    assert "No such file" in tls.last_error or "cannot load" in tls.last_error
    # Files that load but whose expiry cannot be read: served, the metric left as it was, said.
    from rdma_cni.extender import certs

    def unreadable(path: str) -> list[float]:
        raise CertificateError(f"{path}: no validity")

    monkeypatch.setattr(certs, "read_not_after", unreadable)
    caplog.set_level(logging.WARNING, logger="rdma_cni.extender")
    shutil.copy(pki["key"], live / "key")
    assert tls.check() and not tls.failing
    assert tls.expiry == {"serving": _openssl_end(pki["cert"])}
    assert "cannot read the expiry of" in caplog.text
