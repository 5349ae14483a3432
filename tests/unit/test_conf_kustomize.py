"""conf/'s kustomize bases, components and overlays: rendered by the real ``kubectl kustomize`` and checked.

kubectl comes from the cluster tier's build cache (/var/cache/rdma-cni-build/kubectl-*/kubectl);
without it these tests skip and say so. Every render runs as a GitOps tool (Argo CD, Flux) runs it:
``kubectl kustomize DIR`` and nothing more, no ``--load-restrictor``. Each overlay's render is
compared with the files it is made of: the objects they hold, each once, changed only as the overlay
says, and every object valid against Kubernetes' schema.
"""

from __future__ import annotations

import copy
import glob
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.docblocks import blocks

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
BASE = CONF / "base"
OVERLAYS = CONF / "overlays"
COMPONENTS = CONF / "components"
KUBECTLS = sorted(glob.glob("/var/cache/rdma-cni-build/kubectl-*/kubectl"))
NODE_FILES = ["base/node/rbac.yaml", "base/node/daemonset.yaml", "base/node/metrics.yaml"]
SIDECAR = "base/extender/scheduler-extender.yaml"
MTLS = "base/extender-mtls/scheduler-extender-mtls.yaml"
IMAGE = "localhost/rdma-cni"
DIGEST = "sha256:" + "0" * 64
DIGEST_IMAGE = "registry.example.com/rdma-cni@" + DIGEST
SCHEDULER_IMAGE = "registry.k8s.io/kube-scheduler"
# Kubernetes' newest patch of each supported minor (the Go module proxy's k8s.io/kubernetes tags,
# 2026-11-28); the last is the one the cluster tier builds and runs.
SCHEDULER_TAGS = {"1.34": "v1.34.4", "1.35": "v1.35.4", "1.36": "v1.36.3", "1.37": "v1.37.2"}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "Namespace", "ValidatingAdmissionPolicy",
                  "ValidatingAdmissionPolicyBinding"}  # fmt: skip
NAMESPACE = "rdma-cni"
# The one namespaced object the namespace component leaves in kube-system: the binding to the Role
# extension-apiserver-authentication-reader, which exists there only.
STAYS = ("RoleBinding", "rdma-scheduler-authentication-reader")
# Each overlay and what it is made of: the variant's file, and whether it is moved, pinned by digest.
VARIANTS = {
    "sidecar": (SIDECAR, False, False),
    "mtls": (MTLS, False, False),
    "image-digest": (SIDECAR, False, True),
    "image-digest-mtls": (MTLS, False, True),
    "namespace": (SIDECAR, True, False),
    "namespace-mtls": (MTLS, True, False),
}

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


