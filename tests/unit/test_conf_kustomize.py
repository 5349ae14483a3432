"""conf/kustomization.yaml and conf/overlays/: rendered by the real ``kubectl kustomize`` and checked.

kubectl comes from the cluster tier's build cache (/var/cache/rdma-cni-build/kubectl-*/kubectl);
without it these tests skip and say so. Each overlay's render is compared with the files it is
made of: the objects they hold, each once, changed only as the overlay says, and every object
valid against Kubernetes' schema.
"""

from __future__ import annotations

import copy
import glob
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
OVERLAYS = CONF / "overlays"
KUBECTLS = sorted(glob.glob("/var/cache/rdma-cni-build/kubectl-*/kubectl"))
BASE_FILES = ["rbac.yaml", "daemonset.yaml", "metrics.yaml"]
IMAGE = "localhost/rdma-cni"
DIGEST_IMAGE = "registry.example.com/rdma-cni@sha256:" + "0" * 64
SCHEDULER_IMAGE = "registry.k8s.io/kube-scheduler"
# Kubernetes' newest patch of each supported minor (the Go module proxy's k8s.io/kubernetes tags,
# 2026-11-28); the last is the one the cluster tier builds and runs.
SCHEDULER_TAGS = {"1.34": "v1.34.4", "1.35": "v1.35.4", "1.36": "v1.36.3", "1.37": "v1.37.2"}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "Namespace", "ValidatingAdmissionPolicy",
                  "ValidatingAdmissionPolicyBinding"}  # fmt: skip

needs_kubectl = pytest.mark.skipif(
    not KUBECTLS, reason="no kubectl in /var/cache/rdma-cni-build (the cluster tier builds it)"
)


