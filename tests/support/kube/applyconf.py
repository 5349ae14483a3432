"""Apply conf/ to a real API server as an operator would: ``kubectl apply --server-side``, a dry run first.

Every YAML file of conf/ and of its kustomize bases (conf/base/*/) whose
documents are API objects is applied; the files that are not (a
KubeSchedulerConfiguration, which kube-scheduler reads from disk; the
kustomizations) are named in :data:`NOT_API_OBJECTS` with the reason. Files
defining CustomResourceDefinitions go first, and each CRD is awaited until
established, so the custom objects after them are accepted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import yaml

from tests.support.kube.controlplane import REPO, ControlPlane

CONF = os.path.join(REPO, "conf")
# conf/ files kube-apiserver never sees.
NOT_API_OBJECTS = {
    "kube-scheduler-default.yaml": "a KubeSchedulerConfiguration file for the cluster's own kube-scheduler",
    "kustomization.yaml": "kustomize's input, conf/'s and each base's (their resources are applied here)",
}
FIELD_MANAGER = "rdma-cni-operator"


@dataclass(frozen=True)
class Applied:
    """One conf/ file applied: its objects as ``kind/name`` (namespace-qualified where namespaced)."""

    name: str
    objects: list[str]
    dry_run_output: str
    output: str


def manifests() -> list[str]:
    """The YAML files of conf/ and its bases (conf/base/*/) that hold API objects, by path below conf/.

    CRD files first, then by file name (the order from before the bases had directories of their own).
    """
    names = [n for n in os.listdir(CONF) if n.endswith((".yaml", ".yml"))]
    for base in sorted(os.listdir(os.path.join(CONF, "base"))):
        names += [
            f"base/{base}/{n}" for n in os.listdir(os.path.join(CONF, "base", base)) if n.endswith(".yaml")
        ]
    names = sorted((n for n in names if os.path.basename(n) not in NOT_API_OBJECTS), key=os.path.basename)
    return sorted(names, key=lambda n: "CustomResourceDefinition" not in kinds(n))


def documents(name: str) -> list[dict[str, object]]:
    """The non-empty YAML documents of conf/<name>."""
    with open(os.path.join(CONF, name)) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def kinds(name: str) -> set[str]:
    """The kinds one conf/ file holds."""
    return {str(doc.get("kind")) for doc in documents(name)}


def apply_file(cp: ControlPlane, name: str) -> Applied:
    """Server-side dry run, then server-side apply, of one conf/ file; raises with kubectl's words."""
    path = os.path.join(CONF, name)
    common = ["apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "-f", path, "-o", "name"]
    dry = cp.kubectl(*common, "--dry-run=server").stdout
    out = cp.kubectl(*common).stdout
    objects = [line.strip() for line in out.splitlines() if line.strip()]
    for doc in documents(name):
        if doc.get("kind") == "CustomResourceDefinition":
            meta = doc["metadata"]
            assert isinstance(meta, dict)
            cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{meta['name']}")
    return Applied(name, objects, dry, out)


def apply_conf(cp: ControlPlane) -> list[Applied]:
    """Apply every conf/ manifest, in order."""
    return [apply_file(cp, name) for name in manifests()]
