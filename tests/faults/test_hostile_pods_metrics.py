"""The fault tier's "hostile pods" family, metrics: stalled connections to a ``/metrics`` page.

A pod on the cluster network can reach the metrics ports (the agent's listens on
the node's address, on the host network). prometheus_client's own server kept a
thread per connection for ever, so 1,500 connections that never finished their
headers held 1,500 threads, and about 3,500 reached the agent's 128 Mi. Both
pages are now served by the extender's bounded listener; this drives the built
extender (the agent serves its page through the same code, rdma_cni/httpd/exporter.py):
thousands of connections that send nothing, half a request line, or headers
without their end, while a Prometheus-like scraper keeps its connection alive and
scrapes all along. Judged: the process tree's threads and RSS stay within the
cap's, every scrape is answered within 2 s, and a new scraper is admitted once
the flood is in place. Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdma_cni.httpd import exporter
from tests.faults.knobs import STATS, scaled
from tests.faults.test_hostile_connections import Watch, _usage
from tests.integration.test_extender_process import Extender, start
from tests.support.apiserver import ApiServer

if not os.environ.get("RDMA_CNI_BINARY"):
    pytest.skip(
        "the fault tier drives the built binary (make faults sets RDMA_CNI_BINARY)", allow_module_level=True
    )

FAMILY = "hostile pods"
# Threads the page may add: its cap and the quarter more whose connections are ending.
THREADS_ADDED = exporter.MAX_CONNECTIONS + exporter.MAX_CONNECTIONS // 4 + 2
RSS_ADDED_MIB = 24  # 1,500 threads took ~50 MiB; the cap's take a few
ANSWER_BOUND = 2.0  # seconds for a scrape, during the flood too
FIRSTS = [
    b"",
    b"GET /metr",
    b"GET /metrics HTTP/1.1\r\nHost: x\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: ",
]


@pytest.fixture
def extender(tmp_path: Path) -> Iterator[tuple[Extender, int]]:
    with ApiServer() as api:
        ext = start(tmp_path, api, "--metrics-listen", "127.0.0.1:0")
        try:
            ext.wait_ready()
            yield ext, int(ext.announced["metrics"].rsplit(":", 1)[1])
        finally:
            ext.proc.kill()
            ext.proc.wait(10)


def _scrape(conn: http.client.HTTPConnection, problems: list[str], label: str) -> float:
    started = time.monotonic()
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        page = resp.read()
        if resp.status != 200 or b"rdma_cni_extender_ready 1.0" not in page:
            problems.append(f"{label} scrape answered {resp.status}: {page[:100]!r}")
    except OSError as exc:
        problems.append(f"{label} scrape failed: {type(exc).__name__}: {exc}")
    took = time.monotonic() - started
    if took > ANSWER_BOUND:
        problems.append(f"{label} scrape took {took:.2f} s")
    return took


def test_stalled_metrics_connections(extender: tuple[Extender, int]) -> None:
    ext, port = extender
    problems: list[str] = []
    scraper = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    _scrape(scraper, problems, "first")
    rss_before, threads_before = _usage(ext.proc.pid)
    watch = Watch(ext.proc.pid)
    count = scaled(1_500)
    opened: list[socket.socket] = []
    done = threading.Event()

    def flood() -> None:
        for i in range(count):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=30)
                sock.sendall(FIRSTS[i % len(FIRSTS)])
                opened.append(sock)
            except OSError:
                pass
        done.set()

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    times: list[float] = []
    try:
        while not done.is_set():
            times.append(_scrape(scraper, problems, "kept-alive"))
            time.sleep(0.05)
        time.sleep(0.5)
        fresh = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        times.append(_scrape(fresh, problems, "new"))
        fresh.close()
        times.append(_scrape(scraper, problems, "kept-alive"))
    finally:
        thread.join()
        watch.stop()
        scraper.close()
        for sock in opened:
            sock.close()
    if watch.threads - threads_before > THREADS_ADDED:
        problems.append(f"{watch.threads - threads_before} threads added (bound {THREADS_ADDED})")
    if watch.rss - rss_before > RSS_ADDED_MIB:
        problems.append(f"RSS grew {watch.rss - rss_before:.0f} MiB (bound {RSS_ADDED_MIB})")
    stats = STATS.setdefault(FAMILY, Counter())
    stats["inputs"] += count
    stats["cycles"] += len(times)
    stats["violations"] += len(problems)
    print(
        f"{FAMILY}: {count} stalled metrics connections ({len(opened)} opened), {len(times)} scrapes, "
        f"slowest "
        f"{max(times):.2f} s, threads {threads_before} -> peak {watch.threads}, RSS {rss_before:.0f} -> "
        f"peak {watch.rss:.0f} MiB"
    )
    assert not problems, problems
