"""conf/ as shipped: what an operator gets from `kubectl apply -f conf/...` without editing a line.

Each test is one property the manifests must keep: the DaemonSet can start on its read-only
root; no variant of the extender can stop the cluster's scheduling (modelled on how
kube-scheduler decides which pods a profile sees and which pods an extender is asked about);
the flags docs/deploy.md says to set are set, consistently with the sample network; versions,
requests and limits agree with what docs/performance.md measured; every file a comment names
exists; one ClusterRole per component.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rdma_cni.agent import capacity
from rdma_cni.cni.errors import InvalidPodRequest
from rdma_cni.extender import declared
from rdma_cni.extender.demand import Demands
from rdma_cni.extender.options import parser as extender_parser
from rdma_cni.extender.options import settings as extender_settings
from rdma_cni.install import command as install_command
from rdma_cni.shared import dra, nodestate
from rdma_cni.shared.dra import claims as dra_claims
from rdma_cni.shared.podrequest import parse_request
from tests.support import sched_objects as so

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
DOCS = ROOT / "docs"
SIDECAR, MTLS, DEFAULT_CONFIG = (
    "base/extender/scheduler-extender.yaml",
    "base/extender-mtls/scheduler-extender-mtls.yaml",
    "kube-scheduler-default.yaml",
)
# The Kubernetes minor version conf/ is proven on (issue 31's cluster tier: v1.37.x).
KUBERNETES_MINOR = 37
# The extended resources a node agent advertises for a node whose PFs' capacities are known.
ADVERTISED = set(capacity.resources(so.state([("ens1f0", 40_000, 4)])))


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((CONF / name).read_text()) if d]


def one(name: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs(name) if d["kind"] == kind]
    return doc


def pod_spec(name: str, kind: str = "Deployment") -> dict[str, Any]:
    return one(name, kind)["spec"]["template"]["spec"]


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in spec["containers"] if c["name"] == name]
    return found


def extender_args(name: str) -> Any:
    command = container(pod_spec(name), "extender")["command"]
    assert command[:2] == ["/usr/local/bin/rdma-cni", "scheduler-extender"]
    return extender_parser().parse_args(command[2:])


def scheduler_configs() -> dict[str, dict[str, Any]]:
    """Each KubeSchedulerConfiguration of conf/, by the file the extender it calls is in."""
    (configmap,) = [d for d in docs(SIDECAR) if d["kind"] == "ConfigMap"]
    return {SIDECAR: yaml.safe_load(configmap["data"]["config.yaml"]), MTLS: docs(DEFAULT_CONFIG)[0]}


# -- kube-scheduler's dispatch, as it decides it


def profile_of(config: dict[str, Any], pod: dict[str, Any]) -> str | None:
    """The profile of this scheduler that schedules ``pod``, or None if another scheduler does."""
    wanted = pod["spec"].get("schedulerName") or "default-scheduler"
    return wanted if wanted in [p["schedulerName"] for p in config["profiles"]] else None


def requested_resources(pod: dict[str, Any]) -> set[str]:
    spec = pod["spec"]
    return {
        name
        for c in [*spec.get("containers", []), *spec.get("initContainers", [])]
        for part in ("requests", "limits")
        for name in (c.get("resources") or {}).get(part, {})
    }


def extender_asked(config: dict[str, Any], pod: dict[str, Any]) -> bool:
    """Whether scheduling ``pod`` calls this configuration's extender (HTTPExtender.IsInterested:
    every pod without managedResources, else only pods requesting one, in requests or limits)."""
    if profile_of(config, pod) is None:
        return False
    (ext,) = config["extenders"]
    managed = {r["name"] for r in ext.get("managedResources") or []}
    return not managed or bool(managed & requested_resources(pod))


def as_pod(spec: dict[str, Any]) -> dict[str, Any]:
    return {"spec": spec}


def other_pods() -> dict[str, dict[str, Any]]:
    """Pods that are not RDMA pods: conf/'s own workloads and a plain pod."""
    return {
        "daemonset": as_pod(pod_spec("base/node/daemonset.yaml", "DaemonSet")),
        SIDECAR: as_pod(pod_spec(SIDECAR)),
        MTLS: as_pod(pod_spec(MTLS)),
        "plain": as_pod({"containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}]}),
    }


def rdma_pod_for(variant: str) -> dict[str, Any]:
    """conf/pod.yaml as docs/deploy.md says to run it under each variant (mutual TLS: no schedulerName;
    its declared resources are what route it)."""
    pod = one("pod.yaml", "Pod")
    if variant == MTLS:
        pod = {**pod, "spec": {k: v for k, v in pod["spec"].items() if k != "schedulerName"}}
    return pod


# -- 2. the DaemonSet starts as shipped


def test_daemonset_unpacks_into_a_writable_volume() -> None:
    """A read-only root needs RDMA_CNI_CACHE_DIR on a writable, non-host volume (the launcher would
    fall back to /tmp/rdma-cni-0 anyway; the manifest says where, as its comment promises)."""
    spec = pod_spec("base/node/daemonset.yaml", "DaemonSet")
    (agent,) = spec["containers"]
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e.get("value") for e in agent["env"]}
    cache = env.get("RDMA_CNI_CACHE_DIR")
    assert cache, "no RDMA_CNI_CACHE_DIR: the launcher would try the read-only /var/cache/rdma-cni"
    volumes = {v["name"]: v for v in spec["volumes"]}
    writable = [
        m
        for m in agent["volumeMounts"]
        if not m.get("readOnly")
        and "emptyDir" in volumes[m["name"]]
        and cache.startswith(m["mountPath"] + "/")
    ]
    assert writable, f"{cache} is on no writable emptyDir of the pod"
    size = volumes[writable[0]["name"]]["emptyDir"].get("sizeLimit", "")
    assert not size or int(size.removesuffix("Mi")) >= 128  # one unpacked tree is ~41 MB


# -- 3. no variant can stop the cluster's scheduling


@pytest.mark.parametrize("variant", [SIDECAR, MTLS])
def test_each_extender_sees_only_the_pods_it_serves(variant: str) -> None:
    config = scheduler_configs()[variant]
    assert extender_asked(config, rdma_pod_for(variant))
    asked = [name for name, pod in other_pods().items() if extender_asked(config, pod)]
    assert asked == [], f"{variant}'s extender is asked about {asked}"


@pytest.mark.parametrize("variant", [SIDECAR, MTLS])
def test_the_extenders_own_pod_never_depends_on_it(variant: str) -> None:
    """Recreate puts a new extender pod up while the old one is gone: no extender may be asked about it."""
    own = as_pod(pod_spec(variant))
    assert all(not extender_asked(config, own) for config in scheduler_configs().values())
    assert one(variant, "Deployment")["spec"]["strategy"]["type"] == "Recreate"


def test_a_dead_extender_leaves_other_pods_schedulable() -> None:
    """Where a configuration serves the cluster's default profile, its extender manages a resource,
    so a pod without it never waits for the extender; elsewhere only opted-in pods reach it."""
    for variant, config in scheduler_configs().items():
        (ext,) = config["extenders"]
        assert ext["ignorable"] is False, variant  # RDMA pods are never placed blind
        if "default-scheduler" in [p["schedulerName"] for p in config["profiles"]]:
            managed = ext.get("managedResources") or []
            assert managed, f"{variant}: every pod of the cluster would wait for the extender"


def test_the_managed_resources_are_the_ones_nodes_advertise() -> None:
    """One name per concept: the mutual-TLS variant routes pods by the resources the node agents
    advertise (agent/capacity) and pods declare (extender/declared), counted by kube-scheduler.
    A resource no node advertises would need ignoredByScheduler and would count nothing."""
    (ext,) = scheduler_configs()[MTLS]["extenders"]
    managed = {r["name"]: r for r in ext["managedResources"]}
    assert ext["managedResources"][0]["name"] == nodestate.VF_RESOURCE  # the one its reasons name
    assert set(managed) == ADVERTISED
    for name, resource in managed.items():
        # Nodes advertise it: kube-scheduler's fit check and preemption must count it.
        assert resource.get("ignoredByScheduler") is False, name


def test_every_rdma_cni_io_name_in_conf_and_docs_is_one_the_code_defines() -> None:
    """A second name for a concept (the mutual-TLS variant once routed by rdma-cni.io/interfaces,
    which no node advertises) fails here."""
    # DRA's: the driver's attributes as a claim's constraints qualify them, and its configuration's
    # apiVersion (shared/dra).
    attributes = (dra.ATTR_NETWORK, dra.ATTR_PF, dra.ATTR_RAIL, dra.ATTR_LINK_SPEED, dra.ATTR_MAX_TX_RATE)
    qualified = {f"{dra.DRIVER}/{name}" for name in attributes}
    known = {nodestate.ANNOTATION, *ADVERTISED, *qualified, dra_claims.CONFIG_API_VERSION}
    files = [*sorted(CONF.rglob("*.yaml")), *sorted(DOCS.glob("*.md")), ROOT / "README.md"]
    unknown = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        for name in re.findall(r"rdma-cni\.io/[a-z0-9.-]*[a-z0-9]", path.read_text())
        if name not in known
    }
    assert unknown == set(), sorted(unknown)


