"""``rdma-cni doctor``: each check's FAIL (and WARN) path, the exit codes, and the two output forms."""

from __future__ import annotations

import base64
import datetime
import io
import json
import os
import socket
import time

import pytest

from rdma_cni.cli import doctor
from rdma_cni.cli.doctor import FAIL, OK, SKIP, WARN, Finding

NOW = 1_800_000_000.0


def jwt(claims: dict[str, object]) -> str:
    def part(doc: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2lnbmF0dXJl"


def kubeconfig(tmp_path, token: str) -> str:
    path = tmp_path / "rdma-cni.kubeconfig"
    path.write_text(json.dumps({"users": [{"name": "rdma-cni", "user": {"token": token}}]}))
    return str(path)


def test_exit_code_is_the_worst_finding() -> None:
    assert doctor.exit_code([Finding("a", OK, ""), Finding("b", SKIP, "")]) == 0
    assert doctor.exit_code([Finding("a", OK, ""), Finding("b", WARN, "")]) == 1
    assert doctor.exit_code([Finding("a", WARN, ""), Finding("b", FAIL, ""), Finding("c", OK, "")]) == 2
    assert doctor.exit_code([]) == 0


def test_rdma_mode() -> None:
    assert doctor.check_rdma_mode("exclusive", None).status == OK
    assert doctor.check_rdma_mode("shared", None).status == WARN
    failed = doctor.check_rdma_mode(None, "Operation not supported")
    assert failed.status == FAIL and "Operation not supported" in failed.detail


def test_vfs() -> None:
    pf = {"name": "ens1f0", "capacity_vfs": 8, "free_vfs": 6, "used_vfs": 2}
    assert doctor.check_vfs([pf]).status == OK
    assert "ens1f0: 8 VFs, 6 free, 2 used" in doctor.check_vfs([pf]).detail
    assert doctor.check_vfs([pf], named=["ens1f0"]).status == OK
    empty = doctor.check_vfs([pf, {"name": "ens1f1", "capacity_vfs": 0, "free_vfs": 0, "used_vfs": 0}])
    assert empty.status == WARN and "ens1f1" in empty.detail


def test_a_node_without_rdma_pfs_is_skipped_not_failed() -> None:
    """A node the DaemonSet runs on that has no SR-IOV PF (and no RDMA subsystem) is not a failure."""
    plain = doctor.NodeView([], None, "Operation not supported")
    assert not plain.rdma_node()
    vfs = doctor.check_vfs(plain.pfs, plain.named, plain.idle)
    assert vfs.status == SKIP and "no RDMA devices" in vfs.detail
    mode = doctor.check_rdma_mode(plain.mode, plain.rdma_error, plain.rdma_node())
    assert mode.status == SKIP and "Operation not supported" in mode.detail
    assert doctor.check_rdma_mode("shared", None, rdma_node=False).status == SKIP
    assert doctor.check_rdma_mode("exclusive", None, rdma_node=False).status == OK
    # Unless a config names PFs that are missing, or a PF could have VFs and has none.
    named = doctor.NodeView([], None, "x", named=["ens1f0", "ens1f1"])
    assert named.rdma_node()
    missing = doctor.check_vfs(named.pfs, named.named, named.idle)
    assert missing.status == FAIL and "ens1f0, ens1f1" in missing.detail
    assert doctor.check_rdma_mode(named.mode, named.rdma_error, named.rdma_node()).status == FAIL
    pf = {"name": "ens1f0", "capacity_vfs": 8, "free_vfs": 8, "used_vfs": 0}
    one_missing = doctor.check_vfs([pf], ["ens1f0", "ens1f1"])
    assert (
        one_missing.status == FAIL and "ens1f1" in one_missing.detail and "ens1f0," not in one_missing.detail
    )
    idle = doctor.NodeView([], "exclusive", None, idle=("ens2f0",))
    assert idle.rdma_node()
    no_vfs = doctor.check_vfs(idle.pfs, idle.named, idle.idle)
    assert no_vfs.status == FAIL and "ens2f0" in no_vfs.detail and "sriov_numvfs" in no_vfs.detail


def test_idle_pfs_read_sysfs(tmp_path, monkeypatch) -> None:
    net = tmp_path / "class" / "net"
    for name, total, num in (("eth0", None, None), ("ens1f0", 8, 0), ("ens1f1", 8, 4)):
        dev = tmp_path / "devices" / name
        dev.mkdir(parents=True)
        if total is not None:
            (dev / "sriov_totalvfs").write_text(f"{total}\n")
            (dev / "sriov_numvfs").write_text(f"{num}\n")
        (net / name).mkdir(parents=True)
        (net / name / "device").symlink_to(dev)
    monkeypatch.setenv("RDMA_CNI_SYSFS_ROOT", str(tmp_path))
    assert doctor._idle_pfs() == ("ens1f0",)


def test_cni_plugin_installed(tmp_path) -> None:
    from rdma_cni.install.binary import install_binary

    bin_dir = tmp_path / "bin"
    missing = doctor.check_shim(str(bin_dir))
    assert missing.status == FAIL and "has the DaemonSet's installer run" in missing.detail
    source = tmp_path / "rdma-cni-shim"
    source.write_bytes(b"\x7fELF shim")
    source.chmod(0o755)
    bin_dir.mkdir()
    install_binary(str(source), str(bin_dir), "rdma-cni", force=False, out=io.StringIO())
    ok = doctor.check_shim(str(bin_dir))
    assert ok.status == OK and "rdma-cni-shim" in ok.detail
    (bin_dir / "rdma-cni").write_bytes(b"someone else's")
    assert doctor.check_shim(str(bin_dir)).status == WARN
    (bin_dir / ".rdma-cni.installed").unlink()
    assert doctor.check_shim(str(bin_dir)).status == WARN
    (bin_dir / "rdma-cni").chmod(0o644)
    assert doctor.check_shim(str(bin_dir)).status == FAIL


def test_cni_socket_states(tmp_path) -> None:
    path = str(tmp_path / "cni.sock")
    gone = doctor.check_cni_socket(path)
    assert gone.status == FAIL and "no agent serves the shim" in gone.detail
    assert doctor.check_cni_socket(path, "fat").status == SKIP
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)  # bound, never listening: an agent that died
        refused = doctor.check_cni_socket(path)
        assert refused.status == FAIL and "nothing accepts" in refused.detail
        s.listen(1)
        assert doctor.check_cni_socket(path).status == OK
    os.unlink(path)
    (tmp_path / "cni.sock").write_text("")
    assert doctor.check_cni_socket(path).status == FAIL


