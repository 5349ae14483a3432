"""``rdma-cni install`` on temporary directory trees standing in for a node."""

from __future__ import annotations

import io
import json
import logging
import os
import queue
import select
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.cni.config import load_netconf
from rdma_cni.install import binary, command, common
from rdma_cni.kube import credentials, podget

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.support.apiserver import ApiServer  # noqa: E402
from tests.support.cniserver import host_state_untouched  # noqa: E402

FAKE_CA = b"-----BEGIN CERTIFICATE-----\nMIIBfakefakefake\n-----END CERTIFICATE-----\n"
ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


class Node:
    """A fake node: CNI dirs, a service-account dir and source binaries, all under one tmp dir."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin_dir = root / "opt/cni/bin"
        self.conf_dir = root / "etc/cni/net.d"
        self.kubeconfig = self.conf_dir / "rdma-cni.d/rdma-cni.kubeconfig"
        self.sa_dir = root / "sa"
        self.src_dir = root / "src"
        self.ready = root / "ready"
        self.sa_dir.mkdir(parents=True)
        self.src_dir.mkdir()
        self.set_token("token-one")
        (self.sa_dir / "ca.crt").write_bytes(FAKE_CA)

    @property
    def target(self) -> Path:
        return self.bin_dir / "rdma-cni"

    def set_token(self, token: str) -> None:
        # kubelet swaps the projected volume's files atomically; do the same.
        tmp = self.sa_dir / ".token.new"
        tmp.write_text(token)
        os.replace(tmp, self.sa_dir / "token")

    def script(self, version: str, padding: int = 0) -> Path:
        """A shell script standing in for the binary; it prints ``version``.

        The padding comes first, so a partially written copy prints nothing.
        """
        path = self.src_dir / f"rdma-cni-{version}"
        pad = ("# " + "x" * 1000 + "\n") * (padding // 1002)
        path.write_text(f"#!/bin/sh\n{pad}echo {version}\n")
        path.chmod(0o755)
        return path

    def args(self, source: Path, *extra: str) -> list[str]:
        return [
            "--source",
            str(source),
            "--cni-bin-dir",
            str(self.bin_dir),
            "--cni-conf-dir",
            str(self.conf_dir),
            "--kubeconfig-path",
            str(self.kubeconfig),
            "--serviceaccount-dir",
            str(self.sa_dir),
            *extra,
        ]

    def options(self, source: Path, **kw: object) -> common.Options:
        return common.Options(
            source=str(source),
            cni_bin_dir=str(self.bin_dir),
            kubeconfig_path=str(self.kubeconfig),
            serviceaccount_dir=str(self.sa_dir),
            cni_conf_dir=str(self.conf_dir),
            environ=dict(ENV),
            **kw,  # type: ignore[arg-type]
        )


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    return Node(tmp_path)


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = command.main(argv, out, err)
    return code, out.getvalue(), err.getvalue()


def kubeconfig_token(path: Path) -> str:
    return json.loads(path.read_text())["users"][0]["user"]["token"]


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".tmp") or p.name.endswith(".tmp"))


# --------------------------------------------------------------------------
# The binary


def test_installs_binary_marker_and_kubeconfig(node: Node) -> None:
    src = node.script("v1")
    code, out, err = run(node.args(src))
    assert code == 0, err
    assert node.target.read_bytes() == src.read_bytes()
    assert stat.S_IMODE(node.target.stat().st_mode) == 0o755
    marker = json.loads((node.bin_dir / ".rdma-cni.installed").read_text())
    assert marker["sha256"] == binary.sha256_file(str(src))
    assert subprocess.run([node.target], capture_output=True, text=True, check=True).stdout == "v1\n"
    assert "installed" in out and str(node.target) in out
    assert leftovers(node.bin_dir) == [] and leftovers(node.kubeconfig.parent) == []


def test_reinstall_same_and_upgrade(node: Node) -> None:
    v1, v2 = node.script("v1"), node.script("v2")
    assert run(node.args(v1))[0] == 0
    inode = node.target.stat().st_ino
    code, out, _ = run(node.args(v1))
    assert code == 0 and "unchanged" in out
    assert node.target.stat().st_ino == inode  # not rewritten
    code, out, _ = run(node.args(v2))
    assert code == 0 and "replaced" in out
    assert node.target.read_bytes() == v2.read_bytes()
    marker = json.loads((node.bin_dir / ".rdma-cni.installed").read_text())
    assert marker["sha256"] == binary.sha256_file(str(v2))
    assert binary.sha256_file(str(v1)) in marker["previous"]


def test_atomic_replace_while_executing(node: Node, tmp_path: Path) -> None:
    # Big enough to take several write chunks, so a non-atomic copy would be
    # caught half-written by the exec loop.
    versions = [node.script("v1", padding=3 << 20), node.script("v2", padding=3 << 20)]
    assert run(node.args(versions[0]))[0] == 0
    stop_file = tmp_path / "stop"
    results_file = tmp_path / "results.json"
    loop = textwrap.dedent(
        """
        import json, os, subprocess, sys
        target, stop, results = sys.argv[1:4]
        seen = []
        announced = False
        while not os.path.exists(stop):
            try:
                p = subprocess.run([target], capture_output=True, text=True)
                seen.append([p.returncode, p.stdout, p.stderr])
            except OSError as exc:
                seen.append([-1, "", f"{type(exc).__name__}: errno {exc.errno}"])
            if not announced:
                print("running", flush=True)
                announced = True
        with open(results, "w") as f:
            json.dump(seen, f)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", loop, str(node.target), str(stop_file), str(results_file)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready and proc.stdout.readline().strip() == "running"
        for i in range(1, 13):
            src = versions[i % 2]
            code, _, err = run(node.args(src))
            assert code == 0, err
            time.sleep(0.03)
    finally:
        stop_file.touch()
        proc.wait(timeout=60)
    seen = json.loads(results_file.read_text())
    assert len(seen) >= 5
    bad = [s for s in seen if s[0] != 0 or s[1] not in ("v1\n", "v2\n") or s[2]]
    assert not bad, bad[:5]
    assert leftovers(node.bin_dir) == []
    # The last install (i = 12) was v1.
    assert subprocess.run([node.target], capture_output=True, text=True).stdout == "v1\n"


