"""The fault tier's hostile-client family: the extender's HTTP side under floods, slow and huge bodies.

The built extender process serves TLS on loopback, with the API stand-in
behind it; a client playing kube-scheduler keeps one connection alive (as
Go's client does) and filters all along, while hostile clients open
thousands of connections that stop in the TLS handshake, trickle headers and
bodies, and send bodies of the maximum size or announce larger ones. Judged
throughout: the process tree's RSS and thread count stay under their bounds,
and every legitimate filter is answered, within 10 s (kube-scheduler's
patience), with the right answer. Everything is bounded in count and time and
stays on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.extender import server as srv
from rdma_cni.shared import nodestate
from tests.faults.knobs import STATS, scaled
from tests.integration.test_extender_process import Extender, _request, start
from tests.support import sched_objects as so
from tests.support.apiserver import ApiServer

if not os.environ.get("RDMA_CNI_BINARY"):
    pytest.skip(
        "the fault tier drives the built binary (make faults sets RDMA_CNI_BINARY)", allow_module_level=True
    )

# Bounds judged on the extender's process tree (a one-file binary is a bootloader and its child).
RSS_BOUND_MIB = 400  # the Deployment's limit is 512 MiB
THREADS_BOUND = srv.MAX_CONNECTIONS + srv.MAX_CONNECTIONS // 4 + 32
PATIENCE = 10.0  # seconds kube-scheduler waits for an extender


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
    return pids


def _usage(pid: int) -> tuple[float, int]:
    """(RSS in MiB, threads) summed over the process tree."""
    rss = threads = 0
    for p in _tree(pid):
        with contextlib.suppress(OSError), open(f"/proc/{p}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1])
                elif line.startswith("Threads:"):
                    threads += int(line.split()[1])
    return rss / 1024, threads


class Watch:
    """Samples the process tree every 50 ms and keeps the peaks."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.rss = 0.0
        self.threads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            rss, threads = _usage(self.pid)
            self.rss, self.threads = max(self.rss, rss), max(self.threads, threads)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Scheduler:
    """kube-scheduler's side: one kept-alive TLS connection, filters timed against its patience."""

    def __init__(self, ext: Extender, pod: dict[str, Any]) -> None:
        self.ext = ext
        self.doc = so.args_names(pod, ["n1", "n2"])
        self.conn = ext.conn()
        self.latencies: list[float] = []
        self.problems: list[str] = []

    def filter(self, fresh: bool = False) -> None:
        conn = self.ext.conn() if fresh else self.conn
        start_ = time.monotonic()
        try:
            conn.request(
                "POST", "/filter", body=json.dumps(self.doc), headers={"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            out = json.loads(resp.read())
            if resp.status != 200 or out.get("NodeNames") != ["n1"]:
                self.problems.append(f"filter answered {resp.status} {out}")
        except Exception as exc:
            self.problems.append(f"{'fresh' if fresh else 'kept'} filter failed: {type(exc).__name__}: {exc}")
            if not fresh:
                self.conn = self.ext.conn()
        finally:
            if fresh:
                conn.close()
        took = time.monotonic() - start_
        self.latencies.append(took)
        if took > PATIENCE:
            self.problems.append(f"a filter took {took:.1f} s")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Extender, Scheduler]]:
    with ApiServer() as api:
        full = nodestate.encode(so.state([("ens1f0", 25_000, 4)], [("x", [("ens1f0", 24_000, 4)])]))
        for name, text in (("n1", nodestate.encode(so.state([("ens1f0", 25_000, 4)]))), ("n2", full)):
            api.add_node(name, annotations={nodestate.ANNOTATION: text}, images=0)
        ext = start(tmp_path, api, "--max-state-age", "3600", tls=True)
        try:
            ext.wait_ready()
            scheduler = Scheduler(ext, _request(api, "legit", [(5_000, 0)]))
            scheduler.filter()  # the kept connection has completed a request
            yield ext, scheduler
        finally:
            ext.proc.kill()
            ext.proc.wait(10)


def _judge(family: str, watch: Watch, scheduler: Scheduler, inputs: int) -> None:
    watch.stop()
    stats = STATS.setdefault(family, Counter())
    stats["inputs"] += inputs
    stats["cycles"] += len(scheduler.latencies)
    problems = list(scheduler.problems)
    if watch.rss > RSS_BOUND_MIB:
        problems.append(f"RSS reached {watch.rss:.0f} MiB (bound {RSS_BOUND_MIB})")
    if watch.threads > THREADS_BOUND:
        problems.append(f"{watch.threads} threads (bound {THREADS_BOUND})")
    stats["violations"] += len(problems)
    print(
        f"{family}: {inputs} hostile inputs, {len(scheduler.latencies)} filters, slowest "
        f"{max(scheduler.latencies):.2f} s, peak RSS {watch.rss:.0f} MiB, peak threads {watch.threads}"
    )
    assert not problems, problems