def render(path: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize path``, exactly: no flag (GitOps tools pass none)."""
    out = subprocess.run(
        [KUBECTLS[-1], "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
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


def kustomizations() -> list[str]:
    """Every directory below conf/ with a kustomization (conf/ itself as ``.``), by path below conf/."""
    return sorted(str(p.parent.relative_to(CONF)) for p in CONF.rglob("kustomization.yaml"))


def renderable() -> list[str]:
    """The kustomizations that render alone: conf/, the bases and the overlays (a Component does not)."""
    return [d for d in kustomizations() if not d.startswith("components")]


def test_the_layout_is_bases_components_and_overlays() -> None:
    assert renderable() == [
        ".",
        "base/extender",
        "base/extender-mtls",
        "base/node",
        *sorted(f"overlays/{o}" for o in VARIANTS),
    ]
    for d in kustomizations():
        kind = yaml.safe_load((CONF / d / "kustomization.yaml").read_text())["kind"]
        assert kind == ("Component" if d.startswith("components") else "Kustomization"), d


def test_no_kustomization_reaches_a_file_outside_its_directory() -> None:
    """What kustomize's default load restrictor allows: a file below the kustomization, or a directory."""
    for d in kustomizations():
        here = (CONF / d).resolve()
        doc = yaml.safe_load((here / "kustomization.yaml").read_text())
        paths = doc.get("resources", []) + doc.get("components", [])
        paths += [p["path"] for p in doc.get("patches", []) if "path" in p]
        for p in paths:
            target = (here / p).resolve()
            assert target.is_dir() or here in target.parents, (d, p)


def test_nothing_asks_for_the_load_restrictor_flag() -> None:
    # Argo CD and Flux render without it: no kustomization, comment or documented command may need it.
    for path in [*CONF.rglob("*"), ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            assert "LoadRestrictionsNone" not in text, path
            if CONF in path.parents:
                assert "load-restrictor" not in text, path


def test_every_conf_path_named_in_the_repository_exists() -> None:
    """The manifests moved into conf/base/: no page, comment, script or test names an old path."""
    pattern = re.compile(r"(?<![\w/.-])conf/[\w./@-]*[\w@-]")
    texts = [ROOT / "README.md", ROOT / "Makefile", ROOT / ".ci" / "run", *(ROOT / "docs").glob("*.md")]
    for tree, glob_ in (("conf", "*"), ("rdma_cni", "*.py"), ("tests", "*.py"), ("scripts", "*")):
        texts += [p for p in (ROOT / tree).rglob(glob_) if p.is_file() and "__pycache__" not in p.parts]
    missing = {
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in texts
        for m in pattern.finditer(path.read_text(encoding="utf-8", errors="replace"))
        if not (ROOT / m.group(0)).exists()
    }
    assert missing == set(), sorted(missing)


@needs_kubectl
@pytest.mark.parametrize("directory", renderable())
def test_every_base_and_overlay_renders_without_flags(directory: str) -> None:
    assert render(CONF / directory)


@needs_kubectl
@pytest.mark.parametrize(
    ("directory", "files"),
    [
        (".", NODE_FILES),
        ("base/node", NODE_FILES),
        ("base/extender", [SIDECAR]),
        ("base/extender-mtls", [MTLS]),
    ],
)
def test_a_base_renders_its_files_unchanged(directory: str, files: list[str]) -> None:
    assert by_key(render(CONF / directory)) == by_key(docs_of(*files))


@needs_kubectl
@pytest.mark.parametrize(("overlay", "variant"), [("sidecar", SIDECAR), ("mtls", MTLS)])
def test_an_extender_overlay_is_the_node_side_and_one_variant(overlay: str, variant: str) -> None:
    rendered = by_key(render(OVERLAYS / overlay))
    assert rendered == by_key(docs_of(*NODE_FILES, variant))
    assert sum(d["kind"] == "Deployment" for d in rendered.values()) == 1


def pinned_by_digest(doc: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``doc`` as the image-digest component makes it, and how many containers it repoints."""
    doc = copy.deepcopy(doc)
    pod = doc.get("spec", {}).get("template", {}).get("spec", {})
    changed = 0
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        if container["image"].split(":")[0] == IMAGE:
            container["image"] = DIGEST_IMAGE
            changed += 1
        elif container["image"].split(":")[0] == SCHEDULER_IMAGE:
            container["image"] = f"{SCHEDULER_IMAGE}@{DIGEST}"
            changed += 1
    return doc, changed


@needs_kubectl
@pytest.mark.parametrize(
    ("overlay", "unpinned", "containers"),
    # sidecar: the DaemonSet's, the extender's and kube-scheduler's; mtls: the DaemonSet's and the extender's.
    [("image-digest", "sidecar", 3), ("image-digest-mtls", "mtls", 2)],
)
def test_an_image_digest_overlay_pins_every_container_of_its_variant(
    overlay: str, unpinned: str, containers: int
) -> None:
    plain = by_key(render(OVERLAYS / unpinned))
    pinned = by_key(render(OVERLAYS / overlay))
    assert pinned.keys() == plain.keys()
    changed = 0
    for k, doc in plain.items():
        expected, n = pinned_by_digest(doc)
        changed += n
        assert pinned[k] == expected, k
    assert changed == containers
    images = {
        c["image"]
        for d in pinned.values()
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
    }
    assert all("@sha256:" in i for i in images), images


def test_the_sidecar_kube_scheduler_is_the_tested_one_and_its_minors_are_listed() -> None:
    # The manifest's tag, the sidecar overlay's parameter and the Kubernetes the cluster tier
    # builds are one version; the overlay's comment and docs/deploy.md list each supported minor.
    manifest = (CONF / SIDECAR).read_text(encoding="utf-8")
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


def moved(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` as the namespace component must make it: everything that names kube-system moved.

    Built from the shipped file independently of the component: namespaced objects into rdma-cni
    (but the authentication reader's binding), every ServiceAccount subject with them, the admission
    policies' user names, and the sidecar kube-scheduler's lease.
    """
    doc = copy.deepcopy(doc)
    meta = doc["metadata"]
    if doc["kind"] not in CLUSTER_SCOPED and (doc["kind"], meta["name"]) != STAYS:
        assert meta["namespace"] == "kube-system", meta
        meta["namespace"] = NAMESPACE
    for subject in doc.get("subjects", []):
        if subject["kind"] == "ServiceAccount":
            assert subject["namespace"] == "kube-system", subject
            subject["namespace"] = NAMESPACE
    for condition in doc.get("spec", {}).get("matchConditions", []):
        before = "'system:serviceaccount:kube-system:"
        assert condition["expression"].count(before) == 1, condition
        condition["expression"] = condition["expression"].replace(
            before, f"'system:serviceaccount:{NAMESPACE}:"
        )
    if doc["kind"] == "ConfigMap" and "config.yaml" in doc.get("data", {}):
        config = doc["data"]["config.yaml"]
        assert config.count("resourceNamespace: kube-system") == 1
        doc["data"]["config.yaml"] = config.replace(
            "resourceNamespace: kube-system", f"resourceNamespace: {NAMESPACE}"
        )
    return doc


@needs_kubectl
@pytest.mark.parametrize(("overlay", "unmoved"), [("namespace", "sidecar"), ("namespace-mtls", "mtls")])
def test_a_namespace_overlay_moves_the_node_side_and_its_extender(overlay: str, unmoved: str) -> None:
    variant = VARIANTS[overlay][0]
    shipped = docs_of(*NODE_FILES, variant)
    rendered = by_key(render(OVERLAYS / overlay))
    expected = by_key([moved(d) for d in shipped])
    [namespace] = [d for d in rendered.values() if d["kind"] == "Namespace"]
    assert namespace["metadata"] == {
        "name": NAMESPACE, "labels": {"pod-security.kubernetes.io/enforce": "privileged"}
    }  # fmt: skip
    del rendered[key(namespace)]
    assert rendered == expected
    # Every workload of the variant moved with the node side: the extender's Deployment, its account,
    # its configuration or Service, the metrics Services.
    kinds = {d["kind"] for d in rendered.values() if d["metadata"].get("namespace") == NAMESPACE}
    assert {"DaemonSet", "Deployment", "ServiceAccount", "Service"} <= kinds
    assert ("ConfigMap" if variant == SIDECAR else "ValidatingAdmissionPolicy") in {
        d["kind"] for d in rendered.values()
    }
    # kube-system is left only where it must be: the binding to a Role that lives there.
    for k, doc in rendered.items():
        if "kube-system" in yaml.safe_dump(doc):
            assert (doc["kind"], doc["metadata"]["name"]) == STAYS, k
            assert doc["roleRef"] == {
                "apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                "name": "extension-apiserver-authentication-reader",
            }  # fmt: skip
    # The same objects as the variant in kube-system, none lost or added.
    assert {(k[1], k[3]) for k in rendered} == {(k[1], k[3]) for k in by_key(render(OVERLAYS / unmoved))}


def test_the_namespace_components_scheduler_configuration_is_the_shipped_one() -> None:
    """The component replaces the sidecar's configuration string whole: only the lease's namespace differs."""
    [shipped] = [d for d in docs_of(SIDECAR) if d["kind"] == "ConfigMap"]
    patch = yaml.safe_load((COMPONENTS / "namespace" / "move" / "scheduler-config.yaml").read_text())
    assert patch["metadata"] == {"name": shipped["metadata"]["name"]}
    assert patch["data"] == moved(shipped)["data"]


@needs_kubectl
def test_the_docs_own_overlay_combines_both_components(tmp_path: Path) -> None:
    """docs/deploy.md's example of an overlay of one's own, beside a copy of conf/, as it says."""
    [example] = [
        b.text
        for b in blocks(ROOT / "docs" / "deploy.md")
        if b.lang == "yaml" and "../conf/components/namespace" in b.text
    ]
    shutil.copytree(CONF, tmp_path / "conf")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "kustomization.yaml").write_text(example)
    mine = by_key(render(tmp_path / "mine"))
    expected = {k: pinned_by_digest(d)[0] for k, d in by_key(render(OVERLAYS / "namespace")).items()}
    assert mine == expected


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(VARIANTS))
def test_every_rendered_object_is_valid(overlay: str) -> None:
    for doc in render(OVERLAYS / overlay):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
