"""IPAM plugins that refuse, hang, lie or crash; a plugin killed while IPAM runs (issue 16, items 4, 7)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

from tests.integration.conftest import (
    Cluster,
    assert_node_pristine,
    slow_ipam,
    start_add_until_ipam_runs,
    use_ipam,
    wait_warm_server,
)
from tests.support.fake_ipam import crashes, hangs, prints, sleeper
from tests.support.processes import pids_mentioning, wait_gone


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rpartition(b")")[2].split()[1])


def _argv(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")


def _leases(cluster: Cluster) -> dict[str, int]:
    """Every file host-local keeps for the network, with its size (a killed write leaves 0 bytes)."""
    d = os.path.join(cluster.tmp, "ipam", "rdma-net")
    if not os.path.isdir(d):
        return {}
    return {n: os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n[0].isdigit()}


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_kill_9_during_ipam_add_then_del_at_once_leaves_no_lease(cluster: Cluster, start: str) -> None:
    if start == "warm":
        if not os.environ.get("RDMA_CNI_BINARY"):
            pytest.skip("warm start is a feature of the built binary")
        wait_warm_server(cluster)
    conf, marker = slow_ipam(cluster, seconds=2)
    pod = cluster.pod([{"max_tx_rate": 1000}])
    if start == "cold":
        pod["RDMA_CNI_WARM"] = "0"
    proc = start_add_until_ipam_runs(cluster, pod, conf, marker, new_session=True)
    os.killpg(proc.pid, 9)
    proc.wait()
    ipam = pids_mentioning(os.path.join(cluster.tmp, "bin", "slow-local"))
    assert ipam, "IPAM was killed with the plugin"
    if os.environ.get("RDMA_CNI_BINARY"):
        # The built binary's guard is its launcher in guard mode (launcher/guard.c), not a fork.
        assert any(b"--ipam-guard" in _argv(_parent(pid)) for pid in ipam), "no exec'd guard"
    # The runtime's DEL comes at once: it waits for the lock the guard holds
    # until IPAM has written its lease, then releases that lease.
    done = cluster.run("DEL", pod, conf)
    assert done.ok, done.doc
    assert wait_gone(ipam, timeout=1)
    assert _leases(cluster) == {}
    assert_node_pristine(cluster)


def test_hanging_ipam_add_is_cut_at_the_budget_with_its_grandchildren(cluster: Cluster) -> None:
    tag = sleeper(os.path.join(cluster.tmp, "bin"), f"hang{os.getpid()}add")
    conf = use_ipam(cluster, "hang-ipam", {"ADD": hangs(tag)}, ipamTimeoutSeconds=2)
    pod = cluster.pod([{}, {}])
    started = time.monotonic()
    out = cluster.run("ADD", pod, conf)
    elapsed = time.monotonic() - started
    assert out.doc is not None and out.doc["code"] == 11, out.doc
    assert "ipamTimeoutSeconds" in out.doc["msg"]
    assert elapsed < 2 + 4, elapsed
    # The script and the grandchild it left behind: the whole group was killed.
    assert wait_gone(pids_mentioning(tag), timeout=3)
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def test_hanging_ipam_del_costs_one_budget_not_one_per_interface(cluster: Cluster) -> None:
    tag = sleeper(os.path.join(cluster.tmp, "bin"), f"hang{os.getpid()}del")
    conf = use_ipam(cluster, "hang-ipam", {"DEL": hangs(tag)}, ipamTimeoutSeconds=3)
    pod = cluster.pod([{}, {}, {}])
    assert cluster.run("ADD", pod, conf).ok
    started = time.monotonic()
    out = cluster.run("DEL", pod, conf)
    elapsed = time.monotonic() - started
    assert not out.ok and out.doc is not None
    assert "ipamTimeoutSeconds" in json.dumps(out.doc)
    assert elapsed < 3 + 3.5, elapsed  # it was 3 x the timeout, one after another
    assert wait_gone(pids_mentioning(tag), timeout=3)
    # Repaired, the next DEL finishes the job.
    use_ipam(cluster, "hang-ipam", {})
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


ERROR_DOC = {"cniVersion": "1.0.0", "code": 7, "msg": "range 10.77.0.0/24 is exhausted"}


def _result(**ip: Any) -> dict[str, Any]:
    return {"cniVersion": "1.0.0", "ips": [{"address": "10.77.0.9/24", **ip}]}


@pytest.mark.parametrize(
    ("behaviour", "code", "needle"),
    [
        pytest.param(prints(ERROR_DOC, 0), 104, "is exhausted", id="error-document-exit-0"),
        pytest.param(prints({**ERROR_DOC, "code": 11, "msg": "busy"}, 0), 11, "busy", id="try-again-exit-0"),
        pytest.param(prints({**ERROR_DOC, "code": 999, "msg": "no"}, 1), 104, "no", id="refusing"),
        pytest.param(prints(_result(address="10.77.0.300/24")), 104, "ips[0].address", id="bad-address"),
        pytest.param(prints(_result(address="10.77.0.9")), 104, "prefix length", id="no-prefix"),
        pytest.param(
            prints(_result(address="10.77.0.9/24", gateway="fe80::1")), 104, "gateway", id="gw-family"
        ),
        pytest.param(prints(_result(gateway="10.77.0.1x")), 104, "gateway", id="bad-gateway"),
        pytest.param(
            prints({**_result(), "routes": [{"dst": "default"}]}), 104, "routes[0].dst", id="bad-route"
        ),
        pytest.param(
            prints({**_result(), "routes": [{"dst": "0.0.0.0/0", "priority": "high"}]}),
            104,
            "priority",
            id="bad-route-priority",
        ),
        pytest.param(prints({"cniVersion": "1.0.0", "ips": 5}), 104, "malformed", id="ips-not-a-list"),
        pytest.param(prints({**_result(), "dns": {"nameservers": 5}}), 104, "dns", id="bad-dns"),
        pytest.param("cat >/dev/null; echo not json; exit 0", 104, "not JSON", id="not-json"),
        pytest.param("cat >/dev/null; exit 0", 104, "no result", id="silent"),
        pytest.param(crashes(), 104, "signal 11", id="crashing"),
    ],
)
def test_lying_refusing_and_crashing_ipam_fail_add_cleanly(
    cluster: Cluster, behaviour: str, code: int, needle: str
) -> None:
    conf = use_ipam(cluster, "bad-ipam", {"ADD": behaviour})
    pod = cluster.pod([{"max_tx_rate": 1000}, {}])
    out = cluster.run("ADD", pod, conf)
    assert out.doc is not None and out.doc["code"] == code, out.doc
    assert needle in out.doc["msg"], out.doc
    assert_node_pristine(cluster)
