"""The deployment files in conf/, checked offline against Kubernetes' schemas and the plugin's own parsers."""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import string
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from rdma_cni.agent import cniserver
from rdma_cni.agent.dra import kubelet
from rdma_cni.agent.nri import plugin as nri_plugin
from rdma_cni.cni.config import DEFAULT_LOCK_FILE, DEFAULT_STATE_DIR, load_netconf
from rdma_cni.cni.errors import InvalidConfig, InvalidPodRequest, UnsupportedField
from rdma_cni.install import command as install_command
from rdma_cni.install import common, kubeconfig, netconf
from rdma_cni.install.uninstall import DEFAULT_LOG_FILE
from rdma_cni.kube import credentials
from rdma_cni.shared.nodestate import ANNOTATION, BANDWIDTH_RESOURCE, VF_RESOURCE
from rdma_cni.shared.podrequest import parse_request

CONF = Path(__file__).resolve().parents[2] / "conf"

# The oldest Kubernetes these manifests promise to work on, and the newest
# schemas the installed kubernetes-validate ships.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())

MANIFESTS = (
    "base/node/daemonset.yaml",
    "base/node/rbac.yaml",
    "pod.yaml",
    "network-attachment-definition.yaml",
    "base/node/metrics.yaml",
)
# conf/'s files by path below it; a directory whose files are checked by a test of its own is one entry.
EXPECTED_FILES = {
    *MANIFESTS,
    "rdma-cni.conflist",
    "kubeconfig.template.json",
    # The kustomizations (the node side's base and each variant's), with overlays/ and components/:
    # checked in test_conf_kustomize.py.
    "kustomization.yaml",
    "base/node/kustomization.yaml",
    "base/extender/kustomization.yaml",
    "base/extender-mtls/kustomization.yaml",
    "overlays",
    "components",
    "Containerfile",
    # Checked in test_conf_scheduler.py:
    "base/extender/scheduler-extender.yaml",
    "base/extender-mtls/scheduler-extender-mtls.yaml",
    "kube-scheduler-default.yaml",
    # conf/monitoring/prometheus-rules.yaml, checked in test_conf_monitoring.py.
    "monitoring",
    # Served and checked by the real API server in tests/cluster (test_conf_applies.py):
    "network-attachment-definition-crd.yaml",
    # The node's boot unit for sriov_numvfs, checked in test_conf_node.py.
    "node",
    # DRA (resource.k8s.io/v1, Kubernetes 1.34+): checked in test_conf_dra below and applied in tests/cluster.
    "dra.yaml",
}
WHOLE_DIRS = {"overlays", "components", "monitoring", "node"}

NAD_API_VERSION = "k8s.cni.cncf.io/v1"
NAD_KIND = "NetworkAttachmentDefinition"

FAKE_CA = b"-----BEGIN CERTIFICATE-----\nMIIBfakefakefake\n-----END CERTIFICATE-----\n"


