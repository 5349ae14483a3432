"""Scheduling throughput on the real control plane: the default kube-scheduler against rdma-scheduler.

Issue 31 section 4. The control plane is the cluster tier's (etcd, kube-apiserver,
kube-controller-manager from tests/support/kube/controlplane.py, on 127.0.0.1
only); conf/ is applied as an operator applies it and rdma-scheduler (its
kube-scheduler and the extender sidecar) is started from conf/ exactly as the
tier starts it (tests/support/kube/rdmascheduler.py), with one change: the
tier's recorder, a Python proxy between kube-scheduler and the extender that
would add its own cost to every call, is left out, and kube-scheduler calls the
extender directly as it does in the Deployment.

Nodes are created directly (Ready, allocatable set, no kubelet), each with a
published ``rdma-cni.io/node-state`` mixing idle, partly used and full PFs (the
states of benchmarks/extender_bench.py). Then, phase after phase, the same pods
(same RDMA requests, 10m CPU each) are created in a namespace of the phase:

- ``default``: kube-scheduler without any configuration but its client's rate
  (``clientConnection.qps``, ``--default-qps``; 50 is what kube-scheduler ships
  with, and every Binding counts against it), no extender;
- ``rdma``: rdma-scheduler from conf/, its pods naming ``schedulerName:
  rdma-scheduler``.

Only the phase's scheduler runs during a phase, so an idle scheduler's watch
traffic is not counted. Per phase it reports pods/s from the first create to
the last bind (the bind seen on a watch of the API server), scheduling latency
p50/p99 from kube-scheduler's own histograms, CPU seconds per pod of each
process (utime + stime from /proc/<pid>/stat, threads and children included;
over the phase, and again from the first bind to the last, without start-up),
binds refused by the extender (each requeues its pod) and FailedScheduling
events. Pods of a phase are deleted before the next.

Run by hand (not in ``make bench``: it needs ``make components``)::

    .venv/bin/python benchmarks/cluster_throughput.py --nodes 1000 --pods 2000
"""

from __future__ import annotations

import argparse
import bisect
import http.client
import json
import os
import random
import re
import resource
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import yaml  # noqa: E402

import tests.support.kube.rdmascheduler as rdmascheduler  # noqa: E402
from benchmarks.extender_bench import ANNOTATION, SHAPES, node_state, request_value  # noqa: E402
from rdma_cni.shared import nodestate  # noqa: E402
from tests.support.kube.applyconf import apply_conf  # noqa: E402
from tests.support.kube.controlplane import (  # noqa: E402
    ControlPlane,
    https_ok,
    insecure_context,
    write_kubeconfig,
)
from tests.support.kube.objects import node_doc, pod_doc  # noqa: E402
from tests.support.kube.process import Component, free_port, start_component  # noqa: E402

NAMESPACE_PREFIX = "tput"
SECURE_PORT = re.compile(r"^--secure-port=(\d+)$")
ATTEMPT = "scheduler_scheduling_attempt_duration_seconds"
SLI = "scheduler_pod_scheduling_sli_duration_seconds"


# -- the API, as the admin, over kept-alive connections (one per thread)


class Api:
    """A minimal HTTPS client of kube-apiserver as the admin; one connection per thread."""

    def __init__(self, cp: ControlPlane) -> None:
        assert cp.pki is not None
        self.port = cp.api_port
        self.context = ssl.create_default_context(cafile=cp.pki.ca)
        self.context.load_cert_chain(cp.pki.admin.cert, cp.pki.admin.key)
        self.local = threading.local()

    def connection(self, timeout: float = 60) -> http.client.HTTPSConnection:
        """A new connection to the API server."""
        return http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context, timeout=timeout)

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        """One request; returns the decoded answer, raises on a status >= 300."""
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = self.connection()
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type} if data is not None else {}
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException):
            # A dropped kept-alive connection: once more on a new one.
            conn.close()
            conn = self.local.conn = self.connection()
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        if resp.status >= 300:
            raise RuntimeError(f"{method} {path}: {resp.status} {raw[:500]!r}")
        return json.loads(raw) if raw else None


# -- processes: CPU time and metrics


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the extender may run helpers of its own)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its descendants, all threads, in seconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                # The command name (field 2) may hold spaces: split after its ')'.
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / ticks


def pid_of(component: Component) -> int:
    """The process id of a running component."""
    assert component.proc is not None
    return component.proc.pid


