"""The fault tier's hostile pods against the extender at 5,000 nodes (issue 29 items 2, 3 and 5).

One extender process (the built binary) with 5,000 nodes in its cache, each
publishing its own PF state (so no verdict is shared between nodes), and
seeded hostile pods filtered as kube-scheduler filters them, over one
keep-alive connection, between ordinary pods: a network selected hundreds or
thousands of times, alternating networks with constrained requests, interface
names and PF names of 2 KB to 60,000 characters, distinct large valid
annotations. Invariants, read from the answers and the process:

- filter answer size bounded: an Error answer is under 4 KiB, any other at
  most nodes x (name + reason cap + 16) bytes, whatever the tenant wrote;
- extender memory bounded: its resident set stays under 400 MiB (conf/'s
  limit is 512 Mi);
- every filter within its time bound: answered within kube-scheduler's
  ``httpTimeout`` (here 4 s; the extender abandons deciding at half of it).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.extender.wire import MAX_REASON
from rdma_cni.shared import nodestate
from rdma_cni.shared.nodestate import Network, NodeState, PfSummary
from tests.faults.knobs import SEED, STATS, scaled
from tests.support import sched_objects as so
from tests.support.apiserver import ApiServer
from tests.support.extenderproc import start_extender, wait_ready

if not os.environ.get("RDMA_CNI_BINARY"):
    pytest.skip(
        "the fault tier drives the built binary (make faults sets RDMA_CNI_BINARY)", allow_module_level=True
    )

FAMILY = "hostile pods"
ANNOTATION = "rdma_interfaces_required"
NETWORKS = "k8s.v1.cni.cncf.io/networks"
NODES = 5_000
HTTP_TIMEOUT = 4.0
RSS_LIMIT_MIB = 400
ERROR_ANSWER_MAX = 4096
ROUNDS = 12


def _state(i: int) -> str:
    pfs = tuple(
        PfSummary(
            f"ens{k}f0",
            capacity_tx_rate=100_000 + i * 4 + k,
            used_tx_rate=(i * 7 + k * 13) % 40 * 1_000,
            capacity_vfs=16,
            used_vfs=(i + k) % 5,
            numa_node=k // 2,
        )
        for k in range(4)
    )
    networks = (
        Network("rdma-a", ("ens0f0", "ens1f0"), ("rail-1", "rail-2")),
        Network("rdma-b", ("ens2f0", "ens3f0"), ("rail-1", "rail-2")),
    )
    return nodestate.encode(
        NodeState(version=2, generation=1, updated=so.stamp(), pfs=pfs, allocations=(), networks=networks)
    )


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Hostile:
    """The seeded hostile pods, one kind per call."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.n = 0

    def _pod(self, annotations: dict[str, str]) -> dict[str, Any]:
        self.n += 1
        return so.pod(f"h{self.n}", annotations, uid=f"hostile-{self.n}")

    def repeated(self) -> dict[str, Any]:
        count = self.rng.choice([30, 300, 3_000])
        pattern = self.rng.choice([["rdma-a"], ["rdma-a", "rdma-b"]])
        return self._pod({NETWORKS: ",".join(pattern * (count // len(pattern)))})

    def constrained(self) -> dict[str, Any]:
        ask = [
            {"min_tx_rate": self.rng.choice([1_000, 3_000, 20_000]), "rail": "rail-1"},
            {"min_tx_rate": 2_000},
        ]
        value = json.dumps({"interfaces": ask, "different_pfs": True})
        return self._pod(
            {NETWORKS: ",".join(["rdma-a", "rdma-b"] * self.rng.choice([4, 8, 16])), ANNOTATION: value}
        )

    def oversized(self) -> dict[str, Any]:
        if self.rng.random() < 0.5:
            value = json.dumps([{self.rng.choice(["name", "pf"]): "x" * 60_000}])
        else:
            value = json.dumps([{"name": f"{i:02d}" + "y" * 2_046} for i in range(32)])
        return self._pod({ANNOTATION: value})

    def padded(self) -> dict[str, Any]:
        # Distinct, valid and large: each one a new entry for the request memo.
        return self._pod({ANNOTATION: "[{}]" + " " * (60_000 + self.n)})


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        yield server


def _start(tmp: Path, api: ApiServer) -> tuple[subprocess.Popen[str], int]:
    kubeconfig = api.write_kubeconfig(tmp / "kubeconfig")
    return start_extender(kubeconfig, "--networks", "rdma-a,rdma-b", "--http-timeout", str(HTTP_TIMEOUT))


def test_hostile_pods_at_5000_nodes_get_bounded_answers_in_time(tmp_path: Path, api: ApiServer) -> None:
    stats = STATS.setdefault(FAMILY, Counter())
    names = [f"node-{i:05d}" for i in range(NODES)]
    for i, name in enumerate(names):
        api.add_node(name, annotations={nodestate.ANNOTATION: _state(i)})
    proc, port = _start(tmp_path, api)
    problems: list[str] = []
    slowest = peak = 0.0
    try:
        wait_ready(port, timeout=120, interval=0.2)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT * 3)
        hostile = Hostile(random.Random(f"{SEED}:hostile-pods-extender"))
        kinds = [hostile.repeated, hostile.constrained, hostile.oversized, hostile.padded]
        ordinary = so.rdma_pod("ordinary", [(10_000, 0)])
        size_bound = NODES * (len(names[0]) + MAX_REASON + 16)
        for round_ in range(scaled(ROUNDS)):
            for make in [*kinds, lambda: ordinary]:
                pod = make()
                body = json.dumps(so.args_names(pod, names))
                started = time.monotonic()
                conn.request("POST", "/filter", body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                raw = resp.read()
                took = time.monotonic() - started
                stats["runs"] += 1
                if make is ordinary or pod is ordinary:
                    stats["cycles"] += 1
                else:
                    stats["inputs"] += 1
                what = f"round {round_} {getattr(make, '__name__', 'ordinary')}"
                doc = json.loads(raw)
                if resp.status != 200:
                    problems.append(f"{what}: HTTP {resp.status}")
                if took > HTTP_TIMEOUT:
                    problems.append(
                        f"{what}: filter took {took:.2f} s, more than httpTimeout {HTTP_TIMEOUT} s"
                    )
                if doc.get("Error") and len(raw) > ERROR_ANSWER_MAX:
                    problems.append(f"{what}: an Error answer of {len(raw)} bytes")
                if len(raw) > size_bound:
                    problems.append(f"{what}: an answer of {len(raw)} bytes, over {size_bound}")
                rss = _rss_mib(proc.pid)
                slowest, peak = max(slowest, took), max(peak, rss)
                if rss > RSS_LIMIT_MIB:
                    problems.append(f"{what}: the extender's RSS is {rss:.0f} MiB")
        if proc.poll() is not None:
            problems.append("the extender died")
        conn.close()
    finally:
        proc.kill()
        proc.wait(10)
    print(f"hostile pods (extender): slowest filter {slowest:.2f} s, peak RSS {peak:.0f} MiB")
    stats["violations"] += len(problems)
    assert not problems, "\n".join(problems[:20])
