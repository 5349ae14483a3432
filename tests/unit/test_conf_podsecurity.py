"""Which Pod Security Standards level each workload of conf/ needs (docs/deploy.md, "Pod Security").

A checker for the controls of the Pod Security Standards (baseline and restricted, as the
pod-security admission enforces them) that these pods touch: host namespaces, privileged,
capabilities, hostPath and other volume types, hostPorts, privilege escalation, non-root,
seccomp. The DaemonSet needs ``privileged`` (the host network and host paths are the job); the
extender's pods meet ``restricted``; an RDMA pod meets ``restricted`` once NRI injects its
devices and memlock limit, as it needs no capability.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

CONF = Path(__file__).resolve().parents[2] / "conf"
DOCS = Path(__file__).resolve().parents[2] / "docs"
# Capabilities baseline allows adding; restricted allows only NET_BIND_SERVICE.
BASELINE_CAPS = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def violations(spec: dict[str, Any], level: str) -> list[str]:
    """What in a pod spec breaks ``level`` ("baseline" or "restricted"); restricted includes baseline."""
    out = []
    pod_ctx = spec.get("securityContext") or {}
    containers = [*spec.get("initContainers", []), *spec.get("containers", [])]
    out += [f"host namespace {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    out += [f"hostPath volume {v['name']}" for v in spec.get("volumes", []) if "hostPath" in v]
    for c in containers:
        ctx = c.get("securityContext") or {}
        if ctx.get("privileged"):
            out.append(f"{c['name']}: privileged")
        added = set((ctx.get("capabilities") or {}).get("add", []))
        allowed = BASELINE_CAPS if level == "baseline" else {"NET_BIND_SERVICE"}
        out += [f"{c['name']}: adds {cap}" for cap in sorted(added - allowed)]
        out += [f"{c['name']}: hostPort" for p in c.get("ports", []) if p.get("hostPort")]
        if level == "restricted":
            if ctx.get("allowPrivilegeEscalation") is not False:
                out.append(f"{c['name']}: allowPrivilegeEscalation is not false")
            if "ALL" not in (ctx.get("capabilities") or {}).get("drop", []):
                out.append(f"{c['name']}: does not drop ALL capabilities")
            if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")):
                out.append(f"{c['name']}: runAsNonRoot is not set")
            if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
                out.append(f"{c['name']}: runs as user 0")
            seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
            if seccomp not in ("RuntimeDefault", "Localhost"):
                out.append(f"{c['name']}: no RuntimeDefault or Localhost seccomp profile")
    if level == "restricted":
        for v in spec.get("volumes", []):
            kinds = set(v) - {"name"}
            if not kinds <= RESTRICTED_VOLUMES:
                out.append(f"volume {v['name']}: {sorted(kinds)}")
    return out


def template(name: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all((CONF / name).read_text()) if d and d["kind"] == kind]
    return doc["spec"] if kind == "Pod" else doc["spec"]["template"]["spec"]


def restricted_rdma_pod() -> dict[str, Any]:
    """conf/pod.yaml's pod as a workload image would run it: non-root, nothing added, RuntimeDefault."""
    spec = copy.deepcopy(template("pod.yaml", "Pod"))
    spec["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    for c in spec["containers"]:
        c["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return spec


def test_the_checker_sees_each_control() -> None:
    bad = {
        "hostNetwork": True,
        "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
        "containers": [
            {"name": "c", "securityContext": {"privileged": True, "capabilities": {"add": ["IPC_LOCK"]}}}
        ],
    }
    assert violations(bad, "baseline") == [
        "host namespace hostNetwork",
        "hostPath volume h",
        "c: privileged",
        "c: adds IPC_LOCK",
    ]
    assert "c: runAsNonRoot is not set" in violations(bad, "restricted")
    assert violations(restricted_rdma_pod(), "restricted") == []


def test_the_daemonset_needs_privileged() -> None:
    """Host network and host paths are its job: neither baseline nor restricted admits it."""
    assert violations(template("base/node/daemonset.yaml", "DaemonSet"), "baseline")


@pytest.mark.parametrize(
    "name", ["base/extender/scheduler-extender.yaml", "base/extender-mtls/scheduler-extender-mtls.yaml"]
)
def test_the_extenders_meet_restricted(name: str) -> None:
    assert violations(template(name, "Deployment"), "restricted") == []


def test_an_rdma_pod_needs_no_capability() -> None:
    """With NRI's devices and memlock, the sample pod meets baseline as shipped (it installs packages
    as root), and restricted once its image runs as a user: no IPC_LOCK, no device plugin."""
    assert violations(template("pod.yaml", "Pod"), "baseline") == []
    assert violations(restricted_rdma_pod(), "restricted") == []


def test_deploy_md_has_the_pod_security_note() -> None:
    text = (DOCS / "deploy.md").read_text()
    assert "## Pod Security" in text and "tests/unit/test_conf_podsecurity.py" in text
    assert all(level in text for level in ("`privileged`", "`baseline`", "`restricted`"))
