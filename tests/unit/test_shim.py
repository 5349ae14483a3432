"""The host shim (launcher/shim.c) and the agent's CNI server (rdma_cni/agent/cniserver.py) together.

The server runs in this process with a plugin stand-in that answers with what
it was given (tests/support/shim.py); the plugin itself through the shim is
the integration and old-root tiers' job.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rdma_cni import __version__
from rdma_cni.agent import delspool, shimwire
from rdma_cni.agent.cniserver import CniServer, ServerError
from rdma_cni.cni.protocol import LATEST_VERSION, SUPPORTED_VERSIONS
from tests.support.shim import REPO, build_shim, run_shim, write_echo_plugin

if os.geteuid() != 0:
    pytest.skip("the shim tests need root (the server admits root only)", allow_module_level=True)

POD_ENV = {
    "CNI_CONTAINERID": "ctr0001",
    "CNI_IFNAME": "net1",
    "CNI_PATH": "/usr/lib/cni",
    "CNI_ARGS": "IgnoreUnknown=true;K8S_POD_NAME=p",
}


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_shim(str(tmp_path_factory.mktemp("shim")))


@pytest.fixture
def sockdir(tmp_path: Any) -> str:
    d = tmp_path / "agent"
    return str(d)


class Running:
    """A CniServer serving in a thread."""

    def __init__(self, server: CniServer) -> None:
        self.server = server
        self.stop = threading.Event()
        server.start()
        self.thread = threading.Thread(target=server.serve, args=(self.stop,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


@pytest.fixture
def echo(tmp_path: Any) -> str:
    return write_echo_plugin(str(tmp_path / "echo-plugin"))


@pytest.fixture
def serve(sockdir: str, echo: str) -> Iterator[Any]:
    running: list[Running] = []

    def start(**kwargs: Any) -> Running:
        r = Running(CniServer(os.path.join(sockdir, "cni.sock"), [echo], environ={"BASE": "1"}, **kwargs))
        running.append(r)
        return r

    yield start
    for r in running:
        r.close()


def sock(sockdir: str) -> str:
    return os.path.join(sockdir, "cni.sock")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or reaped after it
        return False


# The shim alone, with no server.


def test_shim_constants_match_the_plugin() -> None:
    with open(os.path.join(REPO, "launcher", "shim.h")) as f:
        header = f.read()
    assert f'#define SHIM_VERSION "{__version__}"' in header
    assert f'#define SHIM_CNI_VERSION "{LATEST_VERSION}"' in header
    listed = re.search(r"#define SHIM_SUPPORTED_VERSIONS (.*)", header)
    assert listed is not None
    assert json.loads("[" + json.loads(listed.group(1)) + "]") == list(SUPPORTED_VERSIONS)


def test_version_without_a_server_is_the_plugins_answer(shim: str, sockdir: str) -> None:
    out = run_shim(shim, sock(sockdir), {"CNI_COMMAND": "VERSION"}, b"")
    assert out.code == 0
    assert out.doc == {"cniVersion": LATEST_VERSION, "supportedVersions": list(SUPPORTED_VERSIONS)}


@pytest.mark.parametrize(("verb", "code"), [("ADD", 11), ("CHECK", 11), ("GC", 11), ("STATUS", 50)])
def test_verbs_without_a_server_fail_clearly(shim: str, sockdir: str, verb: str, code: int) -> None:
    out = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": verb, "CNI_NETNS": "/proc/self/ns/net"})
    assert out.code == 1
    assert out.doc is not None and out.doc["code"] == code
    assert "agent is not running" in out.doc["msg"]
    assert sock(sockdir) in out.doc["details"]


def test_del_without_a_server_is_spooled_and_succeeds(shim: str, sockdir: str) -> None:
    env = {**POD_ENV, "CNI_COMMAND": "DEL", "CNI_NETNS": "/var/run/netns/gone"}
    conf = b'{"cniVersion": "1.0.0", "name": "n", "type": "rdma-cni"}'
    out = run_shim(shim, sock(sockdir), env, conf)
    assert out.code == 0, out
    assert out.stdout == ""
    spool = delspool.spool_dir(sock(sockdir))
    assert stat.S_IMODE(os.stat(sockdir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(spool).st_mode) == 0o700
    (name,) = os.listdir(spool)
    assert name == "del-ctr0001-6e657431.req"
    assert stat.S_IMODE(os.stat(os.path.join(spool, name)).st_mode) == 0o600
    request = delspool.read_spooled(os.path.join(spool, name))
    assert request.stdin == conf
    assert request.env == {**env, "CNI_NETNS": ""}
    # A repeated DEL replaces its own request.
    assert run_shim(shim, sock(sockdir), env, conf).code == 0
    assert os.listdir(spool) == [name]


def test_del_that_cannot_be_spooled_asks_for_a_retry(shim: str, sockdir: str) -> None:
    os.makedirs(sockdir, mode=0o755)
    os.chmod(sockdir, 0o755)  # not private: the spool must not live there
    out = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "DEL"})
    assert out.code == 1 and out.doc is not None and out.doc["code"] == 11
    assert out.doc["details"] == f"{sockdir} is not a private directory of root (mode 0700, owned by root)"
    bad = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "DEL", "CNI_CONTAINERID": "a/../b"})
    assert bad.doc is not None and bad.doc["code"] == 11
    assert "CNI_CONTAINERID" in bad.doc["details"]


def test_after_a_reboot_the_shim_makes_the_spools_whole_path(shim: str, tmp_path: Any) -> None:
    run = tmp_path / "run"  # /run after a reboot: there, but empty
    run.mkdir(mode=0o755)
    socket_path = str(run / "rdma-cni" / "agent" / "cni.sock")
    out = run_shim(shim, socket_path, {**POD_ENV, "CNI_COMMAND": "DEL"}, b"{}")
    assert out.code == 0, out
    assert "is not running" in out.stderr and "DEL spooled" in out.stderr
    # As the plugin makes the lock's directory, and the agent its own: then private.
    assert stat.S_IMODE(os.stat(run / "rdma-cni").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(run / "rdma-cni" / "agent").st_mode) == 0o700
    spool = delspool.spool_dir(socket_path)
    assert stat.S_IMODE(os.stat(spool).st_mode) == 0o700
    assert os.listdir(spool) == ["del-ctr0001-6e657431.req"]


@pytest.mark.parametrize(
    ("level", "spoil", "said"),
    [
        ("rdma-cni", lambda p: os.chmod(p, 0o775), "that only root can write into (owner 0, mode 0775)"),
        (
            "rdma-cni",
            lambda p: os.chown(p, 65534, 0),
            "owned by root that only root can write into (owner 65534",
        ),
        ("rdma-cni", lambda p: (shutil.rmtree(p), open(p, "w").close()), "is not a directory"),
        ("rdma-cni/agent", lambda p: os.chmod(p, 0o750), "is not a private directory of root"),
        (
            "rdma-cni/agent",
            lambda p: (shutil.rmtree(p), os.symlink("/tmp", p)),
            "is not a private directory of root",
        ),
        ("rdma-cni/agent/del-spool", lambda p: os.chown(p, 65534, 0), "is not a private directory of root"),
    ],
)
def test_every_level_of_the_spools_path_is_checked(
    shim: str, tmp_path: Any, level: str, spoil: Any, said: str
) -> None:
    run = tmp_path / "run"
    spool = run / "rdma-cni" / "agent" / "del-spool"
    os.makedirs(spool, mode=0o700)
    os.chmod(run / "rdma-cni", 0o755)
    os.chmod(run / "rdma-cni" / "agent", 0o700)
    spoil(str(run / level))
    out = run_shim(shim, str(run / "rdma-cni" / "agent" / "cni.sock"), {**POD_ENV, "CNI_COMMAND": "DEL"})
    assert out.code == 1 and out.doc is not None and out.doc["code"] == 11, out
    assert "could not be spooled" in out.doc["msg"]
    assert str(run / level) in out.doc["details"] and said in out.doc["details"]


def test_a_busy_agent_is_not_called_missing(shim: str, sockdir: str) -> None:
    os.makedirs(sockdir, mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock(sockdir))
    listener.listen(0)
    queued = []
    try:
        while True:  # fill the queue of calls the agent has not accepted yet
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
            try:
                c.connect(sock(sockdir))
            except BlockingIOError:
                c.close()
                break
            queued.append(c)
        add = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "ADD"})
        assert add.code == 1 and add.doc is not None and add.doc["code"] == 11
        assert add.doc["msg"] == "the rdma-cni agent is busy (its queue of calls is full); try again later"
        dele = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "DEL"})
        assert dele.code == 0
        assert (
            "the agent is busy (its queue of calls is full)" in dele.stderr and "DEL spooled" in dele.stderr
        )
        assert "not running" not in dele.stderr
    finally:
        for c in queued:
            c.close()
        listener.close()


def test_without_cni_command_the_shim_says_what_it_is(shim: str, sockdir: str) -> None:
    out = run_shim(shim, sock(sockdir), {})
    assert out.code == 1 and out.stdout == ""
    assert "rdma-cni shim" in out.stderr and sock(sockdir) in out.stderr


# The shim and the server.


def test_a_call_is_relayed_with_its_namespace_and_only_cni_variables(
    shim: str, sockdir: str, serve: Any
) -> None:
    serve()
    ns = f"/proc/{os.getpid()}/task/{os.getpid()}/ns/uts"  # any namespace file: the plugin checks the kind
    env = {
        **POD_ENV,
        "CNI_COMMAND": "ADD",
        "CNI_NETNS": ns,
        "RDMA_CNI_NETNS_VIA": "/etc/passwd",
        "OTHER": "x",
    }
    out = run_shim(shim, sock(sockdir), env, b'{"exit": 7}')
    assert out.code == 7
    assert out.stderr == "plugin stderr\n"
    doc = out.doc
    assert doc is not None
    st = os.stat(ns)
    assert doc["netns"] == [st.st_dev, st.st_ino]
    got = doc["env"]
    assert got["CNI_NETNS"] == ns  # the runtime's value, for results and records
    assert re.fullmatch(r"/proc/self/fd/\d+", got["RDMA_CNI_NETNS_VIA"])
    assert "OTHER" not in got and got["BASE"] == "1"
    assert {k: got[k] for k in POD_ENV} == POD_ENV
    assert doc["stdin"] == '{"exit": 7}'


def test_a_namespace_the_shim_cannot_open_is_reported_as_gone(shim: str, sockdir: str, serve: Any) -> None:
    serve()
    env = {**POD_ENV, "CNI_COMMAND": "DEL", "CNI_NETNS": "/nonexistent/netns"}
    out = run_shim(shim, sock(sockdir), env)
    assert out.code == 0
    assert out.doc is not None and out.doc["env"]["RDMA_CNI_NETNS_VIA"] == "errno:2"


def _spool_raw(spool: str, name: str, raw: bytes) -> None:
    """Put a file in the spool as the shim leaves one (0600, this user's)."""
    os.makedirs(os.path.dirname(spool), mode=0o700, exist_ok=True)
    os.makedirs(spool, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(spool, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, raw)
    os.close(fd)


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_spooled_dels_run_in_the_background_at_start_and_as_they_appear(
    shim: str, sockdir: str, serve: Any, tmp_path: Any
) -> None:
    calls = tmp_path / "calls"
    conf = json.dumps({"calls": str(calls)}).encode()
    assert run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "DEL"}, conf).code == 0
    spool = delspool.spool_dir(sock(sockdir))
    assert os.listdir(spool) == ["del-ctr0001-6e657431.req"]
    serve()
    _wait(lambda: os.listdir(spool) == [], 10, "the DEL spooled before the start did not run")
    assert calls.read_text() == "DEL ctr0001 net1\n"
    # Spooled while the server runs (a shim that found it busy a moment ago): run with no ADD coming.
    failing = shimwire.encode_request(
        {**POD_ENV, "CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c2"},
        json.dumps({"calls": str(calls), "exit": 1}).encode(),
    )
    ok = shimwire.encode_request({**POD_ENV, "CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c3"}, conf)
    for name, raw in (
        ("del-c2-6e657431.req", failing),
        ("del-c3-6e657431.req", ok),
        ("del-c4-00.req", b"junk"),
    ):
        _spool_raw(spool, name, raw)
    _wait(
        lambda: sorted(os.listdir(spool)) == [".bad-del-c4-00.req", ".run-del-c2-6e657431.req"],
        10,
        f"spooled DELs were not run: {sorted(os.listdir(spool))}",
    )
    # The failed one stays (claimed, for the next try); the junk is set aside, never run.
    assert sorted(calls.read_text().splitlines()[1:]) == ["DEL c2 net1", "DEL c3 net1"]


