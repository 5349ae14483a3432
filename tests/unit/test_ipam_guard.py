"""The IPAM guard (rdma_cni.node.ipam_guard.run_guarded): output, timeouts, groups, outliving its caller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdma_cni.cni.errors import IpamError, TryAgainLater
from rdma_cni.node.ipam_guard import run_guarded
from rdma_cni.node.record import node_lock
from tests.support.processes import pids_mentioning, wait_gone

ENV = {"PATH": "/usr/bin:/bin"}


def _built_launcher() -> str:
    binary = os.environ.get("RDMA_CNI_BINARY", "")
    if not binary:
        pytest.skip("the exec'd guard is the built launcher's (make build; RDMA_CNI_BINARY)")
    return binary


@pytest.fixture(autouse=True, params=["forked", "exec'd"])
def guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every test runs against both guards: a fork of the plugin, and the launcher's guard mode."""
    from rdma_cni.node import ipam_guard

    if request.param == "forked":
        monkeypatch.setattr(ipam_guard, "_launcher", None)
        yield ""
        return
    path = _built_launcher()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    monkeypatch.setattr(ipam_guard, "_launcher", (fd, path))
    try:
        yield path
    finally:
        os.close(fd)


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


def test_ipam_that_closes_its_output_but_keeps_running_is_still_cut_at_the_deadline(tmp_path: Path) -> None:
    tagged = tmp_path / f"guardquiet{os.getpid()}"
    tagged.symlink_to("/bin/sleep")
    started = time.monotonic()
    # Its pipes close at once: only its exit (or the deadline) may end the wait.
    done = run_guarded(["/bin/sh", "-c", f"exec >&- 2>&- <&-; exec {tagged} 60"], ENV, b"", 0.5)
    assert done.timed_out and done.signal == signal.SIGKILL
    assert time.monotonic() - started < 5
    assert wait_gone(pids_mentioning(str(tagged)), timeout=3)


def test_a_grandchild_that_left_the_group_holding_the_pipes_does_not_hold_the_guard(tmp_path: Path) -> None:
    from rdma_cni.node import ipam_guard

    tagged = tmp_path / f"guardescape{os.getpid()}"
    tagged.symlink_to("/bin/sleep")
    started = time.monotonic()
    # setsid: out of the group the guard kills, with IPAM's stdout and stderr still open.
    done = run_guarded(["/bin/sh", "-c", f"setsid {tagged} 30 & exec {tagged} 60"], ENV, b"", 0.5)
    elapsed = time.monotonic() - started
    assert done.timed_out and done.signal == signal.SIGKILL
    assert elapsed < 0.5 + ipam_guard.GUARD_GRACE_SECONDS, (
        elapsed
    )  # the guard's own grace, not the parent's kill
    for pid in pids_mentioning(str(tagged)):
        os.kill(pid, signal.SIGKILL)


def test_the_end_of_a_long_stderr_is_kept() -> None:
    script = 'head -c 200000 /dev/zero | tr "\\0" a >&2; echo last >&2; echo ok'
    done = run_guarded(["/bin/sh", "-c", script], ENV, b"", 10)
    assert done.stdout == b"ok\n"
    assert len(done.stderr) == 65536 and done.stderr.endswith(b"aaalast\n"), done.stderr[-20:]


def test_ipam_that_exits_without_reading_a_large_stdin_is_reported() -> None:
    done = run_guarded(["/bin/sh", "-c", "echo early; exit 4"], ENV, b"x" * (1 << 20), 10)
    assert (done.status, done.stdout, done.timed_out) == (4, b"early\n", False)


CALLER = textwrap.dedent(
    """
    import sys
    from rdma_cni.node.ipam_guard import run_guarded
    from rdma_cni.node.record import node_lock
    lock, out = sys.argv[1], sys.argv[2]
    if sys.argv[3]:  # the launcher to guard with (else a fork)
        import os
        from rdma_cni.node import ipam_guard
        ipam_guard._launcher = (os.open(sys.argv[3], os.O_RDONLY), sys.argv[3])
    with node_lock(lock, 5):
        print("locked", flush=True)
        run_guarded(["/bin/sh", "-c", f"sleep 1.5; echo done > {out}"], {"PATH": "/usr/bin:/bin"}, b"", 30)
    """
)


