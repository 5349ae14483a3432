"""A VF is never lost, never held hostage, never given to the wrong pod (issue 16, items 1-5).

Through the plugin process on the simulated node, whose VFs are veths: a VF's
kernel identity there is its peer (the "wire" that stays in the host), which
a pod cannot forge. Pods here behave as adversaries do: they rename their
VFs, create decoys named and aliased like them, and records get lost or
corrupted.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from typing import Any

import pytest

from tests.integration.conftest import (
    Cluster,
    addresses_in,
    assert_node_pristine,
    expected_vf_names,
    host_names,
    ns_name,
)
from tests.support.simnode import SimNode, SimPf, ip

ONE_PF_TWO_VFS = [SimPf("simpf0", 2, 25000)]


def _record_path(cluster: Cluster, pod: dict[str, str], ifname: str = "net1") -> str:
    return os.path.join(cluster.state_dir, "attachments", f"{pod['CNI_CONTAINERID']}@{ifname}.json")


def _pending_dir(cluster: Cluster) -> str:
    return os.path.join(cluster.state_dir, "ipam-pending")


def _pending(cluster: Cluster) -> list[str]:
    d = _pending_dir(cluster)
    return sorted(n for n in os.listdir(d) if not n.startswith(".")) if os.path.isdir(d) else []


def _links(ns: str) -> dict[str, dict[str, Any]]:
    out = subprocess.run(["ip", "-n", ns, "-j", "-d", "link"], capture_output=True, text=True, check=True)
    return {link["ifname"]: link for link in json.loads(out.stdout)}


def _host_index(name: str) -> int:
    out = subprocess.run(["ip", "-j", "link", "show", name], capture_output=True, text=True, check=True)
    return int(json.loads(out.stdout)[0]["ifindex"])


def _is_vf(cluster: Cluster, ns: str, ifname: str, k: int, i: int) -> bool:
    """Does ``ifname`` in ``ns`` have VF (k, i)'s wire as its peer in the host?"""
    link = _links(ns)[ifname]
    return link.get("link_index") == _host_index(cluster.node.vf_wire(k, i)) and "link_netnsid" in link


# -- item 1: IPAM failures never hold a VF ----------------------------------


@pytest.mark.node(ONE_PF_TWO_VFS)
@pytest.mark.parametrize("breakage", ["ranges", "cni_args"])
def test_ipam_refusing_cleanup_never_holds_the_vf(cluster: Cluster, breakage: str) -> None:
    good = cluster.conf()
    if breakage == "ranges":
        broken = cluster.conf()
        broken["ipam"]["ranges"] = True  # host-local refuses this config on ADD and on DEL alike
        pod = cluster.pod([{}, {}])
    else:
        broken = good
        pod = cluster.pod([{}, {}])
        pod["CNI_ARGS"] += ";IP=not-an-address"  # host-local rejects it on ADD and on DEL alike
    failed = cluster.run("ADD", pod, broken)
    assert failed.doc is not None and failed.doc["code"] == 104, failed.doc
    # Both VFs are home, no record holds them, the IPAM release is remembered on its own.
    assert host_names(cluster) == expected_vf_names(cluster)
    assert cluster.records == []
    assert _pending(cluster) == [f"{pod['CNI_CONTAINERID']}@net1.json"]
    path = os.path.join(_pending_dir(cluster), _pending(cluster)[0])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with open(path) as f:
        item = json.load(f)
    # IPAM ADD failed on the first interface: only its release is pending.
    assert item["interfaces"] == ["net1"] and item["network"] == "rdma-net"
    assert item["conf"]["ipam"] == broken["ipam"] and item["netns"] == pod["CNI_NETNS"]
    # The next pod gets both VFs.
    other = cluster.pod([{}, {}])
    assert cluster.run("ADD", other, good).ok
    assert cluster.run("DEL", other, good).ok
    # STATUS keeps serving and says an IPAM release is pending.
    status = cluster.run("STATUS", {}, good)
    assert status.ok and "1 attachment(s) have an IPAM release pending" in status.stderr
    # DEL with the same broken input retries and reports IPAM's own code.
    again = cluster.run("DEL", pod, broken)
    assert again.doc is not None and again.doc["code"] == 104 and "pending" in again.doc["msg"], again.doc
    assert len(_pending(cluster)) == 1
    # GC (its own environment, the fixed config) finishes it.
    gc = cluster.run("GC", {}, {**good, "cni.dev/valid-attachments": []})
    assert gc.ok, gc.doc
    assert _pending(cluster) == []
    assert cluster.run("DEL", pod, good).ok
    assert_node_pristine(cluster)