def load_docs(name: str) -> list[dict[str, Any]]:
    """Every non-empty YAML document in conf/<name>."""
    with open(CONF / name, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def all_docs() -> Iterator[tuple[str, dict[str, Any]]]:
    for name in MANIFESTS:
        for doc in load_docs(name):
            yield name, doc


def one(name: str, kind: str) -> dict[str, Any]:
    found = [doc for doc in load_docs(name) if doc.get("kind") == kind]
    assert len(found) == 1, f"{name}: expected one {kind}, found {len(found)}"
    return found[0]


def validate_k8s(doc: dict[str, Any], version: str) -> None:
    """Strict schema validation; raises kubernetes_validate.ValidationError on a bad manifest."""
    kubernetes_validate.validate(doc, version, strict=True)


def validate_nad(doc: dict[str, Any]) -> dict[str, Any]:
    """Check a NetworkAttachmentDefinition's shape and return its decoded spec.config.

    Its CRD is not among the core schemas, so this follows the CRD by hand:
    only metadata and spec.config (a JSON string) are expected.
    """
    assert doc.get("apiVersion") == NAD_API_VERSION
    assert doc.get("kind") == NAD_KIND
    assert set(doc) <= {"apiVersion", "kind", "metadata", "spec"}, sorted(doc)
    metadata = doc.get("metadata")
    assert isinstance(metadata, dict) and isinstance(metadata.get("name"), str) and metadata["name"]
    spec = doc.get("spec")
    assert isinstance(spec, dict) and set(spec) == {"config"}, spec
    assert isinstance(spec["config"], str)
    config = json.loads(spec["config"])
    assert isinstance(config, dict)
    return config


# --------------------------------------------------------------------------
# Coverage of the directory


def test_conf_holds_exactly_the_checked_files() -> None:
    # A new file must get a test here; a missing one is a packaging mistake.
    found = {
        p.relative_to(CONF).parts[0]
        if p.relative_to(CONF).parts[0] in WHOLE_DIRS
        else p.relative_to(CONF).as_posix()
        for p in CONF.rglob("*")
        if p.is_file()
    }
    assert found == EXPECTED_FILES


# --------------------------------------------------------------------------
# Kubernetes schemas


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", [m for m in MANIFESTS if m != "network-attachment-definition.yaml"])
def test_manifest_validates_strictly(name: str, version: str) -> None:
    docs = load_docs(name)
    assert docs
    for doc in docs:
        validate_k8s(doc, version)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        # A misspelled field is only caught by strict validation.
        (("spec", "template", "spec", "serviceAcountName"), "rdma-cni"),
        (("spec", "template", "spec", "containers", 0, "readinessProbe", "periodSeconds"), "ten"),
        (("spec", "template", "spec", "tolerations", 0, "operatr"), "Exists"),
    ],
)
def test_broken_daemonset_fails_validation(path: tuple[str | int, ...], value: Any) -> None:
    doc = copy.deepcopy(one("base/node/daemonset.yaml", "DaemonSet"))
    node: Any = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(doc, K8S_VERSIONS[0])


def test_broken_pod_fails_validation() -> None:
    doc = copy.deepcopy(one("pod.yaml", "Pod"))
    doc["spec"]["containers"][0]["securityContext"] = {"capabilities": {"add": "IPC_LOCK"}}  # not a list
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(doc, K8S_VERSIONS[0])


# --------------------------------------------------------------------------
# The network configurations against the plugin's parser


def test_nad_structure_and_config() -> None:
    nad = one("network-attachment-definition.yaml", NAD_KIND)
    config = validate_nad(nad)
    conf = load_netconf(config)
    assert conf.type == "rdma-cni"
    assert conf.name == nad["metadata"]["name"]
    assert conf.kubeconfig == common.DEFAULT_KUBECONFIG_PATH
    assert conf.annotation == "rdma_interfaces_required"
    assert conf.ipam is not None and conf.ipam.type == "host-local"


def test_broken_nad_is_rejected() -> None:
    nad = one("network-attachment-definition.yaml", NAD_KIND)
    config = json.loads(nad["spec"]["config"])

    misspelled = dict(config)
    misspelled["rdmaIsolaton"] = misspelled.pop("rdmaIsolation")
    with pytest.raises(UnsupportedField):
        load_netconf(misspelled)

    bad_value = dict(config, rdmaIsolation="sometimes")
    with pytest.raises(InvalidConfig):
        load_netconf(bad_value)

    no_config = copy.deepcopy(nad)
    no_config["spec"] = {"conifg": nad["spec"]["config"]}
    with pytest.raises(AssertionError):
        validate_nad(no_config)


