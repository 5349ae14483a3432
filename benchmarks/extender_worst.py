"""The worst filters one pod can ask of the extender at 5,000 nodes, beside an ordinary one.

Run with ``.venv/bin/python benchmarks/extender_worst.py [--nodes 5000] [--http-timeout 10]``;
prints a Markdown table. In-process (the verbs, not the HTTP server: what is
measured is deciding, which is what a pod can make long; the server's own
bounds are benchmarks/extender_bench.py's and the fault tier's). Every node
publishes its own PF state (4 PFs of 16 VFs on two networks with two rails,
a capacity that differs per node, some VFs and bandwidth in use), so no
verdict is shared between nodes and the verdict cache cannot help: each
filter below judges 5,000 distinct states. Each pod is filtered twice, first
cold (nothing cached for its shape) and then again (what kube-scheduler's
retry of the pod costs).

The bound under test: a filter answers within ``--http-timeout`` x
DECISION_SHARE (half of kube-scheduler's httpTimeout) plus the time to encode
its answer, deciding or abandoning; an abandoned filter's verdicts so far are
kept, so the retry goes further.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from datetime import UTC, datetime
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rdma_cni.extender.decide import Decider, NodeView  # noqa: E402
from rdma_cni.extender.demand import Demands  # noqa: E402
from rdma_cni.extender.reservations import Reservations  # noqa: E402
from rdma_cni.extender.settings import Settings  # noqa: E402
from rdma_cni.extender.verbs import Extender  # noqa: E402
from rdma_cni.shared import nodestate  # noqa: E402
from rdma_cni.shared.nodestate import Network, NodeState, PfSummary  # noqa: E402
from rdma_cni.shared.podrequest import parse_request  # noqa: E402
from tests.support import sched_objects as so  # noqa: E402

NETWORKS = "k8s.v1.cni.cncf.io/networks"
ANNOTATION = "rdma_interfaces_required"


def node_state(i: int) -> str:
    """Node ``i``'s state: its own capacities and load, so that its fingerprint is its own."""
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


def pods() -> list[tuple[str, dict[str, Any]]]:
    """(what it is, the pod): the ordinary pod first, then the worst ones found."""
    tight = json.dumps(
        {
            "interfaces": [
                {"min_tx_rate": 33_000, "rail": "rail-1"},
                {"min_tx_rate": 31_000},
                {"min_tx_rate": 29_000, "max_tx_rate": 90_000},
            ],
            "different_pfs": True,
        }
    )
    fits = json.dumps(
        {
            "interfaces": [{"min_tx_rate": 3_000, "rail": "rail-1"}, {"min_tx_rate": 2_000}],
            "different_pfs": True,
        }
    )
    return [
        ("ordinary: one interface, 10 Gbit/s", so.rdma_pod("ordinary", [(10_000, 0)])),
        ("ordinary: rdma-a and rdma-b, one interface each", so.pod("two", {NETWORKS: "rdma-a,rdma-b"})),
        (
            "oversized: a 60,000-character interface name",
            so.pod("long", {ANNOTATION: json.dumps([{"name": "x" * 60_000}])}),
        ),
        ("3,000 selections of rdma-a (21 KB)", so.pod("rep3000", {NETWORKS: ",".join(["rdma-a"] * 3_000)})),
        ("30 selections of rdma-a", so.pod("rep30", {NETWORKS: ",".join(["rdma-a"] * 30)})),
        (
            "16 selections alternating rdma-a/rdma-b, 3 min-rate interfaces each, rail, different_pfs",
            so.pod("alt16", {NETWORKS: ",".join(["rdma-a", "rdma-b"] * 8), ANNOTATION: tight}),
        ),
        (
            "4 selections alternating, the same tight request",
            so.pod("alt4", {NETWORKS: ",".join(["rdma-a", "rdma-b"] * 2), ANNOTATION: tight}),
        ),
        (
            "16 selections alternating, 2 interfaces each (a rail, min rates, different_pfs): fits",
            so.pod("fit16", {NETWORKS: ",".join(["rdma-a", "rdma-b"] * 8), ANNOTATION: fits}),
        ),
        (
            "32 selections alternating, the same: fits on few nodes",
            so.pod("fit32", {NETWORKS: ",".join(["rdma-a", "rdma-b"] * 16), ANNOTATION: fits}),
        ),
    ]


def extender(nodes: int, http_timeout: float) -> tuple[Extender, list[str]]:
    decider = Decider(max_state_age=3_600)
    names = [f"node-{i:05d}" for i in range(nodes)]
    views: dict[str, NodeView] = {name: decider.view(node_state(i)) for i, name in enumerate(names)}
    ext = Extender(
        decider=decider,
        demands=Demands(
            annotation=ANNOTATION,
            networks=frozenset({"rdma-a", "rdma-b"}),
            default_request=parse_request("[{}]", "--default-request"),
        ),
        reservations=Reservations(600),
        cache_views=lambda: views,
        settings=Settings(http_timeout=http_timeout),
    )
    ext.ready.set()
    return ext, names


def run(ext: Extender, pod: dict[str, Any], names: list[str]) -> tuple[float, int, str]:
    started = time.perf_counter()
    answer = ext.filter_encoded(so.args_names(pod, names))
    body = answer if isinstance(answer, bytes) else json.dumps(answer, separators=(",", ":")).encode()
    took = time.perf_counter() - started
    doc = json.loads(body)
    if doc["Error"]:
        outcome = "abandoned" if "took too long" in doc["Error"] else "refused (Error)"
    else:
        outcome = f"{len(doc['NodeNames'])} pass"
    return took, len(body), outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5_000)
    parser.add_argument("--http-timeout", type=float, default=10.0, help="kube-scheduler's, seconds")
    args = parser.parse_args(argv)
    ext, names = extender(args.nodes, args.http_timeout)
    bound = ext.settings.decision_timeout
    print(
        f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f};"
        f" {args.nodes} nodes in {args.nodes} distinct states; httpTimeout {args.http_timeout:g} s,"
        f" decision bound {bound:g} s"
    )
    print("| pod | first filter s | of httpTimeout | answer bytes | outcome | again s | outcome |")
    print("| --- | ---: | ---: | ---: | --- | ---: | --- |")
    worst = 0.0
    for what, pod in pods():
        took, size, outcome = run(ext, pod, names)
        again, _, outcome2 = run(ext, pod, names)
        worst = max(worst, took, again)
        print(
            f"| {what} | {took:.2f} | {took / args.http_timeout:.0%} | {size:,} | {outcome} |"
            f" {again:.2f} | {outcome2} |"
        )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    share = worst / args.http_timeout
    print(f"\nslowest filter {worst:.2f} s = {share:.0%} of httpTimeout; peak RSS {rss:.0f} MiB")
    return 0 if worst < args.http_timeout else 1


if __name__ == "__main__":
    raise SystemExit(main())