@pytest.mark.node(ONE_PF_TWO_VFS)
def test_del_retries_pending_ipam_and_gc_reports_what_still_fails(cluster: Cluster) -> None:
    broken = cluster.conf()
    broken["ipam"]["ranges"] = True
    pod = cluster.pod([{}])
    assert cluster.run("ADD", pod, broken).doc["code"] == 104  # type: ignore[index]
    gc = cluster.run("GC", {}, {**broken, "cni.dev/valid-attachments": []})
    assert gc.doc is not None and gc.doc["code"] == 108 and pod["CNI_CONTAINERID"] in gc.doc["details"]
    assert len(_pending(cluster)) == 1
    # DEL of the same attachment with the operator's fixed config clears it.
    fixed = cluster.conf()
    done = cluster.run("DEL", pod, fixed)
    assert done.ok, done.doc
    assert _pending(cluster) == []
    assert_node_pristine(cluster)


def test_add_finishes_a_pending_ipam_release_of_the_same_attachment_first(cluster: Cluster) -> None:
    broken = cluster.conf()
    broken["ipam"]["ranges"] = True
    pod = cluster.pod([{}])
    assert cluster.run("ADD", pod, broken).doc["code"] == 104  # type: ignore[index]
    # ADD again with the same broken config: the old release cannot finish, ADD says so (104).
    again = cluster.run("ADD", pod, broken)
    assert again.doc is not None and again.doc["code"] == 104 and "pending" in again.doc["msg"], again.doc
    assert host_names(cluster) == expected_vf_names(cluster)
    # Fixed: the old release finishes first, then ADD allocates; the lease stays with the pod.
    good = cluster.conf()
    assert cluster.run("ADD", pod, good).ok
    assert _pending(cluster) == [] and len(cluster.ipam_allocations()) == 1
    assert cluster.run("DEL", pod, good).ok
    assert_node_pristine(cluster)


def test_another_networks_stuck_release_never_fails_this_networks_verbs(cluster: Cluster) -> None:
    # Network "other", whose IPAM config host-local refuses, leaves a release that cannot finish
    # for the same container ID and ifname this network then uses.
    other = cluster.conf(name="other")
    other["ipam"]["ranges"] = True
    pod = cluster.pod([{}])
    assert cluster.run("ADD", pod, other).doc["code"] == 104  # type: ignore[index]
    assert len(_pending(cluster)) == 1
    good = cluster.conf()
    add = cluster.run("ADD", pod, good)
    assert add.ok, add.doc
    done = cluster.run("DEL", pod, good)
    assert done.ok, done.doc
    # Still remembered for its own network, whose DEL and GC keep reporting it.
    assert len(_pending(cluster)) == 1
    gc = cluster.run("GC", {}, {**other, "cni.dev/valid-attachments": []})
    assert gc.doc is not None and gc.doc["code"] == 108, gc.doc
    fixed = cluster.conf(name="other")
    assert cluster.run("GC", {}, {**fixed, "cni.dev/valid-attachments": []}).ok
    assert _pending(cluster) == []
    assert_node_pristine(cluster)


# -- item 2: DEL without a usable record -------------------------------------


def _spoil(cluster: Cluster, pod: dict[str, str], how: str) -> None:
    path = _record_path(cluster, pod)
    if how == "missing":
        os.unlink(path)
        return
    with open(path) as f:
        rec = json.load(f)
    if how == "empty":
        rec["vfs"] = []
    else:
        for vf in rec["vfs"]:
            vf["pci"] = "0000:ee:1f.7"
    with open(path, "w") as f:
        json.dump(rec, f)


