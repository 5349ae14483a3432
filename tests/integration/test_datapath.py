"""ADD, CHECK, DEL, GC and STATUS through the plugin process on a simulated node."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.conftest import (
    Cluster,
    addresses_in,
    assert_node_pristine,
    host_names,
    ns_name,
    slow_ipam,
    start_add_until_ipam_runs,
    wait_warm_server,
    warm_server_pids,
)
from tests.support.processes import children_of, pids_mentioning, wait_gone
from tests.support.simnode import SimPf, del_netns, ip

THREE = [{"min_tx_rate": 15000, "max_tx_rate": 20000}, {"min_tx_rate": 5000}, {}]


def test_three_interfaces_with_rates_add_check_del(cluster: Cluster) -> None:
    pod = cluster.pod(THREE)
    conf = cluster.conf()
    add = cluster.run("ADD", pod, conf)
    assert add.ok, add.doc
    result = add.doc
    assert result is not None
    names = [i["name"] for i in result["interfaces"]]
    assert names == ["net1", "net1-1", "net1-2"]
    assert all(
        i["sandbox"] == pod["CNI_NETNS"] and i["pciID"] and i["mtu"] == 1500 for i in result["interfaces"]
    )
    assert [ip_["interface"] for ip_ in result["ips"]] == [0, 1, 2]
    assert all(ip_["gateway"] == "10.77.0.1" for ip_ in result["ips"])
    inside = addresses_in(ns_name(pod))
    for itf, addr in zip(result["interfaces"], result["ips"], strict=True):
        assert inside[itf["name"]] == [addr["address"]]
    # 15000 reserved needs the 25G PF; the policy may put the others anywhere that fits.
    state = cluster.node.vf_state()
    rates = sorted(tuple(s["rate"]) for t in state["pfs"].values() for s in t.values() if "rate" in s)
    assert rates == [(5000, 0), (15000, 20000)]
    # The record is private and complete.
    (record,) = cluster.records
    path = os.path.join(cluster.state_dir, "attachments", record)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with open(path) as f:
        rec = json.load(f)
    assert rec["state"] == "ready" and rec["pod"]["name"] and len(rec["vfs"]) == 3
    assert {v["pod_name"] for v in rec["vfs"]} == set(names)
    assert all(v["host_name"].startswith(cluster.node.prefix) for v in rec["vfs"])

    check = cluster.run("CHECK", pod, cluster.check_conf(conf, result))
    assert check.ok, check.doc

    first = cluster.run("DEL", pod, conf)
    assert first.ok and first.doc is None, first.doc
    second = cluster.run("DEL", pod, conf)
    assert second.ok, second.doc
    assert_node_pristine(cluster)


def test_result_shape_follows_config_version(cluster: Cluster) -> None:
    pod = cluster.pod([{}])
    for version in ("0.3.1", "1.0.0"):
        conf = cluster.conf(cniVersion=version)
        add = cluster.run("ADD", pod, conf)
        assert add.ok, add.doc
        assert add.doc is not None and add.doc["cniVersion"] == version
        ips = add.doc["ips"]
        assert ("version" in ips[0]) == (version == "0.3.1")
        assert "pciID" not in add.doc["interfaces"][0]
        assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def test_pods_until_full_then_clean_refusal(cluster: Cluster) -> None:
    conf = cluster.conf()
    pods = []
    for _ in range(4):
        pod = cluster.pod([{"min_tx_rate": 2000}, {}])
        add = cluster.run("ADD", pod, conf)
        assert add.ok, add.doc
        pods.append(pod)
    before_links = host_names(cluster)
    before_records = cluster.records
    extra = cluster.pod([{}])
    refused = cluster.run("ADD", extra, conf)
    assert refused.code == 1 and refused.doc is not None
    assert refused.doc["code"] == 100
    assert "1 interface" in refused.doc["msg"] and "free" in refused.doc["msg"] + refused.doc.get(
        "details", ""
    )
    assert host_names(cluster) == before_links == set()
    assert cluster.records == before_records
    assert addresses_in(ns_name(extra)) == {"lo": []}
    for pod in pods:
        assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def test_bandwidth_refusal_names_request_and_free_state(cluster: Cluster) -> None:
    conf = cluster.conf()
    pod = cluster.pod([{"min_tx_rate": 20000}, {"min_tx_rate": 20000}])
    refused = cluster.run("ADD", pod, conf)
    assert refused.doc is not None and refused.doc["code"] == 100
    text = refused.doc["msg"] + refused.doc.get("details", "")
    assert "20000" in text and "simpf0" in text
    assert_node_pristine(cluster)


@pytest.mark.node([SimPf("simpf0", 4, 25000), SimPf("simpf1", 4, 25000)])
def test_parallel_adds_never_share_a_vf(cluster: Cluster) -> None:
    conf = cluster.conf()
    pods = [cluster.pod([{"min_tx_rate": 1000}]) for _ in range(16)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        outcomes = list(pool.map(lambda p: cluster.run("ADD", p, conf, timeout=120), pods))
    granted = [(p, o) for p, o in zip(pods, outcomes, strict=True) if o.ok]
    refused = [o for o in outcomes if not o.ok]
    assert len(granted) == 8, [o.doc for o in refused]
    assert all(o.doc is not None and o.doc["code"] == 100 for o in refused), [o.doc for o in refused]
    pcis = [o.doc["interfaces"][0]["pciID"] for _, o in granted if o.doc]
    assert len(set(pcis)) == 8
    assert len(cluster.records) == 8
    for pod, _ in granted:
        assert set(addresses_in(ns_name(pod))) == {"lo", "net1"}
    for pod in pods:
        assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def test_del_after_netns_deleted(cluster: Cluster) -> None:
    conf = cluster.conf()
    pod = cluster.pod([{"max_tx_rate": 3000}, {}])
    add = cluster.run("ADD", pod, conf)
    assert add.ok, add.doc
    del_netns(ns_name(pod))
    # A veth dies with its netns (a real VF would come back: the QEMU tier covers that).
    gone = cluster.run("DEL", pod, conf)
    assert gone.ok, gone.doc
    assert cluster.records == [] and cluster.ipam_allocations() == []
    assert all(
        s.get("rate", [0, 0]) == [0, 0] for t in cluster.node.vf_state()["pfs"].values() for s in t.values()
    )
    assert cluster.run("DEL", {**pod, "CNI_NETNS": ""}, conf).ok


def test_del_with_empty_netns_uses_the_recorded_netns(cluster: Cluster) -> None:
    conf = cluster.conf()
    pod = cluster.pod([{}])
    assert cluster.run("ADD", pod, conf).ok
    # The runtime may send DEL without CNI_NETNS; the record remembers the netns.
    done = cluster.run("DEL", {**pod, "CNI_NETNS": ""}, conf)
    assert done.ok, done.doc
    assert_node_pristine(cluster)


def test_del_without_record_succeeds(cluster: Cluster) -> None:
    pod = cluster.pod([{}])
    assert cluster.run("DEL", pod, cluster.conf()).ok
    assert cluster.run("DEL", pod, cluster.conf()).ok
    assert_node_pristine(cluster)


def _kill_add_midway(cluster: Cluster, pod: dict[str, str], conf: dict[str, object], marker: str) -> None:
    """Kill -9 the plugin's process group while its IPAM ADD runs; IPAM finishes (docs/protocol.md)."""
    proc = start_add_until_ipam_runs(cluster, pod, conf, marker, new_session=True)
    os.killpg(proc.pid, 9)  # the plugin's whole group, as a runtime's timeout would
    proc.wait()
    os.unlink(marker)
    # IPAM runs in a session of its own under the plugin's guard: it is not
    # killed mid-write, and it finishes (the guard holds the node lock meanwhile).
    ipam = pids_mentioning(os.path.join(cluster.tmp, "bin", "slow-local"))
    assert ipam, "the IPAM child died with the plugin"
    assert wait_gone(ipam, timeout=60)
    # Half-done: the VF sits in the pod, its rate applied, the record says "adding";
    # IPAM's lease is complete (never a 0-byte file).
    assert set(addresses_in(ns_name(pod))) == {"lo", "net1"}
    rec = f"{pod['CNI_CONTAINERID']}@net1.json"
    with open(os.path.join(cluster.state_dir, "attachments", rec)) as f:
        assert json.load(f)["state"] == "adding"
    holders = []
    for lease in cluster.ipam_allocations():
        with open(os.path.join(cluster.tmp, "ipam", "rdma-net", lease)) as f:
            holders.append(f.read().split()[0])
    assert holders.count(pod["CNI_CONTAINERID"]) == 1


