"""The scheduler half of conf/: the extender's manifests and the two KubeSchedulerConfigurations.

The manifests are validated strictly against Kubernetes' schemas like the
rest of conf/. kubernetes-validate has no schema for kube-scheduler's own
configuration, so it is checked here against the documented fields of
kubescheduler.config.k8s.io/v1 and kube-scheduler's validation rules, and
against the manifests it must agree with (Service name and port, TLS, the
verbs the extender serves).
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

from rdma_cni.extender.main import parser as extender_parser

CONF = Path(__file__).resolve().parents[2] / "conf"
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())

EXTENDER = "scheduler-extender.yaml"
SCHEDULER_CONFIGS = ("kube-scheduler-rdma-profile.yaml", "kube-scheduler-default.yaml")

# The paths the extender serves (rdma_cni/extender/server.py); kube-scheduler
# appends "/" + verb to urlPrefix.
SERVED_VERBS = {
    "filterVerb": "filter",
    "prioritizeVerb": "prioritize",
    "preemptVerb": "preempt",
    "bindVerb": "bind",
}

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
    return errors


def load(name: str) -> list[dict[str, Any]]:
    with open(CONF / name, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def one(name: str, kind: str) -> dict[str, Any]:
    found = [doc for doc in load(name) if doc.get("kind") == kind]
    assert len(found) == 1, f"{name}: expected one {kind}, found {len(found)}"
    return found[0]


def extender_args() -> list[str]:
    container = one(EXTENDER, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[:2] == ["/usr/local/bin/rdma-cni", "scheduler-extender"]
    return list(command[2:]) + list(container.get("args", []))


# -- the extender's manifests


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_extender_manifests_validate_strictly(version: str) -> None:
    docs = load(EXTENDER)
    assert {d["kind"] for d in docs} == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Service",
        "Deployment",
    }
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_broken_extender_deployment_fails_validation() -> None:
    doc = copy.deepcopy(one(EXTENDER, "Deployment"))
    doc["spec"]["strategy"]["rollingUpdate"] = "all at once"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


def test_exactly_one_replica_replaced_not_rolled() -> None:
    spec = one(EXTENDER, "Deployment")["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}


def test_extender_command_line_parses_with_the_extenders_own_parser() -> None:
    args = extender_parser().parse_args(extender_args())
    assert args.tls_cert and args.tls_key and args.kubeconfig is None  # in-cluster service account
    deployment = one(EXTENDER, "Deployment")["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in deployment["containers"][0]["volumeMounts"]}
    secret = next(v for v in deployment["volumes"] if "secret" in v)
    for path in (args.tls_cert, args.tls_key):
        assert Path(path).parent == Path(mounts[secret["name"]])
    assert (
        Path(args.tls_cert).name == "tls.crt" and Path(args.tls_key).name == "tls.key"
    )  # a kubernetes.io/tls Secret


def test_service_probes_and_listen_port_agree() -> None:
    args = extender_parser().parse_args(extender_args())
    container = one(EXTENDER, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["https"] == args.listen[1]
    service = one(EXTENDER, "Service")
    assert (
        service["spec"]["selector"] == one(EXTENDER, "Deployment")["spec"]["template"]["metadata"]["labels"]
    )
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["https"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "https", "scheme": "HTTPS"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}


def test_extender_runs_unprivileged() -> None:
    pod = one(EXTENDER, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == one(EXTENDER, "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True and "hostNetwork" not in pod
    ctx = pod["containers"][0]["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True
    assert ctx["capabilities"] == {"drop": ["ALL"]}


def test_extender_rbac_is_exactly_what_it_uses() -> None:
    rules = one(EXTENDER, "ClusterRole")["rules"]
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
        ("events", "create"),  # BindingRefused (core v1 Events, rdma_cni/kube/events.py)
    }
    binding = one(EXTENDER, "ClusterRoleBinding")
    account = one(EXTENDER, "ServiceAccount")["metadata"]
    assert binding["roleRef"]["name"] == one(EXTENDER, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    ]


# -- the KubeSchedulerConfigurations


@pytest.mark.parametrize("name", SCHEDULER_CONFIGS)
def test_scheduler_config_is_valid(name: str) -> None:
    (doc,) = load(name)
    assert validation_errors(doc) == []


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
    ],
)
def test_broken_scheduler_config_is_rejected(change: Any, expected: str) -> None:
    (doc,) = load(SCHEDULER_CONFIGS[0])
    broken = copy.deepcopy(doc)
    change(broken)
    errors = validation_errors(broken)
    assert any(expected in e for e in errors), errors


@pytest.mark.parametrize("name", SCHEDULER_CONFIGS)
def test_scheduler_config_reaches_the_extender(name: str) -> None:
    (doc,) = load(name)
    (ext,) = doc["extenders"]
    service = one(EXTENDER, "Service")
    dns = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    url = urllib.parse.urlsplit(ext["urlPrefix"])
    assert (url.scheme, url.hostname, url.port, url.path) == (
        "https",
        dns,
        service["spec"]["ports"][0]["port"],
        "",
    )
    assert ext["enableHTTPS"] is True and extender_parser().parse_args(extender_args()).tls_cert
    assert ext["tlsConfig"]["serverName"] == dns and "insecure" not in ext["tlsConfig"]
    assert Path(ext["tlsConfig"]["caFile"]).is_absolute()
    assert {key: ext[key] for key in SERVED_VERBS} == SERVED_VERBS


@pytest.mark.parametrize("name", SCHEDULER_CONFIGS)
def test_scheduler_config_choices(name: str) -> None:
    (doc,) = load(name)
    (ext,) = doc["extenders"]
    assert ext["nodeCacheCapable"] is True  # names only: the extender's cache holds node states
    assert ext["ignorable"] is False  # never schedule RDMA pods blind
    assert ext["weight"] >= 1 and "managedResources" not in ext
    # Extenders only see the feasible nodes kube-scheduler found before it stopped looking.
    assert all(p["percentageOfNodesToScore"] == 100 for p in doc["profiles"])


def test_second_profile_runs_beside_the_default_scheduler() -> None:
    (doc,) = load("kube-scheduler-rdma-profile.yaml")
    assert [p["schedulerName"] for p in doc["profiles"]] == ["rdma-scheduler"]
    election = doc["leaderElection"]
    assert election["resourceName"] not in ("", "kube-scheduler")  # its own lease


def test_extender_binds_the_pods_of_the_profile_that_calls_it() -> None:
    (doc,) = load("kube-scheduler-rdma-profile.yaml")
    args = extender_parser().parse_args(extender_args())
    assert args.scheduler_names == [p["schedulerName"] for p in doc["profiles"]]


def test_default_scheduler_config_keeps_the_default_profile() -> None:
    (doc,) = load("kube-scheduler-default.yaml")
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
    from rdma_cni.extender.main import Service
    from rdma_cni.kube import client as kubeapi
    from rdma_cni.kube.events import EventSink
    from rdma_cni.shared import nodestate
    from tests.support import sched_objects as so
    from tests.support.apiserver import ApiServer

    rules = one(EXTENDER, "ClusterRole")["rules"]
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
