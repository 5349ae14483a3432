"""The DRA objects rdma-cni writes, against Kubernetes v1.37's schemas, and the driver's opaque configuration.

ResourceSlices (shared/dra/slices) and ResourceClaimTemplates (shared/dra/claims,
``rdma-cni claim``) are validated strictly (no unknown field) against the
resource.k8s.io/v1 schemas of the installed kubernetes-validate (1.37); the
cluster tier has the real kube-apiserver accept them and kube-scheduler
allocate them. The configuration's parser is held to what the annotation's
is: typed errors (code 101) naming the field, bounded input.
"""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes_validate
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdma_cni.cli import claim as claim_command
from rdma_cni.shared.dra import BANDWIDTH, DEVICE_CLASS, DRIVER, NUMA_NODE, PCIE_ROOT, VFS
from rdma_cni.shared.dra.claims import (
    CONFIG_API_VERSION,
    CONFIG_KIND,
    MAX_CONFIG_BYTES,
    claim_template,
    configs_of,
    parse_config,
    request_name,
)
from rdma_cni.shared.dra.slices import (
    MAX_DEVICES_PER_SLICE,
    DraDevice,
    device_name,
    index,
    published_devices,
    render_slices,
)
from rdma_cni.shared.errors import InvalidPodRequest
from rdma_cni.shared.podrequest import PodRequest, parse_request
from rdma_cni.shared.quantity import whole

K8S = "1.37.0"
LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def valid(doc: dict[str, Any]) -> None:
    """Strictly valid as Kubernetes 1.37 has the kind (a server-generated name filled in)."""
    doc = json.loads(json.dumps(doc))
    meta = doc.setdefault("metadata", {})
    if "generateName" in meta:
        meta["name"] = meta.pop("generateName") + "abcde"
    kubernetes_validate.validate(doc, K8S, strict=True)


def device(**kw: Any) -> DraDevice:
    base: dict[str, Any] = {
        "network": "rdma-dra",
        "pf": "ens1f0",
        "vfs": 8,
        "bandwidth": 100_000,
        "max_tx_rate": 100_000,
        "link_speed": 100_000,
        "rail": "rail-0",
        "pcie_root": "pci0000:3a",
        "numa_node": 0,
    }
    base.update(kw)
    return DraDevice(**base)


# -- slices


