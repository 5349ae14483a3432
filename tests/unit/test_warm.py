"""Warm start (launcher/warm.c + rdma_cni/launch/warm.py) through the built binary.

Each test has its own cache directory and so its own warm server; the
per-verb log line says whether an invocation started cold or warm.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdma_cni.cli.main import main
from rdma_cni.launch import payload, warm
from tests.support.processes import cache_id, children_of, wait_gone, warm_servers

BINARY = os.environ.get("RDMA_CNI_BINARY")
needs_binary = pytest.mark.skipif(not BINARY, reason="RDMA_CNI_BINARY is not set (make test sets it)")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


class Node:
    """A cache directory, an empty sysfs and a GC config (nothing to collect) that logs to a file."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.cache = tmp / "cache"
        (tmp / "sys").mkdir()
        self.log = tmp / "plugin.log"
        self.conf = {
            "cniVersion": "1.1.0",
            "name": "warmnet",
            "type": "rdma-cni",
            "stateDir": str(tmp / "state"),
            "lockFile": str(tmp / "lock"),
            "logFile": str(self.log),
            "cni.dev/valid-attachments": [],
        }

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "RDMA_CNI_CACHE_DIR": str(self.cache),
            "RDMA_CNI_SYSFS_ROOT": str(self.tmp / "sys"),
            "CNI_COMMAND": "GC",
            "CNI_PATH": "/usr/lib/cni",
            **extra,
        }

    def run(
        self,
        conf: dict[str, object] | None = None,
        prefix: tuple[str, ...] = (),
        binary: str | None = None,
        **extra: str,
    ) -> subprocess.CompletedProcess[bytes]:
        assert BINARY
        return subprocess.run(
            [*prefix, binary or BINARY],
            input=json.dumps(conf or self.conf).encode(),
            env=self.env(**extra),
            capture_output=True,
            timeout=60,
            check=False,
        )

    def starts(self) -> list[str]:
        """cold/warm for each logged invocation, in order."""
        if not self.log.exists():
            return []
        return [
            line.rsplit("(", 1)[1].split()[0]
            for line in self.log.read_text().splitlines()
            if "done in" in line
        ]

    @property
    def tree(self) -> Path:
        assert BINARY
        return self.cache / cache_id(BINARY)

    def server_pid(self, timeout: float = 30) -> int:
        """Wait for the warm server to listen; its pid."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.cache.exists() and (self.tree / warm.SOCKET_NAME).exists():
                pids = warm_servers(str(self.tree))
                # Not a warm child still exiting after its report (same command line).
                children = {child for pid in pids for child in children_of(pid)}
                servers = [pid for pid in pids if pid not in children]
                if servers:
                    return servers[0]
            time.sleep(0.05)
        raise AssertionError("no warm server came up")


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    if n.cache.exists():
        for p in n.cache.iterdir():
            # A warm child (same command line) may still be exiting after it has reported.
            for pid in warm_servers(str(p)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@needs_binary
def test_first_start_is_cold_and_starts_a_server_later_starts_are_warm(node: Node) -> None:
    first = node.run()
    assert first.returncode == 0, first.stderr
    node.server_pid()
    second = node.run()
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert node.starts() == ["cold", "warm"]
    sock = node.tree / warm.SOCKET_NAME
    assert sock.stat().st_mode & 0o777 == 0o600


@needs_binary
def test_warm_start_gives_the_same_error_document_and_exit_code(node: Node) -> None:
    node.run()
    node.server_pid()
    bad = {**node.conf, "rdmaIsolation": "sometimes"}
    cold = node.run(bad, RDMA_CNI_WARM="0")
    hot = node.run(bad)
    assert cold.returncode == hot.returncode == 1
    assert json.loads(hot.stdout) == json.loads(cold.stdout)
    assert json.loads(hot.stdout)["code"] == 7
    assert b"rdmaIsolation" in hot.stderr


@needs_binary
@pytest.mark.parametrize("value", ["0", "off", "false", "no"])
def test_rdma_cni_warm_off_never_starts_a_server(node: Node, value: str) -> None:
    for _ in range(3):
        assert node.run(RDMA_CNI_WARM=value).returncode == 0
    time.sleep(0.5)
    assert not (node.tree / warm.SOCKET_NAME).exists()
    assert warm_servers(str(node.tree)) == []
    assert node.starts() == ["cold"] * 3


@needs_binary
@needs_root
def test_caller_in_another_network_namespace_is_served_cold(node: Node) -> None:
    node.run()
    node.server_pid()
    # "The host's network namespace" means the caller's: a server elsewhere must not answer.
    other = node.run(prefix=("unshare", "--net"))
    assert other.returncode == 0, other.stderr
    assert node.run().returncode == 0
    assert node.starts() == ["cold", "cold", "warm"]


@needs_binary
def test_stopped_server_means_a_cold_start_not_a_hang(node: Node) -> None:
    node.run()
    pid = node.server_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        out = node.run()
        assert out.returncode == 0, out.stderr
        assert time.monotonic() - started < 30
    finally:
        os.kill(pid, signal.SIGCONT)
    assert node.starts() == ["cold", "cold"]
    # The server drops the caller that gave up on it and carries on.
    assert node.run().returncode == 0
    assert node.starts()[-1] == "warm"


@needs_binary
def test_dead_server_leaves_a_stale_socket_that_the_next_server_replaces(node: Node) -> None:
    node.run()
    pid = node.server_pid()
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid)
    stale = (node.tree / warm.SOCKET_NAME).stat().st_ino
    assert node.run().returncode == 0  # cold, and starts a new server
    deadline = time.monotonic() + 30
    while (node.tree / warm.SOCKET_NAME).stat().st_ino == stale:
        assert time.monotonic() < deadline, "no new server"
        time.sleep(0.05)
    assert warm_servers(str(node.tree)) not in ([], [pid])
    assert node.run().returncode == 0
    assert node.starts() == ["cold", "cold", "warm"]


@needs_binary
def test_server_exits_when_idle_only_if_asked(node: Node) -> None:
    node.run(RDMA_CNI_WARM_IDLE="1")
    pid = node.server_pid()
    assert wait_gone(pid, timeout=20)
    assert not (node.tree / warm.SOCKET_NAME).exists()


@needs_binary
def test_second_server_for_the_same_tree_exits_at_once(node: Node) -> None:
    node.run()
    pid = node.server_pid()
    again = subprocess.run(
        [str(node.tree / "rdma-cni"), "warm-server"], capture_output=True, timeout=30, check=False
    )
    assert again.returncode == 0
    assert warm_servers(str(node.tree)) == [pid]


@needs_binary
@needs_root
def test_caller_of_another_uid_is_refused(node: Node) -> None:
    # A cache the other user can traverse (pytest's tmp is private to root).
    open_dir = Path(tempfile.mkdtemp(prefix="rdma-cni-warm-"))
    open_dir.chmod(0o755)
    node.cache = open_dir / "cache"
    node.cache.mkdir(mode=0o755)
    node.run()
    node.server_pid()
    sock = node.tree / warm.SOCKET_NAME
    os.chmod(sock, 0o666)  # only to reach the server's own check behind the file mode
    code = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.connect(sys.argv[1])\n"
        "s.sendall(b'RDMACNI-WARM-1')\n"
        "s.settimeout(10)\n"
        "print(repr(s.recv(1)))\n"
    )
    out = subprocess.run(
        ["python3", "-c", code, str(sock)], capture_output=True, text=True, timeout=30, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "b''"  # closed without 'R'
    for pid in warm_servers(str(node.tree)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(open_dir)


@needs_binary
def test_bad_hello_is_dropped_and_the_server_goes_on(node: Node) -> None:
    node.run()
    node.server_pid()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(node.tree / warm.SOCKET_NAME))
        s.sendall(b"hello?")
        s.settimeout(10)
        assert s.recv(1) == b""
    assert node.run().returncode == 0
    assert node.starts()[-1] == "warm"


def test_warm_server_refuses_arguments_and_the_unbuilt_package(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["warm-server", "x"]) == 2
    assert main(["warm-server"]) == 2
    assert "built binary" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("", None), ("2.5", 2.5), ("0", None), ("-1", None), ("soon", None), ("1e9", None)],
)
def test_idle_seconds(raw: str, expected: float | None) -> None:
    assert warm.idle_seconds({"RDMA_CNI_WARM_IDLE": raw}) == expected
    assert warm.idle_seconds({}) is None


def _launcher_copy(node: Node, name: str) -> Path:
    """A copy of the built binary elsewhere: the same payload, so the same tree and server."""
    assert BINARY
    target = node.tmp / name / "rdma-cni"
    target.parent.mkdir()
    shutil.copy2(BINARY, target)
    return target


def _replace(path: Path, data: bytes) -> None:
    """Replace a file the way an installer does: write beside it, rename over it."""
    new = path.with_name(path.name + ".new")
    new.write_bytes(data)
    new.chmod(0o755)
    os.rename(new, path)


@needs_binary
def test_server_outlives_quiet_periods_by_default(node: Node) -> None:
    # Before, a server idled out after 300 s; now only RDMA_CNI_WARM_IDLE sets a timeout.
    node.run()
    pid = node.server_pid()
    time.sleep(warm.TREE_CHECK_SECONDS * 2 + 1)  # two liveness checks pass
    assert warm_servers(str(node.tree)) == [pid]
    assert node.run().returncode == 0
    assert node.starts() == ["cold", "warm"]


@needs_binary
def test_server_exits_when_its_launcher_is_upgraded(node: Node) -> None:
    launcher = _launcher_copy(node, "bin")
    assert node.run(binary=str(launcher)).returncode == 0
    pid = node.server_pid()
    # The same content rewritten (a new mtime and inode) is not an upgrade.
    _replace(launcher, launcher.read_bytes())
    time.sleep(warm.TREE_CHECK_SECONDS + 1)
    assert warm_servers(str(node.tree)) == [pid]
    assert node.run(binary=str(launcher)).returncode == 0
    assert node.starts() == ["cold", "warm"]
    # Another payload at that path is: the old server has no caller left.
    _replace(launcher, b"#!/bin/sh\nexit 0\n")
    assert wait_gone(pid, timeout=warm.TREE_CHECK_SECONDS * 3)
    assert not (node.tree / warm.SOCKET_NAME).exists()


@needs_binary
def test_server_stays_while_any_launcher_it_served_carries_its_payload(node: Node) -> None:
    first, second = _launcher_copy(node, "a"), _launcher_copy(node, "b")
    assert node.run(binary=str(first)).returncode == 0
    pid = node.server_pid()
    assert node.run(binary=str(second)).returncode == 0  # served warm: the server learns this path
    first.unlink()
    time.sleep(warm.TREE_CHECK_SECONDS + 1)
    assert warm_servers(str(node.tree)) == [pid]
    assert node.run(binary=str(second)).returncode == 0
    assert node.starts() == ["cold", "warm", "warm"]
    second.unlink()
    assert wait_gone(pid, timeout=warm.TREE_CHECK_SECONDS * 3)


def test_payload_id_reads_only_packed_launchers(tmp_path: Path) -> None:
    packed = tmp_path / "packed"
    packed.write_bytes(b"x" * 100 + payload.TRAILER_MAGIC + b"\0" * 16 + b"0123456789abcdef")
    assert payload.payload_id(str(packed)) == "0123456789abcdef"
    other = tmp_path / "other"
    other.write_bytes(b"#!/bin/sh\n" * 10)
    short = tmp_path / "short"
    short.write_bytes(b"RDMACNI")
    assert payload.payload_id(str(other)) is None
    assert payload.payload_id(str(short)) is None
    assert payload.payload_id(str(tmp_path / "missing")) is None


def test_launchers_forget_replaced_paths_and_a_server_started_by_hand_keeps_to_its_tree(
    tmp_path: Path,
) -> None:
    launcher = tmp_path / "rdma-cni"
    launcher.write_bytes(b"x" * 64 + payload.TRAILER_MAGIC + b"\0" * 16 + b"0123456789abcdef")
    by_hand = warm.Launchers("0123456789abcdef")
    assert by_hand.any_current()  # knows no launcher: bound to its tree only
    by_hand.add("relative/path")
    by_hand.add(str(tmp_path / "missing"))
    assert by_hand.known == {} and by_hand.any_current()
    launchers = warm.Launchers("0123456789abcdef")
    launchers.add(str(launcher))
    assert launchers.any_current()
    _replace(launcher, b"x" * 64 + payload.TRAILER_MAGIC + b"\0" * 16 + b"fedcba9876543210")
    assert not launchers.any_current()


@needs_binary
def test_child_takes_the_callers_umask(node: Node) -> None:
    node.run()
    node.server_pid()
    for umask, mode in ((0o027, 0o640), (0o002, 0o664)):
        log = node.tmp / f"umask-{umask:o}.log"
        old = os.umask(umask)
        try:
            out = node.run({**node.conf, "logFile": str(log)})
        finally:
            os.umask(old)
        assert out.returncode == 0, out.stderr
        assert "(warm start)" in log.read_text()
        assert log.stat().st_mode & 0o777 == mode


@needs_binary
def test_caller_in_a_removed_directory_is_served_from_root(node: Node) -> None:
    node.run()
    node.server_pid()
    gone = node.tmp / "gone"
    gone.mkdir()
    assert BINARY
    out = subprocess.run(
        [BINARY],
        input=json.dumps(node.conf).encode(),
        env=node.env(),
        cwd=gone,
        preexec_fn=lambda: os.rmdir(gone),  # after the chdir: the caller's cwd no longer exists
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert node.starts() == ["cold", "warm"]


@needs_binary
def test_child_killed_by_a_signal_kills_the_launcher_with_it(node: Node) -> None:
    import fcntl

    node.run()
    server = node.server_pid()
    # Hold the node lock so the child waits in GC, where we can find it.
    with open(node.tmp / "lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert BINARY
        proc = subprocess.Popen(
            [BINARY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=node.env()
        )
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(node.conf).encode())
        proc.stdin.close()
        deadline = time.monotonic() + 30
        while not children_of(server):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        for child in children_of(server):
            os.kill(child, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL


@needs_binary
def test_server_exits_when_its_tree_is_removed(node: Node) -> None:
    node.run()
    pid = node.server_pid()
    (node.tree / ".complete").unlink()
    assert wait_gone(pid, timeout=20)


def _pids_cgroup() -> Path | None:
    v1 = Path("/sys/fs/cgroup/pids")
    if (v1 / "cgroup.procs").exists():
        return v1
    v2 = Path("/sys/fs/cgroup")
    if "pids" in (v2 / "cgroup.controllers").read_text() if (v2 / "cgroup.controllers").exists() else "":
        (v2 / "cgroup.subtree_control").write_text("+pids")
        return v2
    return None


@needs_binary
@needs_root
def test_server_that_cannot_fork_sends_the_caller_to_a_cold_start(node: Node) -> None:
    root = _pids_cgroup()
    assert root is not None, "no pids cgroup controller on this machine"
    node.run()
    pid = node.server_pid()
    with open(f"/proc/{pid}/cgroup") as f:
        home = next(line.split(":", 2)[2].strip() for line in f if line.split(":")[1] in ("pids", ""))
    jail = root / f"rdma-cni-warm-test-{os.getpid()}"
    jail.mkdir()
    try:
        (jail / "pids.max").write_text("1")
        (jail / "cgroup.procs").write_text(str(pid))
        out = node.run()
        assert out.returncode == 0, out.stderr
        assert node.starts() == ["cold", "cold"]
    finally:
        (root / home.lstrip("/") / "cgroup.procs").write_text(str(pid))
        jail.rmdir()
    assert node.run().returncode == 0
    assert node.starts()[-1] == "warm"


@needs_binary
def test_sigterm_stops_the_server_and_removes_its_socket(node: Node) -> None:
    node.run()
    pid = node.server_pid()
    os.kill(pid, signal.SIGTERM)
    assert wait_gone(pid)
    assert not (node.tree / warm.SOCKET_NAME).exists()


PRELOAD_CHECK = """
import json, os, sys
from rdma_cni.launch import warm
from rdma_cni.cli.main import run_cni
heavy = ("pydantic", "http.client", "rdma_cni.node.record", "pyroute2.netlink.rtnl.ifinfmsg",
         "rdma_cni.verbs.add")