def test_deploy_md_says_how_rdma_pods_reach_each_variant() -> None:
    text = (DOCS / "deploy.md").read_text()
    (ext,) = scheduler_configs()[MTLS]["extenders"]
    for resource in ext["managedResources"]:
        assert f"`{resource['name']}`" in text, resource
    assert "ignoredByScheduler: false" in text
    assert "drop the `schedulerName` line" in text
    assert "schedulerName: rdma-scheduler" in text
    assert "a dead extender" in text.lower() or "extender is down" in text.lower()


def _demands(variant: str) -> Demands:
    """How that variant's extender, with its Deployment's flags, reads a pod."""
    command = container(pod_spec(variant), "extender")["command"]
    s = extender_settings(command[2:])
    return Demands(annotation=s.annotation, networks=s.networks, default_request=s.default_request)


@pytest.mark.parametrize("variant", [SIDECAR, MTLS])
def test_the_sample_pod_declares_exactly_what_it_asks(variant: str) -> None:
    """conf/pod.yaml declares its RDMA request as the resources nodes advertise, exactly as the
    shipped extender reads the request (declared.check), so kube-scheduler counts what it holds."""
    pod = rdma_pod_for(variant)
    demand = _demands(variant).of_pod(pod)  # runs declared.check: InvalidPodRequest if it differs
    assert demand is not None
    declared.check(pod, demand, "conf/pod.yaml")
    vfs, bandwidth = nodestate.VF_RESOURCE, nodestate.BANDWIDTH_RESOURCE
    got = declared.declared(pod, "conf/pod.yaml")
    assert got == {vfs: len(demand.requests), bandwidth: demand.min_total} == {vfs: 3, bandwidth: 20_000}
    for c in pod["spec"]["containers"]:  # extended resources: the API server wants limits == requests
        res = c["resources"]
        assert {k: res["limits"][k] for k in ADVERTISED} == {k: res["requests"][k] for k in ADVERTISED}
    # The check is live: a sample that drifted from its annotation by 1 Mbit/s is refused.
    drifted = copy.deepcopy(pod)
    for part in ("requests", "limits"):
        drifted["spec"]["containers"][0]["resources"][part][bandwidth] = "19999"
    with pytest.raises(InvalidPodRequest, match=re.escape(f"requests 19999 as {bandwidth}")):
        _demands(variant).of_pod(drifted)


