"""The kustomize base and each overlay, rendered by the real kubectl and accepted by the real kube-apiserver.

Each render is applied server-side with ``--dry-run=server`` (validation, defaulting and admission run
in full, nothing is stored) and then, where that does not clash with the control plane this session's
other tests share, for real:

- the base, ``sidecar`` and ``mtls`` hold the objects conf/ holds (the session applied conf/ already):
  applied for real with the same field manager, and each object as stored is then what the render says;
- ``image-digest`` would repoint the shared DaemonSet and Deployment at a registry that does not exist:
  dry run only;
- ``namespace`` moves the node side into a namespace of its own and rebinds the shared ClusterRole and
  admission policy to it: applied for real as a throwaway copy, its namespace and the names of its
  cluster-scoped objects made this test's own (and its DaemonSet's pods kept off every Node: there is
  no kubelet here to run or end them), then deleted.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.cluster.conftest import unique
from tests.support.kube.applyconf import FIELD_MANAGER
from tests.support.kube.controlplane import REPO, ControlPlane

CONF = os.path.join(REPO, "conf")
OVERLAYS = os.path.join(CONF, "overlays")
CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "Namespace",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}


def overlays() -> list[str]:
    """conf/overlays' overlays (a directory's kustomization; namespace/node is a part of namespace)."""
    return sorted(
        d for d in os.listdir(OVERLAYS) if os.path.exists(os.path.join(OVERLAYS, d, "kustomization.yaml"))
    )


def render(cp: ControlPlane, path: str) -> str:
    """``kubectl kustomize`` of ``path`` by the control plane's own kubectl, as docs/deploy.md says."""
    argv = [cp.bins["kubectl"].path, "kustomize", path, "--load-restrictor", "LoadRestrictionsNone"]
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


# The namespace overlay creates the namespace its objects go into, which a dry run does not: its dry run
# is below, once the (throwaway) namespace exists.
@pytest.mark.parametrize("overlay", ["", *(o for o in overlays() if o != "namespace")])
def test_each_render_passes_the_servers_dry_run(applied: ControlPlane, overlay: str) -> None:
    text = render(applied, os.path.join(OVERLAYS, overlay) if overlay else CONF)
    docs = documents(text)
    assert docs
    objects = apply(applied, text, "--dry-run=server")
    assert len(objects) == len(docs), objects


@pytest.mark.parametrize("overlay", ["", "sidecar", "mtls"])
def test_renders_of_conf_as_shipped_apply_for_real(applied: ControlPlane, overlay: str) -> None:
    text = render(applied, os.path.join(OVERLAYS, overlay) if overlay else CONF)
    docs = documents(text)
    assert len(apply(applied, text)) == len(docs)
    for doc in docs:
        got = stored(applied, doc)
        assert matches(got, doc), ref(doc)
        assert contains(
            got["metadata"], {k: doc["metadata"][k] for k in ("name", "labels") if k in doc["metadata"]}
        )


@pytest.fixture
def throwaway(applied: ControlPlane) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The namespace overlay's render, made this test's own (namespace and cluster-scoped names)."""
    namespace = unique("ns-overlay")
    suffix = namespace.removeprefix("ns-overlay")
    text = render(applied, os.path.join(OVERLAYS, "namespace"))
    # The overlay's namespace everywhere it is one: object namespaces, the binding's subject, the
    # policy's user name. Cluster-scoped names and the references to them get the suffix.
    text = text.replace("system:serviceaccount:rdma-cni:", f"system:serviceaccount:{namespace}:")
    docs = documents(text)
    cluster_names = {
        d["metadata"]["name"] for d in docs if d["kind"] in CLUSTER_SCOPED and d["kind"] != "Namespace"
    }
    for doc in docs:
        meta = doc["metadata"]
        if doc["kind"] == "Namespace":
            assert meta["name"] == "rdma-cni"
            meta["name"] = namespace
        elif doc["kind"] in CLUSTER_SCOPED:
            meta["name"] += suffix
        if meta.get("namespace") == "rdma-cni":
            meta["namespace"] = namespace
        for subject in doc.get("subjects", []):
            if subject.get("namespace") == "rdma-cni":
                subject["namespace"] = namespace
        spec = doc.get("spec", {})
        if doc["kind"] == "ClusterRoleBinding" and doc["roleRef"]["name"] in cluster_names:
            doc["roleRef"]["name"] += suffix
        if doc["kind"] == "ValidatingAdmissionPolicyBinding" and spec.get("policyName") in cluster_names:
            spec["policyName"] += suffix
        if doc["kind"] == "DaemonSet":
            spec["template"]["spec"]["nodeSelector"] = {"rdma-cni.io/no-such-node": namespace}
    yield namespace, docs
    for doc in reversed(docs):
        meta = doc["metadata"]
        ns = ["-n", meta["namespace"]] if "namespace" in meta else []
        applied.kubectl(
            "delete", doc["kind"], meta["name"], *ns, "--ignore-not-found", "--wait=false", check=False
        )


def test_the_namespace_overlay_applies_for_real_in_a_throwaway_namespace(
    applied: ControlPlane, throwaway: tuple[str, list[dict[str, Any]]]
) -> None:
    namespace, docs = throwaway
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
    # The node side lives there, and the policy the server compiled names its account.
    kinds = {d["kind"] for d in docs if d["metadata"].get("namespace") == namespace}
    assert {"DaemonSet", "ServiceAccount", "Service"} <= kinds
    [policy] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    compiled = stored(applied, policy)
    assert compiled.get("status", {}).get("typeChecking", {}).get("expressionWarnings") in (None, [])
    assert f"system:serviceaccount:{namespace}:rdma-cni" in json.dumps(compiled["spec"]["matchConditions"])