@pytest.mark.parametrize("how", ["missing", "empty", "wrong-pci"])
def test_del_without_usable_record_returns_the_vfs_in_the_pod(cluster: Cluster, how: str) -> None:
    conf = cluster.conf()
    pod = cluster.pod([{}, {}])
    assert cluster.run("ADD", pod, conf).ok
    _spoil(cluster, pod, how)
    done = cluster.run("DEL", pod, conf)
    assert done.ok, done.doc
    assert set(addresses_in(ns_name(pod))) == {"lo"}
    assert_node_pristine(cluster)
    again = cluster.pod([{}, {}])
    assert cluster.run("ADD", again, conf).ok
    assert cluster.run("DEL", again, conf).ok
    assert_node_pristine(cluster)


@pytest.mark.node([SimPf("simpf0", 1, 25000)])
def test_a_vf_home_without_its_record_never_passes_its_vlan_or_trust_on(cluster: Cluster) -> None:
    """A lost record took the VF's PF-side originals with it: the next network's pod starts from defaults."""
    tenant_a = cluster.conf(vlan=12, vlanQoS=3, trust=True)
    first = cluster.pod([{}])
    assert cluster.run("ADD", first, tenant_a).ok
    _spoil(cluster, first, "missing")
    assert cluster.run("DEL", first, tenant_a).ok
    # Home, but still on tenant A's VLAN and trusted: nothing recorded what to restore.
    left = cluster.node.vf_state()["pfs"]["simpf0"]["0"]
    assert left["vlan"] == [12, 3] and left["trust"] is True
    plain = cluster.conf()
    second = cluster.pod([{}])
    assert cluster.run("ADD", second, plain).ok
    during = cluster.node.vf_state()["pfs"]["simpf0"]["0"]
    assert during["vlan"] == [0, 0] and during["trust"] is False, during
    # Its DEL puts back what it found, as for every setting it changed.
    assert cluster.run("DEL", second, plain).ok
    after = cluster.node.vf_state()["pfs"]["simpf0"]["0"]
    assert after["vlan"] == [12, 3] and after["trust"] is True
    # A network that sets them gets its own values, whatever the VF had.
    third = cluster.pod([{}])
    assert cluster.run("ADD", third, cluster.conf(vlan=7, trust=False)).ok
    assert cluster.node.vf_state()["pfs"]["simpf0"]["0"]["vlan"] == [7, 0]
    assert cluster.run("DEL", third, plain).ok
    assert_node_pristine(cluster)


def test_recordless_del_leaves_another_attachments_vfs_in_the_same_pod(cluster: Cluster) -> None:
    conf = cluster.conf()
    pod = cluster.pod([{}])
    second = {**pod, "CNI_IFNAME": "net2"}
    assert cluster.run("ADD", pod, conf).ok
    assert cluster.run("ADD", second, conf).ok
    os.unlink(_record_path(cluster, pod))
    assert cluster.run("DEL", pod, conf).ok
    assert set(addresses_in(ns_name(pod))) == {"lo", "net2"}
    assert cluster.records == [f"{pod['CNI_CONTAINERID']}@net2.json"]
    assert cluster.run("DEL", second, conf).ok
    assert_node_pristine(cluster)


# -- item 3: a corrupt record does not block the node, nor give a VF twice --


@pytest.mark.node(ONE_PF_TWO_VFS)
def test_corrupt_record_is_set_aside_and_its_vf_is_never_given_again(cluster: Cluster) -> None:
    conf = cluster.conf()
    first = cluster.pod([{}])
    assert cluster.run("ADD", first, conf).ok
    assert _is_vf(cluster, ns_name(first), "net1", 0, 0)
    with open(_record_path(cluster, first), "w") as f:
        f.write('{"schema": 1, "vfs": [')
    # The node keeps serving: the next pod gets the other VF, not the one still in the first pod.
    second = cluster.pod([{}])
    out = cluster.run("ADD", second, conf)
    assert out.ok, out.doc
    assert _is_vf(cluster, ns_name(second), "net1", 0, 1)
    assert "set aside" in out.stderr
    (kept,) = os.listdir(os.path.join(cluster.state_dir, "quarantine"))
    assert kept.startswith(f"{first['CNI_CONTAINERID']}@net1.json.")
    # No VF is home: the third pod is refused (100), never handed the first pod's VF.
    third = cluster.pod([{}])
    full = cluster.run("ADD", third, conf)
    assert full.doc is not None and full.doc["code"] == 100, full.doc
    # DEL of the first pod finds its VF by identity and returns it; the third pod then fits.
    assert cluster.run("DEL", first, conf).ok
    assert set(addresses_in(ns_name(first))) == {"lo"}
    assert cluster.run("ADD", third, conf).ok
    assert _is_vf(cluster, ns_name(third), "net1", 0, 0)
    for pod in (second, third):
        assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