def test_refuses_foreign_binary_without_force(node: Node) -> None:
    node.bin_dir.mkdir(parents=True)
    node.target.write_text("#!/bin/sh\necho someone else\n")
    foreign = node.target.read_bytes()
    src = node.script("v1")
    code, _, err = run(node.args(src))
    assert code == 1
    assert "refusing to overwrite" in err and "--force" in err and str(node.target) in err
    assert node.target.read_bytes() == foreign

    code, out, err = run(node.args(src, "--force"))
    assert code == 0, err
    assert "--force" in out
    assert node.target.read_bytes() == src.read_bytes()
    # From now on the file is ours: an upgrade needs no --force.
    assert run(node.args(node.script("v2")))[0] == 0


def test_existing_identical_file_is_accepted(node: Node) -> None:
    src = node.script("v1")
    node.bin_dir.mkdir(parents=True)
    node.target.write_bytes(src.read_bytes())
    code, out, err = run(node.args(src))
    assert code == 0, err
    assert "unchanged" in out


def test_previous_hash_in_marker_is_still_ours(node: Node) -> None:
    # As after a crash between writing the marker and renaming the binary.
    v1, v2, v3 = node.script("v1"), node.script("v2"), node.script("v3")
    assert run(node.args(v1))[0] == 0
    marker = node.bin_dir / ".rdma-cni.installed"
    doc = json.loads(marker.read_text())
    doc["previous"] = [doc["sha256"]]
    doc["sha256"] = binary.sha256_file(str(v2))
    marker.write_text(json.dumps(doc))
    assert run(node.args(v3))[0] == 0
    assert node.target.read_bytes() == v3.read_bytes()


