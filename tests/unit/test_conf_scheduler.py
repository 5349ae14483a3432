"""The scheduler half of conf/: the extender's two deployments and their KubeSchedulerConfigurations.

The default, scheduler-extender.yaml, runs the extender as a sidecar of a
second kube-scheduler on loopback (its configuration in a ConfigMap);
scheduler-extender-mtls.yaml runs it behind a Service requiring client
certificates, for kube-scheduler-default.yaml. The manifests are validated
strictly against Kubernetes' schemas like the rest of conf/. kubernetes-validate
has no schema for kube-scheduler's own configuration, so it is checked here
against the documented fields of kubescheduler.config.k8s.io/v1 and
kube-scheduler's validation rules, and against the manifests it must agree
with (loopback port, Service name and port, TLS and client certificates, the
verbs the extender serves). No variant serves the verbs on a network address
without client authentication.
"""

from __future__ import annotations

import copy
import re
import urllib.parse
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from rdma_cni.extender.listener import is_loopback
from rdma_cni.extender.options import parser as extender_parser
from rdma_cni.extender.retry import CONDITION

CONF = Path(__file__).resolve().parents[2] / "conf"
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())

SIDECAR = "base/extender/scheduler-extender.yaml"  # the default
MTLS = "base/extender-mtls/scheduler-extender-mtls.yaml"
EXTENDERS = (SIDECAR, MTLS)
# Where each KubeSchedulerConfiguration is: the sidecar's in its ConfigMap.
SCHEDULER_CONFIGS = ("sidecar", "kube-scheduler-default.yaml")
# Which extender deployment each configuration calls.
CALLS = {"sidecar": SIDECAR, "kube-scheduler-default.yaml": MTLS}

# The paths the extender serves (rdma_cni/extender/verbs.py, Extender.routes); kube-scheduler
# appends "/" + verb to urlPrefix.
SERVED_VERBS = {
    "filterVerb": "filter",
    "prioritizeVerb": "prioritize",
    "preemptVerb": "preempt",
    "bindVerb": "bind",
}

# An extended resource name (validateExtendedResourceName): a DNS-subdomain prefix with a dot,
# then a qualified name; kubernetes.io prefixes are native resources.
_EXTENDED_RESOURCE = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)

# Go's time.ParseDuration grammar, as metav1.Duration parses it.
_DURATION = re.compile(r"(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+")

# kubescheduler.config.k8s.io/v1 (k8s.io/kube-scheduler config/v1 types.go):
# a mapping is a struct (unknown keys are errors, as kube-scheduler's strict
# decoding makes them), a one-item list a list of that, "duration" a
# metav1.Duration string, and dict/list opaque values.
_TLS = {
    "insecure": bool,
    "serverName": str,
    "certFile": str,
    "keyFile": str,
    "caFile": str,
    "certData": str,
    "keyData": str,
    "caData": str,
}
_EXTENDER = {
    "urlPrefix": str,
    "filterVerb": str,
    "preemptVerb": str,
    "prioritizeVerb": str,
    "weight": int,
    "bindVerb": str,
    "enableHTTPS": bool,
    "tlsConfig": _TLS,
    "httpTimeout": "duration",
    "nodeCacheCapable": bool,
    "managedResources": [{"name": str, "ignoredByScheduler": bool}],
    "ignorable": bool,
}
SCHEMA: dict[str, Any] = {
    "apiVersion": str,
    "kind": str,
    "parallelism": int,
    "leaderElection": {
        "leaderElect": bool,
        "leaseDuration": "duration",
        "renewDeadline": "duration",
        "retryPeriod": "duration",
        "resourceLock": str,
        "resourceName": str,
        "resourceNamespace": str,
    },
    "clientConnection": {
        "kubeconfig": str,
        "acceptContentTypes": str,
        "contentType": str,
        "qps": float,
        "burst": int,
    },
    "enableProfiling": bool,
    "enableContentionProfiling": bool,
    "percentageOfNodesToScore": int,
    "podInitialBackoffSeconds": int,
    "podMaxBackoffSeconds": int,
    "profiles": [
        {"schedulerName": str, "percentageOfNodesToScore": int, "plugins": dict, "pluginConfig": list}
    ],
    "extenders": [_EXTENDER],
    "delayCacheUntilActive": bool,
}