def _warm_add_in_ipam(cluster: Cluster) -> tuple[dict[str, str], subprocess.Popen[bytes]]:
    """A warm ADD stopped inside its (slow) IPAM call: the moment to kill the warm server."""
    wait_warm_server(cluster)
    conf, marker = slow_ipam(cluster, seconds=2)
    pod = cluster.pod([{"max_tx_rate": 1000}])
    return pod, start_add_until_ipam_runs(cluster, pod, conf, marker)


@pytest.mark.skipif(
    not os.environ.get("RDMA_CNI_BINARY"), reason="warm start is a feature of the built binary"
)
def test_warm_server_killed_mid_add_fails_the_add_and_del_cleans_up(cluster: Cluster) -> None:
    pod, proc = _warm_add_in_ipam(cluster)
    for pid in warm_server_pids():
        os.kill(pid, 9)
    assert proc.stderr is not None
    proc.wait(timeout=60)
    err = proc.stderr.read()
    # The server cannot report the outcome any more: the runtime must see a failure.
    assert proc.returncode == 1
    assert b"warm server went away" in err
    done = cluster.run("DEL", pod, cluster.conf())
    assert done.ok, done.doc
    assert_node_pristine(cluster)


@pytest.mark.skipif(
    not os.environ.get("RDMA_CNI_BINARY"), reason="warm start is a feature of the built binary"
)
def test_warm_server_alone_killed_mid_add_leaves_the_child_to_report_its_outcome(cluster: Cluster) -> None:
    pod, proc = _warm_add_in_ipam(cluster)
    # The server only: its forked children (the verb, and the verb's IPAM guard)
    # carry the same command line; the server is the one no other of them forked.
    running = warm_server_pids()
    forked = {child for pid in running for child in children_of(pid)}
    servers = [pid for pid in running if pid not in forked]
    assert len(servers) == 1 and len(running) >= 2, running
    os.kill(servers[0], 9)
    assert proc.stderr is not None and proc.stdout is not None
    proc.wait(timeout=60)
    # The child owns the outcome and reports it itself: the ADD finishes and says so.
    assert proc.returncode == 0, proc.stderr.read()
    assert json.loads(proc.stdout.read())["interfaces"][0]["name"] == "net1"
    done = cluster.run("DEL", pod, cluster.conf())
    assert done.ok, done.doc
    assert_node_pristine(cluster)


