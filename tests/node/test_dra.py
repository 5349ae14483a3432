"""A pod with a ResourceClaim, prepared by the real kubelet through the agent's DRA plugin.

The DRA path end to end on a real node (docs/dra.md): the agent, conf/base/node/daemonset.yaml as shipped
but for the network configurations an operator adds (a ConfigMap and ``--network-config``, as
the manifest's comment says: conf/'s ``rdma-net`` on the first PF, a DRA network on the second),
publishes the second PF as a ResourceSlice through conf/dra.yaml's rights; the pod refers to the
ResourceClaimTemplate the built ``rdma-cni claim`` prints; the default kube-scheduler v1.37.2
allocates the claim; kubelet v1.37.2 finds the agent's plugin in its plugin registry (the
DaemonSet's hostPath mounts), calls NodePrepareResources before the sandbox, and Multus' ADD
through the shim applies the allocated bandwidth as the VF's guaranteed rate. Deleting the pod
runs DEL and kubelet's NodeUnprepareResources: nothing is left held or prepared. A claim the node
can no longer honour (its PF's link fell below the allocation between kube-scheduler's allocation
and kubelet's preparation) is refused in kubelet's own event with the agent's reason, and leaves
nothing. The node is put back as the other tests expect it (the shipped DaemonSet, no DRA objects).

``RDMA_CNI_RECORD_DRA_WIRE=<file>`` records kubelet's calls to the plugin into ``<file>`` (the
unit tier's tests/unit/data/kubelet-dra-wire.json, docs/testing.md#the-kubelets-dra-calls): the
DaemonSet's two kubelet hostPath volumes then point out of kubelet's sight, and
tests/support/drawire.py's Recorder serves the paths kubelet dials (the agent's registration
socket's name in kubelet's plugin registry, the endpoint the agent's GetInfo names), passing
every call's bytes on to the agent unchanged. Without it the DaemonSet's paths are as shipped.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import re
import shutil
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from rdma_cni.agent.dra import dra_v1_pb2 as dra_pb
from rdma_cni.agent.dra import registration_v1_pb2 as reg_pb
from rdma_cni.agent.dra.kubelet import DEFAULT_PLUGIN_DIR, DEFAULT_REGISTRY_DIR
from tests.node.conftest import held, wait_at_rest
from tests.support import drawire
from tests.support.kube.controlplane import REPO
from tests.support.kube.dra import allocation_of, claim_template, devices, pod_claim, wait_allocated
from tests.support.node import pods
from tests.support.node.node import STATE_DIR, Node, apply_daemonset, second_network, wait_agent_ready
from tests.support.waiting import wait_for

DRA_NETWORK = "rdma-dra"
DRA_SUBNET = "192.168.176.0/20"
CONFIGMAP = "rdma-cni-networks"
MOUNT = "/etc/rdma-cni/network"
PREPARED = os.path.join(STATE_DIR, "prepared")
REQUEST = [{"min_tx_rate": 15000, "max_tx_rate": 20000}]
WIRE = os.path.join(REPO, "tests", "unit", "data", "kubelet-dra-wire.json")
RECORD = os.environ.get("RDMA_CNI_RECORD_DRA_WIRE", "")
# Recording: where the agent's two kubelet directories are instead (kubelet's plugin watcher looks
# in its plugins_registry only, so it never sees the agent's own registration socket here).
HIDDEN = os.path.join(os.path.dirname(DEFAULT_PLUGIN_DIR), "rdma-cni.io-recorded")
HIDDEN_VOLUMES = {
    "kubelet-plugins-registry": os.path.join(HIDDEN, "registry"),
    "kubelet-plugin": os.path.join(HIDDEN, "plugin"),
}


def network_configs(node: Node) -> dict[str, dict[str, Any]]:
    """The agent's two networks: conf/'s rdma-net on the first PF, the DRA network on the second
    (a PF belongs to one path: docs/dra.md#sharing-a-node)."""
    first, second = (pf.name for pf in node.sim.pfs)
    rdma_net = json.loads(second_network("rdma-net", "192.168.128.0/20")["spec"]["config"])
    rdma_net["pfs"] = [first]
    dra = json.loads(second_network(DRA_NETWORK, DRA_SUBNET)["spec"]["config"])
    dra.update({"dra": True, "pfs": [second]})
    return {"rdma-net.json": rdma_net, f"{DRA_NETWORK}.json": dra}


def daemonset_with_networks(text: str, files: list[str], hidden: bool = False) -> str:
    """conf/base/node/daemonset.yaml (as the tier applies it) with the network configurations mounted from
    the ConfigMap and named by ``--network-config``, as its comment tells an operator to; with
    ``hidden`` (recording), its kubelet volumes' host paths are :data:`HIDDEN_VOLUMES`'s."""
    doc = yaml.safe_load(text)
    spec = doc["spec"]["template"]["spec"]
    if hidden:
        for volume in spec["volumes"]:
            if volume["name"] in HIDDEN_VOLUMES:
                volume["hostPath"]["path"] = HIDDEN_VOLUMES[volume["name"]]
    (container,) = [c for c in spec["containers"] if c["name"] == "install"]
    container["command"] += [f"--network-config={MOUNT}/{name}" for name in files]
    container["volumeMounts"].append({"name": "network-config", "mountPath": MOUNT, "readOnly": True})
    spec["volumes"].append({"name": "network-config", "configMap": {"name": CONFIGMAP}})
    return str(yaml.safe_dump(doc))


def conf_dra() -> str:
    with open(os.path.join(REPO, "conf", "dra.yaml")) as f:
        return f.read()


def rollout(node: Node) -> None:
    """The DaemonSet's new agent Ready and the old one gone (maxSurge 1: both run for a while)."""
    node.kubectl("rollout", "status", "daemonset/rdma-cni", "-n", "kube-system", "--timeout=300s")
    wait_agent_ready(node, 240)
    wait_for(lambda: len(node.agent_pods()) == 1, 120, "the old agent pod gone")


@pytest.fixture(scope="module")
def dra_node(node: Node) -> Iterator[Node]:
    """The node's agent with a DRA network; the shipped DaemonSet and no DRA object after.

    One for the module's tests: each rollout (here and back) costs the shared machine a minute.
    """
    configs = network_configs(node)
    node.kubectl("apply", "-f", "-", input=conf_dra())
    nad = second_network(DRA_NETWORK, DRA_SUBNET)
    nad["spec"]["config"] = json.dumps(configs[f"{DRA_NETWORK}.json"])
    node.kubectl("apply", "-f", "-", input=json.dumps(nad))
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONFIGMAP, "namespace": "kube-system"},
        "data": {name: json.dumps(config) for name, config in configs.items()},
    }
    node.kubectl("apply", "-f", "-", input=json.dumps(configmap))
    text = daemonset_with_networks(node.daemonset_text, sorted(configs), hidden=bool(RECORD))
    node.kubectl("apply", "--server-side", "--field-manager=rdma-cni-operator", "-f", "-", input=text)
    try:
        rollout(node)
        yield node
    finally:
        apply_daemonset(node)  # the shipped one again
        rollout(node)
        node.kubectl("delete", "--ignore-not-found", "configmap", CONFIGMAP, "-n", "kube-system")
        node.kubectl("delete", "--ignore-not-found", "network-attachment-definition", DRA_NETWORK)
        node.kubectl("delete", "resourceslices", "--field-selector=spec.driver=rdma-cni.io")
        node.kubectl("delete", "--ignore-not-found", "-f", "-", input=conf_dra())
        shutil.rmtree(HIDDEN, ignore_errors=True)


