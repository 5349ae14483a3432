"""The DEL spool's protocol (rdma_cni/agent/delspool.py): claims, runs, retirement, concurrent runners.

The spool is shared by the shim (launcher/shim.c, which writes entries), the
agent that owns the socket (its background runner), ADDs and DELs served by
any agent (two during a rollout). These tests play those parties against one
directory, processes included, with a stand-in for the plugin's DEL.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import stat
import threading
import time
from typing import Any

import pytest

from rdma_cni.agent import delspool, shimwire
from rdma_cni.agent.shimwire import Request
from tests.support.shim import build_shim, run_shim

ENV = {"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "ctr0001", "CNI_IFNAME": "net1", "CNI_PATH": "/usr/lib/cni"}
NAME = "del-ctr0001-6e657431.req"


def _spool(tmp_path: Any) -> str:
    spool = str(tmp_path / "agent" / "del-spool")
    os.makedirs(spool, mode=0o700)
    os.chmod(os.path.dirname(spool), 0o700)
    return spool


def _put(spool: str, name: str = NAME, stdin: bytes = b"{}", **env: str) -> str:
    path = os.path.join(spool, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, shimwire.encode_request({**ENV, **env}, stdin))
    os.close(fd)
    return path


class Recorder:
    """A stand-in for the plugin's DEL: records each run, and exits as told."""

    def __init__(self, status: int = 0, err: bytes = b"", during: Any = None) -> None:
        self.status = status
        self.err = err
        self.during = during
        self.runs: list[Request] = []

    def __call__(self, request: Request, budget: float) -> tuple[int, bytes]:
        self.runs.append(request)
        if self.during is not None:
            self.during()
        return self.status, self.err


def test_entry_names_are_the_shims() -> None:
    assert delspool.entry_name("ctr0001", "net1") == NAME
    for bad_id in ("", "a/b", "x" * 129, "a b"):
        assert delspool.entry_name(bad_id, "net1") is None
    assert delspool.entry_name("c", "") is None
    assert delspool.entry_name("c", "x" * 65) is None
    assert delspool.attachment_of(".run-" + NAME) == NAME
    assert delspool.attachment_of(NAME) == NAME
    for other in (".tmp-12", ".bad-" + NAME, "del-c-zz.req", "README"):
        assert delspool.attachment_of(other) is None


def test_what_the_server_spools_is_what_the_shim_spools(tmp_path: Any) -> None:
    shim = build_shim(str(tmp_path))
    sock = str(tmp_path / "shim-agent" / "cni.sock")
    conf = b'{"cniVersion": "1.0.0", "name": "n", "type": "rdma-cni"}'
    assert run_shim(shim, sock, ENV, conf).code == 0
    by_shim = os.path.join(delspool.spool_dir(sock), NAME)
    spool = _spool(tmp_path)
    assert delspool.Spool(spool, Recorder()).write(Request(env=dict(ENV), stdin=conf))
    by_server = os.path.join(spool, NAME)
    with open(by_shim, "rb") as a, open(by_server, "rb") as b:
        assert a.read() == b.read()
    assert stat.S_IMODE(os.stat(by_server).st_mode) == 0o600
    # Names that make no entry, and ADDs, are never spooled.
    assert not delspool.Spool(spool, Recorder()).write(
        Request(env={**ENV, "CNI_CONTAINERID": "a/b"}, stdin=b"")
    )
    assert not delspool.Spool(spool, Recorder()).write(Request(env={**ENV, "CNI_COMMAND": "ADD"}, stdin=b""))


