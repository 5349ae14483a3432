"""rdma_cni.httpd.exporter: what the agent's and the extender's /metrics share."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from rdma_cni.httpd import exporter


class _Fixed:
    def __init__(self, name: str) -> None:
        self.name = name

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily(self.name, "a test gauge", value=1.0)


def test_watching_another_collector_replaces_the_first() -> None:
    registry = CollectorRegistry()
    slot = exporter.CollectorSlot(registry)
    slot.watch(_Fixed("first"))
    assert registry.get_sample_value("first") == 1.0
    slot.watch(_Fixed("second"))
    assert registry.get_sample_value("first") is None
    assert registry.get_sample_value("second") == 1.0


def test_serve_answers_metrics_until_shut_down() -> None:
    registry = CollectorRegistry()
    exporter.CollectorSlot(registry).watch(_Fixed("served_gauge"))
    server = exporter.serve(registry, ("127.0.0.1", 0))
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert b"served_gauge 1.0" in resp.read()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("value", "expected"),
    [("127.0.0.1:9101", ("127.0.0.1", 9101)), (":80", ("0.0.0.0", 80)), ("[::1]:0", ("::1", 0))],
)
def test_address_option(value: str, expected: tuple[str, int]) -> None:
    assert exporter.address_option("--metrics-listen", "0.0.0.0:9101")(value) == expected


@pytest.mark.parametrize("value", ["9101", "host:", "host:http", "host:65536", "host:-1"])
def test_address_option_refuses_what_is_not_addr_port(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as info:
        exporter.address_option("--listen", "127.0.0.1:8888")(value)
    assert str(info.value) == f"--listen {value!r}: expected ADDR:PORT, e.g. 127.0.0.1:8888"


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _scrape(conn: http.client.HTTPConnection) -> tuple[int, bytes, float]:
    started = time.monotonic()
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    return resp.status, resp.read(), time.monotonic() - started


@pytest.fixture
def page() -> Iterator[Any]:
    registry = CollectorRegistry()
    exporter.CollectorSlot(registry).watch(_Fixed("served_gauge"))
    server = exporter.serve(registry, ("127.0.0.1", 0), request_timeout=1.0, idle_timeout=2.0)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_stalled_connections_keep_threads_and_memory_bounded_and_scrapes_answered(page: Any) -> None:
    """1,500 connections that never finish their headers (prometheus_client's server kept a thread each)."""
    port = page.server_address[1]
    cap = page.max_connections
    # A scraper answered before the flood keeps its connection through it (it never gives way).
    scraper = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    assert _scrape(scraper)[0] == 200
    threads, rss = threading.active_count(), _rss_kib()
    peak = 0
    stalled = []
    try:
        for i in range(1_500):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall([b"", b"GET /metrics HTTP/1.1\r\n", b"GET /metr"][i % 3])
            stalled.append(sock)
            if i % 100 == 0:
                peak = max(peak, threading.active_count() - threads)
                status, body, took = _scrape(scraper)
                assert status == 200 and b"served_gauge 1.0" in body and took < 2
        assert page.connections() <= cap + cap // 4
        # Every one was accepted and ended: pushed out at the cap, closed at once, or at its deadline.
        deadline = time.monotonic() + 10
        while page.evicted + page.refused + page.reaped < 1_500 - cap and time.monotonic() < deadline:
            time.sleep(0.05)
            peak = max(peak, threading.active_count() - threads)
        assert page.evicted + page.refused + page.reaped >= 1_500 - cap
        assert peak <= cap + cap // 4 + 1, peak
        # 1,500 threads would hold tens of MiB; the cap's threads hold a few.
        assert _rss_kib() - rss < 16 * 1024
        # With all 1,500 open, a new scraper is admitted (a stalled connection gives way) and answered.
        fresh = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        status, body, took = _scrape(fresh)
        fresh.close()
        assert status == 200 and b"served_gauge 1.0" in body and took < 2
    finally:
        scraper.close()
        for sock in stalled:
            sock.close()


def test_a_stalled_connection_is_closed_at_its_deadline(page: Any) -> None:
    port = page.server_address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and no blank line
        started = time.monotonic()
        assert sock.recv(100) == b""
        assert time.monotonic() - started < 2.5  # the 1 s request deadline, and the reaper's slack


@pytest.mark.parametrize(
    ("request_bytes", "status", "closed"),
    [
        (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", b"405", True),
        (b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"405", True),
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"404", False),
        (
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
            b"400",
            True,
        ),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", b"200", True),
    ],
)
def test_the_page_answers_get_metrics_only(
    page: Any, request_bytes: bytes, status: bytes, closed: bool
) -> None:
    port = page.server_address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request_bytes + b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        out = b""
        sock.settimeout(1.5)
        with contextlib.suppress(TimeoutError):
            while chunk := sock.recv(65536):
                out += chunk
    assert out.startswith(b"HTTP/1.1 " + status + b" ")
    # Refused (or a body left unread): one answer and the connection closed; else the next is served.
    assert out.count(b"HTTP/1.1 ") == (1 if closed else 2)
    assert (b"\r\nConnection: close\r\n" in out.split(b"\r\n\r\n", 1)[0] + b"\r\n") == closed
