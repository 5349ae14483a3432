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
    """rdma-scheduler (kube-scheduler and the extender sidecar) from conf/scheduler-extender.yaml."""
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
