"""Records and node state across one version up and down: what one version writes, the other reads."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.node import record
from rdma_cni.node.record import Attachment, PodInfo, RecordStore, VfRecord, parse_attachment
from rdma_cni.shared import nodestate
from rdma_cni.shared.nodestate import Allocation, InterfaceUse, NodeState, PfSummary

# What a schema-1 writer writes, frozen: a key added here without a schema bump is caught below,
# and so is a key removed (an older reader would find its record unreadable). `pod_index` joined
# schema 1 in the release that brought this rule (records before it read it as 0; the release
# before cannot read it: docs/protocol.md says what a downgrade across it does).
SCHEMA_1_ATTACHMENT = {
    "container_id", "ifname", "network", "netns", "cni_version", "state", "pod",
    "created_at", "vfs", "result", "schema",
}  # fmt: skip
SCHEMA_1_VF = {
    "pf", "vf", "pci", "host_name", "host_mac", "host_mtu", "pod_name", "min_tx_rate", "max_tx_rate",
    "pf_original", "pf_applied", "mac", "mtu", "ipam", "rdma_device", "rdma_action", "pod_index",
}  # fmt: skip
SCHEMA_1_POD = {"namespace", "name", "uid"}
# Schema 2 added these, each one a schema-1 reader ignores when it releases (the boot a record was
# written in, and what releases its IPAM without the network's configuration: rdma_cni.node.boot).
SCHEMA_2_ADDED = {"boot_id", "ipam_conf", "cni_path"}
SCHEMA_2_ATTACHMENT = SCHEMA_1_ATTACHMENT | SCHEMA_2_ADDED
# Schema 3 added the pod namespace's kernel identity (what the same-boot release of an attachment
# whose DEL was lost compares: rdma_cni.node.orphans); a schema-2 reader ignores it.
SCHEMA_3_ADDED = {"netns_id"}
SCHEMA_3_ATTACHMENT = SCHEMA_2_ATTACHMENT | SCHEMA_3_ADDED
BOOT_ID = "0f5c8a2e-4b1d-4c3e-9a7f-1e2d3c4b5a69"


def attachment() -> Attachment:
    vf = VfRecord("ens1f0", 3, "0000:5e:00.3", "ens1f0v3", "02:00:00:00:00:03", 1500, "net1", 1000, 2000)
    return Attachment(
        "c" * 64,
        "net1",
        "rdma-net",
        "/var/run/netns/p",
        "1.1.0",
        state="ready",
        pod=PodInfo("team-a", "trainer-0", "uid-1"),
        created_at=1.5,
        vfs=[vf],
    )


def next_schema(att: Attachment) -> dict[str, Any]:
    """``att`` as the next version writes it: schema 3, with keys at every level this one does not know."""
    doc = json.loads(att.to_json())
    doc["schema"] = record.NEXT_SCHEMA
    doc["placement_hint"] = {"rail": "rail-0"}
    doc["pod"]["priority"] = 7
    doc["vfs"][0]["restore_queues"] = 8
    return doc


def test_this_schema_writes_exactly_the_frozen_keys() -> None:
    doc = json.loads(attachment().to_json())
    assert record.SCHEMA == 3
    assert set(doc) == SCHEMA_3_ATTACHMENT
    assert set(doc["vfs"][0]) == SCHEMA_1_VF
    assert set(doc["pod"]) == SCHEMA_1_POD


def test_a_record_of_the_previous_release_is_read() -> None:
    # Only the keys without defaults, as the oldest schema-1 writer's, and no schema key at all.
    vf = {k: v for k, v in asdict(attachment().vfs[0]).items() if k in ("pf", "vf", "pci", "host_name")}
    vf |= {"host_mac": "02:00:00:00:00:03", "host_mtu": 1500, "pod_name": "net1"}
    doc = {"container_id": "c" * 64, "ifname": "net1", "network": "n", "netns": "/p", "cni_version": "1.0.0"}
    att = parse_attachment(json.dumps({**doc, "vfs": [vf]}))
    assert att.state == "adding" and att.schema == record.OLDEST_SCHEMA and att.vfs[0].rdma_action == ""
    assert (att.boot_id, att.ipam_conf, att.cni_path) == ("", None, [])


def test_a_schema_1_record_as_the_version_before_writes_it_is_read_with_the_new_keys_defaulted() -> None:
    doc = json.loads(attachment().to_json())
    for key in SCHEMA_2_ADDED | SCHEMA_3_ADDED:
        del doc[key]
    doc["schema"] = 1
    att = parse_attachment(json.dumps(doc))
    expected = attachment()
    expected.schema = 1
    assert att == expected and att.boot_id == ""


def test_a_schema_1_record_with_a_schema_2_key_is_corrupt() -> None:
    doc = json.loads(attachment().to_json())
    doc["schema"] = 1
    doc["boot_id"] = BOOT_ID
    del doc["ipam_conf"], doc["cni_path"], doc["netns_id"]
    with pytest.raises(ValueError, match=r"unknown keys \['boot_id'\] in a schema 1 record"):
        parse_attachment(json.dumps(doc))


def test_a_schema_2_record_as_the_version_before_writes_it_is_read_without_an_identity() -> None:
    doc = json.loads(attachment().to_json())
    del doc["netns_id"]
    doc["schema"] = 2
    att = parse_attachment(json.dumps(doc))
    expected = attachment()
    expected.schema = 2
    assert att == expected and att.netns_id == []


def test_a_schema_2_record_with_a_schema_3_key_is_corrupt() -> None:
    doc = json.loads(attachment().to_json())
    doc["schema"] = 2
    doc["netns_id"] = [4, 4026532000]
    with pytest.raises(ValueError, match=r"unknown keys \['netns_id'\] in a schema 2 record"):
        parse_attachment(json.dumps(doc))


def test_the_namespace_identity_round_trips() -> None:
    att = attachment()
    att.netns_id = [4, 4026532000]
    assert parse_attachment(att.to_json()) == att


def test_the_schema_2_keys_round_trip() -> None:
    att = attachment()
    att.boot_id = BOOT_ID
    att.ipam_conf = {"cniVersion": "1.1.0", "name": "rdma-net", "ipam": {"type": "host-local"}}
    att.cni_path = ["/opt/cni/bin"]
    assert parse_attachment(att.to_json()) == att


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("boot_id", "not-a-boot-id", "boot_id must be a boot id"),
        ("boot_id", BOOT_ID.upper(), "boot_id must be a boot id"),
        ("boot_id", 7, "boot_id must be a boot id"),
        ("ipam_conf", ["host-local"], "ipam_conf must be an object"),
        ("cni_path", "/opt/cni/bin", "cni_path must be a list"),
        ("cni_path", [1], "cni_path must be a list"),
        ("created_at", "yesterday", "created_at must be a number"),
        ("created_at", True, "created_at must be a number"),
        ("netns_id", [4], "netns_id must be"),
        ("netns_id", [4, -1], "netns_id must be"),
        ("netns_id", [4, "4026532000"], "netns_id must be"),
        ("netns_id", {"dev": 4}, "netns_id must be"),
        ("netns_id", [True, 4026532000], "netns_id must be"),
    ],
)
def test_bad_schema_2_values_are_corrupt(key: str, value: Any, message: str) -> None:
    doc = json.loads(attachment().to_json())
    doc[key] = value
    with pytest.raises((ValueError, TypeError), match=message):
        parse_attachment(json.dumps(doc))


def test_ipam_release_conf_keeps_the_operators_configuration_only() -> None:
    doc = {
        "cniVersion": "1.1.0",
        "name": "rdma-net",
        "type": "rdma-cni",
        "ipam": {"type": "host-local"},
        "args": {"cni": {"written": "by a pod"}},
        "runtimeConfig": {"ips": ["10.0.0.9/24"]},
        "prevResult": {"ips": []},
    }
    assert record.ipam_release_conf(doc) == {
        "cniVersion": "1.1.0",
        "name": "rdma-net",
        "type": "rdma-cni",
        "ipam": {"type": "host-local"},
    }


def test_a_record_of_the_next_version_is_read_without_its_additions() -> None:
    """After a rollback, this version reads what the newer one allocated, to release it."""
    att = parse_attachment(json.dumps(next_schema(attachment())))
    expected = attachment()
    expected.schema = record.NEXT_SCHEMA
    assert att == expected


def test_unknown_keys_in_this_schema_are_still_corrupt() -> None:
    doc = next_schema(attachment())
    doc["schema"] = record.SCHEMA
    with pytest.raises(ValueError, match=r"unknown keys \['placement_hint'\]"):
        parse_attachment(json.dumps(doc))


@pytest.mark.parametrize("schema", [0, -1, record.SCHEMA + 2, "1", "2", None, True, 2.0])
def test_other_schemas_are_unreadable(schema: Any) -> None:
    doc = json.loads(attachment().to_json())
    doc["schema"] = schema
    with pytest.raises(ValueError, match="record schema"):
        parse_attachment(json.dumps(doc))


def test_the_store_holds_a_next_version_record_as_allocated(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = RecordStore(str(state))
    store.ensure()
    att = attachment()
    Path(store.path(att.container_id, att.ifname)).write_text(json.dumps(next_schema(att)))
    unreadable: list[str] = []
    [read] = store.all(unreadable)
    assert unreadable == [] and read.vfs[0].pci == "0000:5e:00.3"


def _state(version: int) -> NodeState:
    return NodeState(
        version=version,
        generation=3,
        updated="2026-11-26T08:00:00Z",
        pfs=(
            PfSummary(
                "ens1f0",
                capacity_tx_rate=100_000,
                used_tx_rate=1_000,
                capacity_vfs=8,
                used_vfs=1,
                numa_node=0,
            ),
        ),
        allocations=(Allocation("team-a", "trainer-0", "uid-1", (InterfaceUse("ens1f0", 1_000, 2_000),)),),
    )


def test_node_state_written_by_a_newer_agent_is_read() -> None:
    """An extender one version back reads a newer agent's state: added keys and trailing entries ignored."""
    doc = json.loads(nodestate.encode(_state(nodestate.VERSION_2)))
    doc["pfs"][0].append("a-new-trailing-entry")
    doc["allocations"][0].append({"new": True})
    doc["drain"] = False
    assert nodestate.decode(json.dumps(doc)) == _state(nodestate.VERSION_2)


def test_node_state_of_an_older_agent_is_read() -> None:
    old = nodestate.decode(nodestate.encode(_state(1)))
    new = nodestate.decode(nodestate.encode(_state(nodestate.VERSION_2)))
    assert (old.pfs, old.allocations) == (new.pfs, new.allocations)