def secure_port(component: Component) -> int:
    """The serving port a kube-scheduler was started with."""
    for arg in component.argv:
        m = SECURE_PORT.match(arg)
        if m:
            return int(m.group(1))
    raise AssertionError(f"{component.name} has no --secure-port")


# How long a refused scrape is retried: in some runs a kube-scheduler just started answered 403,
# the admin's certificate seen as anonymous, while its delegated authentication was not ready yet.
SCRAPE_PATIENCE = 120.0


def scrape(cp: ControlPlane, port: int) -> str:
    """kube-scheduler's /metrics, read with the admin's certificate (delegated authorization)."""
    assert cp.pki is not None
    ctx = insecure_context()  # its serving certificate is self-signed at start
    ctx.load_cert_chain(cp.pki.admin.cert, cp.pki.admin.key)
    give_up = time.monotonic() + SCRAPE_PATIENCE
    while True:
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
        try:
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            body = resp.read().decode()
        finally:
            conn.close()
        if resp.status == 200:
            return body
        if resp.status not in (401, 403) or time.monotonic() > give_up:
            raise RuntimeError(f"kube-scheduler /metrics: {resp.status} {body[:300]}")
        time.sleep(2)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str, **match: str) -> list[tuple[dict[str, str], float]]:
    """The samples of metric ``name`` (exact) whose labels include ``match``."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        if all(labels.get(k) == v for k, v in match.items()):
            out.append((labels, float(m.group(3))))
    return out


def counter(text: str, name: str, **match: str) -> float:
    """The sum of a counter's samples whose labels include ``match``."""
    return sum(v for _, v in samples(text, name, **match))


def buckets(text: str, name: str, **match: str) -> dict[float, float]:
    """A histogram's cumulative buckets, summed over the other labels: upper bound -> count."""
    out: dict[float, float] = {}
    for labels, value in samples(text, f"{name}_bucket", **match):
        le = float(labels["le"])
        out[le] = out.get(le, 0.0) + value
    return out


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of what a histogram gained between two scrapes (linear within a bucket)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    i = bisect.bisect_left(counts, rank)
    if bounds[i] == float("inf"):
        return bounds[i - 1] if i else None  # beyond the last finite bound: say the bound
    lower = bounds[i - 1] if i else 0.0
    below = counts[i - 1] if i else 0.0
    inside = counts[i] - below
    return lower + (bounds[i] - lower) * ((rank - below) / inside if inside else 1.0)


# -- the control plane, without its default scheduler (each phase starts its own)


class BenchControlPlane(ControlPlane):
    """The tier's control plane, without the kube-scheduler it starts: a phase starts the one it measures."""

    def _start_scheduler(self) -> None:
        pass


def start_default_scheduler(cp: ControlPlane, qps: float) -> Component:
    """kube-scheduler with the default profile; only its client's rate is set (``qps``, burst twice that)."""
    assert cp.pki is not None
    kubeconfig = write_kubeconfig(
        cp.path("bench-scheduler.kubeconfig"), cp.server, cp.pki.ca, client=cp.pki.scheduler
    )
    config = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": kubeconfig, "qps": qps, "burst": int(qps * 2)},
        "leaderElection": {"leaderElect": False},
    }
    path = cp.path(f"bench-scheduler-{qps:g}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    port = free_port()
    argv = [
        cp.bins["kube-scheduler"].path,
        f"--config={path}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        "--v=1",
    ]
    return start_component(
        f"bench-kube-scheduler-{qps:g}",
        argv,
        cp.path("logs"),
        lambda: https_ok(f"https://127.0.0.1:{port}/healthz", insecure_context()),
    )


# -- inputs


def create_nodes(api: Api, count: int, seed: int, workers: int) -> None:
    """Ready Nodes with node states, the not-ready taint lifted (no node lifecycle controller runs)."""
    rng = random.Random(seed)
    names = [f"bn-{i:05d}" for i in range(count)]
    states = [nodestate.encode(node_state(rng, name)) for name in names]

    def one(i: int) -> None:
        doc = node_doc(names[i], {nodestate.ANNOTATION: states[i]})
        api.request("POST", "/api/v1/nodes", doc)
        # TaintNodesByCondition put node.kubernetes.io/not-ready on it at create.
        api.request(
            "PATCH",
            f"/api/v1/nodes/{names[i]}",
            {"spec": {"taints": None}},
            "application/merge-patch+json",
        )

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(count)))
    sample = api.request("GET", f"/api/v1/nodes/{names[0]}")
    assert sample["status"]["allocatable"]["pods"] == "110", sample["status"]
    assert not sample["spec"].get("taints"), sample["spec"]


