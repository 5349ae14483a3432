"""The fault tier's "hostile pods" family, namespace side: netns full of links, VFs renamed and hidden.

Each case is a real namespace on the simulated node, filled with thousands
of links (tests/support/linkflood.py), with the pod's VF renamed, decoys
under its name and MAC, or the VF pushed past the bounded walk. Invariants,
judged on every case:

- NRI answers within 2 s (the runtime's limit): the agent's proof of the
  pod's VFs, run in a fresh process as the agent runs it, takes under
  :data:`NRI_LIMIT`, and proves exactly the VFs the pod holds, or fewer,
  never a decoy;
- the node lock is never held longer than :data:`LOCK_BOUND` by a pod's
  doing: a DEL of the full namespace, and another pod's ADD that waits for it;
- no VF is lost or given to the wrong pod: the node is judged from the
  kernel's view after every case (tests/support/invariants.py), and a VF the
  plugin could not find stays out of every other pod until it is home.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from typing import Any

import pytest

from rdma_cni.kernel import linkscan
from tests.faults.bench import Bench
from tests.faults.knobs import scaled
from tests.integration.conftest import Cluster, ip, ns_name
from tests.integration.test_netns_links import as_previous_version, lock_lines, prove, record_of
from tests.support.linkflood import flood
from tests.support.simnode import SimPf

if not os.environ.get("RDMA_CNI_BINARY"):
    pytest.skip(
        "the fault tier drives the built binary (make faults sets RDMA_CNI_BINARY)", allow_module_level=True
    )

FAMILY = "hostile pods"
NRI_LIMIT = 2.0  # seconds: NRI's request timeout
LOCK_BOUND = 1.5  # seconds: the walk's 0.25 s plus DEL's own work, with room for a loaded machine
MAX_LINKS = 24_000


def sizes() -> list[int]:
    return [min(MAX_LINKS, scaled(n)) for n in (4_000, 10_000)]


def judge_proof(bench: Bench, label: str, got: dict[str, Any], allowed: list[str]) -> None:
    if got["seconds"] >= NRI_LIMIT:
        bench.fail(f"{label}: NRI's proof took {got['seconds']:.2f} s (limit {NRI_LIMIT:g} s)")
    if not set(got["proven"]) <= set(allowed):
        bench.fail(f"{label}: NRI proved {got['proven']}, the pod holds {allowed}")


def late_add(bench: Bench, pod: dict[str, str], conf: dict[str, Any], label: str) -> None:
    """Another pod's ADD, started while a DEL runs (it waits for the node lock)."""
    time.sleep(0.1)
    bench.run("ADD", pod, conf, label)


def test_namespaces_full_of_links(cluster: Cluster) -> None:
    bench = Bench(cluster, FAMILY)
    log = os.path.join(cluster.tmp, "rdma-cni.log")
    conf = cluster.conf(logFile=log)
    for links in sizes():
        label = f"{links} links"
        full, other = cluster.pod([{"max_tx_rate": 100}, {}]), cluster.pod([{}])
        bench.stats["inputs"] += 1
        if bench.run("ADD", full, conf, label).code != 0:
            bench.fail(f"{label}: ADD on a clean node failed")
            continue
        flood(full["CNI_NETNS"], links)
        _, doc = record_of(cluster, full)
        got = prove(cluster, full)
        judge_proof(bench, label, got, [vf["pci"] for vf in doc["vfs"]])
        if len(got["proven"]) != len(doc["vfs"]):
            bench.fail(f"{label}: NRI proved {got['proven']} of the pod's own {len(doc['vfs'])} VFs")
        seen = len(lock_lines(log))
        racer = threading.Thread(target=late_add, args=(bench, other, conf, f"{label}, the other pod"))
        racer.start()
        bench.run("DEL", full, conf, label)
        racer.join()
        for waited, held in lock_lines(log)[seen:]:
            if held >= LOCK_BOUND or waited >= LOCK_BOUND:
                bench.fail(f"{label}: the node lock was held {held:.2f} s, waited for {waited:.2f} s")
        bench.stats["cycles"] += 1
        bench.settle([full, other], [], label)
    bench.verdict()


def test_renamed_vfs_and_decoys_with_their_names_and_macs(cluster: Cluster) -> None:
    bench = Bench(cluster, FAMILY)
    conf = cluster.conf()
    pod = cluster.pod([{}, {}])
    bench.stats["inputs"] += 1
    assert bench.run("ADD", pod, conf, "decoys").code == 0
    ns = ns_name(pod)
    _, doc = record_of(cluster, pod)
    links = json.loads(subprocess.run(["ip", "-n", ns, "-j", "link"], capture_output=True, text=True).stdout)
    macs = {link["ifname"]: link["address"] for link in links}
    for n, name in enumerate(("net1", "net1-1")):
        ip("-n", ns, "link", "set", name, "down")
        ip("-n", ns, "link", "set", name, "name", f"hidden{n}")
        # A decoy under the VF's name, MAC and alias, and a veth (the simulated VFs are veths).
        ip("-n", ns, "link", "add", name, "address", macs[name], "type", "veth", "peer", "name", f"decoy{n}")
        ip("-n", ns, "link", "set", name, "alias", f"rdma-cni:{doc['vfs'][n]['pci']}")
    flood(pod["CNI_NETNS"], min(MAX_LINKS, scaled(4_000)))
    got = prove(cluster, pod)
    judge_proof(bench, "decoys", got, [vf["pci"] for vf in doc["vfs"]])
    if got["proven"] != sorted(vf["pci"] for vf in doc["vfs"]):
        bench.fail(f"decoys: NRI proved {got['proven']}, not the pod's renamed VFs")
    bench.stats["cycles"] += 1
    bench.settle([pod], [], "decoys")
    bench.verdict()


@pytest.mark.node([SimPf("simpf0", 1, 25000)])
def test_a_vf_hidden_past_the_walk_is_given_to_no_one(cluster: Cluster) -> None:
    bench = Bench(cluster, FAMILY)
    conf = cluster.conf()
    pod = cluster.pod([{}])
    bench.stats["inputs"] += 1
    flood(pod["CNI_NETNS"], linkscan.SCAN_LINKS + 200)  # the VF then gets an index after them all
    assert bench.run("ADD", pod, conf, "hidden").code == 0
    as_previous_version(cluster, pod)  # no index recorded
    ns = ns_name(pod)
    ip("-n", ns, "link", "set", "net1", "down")
    ip("-n", ns, "link", "set", "net1", "name", "elsewhere")
    judge_proof(bench, "hidden", prove(cluster, pod), [])
    if bench.run("DEL", pod, conf, "hidden").code != 0:
        bench.fail("hidden: DEL failed")
    late = cluster.pod([{}])
    if bench.run("ADD", late, conf, "hidden, another pod").code == 0:
        bench.fail("hidden: another pod got a VF while the node's one VF sat in the first pod")
    # The namespace goes: a real VF comes home (a veth dies with it and is made again).
    ip("netns", "del", ns)
    cluster.netns_names.remove(ns)
    cluster.node.make_vf_netdev(0, 0)
    if bench.run("ADD", late, conf, "hidden, once home").code != 0:
        bench.fail("hidden: the VF was not free once home")
    bench.stats["cycles"] += 1
    bench.settle([late], [], "hidden")
    bench.verdict()