# -- item 4: orphaned temporary files ------------------------------------------


def test_gc_removes_orphaned_temporary_files_only(cluster: Cluster) -> None:
    conf = cluster.conf()
    live = os.getpid()
    planted = {}
    for sub in ("attachments", "ipam-pending"):
        d = os.path.join(cluster.state_dir, sub)
        os.makedirs(d, exist_ok=True)
        # 2**22 + 1 is above the kernel's largest pid_max: no such writer.
        for label, pid, age in (("dead", 2**22 + 1, 0), ("old", live, 120), ("fresh", live, 0)):
            path = os.path.join(d, f".tmp-{pid}-c{label}@net1.json")
            with open(path, "w") as f:
                f.write("{")
            if age:
                then = time.time() - age
                os.utime(path, (then, then))
            planted[(sub, label)] = path
    gc = cluster.run("GC", {}, {**conf, "cni.dev/valid-attachments": []})
    assert gc.ok, gc.doc
    for (_sub, label), path in planted.items():
        # Writer gone or older than a minute: removed; a live writer's fresh file stays.
        assert os.path.exists(path) == (label == "fresh"), path


# -- item 5: a pod cannot swap its VF for a decoy ------------------------------


def _swap_in_decoy(cluster: Cluster, pod: dict[str, str]) -> str:
    """The pod renames its VF and puts a veth named and aliased like it in its place."""
    ns = ns_name(pod)
    with open(_record_path(cluster, pod)) as f:
        pci = json.load(f)["vfs"][0]["pci"]
    ip("-n", ns, "link", "set", "net1", "down")
    ip("-n", ns, "link", "set", "net1", "name", "hidden0")
    ip("-n", ns, "link", "add", "net1", "type", "veth", "peer", "name", "decoyp")
    ip("-n", ns, "link", "set", "net1", "alias", f"rdma-cni:{pci}")
    ip("-n", ns, "link", "set", "net1", "up")
    return ns


@pytest.mark.node(ONE_PF_TWO_VFS)
def test_del_returns_the_real_vf_and_leaves_the_decoy(cluster: Cluster) -> None:
    conf = cluster.conf()
    pod = cluster.pod([{}])
    assert cluster.run("ADD", pod, conf).ok
    ns = _swap_in_decoy(cluster, pod)
    done = cluster.run("DEL", pod, conf)
    assert done.ok, done.doc
    assert set(_links(ns)) == {"lo", "net1", "decoyp"}  # the decoy stays with its pod
    assert_node_pristine(cluster)
    # Every VF in the host is the real one: the next pods get real VFs, never the decoy.
    pods = [cluster.pod([{}]), cluster.pod([{}])]
    for i, nxt in enumerate(pods):
        assert cluster.run("ADD", nxt, conf).ok
        assert _is_vf(cluster, ns_name(nxt), "net1", 0, i)
    for nxt in pods:
        assert cluster.run("DEL", nxt, conf).ok
    assert_node_pristine(cluster)


def test_check_reports_a_swapped_vf(cluster: Cluster) -> None:
    conf = cluster.conf(ipam=None)
    pod = cluster.pod([{}])
    add = cluster.run("ADD", pod, conf)
    assert add.ok and add.doc is not None
    assert cluster.run("CHECK", pod, cluster.check_conf(conf, add.doc)).ok
    ns = _swap_in_decoy(cluster, pod)
    # Same MAC as ADD reported, so only identity can tell them apart.
    ip("-n", ns, "link", "set", "net1", "address", add.doc["interfaces"][0]["mac"])
    out = cluster.run("CHECK", pod, cluster.check_conf(conf, add.doc))
    assert out.doc is not None and out.doc["code"] == 106 and "is not VF" in out.doc["msg"], out.doc
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def test_gc_returns_the_real_vf_and_leaves_the_decoy(cluster: Cluster) -> None:
    conf = cluster.conf()
    pod = cluster.pod([{}])
    assert cluster.run("ADD", pod, conf).ok
    ns = _swap_in_decoy(cluster, pod)
    gc = cluster.run("GC", {}, {**conf, "cni.dev/valid-attachments": []})
    assert gc.ok, gc.doc
    assert set(_links(ns)) == {"lo", "net1", "decoyp"}
    assert_node_pristine(cluster)