def test_a_failing_spooled_del_is_tried_again_on_a_backoff(sockdir: str, tmp_path: Any) -> None:
    spool = delspool.spool_dir(sock(sockdir))
    exit_file, calls = tmp_path / "exit", tmp_path / "calls"
    exit_file.write_text("1")
    conf = json.dumps({"calls": str(calls), "exit_file": str(exit_file)}).encode()
    _spool_raw(
        spool,
        "del-c2-6e657431.req",
        shimwire.encode_request({**POD_ENV, "CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c2"}, conf),
    )
    server = CniServer(sock(sockdir), [write_echo_plugin(str(tmp_path / "echo"))])
    runner = delspool.Runner(server.spool, 10.0, poll=0.05, retry=(0.3, 0.6))
    runner.start()
    try:
        _wait(lambda: calls.exists() and len(calls.read_text().splitlines()) >= 3, 10, "no retries")
        assert runner.failing == 1 and runner.backoff["del-c2-6e657431.req"][0] >= 2
        # Retries back off: three tries take at least 0.3 + 0.6 s.
        exit_file.write_text("0")
        _wait(lambda: os.listdir(spool) == [], 10, "the DEL was not run once it could succeed")
        _wait(lambda: runner.failing == 0, 10, "the runner still counts a failing DEL")
    finally:
        runner.stop(wait=5)
        server.close()