def test_source_required_outside_a_frozen_build(node: Node) -> None:
    args = node.args(node.script("v1"))[2:]  # drop --source
    code, _, err = run(args)
    assert code == 1 and "--source" in err
    assert not node.target.exists()


def test_frozen_binary_installs_itself(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    src = node.script("v1")
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "executable", str(src))
    code, _, err = run(node.args(src)[2:])  # no --source
    assert code == 0, err
    assert node.target.read_bytes() == src.read_bytes()


@pytest.mark.parametrize("name", ["../rdma-cni", ".rdma-cni", ""])
def test_bad_name_is_a_usage_error(node: Node, name: str) -> None:
    with pytest.raises(SystemExit) as excinfo:
        run(node.args(node.script("v1"), "--name", name))
    assert excinfo.value.code == 2


def test_missing_source(node: Node) -> None:
    code, _, err = run(node.args(node.root / "nope"))
    assert code == 1 and "does not exist" in err


# --------------------------------------------------------------------------
# The kubeconfig


def test_kubeconfig_mode_and_content(node: Node) -> None:
    assert run(node.args(node.script("v1")))[0] == 0
    assert stat.S_IMODE(node.kubeconfig.stat().st_mode) == 0o600
    creds = credentials.load_credentials(str(node.kubeconfig))
    assert creds.server == "https://10.96.0.1:443"
    assert creds.token == "token-one"
    assert creds.ca_data == FAKE_CA
    # Inline data only: nothing refers to the pod's secret mount.
    assert str(node.sa_dir) not in node.kubeconfig.read_text()


def test_kubeconfig_ipv6_server(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00:10:96::1")
    assert run(node.args(node.script("v1")))[0] == 0
    assert credentials.load_credentials(str(node.kubeconfig)).server == "https://[fd00:10:96::1]:443"


def test_kubeconfig_reaches_api_server(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    # End to end: the written kubeconfig authenticates and verifies TLS against a real HTTPS server.
    with ApiServer() as api:
        api.add_pod("default", "rdma-test-pod", {"rdma_interfaces_required": "[{}]"})
        node.set_token(api.token)
        (node.sa_dir / "ca.crt").write_bytes(Path(api.ca_path).read_bytes())
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", api.host)
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
        assert run(node.args(node.script("v1")))[0] == 0
        creds = credentials.load_credentials(str(node.kubeconfig))
        pod = podget.get_pod(creds, "default", "rdma-test-pod", retries=0)
        assert podget.pod_annotation(pod, "rdma_interfaces_required") == "[{}]"


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        ("no-token", "token"),
        ("empty-token", "is empty"),
        ("no-ca", "ca.crt"),
        ("no-host", "KUBERNETES_SERVICE_HOST"),
        ("bad-port", "KUBERNETES_SERVICE_PORT"),
    ],
)
def test_missing_service_account_pieces(
    node: Node, monkeypatch: pytest.MonkeyPatch, breakage: str, expected: str
) -> None:
    if breakage == "no-token":
        (node.sa_dir / "token").unlink()
    elif breakage == "empty-token":
        node.set_token("\n")
    elif breakage == "no-ca":
        (node.sa_dir / "ca.crt").unlink()
    elif breakage == "no-host":
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    elif breakage == "bad-port":
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "https")
    code, _, err = run(node.args(node.script("v1")))
    assert code == 1
    assert err.startswith("rdma-cni install: error: ") and expected in err
    assert "Traceback" not in err
    assert not node.kubeconfig.exists()
    assert not node.target.exists()  # nothing half-done


def test_token_never_printed(node: Node) -> None:
    node.set_token("secret token with spaces")
    code, out, err = run(node.args(node.script("v1")))
    assert code == 1 and "whitespace" in err
    assert "secret" not in out + err


