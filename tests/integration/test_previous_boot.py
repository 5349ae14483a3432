"""Records of an earlier boot on the simulated node: released by the next verb, or by the CNI server's start.

A reboot cannot be had in a test, so what a reboot changes is written instead:
the pod's namespace goes, its VFs come back to the host under names that are
not theirs (a real VF keeps its pod-side name; the veth stand-in is moved home
by hand, renamed), and the record and the state directory's marker carry the
boot id of a boot that is not this one. What stays real: the kernel, the
netlink identity the VFs are found by, host-local's leases, the node lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import uuid
from typing import Any

from rdma_cni.agent import snapshot
from rdma_cni.agent.cniserver import CniServer
from rdma_cni.node import boot
from tests.integration.conftest import (
    REPO,
    Cluster,
    assert_node_pristine,
    expected_vf_names,
    host_names,
    ns_name,
    plugin_command,
)
from tests.integration.test_agent_snapshot import view_of
from tests.support.cniserver import host_state_untouched
from tests.support.simnode import SimNode, ip

EARLIER_BOOT = str(uuid.uuid4())


def record_path(cluster: Cluster, pod: dict[str, str]) -> str:
    return os.path.join(
        cluster.state_dir, "attachments", f"{pod['CNI_CONTAINERID']}@{pod['CNI_IFNAME']}.json"
    )


def edit_record(cluster: Cluster, pod: dict[str, str], change: Any) -> dict[str, Any]:
    path = record_path(cluster, pod)
    with open(path) as f:
        doc = json.load(f)
    change(doc)
    with open(path, "w") as f:
        json.dump(doc, f)
    return doc


def scrambled(cluster: Cluster, n: int) -> str:
    return f"{cluster.node.prefix}zz{n}"


def reboot_away(cluster: Cluster, pod: dict[str, str]) -> None:
    """The pod's namespace gone, its VFs back in the host under other names (identity alone finds them)."""
    ns = ns_name(pod)
    with open(record_path(cluster, pod)) as f:
        names = [vf["pod_name"] for vf in json.load(f)["vfs"]]
    for n, name in enumerate(names):
        ip("-n", ns, "link", "set", "dev", name, "name", scrambled(cluster, n))
        ip("-n", ns, "link", "set", "dev", scrambled(cluster, n), "netns", str(os.getpid()))
    ip("netns", "del", ns)
    cluster.netns_names.remove(ns)


def of_an_earlier_boot(cluster: Cluster, pod: dict[str, str]) -> None:
    """The record written in an earlier boot, whose records were all checked then (the marker says so)."""
    edit_record(cluster, pod, lambda doc: doc.update(boot_id=EARLIER_BOOT))
    with open(os.path.join(cluster.state_dir, boot.MARKER), "w") as f:
        f.write(EARLIER_BOOT + "\n")


