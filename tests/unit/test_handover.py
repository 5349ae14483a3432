"""The node kubeconfig during a rollout: the newest agent pod's token stays, a dead pod's is replaced."""

from __future__ import annotations

import base64
import io
import json
import threading
from pathlib import Path

import pytest

from rdma_cni.install import command, common, handover
from rdma_cni.install.kubeconfig import render_kubeconfig
from tests.support.apiserver import ApiServer

NOW = 1_800_000_000.0


def token(pod: str, uid: str, exp: float = NOW + 3600) -> str:
    def part(doc: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()

    claims = {"exp": exp, "kubernetes.io": {"namespace": "kube-system", "pod": {"name": pod, "uid": uid}}}
    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"


def kubeconfig(tok: str) -> bytes:
    return json.dumps({"users": [{"name": "rdma-cni", "user": {"token": tok}}]}).encode()


OLD, NEW = token("rdma-cni-old", "u-old"), token("rdma-cni-new", "u-new")


def test_claims_and_bound_pod() -> None:
    claims = handover.jwt_claims(OLD)
    assert claims is not None and handover.bound_pod(claims) == ("kube-system", "rdma-cni-old", "u-old")
    assert handover.jwt_claims("opaque") is None
    assert handover.bound_pod({"sub": "x"}) is None
    assert handover.kubeconfig_token(b"{not json") is None


@pytest.mark.parametrize(
    ("current", "alive", "leave"),
    [
        (NEW, True, True),  # another pod's token, that pod still there: leave it
        (NEW, None, True),  # cannot tell: leave it (its exp bounds the wait)
        (NEW, False, False),  # its pod is gone: write ours
        (token("rdma-cni-new", "u-new", exp=NOW - 1), True, False),  # expired: write ours
        (token("rdma-cni-old", "u-old", exp=NOW + 10), True, False),  # our own, rotated: write
        ("opaque-token", True, False),  # nothing to judge by: the content rule
    ],
)
def test_leave_reason(current: str, alive: bool | None, leave: bool) -> None:
    asked = []

    def ask(ref: handover.PodRef) -> bool | None:
        asked.append(ref)
        return alive

    reason = handover.leave_reason(kubeconfig(current), kubeconfig(OLD), alive=ask, now=NOW)
    assert (reason is not None) == leave
    if leave:
        assert "kube-system/rdma-cni-new" in reason


def run_watch(tmp_path: Path, api: ApiServer, kc: Path, ticks: int) -> str:
    sa = tmp_path / "sa"
    opts = common.Options(
        source="unused",
        kubeconfig_path=str(kc),
        serviceaccount_dir=str(sa),
        interval=0.01,
        environ={"KUBERNETES_SERVICE_HOST": api.host, "KUBERNETES_SERVICE_PORT": str(api.port)},
    )
    out = io.StringIO()
    command.watch(opts, threading.Event(), out, max_iterations=ticks)
    return out.getvalue()


def test_an_old_pod_leaves_the_new_pods_kubeconfig_until_the_new_pod_is_gone(tmp_path: Path) -> None:
    # This installer is the old pod; the API server knows it by its own token.
    with ApiServer(token=OLD) as api:
        sa = tmp_path / "sa"
        sa.mkdir()
        (sa / "token").write_text(OLD)
        (sa / "ca.crt").write_bytes(Path(api.ca_path).read_bytes())
        env = {"KUBERNETES_SERVICE_HOST": api.host, "KUBERNETES_SERVICE_PORT": str(api.port)}
        api.add_pod("kube-system", "rdma-cni-new", {}, uid="u-new")
        # The new pod took the file over when it started.
        new_sa = tmp_path / "new-sa"
        new_sa.mkdir()
        (new_sa / "token").write_text(NEW)
        (new_sa / "ca.crt").write_bytes(Path(api.ca_path).read_bytes())
        kc = tmp_path / "rdma-cni.kubeconfig"
        kc.write_bytes(render_kubeconfig(str(new_sa), env))
        run_watch(tmp_path, api, kc, ticks=3)
        assert handover.kubeconfig_token(kc.read_bytes()) == NEW
        # A surge pod deleted (a rollout undone): the old pod takes the file back at its next tick.
        api.remove_pod("kube-system", "rdma-cni-new")
        out = run_watch(tmp_path, api, kc, ticks=1)
        assert handover.kubeconfig_token(kc.read_bytes()) == OLD
        assert "rewrote kubeconfig" in out