def test_add_never_takes_a_host_netdev_that_only_looks_like_a_vf(cluster: Cluster) -> None:
    """A host link under a VF's name is not that VF unless the kernel says so."""
    conf = cluster.conf()
    name = cluster.node.vf_netdev(0, 0)
    renamed = f"{cluster.node.prefix}x"
    ip("link", "set", name, "name", renamed)
    ip("link", "add", name, "type", "veth", "peer", "name", f"{cluster.node.prefix}y")
    try:
        pods = [cluster.pod([{}]) for _ in cluster.node.all_vfs()]
        for p in pods:
            out = cluster.run("ADD", p, conf)
            assert out.ok, out.doc
            assert _is_vf(cluster, ns_name(p), "net1", *_which_vf(cluster, ns_name(p)))
        # The real VF went to a pod under its current name; the look-alike stayed in the host.
        assert name in SimNode.host_links() and renamed not in SimNode.host_links()
        for p in pods:
            assert cluster.run("DEL", p, conf).ok
        assert renamed in SimNode.host_links()
    finally:
        ip("link", "del", name, check=False)
        ip("link", "set", renamed, "name", name, check=False)
    assert_node_pristine(cluster)


@pytest.mark.parametrize("pod_name_free_in_host", [True, False])
def test_del_names_the_vf_spare_when_its_host_name_was_taken(
    cluster: Cluster, pod_name_free_in_host: bool
) -> None:
    """Someone took the VF's host name meanwhile: DEL still brings the VF home, named ``rvf<hash>``.

    With the pod-side name free in the host the kernel moves the link under
    it and then refuses the rename: the VF is in the host, and its old index
    in the pod names nothing (or whatever the pod put there). DEL finds it
    again by identity. With both names taken the kernel refuses the move.
    """
    from rdma_cni.node.vfnetdev import fallback_name

    conf = cluster.conf()
    pod = cluster.pod([{}])
    pod["CNI_IFNAME"] = podside = f"{cluster.node.prefix}q"
    assert cluster.run("ADD", pod, conf).ok
    with open(_record_path(cluster, pod, podside)) as f:
        vf = json.load(f)["vfs"][0]
    squatters = [vf["host_name"]] + ([] if pod_name_free_in_host else [podside])
    try:
        for n, name in enumerate(squatters):
            ip("link", "add", name, "type", "veth", "peer", "name", f"{cluster.node.prefix}s{n}")
        done = cluster.run("DEL", pod, conf)
        assert done.ok, done.doc
        assert "is taken; naming it" in done.stderr
        spare = fallback_name(vf["pci"])
        assert spare in SimNode.host_links() and podside not in _links(ns_name(pod))
        k, i = next(
            (k, i) for k, i in cluster.node.all_vfs() if cluster.node.vf_netdev(k, i) == vf["host_name"]
        )
        out = subprocess.run(
            ["ip", "-j", "-d", "link", "show", spare], capture_output=True, text=True, check=True
        )
        home = json.loads(out.stdout)[0]
        # In the host its peer is the VF's wire, in the same namespace.
        assert home.get("link") == cluster.node.vf_wire(k, i) and "link_netnsid" not in home, home
        assert cluster.records == []
        # Named spare, it is still free: the next pod gets it.
        nxt = cluster.pod([{}])
        assert cluster.run("ADD", nxt, conf).ok
        assert _is_vf(cluster, ns_name(nxt), "net1", k, i)
    finally:
        for name in squatters:
            ip("link", "del", name, check=False)
    # The next pod took it named spare, and DEL gives it back under that name
    # (its name when taken); the operator may rename it.
    assert cluster.run("DEL", nxt, conf).ok
    assert spare in SimNode.host_links()
    ip("link", "set", spare, "name", vf["host_name"])
    assert_node_pristine(cluster)


def _which_vf(cluster: Cluster, ns: str) -> tuple[int, int]:
    peer = _links(ns)["net1"].get("link_index")
    for k, i in cluster.node.all_vfs():
        if _host_index(cluster.node.vf_wire(k, i)) == peer:
            return k, i
    raise AssertionError(f"net1 in {ns} is no VF of this node")