def test_kill_9_mid_add_then_del(cluster: Cluster) -> None:
    conf, marker = slow_ipam(cluster, seconds=2)
    pod = cluster.pod([{"max_tx_rate": 1000}])
    _kill_add_midway(cluster, pod, conf, marker)
    done = cluster.run("DEL", pod, conf)
    assert done.ok, done.doc
    assert_node_pristine(cluster)


def test_kill_9_mid_add_then_gc(cluster: Cluster) -> None:
    conf, marker = slow_ipam(cluster, seconds=2)
    keep = cluster.pod([{}])
    assert cluster.run("ADD", keep, cluster.conf()).ok
    pod = cluster.pod([{"max_tx_rate": 1000}])
    _kill_add_midway(cluster, pod, conf, marker)
    assert len(cluster.records) == 2
    gc_conf = {
        **conf,
        "cni.dev/valid-attachments": [{"containerID": keep["CNI_CONTAINERID"], "ifname": "net1"}],
    }
    done = cluster.run("GC", {}, gc_conf)
    assert done.ok, done.doc
    assert cluster.records == [f"{keep['CNI_CONTAINERID']}@net1.json"]
    assert set(addresses_in(ns_name(pod))) == {"lo"}
    assert cluster.run("DEL", keep, cluster.conf()).ok
    assert_node_pristine(cluster)