def _connect(port: int, first: bytes) -> socket.socket | None:
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(first)
        return sock
    except OSError:
        return None


def test_connection_flood(served: tuple[Extender, Scheduler]) -> None:
    """Thousands of connections stop after 3 bytes of a ClientHello (or idle, or mid-headers)."""
    ext, scheduler = served
    watch = Watch(ext.proc.pid)
    count = scaled(2_000)
    firsts = [b"\x16\x03\x01", b"", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"]
    opened: list[socket.socket] = []
    done = threading.Event()

    def flood() -> None:
        for i in range(count):
            sock = _connect(ext.port, firsts[i % len(firsts)])
            if sock is not None:
                opened.append(sock)
        done.set()

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        while not done.is_set():
            scheduler.filter()
            scheduler.filter(fresh=True)  # a new connection during the flood is admitted too
            time.sleep(0.05)
        # All open now: the server ends them (evicted at the cap, or at the handshake deadline).
        deadline = time.monotonic() + srv.HANDSHAKE_TIMEOUT + 3
        while time.monotonic() < deadline:
            scheduler.filter()
            time.sleep(0.2)
        closed = 0
        for sock in opened:
            sock.settimeout(0.01)
            try:
                closed += sock.recv(1) == b""
            except (TimeoutError, BlockingIOError):
                pass
            except OSError:
                closed += 1
        if closed != len(opened):
            scheduler.problems.append(f"{len(opened) - closed} of {len(opened)} flood connections still open")
    finally:
        thread.join()
        for sock in opened:
            sock.close()
    _judge("hostile: connection flood", watch, scheduler, count)


def test_slow_and_oversized_bodies(served: tuple[Extender, Scheduler]) -> None:
    """Bodies trickling in, bodies of the maximum size at once, and larger ones announced."""
    ext, scheduler = served
    watch = Watch(ext.proc.pid)
    slow_count, big_count, huge_count = scaled(200), scaled(24), scaled(50)
    # Slow: a 1 MiB body announced, a few bytes sent, then one byte a second; headers trickling.
    slow = [
        _connect(ext.port, b'POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 1048576\r\n\r\n{"Pod":')
        if i % 2
        else _connect(ext.port, b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Le")
        for i in range(slow_count)
    ]

    # Plain TCP to a TLS server would be refused at the handshake: the bodies go over TLS.
    def big(i: int) -> None:
        fill = (srv.MAX_BODY - 64) // 3
        body = b'{"Pod":{"x":[' + b",".join([b"{}"] * fill) + b']},"NodeNames":[]}'
        conn = ext.conn()
        with contextlib.suppress(OSError, ssl.SSLError):
            conn.request("POST", "/filter", body=body)
            conn.getresponse().read()
        conn.close()

    def huge(i: int) -> None:
        conn = ext.conn()
        with contextlib.suppress(OSError, ssl.SSLError):
            conn.putrequest("POST", "/filter")
            conn.putheader("Content-Length", str(2 << 30))
            conn.putheader("Expect", "100-continue")
            conn.endheaders()
            resp = conn.getresponse()
            if resp.status != 413:
                scheduler.problems.append(f"2 GiB announced: {resp.status}, not 413")
        conn.close()

    workers = [threading.Thread(target=big, args=(i,), daemon=True) for i in range(big_count)]
    workers += [threading.Thread(target=huge, args=(i,), daemon=True) for i in range(huge_count)]
    for w in workers:
        w.start()
    started = time.monotonic()
    try:
        # Past the request deadline: every slow connection has been ended by the server.
        while time.monotonic() - started < srv.REQUEST_TIMEOUT + 3:
            for sock in slow:
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.send(b" ")
            scheduler.filter()
            time.sleep(0.5)
        for w in workers:
            w.join(60)
        open_ = 0
        for sock in slow:
            if sock is None:
                continue
            sock.settimeout(0.01)
            try:
                while chunk := sock.recv(65536):
                    if b" 503 " in chunk or b" 413 " in chunk:
                        break
                else:
                    continue
            except (TimeoutError, BlockingIOError):
                open_ += 1
            except OSError:
                pass
        if open_:
            scheduler.problems.append(f"{open_} slow connections still open after the request deadline")
    finally:
        for sock in slow:
            if sock is not None:
                sock.close()
    _judge("hostile: slow and huge bodies", watch, scheduler, slow_count + big_count + huge_count)