def test_conflist_plugin_entry_loads() -> None:
    with open(CONF / "rdma-cni.conflist", encoding="utf-8") as f:
        conflist = json.load(f)
    assert conflist["cniVersion"] == "1.0.0"
    assert conflist["name"] == "rdma-net"
    (entry,) = conflist["plugins"]
    assert entry["type"] == "rdma-cni"
    # A runtime hands each plugin its entry with the list's version and name inserted.
    conf = load_netconf({**entry, "cniVersion": conflist["cniVersion"], "name": conflist["name"]})
    assert conf.kubeconfig == common.DEFAULT_KUBECONFIG_PATH
    assert conf.ipam is not None and conf.ipam.type == "host-local"
    # containerd passes the pod's annotations only to entries that declare this.
    assert entry["capabilities"] == {"io.kubernetes.cri.pod-annotations": True}


def test_builtin_default_conf_matches_conflist_file() -> None:
    with open(CONF / "rdma-cni.conflist", encoding="utf-8") as f:
        assert json.load(f) == netconf.default_conflist()


def test_nad_and_conflist_agree() -> None:
    nad_config = json.loads(one("network-attachment-definition.yaml", NAD_KIND)["spec"]["config"])
    with open(CONF / "rdma-cni.conflist", encoding="utf-8") as f:
        (entry,) = json.load(f)["plugins"]
    for key in ("type", "kubeconfig", "annotation", "ipam", "rdmaIsolation"):
        assert nad_config[key] == entry[key], key


# --------------------------------------------------------------------------
# The pod


def test_pod_request_parses() -> None:
    pod = one("pod.yaml", "Pod")
    annotations = pod["metadata"]["annotations"]
    request = parse_request(annotations["rdma_interfaces_required"], "conf/pod.yaml")
    rates = [(i.min_tx_rate, i.max_tx_rate) for i in request.interfaces]
    assert rates == [(15000, 20000), (5000, 0), (0, 0)]
    nad = one("network-attachment-definition.yaml", NAD_KIND)
    assert annotations["k8s.v1.cni.cncf.io/networks"] == nad["metadata"]["name"]
    assert pod["metadata"]["namespace"] == nad["metadata"]["namespace"]


def test_broken_pod_request_is_rejected() -> None:
    with pytest.raises(InvalidPodRequest):
        parse_request('[{"min_tx_rate": 15000, "max_tx_rat": 20000}]', "mutated")


def test_pod_works_with_nri_and_rdma_scheduler() -> None:
    """The sample pod needs what rdma-cni gives it and nothing else: no device plugin, no IPC_LOCK."""
    pod = one("pod.yaml", "Pod")
    assert pod["spec"]["schedulerName"] == "rdma-scheduler"
    for container in pod["spec"]["containers"]:
        # The NRI plugin injects the VFs' device nodes and an unlimited memlock limit.
        assert "IPC_LOCK" not in str(container.get("securityContext", {}))
        resources = container.get("resources", {})
        named = {*resources.get("requests", {}), *resources.get("limits", {})}
        # No device-plugin resource; the RDMA resources it declares are rdma-cni's own, which the
        # node agents advertise (test_conf_shipped.py checks their values).
        ours = {VF_RESOURCE, BANDWIDTH_RESOURCE}
        assert named - ours <= {"cpu", "memory", "ephemeral-storage"}, named
    ds = one("base/node/daemonset.yaml", "DaemonSet")
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    memlock = [a.split("=", 1)[1] for a in agent["command"] if a.startswith("--memlock")]
    assert memlock in ([], ["unlimited"])  # the default, unlimited, is what lets IPC_LOCK go
    assert "--nri-socket=" not in agent["command"]  # NRI on: it is what injects the devices


# --------------------------------------------------------------------------
# DaemonSet and RBAC semantics the schemas cannot see