def test_the_servers_spool_is_bounded_as_the_shims(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    spool = _spool(tmp_path)
    monkeypatch.setattr(delspool, "SPOOL_MAX", 3)
    for i in range(3):
        _put(spool, f"del-c{i}-00.req")
    s = delspool.Spool(spool, Recorder())
    assert not s.write(Request(env=dict(ENV), stdin=b"{}"))
    os.rename(os.path.join(spool, "del-c0-00.req"), os.path.join(spool, NAME))
    assert s.write(Request(env=dict(ENV), stdin=b"{}"))  # its own entry is replaced, full or not
    os.chmod(spool, 0o500)  # a spool it cannot write into: refused, not raised
    try:
        assert not s.write(Request(env={**ENV, "CNI_CONTAINERID": "c9"}, stdin=b"{}"))
    finally:
        os.chmod(spool, 0o700)


def test_a_run_that_succeeds_removes_the_entry(tmp_path: Any) -> None:
    spool = _spool(tmp_path)
    _put(spool)
    run = Recorder()
    assert delspool.Spool(spool, run).settle(NAME, 10, wait=0).outcome == "done"
    assert len(run.runs) == 1 and os.listdir(spool) == []
    # Nothing spooled: done at once, nothing run.
    assert delspool.Spool(spool, run).settle(NAME, 10, wait=0).outcome == "done"
    assert len(run.runs) == 1


def test_a_failing_run_stays_claimed_for_the_next(tmp_path: Any) -> None:
    spool = _spool(tmp_path)
    _put(spool)
    failing = Recorder(status=1, err=b"first line\nIPAM DEL for net1: timed out\n")
    settled = delspool.Spool(spool, failing).settle(NAME, 10, wait=0)
    assert settled.outcome == "failed" and settled.detail == "IPAM DEL for net1: timed out"
    assert os.listdir(spool) == [".run-" + NAME]
    # Whoever comes next adopts the claimed file: the runner, or an ADD of this attachment.
    ok = Recorder()
    assert delspool.Spool(spool, ok).settle(NAME, 10, wait=0).outcome == "done"
    assert len(ok.runs) == 1 and os.listdir(spool) == []
    silent = Recorder(status=3)
    _put(spool)
    assert delspool.Spool(spool, silent).settle(NAME, 10, wait=0).detail == "exit status 3"


def test_a_file_gone_at_any_step_is_done_not_an_error(tmp_path: Any) -> None:
    spool = _spool(tmp_path)
    path = _put(spool)
    claimed = os.path.join(spool, ".run-" + NAME)

    def another_runner_finished() -> None:
        os.unlink(claimed)  # the other agent of a rollout ran it too, and removed it first

    assert (
        delspool.Spool(spool, Recorder(during=another_runner_finished)).settle(NAME, 10, wait=0).outcome
        == "done"
    )
    assert os.listdir(spool) == []
    # Retired while claimed: the same.
    _put(spool)
    assert (
        delspool.Spool(spool, Recorder(during=lambda: os.unlink(claimed))).settle(NAME, 10, wait=0).outcome
        == "done"
    )
    assert not os.path.exists(path)


def _hold_claim(path: str, ready: Any, release: Any) -> None:
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ready.set()
    release.wait(30)
    os.close(fd)


def test_a_run_under_way_elsewhere_is_waited_for_never_doubled(tmp_path: Any) -> None:
    spool = _spool(tmp_path)
    _put(spool)
    os.link(os.path.join(spool, NAME), os.path.join(spool, ".run-" + NAME))
    os.unlink(os.path.join(spool, NAME))
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold_claim, args=(os.path.join(spool, ".run-" + NAME), ready, release))
    other.start()
    try:
        assert ready.wait(10)
        run = Recorder()
        # The runner does not wait for it.
        assert delspool.Spool(spool, run).settle(NAME, 10, wait=0).outcome == "busy"
        # A repeat of the DEL spooled meanwhile is not claimed over the run under way.
        _put(spool)
        assert delspool.Spool(spool, run).settle(NAME, 10, wait=0.2).outcome == "busy"
        assert run.runs == [] and sorted(os.listdir(spool)) == [".run-" + NAME, NAME]
        # An ADD of this attachment waits for it; the other process's holder exits without
        # removing it (killed mid-run): the waiting one adopts it, then runs the repeat.
        threading.Timer(0.3, release.set).start()
        began = time.monotonic()
        assert delspool.Spool(spool, run).settle(NAME, 10, wait=10).outcome == "done"
        assert time.monotonic() - began >= 0.25
        assert len(run.runs) == 2 and os.listdir(spool) == []
    finally:
        release.set()
        other.join(10)