def test_an_add_settles_only_its_own_attachments_spooled_del(
    shim: str, sockdir: str, serve: Any, tmp_path: Any
) -> None:
    calls, exit_file = tmp_path / "calls", tmp_path / "exit"
    exit_file.write_text("1")
    spool = delspool.spool_dir(sock(sockdir))
    conf = json.dumps({"calls": str(calls), "exit_file": str(exit_file)}).encode()
    for ctr in ("ctr0001", "other"):
        raw = shimwire.encode_request({**POD_ENV, "CNI_COMMAND": "DEL", "CNI_CONTAINERID": ctr}, conf)
        _spool_raw(spool, f"del-{ctr}-6e657431.req", raw)
    running = serve()
    running.server.runner.stop()  # the background runner out of the way: what the ADD does alone
    _wait(lambda: not running.server.runner._thread.is_alive(), 10, "the runner did not stop")
    calls.write_text("")
    # Its own DEL fails: the ADD is not run, and says why.
    add = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "ADD"}, conf)
    assert add.code == 1 and add.doc is not None and add.doc["code"] == 11, add
    assert "earlier DEL of this container's interface" in add.doc["msg"]
    assert calls.read_text() == "DEL ctr0001 net1\n"
    # Another attachment's ADD never touches the spool.
    other = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "ADD", "CNI_CONTAINERID": "third"}, conf)
    assert other.code == 1 and other.doc is not None and "env" in other.doc  # the plugin's own exit 1
    assert calls.read_text() == "DEL ctr0001 net1\nADD third net1\n"
    # Once its DEL can succeed, the ADD runs after it.
    exit_file.write_text("0")
    assert run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "ADD"}, conf).code == 0
    assert calls.read_text().splitlines()[2:] == ["DEL ctr0001 net1", "ADD ctr0001 net1"]
    assert sorted(os.listdir(spool)) == ["del-other-6e657431.req"]