def test_daemonset_installs_the_shim_and_runs_the_verbs() -> None:
    ds = one("base/node/daemonset.yaml", "DaemonSet")
    assert ds["metadata"]["namespace"] == "kube-system"
    spec = ds["spec"]["template"]["spec"]
    sa = one("base/node/rbac.yaml", "ServiceAccount")
    assert spec["serviceAccountName"] == sa["metadata"]["name"]
    assert ds["metadata"]["namespace"] == sa["metadata"]["namespace"]
    assert {"operator": "Exists"} in spec["tolerations"]
    # The node agent reads the host's PFs (sysfs net class, netlink): host network, nothing more.
    assert spec.get("hostNetwork") is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert not spec.get("hostPID") and not spec.get("hostIPC")
    (container,) = spec["containers"]
    assert container["command"][:3] == ["/usr/local/bin/rdma-cni", "install", "--watch"]
    # The shim in /opt/cni/bin; the verbs run in this container, which therefore is privileged.
    assert "--mode=shim" in container["command"]
    assert container["securityContext"].get("privileged") is True
    assert "allowPrivilegeEscalation" not in container["securityContext"]  # refused with privileged
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert "readinessProbe" in container

    # Host directories are mounted at their own paths, so the installer's
    # defaults are the host paths the plugin and the runtime use.
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    # The logFile that conf/'s network and the installer's default configuration name: only its
    # directory is mounted (not the host's whole /var/log), and it is one of rdma-cni's own.
    nad_config = validate_nad(one("network-attachment-definition.yaml", NAD_KIND))
    log_files = {nad_config["logFile"], netconf.default_conflist()["plugins"][0]["logFile"]}
    (log_file,) = log_files
    log_dir = os.path.dirname(log_file)
    assert log_dir == "/var/log/rdma-cni" and log_file == DEFAULT_LOG_FILE
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert sorted(host_paths.values()) == sorted(
        [
            common.DEFAULT_CNI_BIN_DIR,
            common.DEFAULT_CNI_CONF_DIR,
            DEFAULT_STATE_DIR,
            os.path.dirname(DEFAULT_LOCK_FILE),
            # What the plugin's verbs write: host-local's allocations, the log's own directory.
            "/var/lib/cni/networks",
            log_dir,
            # The NRI plugin: the runtime's socket, and the pods' namespaces to prove their VFs.
            os.path.dirname(nri_plugin.DEFAULT_SOCKET),
            "/var/run/netns",
            # The DRA kubelet plugin's registry and own directory (the installer's defaults).
            kubelet.DEFAULT_REGISTRY_DIR,
            kubelet.DEFAULT_PLUGIN_DIR,
        ]
    )
    for volume, host_path in host_paths.items():
        assert mounts[volume] == host_path
    # The installer's defaults for them are the plugin's (written out there: install never loads grpc).
    defaults = vars(install_command._parser().parse_args([]))
    assert (defaults["kubelet_registry_dir"], defaults["kubelet_plugin_dir"]) == (
        kubelet.DEFAULT_REGISTRY_DIR,
        kubelet.DEFAULT_PLUGIN_DIR,
    )
    # The lock directory holds the node lock, the shim's socket and its DEL spool.
    assert os.path.dirname(DEFAULT_LOCK_FILE) == os.path.dirname(os.path.dirname(cniserver.DEFAULT_SOCKET))
    read_only = {m["mountPath"] for m in container["volumeMounts"] if m.get("readOnly")}
    assert read_only == {"/var/run/netns"}

    # The node agent is on, and names its Node from the downward API.
    assert "--node-state" in container["command"]
    (node_name,) = [e for e in container["env"] if e["name"] == "NODE_NAME"]
    assert node_name["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert common.DEFAULT_KUBECONFIG_PATH.startswith(common.DEFAULT_CNI_CONF_DIR + "/")

    # The ready file the probe looks for is the one the installer is told to write.
    ready = [a.split("=", 1)[1] for a in container["command"] if a.startswith("--ready-file=")]
    assert ready and ready[0] in container["readinessProbe"]["exec"]["command"]


def test_daemonset_liveness_reads_the_file_the_agent_keeps_fresh(tmp_path: Path) -> None:
    """The liveness and startup probes pass on a live file touched now and fail on one 2 minutes old.

    The agent touches ``--live-file`` every ``--interval`` while its parts run
    (tests/unit/test_install.py); the probes run the manifest's own command, with the image's sh and find.
    """
    import subprocess

    spec = one("base/node/daemonset.yaml", "DaemonSet")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    (live,) = [a.split("=", 1)[1] for a in container["command"] if a.startswith("--live-file=")]
    assert "--watch" in container["command"] and not any(
        a.startswith("--interval") for a in container["command"]
    )
    assert common.DEFAULT_INTERVAL <= 10
    liveness, startup = container["livenessProbe"], container["startupProbe"]
    assert liveness["exec"] == startup["exec"]
    command = liveness["exec"]["command"]
    assert live in command[-1] and "-mmin -1" in command[-1]
    # A tick is --interval plus one API call (10 s at most): well inside 60 s. The startup probe
    # covers the CNI server's release of an earlier boot's records (one verb timeout) before the first tick.
    from rdma_cni.agent.cniserver import VERB_TIMEOUT

    assert startup["periodSeconds"] * startup["failureThreshold"] > VERB_TIMEOUT + 60
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60
    # The image mounts /tmp as an emptyDir: the file lives in the pod, not on the host.
    assert os.path.dirname(live) == "/tmp"

    path = tmp_path / "live"
    probe = [*command[:-1], command[-1].replace(live, str(path))]
    # The image's tools (debian:12-slim: dash, GNU find), and busybox's (the tiers' stand-in base).
    shells = [dict(os.environ)]
    busybox = shutil.which("busybox")
    if busybox:
        applets = tmp_path / "busybox"
        applets.mkdir()
        for name in ("sh", "find", "test"):
            (applets / name).symlink_to(busybox)
        shells.append({**os.environ, "PATH": str(applets)})
    for env in shells:
        path.unlink(missing_ok=True)
        assert subprocess.run(probe, env=env, check=False).returncode != 0  # missing
        path.write_text("live\n")
        assert subprocess.run(probe, env=env, check=False).returncode == 0
        stale = time.time() - 70
        os.utime(path, (stale, stale))
        assert subprocess.run(probe, env=env, check=False).returncode != 0


def test_daemonset_rolls_with_surge_and_gives_the_handover_its_time() -> None:
    ds = one("base/node/daemonset.yaml", "DaemonSet")
    # The new pod runs beside the old one until Ready: the node's token never dies first.
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    # On SIGTERM the CNI server hands its socket over, then lets the verbs under way finish.
    grace = ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > cniserver.HANDOVER_SECONDS + cniserver.DRAIN_SECONDS
    # Readiness is the ready file alone: nothing the old pod still holds (a port, a socket).
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["exec"]["command"][:2] == ["test", "-e"]
    assert "ports" not in container  # on the host network, a port is a hostPort: surge pods would not fit


def test_rbac_gets_pods_and_patches_nodes_only() -> None:
    (role,) = [
        d
        for d in load_docs("base/node/rbac.yaml")
        if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "rdma-cni"
    ]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
        # The node's RDMA resources in its status (rdma_cni/agent/capacity.py).
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
        # The agent's NodeStatePublishFailed Event (rdma_cni/kube/events.py posts core v1 Events).
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    ]
    binding = one("base/node/rbac.yaml", "ClusterRoleBinding")
    sa = one("base/node/rbac.yaml", "ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": sa["metadata"]["namespace"]}
    ]