# -- 4. defaults right as shipped


@pytest.mark.parametrize("variant", [SIDECAR, MTLS])
def test_extender_networks_agree_with_the_sample_network(variant: str) -> None:
    nad = one("network-attachment-definition.yaml", "NetworkAttachmentDefinition")
    config = yaml.safe_load(nad["spec"]["config"])
    args = extender_args(variant)
    ours = set(args.networks)  # the extender's parser splits the list
    meta = nad["metadata"]
    assert f"{meta['namespace']}/{meta['name']}" in ours or meta["name"] in ours
    expected = parse_request(config["defaultRequest"], "nad")
    assert args.default_request == expected
    assert args.annotation == config["annotation"]


@pytest.mark.parametrize("variant", [SIDECAR, MTLS])
def test_max_state_age_is_set_as_docs_say(variant: str) -> None:
    text = (DOCS / "deploy.md").read_text()
    m = re.search(r"`--max-state-age` is off by default\..*?\(for example (\d+)[,)]", text, re.S)
    assert m, "docs/deploy.md no longer says what to set --max-state-age to"
    heartbeat = install_command._parser().parse_args(["--watch"]).node_state_heartbeat
    age = extender_args(variant).max_state_age
    assert age == float(m.group(1)) and age >= 2 * heartbeat


