"""The extender reads what kube-scheduler really sends: calls recorded from kube-scheduler v1.37.

``data/kube-scheduler-extender-wire.json`` holds one call of each verb as the
cluster tier's recorder saw it between rdma-scheduler's kube-scheduler and the
extender (filter with NodeNames, prioritize, preempt with MetaVictims, bind);
``RDMA_CNI_RECORD_WIRE=1 make cluster`` records it again. Here each is decoded
by the extender's wire module, and the answers the extender gave are checked
against the shapes kube-scheduler decoded without complaint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.extender import wire

FIXTURE = Path(__file__).parent / "data" / "kube-scheduler-extender-wire.json"


@pytest.fixture(scope="module")
def calls() -> dict[str, dict[str, Any]]:
    doc = json.loads(FIXTURE.read_text())
    assert doc["kubernetes"].startswith("v1.")
    return dict(doc["calls"])


def test_filter_comes_with_node_names_and_the_whole_pod(calls: dict[str, dict[str, Any]]) -> None:
    call = calls["filter"]
    args = wire.parse_filter(call["request"])
    # nodeCacheCapable: names only, no Node objects.
    assert args.nodes is None and args.node_names and args.names == args.node_names
    namespace, name, uid = wire.pod_identity(args.pod)
    assert namespace and name and uid
    assert args.pod["spec"]["schedulerName"] == "rdma-scheduler"
    assert "rdma_interfaces_required" in wire.pod_annotations(args.pod)
    assert call["status"] == 200 and set(call["answer"]) >= {"NodeNames", "FailedNodes"}


def test_prioritize_comes_like_filter_and_is_answered_with_host_priorities(
    calls: dict[str, dict[str, Any]],
) -> None:
    call = calls["prioritize"]
    args = wire.parse_filter(call["request"])
    assert args.node_names and wire.pod_identity(args.pod)[2]
    assert call["status"] == 200 and isinstance(call["answer"], list)
    assert all(set(entry) == {"Host", "Score"} for entry in call["answer"])


def test_preempt_comes_with_meta_victims(calls: dict[str, dict[str, Any]]) -> None:
    call = calls["preempt"]
    assert "NodeNameToMetaVictims" in call["request"]
    args = wire.parse_preempt(call["request"])
    assert args.victims and all(uids for uids in args.victims.values())
    assert all(len(uid) == 36 for uids in args.victims.values() for uid in uids)
    kept = call["answer"]["NodeNameToMetaVictims"]
    assert set(kept) <= set(args.victims)


def test_bind_names_the_pod_its_uid_and_the_node(calls: dict[str, dict[str, Any]]) -> None:
    call = calls["bind"]
    args = wire.parse_bind(call["request"])
    assert args.pod_name and args.pod_namespace and len(args.pod_uid) == 36 and args.node
    assert set(call["request"]) == {"PodName", "PodNamespace", "PodUID", "Node"}
    assert call["status"] == 200 and call["answer"] == wire.bind_result("")