# --------------------------------------------------------------------------
# Watching for token rotation


@pytest.fixture
def watcher(node: Node) -> Iterator[Callable[[common.Options], tuple[threading.Event, io.StringIO]]]:
    threads: list[tuple[threading.Thread, threading.Event]] = []

    def start(opts: common.Options) -> tuple[threading.Event, io.StringIO]:
        stop = threading.Event()
        out = io.StringIO()
        t = threading.Thread(target=command.watch, args=(opts, stop, out), daemon=True)
        t.start()
        threads.append((t, stop))
        return stop, out

    yield start
    for t, stop in threads:
        stop.set()
        t.join(timeout=10)
        assert not t.is_alive()


def test_watch_refreshes_rotated_token(node: Node, watcher: Callable) -> None:
    opts = node.options(node.script("v1"), interval=0.02, ready_file=str(node.ready))
    command.run_once(opts, io.StringIO())
    assert kubeconfig_token(node.kubeconfig) == "token-one"
    _, out = watcher(opts)

    node.set_token("token-two")
    wait_for(lambda: kubeconfig_token(node.kubeconfig) == "token-two")
    assert stat.S_IMODE(node.kubeconfig.stat().st_mode) == 0o600
    assert credentials.load_credentials(str(node.kubeconfig)).token == "token-two"

    # Caught mid-rotation: the last good kubeconfig stays, readiness drops, then recovers.
    wait_for(node.ready.exists)
    (node.sa_dir / "token").unlink()
    wait_for(lambda: not node.ready.exists())
    assert kubeconfig_token(node.kubeconfig) == "token-two"
    node.set_token("token-three")
    wait_for(lambda: kubeconfig_token(node.kubeconfig) == "token-three")
    wait_for(node.ready.exists)
    text = out.getvalue()
    assert "rewrote kubeconfig" in text and "refresh failed" in text and "works again" in text


def test_watch_keeps_the_live_file_fresh_while_every_part_runs(node: Node) -> None:
    """The liveness probe's file: touched each tick while the agent's parts run, left to age if one stops."""
    live = node.root / "live"
    opts = node.options(node.script("v1"), interval=0.02, live_file=str(live))
    command.run_once(opts, io.StringIO())
    dead: list[str] = []
    stop, out = threading.Event(), io.StringIO()
    t = threading.Thread(
        target=command.watch, args=(opts, stop, out), kwargs={"alive": lambda: list(dead)}, daemon=True
    )
    t.start()
    try:
        wait_for(live.exists)
        os.utime(live, (0, 0))
        wait_for(lambda: live.stat().st_mtime > 0)  # touched again
        dead.append("the node agent")
        time.sleep(0.1)  # a tick that was under way may still touch it
        os.utime(live, (0, 0))
        time.sleep(0.2)
        assert live.stat().st_mtime == 0
        assert "the node agent stopped: no longer touching the live file" in out.getvalue()
        dead.clear()
        wait_for(lambda: live.stat().st_mtime > 0)
    finally:
        stop.set()
        t.join(timeout=10)


def test_main_watch_touches_the_live_file(node: Node) -> None:
    live = node.root / "live"
    code, _, err = run(
        node.args(
            node.script("v1"),
            "--watch",
            "--interval",
            "0.01",
            "--max-iterations",
            "2",
            "--live-file",
            str(live),
        )
    )
    assert code == 0, err
    assert live.exists()


def test_watch_restores_deleted_kubeconfig(node: Node, watcher: Callable) -> None:
    opts = node.options(node.script("v1"), interval=0.02)
    command.run_once(opts, io.StringIO())
    watcher(opts)
    node.kubeconfig.unlink()
    wait_for(node.kubeconfig.exists)
    assert kubeconfig_token(node.kubeconfig) == "token-one"


def test_watch_stops_on_event(node: Node) -> None:
    opts = node.options(node.script("v1"), interval=30)
    stop = threading.Event()
    t = threading.Thread(target=command.watch, args=(opts, stop, io.StringIO()))
    t.start()
    stop.set()
    t.join(timeout=5)
    assert not t.is_alive()


