"""The thick design's two halves as a node has them, for tests: the shim installed by the installer,
and ``rdma-cni cni-server`` serving it on a socket of the test's own.

Shared by the integration, old-root and runtime tiers, so each runs the
installer's shim and the server the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence


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


class CniServerProcess:
    """``rdma-cni cni-server --socket PATH`` with ``env`` (the node's), its stderr kept in ``log_path``.

    ``state``: the test's ``stateDir`` and ``lockFile``, never the machine's own (the server's default).

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
    ) -> None:
        self.socket_path = socket_path
        self.log_path = log_path
        argv = [*command, "cni-server", "--socket", socket_path, *(["--plugin", plugin] if plugin else [])]
        if state is not None:
            # The stateDir (and lockFile) whose records of an earlier boot the server releases at start.
            argv += ["--state-dir", state[0], "--lock-file", state[1]]
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
