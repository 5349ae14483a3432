"""docs/deploy.md's uninstall, run as written on a cluster with rdma-cni installed: nothing of ours is left.

A control plane of its own. Installed as the docs say: every conf/ manifest applied, the
mutual-TLS variant's steps (certificates, Secret, ConfigMap, kube-scheduler's configuration
written by ``rdma-cni scheduler-config``), the cluster's kube-scheduler started from it, the
extender of each variant and rdma-scheduler's kube-scheduler running, each node's agent (a pod of
the DaemonSet, owned by it, its token bound to it) advertising the node's RDMA resources and
publishing its state. An RDMA pod is bound through the extender, conf/'s sample pod through
rdma-scheduler. Then the uninstall's blocks, in order; the tier plays the kubelet (a workload's
processes stop once the garbage collector deleted its pods) and the node's own step is left to
the node tiers. Afterwards no object of any listable kind in the cluster names rdma-cni (Events
aside: they expire), no Node has an ``rdma-cni.io`` resource in its status or the state
annotation, and the cluster's kube-scheduler, restarted without the extender, schedules pods,
while a pod declaring ``rdma-cni.io/vf`` finds no node for it.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import yaml

from rdma_cni.shared import nodestate
from tests.cluster.conftest import failed_scheduling, unique, wait_for_service_account
from tests.support import sched_objects as so
from tests.support.docblocks import blocks
from tests.support.kube.applyconf import apply_conf
from tests.support.kube.controlplane import ControlPlane
from tests.support.kube.mtlsscheduler import (
    DEPLOY_MD,
    DefaultScheduler,
    MtlsExtender,
    Operator,
    ServiceRelays,
    docs_blocks,
    rdma_pod,
)
from tests.support.kube.objects import client_for_token, create, create_node, pod_doc
from tests.support.kube.rdmascheduler import RdmaScheduler, start_rdma_scheduler
from tests.support.waiting import wait_for

SECTION = "## Uninstall"
NODES = ("node-a", "node-b")
# The kinds whose objects expire by themselves (the API server's --event-ttl).
EXPIRING = {"events", "events.events.k8s.io"}


def uninstall_blocks() -> list[str]:
    """The shell blocks of the Uninstall section that run (not norun), in order."""
    text = DEPLOY_MD.read_text()
    begin = text.index(SECTION)
    start = text[:begin].count("\n") + 1
    end = text[: text.index("\n## ", begin + len(SECTION))].count("\n") + 1
    found = [b for b in blocks(DEPLOY_MD) if start <= b.line <= end and b.is_shell]
    return [b.text for b in found if b.marker != "norun"]


def debug_block() -> str:
    """The node's step: its one norun block that runs ``kubectl debug``."""
    text = DEPLOY_MD.read_text()
    begin = text.index(SECTION)
    start = text[:begin].count("\n") + 1
    (block,) = [b for b in blocks(DEPLOY_MD) if b.line > start and "kubectl debug node/" in b.text]
    return block.text


@dataclass
class Installed:
    cp: ControlPlane
    operator: Operator
    extender: MtlsExtender
    scheduler: DefaultScheduler
    sidecar: RdmaScheduler
    relays: ServiceRelays
    namespace: str
    kubelet_errors: list[str] = field(default_factory=list)


def _owned_pod(
    cp: ControlPlane, kind: str, name: str, labels: dict[str, str], node: str | None, account: str
) -> str:
    """A pod of a workload as its controller would make it (owned by it, so the garbage collector
    deletes it with the workload), bound to ``node``; returns its name."""
    owner = cp.get(kind, name, "-n", "kube-system")
    pod = f"{name}-{unique('pod')}"
    doc = pod_doc("kube-system", pod, node=node, account=account)
    doc["metadata"]["labels"] = labels
    doc["metadata"]["ownerReferences"] = [
        {
            "apiVersion": owner["apiVersion"],
            "kind": owner["kind"],
            "name": name,
            "uid": owner["metadata"]["uid"],
            "controller": True,
        }
    ]
    create(cp, doc)
    return pod


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("uninstall")
    cp = ControlPlane(str(root / "cluster"), default_scheduler=False)
    relays = extender = scheduler = sidecar = None
    try:
        cp.start()
        wait_for_service_account(cp, "default", "default")
        apply_conf(cp)
        operator = Operator(cp, root / "operator")
        operator.prepare()
        for block in docs_blocks()[:3]:
            operator.run(block)
        extender = MtlsExtender(cp, root / "operator")
        extender.start()
        relays = ServiceRelays(cp, extender.port)
        scheduler = DefaultScheduler(cp, operator, relays)
        scheduler.start()
        sidecar = start_rdma_scheduler(cp, tag="uninstall")
        # The workloads' pods, as their controllers would make them; each agent on its node.
        for node in NODES:
            state = so.state([("ens1f0", 100_000, 8)])
            create_node(cp, node)
            pod = _owned_pod(
                cp, "daemonset", "rdma-cni", {"app.kubernetes.io/name": "rdma-cni"}, node, "rdma-cni"
            )
            token = cp.token(
                "kube-system", "rdma-cni", "--bound-object-kind=Pod", f"--bound-object-name={pod}"
            )
            with client_for_token(cp, token, f"agent-{node}") as client:
                from rdma_cni.agent import capacity

                advertiser = capacity.Advertiser(lambda client=client: client, node)
                assert advertiser.advertise(state), advertiser.last_error
                client.patch_merge(
                    f"/api/v1/nodes/{node}",
                    {"metadata": {"annotations": {nodestate.ANNOTATION: nodestate.encode(state)}}},
                )
        component = {"app.kubernetes.io/component": "rdma-cni-scheduler-extender"}
        _owned_pod(cp, "deployment", "rdma-scheduler", component, NODES[0], "rdma-scheduler")
        _owned_pod(
            cp,
            "deployment",
            "rdma-cni-scheduler-extender",
            component,
            NODES[1],
            "rdma-cni-scheduler-extender",
        )
        namespace = unique("tenant")
        cp.kubectl("create", "namespace", namespace)
        wait_for_service_account(cp, namespace, "default")
        yield Installed(cp, operator, extender, scheduler, sidecar, relays, namespace)
    finally:
        for part in (scheduler, extender, sidecar):
            if part is not None:
                part.stop()
        if relays is not None:
            relays.close()
        cp.stop()