def test_main_watch_with_max_iterations(node: Node) -> None:
    code, out, err = run(
        node.args(node.script("v1"), "--watch", "--interval", "0.01", "--max-iterations", "3")
    )
    assert code == 0, err
    assert "watching" in out and "stopping" in out


def test_sigterm_stops_watch(node: Node) -> None:
    env = {**os.environ, **ENV, "PYTHONPATH": str(_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rdma_cni", "install", *node.args(node.script("v1"), "--watch")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=node.root,
    )
    # A reader thread, not select(): lines already in the pipe object's buffer
    # would never wake select() again.
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout
    reader = threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True)
    reader.start()
    try:
        seen: list[str] = []
        while not any("watching" in line for line in seen):
            try:
                seen.append(lines.get(timeout=30))
            except queue.Empty:
                raise AssertionError(f"installer never started watching: {seen}") from None
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 0, err
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert any("stopping" in line for line in rest), rest
    assert node.target.exists()


# --------------------------------------------------------------------------
# --write-conf


def test_write_default_conf(node: Node) -> None:
    src = node.script("v1")
    code, out, err = run(node.args(src, "--write-conf", "99-rdma-cni.conflist"))
    assert code == 0, err
    path = node.conf_dir / "99-rdma-cni.conflist"
    conflist = json.loads(path.read_text())
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    (entry,) = conflist["plugins"]
    # The built-in default points at the kubeconfig this installer writes.
    assert entry["kubeconfig"] == str(node.kubeconfig)
    conf = load_netconf({**entry, "cniVersion": conflist["cniVersion"], "name": conflist["name"]})
    assert conf.type == "rdma-cni"

    inode = path.stat().st_ino
    code, out, _ = run(node.args(src, "--write-conf", "99-rdma-cni.conflist"))
    assert code == 0 and "unchanged" in out
    assert path.stat().st_ino == inode


def test_write_conf_from_source_and_force(node: Node) -> None:
    src = node.script("v1")
    custom = node.root / "custom.conflist"
    doc = {"cniVersion": "1.0.0", "name": "rdma-net", "plugins": [{"type": "rdma-cni", "logLevel": "debug"}]}
    custom.write_text(json.dumps(doc))
    target = node.conf_dir / "99-rdma-cni.conflist"
    node.conf_dir.mkdir(parents=True)
    target.write_text('{"cniVersion": "1.0.0", "name": "other", "plugins": [{"type": "bridge"}]}')
    before = target.read_text()

    args = node.args(src, "--write-conf", target.name, "--conf-source", str(custom))
    code, _, err = run(args)
    assert code == 1
    assert "refusing to overwrite" in err and "--force" in err
    assert target.read_text() == before

    code, out, err = run([*args, "--force"])
    assert "--force" in out
    assert code == 0, err
    assert json.loads(target.read_text()) == doc
    assert leftovers(node.conf_dir) == []


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("rdma.yaml", None, "only load files ending"),
        ("../escape.conflist", None, "file name inside"),
        ("rdma.conflist", "{not json", "not valid JSON"),
        ("rdma.conflist", '{"cniVersion": "1.0.0", "name": "x", "type": "rdma-cni"}', "plugins"),
        ("rdma.conf", '{"cniVersion": "1.0.0", "name": "x", "plugins": [{"type": "a"}]}', ".conflist"),
        ("rdma.conf", '{"cniVersion": "1.0.0", "type": "rdma-cni"}', "name is missing"),
    ],
)
def test_write_conf_rejects_bad_input(node: Node, name: str, content: str | None, expected: str) -> None:
    extra = ["--write-conf", name]
    if content is not None:
        source = node.root / "source.json"
        source.write_text(content)
        extra += ["--conf-source", str(source)]
    code, _, err = run(node.args(node.script("v1"), *extra))
    assert code == 1
    assert expected in err
    assert not any(node.conf_dir.glob("*.conf*"))


