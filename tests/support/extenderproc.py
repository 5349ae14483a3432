"""The built scheduler extender as a process on a free loopback port, for the fault tier's files."""

from __future__ import annotations

import http.client
import json
import subprocess
import time
from pathlib import Path

from tests.integration.conftest import plugin_command


def start_extender(kubeconfig: str | Path, *args: str) -> tuple[subprocess.Popen[str], int]:
    """``rdma-cni scheduler-extender`` on 127.0.0.1 (a free port) with ``args``: its process and port."""
    cmd = [
        *plugin_command(),
        "scheduler-extender",
        "--listen",
        "127.0.0.1:0",
        "--kubeconfig",
        str(kubeconfig),
        *args,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the extender did not start"
    return proc, int(json.loads(line)["listening"].rsplit(":", 1)[1])


def wait_ready(port: int, timeout: float = 30, interval: float = 0.05) -> None:
    """Return once the extender on ``port`` answers /readyz with 200 (its node cache is listed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/readyz")
        ok = conn.getresponse().status == 200
        conn.close()
        if ok:
            return
        time.sleep(interval)
    raise AssertionError("the extender never became ready")