@pytest.fixture
def wire(dra_node: Node) -> Iterator[drawire.Recorder | None]:
    """With ``RDMA_CNI_RECORD_DRA_WIRE``: the Recorder between kubelet and the new agent's plugin."""
    if not RECORD:
        yield None
        return

    def agent_sockets() -> tuple[str, str] | None:
        registration = glob.glob(
            os.path.join(HIDDEN_VOLUMES["kubelet-plugins-registry"], "rdma-cni.io-*-reg.sock")
        )
        endpoint = glob.glob(os.path.join(HIDDEN_VOLUMES["kubelet-plugin"], "dra-*.sock"))
        return (registration[0], endpoint[0]) if len(registration) == len(endpoint) == 1 else None

    registration, endpoint = wait_for(agent_sockets, 120, "the agent's DRA sockets")
    # The names kubelet would have seen: the registration socket's in its registry, and the
    # endpoint GetInfo answers with (the agent's path in its container, as shipped).
    listen = {
        "dra": os.path.join(DEFAULT_PLUGIN_DIR, os.path.basename(endpoint)),
        "registration": os.path.join(DEFAULT_REGISTRY_DIR, os.path.basename(registration)),
    }
    os.makedirs(DEFAULT_PLUGIN_DIR, exist_ok=True)
    # dra first: kubelet's plugin watcher calls GetInfo as soon as the registration socket exists.
    recorder = drawire.Recorder(listen, {"dra": endpoint, "registration": registration})
    recorder.start()
    try:
        yield recorder
    finally:
        recorder.stop()


