"""The same pods through kube-scheduler's DRA allocator and through rdma-scheduler with the extender.

Issue 40 section 5. One control plane of the cluster tier's
(tests/support/kube/controlplane.py: etcd, kube-apiserver, kube-controller-manager
with the resource claim controller, all v1.37.2 on 127.0.0.1) and the same
nodes for both paths: each Node created Ready with the extender benchmark's
node state (benchmarks/extender_bench.py: two PFs of 100000 Mbit/s and 32 VFs,
idle, partly used or busy) in its ``rdma-cni.io/node-state`` annotation, and
the same free room published as the node's ResourceSlice (one device per PF:
``bandwidth`` the PF's capacity less what its pods hold, ``vfs`` its free VFs,
as the agent publishes a DRA network's PF beside pods of the other path).

The pod stream is the extender benchmark's: the same request shapes from the
same seed, 10m CPU each, more pods than the nodes hold. Each path takes the
stream twice, the pods of each run deleted before the next (a deleted pod's
claim goes with it, an extender reservation ends):

- in order: each pod created once the one before was decided (bound, or
  refused as unschedulable), so both paths see the same pods in the same
  order: how many are placed before the first rejection, and how many are
  Pending at the end, measure the placement alone;
- queued: every pod created before the path's scheduler starts (kube-scheduler
  then takes them in no particular order: its informer's first list is
  unordered), pods bound per second from the first bind to the last.

The paths:

- ``dra``: the default kube-scheduler (its DynamicResources plugin, consumable
  capacity on, as in v1.37 by default), each pod referring to the
  ResourceClaimTemplate ``rdma-cni claim`` renders for its request; the
  client's rate at ``--dra-qps`` (kube-scheduler ships 50; it counts each
  claim's allocation write and each Binding);
- ``extender``: rdma-scheduler from conf/ (kube-scheduler and the extender,
  which binds with its own client), pods asking in the annotation.

Each run also checks that no node was promised more than it has (DRA: each
device's consumed capacity against its capacity, from the claims; extender:
each node's bound pods placed together on its published state by placement's
oracle, or its exact search beyond 12 interfaces).

Run by hand (it needs ``make components``)::

    .venv/bin/python benchmarks/dra_vs_extender.py --nodes 100 --pods 600
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tests.support.kube.rdmascheduler as rdmascheduler  # noqa: E402
from benchmarks.cluster_throughput import (  # noqa: E402
    Api,
    BenchControlPlane,
    BindWatch,
    make_namespace,
    start_default_scheduler,
    wait_for,
)
from benchmarks.extender_bench import ANNOTATION, SHAPES, node_state, request_value  # noqa: E402
from rdma_cni.shared import nodestate  # noqa: E402
from rdma_cni.shared.dra import BANDWIDTH, DRIVER, VFS  # noqa: E402
from rdma_cni.shared.dra.claims import claim_template  # noqa: E402
from rdma_cni.shared.dra.slices import DraDevice, render_slices  # noqa: E402
from rdma_cni.shared.placement import PfState, Request  # noqa: E402
from rdma_cni.shared.podrequest import parse_request  # noqa: E402
from rdma_cni.shared.quantity import whole  # noqa: E402
from tests.support.kube.applyconf import apply_conf  # noqa: E402
from tests.support.kube.controlplane import ControlPlane  # noqa: E402
from tests.support.kube.objects import node_doc, pod_doc  # noqa: E402
from tests.support.placement_oracle import reference_fits  # noqa: E402

NETWORK = "rdma-dra"
RESOURCE = "/apis/resource.k8s.io/v1"


@dataclass
class Result:
    """What one path did with the stream, in order and queued."""

    path: str
    nodes: int
    pods: int
    bound: int = 0  # in order
    before_first_rejection: int = 0  # in order
    pending: int = 0  # in order
    queued_bound: int = 0
    queued_pending: int = 0
    rate: float = 0.0  # queued: pods bound per second, first to last bind
    seconds: float = 0.0
    over_committed: list[str] = field(default_factory=list)
    nodes_used: int = 0
    placed_gbps: float = 0.0  # in order: the bound pods' min_tx_rate, summed (Gbit/s)
    # in order: Pending pods by their largest interface (Mbit/s) -> count
    pending_by_size: dict[int, int] = field(default_factory=dict)


class DecisionWatch(BindWatch):
    """A BindWatch that also remembers the pods kube-scheduler marked unschedulable."""

    def __init__(self, api: Api, namespace: str) -> None:
        self.refused: set[str] = set()
        super().__init__(api, namespace)

    def _seen(self, obj: dict[str, Any], now: float) -> None:
        super()._seen(obj, now)
        for condition in (obj.get("status") or {}).get("conditions") or []:
            if (condition.get("type"), condition.get("status"), condition.get("reason")) == (
                "PodScheduled",
                "False",
                "Unschedulable",
            ):
                with self.lock:
                    self.refused.add(obj["metadata"]["name"])

    def decided(self, name: str) -> bool:
        with self.lock:
            return name in self.bound or name in self.refused


def shapes(count: int, seed: int) -> list[tuple[int, ...]]:
    """The stream: the extender benchmark's shapes, drawn as its pod_specs draws them."""
    rng = random.Random(seed)
    return [rng.choice(SHAPES) for _ in range(count)]