def test_conf_source_needs_write_conf(node: Node) -> None:
    with pytest.raises(SystemExit) as excinfo:
        run(node.args(node.script("v1"), "--conf-source", "/dev/null"))
    assert excinfo.value.code == 2


def test_cli_dispatches_to_install(node: Node) -> None:
    from rdma_cni.cli.main import main as cli_main

    out = io.StringIO()
    assert cli_main(["install", *node.args(node.script("v1"))], stdout=out) == 0
    assert node.target.exists()


# --mode shim: the static shim goes into the bin dir, and with --watch the agent serves its calls.


def test_mode_shim_installs_the_shim_beside_the_source(node: Node) -> None:
    fat = node.script("fat")
    shim = node.src_dir / "rdma-cni-shim"
    shim.write_text("#!/bin/sh\necho shim\n")
    shim.chmod(0o755)
    code, out, _ = run(node.args(fat, "--mode", "shim"))
    assert code == 0
    assert node.target.read_bytes() == shim.read_bytes()
    assert "run `rdma-cni cni-server`" in out
    # Back to the fat binary: the installer wrote the shim, so it may replace it.
    assert run(node.args(fat, "--mode", "fat"))[0] == 0
    assert node.target.read_bytes() == fat.read_bytes()


def test_mode_shim_without_a_shim_is_an_install_error(node: Node) -> None:
    code, _, err = run(node.args(node.script("fat"), "--mode", "shim"))
    assert code == 1
    assert "rdma-cni-shim does not exist" in err


def network_conf(path: Path, state_dir: object, lock_file: object) -> Path:
    """A conflist of one rdma-cni network with its own stateDir and lockFile."""
    entry = {"type": "rdma-cni", "stateDir": str(state_dir), "lockFile": str(lock_file)}
    path.write_text(json.dumps({"cniVersion": "1.1.0", "name": path.stem, "plugins": [entry]}))
    return path


def shim_watch_args(node: Node, tmp_path: Path, *networks: Path) -> list[str]:
    """``--mode shim --watch`` for two ticks, serving a socket of the test's own, for ``networks``."""
    shim = node.src_dir / "shim-elsewhere"
    shim.write_text("#!/bin/sh\n")
    socket_path = tmp_path / "agent" / "cni.sock"
    argv = node.args(node.script("fat"), "--mode", "shim", "--shim-source", str(shim))
    argv += ["--cni-socket", str(socket_path), "--watch", "--interval", "0.05", "--max-iterations", "2"]
    return argv + [f"--network-config={path}" for path in networks]


def test_mode_shim_with_watch_serves_the_socket_first(node: Node, tmp_path: Path) -> None:
    socket_path = tmp_path / "agent" / "cni.sock"
    # The test's own network: the server releases its stateDir at start, never the machine's.
    net = network_conf(tmp_path / "net-a.conflist", tmp_path / "state", tmp_path / "run" / "lock")
    argv = shim_watch_args(node, tmp_path, net)
    with host_state_untouched() as asked:
        code, out, _ = run(argv)
    assert code == 0
    assert asked == [(str(tmp_path / "state"), str(tmp_path / "run" / "lock"))]
    assert f"serving CNI verbs for the shim on {socket_path}" in out
    assert not socket_path.exists()  # stopped with the installer
    # A socket directory others can enter is refused before anything is installed.
    os.chmod(tmp_path / "agent", 0o755)
    node.target.unlink()
    code, _, err = run(argv)
    assert code == 1 and "CNI server" in err and "mode 0700" in err
    assert not node.target.exists()