def _settle_in_child(spool: str, log: str, start: Any) -> None:
    def run(request: Request, budget: float) -> tuple[int, bytes]:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} in\n")
        time.sleep(0.05)
        with open(log, "a") as f:
            f.write(f"{os.getpid()} out\n")
        return 0, b""

    start.wait(10)
    for _ in range(20):
        delspool.Spool(spool, run).settle(NAME, 30, wait=30)


def test_concurrent_runners_never_run_one_attachment_twice_at_once(tmp_path: Any) -> None:
    spool = _spool(tmp_path)
    log = str(tmp_path / "log")
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    children = [ctx.Process(target=_settle_in_child, args=(spool, log, start)) for _ in range(3)]
    for c in children:
        c.start()
    # One spooled before they start: on a loaded machine their settles could otherwise all come
    # before the first, run nothing and leave no log to read.
    _put(spool)
    start.set()
    deadline = time.monotonic() + 20
    while any(c.is_alive() for c in children) and time.monotonic() < deadline:
        _put(spool)  # the runtime keeps spooling repeats of the same DEL
        time.sleep(0.01)
    for c in children:
        c.join(20)
        assert c.exitcode == 0
    with open(log) as f:
        lines = f.read().splitlines()
    depth = 0
    for line in lines:
        depth += 1 if line.endswith(" in") else -1
        assert depth in (0, 1), f"two runs of one attachment at once: {lines}"
    assert lines


def test_retire_drops_entries_but_not_a_run_under_way(tmp_path: Any) -> None:
    spool = _spool(tmp_path)
    s = delspool.Spool(spool, Recorder())
    _put(spool)
    claimed = os.path.join(spool, ".run-" + NAME)
    _put(spool, ".run-" + NAME)  # an orphan: claimed by an agent killed mid-run
    s.retire(NAME)
    assert os.listdir(spool) == []
    s.retire(NAME)  # nothing left: nothing to do
    _put(spool, ".run-" + NAME)
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold_claim, args=(claimed, ready, release))
    other.start()
    try:
        assert ready.wait(10)
        s.retire(NAME)
        assert os.listdir(spool) == [".run-" + NAME]
    finally:
        release.set()
        other.join(10)


def test_entries_that_are_not_the_shims_are_set_aside(tmp_path: Any) -> None:
    spool = _spool(tmp_path)
    os.symlink("/etc/passwd", os.path.join(spool, NAME))
    run = Recorder()
    assert delspool.Spool(spool, run).settle(NAME, 10, wait=0).outcome == "done"
    assert run.runs == [] and os.listdir(spool) == [".bad-" + NAME]


def test_the_runner_tries_never_tried_entries_first(tmp_path: Any) -> None:
    spool = _spool(tmp_path)
    order: list[str] = []
    statuses = {"old": 1, "new": 0}

    def run(request: Request, budget: float) -> tuple[int, bytes]:
        order.append(request.env["CNI_CONTAINERID"])
        return statuses[request.env["CNI_CONTAINERID"]], b""

    runner = delspool.Runner(delspool.Spool(spool, run), 10, retry=(0.0, 0.0))
    _put(spool, "del-old-00.req", CNI_CONTAINERID="old")
    assert runner.run_once() == (0, 1)
    _put(spool, "del-new-00.req", CNI_CONTAINERID="new")
    assert runner.run_once() == (1, 1)
    assert order == ["old", "new", "old"]
    assert runner.failing == 1 and runner.waiting == 1
    # A failing attachment is not tried before its time.
    slow = delspool.Runner(delspool.Spool(spool, run), 10, retry=(60.0, 60.0))
    assert slow.run_once() == (0, 1)
    assert slow.run_once() == (0, 1)
    assert order == ["old", "new", "old", "old"]
    # Gone from the directory: forgotten.
    os.unlink(os.path.join(spool, ".run-del-old-00.req"))
    assert slow.run_once() == (0, 0) and slow.backoff == {}