def node_names(count: int) -> list[str]:
    return [f"dn-{i:04d}" for i in range(count)]


def states(count: int, seed: int) -> dict[str, nodestate.NodeState]:
    rng = random.Random(seed)
    return {name: node_state(rng, name) for name in node_names(count)}


def slice_of(name: str, state: nodestate.NodeState) -> dict[str, Any]:
    """The node's PFs as the agent would publish them for a DRA network beside the pods it holds."""
    devices = [
        DraDevice(
            NETWORK,
            pf.name,
            vfs=pf.capacity_vfs - pf.used_vfs,
            bandwidth=None if pf.capacity_tx_rate is None else pf.capacity_tx_rate - pf.used_tx_rate,
            max_tx_rate=pf.capacity_tx_rate,
            link_speed=pf.capacity_tx_rate,
            numa_node=pf.numa_node,
        )
        for pf in state.pfs
    ]
    (doc,) = render_slices(name, devices, 1)
    return doc


def create_nodes(api: Api, nodes: dict[str, nodestate.NodeState], workers: int) -> None:
    """Ready Nodes with their node state, and their ResourceSlice."""

    def one(name: str) -> None:
        doc = node_doc(name, {nodestate.ANNOTATION: nodestate.encode(nodes[name])})
        api.request("POST", "/api/v1/nodes", doc)
        api.request(
            "PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": None}}, "application/merge-patch+json"
        )
        api.request("POST", f"{RESOURCE}/resourceslices", slice_of(name, nodes[name]))

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, list(nodes)))


def template_name(shape: tuple[int, ...]) -> str:
    return "rdma-" + "-".join(str(r) for r in shape)


def pod_docs(namespace: str, stream: list[tuple[int, ...]], path: str) -> list[dict[str, Any]]:
    """The phase's pods, in stream order: a claim of the shape's template (dra), or the annotation."""
    docs = []
    for i, shape in enumerate(stream):
        if path == "dra":
            doc = pod_doc(namespace, f"p-{i:05d}", annotations={"k8s.v1.cni.cncf.io/networks": NETWORK})
            doc["spec"]["resourceClaims"] = [
                {"name": "rdma", "resourceClaimTemplateName": template_name(shape)}
            ]
            doc["spec"]["containers"][0]["resources"]["claims"] = [{"name": "rdma"}]
        else:
            annotations = {
                ANNOTATION: request_value(shape),
                "k8s.v1.cni.cncf.io/networks": "default/rdma-net",
            }
            doc = pod_doc(namespace, f"p-{i:05d}", annotations=annotations, scheduler="rdma-scheduler")
        docs.append(doc)
    return docs


def create_pods(api: Api, namespace: str, docs: list[dict[str, Any]]) -> None:
    """One after the other, so that creation order is stream order."""
    for doc in docs:
        api.request("POST", f"/api/v1/namespaces/{namespace}/pods", doc)


def settle(watch: BindWatch, total: int, stall: float) -> None:
    """Until every pod is bound or none was bound for ``stall`` seconds."""
    last, since = -1, time.monotonic()
    while True:
        n = watch.count()
        if n >= total:
            return
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since > stall:
            return
        time.sleep(0.2)


def dra_over_commit(api: Api, namespace: str, nodes: dict[str, nodestate.NodeState]) -> list[str]:
    """Devices whose claims consume more bandwidth or VFs than the device has."""
    capacity: dict[tuple[str, str], tuple[int, int]] = {}
    for name in nodes:
        for dev in slice_of(name, nodes[name])["spec"]["devices"]:
            cap = dev["capacity"]
            capacity[(name, dev["name"])] = (
                whole(cap[BANDWIDTH]["value"]) or 0,
                whole(cap[VFS]["value"]) or 0,
            )
    used: dict[tuple[str, str], list[int]] = {}
    for claim in api.request("GET", f"{RESOURCE}/namespaces/{namespace}/resourceclaims")["items"]:
        for r in ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get(
            "results"
        ) or []:
            if r["driver"] == DRIVER:
                entry = used.setdefault((r["pool"], r["device"]), [0, 0])
                entry[0] += whole(r["consumedCapacity"].get(BANDWIDTH, 0)) or 0
                entry[1] += 1
    return [
        f"{key}: {u} of {capacity[key]}"
        for key, u in used.items()
        if u[0] > capacity[key][0] or u[1] > capacity[key][1]
    ]