def test_killing_the_caller_leaves_ipam_to_finish_holding_the_lock(tmp_path: Path, guard: str) -> None:
    lock, out = str(tmp_path / "lock"), tmp_path / "lease"
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, lock, str(out), guard], stdout=subprocess.PIPE, start_new_session=True
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
    from rdma_cni.cni.protocol import parse_env
    from rdma_cni.node import ipam

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


def test_a_started_guard_runs_while_the_caller_works_and_collect_is_idempotent(tmp_path: Path) -> None:
    from rdma_cni.node.ipam_guard import start_guarded

    go = tmp_path / "go"
    # The program waits for a file the caller creates only after start_guarded returned:
    # had start_guarded waited for the program, it would see no file and say so.
    wait = f"i=0; while [ ! -e {go} ] && [ $i -lt 300 ]; do sleep 0.01; i=$((i+1)); done"
    script = f"{wait}; [ -e {go} ] && echo seen"
    call = start_guarded(["/bin/sh", "-c", script], ENV, b"", 10)
    go.touch()
    done = call.collect()
    assert (done.status, done.stdout) == (0, b"seen\n")
    assert call.collect() is done  # a second wait (a caller's finally) neither blocks nor re-reads


def test_an_ipam_call_never_run_has_no_result_and_a_moot_del(tmp_path: Path) -> None:
    from rdma_cni.cni.protocol import parse_env
    from rdma_cni.node import ipam

    plugin = tmp_path / "old-ipam"
    plugin.write_text(
        '#!/bin/sh\necho \'{"cniVersion": "0.2.0", "supportedVersions": ["0.1.0", "0.2.0"]}\'\n'
    )
    plugin.chmod(0o755)
    env = parse_env(
        {"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "net1", "CNI_PATH": str(tmp_path)}
    )
    doc = {"cniVersion": "1.1.0", "name": "n", "ipam": {"type": "old-ipam"}}
    delegate = ipam.Ipam(doc, env, str(tmp_path / "state"))
    ipam.start_verb()
    with pytest.raises(IpamError, match="ADD for net1 returned no result"):
        delegate.add("net1")
    call = delegate.start("DEL", "net1")
    assert call.guarded is None and call.wait() is None
    delegate.finish_delete(call)  # nothing to release: a plugin that cannot speak 0.3.0 was never run


@pytest.mark.parametrize("guard", ["forked"], indirect=True)
def test_only_a_launcher_carrying_this_very_build_is_run_as_the_guard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rdma_cni.launch import payload
    from rdma_cni.node import ipam_guard

    launcher = _built_launcher()
    own = payload.payload_id(launcher)
    assert own is not None
    tree = tmp_path / own
    tree.mkdir()
    monkeypatch.setattr(sys, "executable", str(tree / "rdma-cni"))
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setenv("RDMA_CNI_LAUNCHER", launcher)

    def looked_up() -> tuple[int, str] | None:
        monkeypatch.setattr(ipam_guard, "_launcher", False)
        found = ipam_guard._guard_launcher()
        if found is not None:
            os.close(found[0])
        return found

    assert (looked_up() or (0, ""))[1] == launcher
    # Another build's launcher (an upgrade or a downgrade installed meanwhile) would not know the
    # guard mode: the guard is then a fork. So without the launcher, and outside the built binary.
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setattr(sys, "executable", str(other / "rdma-cni"))
    assert looked_up() is None
    monkeypatch.setattr(sys, "executable", str(tree / "rdma-cni"))
    monkeypatch.setenv("RDMA_CNI_LAUNCHER", str(tmp_path / "gone"))
    assert looked_up() is None
    monkeypatch.setenv("RDMA_CNI_LAUNCHER", launcher)
    monkeypatch.setattr(sys, "frozen", False)
    assert looked_up() is None