def pod_docs(namespace: str, count: int, seed: int, scheduler: str | None) -> list[dict[str, Any]]:
    """The phase's pods: the same RDMA requests in every phase (same seed), 10m CPU each."""
    rng = random.Random(seed)
    return [
        pod_doc(
            namespace,
            f"p-{i:05d}",
            annotations={ANNOTATION: request_value(rng.choice(SHAPES))},
            scheduler=scheduler,
        )
        for i in range(count)
    ]


def wait_for(what: str, check: Callable[[], bool], timeout: float = 120) -> None:
    """Poll ``check`` until it holds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def make_namespace(api: Api, name: str) -> None:
    """A namespace, once its default service account exists (pods are refused before)."""
    api.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )

    def has_account() -> bool:
        try:
            api.request("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")
            return True
        except RuntimeError:
            return False

    wait_for(f"service account {name}/default", has_account)


# -- watching binds


class BindWatch:
    """Watches a namespace's pods and remembers when each was first seen bound (``spec.nodeName``)."""

    def __init__(self, api: Api, namespace: str) -> None:
        self.api, self.namespace = api, namespace
        self.bound: dict[str, float] = {}
        self.nodes: dict[str, str] = {}
        self.lock = threading.Lock()
        listing = api.request("GET", f"/api/v1/namespaces/{namespace}/pods")
        self.rv = listing["metadata"]["resourceVersion"]
        self.stopped = False
        self.rewatches = 0  # watches the API server ended early (each one resumed)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # kube-apiserver closes a watch whose reader falls behind ("Forcing
        # watcher close due to unresponsiveness", seen at 5,000 nodes on the
        # loaded machine): watch again from the last resourceVersion, and
        # re-list when that is too old (410), so no bind goes uncounted.
        while not self.stopped:
            conn = self.api.connection(timeout=3600)
            try:
                path = (
                    f"/api/v1/namespaces/{self.namespace}/pods?watch=1&allowWatchBookmarks=true"
                    f"&resourceVersion={self.rv}&timeoutSeconds=1800"
                )
                conn.request("GET", path)
                resp = conn.getresponse()
                while not self.stopped:
                    line = resp.readline()
                    if not line:
                        break
                    event = json.loads(line)
                    obj = event.get("object", {})
                    if event.get("type") == "ERROR":
                        if obj.get("code") == 410:
                            self._relist()
                        break
                    self.rv = obj.get("metadata", {}).get("resourceVersion", self.rv)
                    self._seen(obj, time.monotonic())
            except (OSError, ValueError, http.client.HTTPException):
                pass  # watch again
            finally:
                conn.close()
            if not self.stopped:
                self.rewatches += 1

    def _relist(self) -> None:
        listing = self.api.request("GET", f"/api/v1/namespaces/{self.namespace}/pods")
        now = time.monotonic()
        for obj in listing["items"]:
            self._seen(obj, now)
        self.rv = listing["metadata"]["resourceVersion"]

    def _seen(self, obj: dict[str, Any], now: float) -> None:
        name = obj.get("metadata", {}).get("name")
        node = obj.get("spec", {}).get("nodeName")
        if name and node:
            with self.lock:
                if name not in self.bound:
                    self.bound[name] = now
                    self.nodes[name] = node

    def count(self) -> int:
        """Pods seen bound so far."""
        with self.lock:
            return len(self.bound)

    def stop(self) -> None:
        """Stop counting; the watch ends at its next event, when the API server closes it, or at exit.

        Closing the connection here, while the watch thread blocks reading it,
        hung the closing thread on the TLS socket.
        """
        self.stopped = True


# -- one phase


@dataclass
class Phase:
    """What one scheduler did with the pods."""

    name: str
    nodes: int
    pods: int
    bound: int = 0
    seconds: float = 0.0
    create_seconds: float = 0.0
    attempt_p50: float | None = None
    attempt_p99: float | None = None
    sli_p50: float | None = None
    sli_p99: float | None = None
    cpu: dict[str, float] = field(default_factory=dict)  # component -> CPU seconds per pod bound
    # The same from the first bind seen to the last, per pod bound in between: without what the
    # scheduler's processes spent starting (the extender's decode of every node's state).
    cpu_binding: dict[str, float] = field(default_factory=dict)
    attempts: dict[str, float] = field(default_factory=dict)  # kube-scheduler's attempts by result
    refused_binds: float = 0.0
    refusals: dict[str, float] = field(default_factory=dict)
    verb_ms: dict[str, float] = field(default_factory=dict)  # the extender's mean answer time by verb
    failed_events: int = 0
    failed_pods: int = 0
    nodes_used: int = 0
    rewatches: int = 0
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # --queued: the pods were created before the scheduler started; seconds are first to last bind.
    queued: bool = False

    @property
    def rate(self) -> float:
        """Pods bound per second: first create to last bind, or (queued) first bind to last bind."""
        if not self.seconds:
            return 0.0
        return (self.bound - 1) / self.seconds if self.queued else self.bound / self.seconds