def test_ipam_failure_on_second_interface_rolls_back(cluster: Cluster) -> None:
    conf = cluster.conf()
    conf["ipam"]["ranges"] = [
        [{"subnet": "10.77.0.0/24", "rangeStart": "10.77.0.10", "rangeEnd": "10.77.0.10"}]
    ]
    pod = cluster.pod([{"max_tx_rate": 1000}, {"max_tx_rate": 1000}])
    failed = cluster.run("ADD", pod, conf)
    assert failed.doc is not None and failed.doc["code"] == 104, failed.doc
    assert "net1-1" in failed.doc["msg"]
    assert addresses_in(ns_name(pod)) == {"lo": []}
    assert_node_pristine(cluster)
    calls = cluster.node.vf_state()["calls"]
    assert [c["settings"]["rate"] for c in calls] == [[0, 1000], [0, 1000], [0, 0], [0, 0]]


@pytest.mark.parametrize(
    ("annotation", "needle"),
    [
        ("not json", "not valid JSON"),
        ('{"min_tx_rate": -5}', "min_tx_rate"),
        ('[{"min_tx_rate": 10, "max_tx_rate": 5}]', "below min_tx_rate"),
        ('[{"min_tx_rate": "100"}]', "min_tx_rate"),
        ('[{"min_tx_rate": 1.5}]', "min_tx_rate"),
        ('[{"bogus": 1}]', "bogus"),
        ("[]", "no interfaces"),
        (json.dumps([{}] * 33), "limit is 32"),
        ('[{"name": "../../x"}]', "name"),
        ('[{"name": "net1"}, {"name": "eth0"}, {"name": "eth0"}]', "unique"),
        ('[{"min_tx_rate": 99999999999}]', "min_tx_rate"),
        ("x" * 70000, "65536"),
    ],
)
def test_hostile_annotations_are_refused_without_touching_the_node(
    cluster: Cluster, annotation: str, needle: str
) -> None:
    pod = cluster.pod(annotation)
    out = cluster.run("ADD", pod, cluster.conf())
    assert out.doc is not None and out.doc["code"] == 101, out.doc
    assert needle in out.doc["msg"]
    assert "default/pod" in out.doc["msg"]
    assert cluster.node.vf_state()["calls"] == []
    assert_node_pristine(cluster)


def test_container_id_with_dots_never_reaches_a_path(cluster: Cluster) -> None:
    pod = cluster.pod([{}])
    for bad in ("../../etc/x", "..", "a/b", ""):
        out = cluster.run("ADD", {**pod, "CNI_CONTAINERID": bad}, cluster.conf())
        assert out.doc is not None and out.doc["code"] == 4 and "CNI_CONTAINERID" in out.doc["msg"]
    assert not os.path.exists(cluster.state_dir) or cluster.records == []
    assert_node_pristine(cluster)