def create_claim_pod(node: Node, namespace: str, name: str) -> None:
    """A pod of the DRA network whose claim comes from the template ``rdma-cni claim`` prints
    (:data:`REQUEST`), for the default kube-scheduler: its DRA allocator."""
    template = claim_template(json.dumps(REQUEST), "trainer", DRA_NETWORK, namespace)
    node.kubectl("create", "-f", "-", input=json.dumps(template))
    pod = pods.pod_manifest(namespace, name, f"default/{DRA_NETWORK}")
    pod["spec"].pop("schedulerName")
    pod["spec"]["resourceClaims"] = [{"name": "rdma", "resourceClaimTemplateName": "trainer"}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "rdma"}]}
    pods.create(node, pod)


def preparations() -> dict[str, dict[str, Any]]:
    """The node's DRA preparations (``<stateDir>/prepared``), by claim uid."""
    if not os.path.isdir(PREPARED):
        return {}
    out = {}
    for name in os.listdir(PREPARED):
        if name.endswith(".json"):
            with open(os.path.join(PREPARED, name)) as f:
                out[name.removesuffix(".json")] = json.load(f)
    return out


def test_the_recorded_wire_is_this_kubelets(node: Node) -> None:
    # The unit tier replays tests/unit/data/kubelet-dra-wire.json as kubelet's calls: it must be
    # this tier's kubelet that sent them, or the recording is stale.
    recorded = drawire.provenance(WIRE).get("kubelet")
    assert RECORD or recorded == node.bins["kubelet"].version, (
        f"{WIRE} was recorded from kubelet {recorded}, this node runs {node.bins['kubelet'].version}: "
        "re-record it (docs/testing.md#the-kubelets-dra-calls)"
    )


