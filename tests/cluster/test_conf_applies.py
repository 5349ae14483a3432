"""conf/ is accepted by the real API server: every manifest applies server-side, a dry run first."""

from __future__ import annotations

import pytest

from tests.support.kube.applyconf import NOT_API_OBJECTS, apply_file, documents, manifests
from tests.support.kube.controlplane import REPO, ControlPlane


def test_every_conf_manifest_applies_server_side(applied: ControlPlane) -> None:
    names = manifests()
    assert names[0] == "network-attachment-definition-crd.yaml", "the CRD goes before the objects of its kind"
    assert "base/node/rbac.yaml" in names and "base/extender/scheduler-extender.yaml" in names
    for name in names:
        # Applied once already by the fixture: applying again must still pass
        # (and change nothing), as an operator re-applying conf/ would.
        result = apply_file(applied, name)
        assert len(result.objects) == len(documents(name)), (name, result.output)
        assert len(result.dry_run_output.splitlines()) == len(documents(name)), (name, result.dry_run_output)
        # Every object is there afterwards, as the API server stored it.
        stored = applied.kubectl("get", "-f", f"conf/{name}", "-o", "name", cwd=REPO).stdout.split()
        assert stored == [obj.split()[0] for obj in result.objects], name


@pytest.mark.parametrize("name", ["rdma-cni-node-state", "rdma-cni-scheduler-extender-pods"])
def test_the_admission_policies_are_compiled_without_type_errors(applied: ControlPlane, name: str) -> None:
    policy = applied.get("validatingadmissionpolicy", name)
    status = policy.get("status", {})
    # kube-apiserver type-checks the CEL expressions against the Node (Pod) schema
    # and reports what it could not check in status.typeChecking.
    assert status.get("typeChecking", {}).get("expressionWarnings") in (None, []), status
    assert policy["spec"]["failurePolicy"] == "Fail"


def test_the_network_attachment_definition_is_served_by_its_crd(applied: ControlPlane) -> None:
    nad = applied.get("network-attachment-definitions.k8s.cni.cncf.io", "rdma-net", "-n", "default")
    assert '"type": "rdma-cni"' in nad["spec"]["config"]
    crd = applied.get("crd", "network-attachment-definitions.k8s.cni.cncf.io")
    assert crd["spec"]["names"]["shortNames"] == ["net-attach-def"]


def test_a_manifest_the_api_server_refuses_fails_the_dry_run(applied: ControlPlane, tmp_path: object) -> None:
    # The check above would pass vacuously if kubectl did not report a refusal:
    # a DaemonSet without a selector is refused by the real server's validation.
    bad = "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: broken, namespace: default}\nspec: {}\n"
    proc = applied.kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", input=bad, check=False)
    assert proc.returncode != 0 and "selector" in proc.stderr


@pytest.mark.parametrize("name", sorted(NOT_API_OBJECTS))
def test_files_not_applied_are_not_api_objects(name: str) -> None:
    assert {str(d.get("kind")) for d in documents(name)} <= {"KubeSchedulerConfiguration", "Kustomization"}
