"""The guard that runs IPAM (rdma_cni.ipam.run_guarded): output, timeouts, groups, outliving its caller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rdma_cni.errors import TryAgainLater
from rdma_cni.ipam import run_guarded
from rdma_cni.record import node_lock
from tests.support.processes import pids_mentioning, wait_gone

ENV = {"PATH": "/usr/bin:/bin"}


def test_output_status_and_stdin_come_back() -> None:
    done = run_guarded(["/bin/sh", "-c", "cat; echo out; echo err >&2; exit 3"], ENV, b"in\n", 10)
    assert (done.status, done.signal, done.timed_out) == (3, None, False)
    assert done.stdout == b"in\nout\n" and done.stderr == b"err\n"


def test_a_crash_is_reported_as_its_signal() -> None:
    done = run_guarded(["/bin/sh", "-c", "kill -SEGV $$"], ENV, b"", 10)
    assert (done.status, done.signal) == (None, signal.SIGSEGV)


def test_a_file_that_cannot_be_executed_is_a_spawn_error(tmp_path: Path) -> None:
    bad = tmp_path / "ipam"
    bad.write_bytes(b"\x7fELF garbage")
    bad.chmod(0o755)
    done = run_guarded([str(bad)], ENV, b"", 10)
    assert "format" in done.spawn_error.lower()


def test_overrun_kills_the_whole_group_at_the_deadline(tmp_path: Path) -> None:
    tagged = tmp_path / f"guardtest{os.getpid()}"
    tagged.symlink_to("/bin/sleep")
    started = time.monotonic()
    done = run_guarded(["/bin/sh", "-c", f"{tagged} 60 & exec {tagged} 60"], ENV, b"", 0.5)
    assert done.timed_out
    assert time.monotonic() - started < 5
    assert wait_gone(pids_mentioning(str(tagged)), timeout=3), "a grandchild outlived the timeout"


CALLER = textwrap.dedent(
    """
    import sys
    from rdma_cni.ipam import run_guarded
    from rdma_cni.record import node_lock
    lock, out = sys.argv[1], sys.argv[2]
    with node_lock(lock, 5):
        print("locked", flush=True)
        run_guarded(["/bin/sh", "-c", f"sleep 1.5; echo done > {out}"], {"PATH": "/usr/bin:/bin"}, b"", 30)
    """
)


def test_killing_the_caller_leaves_ipam_to_finish_holding_the_lock(tmp_path: Path) -> None:
    lock, out = str(tmp_path / "lock"), tmp_path / "lease"
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, lock, str(out)], stdout=subprocess.PIPE, start_new_session=True
    )
    assert caller.stdout is not None and caller.stdout.readline() == b"locked\n"
    time.sleep(0.3)
    os.killpg(caller.pid, signal.SIGKILL)  # the plugin's whole group, as a runtime would
    caller.wait()
    # The guard (a session of its own) still holds the node lock while IPAM runs ...
    with pytest.raises(TryAgainLater), node_lock(lock, 0.2):
        pass
    # ... and IPAM finishes its write; then the lock is free.
    with node_lock(lock, 10):
        assert out.read_text() == "done\n"


def test_a_spent_budget_runs_nothing_until_the_next_verb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rdma_cni import ipam
    from rdma_cni.protocol import parse_env

    marker = tmp_path / "ran"
    plugin = tmp_path / "fake-ipam"
    plugin.write_text(f'#!/bin/sh\ntouch {marker}\necho \'{{"cniVersion": "1.0.0", "ips": []}}\'\n')
    plugin.chmod(0o755)
    env = parse_env(
        {"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "net1", "CNI_PATH": str(tmp_path)}
    )
    doc = {"cniVersion": "1.0.0", "name": "n", "ipam": {"type": "fake-ipam"}, "ipamTimeoutSeconds": 2}
    delegate = ipam.Ipam(doc, env, str(tmp_path / "state"))
    monkeypatch.setattr(ipam, "_deadline", time.monotonic() - 0.1)
    with pytest.raises(TryAgainLater, match=r"ipamTimeoutSeconds, 2 s\) is spent"):
        delegate.add("net1")
    assert not marker.exists()
    ipam.start_verb()
    assert delegate.add("net1")["ips"] == []
    assert marker.exists()