def test_a_del_served_directly_retires_its_spooled_copy(
    shim: str, sockdir: str, serve: Any, tmp_path: Any
) -> None:
    calls, exit_file = tmp_path / "calls", tmp_path / "exit"
    exit_file.write_text("1")
    spool = delspool.spool_dir(sock(sockdir))
    conf = json.dumps({"calls": str(calls), "exit_file": str(exit_file)}).encode()
    raw = shimwire.encode_request({**POD_ENV, "CNI_COMMAND": "DEL"}, conf)
    _spool_raw(spool, "del-ctr0001-6e657431.req", raw)
    running = serve()
    _wait(lambda: running.server.runner.failing == 1, 10, "the spooled DEL was not tried")
    assert os.listdir(spool) == [".run-del-ctr0001-6e657431.req"]
    exit_file.write_text("0")
    # The runtime's own DEL of that attachment, served: the spooled copy stands for it and goes.
    assert run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "DEL"}, conf).code == 0
    assert os.listdir(spool) == []
    tries = calls.read_text().count("DEL")
    # A later ADD of the same container id and interface is not undone by a stale copy.
    assert run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "ADD"}, conf).code == 0
    time.sleep(delspool.RETRY_FIRST + 1.5)
    assert calls.read_text().count("DEL") == tries
    assert calls.read_text().endswith("ADD ctr0001 net1\n")