@dataclass
class Queued:
    """A phase's pods created before its scheduler started (``--queued``)."""

    created: float  # seconds the creates took
    watch: BindWatch  # started before the scheduler, so no bind goes unseen
    cpu_before: dict[str, float]  # the running components' CPU seconds before the scheduler started


def queue_pods(
    api: Api, name: str, scheduler_name: str | None, args: argparse.Namespace, running: dict[str, int]
) -> Queued:
    """Create a phase's pods while no scheduler of theirs runs, and start watching for binds."""
    cpu_before = {comp: cpu_seconds(pid) for comp, pid in running.items()}
    created = create_pods(api, name, scheduler_name, args)
    watch = BindWatch(api, f"{NAMESPACE_PREFIX}-{name}")
    print(f"{name}: {args.pods} pods created in {created:.1f} s before the scheduler", flush=True)
    return Queued(created, watch, cpu_before)


def create_pods(
    api: Api, name: str, scheduler_name: str | None, args: argparse.Namespace, namespace_made: bool = False
) -> float:
    """The phase's pods (and namespace, unless made); the seconds the creates took."""
    namespace = f"{NAMESPACE_PREFIX}-{name}"
    if not namespace_made:
        make_namespace(api, namespace)
    docs = pod_docs(namespace, args.pods, args.seed, scheduler_name)
    start = time.monotonic()
    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(lambda d: api.request("POST", f"/api/v1/namespaces/{namespace}/pods", d), docs))
    return time.monotonic() - start


