"""What a second agent on a node waits for (agent/takeover.py): the wait, the metrics port, NRI's lock."""

from __future__ import annotations

import errno
import itertools
import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from rdma_cni.agent import metrics, takeover
from rdma_cni.agent.nri.plugin import NriPlugin
from rdma_cni.agent.takeover import HELD, FileLock, MetricsPort, take_over
from tests.support.waiting import wait_for


@pytest.fixture(autouse=True)
def _held() -> Iterator[None]:
    saved = dict(HELD)
    HELD.clear()
    yield
    HELD.clear()
    HELD.update(saved)


def test_a_wait_ends_when_the_part_is_free_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    answers = iter([False, False, False, True])
    caplog.set_level(logging.INFO, "rdma_cni.agent")
    assert take_over("cni", lambda: next(answers), threading.Event(), poll=0.01, max_poll=0.02)
    assert HELD == {"cni": True}
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "held by another agent" in m] == [
        "the CNI server's socket: held by another agent on this node; taking it over when it lets go"
    ]
    assert len([m for m in messages if "taken over after" in m]) == 1


def test_a_part_free_at_once_is_taken_without_a_word(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "rdma_cni.agent")
    assert take_over("nri", lambda: True, threading.Event())
    assert HELD == {"nri": True} and caplog.records == []


def test_a_wait_ends_when_the_agent_stops() -> None:
    stop = threading.Event()
    tries: list[float] = []

    def attempt() -> bool:
        tries.append(time.monotonic())
        if len(tries) == 3:
            stop.set()
        return False

    assert not take_over("metrics", attempt, stop, poll=0.01, max_poll=0.01)
    assert len(tries) == 3 and HELD == {"metrics": False}


def test_the_tries_back_off_to_max_poll() -> None:
    stop = threading.Event()
    tries: list[float] = []

    def attempt() -> bool:
        tries.append(time.monotonic())
        if len(tries) == 6:
            stop.set()
        return False

    take_over("metrics", attempt, stop, poll=0.01, max_poll=0.04)
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert gaps[0] < 0.035 and all(g >= 0.035 for g in gaps[3:])


def test_a_wait_that_lasts_too_long_is_said_once_more_as_an_error(caplog: pytest.LogCaptureFixture) -> None:
    stop = threading.Event()
    count = [0]

    def attempt() -> bool:
        count[0] += 1
        return count[0] > 8

    caplog.set_level(logging.INFO, "rdma_cni.agent")
    assert take_over("nri", attempt, stop, poll=0.01, max_poll=0.01, long_wait=0.02)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ["the NRI registration: still held by another agent after 0 s; still waiting"]


def test_a_part_that_cannot_be_taken_ends_the_wait(caplog: pytest.LogCaptureFixture) -> None:
    def attempt() -> bool:
        raise OSError(errno.EACCES, "Permission denied")

    assert not take_over("cni", attempt, threading.Event())
    assert HELD == {"cni": False}
    assert "cannot take it over: [Errno 13] Permission denied" in caplog.text


def test_a_file_lock_is_exclusive_until_released(tmp_path: Any) -> None:
    first, second = FileLock(str(tmp_path / "x.lock")), FileLock(str(tmp_path / "x.lock"))
    assert first.try_acquire()
    assert not second.try_acquire()
    first.release()
    first.release()  # twice is harmless
    assert second.try_acquire()
    second.release()
    with pytest.raises(FileNotFoundError):
        FileLock(str(tmp_path / "missing" / "x.lock")).try_acquire()


# The metrics port, on loopback.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def test_a_busy_metrics_port_is_taken_over_once_the_other_agent_frees_it() -> None:
    address = ("127.0.0.1", _free_port())
    stop = threading.Event()
    old, new = MetricsPort(address, metrics.serve), MetricsPort(address, metrics.serve)
    try:
        assert old.start(stop)
        assert not new.start(stop)  # busy: no error, the wait goes on in the background
        assert new.server is None and HELD["metrics"] is False
        time.sleep(0.5)
        assert new.server is None
        old.close()
        wait_for(lambda: new.server is not None, 10, "the new agent to take the port over")
        assert HELD["metrics"] is True
        assert 'rdma_cni_agent_serving{part="metrics"} 1.0' in _scrape(address[1])
    finally:
        stop.set()
        new.close()
        old.close()