def extender_over_commit(
    bound: dict[str, str], stream: list[tuple[int, ...]], nodes: dict[str, nodestate.NodeState]
) -> list[str]:
    """Nodes whose bound pods do not fit its published state together (placement's brute-force oracle)."""
    by_node: dict[str, list[Request]] = {}
    for pod, node in bound.items():
        by_node.setdefault(node, []).extend(Request(r, r * 2) for r in stream[int(pod.split("-")[1])])
    out = []
    for node, requests in by_node.items():
        pfs = [
            PfState(
                pf.name, pf.capacity_vfs - pf.used_vfs, pf.capacity_tx_rate, pf.used_tx_rate, pf.numa_node
            )
            for pf in nodes[node].pfs
        ]
        # The brute-force oracle up to 12 interfaces; beyond, placement's exact search without a budget.
        fits = reference_fits(requests, pfs) if len(requests) <= 12 else _fits(requests, pfs)
        if not fits:
            out.append(f"{node}: {len(requests)} interfaces do not fit")
    return out


def _fits(requests: list[Request], pfs: list[PfState]) -> bool:
    from rdma_cni.shared.placement import NoFit, place

    try:
        place(requests, pfs, max_steps=None)
    except NoFit:
        return False
    return True


def _templates(api: Api, namespace: str, stream: list[tuple[int, ...]]) -> None:
    for shape in sorted(set(stream)):
        request = parse_request(request_value(shape), "bench")
        doc = claim_template(request, name=template_name(shape), network=NETWORK, namespace=namespace)
        api.request("POST", f"{RESOURCE}/namespaces/{namespace}/resourceclaimtemplates", doc)


def _clean(api: Api, namespace: str) -> None:
    api.request("DELETE", f"/api/v1/namespaces/{namespace}/pods?gracePeriodSeconds=0")
    wait_for(
        f"pods of {namespace} deleted",
        lambda: not api.request("GET", f"/api/v1/namespaces/{namespace}/pods?limit=1")["items"],
        timeout=300,
    )


def run_path(
    api: Api,
    path: str,
    stream: list[tuple[int, ...]],
    nodes: dict[str, nodestate.NodeState],
    start: Callable[[], Callable[[], None]],
    stall: float,
    tag: str = "",
) -> Result:
    """The stream in order (one pod decided after the other), then queued; measured and cleaned up."""
    result = Result(path, len(nodes), len(stream))
    # A namespace per run: one emptied of pods keeps its claims' templates, and is never reused.
    namespace = f"dra-bench-{path}{tag}-in-order"
    make_namespace(api, namespace)
    if path == "dra":
        _templates(api, namespace, stream)
    watch = DecisionWatch(api, namespace)
    stop = start()
    try:
        for doc in pod_docs(namespace, stream, path):
            api.request("POST", f"/api/v1/namespaces/{namespace}/pods", doc)
            name = doc["metadata"]["name"]
            deadline = time.monotonic() + 120
            while not watch.decided(name):
                assert time.monotonic() < deadline, f"{name} never decided"
                time.sleep(0.01)
        settle(watch, len(stream), stall)  # a refused pod retried meanwhile may still be bound
    finally:
        stop()
    watch.stop()
    with watch.lock:
        bound = dict(watch.nodes)
    result.bound = len(bound)
    result.pending = len(stream) - len(bound)
    result.before_first_rejection = next(
        (i for i in range(len(stream)) if f"p-{i:05d}" not in bound), len(stream)
    )
    if path == "dra":
        result.over_committed = dra_over_commit(api, namespace, nodes)
    else:
        result.over_committed = extender_over_commit(bound, stream, nodes)
    result.nodes_used = len(set(bound.values()))
    result.placed_gbps = sum(sum(stream[int(p.split("-")[1])]) for p in bound) / 1000
    for i, shape in enumerate(stream):
        if f"p-{i:05d}" not in bound:
            result.pending_by_size[max(shape)] = result.pending_by_size.get(max(shape), 0) + 1
    _clean(api, namespace)
    print(
        f"{path}{tag}: in order, {result.bound} bound, first rejection at {result.before_first_rejection}",
        flush=True,
    )

    namespace = f"dra-bench-{path}{tag}-queued"
    make_namespace(api, namespace)
    if path == "dra":
        _templates(api, namespace, stream)
    watch = DecisionWatch(api, namespace)
    create_pods(api, namespace, pod_docs(namespace, stream, path))
    if path == "dra":
        # The claim controller makes each pod's claim from its template (at kube-controller-manager's
        # own client rate, 20/s by default): not the scheduler's work, so not in its time.
        wait_for(
            f"{len(stream)} claims made",
            lambda: (
                len(api.request("GET", f"{RESOURCE}/namespaces/{namespace}/resourceclaims")["items"])
                >= len(stream)
            ),
            timeout=600,
        )
    stop = start()
    try:
        settle(watch, len(stream), stall)
    finally:
        stop()
    watch.stop()
    with watch.lock:
        times = sorted(watch.bound.values())
        queued = dict(watch.nodes)
    result.queued_bound = len(queued)
    result.queued_pending = len(stream) - len(queued)
    result.seconds = times[-1] - times[0] if len(times) > 1 else 0.0
    result.rate = (len(times) - 1) / result.seconds if result.seconds else 0.0
    if path == "dra":
        result.over_committed += dra_over_commit(api, namespace, nodes)
    else:
        result.over_committed += extender_over_commit(queued, stream, nodes)
    _clean(api, namespace)
    return result