def cel_whitespace(node: Any) -> Any:
    """``node`` with each CEL ``expression``'s whitespace runs as one space.

    kustomize's YAML writer adds a blank line inside a folded scalar whose lines are indented more
    (the admission policy's expressions); CEL reads any whitespace as a separator, so the policy
    is the same. Nothing else is normalised.
    """
    if isinstance(node, dict):
        return {
            k: " ".join(v.split()) if k == "expression" and isinstance(v, str) else cel_whitespace(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [cel_whitespace(v) for v in node]
    return node


def render(path: Path, *, files_outside: bool = True) -> list[dict[str, Any]]:
    argv = [KUBECTLS[-1], "kustomize", str(path)]
    if files_outside:
        argv += ["--load-restrictor", "LoadRestrictionsNone"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return [cel_whitespace(doc) for doc in yaml.safe_load_all(out.stdout) if doc]


def docs_of(*names: str) -> list[dict[str, Any]]:
    return [cel_whitespace(d) for name in names for d in yaml.safe_load_all((CONF / name).read_text()) if d]


def key(doc: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = doc["metadata"]
    return (doc["apiVersion"].split("/")[0], doc["kind"], meta.get("namespace", ""), meta["name"])


def by_key(docs: list[dict[str, Any]]) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    keys = [key(d) for d in docs]
    duplicates = {k for k in keys if keys.count(k) > 1}
    assert not duplicates, f"objects rendered more than once: {sorted(duplicates)}"
    return dict(zip(keys, docs, strict=True))


def listed(kustomization: Path) -> list[str]:
    return yaml.safe_load(kustomization.read_text())["resources"]


def test_overlays_list_the_base_files() -> None:
    """The overlays cannot take conf/ as their base (kustomize refuses a parent): they list its files."""
    assert listed(CONF / "kustomization.yaml") == BASE_FILES
    for overlay, up in (("sidecar", "../../"), ("mtls", "../../"), ("namespace/node", "../../../")):
        resources = listed(OVERLAYS / overlay / "kustomization.yaml")
        assert [r for r in resources if r.startswith(up) and r[len(up) :] in BASE_FILES] == [
            up + f for f in BASE_FILES
        ], overlay


@needs_kubectl
def test_the_base_renders_conf_files_unchanged_without_flags() -> None:
    assert by_key(render(CONF, files_outside=False)) == by_key(docs_of(*BASE_FILES))


@needs_kubectl
@pytest.mark.parametrize(
    ("overlay", "variant"), [("sidecar", "scheduler-extender.yaml"), ("mtls", "scheduler-extender-mtls.yaml")]
)
def test_an_extender_overlay_is_the_base_and_one_variant(overlay: str, variant: str) -> None:
    rendered = by_key(render(OVERLAYS / overlay))
    assert rendered == by_key(docs_of(*BASE_FILES, variant))
    assert sum(d["kind"] == "Deployment" for d in rendered.values()) == 1


@needs_kubectl
def test_the_image_digest_overlay_pins_every_rdma_cni_container() -> None:
    sidecar = by_key(render(OVERLAYS / "sidecar"))
    pinned = by_key(render(OVERLAYS / "image-digest"))
    assert pinned.keys() == sidecar.keys()
    changed = 0
    for k, doc in sidecar.items():
        expected = copy.deepcopy(doc)
        pod = expected.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            if container["image"].split(":")[0] == IMAGE:
                container["image"] = DIGEST_IMAGE
                changed += 1
            elif container["image"].split(":")[0] == SCHEDULER_IMAGE:
                container["image"] = f"{SCHEDULER_IMAGE}@sha256:" + "0" * 64
                changed += 1
        assert pinned[k] == expected, k
    assert changed >= 3  # the DaemonSet's, the extender's and kube-scheduler's


def test_the_sidecar_kube_scheduler_is_the_tested_one_and_its_minors_are_listed() -> None:
    # The manifest's tag, the sidecar overlay's parameter and the Kubernetes the cluster tier
    # builds are one version; the overlay's comment and docs/deploy.md list each supported minor.
    manifest = (CONF / "scheduler-extender.yaml").read_text(encoding="utf-8")
    overlay_text = (OVERLAYS / "sidecar" / "kustomization.yaml").read_text(encoding="utf-8")
    overlay = yaml.safe_load(overlay_text)
    (entry,) = overlay["images"]
    tested = SCHEDULER_TAGS["1.37"]
    assert entry == {"name": SCHEDULER_IMAGE, "newTag": tested}
    assert f"image: {SCHEDULER_IMAGE}:{tested}" in manifest
    gomod = (ROOT / "gobuild" / "kube" / "go.mod").read_text(encoding="utf-8")
    assert f"k8s.io/kubernetes {tested}" in gomod
    deploy = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    for minor, tag in SCHEDULER_TAGS.items():
        assert f"{minor}: {tag}" in overlay_text, minor
        assert f"| {minor} | `{tag}` |" in deploy, minor


@needs_kubectl
def test_the_namespace_overlay_moves_the_node_side_only() -> None:
    base = by_key(docs_of(*BASE_FILES))
    moved = by_key(render(OVERLAYS / "namespace"))
    names = {(k[1], k[3]) for k in moved}
    expected = {(k[1], k[3]) for k in base if k[3] != "rdma-cni-scheduler-extender-metrics"}
    assert names == expected | {("Namespace", "rdma-cni")}
    for k, doc in moved.items():
        if doc["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in doc["metadata"], k
        else:
            assert doc["metadata"]["namespace"] == "rdma-cni", k
    assert "kube-system" not in yaml.safe_dump(list(moved.values()))
    [binding] = [d for d in moved.values() if d["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rdma-cni", "namespace": "rdma-cni"}]
    # The admission policy: only the service account's user name differs from the shipped one.
    [policy] = [d for d in moved.values() if d["kind"] == "ValidatingAdmissionPolicy"]
    [shipped] = [d for d in base.values() if d["kind"] == "ValidatingAdmissionPolicy"]
    condition = policy["spec"]["matchConditions"][0]["expression"]
    assert condition == "request.userInfo.username == 'system:serviceaccount:rdma-cni:rdma-cni'"
    shipped = copy.deepcopy(shipped)
    shipped["spec"]["matchConditions"][0]["expression"] = condition
    assert policy == shipped


@needs_kubectl
@pytest.mark.parametrize("overlay", ["sidecar", "mtls", "image-digest", "namespace"])
def test_every_rendered_object_is_valid(overlay: str) -> None:
    for doc in render(OVERLAYS / overlay):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