def test_a_del_that_finds_every_slot_busy_is_spooled_and_runs_within_seconds(
    shim: str, sockdir: str, serve: Any, tmp_path: Any
) -> None:
    serve(max_connections=1)
    pidfile, calls = tmp_path / "slow", tmp_path / "calls"
    slow = subprocess.Popen(
        [shim],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={
            **POD_ENV,
            "CNI_COMMAND": "CHECK",
            "CNI_CONTAINERID": "slow",
            "RDMA_CNI_SHIM_SOCKET": sock(sockdir),
        },
    )
    assert slow.stdin is not None
    slow.stdin.write(json.dumps({"sleep": 2, "pidfile": str(pidfile)}).encode())
    slow.stdin.close()
    _wait(pidfile.exists, 20, "the slow call did not start")
    out = run_shim(
        shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "DEL"}, json.dumps({"calls": str(calls)}).encode()
    )
    assert out.code == 0 and out.stdout == "", out
    assert "every slot was busy: DEL spooled" in out.stderr
    spool = delspool.spool_dir(sock(sockdir))
    # No ADD comes: the agent's runner takes it by itself.
    _wait(lambda: calls.exists() and os.listdir(spool) == [], 15, "the DEL spooled while busy never ran")
    assert calls.read_text() == "DEL ctr0001 net1\n"
    assert slow.wait(20) == 0


def test_a_spooled_del_runs_without_the_runtimes_namespace_path(sockdir: str) -> None:
    spool = delspool.spool_dir(sock(sockdir))
    raw = shimwire.encode_request({**POD_ENV, "CNI_COMMAND": "DEL", "CNI_NETNS": "/proc/1/ns/net"}, b"{}")
    _spool_raw(spool, "del-x-00.req", raw)
    seen: list[dict[str, str]] = []
    settled = delspool.Spool(spool, lambda req, budget: (seen.append(req.env) or 0, b"")).settle(
        "del-x-00.req", 10, wait=0
    )
    assert settled.outcome == "done" and os.listdir(spool) == []
    assert seen[0]["CNI_NETNS"] == "" and seen[0]["CNI_COMMAND"] == "DEL"


def test_only_root_or_the_servers_user_is_served(echo: str, tmp_path: Any) -> None:
    base = tempfile.mkdtemp(prefix="rdma-cni-shim-")  # pytest's own directories are closed to others
    os.chmod(base, 0o711)
    sockdir = os.path.join(base, "agent")
    running = Running(CniServer(sock(sockdir), [echo]))
    marker = tmp_path / "ran"
    # Opened up for this test only: the directory and socket modes are the first
    # barrier, the peer's uid the second.
    os.chmod(sockdir, 0o711)
    os.chmod(sock(sockdir), 0o666)
    request = shimwire.encode_request(
        {**POD_ENV, "CNI_COMMAND": "ADD"}, json.dumps({"pidfile": str(marker)}).encode()
    )
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(sock(sockdir))
            s.sendall(request)
            s.settimeout(10)
            os.write(w, b"closed" if s.recv(100) == b"" else b"answered")
        except (ConnectionResetError, BrokenPipeError):  # closed with the request unread, or before
            # the whole request was sent (the server closes at once, so the send may fail)
            os.write(w, b"closed")
        except BaseException as exc:
            os.write(w, repr(exc).encode()[:100])
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    answer = os.read(r, 100)
    os.close(r)
    running.close()
    shutil.rmtree(base)
    assert answer == b"closed"
    assert not marker.exists()


