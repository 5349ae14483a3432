"""The CNI server's verb workers (rdma_cni/agent/verbpool.py, verbworker.py): the real zygote and
workers, with a verb stand-in (tests/support/shim.py) in place of the plugin's.

What a worker promises: one verb at a time, in its own process, as a plugin process would end
(exit status, stdout, stderr); reused only while nothing of a verb stays behind; a verb that
crashes, hangs or loses its caller takes only its worker with it; the pool stays within its
bound and keeps its spare workers ready.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rdma_cni.agent.shimwire import Request
from rdma_cni.agent.verbpool import WorkerPool
from tests.support.processes import children_of, wait_gone
from tests.support.shim import write_echo_plugin

ENV = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "ctr1", "CNI_IFNAME": "net1"}


@pytest.fixture
def echo(tmp_path: Any) -> str:
    return write_echo_plugin(str(tmp_path / "echo-plugin"))


@pytest.fixture
def pools() -> Iterator[list[WorkerPool]]:
    made: list[WorkerPool] = []
    yield made
    for pool in made:
        pool.close()


def make(pools: list[WorkerPool], echo: str, env: dict[str, str] | None = None, **kw: Any) -> WorkerPool:
    pool = WorkerPool([echo], {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(env or {})}, **kw)
    pools.append(pool)
    pool.start()
    assert pool.wait_ready(30), "the workers never became ready"
    return pool


def verb(pool: WorkerPool, conf: dict[str, Any], timeout: float = 30) -> tuple[int, Any, str]:
    """One call with ``conf`` as its stdin: exit status, the answer's document, stderr."""
    status, out, err = pool.run(Request(env=dict(ENV), stdin=json.dumps(conf).encode()), None, None, timeout)
    return status, (json.loads(out) if out.strip() else None), err.decode()


def one(pools: list[WorkerPool], echo: str, env: dict[str, str] | None = None) -> WorkerPool:
    """A pool of one worker: each call goes to it, or to the one that replaced it."""
    return make(pools, echo, env, size=1, spare=1)


def zygote_of(pool: WorkerPool) -> int:
    assert pool._zygote is not None
    return pool._zygote.pid


def test_a_worker_runs_verbs_one_after_another_as_plugin_processes_would_end(
    pools: list[WorkerPool], echo: str
) -> None:
    pool = one(pools, echo, {"FROM_THE_NODE": "1"})
    status, doc, err = verb(pool, {"exit": 3})
    assert status == 3 and err == "plugin stderr\n"
    assert doc["env"]["FROM_THE_NODE"] == "1" and doc["env"]["CNI_CONTAINERID"] == "ctr1"
    first = doc["pid"]
    status, doc, err = verb(pool, {})
    # The same worker, and nothing of the first verb in the second's stderr or environment.
    assert (status, doc["pid"], err) == (0, first, "plugin stderr\n")
    assert first in children_of(zygote_of(pool))


@pytest.mark.parametrize(
    ("left", "why"),
    [
        ({"thread": True}, "2 threads"),
        ({"leak": True}, "open descriptors changed"),
        ({"child": True}, "a child of a verb"),
        ({"raise": 4}, "raised SystemExit"),
    ],
)
def test_a_worker_that_a_verb_left_unclean_is_replaced(
    pools: list[WorkerPool], echo: str, left: dict[str, Any], why: str, capfd: pytest.CaptureFixture[str]
) -> None:
    pool = one(pools, echo)
    _, clean, _ = verb(pool, {})
    status, doc, _ = verb(pool, left)
    if "raise" in left:
        assert status == 4 and doc is None  # as a plugin process raising it would have exited
    else:
        assert status == 0 and doc["pid"] == clean["pid"]
    _, after, _ = verb(pool, {})
    assert after["pid"] != clean["pid"], "the unclean worker was used again"
    assert why in capfd.readouterr().err


def test_a_verb_in_another_network_namespace_does_not_come_back(
    pools: list[WorkerPool], echo: str, capfd: pytest.CaptureFixture[str]
) -> None:
    name = f"rcni-verbpool-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        pool = one(pools, echo)
        _, doc, _ = verb(pool, {"setns": f"/var/run/netns/{name}"})
        _, after, _ = verb(pool, {})
        assert after["pid"] != doc["pid"]
        assert "its network namespace changed" in capfd.readouterr().err
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_a_verbs_logging_handlers_do_not_outlive_it(pools: list[WorkerPool], echo: str) -> None:
    pool = one(pools, echo)
    _, before, _ = verb(pool, {})
    _, during, _ = verb(pool, {"handler": True})
    _, after, _ = verb(pool, {})
    assert before["pid"] == during["pid"] == after["pid"]
    assert during["handlers"] == before["handlers"] + 1 and after["handlers"] == before["handlers"]


def test_a_worker_leaves_after_its_share_of_verbs(pools: list[WorkerPool], echo: str) -> None:
    pool = one(pools, echo, {"ECHO_MAX_VERBS": "2"})
    pids = [verb(pool, {})[1]["pid"] for _ in range(3)]
    assert pids[0] == pids[1] != pids[2]