def forget_the_check(cluster: Cluster) -> None:
    """This boot's records not checked yet (the first verb after the ADD may already have)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(cluster.state_dir, boot.MARKER))


def held_vfs(cluster: Cluster) -> int:
    state = snapshot.snapshot([view_of(cluster)])
    return sum(p.used_vfs for p in state.pfs)


def added_pod_of_an_earlier_boot(cluster: Cluster, conf: dict[str, Any]) -> dict[str, str]:
    pod = cluster.pod([{"min_tx_rate": 1000, "max_tx_rate": 2000}, {}])
    outcome = cluster.run("ADD", pod, conf)
    assert outcome.ok, outcome.stderr
    with open(record_path(cluster, pod)) as f:
        doc = json.load(f)
    # ADD keeps what releases it without the network's configuration.
    assert doc["schema"] == 3 and doc["boot_id"] == boot.boot_id()
    assert doc["ipam_conf"]["ipam"] == conf["ipam"] and doc["cni_path"] == cluster.cni_path.split(":")
    assert "args" not in doc["ipam_conf"]
    reboot_away(cluster, pod)
    of_an_earlier_boot(cluster, pod)
    assert len(cluster.ipam_allocations()) == 2 and held_vfs(cluster) == 2
    assert {scrambled(cluster, 0), scrambled(cluster, 1)} <= SimNode.host_links()
    return pod


def assert_released_for_this_boot(cluster: Cluster) -> None:
    assert_node_pristine(cluster)  # names, record, IPAM lease, PF-side settings
    assert held_vfs(cluster) == 0  # the node state the agent publishes has them free
    assert boot.checked(cluster.state_dir, boot.boot_id())


def start_a_cni_server(cluster: Cluster, conf: dict[str, Any]) -> None:
    """Start the node agent's CNI server for this node's state (which releases an earlier boot's
    records before it serves), and stop it."""
    environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **cluster.node.env()}
    server = CniServer(
        os.path.join(cluster.tmp, "agent", "cni.sock"),
        plugin_command(),
        environ=environ,
        states=[(cluster.state_dir, conf["lockFile"])],
    )
    server.start()
    server.close()


def test_the_first_status_after_a_reboot_releases_an_earlier_boots_record(cluster: Cluster) -> None:
    conf = cluster.conf()
    added_pod_of_an_earlier_boot(cluster, conf)
    outcome = cluster.run("STATUS", {}, conf)
    assert outcome.ok, outcome.stderr
    assert_released_for_this_boot(cluster)


def test_the_first_add_after_a_reboot_can_have_every_vf(cluster: Cluster) -> None:
    """The release comes before placement: a pod asking for all eight VFs gets them."""
    conf = cluster.conf()
    added_pod_of_an_earlier_boot(cluster, conf)
    big = cluster.pod([{}] * 8)
    outcome = cluster.run("ADD", big, conf)
    assert outcome.ok, outcome.stderr
    assert outcome.doc is not None and len(outcome.doc["interfaces"]) == 8
    assert cluster.records == [os.path.basename(record_path(cluster, big))]
    assert cluster.run("DEL", big, conf).ok
    assert_released_for_this_boot(cluster)


def test_the_cni_servers_start_releases_an_earlier_boots_record(cluster: Cluster) -> None:
    """No verb, no network configuration: the record's own IPAM configuration and CNI_PATH release it."""
    conf = cluster.conf()
    added_pod_of_an_earlier_boot(cluster, conf)
    start_a_cni_server(cluster, conf)
    assert_released_for_this_boot(cluster)


def test_the_agents_cni_server_releases_the_earlier_boot_of_each_network_it_is_told(cluster: Cluster) -> None:
    """As the DaemonSet runs it (``install --mode shim --watch``), for a network whose stateDir is not
    the plugin's default, named by ``--network-config``; a configuration the plugin refuses (a
    relative stateDir) is logged and skipped, and the other network's record is still released."""
    conf = cluster.conf()
    added_pod_of_an_earlier_boot(cluster, conf)
    good = os.path.join(cluster.tmp, "rdma-net.conflist")
    entry = {k: v for k, v in conf.items() if k not in ("cniVersion", "name")}
    with open(good, "w") as f:
        json.dump({"cniVersion": conf["cniVersion"], "name": conf["name"], "plugins": [entry]}, f)
    bad = os.path.join(cluster.tmp, "bad-net.conf")
    with open(bad, "w") as f:
        json.dump(cluster.conf(name="bad-net", stateDir="var/lib/cni/rdma-cni"), f)
    sa = os.path.join(cluster.tmp, "sa")
    os.makedirs(sa)
    with open(os.path.join(sa, "token"), "w") as f:
        f.write("t")
    with open(os.path.join(sa, "ca.crt"), "w") as f:
        f.write("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    source = os.path.join(cluster.tmp, "shim-source")
    with open(source, "w") as f:
        f.write("#!/bin/sh\n")
    argv = [
        *plugin_command(),
        *("install", "--mode=shim", "--watch", "--max-iterations=1", "--interval=0.1"),
        *(f"--source={source}", f"--shim-source={source}", f"--serviceaccount-dir={sa}"),
        f"--cni-bin-dir={os.path.join(cluster.tmp, 'bin')}",
        f"--kubeconfig-path={os.path.join(cluster.tmp, 'installed.kubeconfig')}",
        f"--cni-socket={os.path.join(cluster.tmp, 'agent', 'cni.sock')}",
        *(f"--network-config={bad}", f"--network-config={good}"),
    ]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": REPO,
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": "6443",
        **cluster.node.env(),
    }
    with host_state_untouched():
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert f"records of earlier boots of {bad} not released at start" in proc.stderr
    assert "must be an absolute path" in proc.stderr
    assert_released_for_this_boot(cluster)