def test_calls_beyond_the_bound_are_told_to_retry(shim: str, sockdir: str, serve: Any, tmp_path: Any) -> None:
    serve(max_connections=1)
    pidfile = tmp_path / "slow"
    slow = subprocess.Popen(
        [shim],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**POD_ENV, "CNI_COMMAND": "CHECK", "RDMA_CNI_SHIM_SOCKET": sock(sockdir)},
    )
    assert slow.stdin is not None
    slow.stdin.write(json.dumps({"sleep": 3, "pidfile": str(pidfile)}).encode())
    slow.stdin.close()
    deadline = time.monotonic() + 20
    while not pidfile.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    out = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "CHECK"})
    assert out.code == 1 and out.doc is not None and out.doc["code"] == 11
    assert "too many calls" in out.doc["msg"]
    assert slow.wait(20) == 0


def test_a_caller_that_goes_away_gets_its_verb_killed(
    shim: str, sockdir: str, serve: Any, tmp_path: Any
) -> None:
    serve()
    pidfile = tmp_path / "pid"
    proc = subprocess.Popen(
        [shim],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**POD_ENV, "CNI_COMMAND": "ADD", "RDMA_CNI_SHIM_SOCKET": sock(sockdir)},
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps({"sleep": 60, "pidfile": str(pidfile)}).encode())
    proc.stdin.close()
    deadline = time.monotonic() + 20
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    plugin = int(pidfile.read_text())
    proc.send_signal(signal.SIGKILL)  # a runtime's timeout
    proc.wait()
    deadline = time.monotonic() + 10
    while _running(plugin):
        assert time.monotonic() < deadline, "the verb of a caller that went away still runs"
        time.sleep(0.05)


def test_a_verb_that_runs_too_long_is_killed_and_reported(shim: str, sockdir: str, serve: Any) -> None:
    serve(verb_timeout=1.0)
    out = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "ADD"}, b'{"sleep": 30}')
    assert out.code == 1 and out.doc is not None and out.doc["code"] == 11
    assert "within 1 s" in out.doc["msg"]


def test_a_server_that_dies_mid_call(shim: str, sockdir: str) -> None:
    os.makedirs(sockdir, mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock(sockdir))
    listener.listen(4)

    def hang_up() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            conn.recv(1 << 16)
            conn.close()

    t = threading.Thread(target=hang_up, daemon=True)
    t.start()
    add = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "ADD"})
    assert add.code == 1 and add.doc is not None and add.doc["code"] == 11
    assert "outcome is unknown" in add.doc["msg"]
    # DEL is safe to run again: spooled.
    dele = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "DEL"})
    assert dele.code == 0
    assert os.listdir(delspool.spool_dir(sock(sockdir))) == ["del-ctr0001-6e657431.req"]
    listener.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"GET / HTTP/1.0\r\n\r\n" + b"x" * 20,
        shimwire.REQUEST_HEADER.pack(shimwire.REQUEST_MAGIC, 1 << 30, 0, 0, 0),
        shimwire.encode_request({"CNI_COMMAND": "ADD"}, b"")[:-1] + b"",  # env cut short below
        shimwire.REQUEST_HEADER.pack(shimwire.REQUEST_MAGIC, 12, 0, 0, 0) + b"LD_PRELOAD=x",
    ],
)
def test_malformed_requests_are_dropped_and_the_server_keeps_serving(
    shim: str, sockdir: str, serve: Any, raw: bytes
) -> None:
    serve()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock(sockdir))
    s.sendall(raw)
    s.shutdown(socket.SHUT_WR)
    s.settimeout(15)
    with contextlib.suppress(ConnectionResetError):  # closed with bytes unread: dropped all the same
        assert s.recv(100) == b""
    s.close()
    assert run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "CHECK"}).code == 0


def test_the_socket_directory_must_be_private(sockdir: str, echo: str) -> None:
    os.makedirs(sockdir, mode=0o755)
    os.chmod(sockdir, 0o755)
    with pytest.raises(ServerError, match="mode 0700"):
        CniServer(sock(sockdir), [echo]).start()


