"""The plugin under cnitool v1.3.0 (``make cnitool``), the CNI project's own runtime, on the simulated node.

cnitool runs a conflist by name through libcni as container runtimes do: ADD with the
result cached under /var/lib/cni, CHECK and DEL with that cached result as prevResult,
STATUS, and GC (which DELs every cached attachment of the network, then runs the
plugin's GC with no valid attachments). Each test names its network uniquely, so that
GC never reaches another run's cached attachments.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.conftest import HOST_LOCAL_DIR, REPO, Cluster, assert_node_pristine, ns_name
from tests.support import cnitool
from tests.support.cnitool import CniTool
from tests.support.simnode import ip, netns_links

LIBCNI_RESULTS = "/var/lib/cni/results"
Tool = tuple[CniTool, str]  # cnitool set up for the node, and the test's own network name

if not os.path.exists(cnitool.path()):
    pytest.fail(f"{cnitool.path()} is missing: run make cnitool", pytrace=False)


def install_plugin(bindir: str) -> None:
    """rdma-cni on cnitool's CNI_PATH: the built binary, or the package behind a small script."""
    os.makedirs(bindir, exist_ok=True)
    target = os.path.join(bindir, "rdma-cni")
    binary = os.environ.get("RDMA_CNI_BINARY")
    if binary:
        os.symlink(binary, target)
        return
    with open(target, "w", encoding="utf-8") as f:
        f.write(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m rdma_cni "$@"\n')
    os.chmod(target, 0o755)


@pytest.fixture
def tool(cluster: Cluster) -> Iterator[Tool]:
    """cnitool set up for this node, and the name of a network only this test uses."""
    network = f"rdma-ct-{uuid.uuid4().hex[:12]}"
    plugin = {k: v for k, v in cluster.conf().items() if k not in ("cniVersion", "name")}
    netd = os.path.join(cluster.tmp, "net.d")
    os.makedirs(netd)
    with open(os.path.join(netd, "10-rdma.conflist"), "w", encoding="utf-8") as f:
        json.dump({"cniVersion": "1.1.0", "name": network, "plugins": [plugin]}, f)
    bindir = os.path.join(cluster.tmp, "cnibin")
    install_plugin(bindir)
    yield CniTool(netd, f"{bindir}:{HOST_LOCAL_DIR}", cluster.node.env()), network
    for stale in glob.glob(os.path.join(LIBCNI_RESULTS, f"{network}-*")):
        os.unlink(stale)


def leases(cluster: Cluster, network: str) -> list[str]:
    d = os.path.join(cluster.tmp, "ipam", network)
    if not os.path.isdir(d):
        return []
    return sorted(n for n in os.listdir(d) if n[0].isdigit() and n != "last_reserved_ip.0")


def cached(network: str) -> list[str]:
    """libcni's cached results of this network (one per attachment cnitool added)."""
    return sorted(glob.glob(os.path.join(LIBCNI_RESULTS, f"{network}-*")))


def pristine(cluster: Cluster, network: str) -> None:
    assert_node_pristine(cluster)
    assert leases(cluster, network) == []


def add(tool: CniTool, network: str, pod: dict[str, str]) -> dict[str, Any]:
    got = tool.run("add", network, pod["CNI_NETNS"], cni_args=pod["CNI_ARGS"])
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)


def test_status_add_check_del_through_cnitool(cluster: Cluster, tool: Tool) -> None:
    """Every verb a runtime sends, in its order, through cnitool; the pod's request from the API."""
    ct, network = tool
    pod = cluster.pod([{"min_tx_rate": 15000, "max_tx_rate": 20000}, {"min_tx_rate": 5000}])
    status = ct.run("status", network, pod["CNI_NETNS"])
    assert status.returncode == 0, status.stderr
    result = add(ct, network, pod)
    assert [i["name"] for i in result["interfaces"] if i.get("sandbox")] == ["net1", "net1-1"]
    assert {"net1", "net1-1"} <= set(netns_links(ns_name(pod)))
    assert len(cluster.records) == 1 and len(leases(cluster, network)) == 2
    assert len(cached(network)) == 1
    rates = [s.get("rate") for t in cluster.node.vf_state()["pfs"].values() for s in t.values()]
    assert [15000, 20000] in rates
    check = ct.run("check", network, pod["CNI_NETNS"], cni_args=pod["CNI_ARGS"])
    assert check.returncode == 0, check.stderr
    for _ in range(2):  # DEL is idempotent, also once libcni's cache entry is gone
        gone = ct.run("del", network, pod["CNI_NETNS"], cni_args=pod["CNI_ARGS"])
        assert gone.returncode == 0, gone.stderr
        pristine(cluster, network)
    assert cached(network) == []


def test_check_through_cnitool_reports_a_lost_interface(cluster: Cluster, tool: Tool) -> None:
    """An interface the pod renamed fails CHECK with the plugin's message, as cnitool prints it; DEL still
    finds the VF by its identity."""
    ct, network = tool
    pod = cluster.pod([{}, {}])
    add(ct, network, pod)
    ip("-n", ns_name(pod), "link", "set", "net1-1", "name", "decoy")
    check = ct.run("check", network, pod["CNI_NETNS"], cni_args=pod["CNI_ARGS"])
    assert check.returncode == 1
    assert "net1-1" in check.stderr, check.stderr
    gone = ct.run("del", network, pod["CNI_NETNS"], cni_args=pod["CNI_ARGS"])
    assert gone.returncode == 0, gone.stderr
    pristine(cluster, network)


def test_gc_through_cnitool_releases_what_the_runtime_forgot(cluster: Cluster, tool: Tool) -> None:
    """cnitool's GC: libcni DELs the attachment it cached, the plugin's GC releases the one it lost."""
    ct, network = tool
    kept, lost = cluster.pod([{}]), cluster.pod([{}, {}])
    add(ct, network, kept)
    add(ct, network, lost)
    assert len(cluster.records) == 2 and len(cached(network)) == 2
    lost_cache = [c for c in cached(network) if _cached_netns(c) == lost["CNI_NETNS"]]
    assert len(lost_cache) == 1
    os.unlink(lost_cache[0])  # the runtime lost track of it: only the plugin's GC can find it now
    gc = ct.run("gc", network, kept["CNI_NETNS"])
    assert gc.returncode == 0, gc.stderr
    pristine(cluster, network)
    assert cached(network) == []


def _cached_netns(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return str(json.load(f)["netns"])


def test_add_that_cannot_fit_fails_through_cnitool_and_leaves_nothing(cluster: Cluster, tool: Tool) -> None:
    """No capacity: cnitool exits 1 with the plugin's reason; no VF, lease, record or cached result left."""
    ct, network = tool
    pod = cluster.pod([{"min_tx_rate": 30000}])  # more than either PF's link
    got = ct.run("add", network, pod["CNI_NETNS"], cni_args=pod["CNI_ARGS"])
    assert got.returncode == 1
    assert "does not fit on this node" in got.stderr and "30000" in got.stderr, got.stderr
    pristine(cluster, network)
    assert cached(network) == []