assert not any(name in sys.modules for name in heavy)
warm.preload()
before = set(sys.modules)
tmp = sys.argv[1]
conf = {"cniVersion": "1.1.0", "name": "n", "type": "rdma-cni", "stateDir": tmp + "/state",
        "lockFile": tmp + "/lock", "cni.dev/valid-attachments": []}
code, _ = run_cni({"CNI_COMMAND": "GC", "CNI_PATH": "/usr/lib/cni"}, json.dumps(conf).encode())
print(json.dumps({"code": code, "heavy": [n for n in heavy if n in before],
                  "new": sorted(set(sys.modules) - before)}))
"""


def test_preload_imports_what_a_verb_would_import(tmp_path: Path) -> None:
    (tmp_path / "sys").mkdir()
    env = {**os.environ, "RDMA_CNI_SYSFS_ROOT": str(tmp_path / "sys")}
    out = subprocess.run(
        [sys.executable, "-c", PRELOAD_CHECK, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["code"] == 0
    assert len(seen["heavy"]) == 5
    # The verb itself (config, lock, netlink, records) imports nothing more.
    assert seen["new"] == [], seen["new"]


GET_AFTER_PRELOAD = """
import json, sys
sys.path.insert(0, sys.argv[2])
from rdma_cni.kube import credentials, podget, tls
from rdma_cni.launch import warm
from tests.support.apiserver import ApiServer
warm.preload()
with ApiServer() as api:
    api.add_pod("default", "web-0", {})
    creds = credentials.load_credentials(api.write_kubeconfig(sys.argv[1] + "/kc", mode="token"))
    before = set(sys.modules)
    pod = podget.get_pod(creds, "default", "web-0")
