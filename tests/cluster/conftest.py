"""Fixtures of the cluster tier: the real control plane, conf/ applied to it, rdma-scheduler from conf/.

One control plane per test session (starting kube-apiserver costs tens of
seconds on the shared 2-core machine); each test works in objects of its own
(namespaces and Nodes named after it), so tests do not depend on each other's
order.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator

import pytest

from tests.support.kube.applyconf import apply_conf
from tests.support.kube.controlplane import ControlPlane
from tests.support.kube.rdmascheduler import RdmaScheduler, start_rdma_scheduler
from tests.support.waiting import wait_for

_names = itertools.count()


def unique(prefix: str) -> str:
    """A name no other test of this session (or a parallel session) uses."""
    return f"{prefix}-{os.getpid()}-{next(_names)}"


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver, kube-controller-manager and the default kube-scheduler, on 127.0.0.1."""
    cp = ControlPlane(str(tmp_path_factory.mktemp("cluster")))
    try:
        cp.start()
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def applied(control_plane: ControlPlane) -> ControlPlane:
    """The control plane with every conf/ manifest applied (server-side), as an operator would."""
    wait_for_service_account(control_plane, "default", "default")
    apply_conf(control_plane)
    return control_plane


@pytest.fixture(scope="session")
def rdma_scheduler(applied: ControlPlane) -> Iterator[RdmaScheduler]:
    """rdma-scheduler (kube-scheduler and the extender sidecar) from conf/base/extender/'s manifest."""
    pair = start_rdma_scheduler(applied)
    try:
        yield pair
    finally:
        pair.stop()


def wait_for_service_account(cp: ControlPlane, namespace: str, name: str, timeout: float = 60) -> None:
    """Wait until kube-controller-manager created a namespace's service account (pods need it)."""
    deadline = time.monotonic() + timeout
    while cp.kubectl("get", "serviceaccount", name, "-n", namespace, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"service account {namespace}/{name} never appeared")
        time.sleep(0.5)


def strays_deleted(cp: ControlPlane) -> None:
    """Delete the rdma-scheduler pods left Pending by earlier modules, before this module's nodes exist.

    conf/pod.yaml's sample pod (applied with conf/, and again by
    test_conf_applies) asks for 3 VFs and 20000 Mbit/s and may still be
    Pending when this module starts: kube-scheduler then binds it to the
    first node here with room, taking what a test counted on (the fill
    test's big node, or the preemption test's fresh node, whose first low
    pod then never fits), and each of its attempts moves where
    kube-scheduler starts its next search of the nodes (test_sampling counts
    on that). Bound pods stay: they hold nothing on this module's nodes.
    """
    stray = pending_rdma_pods(cp)
    for namespace, name in stray:
        cp.kubectl("delete", "pod", name, "-n", namespace, "--grace-period=0", "--force", check=False)
    wait_for(lambda: not stray & pending_rdma_pods(cp), 60, f"{sorted(stray)} deleted")


def pending_rdma_pods(cp: ControlPlane) -> set[tuple[str, str]]:
    """(namespace, name) of every unbound rdma-scheduler pod, in any namespace."""
    return {
        (p["metadata"]["namespace"], p["metadata"]["name"])
        for p in cp.get("pods", "--all-namespaces")["items"]
        if p["spec"].get("schedulerName") == "rdma-scheduler" and not p["spec"].get("nodeName")
    }


def failed_scheduling(cp: ControlPlane, namespace: str, pod: str) -> list[str]:
    """The messages of a pod's FailedScheduling events (kube-scheduler writes events.k8s.io notes)."""
    events = cp.get(
        "events", "-n", namespace, "--field-selector", f"involvedObject.name={pod},reason=FailedScheduling"
    )
    return [e.get("message") or e.get("note") or "" for e in events["items"]]