def node_of(cp: ControlPlane, namespace: str, pod: str) -> str | None:
    return cp.get("pod", pod, "-n", namespace)["spec"].get("nodeName")


def leftovers(cp: ControlPlane, skip_namespaces: set[str]) -> list[str]:
    """Every object of every listable kind whose name, labels or annotations say rdma-cni (or rdma-),
    Events aside; and every Node's rdma-cni.io status keys."""
    kinds = cp.kubectl("api-resources", "--verbs=list", "-o", "name").stdout.split()
    found = []
    for kind in kinds:
        if kind in EXPIRING:
            continue
        proc = cp.kubectl("get", kind, "--all-namespaces", "-o", "json", check=False)
        if proc.returncode != 0:
            continue
        for item in json.loads(proc.stdout)["items"]:
            meta = item.get("metadata") or {}
            if meta.get("namespace") in skip_namespaces:
                continue
            text = json.dumps([meta.get("name"), meta.get("labels"), meta.get("annotations")], sort_keys=True)
            if "rdma" in text:
                found.append(f"{kind} {meta.get('namespace') or ''}/{meta.get('name')}")
            status = item.get("status") or {}
            for part in ("capacity", "allocatable"):
                keys = [k for k in (status.get(part) or {}) if k.startswith("rdma-cni.io/")]
                if kind == "nodes" and keys:
                    found.append(f"node {meta.get('name')} status.{part}: {keys}")
    return found


def _run_debug_step(cp: ControlPlane, namespace: str, node: str) -> subprocess.CompletedProcess[str]:
    """The docs' kubectl debug command for ``node`` with ``-n namespace`` (no kubelet here: kubectl
    waits for a pod that never runs, so it is cut short once the API server has answered)."""
    first = debug_block().replace("\\\n", " ").splitlines()[0]
    assert first.startswith("kubectl debug node/NODE -n kube-system -it --profile=sysadmin --image=IMAGE"), (
        first
    )
    argv = first.split()[1:]
    argv = [a.replace("NODE", node).replace("IMAGE", "registry.invalid/rdma-cni:0.1.0") for a in argv]
    argv[argv.index("-n") + 1] = namespace
    argv.remove("-it")  # no terminal to attach here; admission is what is checked
    return cp.kubectl(*argv, check=False)


def play_the_kubelet(i: Installed, stop: threading.Event) -> None:
    """The garbage collector's and the kubelet's part in a workload's deletion: a pod whose owner is
    gone is deleted (its processes are stopped once the block is done). The tier's
    kube-controller-manager runs its garbage collector under its own identity (no service-account
    credentials), which may not delete pods, and there is no kubelet."""
    while not stop.wait(0.5):
        try:
            _kubelet_pass(i)
        except Exception as exc:  # the test sees it: the waits time out, and this says why
            i.kubelet_errors.append(repr(exc))


def _kubelet_pass(i: Installed) -> None:
    """One look: the pods whose owner is gone deleted (their processes are stopped after the block)."""
    if True:
        owners = {
            o["metadata"]["uid"]
            for kind in ("daemonsets", "deployments")
            for o in i.cp.get(kind, "-n", "kube-system")["items"]
        }
        for pod in i.cp.get("pods", "-n", "kube-system")["items"]:
            meta = pod["metadata"]
            labels = meta.get("labels") or {}
            refs = meta.get("ownerReferences") or []
            if not refs or refs[0]["uid"] in owners or "rdma" not in json.dumps(labels):
                continue
            i.cp.kubectl(
                "-n", "kube-system", "delete", "pod", meta["name"], "--grace-period=0", "--force", check=False
            )


