"""``rdma-cni doctor``: each check's FAIL (and WARN) path, the exit codes, and the two output forms."""

from __future__ import annotations

import base64
import datetime
import io
import json
import os
import socket

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
    assert doctor.check_vfs([]).status == FAIL
    empty = doctor.check_vfs([pf, {"name": "ens1f1", "capacity_vfs": 0, "free_vfs": 0, "used_vfs": 0}])
    assert empty.status == WARN and "ens1f1" in empty.detail


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
    monkeypatch.setattr(doctor, "_inventory", lambda config: ([], None, "no RDMA netlink"))
    argv = [
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
            "nri-socket",
            "glibc",
            "kubeconfig-token",
            "node-state-age",
            "cache",
        ]
        statuses = {c["check"]: c["status"] for c in doc["checks"]}
        assert statuses["vfs"] == FAIL and statuses["kubeconfig-token"] == OK
        assert statuses["nri-socket"] == SKIP and statuses["cache"] == OK
    else:
        lines = out.getvalue().splitlines()
        assert len(lines) == 7 and lines[0].startswith("FAIL  rdma-netns-mode")


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