def structural_errors(value: Any, schema: Any, where: str = "") -> list[str]:
    """Where ``value`` departs from ``schema`` (see SCHEMA), as messages naming the field."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{where or '<root>'}: expected a mapping"]
        errors = []
        for key, item in value.items():
            path = f"{where}.{key}" if where else key
            if key not in schema:
                errors.append(f"{path}: unknown field")
            else:
                errors += structural_errors(item, schema[key], path)
        return errors
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        return [
            e for i, item in enumerate(value) for e in structural_errors(item, schema[0], f"{where}[{i}]")
        ]
    if schema == "duration":
        ok = isinstance(value, str) and bool(_DURATION.fullmatch(value))
        return [] if ok else [f"{where}: {value!r} is not a duration such as 10s"]
    if schema is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif schema is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, schema)
    return [] if ok else [f"{where}: expected {schema.__name__}, got {type(value).__name__}"]


def validation_errors(doc: dict[str, Any]) -> list[str]:
    """kube-scheduler's own checks (pkg/scheduler/apis/config/validation) that apply to these files."""
    errors = structural_errors(doc, SCHEMA)
    if (
        doc.get("apiVersion") != "kubescheduler.config.k8s.io/v1"
        or doc.get("kind") != "KubeSchedulerConfiguration"
    ):
        errors.append("apiVersion/kind: must be kubescheduler.config.k8s.io/v1 KubeSchedulerConfiguration")
    profiles = doc.get("profiles") or []
    names = [p.get("schedulerName") for p in profiles if isinstance(p, dict)]
    if not profiles:
        errors.append("profiles: at least one is required")
    if any(not n for n in names) or len(set(names)) != len(names):
        errors.append("profiles: schedulerName must be set and unique")
    for i, profile in enumerate(profiles):
        pct = profile.get("percentageOfNodesToScore") if isinstance(profile, dict) else None
        if pct is not None and not 0 <= pct <= 100:
            errors.append(f"profiles[{i}].percentageOfNodesToScore: must be in [0, 100]")
    extenders = doc.get("extenders") or []
    if sum(1 for e in extenders if isinstance(e, dict) and e.get("bindVerb")) > 1:
        errors.append("extenders: only one extender can implement bind")
    for i, ext in enumerate(extenders):
        if not isinstance(ext, dict):
            continue
        weight = ext.get("weight", 0)
        if ext.get("prioritizeVerb") and isinstance(weight, int) and weight <= 0:
            errors.append(f"extenders[{i}].weight: must have a positive weight applied to it")
        if not ext.get("urlPrefix"):
            errors.append(f"extenders[{i}].urlPrefix: required")
        names = [r.get("name") for r in ext.get("managedResources") or [] if isinstance(r, dict)]
        for j, name in enumerate(names):
            where = f"extenders[{i}].managedResources[{j}].name"
            if not isinstance(name, str) or not _EXTENDED_RESOURCE.fullmatch(name):
                errors.append(f"{where}: {name!r} is not a valid extended resource name")
            elif name.split("/", 1)[0].endswith("kubernetes.io"):
                errors.append(f"{where}: {name!r} is a native resource name, not an extended one")
            if names.count(name) > 1:
                errors.append(f"{where}: duplicate extender managed resource name {name!r}")
    return errors


