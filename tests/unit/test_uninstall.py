"""``rdma-cni install --uninstall`` on a temporary root: refuses while pods hold VFs, removes what
install and the plugin put there, and says what it left and why."""

from __future__ import annotations

import fcntl
import io
import json
import os
import socket
from pathlib import Path

import pytest

from rdma_cni.install import command, uninstall

TREE = "0123456789abcdef"
OLD_TREE = "fedcba9876543210"


class Root:
    """A node's paths under one temporary directory, installed by ``rdma-cni install``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin_dir = root / "opt/cni/bin"
        self.conf_dir = root / "etc/cni/net.d"
        self.kubeconfig = self.conf_dir / "rdma-cni.d/rdma-cni.kubeconfig"
        self.state_dir = root / "var/lib/cni/rdma-cni"
        self.lock_file = root / "run/rdma-cni/rdma-cni.lock"
        self.cache = root / "var/cache/rdma-cni"
        self.ready = root / "ready"
        sa = root / "sa"
        sa.mkdir()
        (sa / "token").write_text("token-one")
        (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
        source = root / "rdma-cni-src"
        source.write_text("#!/bin/sh\necho 1\n")
        source.chmod(0o755)
        self.common = [
            "--cni-bin-dir", str(self.bin_dir),
            "--cni-conf-dir", str(self.conf_dir),
            "--kubeconfig-path", str(self.kubeconfig),
            "--write-conf", "10-rdma-cni.conflist",
            "--ready-file", str(self.ready),
        ]  # fmt: skip
        code, _, err = self.main(["--source", str(source), "--serviceaccount-dir", str(sa)])
        assert code == 0, err
        # What the plugin leaves as it runs: state directories, the lock, NRI's state, the cache.
        for sub in ("attachments", "quarantine", "ipam-pending"):
            (self.state_dir / sub).mkdir(parents=True)
        (self.state_dir / "boot-checked").write_text("0f5c8a2e-4b1d-4c3e-9a7f-1e2d3c4b5a69\n")
        self.lock_file.parent.mkdir(parents=True)
        self.lock_file.write_text("")
        (self.lock_file.parent / "nri-state").write_text("registered\n")
        (self.lock_file.parent / "nri-state.lock").write_text("")
        # The CNI server's directory (shim mode): its spool, and the socket a stopped agent left.
        self.socket = self.lock_file.parent / "agent" / "cni.sock"
        (self.socket.parent / "del-spool").mkdir(parents=True)
        for lock in ("cni.lock", "cni.next.lock"):  # the servers' own (rdma_cni/agent/cniserver.py)
            (self.socket.parent / lock).write_text("")
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(self.socket))
        stale.close()
        for tree in (TREE, OLD_TREE):
            (self.cache / tree).mkdir(parents=True)
            (self.cache / tree / "rdma-cni").write_text("")
            (self.cache / tree / ".complete").write_text("")

    def argv(self, *extra: str) -> list[str]:
        return [
            "--uninstall",
            *self.common,
            "--state-dir", str(self.state_dir),
            "--lock-file", str(self.lock_file),
            "--cache-dir", str(self.cache),
            "--cni-socket", str(self.socket),
            *extra,
        ]  # fmt: skip

    def main(self, argv: list[str]) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = command.main([*self.common, *argv] if "--uninstall" not in argv else argv, out, err)
        return code, out.getvalue(), err.getvalue()

    def hold(self, container_id: str = "c" * 64, pod: str = "rdma-pod") -> Path:
        record = self.state_dir / "attachments" / f"{container_id}@net1.json"
        record.write_text(json.dumps({"pod": {"namespace": "team-a", "name": pod, "uid": "u"}}))
        return record

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.name not in ("sa",))


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Root:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    return Root(tmp_path)


def test_refuses_while_pods_hold_vfs_and_changes_nothing(node: Root) -> None:
    node.hold()
    (node.state_dir / "attachments" / f"{'d' * 64}@net2.json").write_text("{not json")
    before = node.files()
    code, out, err = node.main(node.argv())
    assert code == 1
    assert "refusing to uninstall: 2 attachment(s)" in err
    assert f"pod team-a/rdma-pod (container {'c' * 12}, net1)" in err
    assert f"an unreadable record (container {'d' * 12}, net2)" in err
    assert node.files() == before and out == ""


def test_removes_what_install_and_the_plugin_put_there(node: Root) -> None:
    (node.conf_dir / "00-other.conflist").write_text("{}")  # not ours: stays
    code, out, err = node.main(node.argv())
    assert code == 0, err
    assert not (node.bin_dir / "rdma-cni").exists()
    assert not (node.bin_dir / ".rdma-cni.installed").exists()
    assert not (node.conf_dir / "10-rdma-cni.conflist").exists()
    assert (node.conf_dir / "00-other.conflist").exists()
    assert not node.kubeconfig.parent.exists()
    assert not node.ready.exists()
    assert not node.cache.exists()
    assert not node.lock_file.parent.exists()  # with the stale socket and the empty spool
    assert not node.state_dir.exists()
    assert f"removed {node.bin_dir / 'rdma-cni'}" in out
    assert "left /var/log/rdma-cni/rdma-cni.log" in out
    assert "rdma-cni.io/node-state annotation" in out
    # Again: nothing left to remove, still fine.
    code, out, _ = node.main(node.argv())
    assert code == 0 and "removed" not in out


def test_leaves_a_foreign_binary_and_pending_state_and_says_why(node: Root) -> None:
    (node.bin_dir / "rdma-cni").write_text("someone else's\n")
    (node.state_dir / "quarantine" / "x@net1.json").write_text("{")
    code, out, _ = node.main(node.argv())
    assert code == 0
    assert (node.bin_dir / "rdma-cni").exists()
    assert "not written by rdma-cni install" in out
    assert (node.state_dir / "quarantine" / "x@net1.json").exists()
    assert f"left {node.state_dir / 'quarantine'}: not empty" in out
    code, out, _ = node.main(node.argv("--force"))
    assert code == 0 and not (node.bin_dir / "rdma-cni").exists()


def test_removes_an_empty_dra_preparations_dir_and_leaves_a_prepared_claim(node: Root) -> None:
    (node.state_dir / "prepared").mkdir()
    code, out, _ = node.main(node.argv())
    assert code == 0 and not node.state_dir.exists(), out
    (node.state_dir / "prepared").mkdir(parents=True)
    (node.state_dir / "prepared" / "uid-1.json").write_text("{}")
    code, out, _ = node.main(node.argv())
    assert code == 0
    assert (node.state_dir / "prepared" / "uid-1.json").exists()
    assert f"left {node.state_dir / 'prepared'}: not empty: DRA claims still prepared" in out


def test_names_the_dels_spooled_while_no_agent_ran(node: Root) -> None:
    node.hold()
    (node.socket.parent / "del-spool" / "c1@net1").write_bytes(b"spooled")
    # One claimed by a run that failed (or by an agent killed mid-run) is still owed.
    (node.socket.parent / "del-spool" / ".run-del-c2-6e657431.req").write_bytes(b"claimed")
    (node.socket.parent / "del-spool" / ".tmp-12-x").write_bytes(b"a cut write")
    code, _, err = node.main(node.argv())
    assert code == 1
    assert "2 DEL(s) the shim spooled while no agent ran: start the DaemonSet again" in err


def test_a_serving_agent_keeps_its_socket(node: Root) -> None:
    node.socket.unlink()
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(node.socket))
        live.listen(1)
        code, out, _ = node.main(node.argv())
        assert code == 0
        assert f"left {node.socket}: an agent still serves here: delete the DaemonSet first" in out
        assert node.socket.exists() and not (node.bin_dir / "rdma-cni").exists()


def test_drain_waits_for_the_pods_to_go(node: Root) -> None:
    record = node.hold()
    waits = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 3:
            record.unlink()  # the runtime's DEL, after kubectl drain

    args = command._parser().parse_args(node.argv("--drain"))
    out, err = io.StringIO(), io.StringIO()
    assert uninstall.run(args, out, err, sleep=sleep) == 0, err.getvalue()
    assert waits == [1.0, 1.0, 1.0]
    assert "draining: waiting up to 300s for 1 attachment(s)" in out.getvalue()
    assert not (node.bin_dir / "rdma-cni").exists()


def test_drain_gives_up_after_its_timeout_and_changes_nothing(node: Root) -> None:
    node.hold()
    before = node.files()
    code, _, err = node.main(node.argv("--drain", "--drain-timeout", "0.2"))
    assert code == 1 and "pod team-a/rdma-pod" in err
    assert node.files() == before


def test_waits_for_the_warm_server_to_let_go_of_its_tree(node: Root) -> None:
    fd = os.open(node.cache / OLD_TREE / "warm.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)

    def sleep(_seconds: float) -> None:
        os.close(fd)  # the server saw its binary go and exited

    args = command._parser().parse_args(node.argv())
    out = io.StringIO()
    assert uninstall.run(args, out, io.StringIO(), sleep=sleep) == 0
    assert not node.cache.exists()


def test_a_warm_server_that_stays_is_reported(node: Root) -> None:
    fd = os.open(node.cache / OLD_TREE / "warm.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        args = command._parser().parse_args(node.argv())
        out = io.StringIO()
        assert uninstall.run(args, out, io.StringIO(), sleep=lambda s: None, warm_exit_wait=0.0) == 0
        assert f"left {node.cache / OLD_TREE}: a warm server holds it" in out.getvalue()
    finally:
        os.close(fd)


def test_uninstall_does_not_go_with_watch(node: Root) -> None:
    code, _, err = node.main(node.argv("--watch"))
    assert code == 2 and "--uninstall does not go with --watch" in err


def test_defaults_are_the_plugins() -> None:
    from rdma_cni.agent import delspool
    from rdma_cni.cni import config
    from rdma_cni.node import boot, nristate, prepared, statedir
    from rdma_cni.shared import nodestate

    assert uninstall.DEFAULT_STATE_DIR == config.DEFAULT_STATE_DIR
    assert uninstall.DEFAULT_LOCK_FILE == config.DEFAULT_LOCK_FILE
    assert uninstall.NRI_STATE == nristate.STATE_FILE
    assert uninstall.STATE_SUBDIRS == statedir.SUBDIRS
    assert uninstall.PREPARED_DIR == prepared.DIRECTORY
    assert uninstall.BOOT_CHECKED == boot.MARKER
    assert uninstall.NODE_STATE_ANNOTATION == nodestate.ANNOTATION
    assert uninstall.SPOOL_NAME == delspool.SPOOL_NAME
    assert uninstall.CLAIMED == delspool.CLAIMED