def test_sidecar_kube_scheduler_is_within_the_supported_skew() -> None:
    image = container(pod_spec(SIDECAR), "kube-scheduler")["image"]
    m = re.fullmatch(r"registry\.k8s\.io/kube-scheduler:v1\.(\d+)\.(\d+)", image)
    assert m and int(m.group(1)) == KUBERNETES_MINOR, image


def _mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", quantity)
    assert m, quantity
    return int(m.group(1)) * units[m.group(2)]


def test_every_container_requests_cpu_and_memory() -> None:
    for name, kind in [
        ("base/node/daemonset.yaml", "DaemonSet"),
        (SIDECAR, "Deployment"),
        (MTLS, "Deployment"),
    ]:
        for c in pod_spec(name, kind)["containers"]:
            requests = c.get("resources", {}).get("requests", {})
            assert {"cpu", "memory"} <= set(requests), f"{name}: {c['name']} requests {requests}"


def _measured(pattern: str) -> float:
    m = re.search(pattern, (DOCS / "performance.md").read_text(), re.S)
    assert m, f"docs/performance.md no longer holds {pattern}"
    return float(m.group(1).replace(",", ""))


def test_requests_and_limits_match_the_measured_figures() -> None:
    """Requests cover what docs/performance.md measured in normal use, limits the measured peaks."""
    agent = container(pod_spec("base/node/daemonset.yaml", "DaemonSet"), "install")["resources"]
    agent_mb = _measured(r"The node agent \(the installer with the agent, built binary\) uses (\d+) MB")
    assert _mebibytes(agent["requests"]["memory"]) >= agent_mb
    assert _mebibytes(agent["limits"]["memory"]) >= 2 * agent_mb
    # The extender: RSS with the 5,000-node cache; the peak under maximum-size hostile bodies.
    cache_mib = _measured(r"\| cache \(NodeNames\) \| 5,000 \| 5,000 \|(?:[^|\n]*\|){11} (\d+) \|")
    peak_mib = _measured(r"peak RSS (\d+) MiB\s+under the Deployment's")
    for variant in (SIDECAR, MTLS):
        res = container(pod_spec(variant), "extender")["resources"]
        assert _mebibytes(res["requests"]["memory"]) >= cache_mib, variant
        assert _mebibytes(res["limits"]["memory"]) >= peak_mib, variant


_FILE = re.compile(r"(?:conf/)?\b([\w.-]+\.(?:yaml|conflist|json))\b")


@pytest.mark.parametrize("name", sorted(str(p.relative_to(CONF)) for p in CONF.rglob("*") if p.is_file()))
def test_every_file_a_conf_file_names_exists(name: str) -> None:
    comments = "\n".join(
        line.split("#", 1)[1] for line in (CONF / name).read_text().splitlines() if "#" in line
    )
    named = {m.group(1) for m in _FILE.finditer(comments)}
    # Files that are not conf/'s: kubeadm's kubeconfig, Multus' manifest, the installed conflist.
    elsewhere = {"scheduler.conf", "multus-daemonset-thick.yml", "99-rdma-cni.conflist", "rdma-net.conflist"}
    missing = sorted(n for n in named - elsewhere if not any(CONF.rglob(n)))
    assert missing == [], f"conf/{name} names {missing}"


def test_one_cluster_role_per_component() -> None:
    """No two files (or variants) define the same ClusterRole: applying one never rewrites another's."""
    defined: dict[str, str] = {}
    for path in sorted([*CONF.glob("*.yaml"), *CONF.glob("base/*/*.yaml")]):
        for doc in docs(str(path.relative_to(CONF))):
            if doc.get("kind") in ("ClusterRole", "ClusterRoleBinding"):
                key = f"{doc['kind']}/{doc['metadata']['name']}"
                assert key not in defined, f"{key} in {defined.get(key)} and {path}"
                defined[key] = str(path)
    roles = sorted(k.split("/", 1)[1] for k in defined if k.startswith("ClusterRole/"))
    # the agent, its DRA rights (conf/dra.yaml, applied only with DRA networks), the extender
    assert roles == ["rdma-cni", "rdma-cni-dra", "rdma-cni-scheduler-extender"]