def test_the_node_step_is_admitted_in_kube_system_and_refused_under_baseline(installed: Installed) -> None:
    i = installed
    baseline = unique("baseline")
    i.cp.kubectl("create", "namespace", baseline)
    i.cp.kubectl("label", "namespace", baseline, "pod-security.kubernetes.io/enforce=baseline")
    refused = _run_debug_step(i.cp, baseline, NODES[0])
    assert refused.returncode != 0 and 'violates PodSecurity "baseline:latest"' in refused.stderr, (
        refused.stderr
    )
    admitted = _run_debug_step(i.cp, "kube-system", NODES[0])
    assert admitted.returncode == 0, admitted.stderr
    pods = [
        p
        for p in i.cp.get("pods", "-n", "kube-system")["items"]
        if p["metadata"]["name"].startswith(f"node-debugger-{NODES[0]}-")
    ]
    assert len(pods) == 1 and pods[0]["spec"]["hostPID"] and pods[0]["spec"]["nodeName"] == NODES[0]
    # The docs' clean-up line deletes it once it completed; no kubelet here to confirm a graceful delete.
    i.cp.kubectl(
        "-n", "kube-system", "delete", "pod", pods[0]["metadata"]["name"], "--grace-period=0", "--force"
    )
    i.cp.kubectl("delete", "namespace", baseline, "--wait=false")


def test_the_uninstall_leaves_nothing(installed: Installed) -> None:
    i = installed
    cp = i.cp
    # Installed and working: an RDMA pod bound through the mutual-TLS extender, the sample pod
    # through rdma-scheduler; the Nodes carry what the agents wrote.
    pod = unique("rdma")
    rdma_pod(cp, i.namespace, pod, [{"min_tx_rate": 1000}])
    wait_for(lambda: node_of(cp, i.namespace, pod), 90, f"{pod} bound")
    wait_for(lambda: node_of(cp, "default", "rdma-test-pod"), 90, "conf/pod.yaml's pod bound")
    assert leftovers(cp, {i.namespace})  # the check sees what is installed

    steps = uninstall_blocks()
    assert len(steps) == 6, len(steps)
    rdma_pods, control_plane, workloads, node_status, objects, crd = steps
    # 1. The RDMA pods: conf/'s sample pod by the block, this tenant's own pod by its owner.
    i.operator.run(rdma_pods)
    cp.kubectl("delete", "pod", pod, "-n", i.namespace, "--grace-period=0", "--force")
    cp.kubectl("delete", "pod", "rdma-test-pod", "-n", "default", "--grace-period=0", "--force", check=False)
    # 2. The control plane: kube-scheduler's configuration without the extender, kube-scheduler restarted.
    before = yaml.safe_load(i.operator.config.read_text())
    i.operator.run(control_plane)
    after = yaml.safe_load(i.operator.config.read_text())
    assert "extenders" not in after
    assert {k: v for k, v in after.items()} == {k: v for k, v in before.items() if k != "extenders"}
    i.scheduler.restart()
    # 3. The workloads; the garbage collector deletes their pods, and the kubelet stops their
    # containers and confirms the deletion, which the block's waits wait for (both played here).
    stop = threading.Event()
    kubelet = threading.Thread(target=play_the_kubelet, args=(i, stop), daemon=True)
    kubelet.start()
    try:
        i.operator.run(workloads)
    finally:
        stop.set()
        kubelet.join()
        assert not i.kubelet_errors, i.kubelet_errors
    assert not [
        p
        for p in cp.get("pods", "-n", "kube-system")["items"]
        if "rdma" in json.dumps(p["metadata"].get("labels"))
    ]
    i.sidecar.stop()
    i.extender.stop()
    # 4. Each node's files: the node tiers' (tests/unit/test_uninstall.py); its pod's admission above.
    # 5. What the agents wrote on the Nodes.
    i.operator.run(node_status)
    # 6. The other objects, and the CRD this cluster got from conf/.
    i.operator.run(objects)
    i.operator.run(crd)

    cp.kubectl("delete", "namespace", i.namespace, "--wait=false")
    assert leftovers(cp, {i.namespace}) == []
    for node in cp.get("nodes")["items"]:
        status = node["status"]
        assert not [
            k for k in {**status["capacity"], **status["allocatable"]} if k.startswith("rdma-cni.io/")
        ]
        assert nodestate.ANNOTATION not in (node["metadata"].get("annotations") or {})

    # The cluster's kube-scheduler schedules without the extender; a pod still declaring the RDMA
    # resources fits no node now (none advertises them), instead of landing on a node without the plugin.
    tenant = unique("after")
    cp.kubectl("create", "namespace", tenant)
    wait_for_service_account(cp, tenant, "default")
    plain = unique("plain")
    create(cp, pod_doc(tenant, plain))
    wait_for(lambda: node_of(cp, tenant, plain), 60, f"{plain} scheduled after the uninstall")
    declaring = unique("declaring")
    rdma_pod(cp, tenant, declaring, [{"min_tx_rate": 1000}])
    reasons = wait_for(
        lambda: [r for r in failed_scheduling(cp, tenant, declaring) if "Insufficient rdma-cni.io/vf" in r],
        60,
        f"{declaring}'s FailedScheduling event",
    )
    assert node_of(cp, tenant, declaring) is None, reasons