def test_kubelet_prepares_a_claim_and_add_applies_the_allocated_rate(
    dra_node: Node, wire: drawire.Recorder | None, namespace: str
) -> None:
    node = dra_node
    first, second = (pf.name for pf in node.sim.pfs)
    # The agent publishes the DRA network's PF, and only that one, as a device of its node.
    published = wait_for(lambda: devices(node.cp, node.name) or None, 120, "the agent's ResourceSlice")
    assert sorted(published) == [second], published
    assert published[second]["capacity"]["bandwidth"]["value"] in ("100k", "100000")

    create_claim_pod(node, namespace, "dra-pod")
    running = pods.wait_running(node, namespace, ["dra-pod"], timeout=240)["dra-pod"]
    assert running["spec"]["nodeName"] == node.name

    # kube-scheduler allocated a 15000 Mbit/s share of the DRA PF's device.
    claim = pod_claim(node.cp, namespace, "dra-pod")
    assert claim is not None
    (result,) = allocation_of(claim)
    assert result["driver"] == "rdma-cni.io" and result["pool"] == node.name
    assert result["device"] == published[second]["name"]
    assert result["consumedCapacity"]["bandwidth"] in ("15k", "15000"), result
    assert [r["uid"] for r in claim["status"]["reservedFor"]] == [running["metadata"]["uid"]]

    # kubelet registered the agent's plugin and called NodePrepareResources (the only writer of a
    # preparation): the claim's VF chosen on that PF for this pod.
    log = node.agent_log()
    assert "DRA: kubelet registered the rdma-cni.io plugin" in log, log[-3000:]
    prepared = preparations()
    assert list(prepared) == [claim["metadata"]["uid"]], prepared
    (vf,) = prepared[claim["metadata"]["uid"]]["vfs"]
    assert (vf["pf"], vf["min_tx_rate"], vf["max_tx_rate"]) == (second, 15000, 20000), vf
    assert prepared[claim["metadata"]["uid"]]["pod_uid"] == running["metadata"]["uid"]

    # Multus' ADD through the shim took exactly that VF, at the allocated rate and the cap.
    sandbox = node.sandbox(namespace, "dra-pod")["status"]["id"]
    (record,) = [r for r in node.record_docs() if r["container_id"] == sandbox]
    assert record["network"] == DRA_NETWORK
    assert [(v["pf"], int(v["vf"]), v["min_tx_rate"], v["max_tx_rate"]) for v in record["vfs"]] == [
        (second, int(vf["vf"]), 15000, 20000)
    ]
    assert node.pf_settings()[f"{second}/{vf['vf']}"]["rate"] == [15000, 20000]
    settings = node.pf_settings()
    assert not [
        k for k, s in settings.items() if k.startswith(f"{first}/") and s.get("rate", [0, 0]) != [0, 0]
    ]
    status = pods.network_status(node.pod(namespace, "dra-pod") or running)
    assert [(s["name"], s["interface"]) for s in status][1:] == [(f"default/{DRA_NETWORK}", "net1")], status
    seen = node.exec(namespace, "dra-pod", "c", "ip", "-o", "link")
    assert re.search(r"^\d+: net1[@:]", seen, re.M), seen  # busybox: "29606: net1@if29605: <...>"

    # Deleted: DEL gives the VF back, kubelet's NodeUnprepareResources drops the preparation.
    pods.delete(node, namespace, "dra-pod")
    pods.wait_gone(node, namespace, ["dra-pod"])
    wait_at_rest(node)
    wait_for(lambda: not preparations(), 120, "the claim unprepared")
    if wire is not None:
        save_recording(node, wire, claim)


def test_a_claim_the_node_can_no_longer_honour_fails_kubelets_preparation_and_leaves_nothing(
    dra_node: Node, wire: drawire.Recorder | None, namespace: str
) -> None:
    node = dra_node
    second = node.sim.pfs[1]
    speed = second.speed
    assert speed is not None
    published = wait_for(lambda: devices(node.cp, node.name) or None, 120, "the agent's ResourceSlice")
    assert published[second.name]["capacity"]["bandwidth"]["value"] in ("100k", "100000")
    before = {"prepared": preparations(), "held": held(node), "vfs home": node.vfs_home()}
    assert before == {"prepared": {}, "held": {}, "vfs home": node.all_vfs()}, before
    kubelet = node.kubelet.component.proc if node.kubelet and node.kubelet.component else None
    assert kubelet is not None and kubelet.poll() is None
    try:
        # kubelet held off (stopped, not gone: its connections and plugin registration stay) while
        # kube-scheduler allocates the claim from the published slice and binds the pod; then the
        # PF's link renegotiates to 10 Gbit/s, below the 15000 Mbit/s allocated: the node changed
        # between the allocation and kubelet's preparation, which no publishing can close.
        os.kill(kubelet.pid, signal.SIGSTOP)
        try:
            create_claim_pod(node, namespace, "dra-late")
            claim = wait_allocated(node.cp, namespace, "dra-late", 120)
            (result,) = allocation_of(claim)
            assert result["device"] == published[second.name]["name"], result
            node.sim.set_speed(1, 10000)
        finally:
            os.kill(kubelet.pid, signal.SIGCONT)

        # kubelet's NodePrepareResources got the agent's reason, and its event on the pod says it.
        reason = (
            f"PF {second.name} has 10000 of 10000 Mbit/s unreserved, this claim was allocated 15000 "
            "there (the node changed since the allocation): nothing prepared"
        )

        def refused() -> list[str] | None:
            seen = [e for e in pods.events(node, namespace, "dra-late") if reason in e]
            return seen or None

        (event, *_) = wait_for(refused, 120, "kubelet's event with the agent's reason")
        claim_name = claim["metadata"]["name"]
        assert event.startswith("FailedPrepareDynamicResources: "), event
        assert f"rdma-cni: claim {namespace}/{claim_name}: {reason}" in event, event
        print(f"kubelet's event: {event}")
        # Nothing behind: no preparation, no sandbox (so no ADD: no record, VF, rate or lease).
        assert preparations() == {}
        assert held(node) == {} and node.vfs_home() == before["vfs home"]
        pod = node.pod(namespace, "dra-late")
        assert pod is not None and pod["status"]["phase"] == "Pending", pod
        assert not node.containerd.crictl_json("pods", "--namespace", namespace)["items"]
        assert f"DRA: claim {namespace}/{claim_name} (uid {claim['metadata']['uid']}) not prepared" in (
            node.agent_log()
        )

        # Deleted while refused (kubelet retries the preparation until then): still nothing.
        pods.delete(node, namespace, "dra-late")
        pods.wait_gone(node, namespace, ["dra-late"])
        wait_at_rest(node)
        assert preparations() == {}
    finally:
        # The link as it was, published again, so the next test's scheduler sees the whole PF.
        node.sim.set_speed(1, speed)
        wait_for(
            lambda: (
                devices(node.cp, node.name)
                .get(second.name, {})
                .get("capacity", {})
                .get("bandwidth", {})
                .get("value")
                in ("100k", "100000")
            ),
            120,
            "the PF's bandwidth published again",
        )


