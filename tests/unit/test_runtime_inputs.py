"""What real runtimes put in a request besides the pod's name: a MAC, the pod's annotations.

podman passes ``MAC=`` in CNI_ARGS for ``--network net:mac=..``; a runtime
with the ``mac`` capability passes ``runtimeConfig.mac``; containerd's CRI
passes the pod's annotations in ``runtimeConfig["io.kubernetes.cri.pod-annotations"]``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.cli.main import run_cni
from rdma_cni.cni.config import first_interface_mac, load_netconf, parse_mac
from rdma_cni.cni.errors import InvalidConfig, InvalidPodRequest
from rdma_cni.cni.protocol import parse_env
from rdma_cni.node.podmeta import CRI_ANNOTATIONS, resolve_request, runtime_annotations

pytestmark = pytest.mark.usefixtures("no_real_sysfs")

REQUEST = '[{"min_tx_rate": 1000}, {}]'
POD_UID = "0b5e1c2a-7d3f-4e8a-9c61-5a4b3c2d1e0f"
POD_ARGS = "IgnoreUnknown=1;K8S_POD_NAMESPACE=team-a;K8S_POD_NAME=trainer-0;K8S_POD_UID=" + POD_UID
BAD_MACS: tuple[Any, ...] = (
    "02:00:00:00:00",  # five octets
    "02:00:00:00:00:00:01",
    "02-00-00-00-00-01",
    "0200.0000.0001",
    "02:00:00:00:00:0g",
    "02:00:00:00:00:01\n",
    " 02:00:00:00:00:01",
    "",
    "01:00:5e:00:00:01",  # multicast
    "ff:ff:ff:ff:ff:ff",
    "00:00:00:00:00:00",
    42,
    None,
    ["02:00:00:00:00:01"],
)


def netconf(tmp_path: Path, **extra: Any) -> Any:
    doc = {
        "cniVersion": "1.0.0",
        "name": "rdma-net",
        "type": "rdma-cni",
        # Nothing here may reach an API server: a kubeconfig that does not exist
        # turns any attempt into code 102.
        "kubeconfig": str(tmp_path / "no-such-kubeconfig"),
        "stateDir": str(tmp_path / "state"),
        "lockFile": str(tmp_path / "lock"),
        **extra,
    }
    return load_netconf(doc)


def add_env(cni_args: str = POD_ARGS) -> Any:
    return parse_env(
        {
            "CNI_COMMAND": "ADD",
            "CNI_CONTAINERID": "c1",
            "CNI_NETNS": "/var/run/netns/x",
            "CNI_IFNAME": "net1",
            "CNI_ARGS": cni_args,
        }
    )


# ---------------------------------------------------------------------------
# MAC


@pytest.mark.parametrize(
    ("raw", "mac"),
    [("02:00:00:00:00:01", "02:00:00:00:00:01"), ("0A:1b:2C:3d:4E:5f", "0a:1b:2c:3d:4e:5f")],
)
def test_parse_mac_accepts_unicast(raw: str, mac: str) -> None:
    assert parse_mac(raw, "somewhere") == mac


@pytest.mark.parametrize("raw", BAD_MACS, ids=repr)
def test_parse_mac_refuses_with_code_7_naming_the_source(raw: Any) -> None:
    with pytest.raises(InvalidConfig) as info:
        parse_mac(raw, "CNI_ARGS MAC")
    assert info.value.code == 7
    assert info.value.msg.startswith("CNI_ARGS MAC: ")


def test_mac_from_cni_args(tmp_path: Path) -> None:
    env = add_env(POD_ARGS + ";MAC=02:AA:00:00:00:01")
    assert first_interface_mac(netconf(tmp_path), env.args) == "02:aa:00:00:00:01"


def test_mac_from_runtime_config(tmp_path: Path) -> None:
    conf = netconf(tmp_path, runtimeConfig={"mac": "02:bb:00:00:00:01"})
    assert first_interface_mac(conf, add_env().args) == "02:bb:00:00:00:01"


def test_no_mac(tmp_path: Path) -> None:
    assert first_interface_mac(netconf(tmp_path, runtimeConfig={"ips": []}), add_env().args) == ""


def test_runtime_config_mac_wins_over_cni_args(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    conf = netconf(tmp_path, runtimeConfig={"mac": "02:bb:00:00:00:01"})
    env = add_env(POD_ARGS + ";MAC=02:aa:00:00:00:01")
    with caplog.at_level(logging.WARNING, logger="rdma_cni.config"):
        assert first_interface_mac(conf, env.args) == "02:bb:00:00:00:01"
    assert "overrides CNI_ARGS MAC=02:aa:00:00:00:01" in caplog.text


@pytest.mark.parametrize(
    ("runtime_config", "cni_args", "named"),
    [
        ({"mac": "02:00:00:00:00"}, POD_ARGS, "runtimeConfig.mac"),
        ({"mac": 7}, POD_ARGS, "runtimeConfig.mac"),
        ({}, POD_ARGS + ";MAC=01:00:5e:00:00:01", "CNI_ARGS MAC"),
        # A bad CNI_ARGS MAC is refused even when runtimeConfig.mac would win.
        ({"mac": "02:00:00:00:00:01"}, POD_ARGS + ";MAC=nonsense", "CNI_ARGS MAC"),
    ],
)
def test_bad_mac_through_run_cni_is_code_7_before_anything_else(
    tmp_path: Path, runtime_config: dict[str, Any], cni_args: str, named: str
) -> None:
    """ADD refuses it first: before reading the pod, opening the netns or taking the lock."""
    doc = {
        "cniVersion": "1.0.0",
        "name": "rdma-net",
        "type": "rdma-cni",
        "kubeconfig": str(tmp_path / "no-such-kubeconfig"),
        "stateDir": str(tmp_path / "state"),
        "lockFile": str(tmp_path / "lock"),
        "runtimeConfig": runtime_config,
    }
    environ = {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "c1",
        "CNI_NETNS": str(tmp_path / "no-such-netns"),
        "CNI_IFNAME": "net1",
        "CNI_ARGS": cni_args,
    }
    code, answer = run_cni(environ, json.dumps(doc).encode())
    assert code == 1 and answer is not None
    assert answer["code"] == 7 and answer["msg"].startswith(named + ": "), answer
    assert answer["cniVersion"] == "1.0.0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty-sys"]  # no state, lock or netns


# ---------------------------------------------------------------------------
# The pod's annotations from the runtime (containerd's CRI)


def test_cri_annotations_are_used_without_the_api(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    annotations = {"rdma_interfaces_required": REQUEST, "other": "x"}
    conf = netconf(tmp_path, runtimeConfig={CRI_ANNOTATIONS: annotations})
    with caplog.at_level(logging.INFO, logger="rdma_cni.podmeta"):
        request, source = resolve_request(add_env(), conf)
    assert [(r.min_tx_rate, r.max_tx_rate) for r in request.interfaces] == [(1000, 0), (0, 0)]
    assert (
        source == "pod team-a/trainer-0 annotation rdma_interfaces_required (from the runtime's annotations)"
    )
    assert f"pod request from {source}: 2 interface(s)" in caplog.text


def test_cri_annotations_without_the_request_give_the_default(tmp_path: Path) -> None:
    conf = netconf(
        tmp_path, defaultRequest=[{"max_tx_rate": 5}], runtimeConfig={CRI_ANNOTATIONS: {"other": "x"}}
    )
    request, source = resolve_request(add_env(), conf)
    assert [r.max_tx_rate for r in request.interfaces] == [5]
    assert source.startswith("defaultRequest (pod team-a/trainer-0 has no rdma_interfaces_required")


def test_cri_null_means_no_annotations(tmp_path: Path) -> None:
    """containerd sends null for a pod without annotations: the default, and no API round trip."""
    conf = netconf(tmp_path, defaultRequest=[{}, {}], runtimeConfig={CRI_ANNOTATIONS: None})
    assert runtime_annotations(conf) == {}
    request, source = resolve_request(add_env(), conf)
    assert len(request.interfaces) == 2 and source.startswith("defaultRequest")


def test_cri_annotations_honour_the_configured_key(tmp_path: Path) -> None:
    conf = netconf(
        tmp_path,
        annotation="example.com/rdma",
        runtimeConfig={
            CRI_ANNOTATIONS: {"example.com/rdma": "[{}, {}, {}]", "rdma_interfaces_required": "[{}]"}
        },
    )
    request, _ = resolve_request(add_env(), conf)
    assert len(request.interfaces) == 3


def test_cri_annotations_without_pod_args(tmp_path: Path) -> None:
    conf = netconf(tmp_path, runtimeConfig={CRI_ANNOTATIONS: {"rdma_interfaces_required": "[{}, {}]"}})
    request, source = resolve_request(add_env(cni_args=""), conf)
    assert len(request.interfaces) == 2 and source.startswith("the pod annotation")


@pytest.mark.parametrize(
    "value", [[], "x", 3, True, {"rdma_interfaces_required": ["not", "a", "string"]}, {"a": None}], ids=repr
)
def test_cri_annotations_of_the_wrong_shape_are_code_7(tmp_path: Path, value: Any) -> None:
    conf = netconf(tmp_path, runtimeConfig={CRI_ANNOTATIONS: value})
    with pytest.raises(InvalidConfig) as info:
        resolve_request(add_env(), conf)
    assert info.value.code == 7 and CRI_ANNOTATIONS in info.value.msg


@pytest.mark.parametrize("raw", ["not json", "[]", '[{"min_tx_rate": -1}]', "[" * 100_000])
def test_invalid_request_in_cri_annotations_is_code_101_naming_the_pod(tmp_path: Path, raw: str) -> None:
    conf = netconf(tmp_path, runtimeConfig={CRI_ANNOTATIONS: {"rdma_interfaces_required": raw}})
    with pytest.raises(InvalidPodRequest) as info:
        resolve_request(add_env(), conf)
    assert "pod team-a/trainer-0 annotation rdma_interfaces_required" in info.value.msg


@pytest.mark.parametrize("runtime_config", [{}, {"mac": "02:00:00:00:00:01"}])
def test_without_cri_annotations_the_api_is_asked(tmp_path: Path, runtime_config: dict[str, Any]) -> None:
    """Multus passes no annotations: the pod is read from the API server (here its kubeconfig is missing)."""
    with pytest.raises(InvalidConfig, match=r"kubeconfig .*no-such-kubeconfig cannot be read"):
        resolve_request(add_env(), netconf(tmp_path, runtimeConfig=runtime_config))


# ---------------------------------------------------------------------------
# Per-attachment requests: args.cni (Multus: the selection's cni-args) wins


def test_args_cni_wins_over_the_cri_annotations(tmp_path: Path) -> None:
    conf = netconf(
        tmp_path,
        args={"cni": {"rdma_interfaces_required": [{"min_tx_rate": 7}]}},
        runtimeConfig={CRI_ANNOTATIONS: {"rdma_interfaces_required": REQUEST}},
    )
    request, source = resolve_request(add_env(), conf)
    assert [r.min_tx_rate for r in request.interfaces] == [7]
    assert source == "config args.cni.rdma_interfaces_required"


def test_args_cni_wins_over_the_api_without_asking_it(tmp_path: Path) -> None:
    """Pod args and no CRI annotations would mean an API read (code 102 here): args.cni needs none."""
    conf = netconf(tmp_path, args={"cni": {"rdma_interfaces_required": [{}, {}, {}]}})
    request, source = resolve_request(add_env(), conf)
    assert len(request.interfaces) == 3 and source == "config args.cni.rdma_interfaces_required"


def test_args_cni_without_the_request_falls_back_to_the_annotation(tmp_path: Path) -> None:
    conf = netconf(
        tmp_path,
        args={"cni": {"other": 1}},
        runtimeConfig={CRI_ANNOTATIONS: {"rdma_interfaces_required": REQUEST}},
    )
    request, source = resolve_request(add_env(), conf)
    assert len(request.interfaces) == 2 and "annotation" in source


def test_invalid_args_cni_request_is_code_101_naming_args(tmp_path: Path) -> None:
    conf = netconf(
        tmp_path,
        args={"cni": {"rdma_interfaces_required": [{"min_tx_rate": -1}]}},
        runtimeConfig={CRI_ANNOTATIONS: {"rdma_interfaces_required": REQUEST}},
    )
    with pytest.raises(InvalidPodRequest) as info:
        resolve_request(add_env(), conf)
    assert info.value.msg.startswith("config args.cni.rdma_interfaces_required: ")


def test_api_annotation_unless_the_attachment_has_its_own(tmp_path: Path) -> None:
    """One pod, two attachments (two rdma-cni networks): the one with args.cni keeps its own request."""
    from tests.support.apiserver import ApiServer

    with ApiServer() as api:
        api.add_pod("team-a", "trainer-0", {"rdma_interfaces_required": REQUEST}, uid=POD_UID)
        kubeconfig = str(api.write_kubeconfig(tmp_path / "kubeconfig", mode="token"))
        plain = netconf(tmp_path, kubeconfig=kubeconfig)
        request, source = resolve_request(add_env(), plain)
        assert len(request.interfaces) == 2 and source.endswith("(from the API server)")
        asked = api.request_count
        own = netconf(tmp_path, kubeconfig=kubeconfig, args={"cni": {"rdma_interfaces_required": [{}]}})
        request, source = resolve_request(add_env(), own)
        assert len(request.interfaces) == 1 and source == "config args.cni.rdma_interfaces_required"
        assert api.request_count == asked  # no round trip for an attachment's own request