def test_a_slice_is_valid_and_says_what_the_issue_asks() -> None:
    slices = render_slices("node-1", [device()], 3, owner={"name": "node-1", "uid": "u-1"})
    assert len(slices) == 1
    valid(slices[0])
    spec = slices[0]["spec"]
    assert spec["driver"] == DRIVER and spec["nodeName"] == "node-1"
    assert spec["pool"] == {"name": "node-1", "generation": 3, "resourceSliceCount": 1}
    (dev,) = spec["devices"]
    assert dev["allowMultipleAllocations"] is True
    assert dev["capacity"][BANDWIDTH] == {"value": "100000", "requestPolicy": {"default": "0"}}
    assert dev["capacity"][VFS] == {"value": "8", "requestPolicy": {"default": "1", "validValues": ["1"]}}
    attrs = dev["attributes"]
    assert attrs[PCIE_ROOT] == {"string": "pci0000:3a"} and attrs[NUMA_NODE] == {"int": 0}
    assert attrs["pf"] == {"string": "ens1f0"} and attrs["network"] == {"string": "rdma-dra"}
    assert attrs["rail"] == {"string": "rail-0"} and attrs["linkSpeed"] == {"int": 100_000}
    assert attrs["maxTxRate"] == {"int": 100_000}
    assert slices[0]["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_a_pf_of_unknown_capacity_publishes_no_bandwidth() -> None:
    (s,) = render_slices("n", [device(bandwidth=None, max_tx_rate=None, link_speed=None)], 1)
    valid(s)
    (dev,) = s["spec"]["devices"]
    assert BANDWIDTH not in dev["capacity"] and VFS in dev["capacity"]
    assert "maxTxRate" not in dev["attributes"] and "linkSpeed" not in dev["attributes"]


def test_what_the_platform_does_not_know_is_left_out() -> None:
    (s,) = render_slices("n", [device(rail=None, pcie_root=None, numa_node=None)], 1)
    valid(s)
    attrs = s["spec"]["devices"][0]["attributes"]
    assert set(attrs) == {"network", "pf", "linkSpeed", "maxTxRate"}
    # Linux's "no NUMA node" (-1) is no attribute either (deviceattribute's rule).
    (s,) = render_slices("n", [device(numa_node=-1)], 1)
    assert NUMA_NODE not in s["spec"]["devices"][0]["attributes"]


def test_a_pf_without_a_vf_is_not_published() -> None:
    # A requestPolicy of 1 needs a capacity of at least 1; such a PF has nothing to give anyway.
    devices = [device(pf="ens1f0", vfs=0), device(pf="ens1f1", vfs=2)]
    (s,) = render_slices("n", devices, 1)
    assert [d["attributes"]["pf"]["string"] for d in s["spec"]["devices"]] == ["ens1f1"]
    assert render_slices("n", [device(vfs=0)], 1) == []


def test_bandwidth_below_zero_publishes_zero() -> None:
    (s,) = render_slices("n", [device(bandwidth=-5)], 1)
    assert s["spec"]["devices"][0]["capacity"][BANDWIDTH]["value"] == "0"


def test_a_large_node_is_split_into_slices_of_one_pool() -> None:
    devices = [device(network=f"net{n}", pf=f"ens{p}f0") for n in range(9) for p in range(16)]
    slices = render_slices("n", devices, 7)
    assert [len(s["spec"]["devices"]) for s in slices] == [MAX_DEVICES_PER_SLICE, 144 - MAX_DEVICES_PER_SLICE]
    for s in slices:
        valid(s)
        assert s["spec"]["pool"] == {"name": "n", "generation": 7, "resourceSliceCount": 2}
    names = [d["name"] for s in slices for d in s["spec"]["devices"]]
    assert len(set(names)) == 144


def test_devices_are_listed_in_network_and_pf_order() -> None:
    devices = [device(network="b", pf="p1"), device(network="a", pf="p2"), device(network="a", pf="p1")]
    assert [(d.network, d.pf) for d in published_devices(devices)] == [("a", "p1"), ("a", "p2"), ("b", "p1")]


@given(
    network=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,80}", fullmatch=True),
    pf=st.text(
        st.characters(min_codepoint=33, max_codepoint=0x2FF, exclude_characters="/:"), min_size=1, max_size=15
    ),
)
@settings(max_examples=300)
def test_device_names_are_dns_labels_and_stable(network: str, pf: str) -> None:
    name = device_name(network, pf)
    assert LABEL.fullmatch(name) and len(name) <= 63
    assert name == device_name(network, pf)


def test_device_names_keep_pairs_apart() -> None:
    # The same text once joined: "a-b" + "c" and "a" + "b-c"; and names only case tells apart.
    pairs = [("a-b", "c"), ("a", "b-c"), ("net", "ENS1F0"), ("net", "ens1f0"), ("n.x", "p"), ("n_x", "p")]
    names = {device_name(*p) for p in pairs}
    assert len(names) == len(pairs)
    assert index([device(network=n, pf=p) for n, p in pairs])


def test_two_devices_of_one_name_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Real names never collide (the hash), so the check is shown with a name function that does.
    from rdma_cni.shared.dra import slices

    monkeypatch.setattr(slices, "device_name", lambda network, pf: "same")
    with pytest.raises(ValueError, match="have one name same"):
        render_slices("n", [device(pf="a"), device(pf="b")], 1)
    assert list(index([device(pf="a"), device(pf="a")])) == ["same"]  # one pair twice: one device


# -- claim templates


def template(request: str | dict[str, Any] | list[Any], **kw: Any) -> dict[str, Any]:
    text = request if isinstance(request, str) else json.dumps(request)
    return claim_template(
        parse_request(text, "test"), name=kw.pop("name", "t"), network=kw.pop("network", "rdma-dra"), **kw
    )


