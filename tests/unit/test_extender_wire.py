"""The extender/v1 wire format: parsing what kube-scheduler sends, shaping what it reads back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rdma_cni.extender import wire
from tests.support import sched_objects as so


def test_filter_args_with_full_nodes() -> None:
    doc = so.args_nodes(so.pod("p"), [so.node("n1", None), so.node("n2", None)])
    args = wire.parse_filter(doc)
    assert args.node_names is None and args.names == ["n1", "n2"]
    assert args.pod["metadata"]["name"] == "p"


def test_filter_args_with_node_names_and_lower_case_keys() -> None:
    args = wire.parse_filter({"pod": so.pod("p"), "nodenames": ["a", "b"]})
    assert args.node_names == ["a", "b"] and args.nodes is None
    assert wire.parse_filter({"POD": so.pod("p"), "nodeNames": ["a"]}).names == ["a"]


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "ExtenderArgs: expected an object"),
        ({"NodeNames": []}, "Pod: expected an object"),
        ({"Pod": {}, "NodeNames": None, "Nodes": None}, "carries neither Nodes nor NodeNames"),
        ({"Pod": {}, "NodeNames": ["a", 1]}, "NodeNames: expected a list of node names"),
        ({"Pod": {}, "NodeNames": "a"}, "NodeNames: expected a list of node names"),
        ({"Pod": {}, "Nodes": []}, "Nodes: expected an object"),
        ({"Pod": {}, "Nodes": {"items": [1]}}, "Nodes.items: expected a list of Node objects"),
        ({"Pod": {}, "NodeNames": ["a"] * (wire.MAX_NODES + 1)}, "100001 nodes, the limit is 100000"),
    ],
)
def test_filter_args_refused_with_the_field_named(doc: Any, message: str) -> None:
    with pytest.raises(wire.WireError, match=message):
        wire.parse_filter(doc)


def test_node_without_a_name_is_refused() -> None:
    args = wire.parse_filter({"Pod": {}, "Nodes": {"items": [{"metadata": {}}]}})
    with pytest.raises(wire.WireError, match=r"metadata\.name"):
        _ = args.names


def test_filter_result_answers_in_the_form_asked() -> None:
    names = wire.parse_filter(so.args_names(so.pod("p"), ["a", "b", "c"]))
    out = wire.filter_result(names, ["a"], {"b": "full"}, {"c": "never"})
    assert out == {
        "Nodes": None,
        "NodeNames": ["a"],
        "FailedNodes": {"b": "full"},
        "FailedAndUnresolvableNodes": {"c": "never"},
        "Error": "",
    }
    nodes = [so.node("a", None), so.node("b", None)]
    full = wire.parse_filter(so.args_nodes(so.pod("p"), nodes))
    out = wire.filter_result(full, ["b"], {"a": "full"}, {})
    assert out["NodeNames"] is None
    assert out["Nodes"]["kind"] == "NodeList" and out["Nodes"]["items"] == [nodes[1]]
    assert wire.filter_error("boom") == {
        "Nodes": None,
        "NodeNames": None,
        "FailedNodes": {},
        "FailedAndUnresolvableNodes": {},
        "Error": "boom",
    }


def test_priority_list_shape() -> None:
    expected = [{"Host": "a", "Score": 3}, {"Host": 'b"\u00e9', "Score": 10}]
    assert wire.priority_list([("a", 3), ('b"\u00e9', 10)]) == expected
    assert json.loads(wire.priority_json([("a", 3), ('b"\u00e9', 10)])) == expected
    assert wire.priority_json([]) == b"[]"
    # A 0 is left out: kube-scheduler adds nothing for a node an extender does not list.
    assert json.loads(wire.priority_json([("z", 0), ("a", 3), ("y", 0)])) == [{"Host": "a", "Score": 3}]


def test_preempt_args_meta_victims_and_full_victims() -> None:
    meta = {
        "Pod": so.pod("p"),
        "NodeNameToVictims": None,
        "NodeNameToMetaVictims": {
            "n1": {"Pods": [{"UID": "u1"}, {"UID": "u2"}], "NumPDBViolations": 1},
            "n2": {"Pods": [], "NumPDBViolations": 0},
        },
    }
    args = wire.parse_preempt(meta)
    assert args.victims == {"n1": ("u1", "u2"), "n2": ()}
    assert args.pdb_violations == {"n1": 1, "n2": 0}
    full = {
        "pod": so.pod("p"),
        "nodeNameToVictims": {"n1": {"pods": [so.pod("v", uid="u9")], "numPDBViolations": 2}},
    }
    args = wire.parse_preempt(full)
    assert args.victims == {"n1": ("u9",)} and args.pdb_violations == {"n1": 2}
    assert wire.preempt_result({"n1": ("u1",)}, {"n1": 1}) == {
        "NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": "u1"}], "NumPDBViolations": 1}}
    }


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"Pod": {}, "NodeNameToMetaVictims": []}, "NodeNameToMetaVictims: expected an object"),
        ({"Pod": {}, "NodeNameToMetaVictims": {"n": {"Pods": [{}]}}}, r"n\]\.Pods\[0\]\.UID: expected"),
        ({"Pod": {}, "NodeNameToMetaVictims": {"n": {"Pods": "x"}}}, r"\.Pods: expected a list"),
        (
            {"Pod": {}, "NodeNameToMetaVictims": {"n": {"NumPDBViolations": "1"}}},
            "NumPDBViolations: expected",
        ),
        ({"Pod": {}, "NodeNameToVictims": {"n": {"Pods": [{"metadata": {}}]}}}, r"metadata\.uid: expected"),
    ],
)
def test_preempt_args_refused(doc: Any, message: str) -> None:
    with pytest.raises(wire.WireError, match=message):
        wire.parse_preempt(doc)


def test_bind_args() -> None:
    doc = {"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": "n1"}
    assert wire.parse_bind(doc) == wire.BindArgs("p", "ns", "u", "n1")
    assert wire.parse_bind({"podName": "p", "podNamespace": "ns", "node": "n1"}).pod_uid == ""
    with pytest.raises(wire.WireError, match="Node: expected a non-empty string"):
        wire.parse_bind({"PodName": "p", "PodNamespace": "ns", "Node": ""})
    assert wire.bind_result() == {"Error": ""}


def test_pod_identity_and_annotations() -> None:
    assert wire.pod_identity({"metadata": {"name": "p"}}) == ("default", "p", "")
    with pytest.raises(wire.WireError, match=r"Pod\.metadata: expected an object"):
        wire.pod_identity({})
    with pytest.raises(wire.WireError, match=r"Pod\.metadata\.uid: expected a string"):
        wire.pod_identity({"metadata": {"uid": 5}})
    with pytest.raises(wire.WireError, match="annotations: expected an object"):
        wire.pod_annotations({"metadata": {"annotations": []}})