def test_one_server_per_socket(sockdir: str, serve: Any, echo: str) -> None:
    serve()
    with pytest.raises(ServerError, match="another CNI server"):
        CniServer(sock(sockdir), [echo]).start()
    assert stat.S_IMODE(os.stat(sock(sockdir)).st_mode) == 0o600


def test_a_plugin_that_cannot_start(shim: str, sockdir: str, tmp_path: Any) -> None:
    running = Running(CniServer(sock(sockdir), [str(tmp_path / "missing")]))
    try:
        out = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "ADD"})
    finally:
        running.close()
    assert out.code == 1 and out.doc is not None and out.doc["code"] == 11
    assert "cannot run verbs: cannot start" in out.doc["msg"] and "missing" in out.doc["msg"]


# The plugin's side: the namespace the server passes.


def test_the_plugin_opens_the_passed_namespace_for_its_cni_netns(monkeypatch: pytest.MonkeyPatch) -> None:
    from rdma_cni.kernel.netns import NotAPodNetns, open_pod_netns

    monkeypatch.setenv("CNI_NETNS", "/nonexistent/pod")
    # The passed fd is what is opened (and checked): here the plugin's own namespace, refused as such.
    monkeypatch.setenv("RDMA_CNI_NETNS_VIA", "/proc/self/ns/net")
    with pytest.raises(NotAPodNetns, match="host's own"):
        open_pod_netns("/nonexistent/pod")
    # Another path (a record's) is opened as it is.
    with pytest.raises(FileNotFoundError):
        open_pod_netns("/nonexistent/other")
    # The shim could not open it: the plugin hears the shim's errno.
    monkeypatch.setenv("RDMA_CNI_NETNS_VIA", "errno:2")
    with pytest.raises(FileNotFoundError):
        open_pod_netns("/nonexistent/pod")


def test_the_spool_is_bounded(shim: str, sockdir: str) -> None:
    spool = delspool.spool_dir(sock(sockdir))
    os.makedirs(sockdir, mode=0o700)
    os.makedirs(spool, mode=0o700)
    for i in range(4096):
        open(os.path.join(spool, f"del-c{i}-00.req"), "w").close()
    out = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "DEL"})
    assert out.code == 1 and out.doc is not None and out.doc["code"] == 11
    assert out.doc["details"] == "the spool is full"
    # A DEL already spooled replaces its own file, full or not.
    os.rename(os.path.join(spool, "del-c0-00.req"), os.path.join(spool, "del-ctr0001-6e657431.req"))
    assert run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "DEL"}).code == 0


def test_bounds_of_what_the_shim_sends(shim: str, sockdir: str) -> None:
    huge = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "ADD", "CNI_ARGS": "K=" + "v" * 70000})
    assert huge.code == 1 and huge.doc is not None and huge.doc["code"] == 4
    assert "environment is too large" in huge.doc["msg"]
    long_path = "/tmp/" + "d" * 120 + "/cni.sock"
    add = run_shim(shim, long_path, {**POD_ENV, "CNI_COMMAND": "ADD"})
    assert add.doc is not None and add.doc["code"] == 11 and "File name too long" in add.doc["details"]
    dele = run_shim(shim, long_path, {**POD_ENV, "CNI_COMMAND": "DEL"})
    assert dele.doc is not None and dele.doc["code"] == 11
    assert dele.doc["details"] == "the socket path is too long"
    assert run_shim(shim, long_path, {"CNI_COMMAND": "VERSION"}).code == 0
    assert subprocess.run([shim, "--version"], capture_output=True, check=False).returncode == 0


def test_what_the_plugin_ends_with_is_relayed(shim: str, sockdir: str, serve: Any) -> None:
    serve()
    killed = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "ADD"}, b'{"kill": 9}')
    # The worker died with the verb: the outcome is unknown, so the runtime is told to try again.
    assert killed.code == 1 and killed.doc is not None and killed.doc["code"] == 11
    assert "died before it answered" in killed.doc["msg"]
    big = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "ADD"}, b'{"big": 5000000}')
    assert big.code == 1 and big.doc is not None and big.doc["code"] == 999
    assert "too large to relay" in big.doc["msg"]


