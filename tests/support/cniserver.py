"""The thick design's two halves as a node has them, for tests: the shim installed by the installer,
and ``rdma-cni cni-server`` serving it on a socket of the test's own.

Shared by the integration, old-root and runtime tiers, so each runs the
installer's shim and the server the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence

from rdma_cni.agent import bootrelease
from rdma_cni.cni.config import DEFAULT_LOCK_FILE, DEFAULT_STATE_DIR
from rdma_cni.node.boot import MARKER


def install_shim(binary: str, bin_dir: str, work_dir: str) -> str:
    """``rdma-cni install --once --mode shim`` into ``bin_dir``, as the DaemonSet runs it; its stdout.

    The kubeconfig and service-account files it wants go under ``work_dir``; the
    shim comes from ``rdma-cni-shim`` beside ``binary`` (``make build``).
    """
    sa = os.path.join(work_dir, "sa")
    os.makedirs(sa, exist_ok=True)
    with open(os.path.join(sa, "token"), "w") as f:
        f.write("test-token")
    with open(os.path.join(sa, "ca.crt"), "w") as f:
        f.write("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    proc = subprocess.run(
        [
            *(binary, "install", "--once", "--mode", "shim", "--cni-bin-dir", bin_dir),
            *("--kubeconfig-path", os.path.join(work_dir, "kubeconfig"), "--serviceaccount-dir", sa),
        ],
        env={**os.environ, "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "rdma-cni-shim" in proc.stdout, proc.stdout
    return proc.stdout


# What of the machine's own plugin state a test must never touch: the defaults' paths, and what a
# release of an earlier boot's records would make or change there.
HOST_STATE_PATHS = (
    DEFAULT_STATE_DIR,
    os.path.join(DEFAULT_STATE_DIR, MARKER),
    os.path.join(DEFAULT_STATE_DIR, "attachments"),
    os.path.join(DEFAULT_STATE_DIR, "ipam-pending"),
    os.path.dirname(DEFAULT_LOCK_FILE),
    DEFAULT_LOCK_FILE,
)


def host_state() -> dict[str, tuple[int, int, int] | None]:
    """Each of :data:`HOST_STATE_PATHS` as (inode, mtime, ctime), None when it does not exist."""
    out: dict[str, tuple[int, int, int] | None] = {}
    for path in HOST_STATE_PATHS:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            out[path] = None
        else:
            out[path] = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
    return out


def names_host_state(state_dir: str, lock_file: str) -> bool:
    """Whether a server asked to release ``state_dir`` with ``lock_file`` would reach the machine's own."""
    state_dir, lock_file = os.path.normpath(state_dir), os.path.normpath(lock_file)
    return state_dir == DEFAULT_STATE_DIR or lock_file == DEFAULT_LOCK_FILE


@contextlib.contextmanager
def host_state_untouched() -> Iterator[list[tuple[str, str]]]:
    """Fail the test if a CNI server it starts in this process names the machine's own plugin state.

    Two checks. Every release of an earlier boot's records a server of this process runs
    (:func:`rdma_cni.agent.bootrelease.release_one`) is recorded, and one for the default
    ``stateDir`` or ``lockFile`` fails the test even when it would change nothing (the machine's
    records already checked this boot): after a reboot it would release them. And the default
    paths are compared before and after, for what a subprocess does. Yields the recorded
    (stateDir, lockFile) pairs, for the test's own assertions.
    """
    asked: list[tuple[str, str]] = []
    real = bootrelease.release_one

    def recording(
        plugin: Sequence[str], env: Mapping[str, str], state_dir: str, lock_file: str, timeout: float
    ) -> None:
        asked.append((state_dir, lock_file))
        if names_host_state(state_dir, lock_file):
            return  # never run: the test fails below
        real(plugin, env, state_dir, lock_file, timeout)

    before = host_state()
    bootrelease.release_one = recording  # type: ignore[assignment]
    try:
        yield asked
    finally:
        bootrelease.release_one = real  # type: ignore[assignment]
    touched = [pair for pair in asked if names_host_state(*pair)]
    assert not touched, f"a test's CNI server named the machine's own plugin state: {touched}"
    after = host_state()
    changed = [path for path in HOST_STATE_PATHS if before[path] != after[path]]
    assert not changed, f"the machine's own plugin state changed during the test: {changed}"


class CniServerProcess:
    """``rdma-cni cni-server --socket PATH`` with ``env`` (the node's), its stderr kept in ``log_path``.

    ``state`` (a ``stateDir`` and ``lockFile``) or ``networks`` (network configuration files):
    the test's own, whose records of an earlier boot the server releases at start. One of them
    is required: without, the server would release the machine's own (the plugin's defaults).

    Started at construction; ready once it printed ``{"listening": PATH}``.
    """

    def __init__(
        self,
        command: Sequence[str],
        socket_path: str,
        env: Mapping[str, str],
        log_path: str,
        plugin: str | None = None,
        state: tuple[str, str] | None = None,
        networks: Sequence[str] = (),
    ) -> None:
        if state is None and not networks:
            raise ValueError("a test's cni-server needs its own state or networks, not the machine's")
        if state is not None and names_host_state(*state):
            raise ValueError(f"a test's cni-server must not release the machine's own state: {state}")
        self.socket_path = socket_path
        self.log_path = log_path
        argv = [*command, "cni-server", "--socket", socket_path, *(["--plugin", plugin] if plugin else [])]
        if state is not None:
            # The stateDir (and lockFile) whose records of an earlier boot the server releases at start.
            argv += ["--state-dir", state[0], "--lock-file", state[1]]
        argv += [f"--network-config={path}" for path in networks]
        with open(log_path, "ab") as log:
            # A file, not a pipe: nobody drains the server's stderr while it serves.
            self.proc = subprocess.Popen(argv, env=dict(env), stdout=subprocess.PIPE, stderr=log)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        try:
            ready = json.loads(line) == {"listening": socket_path}
        except ValueError:
            ready = False
        if not ready:
            self.stop()
            raise AssertionError(f"cni-server did not start ({line!r}): {self.log()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        """What the server logged so far."""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        """SIGTERM, as the agent's container is stopped; SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
