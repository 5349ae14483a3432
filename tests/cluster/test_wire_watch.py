"""The extender's node watch against the real kube-apiserver: its bookmarks, and its compaction of etcd.

Two control planes of their own, each on the flags its property needs:

- **Bookmarks** come only from kube-apiserver's watch cache (v1.37's etcd3
  watcher gives external clients none: ``isInitialEventsEndBookmarkRequired``
  in k8s.io/apiserver/pkg/storage/etcd3/watcher.go), so that plane keeps the
  cache on, the default. A cached watch gets one 2 s before its
  ``timeoutSeconds`` and about once a minute (``nextBookmarkTime`` in
  .../storage/cacher/cache_watcher.go), carrying the cache's resourceVersion,
  which follows etcd's revision through etcd's progress notifications (etcd
  ``--watch-progress-notify-interval``: kubeadm sets 5 s; 1 s here) even when
  no Node changes. kube-apiserver compacts etcd every 15 s
  (``--etcd-compaction-interval``; 5 min by default).
- **A 410 from compaction** needs watches served by etcd: with the watch cache
  on, a watch is served from the cache's own window of Node events, which
  etcd's compaction never shortens (only a restart of kube-apiserver does: the
  tier's test_scheduling shows that one). So that plane runs
  ``--watch-cache=false`` and compacts every 3 s; the extender reaches it
  through a relay the test cuts (a network partition), so its watch resumes
  from a version compacted meanwhile.

The node agents watch nothing (they GET their Node and PATCH its annotation):
they have no resourceVersion to lose.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rdma_cni.extender.cache import NodeCache
from rdma_cni.extender.decide import Decider
from rdma_cni.kube import client as kubeapi
from rdma_cni.shared import nodestate
from tests.cluster.conftest import unique
from tests.support import sched_objects as so
from tests.support.kube.controlplane import ControlPlane, write_kubeconfig
from tests.support.kube.objects import create_node
from tests.support.kube.process import Component, free_port, start_component
from tests.support.kube.rdmascheduler import _probe_ready, plugin_command
from tests.support.kube.relay import Relay
from tests.support.waiting import wait_for

NODES = "/api/v1/nodes"


def _plane(directory: Path, etcd_args: list[str], apiserver_args: list[str]) -> Iterator[ControlPlane]:
    cp = ControlPlane(
        str(directory), etcd_args=etcd_args, apiserver_args=apiserver_args, default_scheduler=False
    )
    try:
        cp.start()
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """Watch cache on (the default); etcd reports progress every second; compaction every 15 s."""
    yield from _plane(
        tmp_path_factory.mktemp("bookmarks"),
        ["--watch-progress-notify-interval=1s"],
        ["--etcd-compaction-interval=15s"],
    )


@pytest.fixture(scope="module")
def uncached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """Watches served by etcd; kube-apiserver compacts it every 3 s."""
    yield from _plane(
        tmp_path_factory.mktemp("compaction"), [], ["--watch-cache=false", "--etcd-compaction-interval=3s"]
    )


def admin_client(cp: ControlPlane, server: str | None = None, tag: str = "wire") -> kubeapi.ApiClient:
    """The project's client as the admin (through ``server`` when given, e.g. a relay)."""
    assert cp.pki is not None
    path = write_kubeconfig(cp.path(f"{tag}.kubeconfig"), server or cp.server, cp.pki.ca, client=cp.pki.admin)
    return kubeapi.ApiClient.from_kubeconfig(path)


def held(client: kubeapi.ApiClient, rv: str) -> bool:
    """False once the server answers 410 for a list at exactly ``rv``: etcd compacted it."""
    try:
        client.list(NODES, {"resourceVersion": rv, "resourceVersionMatch": "Exact", "limit": "1"})
    except kubeapi.Gone:
        return False
    return True


def churn(cp: ControlPlane, namespace: str, n: int) -> None:
    """Writes to objects the node watch never sees: etcd's revision moves on."""
    cp.kubectl("create", "configmap", f"churn-{n}", "-n", namespace, f"--from-literal=n={n}")