def _metrics_service(component: str) -> dict[str, Any]:
    (service,) = [
        doc for doc in load_docs("base/node/metrics.yaml") if component in doc["spec"]["selector"].values()
    ]
    return service


@pytest.mark.parametrize(
    ("component", "manifest", "kind"),
    [
        ("rdma-cni", "base/node/daemonset.yaml", "DaemonSet"),
        ("rdma-cni-scheduler-extender", "base/extender/scheduler-extender.yaml", "Deployment"),  # the sidecar
        ("rdma-cni-scheduler-extender", "base/extender-mtls/scheduler-extender-mtls.yaml", "Deployment"),
    ],
)
def test_metrics_service_reaches_the_port_the_component_serves(
    component: str, manifest: str, kind: str
) -> None:
    from rdma_cni.extender.options import parser as extender_parser

    template = one(manifest, kind)["spec"]["template"]
    # The sidecar's pod holds kube-scheduler too: the container that runs rdma-cni.
    (container,) = [c for c in template["spec"]["containers"] if c["command"][0] == "/usr/local/bin/rdma-cni"]
    command = container["command"]
    # The port each component's own parser reads from its command line.
    if command[1] == "install":
        listen = install_command._parser().parse_args(command[2:]).metrics_listen
    else:
        listen = extender_parser().parse_args(command[2:]).metrics_listen
    assert listen is not None
    if template["spec"].get("hostNetwork"):
        # On the host's network 0.0.0.0 is every interface of the node: the node's own address only.
        assert listen[0] == "$(HOST_IP)"
        env = {
            e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]
        }
        assert env["HOST_IP"] == "status.hostIP"
    else:
        assert listen[0] == "0.0.0.0"  # the pod's own network namespace: its address and loopback
    if template["spec"].get("hostNetwork"):
        # A declared port on the host network is a hostPort, which would keep a surge pod off its node.
        assert "ports" not in container
        ports, target = {"metrics": listen[1]}, listen[1]
    else:
        ports, target = {p["name"]: p["containerPort"] for p in container["ports"]}, "metrics"
    service = _metrics_service(component)
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert service["metadata"]["namespace"] == one(manifest, kind)["metadata"]["namespace"]
    annotations = service["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"] == listen[1]
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": listen[1], "targetPort": target, "protocol": "TCP"}
    ]