def run_phase(
    cp: ControlPlane,
    api: Api,
    name: str,
    scheduler_name: str | None,
    processes: dict[str, int],
    metrics_port: int,
    extender_metrics: Callable[[], str] | None,
    args: argparse.Namespace,
    queued: Queued | None = None,
) -> Phase:
    """Create the pods (unless ``queued``: created before the scheduler started), wait until they
    are bound (or stop progressing), and measure."""
    namespace = f"{NAMESPACE_PREFIX}-{name}"
    result = Phase(name, args.nodes, args.pods, queued=queued is not None)
    if queued is None:
        make_namespace(api, namespace)
        watch = BindWatch(api, namespace)
        cpu_before = {comp: cpu_seconds(pid) for comp, pid in processes.items()}
    else:
        watch = queued.watch
        # The scheduler's processes started with the phase: all their CPU is the phase's.
        cpu_before = {comp: queued.cpu_before.get(comp, 0.0) for comp in processes}
    sched_before = scrape(cp, metrics_port)
    ext_before = extender_metrics() if extender_metrics else ""
    self_before = resource.getrusage(resource.RUSAGE_SELF)

    start = time.monotonic()
    if queued is None:
        result.create_seconds = create_pods(api, name, scheduler_name, args, namespace_made=True)
    else:
        result.create_seconds = queued.created
    print(
        f"{name}: {args.pods} pods created in {result.create_seconds:.1f} s, {watch.count()} bound",
        flush=True,
    )

    # Until every pod is bound, or none was bound for --stall seconds (pods that fit nowhere).
    last_count, last_change = -1, time.monotonic()
    first: tuple[int, dict[str, float]] | None = None  # pods bound and CPU when the first bind was seen
    while True:
        n = watch.count()
        if n and first is None:
            first = (n, {comp: cpu_seconds(pid) for comp, pid in processes.items()})
        if n >= args.pods:
            break
        if n != last_count:
            last_count, last_change = n, time.monotonic()
        elif time.monotonic() - last_change > args.stall:
            break
        time.sleep(0.2)

    cpu_after = {comp: cpu_seconds(pid) for comp, pid in processes.items()}
    self_after = resource.getrusage(resource.RUSAGE_SELF)
    sched_after = scrape(cp, metrics_port)
    ext_after = extender_metrics() if extender_metrics else ""
    result.load = os.getloadavg()
    watch.stop()

    with watch.lock:
        times = sorted(watch.bound.values())
        nodes = list(watch.nodes.values())
    result.bound = len(times)
    if result.queued:
        result.seconds = (times[-1] - times[0]) if len(times) > 1 else 0.0
    else:
        result.seconds = (times[-1] - start) if times else 0.0
    per = max(result.bound, 1)
    result.cpu = {comp: (cpu_after[comp] - cpu_before[comp]) / per for comp in processes}
    if first is not None and result.bound > first[0]:
        result.cpu_binding = {
            comp: (cpu_after[comp] - first[1][comp]) / (result.bound - first[0]) for comp in processes
        }
    result.cpu["this script"] = (
        self_after.ru_utime + self_after.ru_stime - self_before.ru_utime - self_before.ru_stime
    ) / per
    result.nodes_used = len(set(nodes))
    result.rewatches = watch.rewatches

    for metric, lo, hi in ((ATTEMPT, "attempt_p50", "attempt_p99"), (SLI, "sli_p50", "sli_p99")):
        match = {"result": "scheduled"} if metric == ATTEMPT else {}
        before, after = buckets(sched_before, metric, **match), buckets(sched_after, metric, **match)
        setattr(result, lo, quantile(before, after, 0.5))
        setattr(result, hi, quantile(before, after, 0.99))
    for res in ("scheduled", "unschedulable", "error"):
        gained = counter(sched_after, "scheduler_schedule_attempts_total", result=res) - counter(
            sched_before, "scheduler_schedule_attempts_total", result=res
        )
        result.attempts[res] = gained
    if extender_metrics:
        refused = "rdma_cni_extender_decisions_total"
        result.refused_binds = counter(ext_after, refused, verb="bind", outcome="refused") - counter(
            ext_before, refused, verb="bind", outcome="refused"
        )
        for verb in ("filter", "prioritize", "bind"):
            total = "rdma_cni_extender_request_seconds"
            n = counter(ext_after, f"{total}_count", verb=verb) - counter(
                ext_before, f"{total}_count", verb=verb
            )
            t = counter(ext_after, f"{total}_sum", verb=verb) - counter(ext_before, f"{total}_sum", verb=verb)
            if n:
                result.verb_ms[verb] = t / n * 1000
        for labels, value in samples(ext_after, "rdma_cni_extender_bind_refusals_total"):
            gained = value - counter(
                ext_before, "rdma_cni_extender_bind_refusals_total", reason=labels["reason"]
            )
            if gained:
                result.refusals[labels["reason"]] = gained

    events = api.request(
        "GET", f"/api/v1/namespaces/{namespace}/events?fieldSelector=reason%3DFailedScheduling"
    )["items"]
    result.failed_events = sum(int(e.get("count") or 1) for e in events)
    result.failed_pods = len({e["involvedObject"]["name"] for e in events})

    # Gone before the next phase, so its scheduler's cache does not hold them.
    api.request("DELETE", f"/api/v1/namespaces/{namespace}/pods?gracePeriodSeconds=0")
    wait_for(
        f"pods of {namespace} deleted",
        lambda: not api.request("GET", f"/api/v1/namespaces/{namespace}/pods?limit=1")["items"],
    )
    return result


# -- report


def fmt_s(value: float | None) -> str:
    """Seconds as milliseconds."""
    return "-" if value is None else f"{value * 1000:.0f}"


def report(results: Iterable[Phase]) -> str:
    """A Markdown table of the phases."""
    rows = [
        "| scheduler | nodes | pods bound / created | create s | pods/s | attempt p50 / p99 ms | "
        "SLI p50 / p99 ms | CPU ms per pod: scheduler / extender / apiserver / etcd / script | "
        "CPU ms per pod while binding: scheduler / extender / apiserver / etcd | "
        "attempts scheduled / unschedulable / error | binds refused | FailedScheduling events (pods) | "
        "nodes used | bind watch resumed | load 1 / 5 min |",
        "| --- |" + " ---: |" * 14,
    ]
    for r in results:
        cpu = " / ".join(
            "-" if k not in r.cpu else f"{r.cpu[k] * 1000:.1f}"
            for k in ("kube-scheduler", "extender", "kube-apiserver", "etcd", "this script")
        )
        binding = " / ".join(
            "-" if k not in r.cpu_binding else f"{r.cpu_binding[k] * 1000:.1f}"
            for k in ("kube-scheduler", "extender", "kube-apiserver", "etcd")
        )
        refusals = f"{r.refused_binds:.0f}" + (f" {r.refusals}" if r.refusals else "")
        att = " / ".join(f"{r.attempts.get(k, 0):.0f}" for k in ("scheduled", "unschedulable", "error"))
        rows.append(
            f"| {r.name} | {r.nodes:,} | {r.bound:,} / {r.pods:,} | {r.create_seconds:.1f} | {r.rate:.0f} | "
            f"{fmt_s(r.attempt_p50)} / {fmt_s(r.attempt_p99)} | {fmt_s(r.sli_p50)} / {fmt_s(r.sli_p99)} | "
            f"{cpu} | {binding} | {att} | {refusals} | {r.failed_events} ({r.failed_pods}) | "
            f"{r.nodes_used:,} | {r.rewatches} | {r.load[0]:.1f} / {r.load[1]:.1f} |"
        )
    return "\n".join(rows)