def measure(
    cp: ControlPlane,
    nodes: int,
    pods: int,
    seed: int,
    *,
    stall: float = 20.0,
    dra_qps: tuple[float, ...] = (50.0,),
) -> list[Result]:
    """Both paths on ``nodes`` nodes and a stream of ``pods`` pods, on a control plane with conf/ applied.

    ``cp`` runs no default kube-scheduler of its own (each phase starts the one it measures).
    """
    api = Api(cp)
    node_states = states(nodes, seed)
    create_nodes(api, node_states, 4)
    stream = shapes(pods, seed)
    results = []
    for qps in dra_qps:

        def start_dra(qps: float = qps) -> Callable[[], None]:
            sched = start_default_scheduler(cp, qps)
            return sched.stop

        result = run_path(api, "dra", stream, node_states, start_dra, stall, tag=f"-qps{qps:g}")
        result.path = f"dra (qps {qps:g})"
        results.append(result)
        print(table(results[-1:]), flush=True)

    def start_extender() -> Callable[[], None]:
        pair = rdmascheduler.start_rdma_scheduler(cp, tag="dra-bench", record=False)
        return pair.stop

    results.append(run_path(api, "extender", stream, node_states, start_extender, stall))
    print(table(results[-1:]), flush=True)
    return results


def _exists(api: Api, path: str) -> bool:
    try:
        api.request("GET", path)
        return True
    except RuntimeError:
        return False


def table(results: list[Result]) -> str:
    rows = [
        "| path | nodes | pods | in order: placed before the first rejection | in order: bound / Pending | "
        "in order: Gbit/s placed | in order: Pending by largest interface (Mbit/s: pods) | "
        "queued: bound / Pending | queued: pods/s | over-committed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for r in results:
        sizes = ", ".join(f"{size}: {n}" for size, n in sorted(r.pending_by_size.items()))
        rows.append(
            f"| {r.path} | {r.nodes} | {r.pods} | {r.before_first_rejection} | {r.bound} / {r.pending} | "
            f"{r.placed_gbps:,.0f} | {sizes or '-'} | {r.queued_bound} / {r.queued_pending} | {r.rate:.1f} | "
            f"{'; '.join(r.over_committed) or 'none'} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--pods", type=int, default=600)
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument("--stall", type=float, default=20, help="end a phase after this long with no bind")
    parser.add_argument(
        "--dra-qps", default="50,5000", help="kube-scheduler's client rate in the DRA phases (shipped: 50)"
    )
    parser.add_argument("--binary", help="the built rdma-cni for the extender (else python -m rdma_cni)")
    parser.add_argument("--keep", help="run in this folder and keep it (logs)")
    args = parser.parse_args()
    if args.binary:
        os.environ["RDMA_CNI_BINARY"] = os.path.abspath(args.binary)
    directory = args.keep or tempfile.mkdtemp(prefix="dra-vs-extender-")
    os.makedirs(directory, exist_ok=True)
    cp = BenchControlPlane(directory)
    try:
        cp.start()
        api = Api(cp)
        wait_for(
            "service account default/default",
            lambda: _exists(api, "/api/v1/namespaces/default/serviceaccounts/default"),
        )
        apply_conf(cp)
        results = measure(
            cp,
            args.nodes,
            args.pods,
            args.seed,
            stall=args.stall,
            dra_qps=tuple(float(q) for q in args.dra_qps.split(",")),
        )
    finally:
        cp.stop()
    print()
    print(
        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        f"Kubernetes {cp.version}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
    )
    print(table(results))
    print(json.dumps([r.__dict__ for r in results]))


if __name__ == "__main__":
    main()