@dataclass
class Spy:
    """Between the node cache and the client: what every watch started from, every event it gave."""

    client: kubeapi.ApiClient
    starts: list[tuple[str, bool]] = field(default_factory=list)  # (resourceVersion, held then)
    events: list[tuple[str, str]] = field(default_factory=list)  # (type, resourceVersion)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def list(self, *args: Any, **kw: Any) -> dict[str, Any]:
        return self.client.list(*args, **kw)

    def watch(self, path: str, params: dict[str, Any], **kw: Any) -> Iterator[dict[str, Any]]:
        assert params.get("allowWatchBookmarks") == "true"
        rv = str(params.get("resourceVersion") or "")
        with self.lock:
            self.starts.append((rv, held(self.client, rv)))
        for event in self.client.watch(path, params, **kw):
            with self.lock:
                self.events.append((event["type"], str(event["object"]["metadata"].get("resourceVersion"))))
            yield event


def test_a_bookmark_advances_the_node_watch_past_a_version_compaction_then_removes(
    cached: ControlPlane,
) -> None:
    cp = cached
    namespace = unique("bookmarks")
    cp.kubectl("create", "namespace", namespace)
    spy = Spy(admin_client(cp))
    # A short watch (the extender's is 300 s): its bookmark comes 2 s before the end.
    cache = NodeCache(spy, Decider(), watch_timeout=10).start()
    try:
        assert cache.synced.wait(60)
        node = unique("bm-node")
        r1 = create_node(
            cp, node, {nodestate.ANNOTATION: nodestate.encode(so.state([("ens1f0", 25_000, 2)]))}
        )["metadata"]["resourceVersion"]
        wait_for(lambda: cache.resource_version == r1, 30, "the node cache at the node's last write")
        seen = len(spy.events)

        # Only other objects change; the bookmark carries the server's newer version all the same.
        writes = itertools.count()

        def bookmarked() -> str | None:
            churn(cp, namespace, next(writes))
            marks = [rv for kind, rv in spy.events[seen:] if kind == "BOOKMARK" and int(rv) > int(r1)]
            return marks[-1] if marks else None

        mark = wait_for(bookmarked, 60, "a BOOKMARK past the node's version", interval=0.5)
        assert {kind for kind, _ in spy.events[seen:]} == {"BOOKMARK"}, spy.events[seen:]
        assert int(cache.resource_version) >= int(mark) > int(r1)

        # kube-apiserver compacts etcd past r1: resuming there would be 410.
        def compacted() -> bool:
            churn(cp, namespace, next(writes))
            return not held(spy.client, r1)

        wait_for(compacted, 90, f"{r1} compacted", interval=1)
        # The watch cache still serves a watch from r1 (its window of Node events is not
        # etcd's history): why a 410 from compaction needs the cache off (the test below).
        assert all(
            e["type"] == "BOOKMARK"
            for e in spy.client.watch(NODES, {"resourceVersion": r1}, timeout_seconds=3)
        )
        compacted_at = len(spy.starts)
        # The watch ends (timeoutSeconds) and resumes from the bookmarked version, still held.
        wait_for(lambda: len(spy.starts) > compacted_at, 30, "the node watch to resume")
        rv, was_held = spy.starts[compacted_at]
        assert int(rv) > int(r1) and was_held, spy.starts
        # It follows Nodes from there: a change is seen, and nothing was listed again.
        bigger = nodestate.encode(so.state([("ens1f0", 100_000, 8)]))
        cp.kubectl("annotate", "node", node, "--overwrite", f"{nodestate.ANNOTATION}={bigger}")
        wait_for(lambda: cache.views[node].capacity_vfs == 8, 30, "the node's change in the cache")
        assert (cache.relists, cache.reconnects) == (1, 0)
    finally:
        cache.stop()
        cp.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@dataclass