def main() -> None:
    """Parse the knobs, start the control plane, run the phases, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--workers", type=int, default=4, help="concurrent creates (nodes and pods)")
    parser.add_argument("--stall", type=float, default=30, help="end a phase after this long with no bind")
    parser.add_argument(
        "--default-qps",
        default="50",
        help="clientConnection.qps of each default-scheduler phase, comma-separated (shipped: 50)",
    )
    parser.add_argument("--skip-rdma", action="store_true")
    parser.add_argument(
        "--queued",
        action="store_true",
        help="create each phase's pods before its scheduler starts; pods/s from first to last bind "
        "(the creates no longer bound the figure)",
    )
    parser.add_argument("--binary", help="the built rdma-cni for the extender (else python -m rdma_cni)")
    parser.add_argument("--keep", help="run in this folder and keep it (logs)")
    args = parser.parse_args()
    if args.binary:
        os.environ["RDMA_CNI_BINARY"] = os.path.abspath(args.binary)

    directory = args.keep or tempfile.mkdtemp(prefix="cluster-throughput-")
    os.makedirs(directory, exist_ok=True)
    cp = BenchControlPlane(directory)
    results: list[Phase] = []
    try:
        t0 = time.monotonic()
        cp.start()
        api = Api(cp)
        wait_for(
            "service account default/default",
            lambda: bool(_exists(api, "/api/v1/namespaces/default/serviceaccounts/default")),
        )
        apply_conf(cp)
        print(f"control plane and conf/ up in {time.monotonic() - t0:.0f} s", flush=True)
        t0 = time.monotonic()
        create_nodes(api, args.nodes, args.seed, args.workers)
        print(f"{args.nodes} nodes created in {time.monotonic() - t0:.0f} s", flush=True)
        base = {
            "kube-apiserver": pid_of(cp.components["kube-apiserver"]),
            "etcd": pid_of(cp.components["etcd"]),
        }
        for qps in (float(q) for q in args.default_qps.split(",") if q):
            name = f"default-qps{qps:g}"
            queued = queue_pods(api, name, None, args, base) if args.queued else None
            sched = start_default_scheduler(cp, qps)
            try:
                procs = {**base, "kube-scheduler": pid_of(sched)}
                results.append(run_phase(cp, api, name, None, procs, secure_port(sched), None, args, queued))
                print(report(results[-1:]), flush=True)
            finally:
                sched.stop()
        if not args.skip_rdma:
            # kube-scheduler calls the extender itself, as in the Deployment (no recorder in between).
            queued = queue_pods(api, "rdma-scheduler", "rdma-scheduler", args, base) if args.queued else None
            pair = rdmascheduler.start_rdma_scheduler(cp, tag="bench", record=False)
            try:
                procs = {**base, "kube-scheduler": pid_of(pair.scheduler), "extender": pid_of(pair.extender)}
                results.append(
                    run_phase(
                        cp,
                        api,
                        "rdma-scheduler",
                        "rdma-scheduler",
                        procs,
                        secure_port(pair.scheduler),
                        pair.metrics,
                        args,
                        queued,
                    )
                )
            finally:
                pair.stop()
    finally:
        cp.stop()
    print()
    print(
        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        f"Kubernetes {cp.version}, {os.cpu_count()} CPUs",
    )
    print(report(results))
    for r in results:
        if r.verb_ms:
            means = ", ".join(f"{verb} {ms:.1f}" for verb, ms in r.verb_ms.items())
            print(f"{r.name}: the extender's mean answer ms: {means}")


def _exists(api: Api, path: str) -> bool:
    try:
        api.request("GET", path)
        return True
    except RuntimeError:
        return False


if __name__ == "__main__":
    main()
