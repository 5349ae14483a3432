"""A pod with two rdma-cni networks, through rdma-scheduler, kubelet, containerd 2.x and Multus.

The pod selects conf/'s ``rdma-net`` (its request in the pod-wide annotation: two interfaces,
one with rates) and the second rail ``rdma-rail-b`` (its own request in the selection's
``cni-args``: one interface with rates). Checked from every side: the API (where it was bound,
by whom, what Multus wrote), the node (records, leases, PF-side rates, the pod's namespace as
the kernel shows it), the container (what it lists), and after deletion (all of it gone).
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from typing import Any

from tests.node.conftest import wait_at_rest
from tests.support.node import pods
from tests.support.node.node import SECOND_NETWORK, SECOND_SUBNET, Node

FIRST_SUBNET = "192.168.128.0/20"  # conf/network-attachment-definition.yaml's
POD_WIDE = [{"min_tx_rate": 15000, "max_tx_rate": 20000}, {}]
OWN = [{"min_tx_rate": 3000, "max_tx_rate": 4000}]
SELECTIONS = [
    {"name": "rdma-net", "namespace": "default"},
    {"name": SECOND_NETWORK, "namespace": "default", "cni-args": {pods.REQUEST: OWN}},
]


def netns_addresses(netns: str) -> dict[str, list[str]]:
    """Interface -> IPv4 addresses (with prefix) in the namespace at ``netns``, from the kernel."""
    out = subprocess.run(
        ["nsenter", f"--net={netns}", "ip", "-j", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout
    return {
        link["ifname"]: [
            f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", []) if a["family"] == "inet"
        ]
        for link in json.loads(out)
    }


def container_addresses(listing: str) -> dict[str, list[str]]:
    """Interface -> IPv4 addresses from busybox's ``ip -o addr`` in the container."""
    out: dict[str, list[str]] = {}
    for line in listing.splitlines():
        words = line.split()
        if len(words) > 3 and words[2] == "inet":
            out.setdefault(words[1], []).append(words[3])
        elif len(words) > 1:
            out.setdefault(words[1].rstrip(":"), [])
    return out


def records_by_ifname(node: Node, sandbox: str) -> dict[str, dict[str, Any]]:
    return {r["ifname"]: r for r in node.record_docs() if r["container_id"] == sandbox}


def test_two_networks_requests_in_the_annotation_and_in_cni_args(node: Node, namespace: str) -> None:
    name = "two-rails"
    pods.create(node, pods.pod_manifest(namespace, name, SELECTIONS, POD_WIDE))
    pod = pods.wait_running(node, namespace, [name])[name]

    # Placed by rdma-scheduler, which asked its extender about it and bound it there.
    assert pod["spec"]["nodeName"] == node.name
    assert node.scheduler is not None
    for verb in ("filter", "bind"):
        assert f"{namespace}/{name}" in node.scheduler.recorder.pods(verb), verb

    # On the node: one record per attachment, with exactly the VFs and rates asked for, in order.
    sandbox = node.sandbox(namespace, name)["status"]["id"]
    records = records_by_ifname(node, sandbox)
    assert sorted(records) == ["net1", "net2"], records.keys()
    assert records["net1"]["network"] == "rdma-net" and records["net2"]["network"] == SECOND_NETWORK
    for ifname, request in (("net1", POD_WIDE), ("net2", OWN)):
        vfs = records[ifname]["vfs"]
        assert [(v["min_tx_rate"], v["max_tx_rate"]) for v in vfs] == [
            (r.get("min_tx_rate", 0), r.get("max_tx_rate", 0)) for r in request
        ]
        assert records[ifname]["pod"]["namespace"] == namespace and records[ifname]["pod"]["name"] == name
        for v in vfs:  # PF-side, as the simulated PF holds them
            want = [v["min_tx_rate"], v["max_tx_rate"]]
            assert node.pf_settings().get(f"{v['pf']}/{v['vf']}", {}).get("rate", [0, 0]) == want, v
    pod_side = {v["pod_name"] for r in records.values() for v in r["vfs"]}
    assert pod_side == {"net1", "net1-1", "net2"}

    # The kernel's view of the pod's namespace: those interfaces, each with its network's address.
    netns = node.netns(namespace, name)
    kernel = netns_addresses(netns)
    for ifname, subnet in (("net1", FIRST_SUBNET), ("net1-1", FIRST_SUBNET), ("net2", SECOND_SUBNET)):
        (address,) = kernel[ifname]
        assert ipaddress.ip_interface(address).ip in ipaddress.ip_network(subnet), (ifname, address)
    assert len(node.leases("rdma-net")) == 2 and len(node.leases(SECOND_NETWORK)) == 1

    # What Multus wrote in the pod's network-status: the default network, then each interface of
    # each attachment (both of rdma-net's), with the addresses the kernel shows.
    status = pods.network_status(node.pod(namespace, name) or pod)
    assert [(s["name"], s["interface"]) for s in status] == [
        ("node-default", "eth0"),
        ("default/rdma-net", "net1"),
        ("default/rdma-net", "net1-1"),
        (f"default/{SECOND_NETWORK}", "net2"),
    ], status
    for entry in status:
        assert [f"{ip}/" for ip in entry["ips"]] == [
            a.split("/")[0] + "/" for a in kernel[entry["interface"]]
        ]

    # The container sees the same interfaces and addresses (through the CRI).
    seen = container_addresses(node.exec(namespace, name, "c", "ip", "-o", "addr"))
    for ifname in ("net1", "net1-1", "net2"):
        assert seen.get(ifname) == kernel[ifname], (ifname, seen)

    # Deleted: every VF home, no record, no lease, PF-side rates back to none.
    pods.delete(node, namespace, name)
    pods.wait_gone(node, namespace, [name])
    wait_at_rest(node)