print(json.dumps({"name": pod["metadata"]["name"], "new": sorted(set(sys.modules) - before)}))
"""


def test_preload_covers_the_pod_get(tmp_path: Path) -> None:
    # ADD's one network request must not import anything in each warm child either.
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-c", GET_AFTER_PRELOAD, str(tmp_path), root],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["name"] == "web-0"
    assert seen["new"] == [], seen["new"]


def test_server_keeps_the_tls_contexts_its_children_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rdma_cni.kube import credentials, podget, tls
    from tests.support.apiserver import ApiServer

    kept: dict[bytes, object] = {}
    monkeypatch.setattr(tls, "_CONTEXTS", kept)
    tree = tmp_path / "tree"
    tree.mkdir()
    server = warm.Server(str(tree), None, run=main)
    try:
        server._keep_contexts()  # nothing said yet: nothing to do
        with ApiServer() as api:
            api.add_pod("default", "web-0", {})
            good = api.write_kubeconfig(tmp_path / "kc", mode="token")
            # A child names a kubeconfig twice and one that cannot be read: the server keeps going.
            os.write(server.hint_w, f"{good}\n{tmp_path}/missing\n{good}\n".encode())
            server._keep_contexts()
            assert len(kept) == 1
            creds = credentials.load_credentials(good)
            monkeypatch.setattr(tls, "ssl_context", lambda *_: pytest.fail("the kept context was not used"))
            assert podget.get_pod(creds, "default", "web-0")["metadata"]["name"] == "web-0"
    finally:
        for fd in (server.hint_r, server.hint_w, server.wake_r, server.wake_w, server.dirfd):
            os.close(fd)
        server.listener.close()


def test_preload_proves_once_for_every_child_that_sysfs_shows_this_namespace() -> None:
    # Each warm child and verb worker is forked after preload: the dump that proves the view
    # (kernel/identity.sysfs_shows) is then not repeated by every ADD.
    check = (
        "from rdma_cni.launch import warm\n"
        "from rdma_cni.kernel import identity\n"
        "warm.preload()\n"
        "print(len(identity._VIEWS_PROVEN))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split()[-1] == "1"
