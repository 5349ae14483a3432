"""kubelet and containerd restarted under running pods, and a "reboot" of the simulated node.

A restart of either leaves every running pod as it was: the same sandbox and container, the
same records, the same interfaces and addresses in its namespace; and the agent's NRI plugin
registers with the new containerd (a container created after it gets its devices).

The reboot (docs/deploy.md, "A reboot"): kubelet and containerd stop, then every process of
every pod dies and every pod's network namespace goes (a VF's veth dies with it; the VF comes
back to the host under its own name, as its driver names it at boot), ``/run`` is emptied (a
tmpfs: containerd's state, the agent's socket and DEL spool, Multus' socket, NRI's), and the
PF-side VF settings are reset; ``/var/lib`` stays (containerd's root, kubelet's pods, the
plugin's records and host-local's leases). The one thing of a reboot a test cannot have, a new
kernel boot id, is given to the plugin's state instead: the records, and its note of the boot
last checked, name another boot (as the runtime tier does). containerd and kubelet start again;
kubelet starts the DaemonSets' pods anew and stops the old sandboxes containerd still knows.
Their DELs do not reach rdma-cni: Multus' daemon is a pod that is not up yet, and its shim
answers DEL itself, with success (multus-cni v4.3.0 ``pkg/server/api/shim.go``). The agent's
CNI server releases the old
records when it starts, as records of an earlier boot; the pod, still in the API, runs again in
a new sandbox with new VFs, and nothing of its old one is held.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from typing import Any

from tests.node.conftest import wait_at_rest
from tests.support.node import host, pods
from tests.support.node.node import SECOND_NETWORK, SIM_ROOT, Node, wait_agent_ready
from tests.support.simnode import SimNode
from tests.support.waiting import wait_for

TWO = [
    {"name": "rdma-net", "namespace": "default"},
    {"name": SECOND_NETWORK, "namespace": "default", "cni-args": {pods.REQUEST: [{"min_tx_rate": 1000}]}},
]


def attached(node: Node, namespace: str, name: str) -> dict[str, Any]:
    """What the pod holds, from every side: sandbox, container, records, its namespace's addresses."""
    sandbox = node.sandbox(namespace, name)
    sid = sandbox["status"]["id"]
    (container,) = node.containerd.crictl_json("ps", "--pod", sid)["containers"]
    netns = node.netns(namespace, name)
    out = subprocess.run(
        ["nsenter", f"--net={netns}", "ip", "-j", "-4", "addr", "show"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {
        "sandbox": sid,
        "container": (container["id"], container["state"]),
        "records": sorted(
            (r["ifname"], tuple(v["pci"] for v in r["vfs"]))
            for r in node.record_docs()
            if r["container_id"] == sid
        ),
        "addresses": sorted(
            (link["ifname"], a["local"]) for link in json.loads(out) for a in link.get("addr_info", [])
        ),
    }


def node_ready(node: Node) -> bool:
    doc = node.get("node", node.name)
    return any(c["type"] == "Ready" and c["status"] == "True" for c in doc["status"]["conditions"])


def test_kubelet_and_containerd_restarted_under_running_pods_leave_them_attached(
    node: Node, namespace: str
) -> None:
    assert node.kubelet is not None
    pods.create(
        node,
        pods.pod_manifest(namespace, "steady-a", TWO, [{"min_tx_rate": 2000}]),
        pods.pod_manifest(namespace, "steady-b", "default/rdma-net", [{}, {}]),
    )
    pods.wait_running(node, namespace, ["steady-a", "steady-b"])
    before = {name: attached(node, namespace, name) for name in ("steady-a", "steady-b")}
    assert all(len(v["records"]) for v in before.values()), before

    node.kubelet.stop()
    node.kubelet.start()
    wait_for(lambda: node_ready(node), 120, "the Node Ready after kubelet's restart")
    assert {name: attached(node, namespace, name) for name in before} == before

    assert node.containerd.component is not None
    registered_before = nri_registrations(node.containerd.component.log)
    node.containerd.stop()
    node.containerd.start()
    wait_for(lambda: node_ready(node), 120, "the Node Ready after containerd's restart")
    pods.wait_running(node, namespace, list(before))
    assert {name: attached(node, namespace, name) for name in before} == before
    assert all(
        p["status"]["containerStatuses"][0]["restartCount"] == 0
        for p in (node.pod(namespace, n) for n in before)
        if p is not None
    )

    # The agent registers with the new containerd (it retries every 0.1 s): a pod made once it has
    # still gets its devices. One made before, in that window, gets none: NRI adjusts only the
    # containers created while a plugin is connected (docs/devices.md, containerd 2.4).
    wait_for(
        lambda: nri_registrations(node.containerd.component.log) > registered_before,  # type: ignore[union-attr]
        60,
        "the agent's NRI plugin registered with the restarted containerd",
    )
    pods.create(node, pods.pod_manifest(namespace, "after", "default/rdma-net", [{}]))
    pods.wait_running(node, namespace, ["after"])
    listing = node.exec(namespace, "after", "c", "ls", "/dev/infiniband").split()
    assert "rdma_cm" in listing and any(d.startswith("uverbs") for d in listing), listing

    pods.delete(node, namespace, "steady-a", "steady-b", "after")
    pods.wait_gone(node, namespace, ["steady-a", "steady-b", "after"])
    wait_at_rest(node)


def nri_registrations(log: str) -> int:
    """How many times containerd's log (appended across its restarts) says the agent's plugin connected."""
    with open(log, errors="replace") as f:
        # containerd 2.4 logs the plugin by its index and name, escaped in logfmt.
        return f.read().count('plugin \\"50-rdma-cni\\" connected and synchronized')


def reboot(node: Node) -> None:
    """Everything a reboot takes (the module's docstring), done to the stopped node."""
    assert node.kubelet is not None
    away = [(k, i) for k, i in node.sim.all_vfs() if node.sim.vf_netdev(k, i) not in SimNode.host_links()]
    node.kubelet.stop()
    node.containerd.stop()
    shims = [
        pid
        for pid in host.processes_in_my_namespace()
        if os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("containerd-shim")
    ]
    host.kill_and_wait(shims + host.cgroup_tasks(node.cgroup_root))
    # Every mount below /run goes with the reboot: the pods' network namespaces (a namespace
    # nothing holds is freed, its veths with it) and the containers' root filesystems.
    host.unmount_below("/run")
    node.vfs_back_from_gone_namespaces(away, reboot=True)
    node.mark_as_an_earlier_boot()
    state = node.sim.vf_state()
    state["pfs"] = {}  # VFs are created anew at boot, their settings neutral
    with open(node.sim.vfcontrol, "w") as f:
        json.dump(state, f)
    # /run is a tmpfs: emptied, but for the simulated node's sysfs (the kernel's, made at boot).
    keep = os.path.dirname(SIM_ROOT)
    for entry in os.listdir("/run"):
        path = os.path.join("/run", entry)
        if path == keep:
            for inner in os.listdir(path):
                if os.path.join(path, inner) != SIM_ROOT:
                    _remove(os.path.join(path, inner))
        else:
            _remove(path)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def test_a_reboot_with_containerd_state_kept_is_cleaned_up(node: Node, namespace: str) -> None:
    assert node.kubelet is not None
    pods.create(node, pods.pod_manifest(namespace, "survivor", TWO, [{"min_tx_rate": 3000}, {}]))
    pods.wait_running(node, namespace, ["survivor"])
    old = attached(node, namespace, "survivor")
    assert len(old["records"]) == 2

    reboot(node)
    node.containerd.start()
    node.kubelet.start()
    wait_agent_ready(node, 240)

    def again() -> dict[str, Any] | None:
        if pods.running(node, namespace, "survivor") is None:
            return None
        with contextlib.suppress(AssertionError, ValueError):
            now = attached(node, namespace, "survivor")
            return now if now["sandbox"] != old["sandbox"] else None
        return None

    new = wait_for(again, 240, "the pod running again in a new sandbox")
    assert len(new["records"]) == 2
    # The agent's start released the old sandbox's records; nothing else of it is held.
    wait_for(
        lambda: {r["container_id"] for r in node.record_docs()} == {new["sandbox"]},
        120,
        "only the new sandbox's records",
    )
    pods.delete(node, namespace, "survivor")
    pods.wait_gone(node, namespace, ["survivor"])
    wait_at_rest(node)
