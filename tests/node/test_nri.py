"""The agent's NRI plugin under containerd 2.x (NRI on by default, nothing configured for it).

The simulated node's VFs each have an RDMA device and a uverbs character device in its sysfs
(tests/support/node/node.py, :func:`~tests.support.node.node.give_rdma_devices`), and the node
has ``rdma_cm``. A container of a pod with attachments must get exactly its VFs' uverbs nodes
and ``rdma_cm``, with the numbers sysfs gives and device-cgroup rules for them; a container of a
pod without attachments gets nothing. (That the devices open, and another pod's do not, is the
QEMU tier's, on real RDMA devices.)
"""

from __future__ import annotations

import os
import re

from rdma_cni.agent.nri.plugin import RLIM_INFINITY, grantable_memlock
from tests.node.conftest import wait_at_rest
from tests.support.node import pods
from tests.support.node.node import Node

NRI_STATE = "/run/rdma-cni/nri-state"  # beside the node lock (rdma_cni/node/nristate.py)


def devices_listed(listing: str) -> dict[str, tuple[int, int]]:
    """busybox ``ls -l /dev/infiniband``: character device name -> (major, minor)."""
    out = {}
    for line in listing.splitlines():
        m = re.match(r"^c\S+\s+\d+\s+\S+\s+\S+\s+(\d+),\s+(\d+)\s+.*\s(\S+)$", line)
        if m:
            out[m.group(3)] = (int(m.group(1)), int(m.group(2)))
    return out


def device_rules(node: Node, namespace: str, name: str) -> set[str]:
    """The device cgroup's allow-list of the pod's container (cgroup v1 ``devices.list``)."""
    sid = node.sandbox(namespace, name)["status"]["id"]
    (container,) = node.containerd.crictl_json("ps", "--pod", sid)["containers"]
    spec = node.containerd.crictl_json("inspect", container["id"])["info"]["runtimeSpec"]
    path = spec["linux"]["cgroupsPath"]
    with open(os.path.join("/sys/fs/cgroup/devices", path.lstrip("/"), "devices.list")) as f:
        return set(f.read().split("\n"))


def test_containerd_2_runs_the_agents_nri_plugin_and_it_injects_exactly_the_pods_devices(
    node: Node, namespace: str
) -> None:
    # Registered, as the agent says and as containerd logs it (its own plugin name and index).
    with open(NRI_STATE) as f:
        assert f.read().strip() == "registered"
    assert node.containerd.component is not None
    with open(node.containerd.component.log, errors="replace") as f:
        # containerd 2.4 logs the plugin by its index and name, escaped in logfmt.
        assert 'plugin \\"50-rdma-cni\\" connected and synchronized' in f.read(), "containerd did not log it"

    pods.create(
        node,
        pods.pod_manifest(namespace, "rdma", "default/rdma-net", [{"min_tx_rate": 1000}, {}]),
        pods.pod_manifest(namespace, "plain", None),
    )
    pods.wait_running(node, namespace, ["rdma", "plain"])

    sid = node.sandbox(namespace, "rdma")["status"]["id"]
    (record,) = [r for r in node.record_docs() if r["container_id"] == sid]
    want = {
        f"uverbs{node.rdma_devices[v['host_name']][1] - 192}": node.rdma_devices[v["host_name"]]
        for v in record["vfs"]
    }
    want["rdma_cm"] = (10, 58)
    got = devices_listed(node.exec(namespace, "rdma", "c", "ls", "-l", "/dev/infiniband"))
    assert got == want
    rules = device_rules(node, namespace, "rdma")
    for major, minor in want.values():
        # containerd 2.4 allows an NRI-injected device "rw" (1.7 gave "rwm"): open, not mknod.
        assert {f"c {major}:{minor} rw", f"c {major}:{minor} rwm"} & rules, (major, minor, sorted(rules))

    # A pod without attachments: no device, no rule for one.
    plain = node.exec(namespace, "plain", "c", "sh", "-c", "ls /dev/infiniband 2>&1; true")
    assert "No such file or directory" in plain, plain
    assert not [r for r in device_rules(node, namespace, "plain") if r.startswith("c 231:")]

    # RLIMIT_MEMLOCK: raised to unlimited for the attached pod's container where the runtime can
    # raise it; on a host without CAP_SYS_RESOURCE (this project's sandboxes) the agent asks for
    # no raise (runc would fail the container) and says so: both keep the runtime's limit.
    limits = {n: node.exec(namespace, n, "c", "sh", "-c", "ulimit -l").strip() for n in ("rdma", "plain")}
    if grantable_memlock(RLIM_INFINITY)[0] is None:
        assert "cannot raise RLIMIT_MEMLOCK" in node.agent_log()
        assert limits["rdma"] == limits["plain"], limits
    else:
        assert limits["rdma"] == "unlimited" and limits["plain"] != "unlimited", limits

    pods.delete(node, namespace, "rdma", "plain")
    pods.wait_gone(node, namespace, ["rdma", "plain"])
    wait_at_rest(node)
