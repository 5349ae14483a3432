"""The two paths side by side, small: the extender benchmark's pods through DRA and through the extender.

benchmarks/dra_vs_extender.py at a size the tier affords (8 nodes, 48 pods), on
a control plane of its own with no default scheduler (each path starts the
one it measures): the real kube-scheduler v1.37.2's DRA allocator on the
nodes' ResourceSlices, and rdma-scheduler from conf/ on their node states, the
same free room both ways. What must hold whatever the machine's load: both
place pods, in order and queued, and neither promises a node more than it has.
The figures (docs/scheduling.md) come from the benchmark at 100 nodes; this
prints its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from benchmarks.dra_vs_extender import measure, table
from tests.cluster.conftest import wait_for_service_account
from tests.support.kube.applyconf import apply_conf
from tests.support.kube.controlplane import ControlPlane


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane(str(tmp_path_factory.mktemp("dra-measure")), default_scheduler=False)
    try:
        cp.start()
        wait_for_service_account(cp, "default", "default")
        apply_conf(cp)
        yield cp
    finally:
        cp.stop()


def test_both_paths_place_the_stream_without_over_commit(
    bare: ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    results = measure(bare, nodes=8, pods=48, seed=40, stall=10.0, dra_qps=(50.0,))
    with capsys.disabled():
        print(f"\n{table(results)}\n(load {os.getloadavg()[0]:.1f})")
    dra, extender = results
    for r in (dra, extender):
        assert r.over_committed == [], r
        assert r.bound > 0 and r.queued_bound > 0 and r.rate > 0, r
        assert r.bound + r.pending == r.pods
        assert 0 < r.before_first_rejection <= r.bound