def test_mode_shim_with_watch_has_the_workers_connect_to_the_kubeconfig_it_writes(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rdma_cni.agent import cniserver

    asked: list[list[str]] = []

    class Recording(cniserver.CniServer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            asked.append(list(kwargs.get("kubeconfigs", ())))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(cniserver, "CniServer", Recording)
    net = network_conf(tmp_path / "net-a.conflist", tmp_path / "state", tmp_path / "run" / "lock")
    with host_state_untouched():
        code, _, err = run(shim_watch_args(node, tmp_path, net))
    assert code == 0, err
    assert asked == [[str(node.kubeconfig)]]


class Logged(logging.Handler):
    """What the rdma_cni loggers say (the entry point's handler may stop propagation to caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> Logged:
        logger = logging.getLogger("rdma_cni")
        self.old_level = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *_exc: object) -> None:
        logger = logging.getLogger("rdma_cni")
        logger.removeHandler(self)
        logger.setLevel(self.old_level)


def test_mode_shim_with_watch_releases_every_networks_earlier_boot(node: Node, tmp_path: Path) -> None:
    """Each --network-config's stateDir, not only the plugin's default; a refused one logged and skipped."""
    from rdma_cni.node import boot

    nets, states = [], []
    for name in ("net-a", "net-b"):
        state = tmp_path / name / "state"
        (state / "attachments").mkdir(parents=True, mode=0o700)
        (state / boot.MARKER).write_text(
            "0f5c8a2e-4b1d-4c3e-9a7f-1e2d3c4b5a69\n"
        )  # checked in an earlier boot
        states.append((str(state), str(tmp_path / name / "lock")))
        nets.append(network_conf(tmp_path / f"{name}.conflist", *states[-1]))
    bad = network_conf(tmp_path / "net-bad.conflist", "relative/state", tmp_path / "lock")
    argv = shim_watch_args(node, tmp_path, nets[0], bad, nets[1])
    with host_state_untouched() as asked, Logged() as logged:
        code, _, err = run(argv)
    assert code == 0, err
    assert asked == states
    for state, _lock in states:
        assert boot.checked(state, boot.boot_id())  # the pass ran: nothing of the earlier boot left
    text = "\n".join(logged.lines)
    assert f"records of earlier boots of {bad} not released at start" in text
    assert "stateDir" in text and "must be an absolute path" in text


def test_network_config_without_the_agent_or_the_cni_server_is_refused(node: Node, tmp_path: Path) -> None:
    net = network_conf(tmp_path / "net-a.conflist", tmp_path / "state", tmp_path / "lock")
    with pytest.raises(SystemExit) as exc:
        run(node.args(node.script("fat"), "--mode", "shim", f"--network-config={net}"))
    assert exc.value.code == 2


def test_cni_server_command_line(tmp_path: Path) -> None:
    from rdma_cni.agent import cniserver

    assert cniserver.main(["--max-connections", "0"]) == 2
    d = tmp_path / "open"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    assert cniserver.main(["--socket", str(d / "cni.sock")]) == 1


def test_mode_shim_with_watch_is_ready_only_once_its_verb_workers_are(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rdma_cni.agent import cniserver

    net = network_conf(tmp_path / "net-a.conflist", tmp_path / "state", tmp_path / "run" / "lock")
    ready = tmp_path / "ready"
    argv = [*shim_watch_args(node, tmp_path, net), "--ready-file", str(ready)]
    code, _, err = run(argv)
    assert code == 0, err
    assert ready.exists()
    ready.unlink()
    # Workers that never start (a plugin that is not one): never Ready, until stopped.
    broken = tmp_path / "broken-plugin"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(cniserver, "default_plugin", lambda: [str(broken)])
    seen: list[bool] = []

    def stop_later() -> None:
        time.sleep(2)
        seen.append(ready.exists())
        os.kill(os.getpid(), signal.SIGTERM)  # the installer, in the main thread, turns it into its stop

    threading.Thread(target=stop_later, daemon=True).start()
    code, out, err = run(argv)
    assert code == 0, err
    assert seen == [False] and not ready.exists()
    assert "waiting for the CNI verb workers" in out
