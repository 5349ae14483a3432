"""conf/'s kustomize bases and overlays, rendered by the real kubectl and accepted by the real kube-apiserver.

Each is rendered as docs/deploy.md says and GitOps tools do, ``kubectl kustomize DIR`` with no flag,
and applied server-side with ``--dry-run=server`` (validation, defaulting and admission run in full,
nothing is stored) and then, where that does not clash with the control plane this session's other
tests share, for real:

- conf/, its bases, ``sidecar`` and ``mtls`` hold the objects conf/ holds (the session applied conf/
  already): applied for real with the same field manager, and each object as stored is then what the
  render says;
- ``image-digest`` and ``image-digest-mtls`` would repoint the shared DaemonSet and Deployments at a
  registry that does not exist: dry run only;
- ``namespace`` and ``namespace-mtls`` move the node side and the extender into a namespace of their
  own and rebind the shared ClusterRoles and admission policies to it: applied for real as throwaway
  copies, their namespace and the names of their cluster-scoped objects (and of the one binding left
  in kube-system) made this test's own, and their pods kept from ever existing (there is no kubelet
  here to run or end them), then deleted.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.conftest import unique
from tests.support.kube.applyconf import FIELD_MANAGER
from tests.support.kube.controlplane import REPO, ControlPlane
from tests.support.kube.rdmascheduler import start_rdma_scheduler

CONF = os.path.join(REPO, "conf")
OVERLAYS = os.path.join(CONF, "overlays")
BASES = ["base/node", "base/extender", "base/extender-mtls"]
# What the namespace component names (conf/components/namespace).
MOVED_TO = "rdma-cni"
CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "Namespace",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}


def overlays() -> list[str]:
    """conf/overlays' overlays (each directory with a kustomization)."""
    return sorted(
        d for d in os.listdir(OVERLAYS) if os.path.exists(os.path.join(OVERLAYS, d, "kustomization.yaml"))
    )


def moving() -> list[str]:
    """The overlays that move everything into a namespace of their own."""
    return [o for o in overlays() if o.startswith("namespace")]


def path_of(name: str) -> str:
    """conf/ (``""``), a base (``base/...``) or an overlay of conf/overlays."""
    return (
        CONF
        if not name
        else os.path.join(CONF, name)
        if name.startswith("base/")
        else os.path.join(OVERLAYS, name)
    )


def render(cp: ControlPlane, path: str) -> str:
    """``kubectl kustomize path``, by the control plane's own kubectl, as docs/deploy.md says: no flag."""
    argv = [cp.bins["kubectl"].path, "kustomize", path]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def ref(doc: dict[str, Any]) -> str:
    """``kind/name`` and its namespace, as ``kubectl get`` takes them."""
    meta = doc["metadata"]
    return f"{doc['kind']}/{meta['name']}" + (f" -n {meta['namespace']}" if "namespace" in meta else "")


def apply(cp: ControlPlane, text: str, *extra: str) -> list[str]:
    """``kubectl apply --server-side`` of a render; the objects kubectl names, one per document."""
    out = cp.kubectl(
        "apply",
        "--server-side",
        f"--field-manager={FIELD_MANAGER}",
        "-o",
        "name",
        *extra,
        "-f",
        "-",
        input=text,
    ).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def stored(cp: ControlPlane, doc: dict[str, Any]) -> dict[str, Any]:
    meta = doc["metadata"]
    args = [
        doc["kind"].lower() + "." + doc["apiVersion"].split("/")[0]
        if "/" in doc["apiVersion"]
        else doc["kind"]
    ]
    args.append(meta["name"])
    if "namespace" in meta:
        args += ["-n", meta["namespace"]]
    return dict(cp.get(*args))


def matches(got: dict[str, Any], doc: dict[str, Any]) -> bool:
    """Whether the object as stored holds what the render says: all but metadata, and its name and labels."""
    meta = {
        k: doc["metadata"][k] for k in ("name", "namespace", "labels", "annotations") if k in doc["metadata"]
    }
    return contains(got["metadata"], meta) and contains(
        got, {k: v for k, v in doc.items() if k != "metadata"}
    )