def test_the_readme_request_becomes_one_request_per_interface() -> None:
    doc = template([{"min_tx_rate": 15000, "max_tx_rate": 20000}, {"min_tx_rate": 5000}, {}], namespace="ml")
    valid(doc)
    devices = doc["spec"]["spec"]["devices"]
    assert [r["name"] for r in devices["requests"]] == ["if0", "if1", "if2"]
    caps = [r["exactly"].get("capacity") for r in devices["requests"]]
    assert caps == [{"requests": {BANDWIDTH: "15000"}}, {"requests": {BANDWIDTH: "5000"}}, None]
    assert all(r["exactly"]["deviceClassName"] == DEVICE_CLASS for r in devices["requests"])
    # The cap: a selector (the PF's capacity reaches it) and the request's configuration.
    first = [s["cel"]["expression"] for s in devices["requests"][0]["exactly"]["selectors"]]
    assert first[0] == 'device.attributes["rdma-cni.io"].network == "rdma-dra"'
    assert first[1] == 'device.attributes["rdma-cni.io"].?maxTxRate.orValue(20000) >= 20000'
    assert devices["config"] == [
        {
            "requests": ["if0"],
            "opaque": {
                "driver": DRIVER,
                "parameters": {"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, "max_tx_rate": 20000},
            },
        }
    ]
    assert "constraints" not in devices
    assert doc["metadata"] == {"name": "t", "namespace": "ml"}


def test_constraints_become_selectors_and_a_distinct_pf() -> None:
    doc = template(
        {
            "interfaces": [{"rail": "rail-0", "name": "net1"}, {"pf": 'we"ird\\', "name": "data"}],
            "different_pfs": True,
        }
    )
    valid(doc)
    devices = doc["spec"]["spec"]["devices"]
    rail = devices["requests"][0]["exactly"]["selectors"][1]["cel"]["expression"]
    assert rail == 'device.attributes["rdma-cni.io"].?rail.orValue("") == "rail-0"'
    pf = devices["requests"][1]["exactly"]["selectors"][1]["cel"]["expression"]
    assert pf == 'device.attributes["rdma-cni.io"].pf == "we\\"ird\\\\"'  # a CEL string literal
    assert devices["constraints"] == [{"distinctAttribute": "rdma-cni.io/pf"}]
    assert [c["opaque"]["parameters"].get("name") for c in devices["config"]] == ["net1", "data"]


interface = st.fixed_dictionaries(
    {},
    optional={
        "min_tx_rate": st.integers(0, 400_000),
        "name": st.sampled_from(["a", "net1-x", "data0"]),
        "pf": st.sampled_from(["ens1f0", "ib0"]),
    },
).map(lambda d: {**d, "max_tx_rate": d.get("min_tx_rate", 0) * 2} if d.get("min_tx_rate", 0) % 3 == 0 else d)


@given(st.lists(interface, min_size=1, max_size=32), st.booleans())
@settings(max_examples=60, deadline=None)
def test_every_template_is_valid(interfaces: list[dict[str, Any]], different: bool) -> None:
    names = [i.get("name") for i in interfaces if i.get("name")]
    if len(names) != len(set(names)):
        return  # the parser refuses it, as the annotation's
    request = PodRequest(interfaces=interfaces, different_pfs=different)
    doc = claim_template(request, name="t", network="n")
    valid(doc)
    requests = doc["spec"]["spec"]["devices"]["requests"]
    assert [r["name"] for r in requests] == [request_name(i) for i in range(len(interfaces))]
    for entry, req in zip(request.interfaces, requests, strict=True):
        asked = req["exactly"].get("capacity", {}).get("requests", {}).get(BANDWIDTH)
        assert whole(asked) == (entry.min_tx_rate or None)


def test_the_command_prints_the_template_and_refuses_what_the_annotation_refuses(capsys: Any) -> None:
    import io

    out = io.StringIO()
    assert (
        claim_command.main(["--name", "trainer", "--network", "rail-net", '[{"min_tx_rate": 100}]'], out) == 0
    )
    doc = json.loads(out.getvalue())
    valid(doc)
    assert doc["metadata"]["name"] == "trainer"
    assert (
        "rail-net"
        in doc["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]["expression"]
    )
    assert "resourceClaimTemplateName: trainer" in capsys.readouterr().err
    out = io.StringIO()
    assert claim_command.main(['[{"min_tx_rate": 5, "max_tx_rate": 1}]'], out) == 1
    answer = json.loads(out.getvalue())
    assert answer["code"] == 101 and "max_tx_rate 1 is below min_tx_rate 5" in answer["error"]
    for bad in (["--name", "Bad_Name", "[{}]"], ["--network", "-x", "[{}]"], ["--namespace", "a.b", "[{}]"]):
        with pytest.raises(SystemExit) as exc:
            claim_command.main(bad, io.StringIO())
        assert exc.value.code == 2


# -- the opaque configuration


def good(**kw: Any) -> dict[str, Any]:
    return {"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, **kw}


def test_a_configuration_is_read() -> None:
    config = parse_config(good(max_tx_rate=20000, name="net1-1"), "config[0]")
    assert (config.max_tx_rate, config.name) == (20000, "net1-1")
    assert parse_config(good(), "c").max_tx_rate == 0


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        (good(max_tx_rate=-1), "config[0]: max_tx_rate: Input should be greater than or equal to 0"),
        (good(max_tx_rate=10_000_001), "max_tx_rate: Input should be less than or equal to 10000000"),
        (good(max_tx_rate="20000"), "max_tx_rate: Input should be a valid integer"),
        (good(max_tx_rate=1.5), "max_tx_rate: Input should be a valid integer"),
        (good(min_tx_rate=5), "min_tx_rate: Extra inputs are not permitted"),
        (good(name="a/b"), "name: 'a/b' is not a valid interface name"),
        ({**good(), "kind": "Other"}, "kind: Input should be 'VfConfig'"),
        ({"kind": CONFIG_KIND}, "apiVersion: Field required"),
        (["not", "an", "object"], "parameters must be an object"),
        (None, "parameters must be an object"),
        (good(name="x" * MAX_CONFIG_BYTES), f"the limit is {MAX_CONFIG_BYTES}"),
        (good(name=[[[[["deep"]]]]]), "parameters nest deeper than 4 levels"),
    ],
)
def test_a_bad_configuration_is_code_101_naming_the_field(parameters: Any, says: str) -> None:
    with pytest.raises(InvalidPodRequest) as exc:
        parse_config(parameters, "config[0]")
    assert exc.value.code == 101
    assert says.removeprefix("config[0]: ") in exc.value.msg
    assert exc.value.msg.startswith("config[0]: ")
    assert len(exc.value.msg) < 2048


def test_configurations_apply_class_first_then_claim_in_order() -> None:
    entries = [
        {
            "source": "FromClaim",
            "requests": ["if0"],
            "opaque": {"driver": DRIVER, "parameters": good(max_tx_rate=3)},
        },
        {"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": good(max_tx_rate=1)}},
        {"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {"anything": True}}},
        {
            "source": "FromClaim",
            "requests": ["if1/sub"],
            "opaque": {"driver": DRIVER, "parameters": good(name="x")},
        },
        {"source": "FromClaim", "requests": ["nothere"], "opaque": {"driver": DRIVER, "parameters": good()}},
    ]
    got = configs_of(entries, ["if0", "if1", "if2"], "claim")
    assert got["if0"].max_tx_rate == 3  # the claim's, after the class's
    assert got["if1"].name == "x" and got["if1"].max_tx_rate == 0
    assert got["if2"].max_tx_rate == 1  # the class's, for every request
    assert configs_of(None, ["if0"], "claim") == {}
    with pytest.raises(
        InvalidPodRequest, match=r"claim: config\[0\] \(FromClaim\): apiVersion: Field required; kind"
    ):
        configs_of(
            [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {"kind": "x"}}}],
            ["a"],
            "claim",
        )
    with pytest.raises(InvalidPodRequest, match="expected a list"):
        configs_of(
            [{"requests": "if0", "opaque": {"driver": DRIVER, "parameters": good()}}], ["if0"], "claim"
        )


@pytest.mark.parametrize(
    ("text", "count"),
    [("25000", 25000), ("25k", 25000), ("1Ki", 1024), ("1e3", 1000), (7, 7), ("0", 0)],
)
def test_whole_quantities(text: Any, count: int) -> None:
    assert whole(text) == count


@pytest.mark.parametrize("text", ["1500m", "1.5", "-1", -1, True, None, "1" * 25, "k", 1.0])
def test_not_whole_quantities(text: Any) -> None:
    assert whole(text) is None