def load(name: str) -> list[dict[str, Any]]:
    with open(CONF / name, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def one(name: str, kind: str, metadata_name: str | None = None) -> dict[str, Any]:
    found = [
        doc
        for doc in load(name)
        if doc.get("kind") == kind and metadata_name in (None, doc["metadata"]["name"])
    ]
    assert len(found) == 1, f"{name}: expected one {kind} {metadata_name or ''}, found {len(found)}"
    return found[0]


def extender_role() -> dict[str, Any]:
    """The extender's ClusterRole, which conf/base/node/rbac.yaml holds for both variants."""
    return one("base/node/rbac.yaml", "ClusterRole", "rdma-cni-scheduler-extender")


def pod_spec(name: str) -> dict[str, Any]:
    return one(name, "Deployment")["spec"]["template"]["spec"]


def extender_container(name: str) -> dict[str, Any]:
    (container,) = [c for c in pod_spec(name)["containers"] if c["command"][1:2] == ["scheduler-extender"]]
    return container


def extender_args(name: str) -> list[str]:
    container = extender_container(name)
    command = container["command"]
    assert command[:2] == ["/usr/local/bin/rdma-cni", "scheduler-extender"]
    return list(command[2:]) + list(container.get("args", []))


def scheduler_config(where: str) -> dict[str, Any]:
    if where == "sidecar":
        data = one(SIDECAR, "ConfigMap")["data"]
        assert list(data) == ["config.yaml"]
        return yaml.safe_load(data["config.yaml"])
    (doc,) = load(where)
    return doc


def mounts(name: str, container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in pod_spec(name)["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}


# -- the extender's manifests


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    ("name", "kinds"),
    [
        (
            SIDECAR,
            {
                "ServiceAccount",
                "ClusterRoleBinding",
                "Role",
                "RoleBinding",
                "ConfigMap",
                "Deployment",
            },
        ),
        (
            MTLS,
            {
                "ServiceAccount",
                "ClusterRoleBinding",
                "ValidatingAdmissionPolicy",
                "ValidatingAdmissionPolicyBinding",
                "Service",
                "Deployment",
            },
        ),
    ],
)
def test_extender_manifests_validate_strictly(name: str, kinds: set[str], version: str) -> None:
    docs = load(name)
    assert {d["kind"] for d in docs} == kinds
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("name", EXTENDERS)
def test_broken_extender_deployment_fails_validation(name: str) -> None:
    doc = copy.deepcopy(one(name, "Deployment"))
    doc["spec"]["strategy"]["rollingUpdate"] = "all at once"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("name", EXTENDERS)
def test_exactly_one_replica_replaced_not_rolled(name: str) -> None:
    spec = one(name, "Deployment")["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}


def _extender_files() -> list[str]:
    """Every manifest of conf/ and its bases that runs the extender, by path below conf/."""
    files = [*CONF.glob("*.yaml"), *CONF.glob("base/*/*.yaml")]
    return sorted(str(p.relative_to(CONF)) for p in files if "scheduler-extender\n" in p.read_text() + "\n")


def test_no_variant_serves_the_network_without_client_certificates() -> None:
    """The extender can bind any pod anywhere: loopback, or client certificates of a given CA."""
    files = [n for n in _extender_files() if any(d.get("kind") == "Deployment" for d in load(n))]
    assert sorted(files) == sorted(EXTENDERS)
    for name in files:
        args = extender_parser().parse_args(extender_args(name))
        host = args.listen[0]
        assert is_loopback(host) or (args.client_ca and args.tls_cert and args.tls_key), name


def test_sidecar_listens_on_loopback_where_its_kube_scheduler_calls() -> None:
    args = extender_parser().parse_args(extender_args(SIDECAR))
    assert args.listen == ("127.0.0.1", 8888) and is_loopback(args.listen[0])
    assert args.tls_cert is None and args.client_ca is None and args.kubeconfig is None
    (ext,) = scheduler_config("sidecar")["extenders"]
    url = urllib.parse.urlsplit(ext["urlPrefix"])
    assert (url.scheme, url.hostname, url.port, url.path) == ("http", args.listen[0], args.listen[1], "")
    assert ext["enableHTTPS"] is False and "tlsConfig" not in ext
    assert "hostNetwork" not in pod_spec(SIDECAR)  # the pod's loopback, not the node's
    assert not [d for d in load(SIDECAR) if d["kind"] == "Service"]  # nothing to reach it by


def test_sidecar_kube_scheduler_reads_the_configmap() -> None:
    (scheduler,) = [c for c in pod_spec(SIDECAR)["containers"] if c["name"] == "kube-scheduler"]
    assert scheduler["image"].startswith("registry.k8s.io/kube-scheduler:v1.")
    (config,) = [a.split("=", 1)[1] for a in scheduler["command"] if a.startswith("--config=")]
    volume = mounts(SIDECAR, scheduler)[str(Path(config).parent)]
    assert volume["configMap"]["name"] == one(SIDECAR, "ConfigMap")["metadata"]["name"]
    assert Path(config).name == "config.yaml"
    assert scheduler_config("sidecar").get("clientConnection") is None  # the pod's service account


def test_sidecar_kube_scheduler_has_kube_schedulers_rights() -> None:
    account = one(SIDECAR, "ServiceAccount")["metadata"]
    subject = [{"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}]
    assert pod_spec(SIDECAR)["serviceAccountName"] == account["name"]
    bound = {
        (d["kind"], d["roleRef"]["kind"], d["roleRef"]["name"])
        for d in load(SIDECAR)
        if d["kind"] in ("ClusterRoleBinding", "RoleBinding") and d["subjects"] == subject
    }
    lease = one(SIDECAR, "Role", "rdma-scheduler-lease")
    assert bound == {
        ("ClusterRoleBinding", "ClusterRole", extender_role()["metadata"]["name"]),
        ("ClusterRoleBinding", "ClusterRole", "system:kube-scheduler"),
        ("ClusterRoleBinding", "ClusterRole", "system:volume-scheduler"),
        ("RoleBinding", "Role", "extension-apiserver-authentication-reader"),
        ("RoleBinding", "Role", lease["metadata"]["name"]),
    }
    election = scheduler_config("sidecar")["leaderElection"]
    assert lease["rules"][0]["resourceNames"] == [election["resourceName"]]
    assert lease["metadata"]["namespace"] == election["resourceNamespace"]


def test_mtls_command_line_parses_with_the_extenders_own_parser() -> None:
    args = extender_parser().parse_args(extender_args(MTLS))
    assert args.tls_cert and args.tls_key and args.client_ca and args.kubeconfig is None
    assert args.client_names == ["rdma-cni-kube-scheduler"]
    assert not is_loopback(args.listen[0])  # behind the Service: only client certificates protect it
    volumes = mounts(MTLS, extender_container(MTLS))
    for path in (args.tls_cert, args.tls_key):
        assert volumes[str(Path(path).parent)]["secret"]["secretName"] == "rdma-cni-scheduler-extender-tls"
    assert (
        Path(args.tls_cert).name == "tls.crt" and Path(args.tls_key).name == "tls.key"
    )  # a kubernetes.io/tls Secret
    ca = volumes[str(Path(args.client_ca).parent)]
    assert ca["configMap"]["name"] == "rdma-cni-scheduler-extender-client-ca"
    assert Path(args.client_ca).name == "ca.crt"


@pytest.mark.parametrize("name", EXTENDERS)
def test_probes_reach_only_the_probe_listener(name: str) -> None:
    """The kubelet has no client certificate and cannot reach loopback: probes have their own port."""
    args = extender_parser().parse_args(extender_args(name))
    container = extender_container(name)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.probe_listen is not None and ports["probes"] == args.probe_listen[1]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "probes", "scheme": "HTTP"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "probes", "scheme": "HTTP"}


def test_mtls_service_and_listen_port_agree() -> None:
    args = extender_parser().parse_args(extender_args(MTLS))
    container = extender_container(MTLS)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["https"] == args.listen[1]
    service = one(MTLS, "Service")
    labels = one(MTLS, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["https"]  # not the probes


@pytest.mark.parametrize("name", EXTENDERS)
def test_extender_runs_unprivileged(name: str) -> None:
    pod = pod_spec(name)
    assert pod["serviceAccountName"] == one(name, "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True and "hostNetwork" not in pod
    for container in pod["containers"]:
        ctx = container["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"] == {"drop": ["ALL"]}
    assert extender_container(name)["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_mtls_extenders_pod_writes_are_confined_by_an_admission_policy() -> None:
    # The sidecar's account is kube-scheduler's, which writes pods' status itself: no policy there.
    policy = one(MTLS, "ValidatingAdmissionPolicy")
    binding = one(MTLS, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["pods", "pods/status"] and rule["operations"] == ["UPDATE"]
    account = one(MTLS, "ServiceAccount")["metadata"]
    (condition,) = spec["matchConditions"]
    assert f"'system:serviceaccount:{account['namespace']}:{account['name']}'" in condition["expression"]
    # The one condition the extender writes, left out of both sides of the comparison.
    text = " ".join(v["expression"] for v in spec["variables"])
    assert text.count(f"'{CONDITION}'") == 2
    assert not [d for d in load(SIDECAR) if d["kind"] == "ValidatingAdmissionPolicy"]


@pytest.mark.parametrize("name", EXTENDERS)
def test_extender_rbac_is_exactly_what_it_uses(name: str) -> None:
    role = extender_role()
    rules = role["rules"]
    granted = {(res, verb) for rule in rules for res in rule["resources"] for verb in rule["verbs"]}
    assert all(rule["apiGroups"] == [""] for rule in rules)
    assert granted == {
        ("nodes", "get"),
        ("nodes", "list"),
        ("nodes", "watch"),
        ("pods", "get"),
        ("pods", "list"),
        ("pods", "watch"),
        ("pods/binding", "create"),
        ("pods/status", "patch"),  # the retry condition (rdma_cni/extender/retry.py)
        ("events", "create"),  # BindingRefused (core v1 Events, rdma_cni/kube/events.py)
    }
    (binding,) = [
        d
        for d in load(name)
        if d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"] == role["metadata"]["name"]
    ]
    account = one(name, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    ]


def test_both_variants_bind_the_one_extender_role() -> None:
    """One ClusterRole per component, in conf/base/node/rbac.yaml: no variant defines (redefines) one."""
    assert [d for n in EXTENDERS for d in load(n) if d["kind"] == "ClusterRole"] == []
    for name in EXTENDERS:
        refs = [d["roleRef"]["name"] for d in load(name) if d["kind"] == "ClusterRoleBinding"]
        assert extender_role()["metadata"]["name"] in refs
    names = {d["metadata"]["name"] for n in EXTENDERS for d in load(n) if d["kind"] == "ClusterRoleBinding"}
    assert len(names) == sum(1 for n in EXTENDERS for d in load(n) if d["kind"] == "ClusterRoleBinding")


# -- the KubeSchedulerConfigurations


@pytest.mark.parametrize("where", SCHEDULER_CONFIGS)
def test_scheduler_config_is_valid(where: str) -> None:
    assert validation_errors(scheduler_config(where)) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda d: d["extenders"][0].update(nodeCacheCapible=True),
            "extenders[0].nodeCacheCapible: unknown field",
        ),
        (lambda d: d["extenders"][0].update(weight="1"), "extenders[0].weight: expected int, got str"),
        (lambda d: d["extenders"][0].update(weight=0), "extenders[0].weight: must have a positive weight"),
        (lambda d: d["extenders"][0].update(httpTimeout="10 seconds"), "is not a duration"),
        (lambda d: d["extenders"][0].update(ignorable="false"), "extenders[0].ignorable: expected bool"),
        (
            lambda d: d["extenders"][0]["tlsConfig"].update(caFIle="x"),
            "extenders[0].tlsConfig.caFIle: unknown field",
        ),
        (lambda d: d["extenders"].append(dict(d["extenders"][0])), "only one extender can implement bind"),
        (lambda d: d["profiles"].append(dict(d["profiles"][0])), "schedulerName must be set and unique"),
        (lambda d: d["profiles"][0].update(percentageOfNodesToScore=101), "must be in [0, 100]"),
        (lambda d: d.update(apiVersion="kubescheduler.config.k8s.io/v1beta3"), "apiVersion/kind"),
        (lambda d: d.update(extenders={}), "extenders: expected a list"),
        (
            lambda d: d["extenders"][0]["managedResources"][0].update(name="interfaces"),
            "is not a valid extended resource name",
        ),
        (
            lambda d: d["extenders"][0]["managedResources"][0].update(name="kubernetes.io/rdma"),
            "is a native resource name",
        ),
        (
            lambda d: d["extenders"][0]["managedResources"].append(d["extenders"][0]["managedResources"][0]),
            "duplicate extender managed resource name",
        ),
    ],
)
def test_broken_scheduler_config_is_rejected(change: Any, expected: str) -> None:
    broken = copy.deepcopy(scheduler_config("kube-scheduler-default.yaml"))
    change(broken)
    errors = validation_errors(broken)
    assert any(expected in e for e in errors), errors


def test_default_scheduler_config_names_no_file_and_checks_the_service_name() -> None:
    """kube-scheduler reads certFile/keyFile/caFile at start and exits when one is missing: the shipped
    configuration names none (rdma-cni scheduler-config puts the credentials inline, see
    test_schedconfig.py), and its urlPrefix, a placeholder for the Service's ClusterIP, is no Service
    name (the host's DNS does not resolve those); the serving certificate is checked for the Service."""
    (ext,) = scheduler_config("kube-scheduler-default.yaml")["extenders"]
    service = one(MTLS, "Service")
    dns = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    url = urllib.parse.urlsplit(ext["urlPrefix"])
    assert (url.scheme, url.hostname, url.port, url.path) == (
        "https",
        "cluster-ip",
        service["spec"]["ports"][0]["port"],
        "",
    )
    args = extender_parser().parse_args(extender_args(MTLS))
    assert ext["enableHTTPS"] is True and args.tls_cert and args.client_ca
    assert ext["tlsConfig"] == {"serverName": dns}


@pytest.mark.parametrize("where", SCHEDULER_CONFIGS)
def test_scheduler_config_serves_the_verbs_with_these_choices(where: str) -> None:
    doc = scheduler_config(where)
    (ext,) = doc["extenders"]
    assert {key: ext[key] for key in SERVED_VERBS} == SERVED_VERBS
    assert ext["nodeCacheCapable"] is True  # names only: the extender's cache holds node states
    assert ext["ignorable"] is False  # never schedule RDMA pods blind
    assert ext["weight"] >= 1
    # kube-scheduler's own sample of nodes (the extender sends a pod that fits only outside it back
    # for the next nodes): 100 would filter every node for every pod, three times the CPU.
    assert all("percentageOfNodesToScore" not in p for p in doc["profiles"])


def test_second_profile_runs_beside_the_default_scheduler() -> None:
    doc = scheduler_config("sidecar")
    assert [p["schedulerName"] for p in doc["profiles"]] == ["rdma-scheduler"]
    election = doc["leaderElection"]
    assert election["resourceName"] not in ("", "kube-scheduler")  # its own lease


@pytest.mark.parametrize(("name", "where"), [(SIDECAR, "sidecar"), (MTLS, "kube-scheduler-default.yaml")])
def test_extender_binds_the_pods_of_the_profile_that_calls_it(name: str, where: str) -> None:
    # bind refuses pods of other schedulers: each variant must serve the profiles that call it.
    doc = scheduler_config(where)
    args = extender_parser().parse_args(extender_args(name))
    assert args.scheduler_names == [p["schedulerName"] for p in doc["profiles"]]


@pytest.mark.parametrize(("name", "where"), [(SIDECAR, "sidecar"), (MTLS, "kube-scheduler-default.yaml")])
def test_extender_knows_the_http_timeout_kube_scheduler_gives_it(name: str, where: str) -> None:
    # The extender abandons deciding at half of it: the two must be the same number.
    (extender,) = scheduler_config(where)["extenders"]
    args = extender_parser().parse_args(extender_args(name))
    assert extender["httpTimeout"] == f"{args.http_timeout:g}s"


def test_default_scheduler_config_keeps_the_default_profile() -> None:
    doc = scheduler_config("kube-scheduler-default.yaml")
    assert [p["schedulerName"] for p in doc["profiles"]] == ["default-scheduler"]
    assert doc["clientConnection"]["kubeconfig"] == "/etc/kubernetes/scheduler.conf"  # kubeadm's


def _rbac_of(method: str, raw_path: str) -> tuple[str, str]:
    """The (resource, verb) RBAC checks for an API request, as the API server derives it."""
    split = urllib.parse.urlsplit(raw_path)
    query = urllib.parse.parse_qs(split.query)
    parts = split.path.strip("/").split("/")[2:]  # after api/v1
    if parts[:1] == ["namespaces"]:
        parts = parts[2:]
    resource = "/".join(parts[::2])  # pods, pods/binding, nodes
    named = len(parts) % 2 == 0
    if method == "GET":
        verb = "watch" if query.get("watch") in (["1"], ["true"]) else ("get" if named else "list")
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
    return resource, verb


def test_extender_rbac_covers_every_call_it_makes(tmp_path: Path) -> None:
    """Run the extender against the API stand-in and check each request against the ClusterRole."""
    import sys

    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    from rdma_cni.extender.service import Service
    from rdma_cni.kube import client as kubeapi
    from rdma_cni.kube.events import EventSink
    from rdma_cni.shared import nodestate
    from tests.support import sched_objects as so
    from tests.support.apiserver import ApiServer

    rules = extender_role()["rules"]
    granted = {(res, verb) for rule in rules for res in rule["resources"] for verb in rule["verbs"]}
    with ApiServer() as api:
        state = nodestate.encode(so.state([("ens1f0", 25_000, 4)]))
        api.add_node("n1", annotations={nodestate.ANNOTATION: state})
        value = '[{"min_tx_rate": 1000}]'
        pod = api.add_pod(
            "team-a",
            "p",
            {"rdma_interfaces_required": value},
            node_name=None,
            scheduler_name="rdma-scheduler",
        )
        client = kubeapi.ApiClient.from_kubeconfig(api.write_kubeconfig(tmp_path / "kubeconfig"))
        events = EventSink(client.post, "rdma-cni-extender")
        service = Service(client, listen=("127.0.0.1", 0), events=events).start()
        try:
            assert service.extender.ready.wait(30)
            assert service.extender.filter(so.args_names(pod, ["n1"]))["NodeNames"] == ["n1"]
            meta = pod["metadata"]
            bind = {
                "PodName": meta["name"],
                "PodNamespace": meta["namespace"],
                "PodUID": meta["uid"],
                "Node": "n1",
            }
            assert service.extender.bind(bind) == {"Error": ""}
            assert service.extender.bind(bind)["Error"]  # already bound: refused, with an Event
            assert events.flush() and events.posted == 1
            service.check_pods()
        finally:
            service.stop()
            client.close()
        used = {_rbac_of(seen.method, seen.path) for seen in api.requests_seen}
    assert {
        ("nodes", "list"),
        ("nodes", "watch"),
        ("pods", "list"),
        ("pods/binding", "create"),
        ("pods", "get"),
        ("events", "create"),
    } <= used
    assert used <= granted, sorted(used - granted)
