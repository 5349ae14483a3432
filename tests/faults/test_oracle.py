"""The fault tier's oracle is not vacuous: each broken promise, made by hand, is reported."""

from __future__ import annotations

import json
import os

from tests.integration.conftest import Cluster
from tests.support.hostview import host_links
from tests.support.invariants import locate_vfs, violations
from tests.support.simnode import ip


def test_oracle_reports_each_broken_promise(cluster: Cluster) -> None:
    node = cluster.node
    before = host_links(node.prefix + "\0")
    assert violations(cluster, [], before, settled=True) == []
    pod = cluster.pod([{}])
    ns = os.path.basename(pod["CNI_NETNS"])
    # A VF moved into a pod with no record; another at home under a wrong name.
    ip("link", "set", node.vf_netdev(0, 0), "netns", ns)
    ip("link", "set", node.vf_netdev(0, 1), "name", f"{node.prefix}zz")
    # A record holding a VF that is at home; an empty lease; a lease nobody holds.
    os.makedirs(os.path.join(cluster.state_dir, "attachments"))
    with open(os.path.join(cluster.state_dir, "attachments", "c1@net1.json"), "w") as f:
        json.dump(
            {"container_id": "c1", "ifname": "net1", "netns": "", "vfs": [{"pci": node.vf_pci(1, 0)}]}, f
        )
    leases = os.path.join(cluster.tmp, "ipam", "rdma-net")
    os.makedirs(leases)
    open(os.path.join(leases, "10.77.0.5"), "w").close()
    with open(os.path.join(leases, "10.77.0.6"), "w") as f:
        f.write("ghost\nnet1")
    assert locate_vfs(node, [ns])[(0, 0)] == [(ns, node.vf_netdev(0, 0))]
    found = "\n".join(violations(cluster, [ns], before, settled=True))
    for needle in (
        f"VF {node.vf_pci(0, 0)} is still in pod {ns}",
        f"VF {node.vf_pci(0, 1)} is in the host as {node.prefix}zz",
        f"VF {node.vf_pci(1, 0)} is at home but still held by record c1@net1.json",
        "records remain after every DEL",
        "lease 10.77.0.5 is empty",
        "lease 10.77.0.6 of ('ghost', 'net1') belongs to no attachment",
        f"unknown link {node.prefix}zz",
    ):
        assert needle in found, found
    unsettled = "\n".join(violations(cluster, [ns], before, settled=False))
    assert (
        f"VF {node.vf_pci(0, 0)} is in pod {ns} as {node.vf_netdev(0, 0)} without exactly one record"
        in unsettled
    )
    # Put things back for the fixture's teardown.
    ip("-n", ns, "link", "set", node.vf_netdev(0, 0), "netns", "1")
    ip("link", "set", f"{node.prefix}zz", "name", node.vf_netdev(0, 1))