class Extender:
    """``rdma-cni scheduler-extender`` on loopback, reaching kube-apiserver through a relay."""

    process: Component
    port: int
    metrics_port: int

    def fits(self, probe: dict[str, Any], nodes: list[str]) -> list[str]:
        """The nodes /filter keeps for ``probe``."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("POST", "/filter", body=json.dumps(so.args_names(probe, nodes)))
            return list(json.loads(conn.getresponse().read()).get("NodeNames") or [])
        finally:
            conn.close()

    def counters(self) -> dict[str, float]:
        """The node watch's counters on /metrics."""
        conn = http.client.HTTPConnection("127.0.0.1", self.metrics_port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            page = conn.getresponse().read().decode()
        finally:
            conn.close()
        wanted = ("rdma_cni_extender_watch_restarts_total", "rdma_cni_extender_relists_total")
        return {
            s.name: s.value
            for family in text_string_to_metric_families(page)
            for s in family.samples
            if s.name in wanted
        }


def start_extender(cp: ControlPlane, relay: Relay) -> Extender:
    """The extender as the admin, its API server the relay."""
    assert cp.pki is not None
    kubeconfig = write_kubeconfig(
        cp.path("relayed.kubeconfig"), f"https://127.0.0.1:{relay.port}", cp.pki.ca, client=cp.pki.admin
    )
    port, probe, metrics = free_port(), free_port(), free_port()
    argv = [
        *plugin_command(),
        "scheduler-extender",
        f"--listen=127.0.0.1:{port}",
        f"--probe-listen=127.0.0.1:{probe}",
        f"--metrics-listen=127.0.0.1:{metrics}",
        f"--kubeconfig={kubeconfig}",
        "--no-events",
    ]
    process = start_component("relayed-extender", argv, cp.path("logs"), lambda: _probe_ready(probe))
    return Extender(process, port, metrics)


def test_the_extenders_watch_relists_after_kube_apiserver_compacted_its_version(
    uncached: ControlPlane,
) -> None:
    cp = uncached
    namespace = unique("compaction")
    cp.kubectl("create", "namespace", namespace)
    direct = admin_client(cp)
    relay = Relay(("127.0.0.1", cp.api_port))
    ext = start_extender(cp, relay)
    try:
        probe = so.rdma_pod(unique("probe"), [(20_000, 0)])
        roomy, other = unique("cmp-roomy"), unique("cmp-other")
        create_node(cp, roomy, {nodestate.ANNOTATION: nodestate.encode(so.state([("ens1f0", 25_000, 2)]))})
        wait_for(lambda: ext.fits(probe, [roomy]) == [roomy], 60, f"the extender to judge {roomy}")
        before = ext.counters()

        # A partition: the extender's watch breaks and it cannot reconnect.
        relay.cut()
        # Meanwhile roomy fills up and another node comes.
        full = nodestate.encode(so.state([("ens1f0", 10_000, 2)]))
        cp.kubectl("annotate", "node", roomy, "--overwrite", f"{nodestate.ANNOTATION}={full}")
        create_node(cp, other, {nodestate.ANNOTATION: nodestate.encode(so.state([("ens2f0", 25_000, 2)]))})
        # Every version the extender could hold is older than this one; kube-apiserver compacts past it.
        now = str(direct.list(NODES, {"limit": "1"})["metadata"]["resourceVersion"])
        writes = itertools.count()

        def compacted() -> bool:
            churn(cp, namespace, next(writes))
            return not held(direct, now)

        wait_for(compacted, 90, f"kube-apiserver to compact etcd past {now}", interval=1)
        wait_for(lambda: relay.turned_away > 0, 30, "the extender's reconnect during the partition")

        relay.resume()
        log = Path(ext.process.log)
        wait_for(lambda: "is too old, relisting" in log.read_text(), 60, "the extender's 410 and relist")
        # etcd's ErrCompacted in kube-apiserver's words (k8s.io/apiserver/pkg/storage/etcd3/errors.go).
        assert "HTTP 410 Expired: The resourceVersion for the provided watch is too old." in log.read_text()
        wait_for(
            lambda: ext.fits(probe, [roomy, other]) == [other], 60, "the node cache to hold the gap's changes"
        )
        after = ext.counters()
        assert after["rdma_cni_extender_relists_total"] == before["rdma_cni_extender_relists_total"] + 1
        assert (
            after["rdma_cni_extender_watch_restarts_total"] > before["rdma_cni_extender_watch_restarts_total"]
        )
        assert ext.process.alive()
    finally:
        ext.process.stop()
        relay.close()
        cp.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