def contains(whole: Any, part: Any) -> bool:
    """Whether ``part`` is in ``whole``: a mapping's keys, lists item by item (server additions let be)."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and contains(whole[k], v) for k, v in part.items())
    if isinstance(part, list):
        return isinstance(whole, list) and len(whole) == len(part) and all(map(contains, whole, part))
    if isinstance(part, str) and isinstance(whole, str):
        return " ".join(part.split()) == " ".join(whole.split())  # CEL: kustomize's folded scalars
    return bool(whole == part)


def test_the_overlays_are_the_documented_ones() -> None:
    assert overlays() == [
        "image-digest",
        "image-digest-mtls",
        "mtls",
        "namespace",
        "namespace-mtls",
        "sidecar",
    ]


# The namespace overlays create the namespace their objects go into, which a dry run does not: their dry
# run is below, once the (throwaway) namespace exists.
@pytest.mark.parametrize("overlay", ["", *BASES, *(o for o in overlays() if o not in moving())])
def test_each_render_passes_the_servers_dry_run(applied: ControlPlane, overlay: str) -> None:
    text = render(applied, path_of(overlay))
    docs = documents(text)
    assert docs
    objects = apply(applied, text, "--dry-run=server")
    assert len(objects) == len(docs), objects


@pytest.mark.parametrize("overlay", ["", *BASES, "sidecar", "mtls"])
def test_renders_of_conf_as_shipped_apply_for_real(applied: ControlPlane, overlay: str) -> None:
    text = render(applied, path_of(overlay))
    docs = documents(text)
    assert len(apply(applied, text)) == len(docs)
    for doc in docs:
        got = stored(applied, doc)
        assert matches(got, doc), ref(doc)
        assert contains(
            got["metadata"], {k: doc["metadata"][k] for k in ("name", "labels") if k in doc["metadata"]}
        )


@pytest.fixture(params=moving())
def throwaway(
    applied: ControlPlane, request: pytest.FixtureRequest
) -> Iterator[tuple[str, str, list[dict[str, Any]]]]:
    """A namespace overlay's render, made this test's own (namespace and names outside it)."""
    overlay = request.param
    namespace = unique("ns-overlay")
    suffix = namespace.removeprefix("ns-overlay")
    text = render(applied, os.path.join(OVERLAYS, overlay))
    # The overlay's namespace everywhere it is one: object namespaces, the bindings' subjects, the
    # policies' user names. Cluster-scoped names and the references to them get the suffix, and so does
    # the binding the overlay leaves in kube-system, which would otherwise rebind the shared one.
    text = text.replace(f"system:serviceaccount:{MOVED_TO}:", f"system:serviceaccount:{namespace}:")
    text = text.replace(f"resourceNamespace: {MOVED_TO}", f"resourceNamespace: {namespace}")
    docs = documents(text)
    cluster_names = {
        d["metadata"]["name"] for d in docs if d["kind"] in CLUSTER_SCOPED and d["kind"] != "Namespace"
    }
    for doc in docs:
        meta = doc["metadata"]
        if doc["kind"] == "Namespace":
            assert meta["name"] == MOVED_TO
            meta["name"] = namespace
        elif doc["kind"] in CLUSTER_SCOPED or meta.get("namespace") == "kube-system":
            meta["name"] += suffix
        if meta.get("namespace") == MOVED_TO:
            meta["namespace"] = namespace
        for subject in doc.get("subjects", []):
            if subject.get("namespace") == MOVED_TO:
                subject["namespace"] = namespace
        spec = doc.get("spec", {})
        if doc["kind"] == "ClusterRoleBinding" and doc["roleRef"]["name"] in cluster_names:
            doc["roleRef"]["name"] += suffix
        if doc["kind"] == "ValidatingAdmissionPolicyBinding" and spec.get("policyName") in cluster_names:
            spec["policyName"] += suffix
        # No pod of these workloads: nothing here would run or end it.
        if doc["kind"] == "DaemonSet":
            spec["template"]["spec"]["nodeSelector"] = {"rdma-cni.io/no-such-node": namespace}
        if doc["kind"] == "Deployment":
            spec["replicas"] = 0
    yield overlay, namespace, docs
    for doc in reversed(docs):
        meta = doc["metadata"]
        ns = ["-n", meta["namespace"]] if "namespace" in meta else []
        applied.kubectl(
            "delete", doc["kind"], meta["name"], *ns, "--ignore-not-found", "--wait=false", check=False
        )


def test_a_namespace_overlay_applies_for_real_in_a_throwaway_namespace(
    applied: ControlPlane, throwaway: tuple[str, str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    overlay, namespace, docs = throwaway
    text = "---\n".join(yaml.safe_dump(d) for d in docs)
    # A dry run creates nothing, so the overlay's namespaced objects find no namespace; nothing else fails.
    refused = applied.kubectl(
        "apply", "--server-side", "--dry-run=server", "-f", "-", input=text, check=False
    ).stderr.splitlines()
    assert refused and all(f'namespaces "{namespace}" not found' in line for line in refused), refused
    [ns_doc] = [d for d in docs if d["kind"] == "Namespace"]
    assert len(apply(applied, yaml.safe_dump(ns_doc))) == 1
    assert len(apply(applied, text, "--dry-run=server")) == len(docs)
    assert len(apply(applied, text)) == len(docs)
    for doc in docs:
        got = stored(applied, doc)
        assert matches(got, doc), ref(doc)
    ns = applied.get("namespace", namespace)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    # The node side and the extender live there; only the binding to a kube-system Role stays behind.
    kinds = {d["kind"] for d in docs if d["metadata"].get("namespace") == namespace}
    assert {"DaemonSet", "Deployment", "ServiceAccount", "Service"} <= kinds
    elsewhere = [d for d in docs if d["metadata"].get("namespace", namespace) != namespace]
    if overlay == "namespace":
        assert "ConfigMap" in kinds
        [binding] = elsewhere
        assert binding["metadata"]["namespace"] == "kube-system"
        assert binding["roleRef"]["name"] == "extension-apiserver-authentication-reader"
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "rdma-scheduler", "namespace": namespace}
        ]
    else:
        assert elsewhere == []
    # Every ServiceAccount a binding names is one of the namespace's.
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    for doc in docs:
        for subject in doc.get("subjects", []):
            assert subject["namespace"] == namespace and subject["name"] in accounts, ref(doc)
    # The policies the server compiled name the accounts in the namespace.
    policies = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    assert len(policies) == (1 if overlay == "namespace" else 2)
    for policy in policies:
        compiled = stored(applied, policy)
        assert compiled.get("status", {}).get("typeChecking", {}).get("expressionWarnings") in (None, [])
        condition = json.dumps(compiled["spec"]["matchConditions"])
        assert f"system:serviceaccount:{namespace}:" in condition and "kube-system" not in condition
    if overlay == "namespace":
        the_moved_sidecar_runs(applied, namespace, docs, tmp_path)


def the_moved_sidecar_runs(
    cp: ControlPlane, namespace: str, docs: list[dict[str, Any]], tmp_path: Path
) -> None:
    """rdma-scheduler as the moved Deployment runs it, on its account in the namespace.

    Its kube-scheduler leads through the lease the moved configuration names, which the Role in the
    namespace lets it renew, and reads kube-system's extension-apiserver-authentication ConfigMap
    through the one binding left there (without it kube-scheduler logs that it cannot, and goes on).
    """
    manifest = tmp_path / "namespace-overlay.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    pair = start_rdma_scheduler(cp, str(manifest), tag=namespace, record=False)
    try:
        deadline = time.monotonic() + 60
        while True:
            lease = cp.kubectl("get", "lease", "rdma-scheduler", "-n", namespace, "-o", "json", check=False)
            if lease.returncode == 0 and json.loads(lease.stdout)["spec"].get("holderIdentity"):
                break
            assert time.monotonic() < deadline, f"no lease rdma-scheduler in {namespace}: {lease.stderr}"
            time.sleep(1)
        assert pair.scheduler.alive() and pair.ready()
        log = Path(pair.scheduler.log).read_text(errors="replace")
        # Without that binding: "Unable to get configmap/extension-apiserver-authentication in
        # kube-system", and each of its reads "is forbidden".
        assert "Unable to get configmap" not in log and "is forbidden" not in log, log[-3000:]
    finally:
        pair.stop()