def test_api_server_down_is_try_again(cluster: Cluster) -> None:
    pod = cluster.pod([{}])
    conf = cluster.conf()
    with open(conf["kubeconfig"]) as f:
        kc = json.load(f)
    kc["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:9"  # nothing listens on discard
    dead = os.path.join(cluster.tmp, "dead.kubeconfig")
    with open(dead, "w") as f:
        json.dump(kc, f)
    out = cluster.run("ADD", pod, {**conf, "kubeconfig": dead})
    assert out.doc is not None and out.doc["code"] == 11, out.doc
    assert_node_pristine(cluster)


def test_unknown_pod_is_a_clear_error(cluster: Cluster) -> None:
    pod = cluster.pod([{}])
    args = pod["CNI_ARGS"].replace("K8S_POD_NAME=", "K8S_POD_NAME=ghost")
    out = cluster.run("ADD", {**pod, "CNI_ARGS": args}, cluster.conf())
    assert out.doc is not None and out.doc["code"] == 102 and "not found" in out.doc["msg"], out.doc
    assert_node_pristine(cluster)


def test_pod_without_annotation_gets_default_request(cluster: Cluster) -> None:
    pod = cluster.pod(None)
    conf = cluster.conf(defaultRequest=[{"max_tx_rate": 700}, {}])
    add = cluster.run("ADD", pod, conf)
    assert add.ok and add.doc is not None and len(add.doc["interfaces"]) == 2
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def test_manual_use_without_kubernetes_reads_args(cluster: Cluster) -> None:
    pod = cluster.pod(None)
    manual = {k: v for k, v in pod.items() if k != "CNI_ARGS"}
    conf = cluster.conf(kubeconfig=None, args={"cni": {"rdma_interfaces_required": [{}, {}, {}]}})
    add = cluster.run("ADD", manual, conf)
    assert add.ok and add.doc is not None and len(add.doc["interfaces"]) == 3
    assert cluster.run("DEL", manual, conf).ok
    assert_node_pristine(cluster)


def test_duplicate_add_is_refused(cluster: Cluster) -> None:
    pod = cluster.pod([{}])
    conf = cluster.conf()
    assert cluster.run("ADD", pod, conf).ok
    again = cluster.run("ADD", pod, conf)
    assert again.doc is not None and again.doc["code"] == 107
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def test_check_reports_each_mismatch(cluster: Cluster) -> None:
    pod = cluster.pod([{"max_tx_rate": 4000}, {}])
    conf = cluster.conf()
    add = cluster.run("ADD", pod, conf)
    assert add.ok and add.doc is not None
    check_conf = cluster.check_conf(conf, add.doc)
    assert cluster.run("CHECK", pod, check_conf).ok
    ns = ns_name(pod)

    # A rate changed behind our back (the fake PF table stands in for the kernel's).
    state = cluster.node.vf_state()
    for table in state["pfs"].values():
        for settings in table.values():
            if settings.get("rate") == [0, 4000]:
                settings["rate"] = [0, 100]
    with open(cluster.node.vfcontrol, "w") as f:
        json.dump(state, f)
    bad = cluster.run("CHECK", pod, check_conf)
    assert bad.doc is not None and bad.doc["code"] == 106 and "rate" in bad.doc["msg"], bad.doc
    for table in state["pfs"].values():
        for settings in table.values():
            if settings.get("rate") == [0, 100]:
                settings["rate"] = [0, 4000]
    with open(cluster.node.vfcontrol, "w") as f:
        json.dump(state, f)
    assert cluster.run("CHECK", pod, check_conf).ok

    wrong_mac = json.loads(json.dumps(check_conf))
    wrong_mac["prevResult"]["interfaces"][1]["mac"] = "02:00:00:00:00:01"
    bad = cluster.run("CHECK", pod, wrong_mac)
    assert bad.doc is not None and bad.doc["code"] == 106 and "MAC" in bad.doc["msg"], bad.doc

    ip("-n", ns, "link", "set", "net1-1", "down")
    bad = cluster.run("CHECK", pod, cluster.check_conf(conf, add.doc))
    assert bad.doc is not None and bad.doc["code"] == 106

    ip("-n", ns, "link", "set", "net1-1", "name", "renamed")
    bad = cluster.run("CHECK", pod, cluster.check_conf(conf, add.doc))
    assert bad.doc is not None and bad.doc["code"] == 106 and "net1-1" in bad.doc["msg"], bad.doc
    ip("-n", ns, "link", "set", "renamed", "name", "net1-1")
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def test_check_without_prev_result_or_record(cluster: Cluster) -> None:
    pod = cluster.pod([{}])
    conf = cluster.conf()
    out = cluster.run("CHECK", pod, conf)
    assert out.doc is not None and out.doc["code"] == 7 and "prevResult" in out.doc["msg"]
    out = cluster.run("CHECK", pod, cluster.check_conf(conf, {"cniVersion": "1.1.0", "interfaces": []}))
    assert out.doc is not None and out.doc["code"] == 106 and "no rdma-cni attachment" in out.doc["msg"]


def test_gc_releases_only_stale_attachments_of_this_network(cluster: Cluster) -> None:
    conf = cluster.conf()
    keep, stale = cluster.pod([{}]), cluster.pod([{}, {}])
    other_net = cluster.pod([{}])
    assert cluster.run("ADD", keep, conf).ok
    assert cluster.run("ADD", stale, conf).ok
    other_conf = cluster.conf(name="other-net")
    other_conf["ipam"] = {**conf["ipam"], "dataDir": os.path.join(cluster.tmp, "ipam-other")}
    assert cluster.run("ADD", other_net, other_conf).ok
    valid = [{"containerID": keep["CNI_CONTAINERID"], "ifname": "net1"}]
    gc = cluster.run("GC", {}, {**conf, "cni.dev/valid-attachments": valid})
    assert gc.ok, gc.doc
    assert sorted(cluster.records) == sorted(
        [f"{keep['CNI_CONTAINERID']}@net1.json", f"{other_net['CNI_CONTAINERID']}@net1.json"]
    )
    assert set(addresses_in(ns_name(stale))) == {"lo"}
    # The older spelling of the key is accepted too.
    gc = cluster.run("GC", {}, {**conf, "cni.dev/attachments": []})
    assert gc.ok, gc.doc
    assert cluster.records == [f"{other_net['CNI_CONTAINERID']}@net1.json"]
    assert cluster.run("DEL", other_net, other_conf).ok
    assert_node_pristine(cluster)


def test_gc_sets_a_corrupt_record_aside_and_keeps_going(cluster: Cluster) -> None:
    conf = cluster.conf()
    stale = cluster.pod([{}])
    assert cluster.run("ADD", stale, conf).ok
    corrupt = os.path.join(cluster.state_dir, "attachments", "broken@net1.json")
    with open(corrupt, "w") as f:
        f.write("{not json")
    gc = cluster.run("GC", {}, {**conf, "cni.dev/valid-attachments": []})
    assert gc.ok, gc.doc
    assert "broken@net1.json" in gc.stderr and "set aside" in gc.stderr
    assert cluster.records == []
    (kept,) = os.listdir(os.path.join(cluster.state_dir, "quarantine"))
    assert kept.startswith("broken@net1.json.")
    assert set(addresses_in(ns_name(stale))) == {"lo"}


def test_status(cluster: Cluster) -> None:
    conf = cluster.conf()
    ok = cluster.run("STATUS", {}, conf)
    assert ok.ok and ok.doc is None, ok.doc
    missing = cluster.run("STATUS", {}, cluster.conf(pfs=["nosuchpf"]))
    assert missing.doc is not None and missing.doc["code"] == 50 and "nosuchpf" in missing.doc["msg"]
    os.makedirs(os.path.join(cluster.state_dir, "attachments"), exist_ok=True)
    with open(os.path.join(cluster.state_dir, "attachments", "y@net1.json"), "w") as f:
        f.write("garbage")
    # A corrupt record does not stop the node: STATUS still succeeds, and warns.
    corrupt = cluster.run("STATUS", {}, conf)
    assert corrupt.ok and corrupt.doc is None, corrupt.doc
    assert "WARNING" in corrupt.stderr and "y@net1.json" in corrupt.stderr


def test_lock_timeout_is_try_again(cluster: Cluster) -> None:
    import fcntl

    conf = cluster.conf(lockTimeoutSeconds=0.3)
    pod = cluster.pod([{}])
    with open(conf["lockFile"], "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        out = cluster.run("ADD", pod, conf)
    assert out.doc is not None and out.doc["code"] == 11 and "lock" in out.doc["msg"], out.doc
    assert_node_pristine(cluster)


def test_existing_interface_name_in_pod_is_refused_and_rolled_back(cluster: Cluster) -> None:
    pod = cluster.pod([{"max_tx_rate": 100}, {}])
    ip("-n", ns_name(pod), "link", "add", "net1-1", "type", "veth", "peer", "name", "blocker")
    out = cluster.run("ADD", pod, cluster.conf())
    assert out.doc is not None and out.doc["code"] == 103 and "net1-1" in out.doc["msg"], out.doc
    assert set(addresses_in(ns_name(pod))) == {"lo", "net1-1", "blocker"}
    assert_node_pristine(cluster)


def test_pf_refusing_min_rate_rolls_back(cluster: Cluster) -> None:
    cluster.node.refuse("min_tx_rate", 22)
    pod = cluster.pod([{"max_tx_rate": 100}, {"min_tx_rate": 1000}])
    out = cluster.run("ADD", pod, cluster.conf())
    assert out.doc is not None and out.doc["code"] == 103, out.doc
    assert "min_tx_rate" in out.doc["msg"] and "Invalid argument" in out.doc["msg"]
    assert_node_pristine(cluster)