def answered(recorder: drawire.Recorder, method: str) -> bool:
    return any(
        c.method == drawire.DRA + method and (c.answer is not None or c.code != "OK")
        for c in list(recorder.calls)
    )


def save_recording(node: Node, recorder: drawire.Recorder, claim_object: dict[str, Any]) -> None:
    """The recorded calls are kubelet's for this pod's claim; written to ``RDMA_CNI_RECORD_DRA_WIRE``.

    With them, the claim and its allocation as kube-apiserver has them (``api``): what the unit
    tier checks the plugin's reading of the bytes and its answer against, known without them.
    """
    meta = claim_object["metadata"]
    claim = (meta["namespace"], meta["uid"], meta["name"])
    # The preparation is gone before the plugin answers: wait for the answer to be recorded too.
    wait_for(lambda: answered(recorder, "NodeUnprepareResources"), 60, "NodeUnprepareResources answered")
    calls = list(recorder.calls)
    by_method = {c.method: c for c in calls}
    assert reg_pb.RegistrationStatus.FromString(
        by_method[drawire.REGISTRATION + "NotifyRegistrationStatus"].request
    ).plugin_registered, calls
    for method, message in (
        ("NodePrepareResources", dra_pb.NodePrepareResourcesRequest),
        ("NodeUnprepareResources", dra_pb.NodeUnprepareResourcesRequest),
    ):
        for call in (c for c in calls if c.method == drawire.DRA + method):
            sent = message.FromString(call.request)
            assert [(c.namespace, c.uid, c.name) for c in sent.claims] == [claim], (method, sent)
    kubelet = node.bins["kubelet"].version
    provenance = {
        "kubelet": kubelet,
        "containerd": node.bins["containerd"].version,
        "recorded": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "how": (
            "make node's tests/node/test_dra.py with RDMA_CNI_RECORD_DRA_WIRE set to this file: "
            "tests/support/drawire.py's Recorder served the paths kubelet dials (the agent's "
            "registration socket's name in kubelet's plugin registry, the endpoint the agent's "
            "GetInfo names) and passed every call's bytes on to the agent's DRA plugin unchanged; "
            "one pod with one ResourceClaim, created and deleted"
        ),
        "normalized": (
            "nothing of the bytes: request and answer are as they crossed the sockets (the claim's "
            "namespace, uid and name, the node's name and the socket paths are that run's); "
            "timeout is the deadline left when the call arrived, rounded up to whole seconds"
        ),
    }
    api = {
        "claims": [dict(zip(("namespace", "uid", "name"), claim, strict=True))],
        "allocation": [
            {k: r.get(k, "") for k in ("request", "pool", "device", "shareID")}
            for r in allocation_of(claim_object)
        ],
    }
    source = (
        f"recorded from the real kubelet {kubelet} (containerd {provenance['containerd']}) by the node tier"
    )
    with open(RECORD, "w") as f:
        f.write(recorder.to_json(source, provenance, api))