def test_del_naming_the_host_namespace_takes_nothing_from_the_host(cluster: Cluster) -> None:
    """Without a record, DEL looks for VFs in CNI_NETNS: never when that is the host's own namespace."""
    conf = cluster.conf()
    held = cluster.pod([{}])
    assert cluster.run("ADD", held, conf).ok
    prefix = cluster.node.prefix

    def ours() -> set[str]:  # other test sessions add and remove host links meanwhile
        return {n for n in SimNode.host_links() if n.startswith(prefix)}

    before = ours()
    calls = len(cluster.node.vf_state()["calls"])
    hostile = {**cluster.pod([{}]), "CNI_NETNS": "/proc/self/ns/net"}
    out = cluster.run("DEL", hostile, conf)
    assert out.ok, out.doc
    assert "host's own network namespace" in out.stderr
    assert ours() == before
    assert len(cluster.node.vf_state()["calls"]) == calls
    assert cluster.run("DEL", held, conf).ok
    assert_node_pristine(cluster)


def test_a_corrupt_pending_ipam_release_is_set_aside_not_blocking(cluster: Cluster) -> None:
    conf = cluster.conf()
    pod = cluster.pod([{}])
    assert cluster.run("ADD", pod, conf).ok
    os.makedirs(_pending_dir(cluster))
    path = os.path.join(_pending_dir(cluster), f"{pod['CNI_CONTAINERID']}@net1.json")
    with open(path, "w") as f:
        f.write("{broken")
    done = cluster.run("DEL", pod, conf)
    assert done.ok, done.doc
    assert "is corrupt" in done.stderr and "set aside" in done.stderr
    assert _pending(cluster) == []
    (kept,) = os.listdir(os.path.join(cluster.state_dir, "quarantine"))
    assert kept.startswith(f"{pod['CNI_CONTAINERID']}@net1.json.")
    assert_node_pristine(cluster)


def test_ethtool_driver_info_answers_in_the_pod(cluster: Cluster) -> None:
    """The pre-5.16 identity source, on this kernel: a veth in a pod has no PCI bus-info."""
    from rdma_cni.kernel.identity import drvinfo
    from rdma_cni.kernel.netns import Netns

    conf = cluster.conf(ipam=None)
    pod = cluster.pod([{}])
    assert cluster.run("ADD", pod, conf).ok
    ns = Netns(pod["CNI_NETNS"])
    try:
        assert drvinfo("net1", ns.fd) == ("veth", "")
        with pytest.raises(OSError):
            drvinfo(cluster.node.vf_netdev(1, 0), ns.fd)  # not in the pod
    finally:
        ns.close()
    assert drvinfo(cluster.node.vf_wire(0, 0)) == ("veth", "")
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def test_pending_ipam_release_falls_back_to_the_recorded_config(cluster: Cluster) -> None:
    """The verb's own config is tried first; when it fails, the one IPAM DEL was first given."""
    good = cluster.conf()
    pod = cluster.pod([{}])
    bad_args = {**pod, "CNI_ARGS": pod["CNI_ARGS"] + ";IP=not-an-address"}
    assert cluster.run("ADD", bad_args, good).doc["code"] == 104  # type: ignore[index]
    assert len(_pending(cluster)) == 1
    broken = cluster.conf()
    broken["ipam"]["ranges"] = True
    done = cluster.run("DEL", pod, broken)
    assert done.ok, done.doc
    assert _pending(cluster) == []  # the current (broken) config failed; the recorded one worked
    # A pending release of another network is not this GC's business.
    other = cluster.pod([{}])
    other_net = cluster.conf(name="other-net")
    other_net["ipam"] = {**broken["ipam"], "dataDir": os.path.join(cluster.tmp, "ipam-other")}
    assert cluster.run("ADD", other, other_net).doc["code"] == 104  # type: ignore[index]
    gc = cluster.run("GC", {}, {**good, "cni.dev/valid-attachments": []})
    assert gc.ok, gc.doc
    assert _pending(cluster) == [f"{other['CNI_CONTAINERID']}@net1.json"]
    assert_node_pristine(cluster)
