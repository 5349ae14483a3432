"""A pod whose namespace went without a DEL, on the simulated node: the agent releases it in this boot.

What a lost DEL leaves (Multus' shim answering DEL itself while its daemon is down): the pod's
namespace deleted, its VFs back in the host (the kernel moves a physical netdev home when its
namespace dies; the veth stand-in is moved home by hand, renamed as the kernel would leave it), and
its record, lease and PF-side rate still held. The node agent's CNI server, with its periodic pass
(:mod:`rdma_cni.agent.orphanpass`), releases it; a pod whose namespace is alive is never released,
even with its VFs moved home, and one whose VFs are not back is kept.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from rdma_cni.agent.cniserver import CniServer
from tests.integration.conftest import (
    Cluster,
    assert_node_pristine,
    expected_vf_names,
    host_names,
    ns_name,
    plugin_command,
)
from tests.integration.test_previous_boot import held_vfs, reboot_away, record_path
from tests.support.cniserver import host_state_untouched
from tests.support.simnode import ip
from tests.support.waiting import wait_for


def release_orphans(cluster: Cluster, conf: dict[str, Any]) -> dict[str, Any]:
    """``rdma-cni release-orphans`` for this node's state, as the agent runs it: its answer."""
    proc = subprocess.run(
        [
            *plugin_command(),
            "release-orphans",
            f"--state-dir={cluster.state_dir}",
            f"--lock-file={conf['lockFile']}",
        ],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **cluster.node.env()},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(json.loads(proc.stdout))


def key(pod: dict[str, str]) -> str:
    return f"{pod['CNI_CONTAINERID']}/{pod['CNI_IFNAME']}"


def test_the_agents_pass_releases_a_pod_whose_namespace_went_without_a_del(cluster: Cluster) -> None:
    conf = cluster.conf()
    gone = cluster.pod([{"min_tx_rate": 1000, "max_tx_rate": 2000}, {}], name="gone")
    live = cluster.pod([{"max_tx_rate": 3000}], name="live")
    assert cluster.run("ADD", gone, conf).ok and cluster.run("ADD", live, conf).ok
    with open(record_path(cluster, gone)) as f:
        recorded = json.load(f)
    st = os.stat(gone["CNI_NETNS"])
    assert recorded["netns_id"] == [st.st_dev, st.st_ino]  # the namespace by kernel identity
    reboot_away(cluster, gone)  # no DEL: the namespace deleted, the kernel's VFs home
    assert len(cluster.ipam_allocations()) == 3 and held_vfs(cluster) == 3
    server = CniServer(
        os.path.join(cluster.tmp, "agent", "cni.sock"),
        plugin_command(),
        environ={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **cluster.node.env()},
        states=[(cluster.state_dir, conf["lockFile"])],
        orphan_interval=0.2,
    )
    with host_state_untouched():
        server.start()
        try:
            wait_for(
                lambda: not os.path.exists(record_path(cluster, gone)), 60, "the pass to release the pod"
            )
        finally:
            server.close()
    # Released as a DEL would: names home by identity, its lease and PF-side rate back.
    assert cluster.records == [os.path.basename(record_path(cluster, live))]
    assert len(cluster.ipam_allocations()) == 1 and held_vfs(cluster) == 1
    assert len(expected_vf_names(cluster) - host_names(cluster)) == 1  # the live pod's VF
    rates = [s.get("rate") for t in cluster.node.vf_state()["pfs"].values() for s in t.values()]
    assert [r for r in rates if r and r != [0, 0]] == [[0, 3000]]  # the live pod's only
    # The live pod was never touched: its VF is still in its namespace.
    links = json.loads(ip("-n", ns_name(live), "-j", "link", "show").stdout)
    assert "net1" in {link["ifname"] for link in links}
    assert cluster.run("DEL", live, conf).ok
    assert_node_pristine(cluster)


def test_a_live_namespace_is_never_released_even_with_its_vfs_home(cluster: Cluster) -> None:
    """Moved home by the host's root (no pod can move a netdev into the host's namespace): the
    namespace is still there, so its pod may still run; the pass keeps it, DEL releases it."""
    conf = cluster.conf()
    pod = cluster.pod([{"min_tx_rate": 1000}])
    assert cluster.run("ADD", pod, conf).ok
    ip("-n", ns_name(pod), "link", "set", "dev", "net1", "netns", str(os.getpid()))
    answer = release_orphans(cluster, conf)
    assert answer["released"] == [] and "still its network namespace" in answer["kept"][key(pod)]
    assert os.path.exists(record_path(cluster, pod)) and len(cluster.ipam_allocations()) == 1
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def test_a_namespace_gone_with_its_vfs_not_back_is_kept(cluster: Cluster) -> None:
    """A veth dies with its namespace: nothing proves the VF home, so nothing is released."""
    conf = cluster.conf()
    pod = cluster.pod([{"min_tx_rate": 1000}])
    assert cluster.run("ADD", pod, conf).ok
    ns = ns_name(pod)
    ip("netns", "del", ns)
    cluster.netns_names.remove(ns)
    answer = release_orphans(cluster, conf)
    assert answer["released"] == [] and "not back in the host" in answer["kept"][key(pod)]
    assert os.path.exists(record_path(cluster, pod)) and len(cluster.ipam_allocations()) == 1
    # Once the VF is back (here: made again, as a real one would come home), the pass releases it.
    with open(record_path(cluster, pod)) as f:
        pci = json.load(f)["vfs"][0]["pci"]
    (k, i) = next((k, i) for k, i in cluster.node.all_vfs() if cluster.node.vf_pci(k, i) == pci)
    cluster.node.make_vf_netdev(k, i)
    answer = release_orphans(cluster, conf)
    assert answer["released"] == [key(pod)]
    assert_node_pristine(cluster)