def test_unusable_spooled_files_are_set_aside(sockdir: str, tmp_path: Any) -> None:
    spool = str(tmp_path / "spool")
    os.makedirs(spool, mode=0o700)
    good = shimwire.encode_request({**POD_ENV, "CNI_COMMAND": "DEL"}, b"{}")
    cases = {
        "del-open-00.req": (good, 0o644),  # readable by others: not one the shim wrote
        "del-add-00.req": (shimwire.encode_request({**POD_ENV, "CNI_COMMAND": "ADD"}, b"{}"), 0o600),
        "del-cut-00.req": (good[:-1], 0o600),
        "del-huge-00.req": (good + b" " * delspool.MAX_FILE, 0o600),
        "del-env-00.req": (shimwire.encode_request({"LD_PRELOAD": "x"}, b""), 0o600),
    }
    for name, (raw, mode) in cases.items():
        path = os.path.join(spool, name)
        with open(path, "wb") as f:
            f.write(raw)
        os.chmod(path, mode)
    ran: list[Any] = []

    def run(req: Any, budget: float) -> tuple[int, bytes]:
        ran.append(req)
        return 0, b""

    assert delspool.Runner(delspool.Spool(spool, run), 10).run_once() == (len(cases), 0)
    assert ran == []
    assert sorted(os.listdir(spool)) == sorted(f".bad-{n}" for n in cases)
    assert delspool.Runner(delspool.Spool(str(tmp_path / "none"), run), 10).run_once() == (0, 0)


def test_a_socket_path_too_long_for_unix_sockets(tmp_path: Any, echo: str) -> None:
    d = tmp_path / ("d" * 100)
    with pytest.raises(ServerError, match="longer than a unix socket allows"):
        CniServer(str(d / "cni.sock"), [echo]).start()


def test_a_hung_server_does_not_hold_the_runtime(shim: str, sockdir: str) -> None:
    os.makedirs(sockdir, mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock(sockdir))
    listener.listen(0)  # never accepts: its backlog fills
    waiting = []
    while True:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(sock(sockdir))
        except BlockingIOError:
            c.close()
            break
        waiting.append(c)
    try:
        started = time.monotonic()
        add = run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "ADD"}, timeout=20)
        assert time.monotonic() - started < 10
        assert add.doc is not None and add.doc["code"] == 11
        assert "Resource temporarily unavailable" in add.doc["details"]
        assert run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "DEL"}, timeout=20).code == 0
    finally:
        for c in waiting:
            c.close()
        listener.close()


def test_a_request_that_trickles_in_is_dropped(
    sockdir: str, serve: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rdma_cni.agent import shimconn

    monkeypatch.setattr(shimconn, "REQUEST_SECONDS", 1.5)
    serve()
    marker = tmp_path / "ran"
    raw = shimwire.encode_request(
        {**POD_ENV, "CNI_COMMAND": "CHECK"}, json.dumps({"pidfile": str(marker)}).encode()
    )
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock(sockdir))
    started = time.monotonic()
    closed = False
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        for i in range(len(raw)):  # a byte every 0.1 s: each read is quick, the whole is not
            s.send(raw[i : i + 1])
            time.sleep(0.1)
    closed = time.monotonic() - started < len(raw) * 0.1
    s.close()
    assert closed, "a request trickled in for longer than the request deadline"
    assert not marker.exists()


def test_a_second_server_can_wait_for_the_first_to_stop(
    shim: str, sockdir: str, serve: Any, echo: str
) -> None:
    first = serve()
    second = CniServer(sock(sockdir), [echo])
    giving_up = threading.Event()
    took_over = threading.Event()

    def start_second() -> None:
        with contextlib.suppress(ServerError):
            second.start(wait=giving_up)
            took_over.set()

    t = threading.Thread(target=start_second, daemon=True)
    t.start()
    time.sleep(1)
    assert not took_over.is_set()
    assert run_shim(shim, sock(sockdir), {**POD_ENV, "CNI_COMMAND": "CHECK"}).code == 0  # the first serves
    first.close()
    t.join(10)
    assert took_over.is_set()
    second.close()
    # Waiting ends when told to: nothing is left held.
    third = serve()
    giving_up.set()
    with pytest.raises(ServerError, match="another CNI server"):
        CniServer(sock(sockdir), [echo]).start(wait=giving_up)
    third.close()