def test_a_record_of_this_boot_is_never_released(cluster: Cluster) -> None:
    conf = cluster.conf()
    pod = cluster.pod([{}])
    assert cluster.run("ADD", pod, conf).ok
    forget_the_check(cluster)
    # Created "a day before this boot" by the clock (stepped forward since): the boot id decides.
    edit_record(cluster, pod, lambda doc: doc.update(created_at=boot.boot_time() - 86_400))
    assert cluster.run("STATUS", {}, conf).ok
    assert cluster.records == [os.path.basename(record_path(cluster, pod))] and held_vfs(cluster) == 1
    with open(record_path(cluster, pod)) as f:
        result = json.load(f)["result"]
    assert cluster.run("CHECK", pod, cluster.check_conf(conf, result)).ok
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def as_the_version_before(doc: dict[str, Any], created_at: float) -> None:
    """A schema 1 record: no boot id, no IPAM configuration of its own."""
    for key in ("boot_id", "ipam_conf", "cni_path", "netns_id"):
        del doc[key]
    doc["schema"] = 1
    doc["created_at"] = created_at


def test_records_of_the_version_before_are_judged_by_the_clock_and_the_kernel(cluster: Cluster) -> None:
    """Released: created well before this boot, its VFs home. Kept: created as long ago, but its VF sits
    in a live namespace (a clock stepped forward could make a record of this boot look that old)."""
    conf = cluster.conf()
    old = boot.boot_time() - 2 * boot.CLOCK_SLACK_SECONDS
    gone = cluster.pod([{"min_tx_rate": 1000}], name="gone")
    live = cluster.pod([{}], name="live")
    assert cluster.run("ADD", gone, conf).ok and cluster.run("ADD", live, conf).ok
    reboot_away(cluster, gone)
    edit_record(cluster, gone, lambda doc: as_the_version_before(doc, old))
    edit_record(cluster, live, lambda doc: as_the_version_before(doc, old))
    forget_the_check(cluster)
    outcome = cluster.run("STATUS", {}, conf)
    assert outcome.ok, outcome.stderr
    # The released one's lease went through this network's own IPAM configuration (same network).
    assert cluster.records == [os.path.basename(record_path(cluster, live))]
    assert len(cluster.ipam_allocations()) == 1 and held_vfs(cluster) == 1
    assert "not surely of an earlier boot" in outcome.stderr
    assert boot.checked(cluster.state_dir, boot.boot_id())  # kept for DEL or GC, not judged again
    assert cluster.run("DEL", live, conf).ok
    assert_node_pristine(cluster)


def test_a_vf_that_no_longer_exists_has_nothing_to_give_back(cluster: Cluster) -> None:
    """A VF not created again after the reboot: the record and the lease still go, nothing is asked of it."""
    conf = cluster.conf()
    pod = cluster.pod([{"min_tx_rate": 1000}])
    assert cluster.run("ADD", pod, conf).ok
    with open(record_path(cluster, pod)) as f:
        [vf] = json.load(f)["vfs"]
    reboot_away(cluster, pod)
    of_an_earlier_boot(cluster, pod)
    # The VF's PCI device is gone (its PF's VFs not created again yet): sysfs has no such device.
    ip("link", "del", scrambled(cluster, 0))
    pci = os.path.join(cluster.node.sysfs, "bus", "pci", "devices", vf["pci"])
    os.rename(pci, pci + ".gone")
    calls = len(cluster.node.vf_state()["calls"])
    outcome = cluster.run("STATUS", {}, conf)
    assert outcome.ok, outcome.stderr
    assert cluster.records == [] and cluster.ipam_allocations() == []
    assert len(cluster.node.vf_state()["calls"]) == calls  # no PF-side setting asked of a VF that is not
    assert boot.checked(cluster.state_dir, boot.boot_id())


def test_a_release_that_fails_keeps_its_record_and_the_next_verb_tries_again(cluster: Cluster) -> None:
    conf = cluster.conf()
    pod = added_pod_of_an_earlier_boot(cluster, conf)
    with open(record_path(cluster, pod)) as f:
        first = json.load(f)["vfs"][0]
    cluster.node.refuse(
        f"{first['pf']}/{first['vf']}", errno.EBUSY
    )  # its PF-side settings cannot be restored
    outcome = cluster.run("STATUS", {}, conf)
    assert outcome.ok, outcome.stderr  # the verb itself is served
    assert cluster.records == [os.path.basename(record_path(cluster, pod))]
    assert not boot.checked(cluster.state_dir, boot.boot_id())  # not done: the next verb goes on
    # The CNI server's subcommand says so too, and exits 1 (the server logs it).
    proc = subprocess.run(
        [
            *plugin_command(),
            "release-previous-boot",
            "--state-dir",
            cluster.state_dir,
            "--lock-file",
            conf["lockFile"],
        ],
        env={k: v for k, v in cluster.env("STATUS").items() if not k.startswith("CNI_")},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        check=False,
    )
    key = f"{pod['CNI_CONTAINERID']}/{pod['CNI_IFNAME']}"
    assert proc.returncode == 1 and json.loads(proc.stdout)["failed"] == [key], proc.stderr
    doc = cluster.node.vf_state()
    doc["refuse"] = {}
    with open(cluster.node.vfcontrol, "w") as f:
        json.dump(doc, f)
    assert cluster.run("STATUS", {}, conf).ok
    assert_released_for_this_boot(cluster)