def test_a_crashed_or_hung_verb_takes_only_its_worker(
    pools: list[WorkerPool], echo: str, tmp_path: Any
) -> None:
    pool = make(pools, echo, spare=1)
    status, doc, _ = verb(pool, {"kill": 9})
    assert status == 1 and doc["code"] == 11 and "died before it answered" in doc["msg"]
    pidfile = tmp_path / "pid"
    started = time.monotonic()
    status, doc, _ = verb(pool, {"sleep": 60, "pidfile": str(pidfile)}, timeout=1)
    assert time.monotonic() - started < 5
    assert status == 1 and doc["code"] == 11 and "did not finish ADD within 1 s" in doc["msg"]
    assert wait_gone(int(pidfile.read_text()))
    assert verb(pool, {})[0] == 0  # served by a new worker


def test_a_caller_that_goes_away_gets_its_verb_killed_or_never_run(
    pools: list[WorkerPool], echo: str, tmp_path: Any
) -> None:
    pool = make(pools, echo, size=1, spare=1)
    ours, theirs = socket.socketpair()
    pidfile, calls = tmp_path / "pid", tmp_path / "calls"
    outcome: list[tuple[int, bytes, bytes]] = []
    req = Request(env=dict(ENV), stdin=json.dumps({"sleep": 60, "pidfile": str(pidfile)}).encode())
    running = threading.Thread(target=lambda: outcome.append(pool.run(req, None, ours, 30)))
    running.start()
    deadline = time.monotonic() + 10
    while not pidfile.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # A second caller waits for the one worker, and goes away before it gets it: its verb never runs.
    waiting_ours, waiting_theirs = socket.socketpair()
    queued = Request(env=dict(ENV), stdin=json.dumps({"calls": str(calls)}).encode())
    second: list[tuple[int, bytes, bytes]] = []
    waiter = threading.Thread(target=lambda: second.append(pool.run(queued, None, waiting_ours, 30)))
    waiter.start()
    time.sleep(0.3)
    waiting_theirs.close()
    waiter.join(10)
    assert second == [(1, b"", b"")] and not calls.exists()
    theirs.close()  # the first caller goes away: its worker is killed
    running.join(10)
    assert outcome == [(1, b"", b"")]
    assert wait_gone(int(pidfile.read_text()))
    assert verb(pool, {})[0] == 0


def test_calls_beyond_the_bound_wait_their_turn(pools: list[WorkerPool], echo: str) -> None:
    pool = make(pools, echo, size=2, spare=1, idle_seconds=0.5)
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(verb(pool, {"sleep": 0.3})[1]["pid"]))
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 6 and len(set(results)) <= 2
    # The worker beyond the spare one leaves once idle.
    deadline = time.monotonic() + 10
    while len(children_of(zygote_of(pool))) > 1:
        assert time.monotonic() < deadline, "the extra worker never left"
        time.sleep(0.1)


def test_a_zygote_that_dies_is_started_again(pools: list[WorkerPool], echo: str) -> None:
    pool = make(pools, echo, spare=1)
    old = zygote_of(pool)
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while pool._zygote is None or pool._zygote.pid == old:
        assert time.monotonic() < deadline, "no new zygote"
        time.sleep(0.05)
    assert verb(pool, {})[0] == 0


def test_workers_leave_when_the_pool_closes(pools: list[WorkerPool], echo: str) -> None:
    pool = make(pools, echo, spare=2)
    zygote = zygote_of(pool)
    workers = children_of(zygote)
    assert len(workers) == 2
    pool.close()
    assert wait_gone([zygote, *workers])
    status, doc, _ = verb(pool, {})
    assert status == 1 and "stopping" in doc["msg"]


def test_a_plugin_whose_workers_cannot_start_is_said_so(pools: list[WorkerPool], tmp_path: Any) -> None:
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    pool = WorkerPool([str(broken)], {})
    pools.append(pool)
    pool.start()
    deadline = time.monotonic() + 20
    while pool.never_started() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "did not start" in (pool.never_started() or "")
    status, doc, _ = verb(pool, {})
    assert status == 1 and "cannot run verbs" in doc["msg"]


def _kubeconfig(path: Any, server: str) -> str:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    with open(path, "w") as f:
        json.dump(doc, f)
    return str(path)


def test_each_worker_connects_to_the_networks_api_server_before_it_is_ready(
    pools: list[WorkerPool], echo: str, tmp_path: Any
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    try:
        kubeconfig = _kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{listener.getsockname()[1]}")
        pool = make(pools, echo, kubeconfigs=[kubeconfig], size=2, spare=2)
        assert "--kubeconfig=" + kubeconfig in pool._zygote.args  # type: ignore[union-attr]
        # Ready, no verb run yet: both spare workers have their connection.
        accepted = [listener.accept()[0] for _ in range(2)]
        for conn in accepted:
            conn.close()
    finally:
        listener.close()


def test_a_kubeconfig_that_cannot_be_read_does_not_keep_the_workers_from_ready(
    pools: list[WorkerPool], echo: str, tmp_path: Any
) -> None:
    pool = make(pools, echo, kubeconfigs=[str(tmp_path / "not-written-yet")], size=1, spare=1)
    status, doc, _err = verb(pool, {})
    assert status == 0 and doc["env"]["CNI_CONTAINERID"] == "ctr1"