def test_node_patches_are_confined_by_an_admission_policy() -> None:
    sa = one("base/node/rbac.yaml", "ServiceAccount")
    policy = one("base/node/rbac.yaml", "ValidatingAdmissionPolicy")
    binding = one("base/node/rbac.yaml", "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["nodes", "nodes/status"] and rule["operations"] == ["UPDATE"]
    user = f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
    (condition,) = spec["matchConditions"]
    assert f"'{user}'" in condition["expression"]
    text = " ".join(v["expression"] for v in spec["validations"] + spec["variables"])
    assert "authentication.kubernetes.io/node-name" in text
    assert text.count(f"'{ANNOTATION}'") == 2
    # In the status, the two resources kube-scheduler counts and nothing else (the cluster tier
    # checks that every other field of NodeStatus is held unchanged).
    resources = f"['{BANDWIDTH_RESOURCE}', '{VF_RESOURCE}']"
    assert resources in text and "request.subResource == 'status'" in text


# --------------------------------------------------------------------------
# Kubeconfig template and Containerfile


def _substituted_template(server: str, token: str) -> str:
    text = (CONF / "kubeconfig.template.json").read_text(encoding="utf-8")
    # substitute() fails on any placeholder left unfilled.
    return string.Template(text).substitute(
        RDMA_CNI_API_SERVER=server,
        RDMA_CNI_CA_DATA=base64.b64encode(FAKE_CA).decode("ascii"),
        RDMA_CNI_TOKEN=token,
    )


def test_kubeconfig_template_loads(tmp_path: Path) -> None:
    path = tmp_path / "rdma-cni.kubeconfig"
    path.write_text(_substituted_template("https://10.96.0.1:443", "abc.def-ghi"), encoding="utf-8")
    creds = credentials.load_credentials(str(path))
    assert creds.server == "https://10.96.0.1:443"
    assert creds.token == "abc.def-ghi"
    assert creds.ca_data == FAKE_CA


def test_kubeconfig_template_matches_installer_output(tmp_path: Path) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("abc.def-ghi\n")
    (sa / "ca.crt").write_bytes(FAKE_CA)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    rendered = json.loads(kubeconfig.render_kubeconfig(str(sa), env))
    assert json.loads(_substituted_template("https://10.96.0.1:443", "abc.def-ghi")) == rendered


def test_kubeconfig_template_placeholders_are_marked() -> None:
    text = (CONF / "kubeconfig.template.json").read_text(encoding="utf-8")
    names = {m.group("braced") for m in string.Template.pattern.finditer(text) if m.group("braced")}
    assert names == {"RDMA_CNI_API_SERVER", "RDMA_CNI_CA_DATA", "RDMA_CNI_TOKEN"}


def _containerfile_stages() -> list[list[str]]:
    """conf/Containerfile's instructions (comments and continuations joined), split at each FROM."""
    text = (CONF / "Containerfile").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = " ".join(
        line.rstrip("\\").strip() if line.endswith("\\") else line.strip() + "\n" for line in lines
    )
    stages: list[list[str]] = [[]]
    for instruction in (i.strip() for i in joined.split("\n") if i.strip()):
        if instruction.upper().startswith("FROM "):
            stages.append([])
        stages[-1].append(instruction)
    return stages


def test_containerfile_builds_from_source_in_two_stages() -> None:
    args, build, image = _containerfile_stages()
    defaults = dict(a.removeprefix("ARG ").split("=", 1) for a in args)
    assert defaults == {
        "BUILDER": "docker.io/library/golang:1.26-bookworm",
        "BASE": "docker.io/library/debian:12-slim",
    }
    assert build[0] == "FROM ${BUILDER} AS build" and image[0] == "FROM ${BASE}"
    # The build stage runs the project's own build on what it copies from the context: every
    # path it copies is in the repository, and it copies every input of `make build`.
    copied = [w.rstrip("/") for i in build if i.startswith("COPY ") for w in i.split()[1:-1]]
    tracked = subprocess.run(["git", "ls-files"], cwd=CONF.parent, capture_output=True, text=True, check=True)
    top = {path.split("/")[0] for path in tracked.stdout.split()}
    assert set(copied) <= top, set(copied) - top
    makefile = (CONF.parent / "Makefile").read_text(encoding="utf-8")
    for needed in ("setup.cfg", "pyproject.toml", "build.spec", "rdma_cni", "launcher", "scripts"):
        assert needed in copied and needed in makefile, needed
    assert any(i.startswith("RUN make build") for i in build)
    # The image stage takes the two executables from the build stage, nothing from the context.
    copies = [i.split() for i in image if i.startswith("COPY ")]
    assert [c[1:2] + c[-2:] for c in copies] == [
        ["--from=build", "/dist/rdma-cni", "/usr/local/bin/rdma-cni"],
        ["--from=build", "/dist/rdma-cni-shim", "/usr/local/bin/rdma-cni-shim"],
    ]
    lines = image
    (entrypoint,) = [line for line in lines if line.startswith("ENTRYPOINT")]
    assert json.loads(entrypoint.removeprefix("ENTRYPOINT")) == [
        "/usr/local/bin/rdma-cni",
        "install",
        "--watch",
    ]


def test_conf_dra() -> None:
    """conf/dra.yaml against Kubernetes 1.37's schemas (resource.k8s.io/v1 exists from 1.34 only)."""
    from rdma_cni.shared.dra import DEVICE_CLASS, DRIVER

    docs = load_docs("dra.yaml")
    for doc in docs:
        validate_k8s(doc, kubernetes_validate.latest_version())
    (device_class,) = [d for d in docs if d["kind"] == "DeviceClass"]
    assert device_class["metadata"]["name"] == DEVICE_CLASS
    assert device_class["spec"]["selectors"] == [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rdma-cni", "namespace": "kube-system"}]