def test_a_metrics_address_the_node_lacks_is_an_error_not_a_wait() -> None:
    port = MetricsPort(("192.0.2.1", _free_port()), metrics.serve)  # TEST-NET-1: on no interface here
    with pytest.raises(OSError) as caught:
        port.start(threading.Event())
    assert caught.value.errno == errno.EADDRNOTAVAIL


def test_a_port_freed_after_the_agent_stopped_is_let_go_at_once() -> None:
    address = ("127.0.0.1", _free_port())
    port = MetricsPort(address, metrics.serve)
    port.close()  # the agent stopped while its background wait was binding
    assert port._attempt()
    assert port.server is None
    with socket.socket() as s:
        s.bind(address)  # free again


def test_a_wait_for_the_metrics_port_ends_with_the_agent() -> None:
    address = ("127.0.0.1", _free_port())
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(address)
    holder.listen(1)
    stop = threading.Event()
    port = MetricsPort(address, metrics.serve)
    try:
        assert not port.start(stop)
        stop.set()
        waiter = [t for t in threading.enumerate() if t.name == "metrics-takeover"]
        for t in waiter:
            t.join(5)
        assert not any(t.is_alive() for t in waiter)
        assert port.server is None
    finally:
        holder.close()
        port.close()


def test_the_serving_gauge_reports_each_part() -> None:
    from prometheus_client import generate_latest

    HELD.update(cni=True, nri=False)
    page = generate_latest(metrics.REGISTRY).decode()
    assert 'rdma_cni_agent_serving{part="cni"} 1.0' in page
    assert 'rdma_cni_agent_serving{part="nri"} 0.0' in page
    assert set(takeover.PARTS) == {"cni", "metrics", "nri"}


# NRI: one agent's plugin registered at a time.


def _plugin(tmp_path: Any, lock: str | None) -> NriPlugin:
    return NriPlugin(str(tmp_path / "no-runtime.sock"), lambda sandbox: [], lock_file=lock)


def test_a_second_nri_plugin_registers_only_once_the_first_lets_go(tmp_path: Any) -> None:
    lock = str(tmp_path / "nri.lock")
    first, second = _plugin(tmp_path, lock), _plugin(tmp_path, lock)
    stop_first, stop_second = threading.Event(), threading.Event()
    t1 = threading.Thread(target=first.run, args=(stop_first,), daemon=True)
    t1.start()
    wait_for(lambda: first.state.startswith("not injecting"), 10, "the first plugin to try the runtime")
    t2 = threading.Thread(target=second.run, args=(stop_second,), daemon=True)
    t2.start()
    time.sleep(0.5)
    assert second.state == "not connected"  # never went near the runtime
    assert HELD["nri"] is False
    stop_first.set()
    t1.join(10)
    wait_for(lambda: second.state.startswith("not injecting"), 10, "the second plugin to take over")
    assert HELD["nri"] is True
    stop_second.set()
    t2.join(10)
    assert not t2.is_alive()
    assert FileLock(lock).try_acquire()  # released on stop


def test_an_nri_plugin_stopped_while_waiting_never_registers(tmp_path: Any) -> None:
    lock = str(tmp_path / "nri.lock")
    holder = FileLock(lock)
    assert holder.try_acquire()
    plugin = _plugin(tmp_path, lock)
    stop = threading.Event()
    t = threading.Thread(target=plugin.run, args=(stop,), daemon=True)
    t.start()
    time.sleep(0.3)
    stop.set()
    t.join(10)
    assert not t.is_alive() and plugin.state == "not connected"
    holder.release()


def test_an_nri_lock_that_cannot_be_opened_does_not_stop_registration(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = _plugin(tmp_path, str(tmp_path / "missing" / "nri.lock"))
    stop = threading.Event()
    t = threading.Thread(target=plugin.run, args=(stop,), daemon=True)
    t.start()
    wait_for(lambda: plugin.state.startswith("not injecting"), 10, "the plugin to try the runtime")
    stop.set()
    t.join(10)
    assert "the NRI registration: cannot take it over" in caplog.text
