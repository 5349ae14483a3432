"""Two CNI servers on one socket, as two agents on a node in a rollout with surge (agent/cniserver.py).

The old server serves; the new one waits beside it; the old one stops and the
new one takes the path over. The shim (launcher/shim.c, built from source)
calls throughout, with a plugin stand-in that answers what it was given.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rdma_cni.agent.cniserver import CniServer, ServerError
from rdma_cni.agent.takeover import FileLock
from tests.support.shim import build_shim, run_shim, write_echo_plugin
from tests.support.waiting import wait_for

if os.geteuid() != 0:
    pytest.skip("the shim tests need root (the server admits root only)", allow_module_level=True)

POD_ENV = {"CNI_CONTAINERID": "ctr0001", "CNI_IFNAME": "net1", "CNI_PATH": "/usr/lib/cni"}


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_shim(str(tmp_path_factory.mktemp("shim")))


@pytest.fixture
def echo(tmp_path: Any) -> str:
    return write_echo_plugin(str(tmp_path / "echo-plugin"))


@pytest.fixture
def path(tmp_path: Any) -> str:
    return str(tmp_path / "agent" / "cni.sock")


class Serving:
    """A server serving in a thread, stopped by :meth:`stop` (as SIGTERM stops the agent)."""

    def __init__(self, server: CniServer, *, wait: bool = False) -> None:
        self.server = server
        self.stopping = threading.Event()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(wait,), daemon=True)
        self.thread.start()

    def _run(self, wait: bool) -> None:
        with_wait = self.stopping if wait else None
        try:
            self.server.start(wait=with_wait)
        except ServerError:
            return
        self.started.set()
        self.server.serve(self.stopping)

    def stop(self, timeout: float = 30) -> float:
        began = time.monotonic()
        self.stopping.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive()
        return time.monotonic() - began


@pytest.fixture
def servers() -> Iterator[list[Serving]]:
    running: list[Serving] = []
    yield running
    for s in running:
        s.stopping.set()
        s.thread.join(30)


def _start(servers: list[Serving], path: str, echo: str, *, wait: bool = False, **kw: Any) -> Serving:
    s = Serving(CniServer(path, [echo], **kw), wait=wait)
    servers.append(s)
    return s


def _pid_of_answer(shim: str, path: str) -> int:
    out = run_shim(shim, path, {**POD_ENV, "CNI_COMMAND": "CHECK"}, b"{}")
    assert out.code == 0, out
    assert out.doc is not None
    return int(out.doc["pid"]) if "pid" in out.doc else 0


def test_a_waiting_server_takes_over_with_no_call_refused(
    shim: str, path: str, echo: str, servers: list[Serving]
) -> None:
    old = _start(servers, path, echo)
    assert old.started.wait(10)
    new = _start(servers, path, echo, wait=True)
    time.sleep(0.5)
    assert not new.started.is_set()  # the old one serves; the new one waits beside it
    assert os.path.exists(os.path.join(os.path.dirname(path), "cni.next.lock"))
    outcomes: list[Any] = []
    calling = threading.Event()

    def call_all_along() -> None:
        while not calling.is_set():
            outcomes.append(run_shim(shim, path, {**POD_ENV, "CNI_COMMAND": "ADD"}, b"{}"))

    caller = threading.Thread(target=call_all_along, daemon=True)
    caller.start()
    wait_for(lambda: len(outcomes) >= 3, 30, "calls to the old server")
    took = old.stop()
    assert new.started.wait(10)
    count = len(outcomes)
    wait_for(lambda: len(outcomes) >= count + 3, 30, "calls to the new server")
    calling.set()
    caller.join(60)
    refused = [o for o in outcomes if o.code != 0]
    assert refused == [], refused[:3]
    assert took < 5  # the handover is quick: the old server was not held to its bound
    assert new.server._owns_path() and not old.server._owns_path()
    assert json.loads(run_shim(shim, path, {**POD_ENV, "CNI_COMMAND": "CHECK"}, b"{}").stdout) is not None


def test_a_server_with_no_successor_closes_at_once(path: str, echo: str, servers: list[Serving]) -> None:
    only = _start(servers, path, echo)
    assert only.started.wait(10)
    assert only.stop() < 2
    assert not os.path.exists(path)  # the shim then spools DELs and answers ADDs "try again later"


def test_a_successor_that_never_takes_over_is_given_up_on(
    path: str, echo: str, servers: list[Serving], caplog: pytest.LogCaptureFixture
) -> None:
    old = _start(servers, path, echo, handover_seconds=0.5)
    assert old.started.wait(10)
    marker = FileLock(os.path.join(os.path.dirname(path), "cni.next.lock"))
    assert marker.try_acquire()  # a successor says it waits, and then never comes
    try:
        took = old.stop()
    finally:
        marker.release()
    assert 0.5 <= took < 5
    assert "no other CNI server took" in caplog.text
    assert not os.path.exists(path)


def test_a_stopping_server_never_removes_the_socket_its_successor_bound(
    path: str, echo: str, servers: list[Serving]
) -> None:
    old = _start(servers, path, echo, handover_seconds=0.3)
    assert old.started.wait(10)
    directory = os.path.dirname(path)
    marker = FileLock(os.path.join(directory, "cni.next.lock"))
    assert marker.try_acquire()  # a successor waits...
    lock = FileLock(os.path.join(directory, "cni.lock"))
    successor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    successor.bind(path + ".succ")
    successor.listen(1)
    real = old.server._owns_path
    renamed: list[bool] = []

    def rename() -> None:
        os.rename(path + ".succ", path)
        renamed.append(True)

    def successor_renames_right_after_the_check() -> bool:
        # ...takes the lock the moment the old one lets go, is slow to publish its socket, and
        # renames it over the path exactly when the stopping server has just found the path its own.
        result = real()
        lock.try_acquire()
        if result and sys._getframe(1).f_code.co_name == "close" and not renamed:
            rename()
        return result

    old.server._owns_path = successor_renames_right_after_the_check  # type: ignore[method-assign]
    try:
        old.stop()
        if not renamed:
            rename()  # the successor gets there in the end
        assert os.path.exists(path), "the stopping server removed the socket its successor had bound"
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(path)  # the successor's: it answers
        probe.close()
    finally:
        successor.close()
        marker.release()
        lock.release()


def test_calls_under_way_are_answered_after_the_stop(
    shim: str, path: str, echo: str, servers: list[Serving]
) -> None:
    old = _start(servers, path, echo)
    assert old.started.wait(10)
    answers: list[Any] = []
    slow = threading.Thread(
        target=lambda: answers.append(
            run_shim(shim, path, {**POD_ENV, "CNI_COMMAND": "ADD"}, json.dumps({"sleep": 2}).encode())
        ),
        daemon=True,
    )
    slow.start()
    time.sleep(0.7)  # the verb runs
    old.stop()
    slow.join(30)
    assert answers and answers[0].code == 0, answers


def test_calls_that_outlast_the_drain_are_left(
    shim: str, path: str, echo: str, servers: list[Serving], caplog: pytest.LogCaptureFixture
) -> None:
    old = _start(servers, path, echo, drain_seconds=0.3)
    assert old.started.wait(10)
    threading.Thread(
        target=run_shim,
        args=(shim, path, {**POD_ENV, "CNI_COMMAND": "ADD"}, json.dumps({"sleep": 5}).encode()),
        daemon=True,
    ).start()
    time.sleep(0.7)
    with caplog.at_level(logging.WARNING, "rdma_cni.agent.cniserver"):
        took = old.stop()
    assert took < 3
    assert "stopping with 1 CNI call(s) still running" in caplog.text


def test_a_socket_that_cannot_be_published_leaves_the_lock_free(path: str, echo: str) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700)
    os.makedirs(path)  # a directory where the socket goes: the rename fails
    with open(os.path.join(path, "x"), "w"):
        pass
    with pytest.raises(ServerError, match="cannot listen on"):
        CniServer(path, [echo]).start()
    assert not os.path.exists(path + ".next")
    assert FileLock(os.path.join(os.path.dirname(path), "cni.lock")).try_acquire()


def test_a_lock_that_cannot_be_opened(path: str, echo: str) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700)
    os.makedirs(os.path.join(os.path.dirname(path), "cni.lock"))
    with pytest.raises(ServerError, match="cannot open the lock"):
        CniServer(path, [echo]).try_start()


def test_a_stale_temporary_socket_is_replaced(path: str, echo: str, servers: list[Serving]) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700)
    with open(path + ".next", "w"):
        pass  # a server died between bind and rename
    s = _start(servers, path, echo)
    assert s.started.wait(10)
    assert os.path.exists(path) and not os.path.exists(path + ".next")


def test_a_third_server_waits_unmarked(path: str, echo: str, servers: list[Serving]) -> None:
    first = _start(servers, path, echo)
    assert first.started.wait(10)
    second, third = CniServer(path, [echo]), CniServer(path, [echo])
    assert not second.try_start()
    assert not third.try_start()  # the marker is the second's: the third waits all the same
    assert first.server._successor_waits()
    second.close()
    third.close()


# The installer's side (rdma-cni install --watch --mode shim): never an exit for a busy socket.


def test_the_installer_waits_for_a_busy_socket_in_the_background(
    path: str, echo: str, servers: list[Serving]
) -> None:
    import io

    from rdma_cni.agent.takeover import HELD
    from rdma_cni.install.command import _start_cni_server

    old = _start(servers, path, echo)
    assert old.started.wait(10)
    out = io.StringIO()
    stop = threading.Event()
    thread, _ = _start_cni_server(path, [], stop, out)  # returns at once: readiness never waits on it
    assert "another agent serves" in out.getvalue() and "taking it over when it stops" in out.getvalue()
    assert HELD["cni"] is False
    old.stop()
    wait_for(lambda: HELD.get("cni") is True, 10, "the installer's server to take over")
    stop.set()
    thread.join(30)
    assert not thread.is_alive() and HELD["cni"] is False


def test_the_installer_stopped_while_waiting_lets_go(path: str, echo: str, servers: list[Serving]) -> None:
    import io

    from rdma_cni.install.command import _start_cni_server

    old = _start(servers, path, echo)
    assert old.started.wait(10)
    stop = threading.Event()
    thread, _ = _start_cni_server(path, [], stop, io.StringIO())
    wait_for(lambda: old.server._successor_waits(), 10, "the installer to mark itself the successor")
    stop.set()  # a rollout undone: the surge pod goes before it ever served
    thread.join(10)
    assert not thread.is_alive()
    assert not old.server._successor_waits()  # so the old one, stopped later, closes at once
    assert old.server._owns_path()


def test_the_installer_refuses_a_socket_it_can_never_serve(tmp_path: Any) -> None:
    import io

    from rdma_cni.install.command import InstallError, _start_cni_server

    bad = tmp_path / "open"
    bad.mkdir(mode=0o755)
    bad.chmod(0o755)
    with pytest.raises(InstallError, match=r"CNI server: the socket directory .* mode 0700"):
        _start_cni_server(str(bad / "cni.sock"), [], threading.Event(), io.StringIO())