@pytest.mark.skipif(os.geteuid() != 0, reason="the CNI server admits root only")
def test_cni_socket_probe_against_the_agent_logs_nothing(tmp_path, caplog) -> None:
    """The real CNI server accepts doctor's probe and takes it for no dropped call."""
    import threading

    from rdma_cni.agent.cniserver import CniServer

    path = str(tmp_path / "agent" / "cni.sock")
    server = CniServer(path, ["/bin/false"])
    server.start()
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        with caplog.at_level("DEBUG", logger="rdma_cni.agent.cniserver"):
            assert doctor.check_cni_socket(path).status == OK
            time.sleep(0.5)
    finally:
        stop.set()
        thread.join(30)
    assert not [r for r in caplog.records if "dropped a call" in r.getMessage()]


def test_nri_socket(tmp_path) -> None:
    assert doctor.check_nri_socket(str(tmp_path / "missing.sock")).status == FAIL
    plain = tmp_path / "plain"
    plain.write_text("")
    assert doctor.check_nri_socket(str(plain)).status == FAIL
    path = str(tmp_path / "nri.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        assert doctor.check_nri_socket(path).status == OK
    assert doctor.check_nri_socket("").status == SKIP


def test_glibc() -> None:
    assert doctor.check_glibc("2.28").status == OK
    assert doctor.check_glibc("2.39").status == OK
    old = doctor.check_glibc("2.17")
    assert old.status == FAIL and "2.28" in old.detail
    assert doctor.check_glibc(None).status == WARN
    assert doctor.check_glibc("x.y").status == WARN
    # This process runs on glibc: the reading is a version string.
    version = doctor.glibc_version()
    assert version is not None and version.startswith("2.")


def test_token_missing_and_malformed(tmp_path) -> None:
    assert doctor.check_token(str(tmp_path / "none"), NOW).status == FAIL
    bad = tmp_path / "bad"
    bad.write_text("{not json")
    assert doctor.check_token(str(bad), NOW).status == FAIL
    assert doctor.check_token(kubeconfig(tmp_path, ""), NOW).status == FAIL
    assert doctor.check_token(kubeconfig(tmp_path, "opaque-token"), NOW).status == WARN


def test_token_expiry(tmp_path) -> None:
    expired = doctor.check_token(kubeconfig(tmp_path, jwt({"exp": NOW - 30})), NOW)
    assert expired.status == FAIL and "expired 30 s ago" in expired.detail
    assert doctor.check_token(kubeconfig(tmp_path, jwt({"exp": NOW + 120})), NOW).status == WARN
    fine = doctor.check_token(kubeconfig(tmp_path, jwt({"exp": NOW + 3600})), NOW)
    assert fine.status == OK and "3600 s" in fine.detail
    assert doctor.check_token(kubeconfig(tmp_path, jwt({"sub": "x"})), NOW).status == OK


def unpack(base, ident: str, size: int, complete: bool = True) -> None:
    tree = base / ident
    tree.mkdir(parents=True)
    (tree / "rdma-cni").write_bytes(b"x" * size)
    if complete:
        (tree / ".complete").write_text("")


def test_cache(tmp_path) -> None:
    assert doctor.check_cache(str(tmp_path / "none")).status == OK
    base = tmp_path / "cache"
    unpack(base, "0123456789abcdef", 1000)
    unpack(base, "fedcba9876543210", 500, complete=False)  # half-unpacked: not a version
    (base / ".tmp-0123456789abcdef-42").mkdir()
    one = doctor.check_cache(str(base))
    assert one.status == OK and "1 version(s) unpacked" in one.detail
    assert doctor.unpacked_trees(str(base)) == ["0123456789abcdef"]
    assert doctor.tree_bytes(str(base)) == 1500
    for i in range(doctor.CACHE_WARN_VERSIONS):
        unpack(base, f"{i:016x}", 10)
    assert doctor.check_cache(str(base)).status == WARN


def test_cache_dir_follows_the_launcher() -> None:
    assert doctor.cache_dir({"RDMA_CNI_CACHE_DIR": "/x"}) == "/x"
    expected = "/var/cache/rdma-cni" if os.geteuid() == 0 else f"/tmp/rdma-cni-{os.geteuid()}"
    assert doctor.cache_dir({}) == expected
    assert doctor.cache_dir({}, "/tmp/rdma-cni-0/0123456789abcdef/rdma-cni") == "/tmp/rdma-cni-0"


@pytest.mark.parametrize("as_json", [False, True])
def test_main_prints_every_check_and_exits_with_the_worst(tmp_path, monkeypatch, as_json) -> None:
    monkeypatch.setattr(
        doctor, "_inventory", lambda config: doctor.NodeView([], None, "no RDMA netlink", ["ens1f0"])
    )
    argv = [
        "--cni-bin-dir",
        str(tmp_path / "bin"),
        "--cni-socket",
        str(tmp_path / "cni.sock"),
        "--kubeconfig",
        kubeconfig(tmp_path, jwt({"exp": 4_000_000_000})),
        "--nri-socket",
        "",
        "--node",
        "",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    out = io.StringIO()
    code = doctor.main([*argv, "--json"] if as_json else argv, out)
    assert code == 2
    if as_json:
        doc = json.loads(out.getvalue())
        assert doc["exit_code"] == 2
        assert [c["check"] for c in doc["checks"]] == [
            "rdma-netns-mode",
            "vfs",
            "cni-plugin",
            "cni-socket",
            "nri-socket",
            "glibc",
            "kubeconfig-token",
            "node-state-age",
            "cache",
        ]
        statuses = {c["check"]: c["status"] for c in doc["checks"]}
        assert statuses["vfs"] == FAIL and statuses["kubeconfig-token"] == OK
        assert statuses["nri-socket"] == SKIP and statuses["cache"] == OK
        assert statuses["cni-plugin"] == FAIL and statuses["cni-socket"] == FAIL
    else:
        lines = out.getvalue().splitlines()
        assert len(lines) == 9 and lines[0].startswith("FAIL  rdma-netns-mode")


def test_main_on_a_node_without_rdma_exits_0(tmp_path, monkeypatch) -> None:
    """The DaemonSet's pod on a node with no SR-IOV PF: doctor says so, and nothing fails."""
    from rdma_cni.agent.cniserver import DEFAULT_SOCKET
    from rdma_cni.install.common import DEFAULT_CNI_BIN_DIR

    monkeypatch.setattr(doctor, "_inventory", lambda config: doctor.NodeView([], None, "no RDMA netlink"))
    monkeypatch.setattr(doctor, "check_shim", lambda bin_dir: Finding("cni-plugin", OK, bin_dir))
    monkeypatch.setattr(doctor, "check_cni_socket", lambda path, mode: Finding("cni-socket", OK, path))
    out = io.StringIO()
    argv = ["--json", "--kubeconfig", kubeconfig(tmp_path, jwt({"exp": 4_000_000_000})), "--nri-socket", ""]
    code = doctor.main([*argv, "--node", "", "--cache-dir", str(tmp_path / "cache")], out)
    doc = json.loads(out.getvalue())
    statuses = {c["check"]: c["status"] for c in doc["checks"]}
    assert code == 0, doc
    assert statuses["vfs"] == SKIP and statuses["rdma-netns-mode"] == SKIP
    details = {c["check"]: c["detail"] for c in doc["checks"]}
    # The installer's and the agent's own defaults.
    assert details["cni-plugin"] == DEFAULT_CNI_BIN_DIR and details["cni-socket"] == DEFAULT_SOCKET


def test_cli_dispatches_doctor(monkeypatch) -> None:
    from rdma_cni.cli import main as cli

    seen = []
    monkeypatch.setattr(doctor, "main", lambda argv, out: seen.append(argv) or 1)
    assert cli.main(["doctor", "--json"], stdout=io.StringIO()) == 1
    assert seen == [["--json"]]


def state_text(updated: float) -> str:
    from rdma_cni.shared import nodestate
    from rdma_cni.shared.nodestate import NodeState, PfSummary

    stamp = datetime.datetime.fromtimestamp(updated, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    state = NodeState(
        version=2,
        generation=4,
        updated=stamp,
        pfs=(
            PfSummary(
                "ens1f0", capacity_tx_rate=100_000, used_tx_rate=0, capacity_vfs=8, used_vfs=0, numa_node=0
            ),
        ),
        allocations=(),
    )
    return nodestate.encode(state)


def test_state_age() -> None:
    def check(read: tuple[str | None, str | None], node: str = "n1") -> Finding:
        return doctor.check_state_age(node, 900.0, NOW, lambda: read)

    assert check((None, None), node="").status == SKIP
    fresh = check((state_text(NOW - 30), None))
    assert fresh.status == OK and "30 s old (generation 4)" in fresh.detail
    assert check((state_text(NOW - 400), None)).status == WARN
    # A healthy agent: the heartbeat (300 s) plus its period and one retry is never a warning.
    from rdma_cni.agent.loop import DEFAULT_PERIOD
    from rdma_cni.agent.publish import DEFAULT_HEARTBEAT, MAX_BACKOFF

    healthy = DEFAULT_HEARTBEAT + DEFAULT_PERIOD + MAX_BACKOFF
    assert check((state_text(NOW - DEFAULT_HEARTBEAT - 1), None)).status == OK
    assert check((state_text(NOW - healthy), None)).status == OK
    late = check((state_text(NOW - healthy - 2), None))
    assert late.status == WARN and "heartbeat (300 s) was missed" in late.detail
    # With the agent's heartbeat given, the threshold moves with it.
    slow = doctor.check_state_age("n1", 2000.0, NOW, lambda: (state_text(NOW - 650), None), heartbeat=600)
    assert slow.status == OK
    stale = check((state_text(NOW - 1000), None))
    assert stale.status == FAIL and "over 900 s" in stale.detail
    missing = check((None, None))
    assert missing.status == FAIL and "no rdma-cni.io/node-state" in missing.detail
    assert check(("{not a state", None)).status == FAIL
    unreachable = check((None, "cannot read Node n1: Forbidden"))
    assert unreachable.status == WARN and "Forbidden" in unreachable.detail


def test_state_age_read_from_the_api(tmp_path) -> None:
    from tests.support.apiserver import ApiServer

    with ApiServer() as api:
        kc = api.write_kubeconfig(tmp_path / "kc.json")
        api.add_node("n1", annotations={"rdma-cni.io/node-state": state_text(NOW - 5)})
        api.add_node("n2")
        text, error = doctor.read_node_state(kc, "n1")
        assert error is None and doctor.check_state_age("n1", 900.0, NOW, lambda: (text, error)).status == OK
        assert doctor.read_node_state(kc, "n2") == (None, None)
        text, error = doctor.read_node_state(kc, "gone")
        assert text is None and error is not None and "gone" in error
    assert doctor.read_node_state(str(tmp_path / "none.json"), "n1")[1]


def test_max_state_age_must_be_positive() -> None:
    with pytest.raises(SystemExit) as exc:
        doctor.main(["--max-state-age", "0"], io.StringIO())
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        doctor.main(["--node-state-heartbeat", "-1"], io.StringIO())
    assert exc.value.code == 2