def test_one_pass_releases_a_bounded_number_and_the_next_goes_on(cluster: Cluster) -> None:
    from rdma_cni.verbs.gc import release_previous_boot

    conf = cluster.conf()
    pods = [cluster.pod([{}]) for _ in range(3)]
    for pod in pods:
        assert cluster.run("ADD", pod, conf).ok
    for pod in pods:
        with open(record_path(cluster, pod)) as f:
            [name] = [vf["pod_name"] for vf in json.load(f)["vfs"]]
        ip("-n", ns_name(pod), "link", "set", "dev", name, "name", f"{cluster.node.prefix}q{pods.index(pod)}")
        ip(
            "-n",
            ns_name(pod),
            "link",
            "set",
            "dev",
            f"{cluster.node.prefix}q{pods.index(pod)}",
            "netns",
            str(os.getpid()),
        )
        of_an_earlier_boot(cluster, pod)
    lock = conf["lockFile"]
    first = release_previous_boot(cluster.state_dir, lock, 30, limit=2)
    assert first is not None and (len(first.released), first.left, first.failed) == (2, 1, [])
    assert len(cluster.records) == 1 and not boot.checked(cluster.state_dir, boot.boot_id())
    second = release_previous_boot(cluster.state_dir, lock, 30, limit=2)
    assert second is not None and (len(second.released), second.left) == (1, 0)
    assert release_previous_boot(cluster.state_dir, lock, 30) is None  # checked: two reads, no lock
    assert_released_for_this_boot(cluster)


def test_a_record_without_ipam_configuration_of_another_network_leaves_its_lease_pending(
    cluster: Cluster,
) -> None:
    """A schema 1 record of a network no verb has run for yet: the VFs go home, the IPAM release waits."""
    other = cluster.conf(name="other-net")
    pod = cluster.pod([{}])
    assert cluster.run("ADD", pod, other).ok
    reboot_away(cluster, pod)
    edit_record(cluster, pod, lambda doc: as_the_version_before(doc, boot.boot_time() - 7200))
    forget_the_check(cluster)
    assert cluster.run("STATUS", {}, cluster.conf()).ok
    assert cluster.records == [] and host_names(cluster) == expected_vf_names(cluster)
    pending = os.path.join(cluster.state_dir, "ipam-pending", os.path.basename(record_path(cluster, pod)))
    with open(pending) as f:
        assert json.load(f)["network"] == "other-net"
    # That network's GC (or the attachment's DEL) finishes it with its configuration.
    assert cluster.run("GC", {}, {**other, "cni.dev/valid-attachments": []}).ok
    leases = os.listdir(os.path.join(cluster.tmp, "ipam", "other-net"))
    assert not os.path.exists(pending) and [n for n in leases if n[0].isdigit()] == []


def test_an_ipam_plugin_no_longer_on_the_recorded_cni_path_leaves_the_lease_pending(cluster: Cluster) -> None:
    conf = cluster.conf()
    pod = added_pod_of_an_earlier_boot(cluster, conf)
    edit_record(cluster, pod, lambda doc: doc.update(cni_path=[os.path.join(cluster.tmp, "nowhere")]))
    start_a_cni_server(cluster, conf)
    assert cluster.records == [] and host_names(cluster) == expected_vf_names(cluster)
    assert held_vfs(cluster) == 0 and len(cluster.ipam_allocations()) == 2
    pending = os.path.join(cluster.state_dir, "ipam-pending", os.path.basename(record_path(cluster, pod)))
    with open(pending) as f:
        item = json.load(f)
    assert item["conf"]["ipam"] == conf["ipam"] and "not found in CNI_PATH" in item["last_error"]
    assert cluster.run("GC", {}, {**conf, "cni.dev/valid-attachments": []}).ok  # with the runtime's CNI_PATH
    assert_released_for_this_boot(cluster)
