"""Multus' networks annotation nested deep, against the extender as a process (shared/jsondepth).

A pod may write any depth up to the API server's 256 KiB: the extender reads up to 512 levels, and
past that answers a typed refusal naming the annotation, in the filter and while it rebuilds its
reservations from the pods it lists, and goes on serving.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdma_cni.shared import nodestate
from tests.integration.test_extender_process import Extender, start
from tests.support import sched_objects as so
from tests.support.apiserver import ApiServer

NETS = "k8s.v1.cni.cncf.io/networks"


def nested(depth: int) -> str:
    """rdma-a selected with its cni-args nesting the annotation ``depth`` levels in all."""
    inner = depth - 3  # the list, the element and the cni-args object
    return '[{"name": "rdma-a", "cni-args": {"x": ' + "[" * inner + "]" * inner + "}}]"


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        yield server


@pytest.fixture
def extender(tmp_path: Path, api: ApiServer) -> Iterator[Extender]:
    api.add_node(
        "n1", annotations={nodestate.ANNOTATION: nodestate.encode(so.state([("ens1f0", 25_000, 4)]))}
    )
    # Already bound before the extender starts: it reads this pod while rebuilding its reservations.
    api.add_pod(
        "team-a", "bound-deep", {NETS: nested(100_000)}, node_name="n1", scheduler_name="rdma-scheduler"
    )
    ext = start(tmp_path, api, "--max-state-age", "600", "--networks", "rdma-a")
    try:
        ext.wait_ready(timeout=120)
        yield ext
    finally:
        if ext.proc.poll() is None:
            ext.proc.kill()
            ext.proc.wait(10)


@pytest.mark.parametrize("depth", [10, 512, 513, 1_000, 100_000])
def test_filter_reads_to_the_bound_and_refuses_past_it(
    api: ApiServer, extender: Extender, depth: int
) -> None:
    pod = api.add_pod("team-a", f"deep-{depth}", {NETS: nested(depth)}, node_name=None)
    began = time.monotonic()
    status, out = extender.call("POST", "/filter", so.args_names(pod, ["n1"]))
    elapsed = time.monotonic() - began
    assert status == 200
    if depth <= 512:
        assert out["NodeNames"] == ["n1"] and not out.get("Error"), out
    else:
        assert out["Error"].startswith(f"rdma-cni: pod team-a/deep-{depth} annotation {NETS}"), out
        assert f"is nested {depth} levels deep; the extender reads at most 512" in out["Error"]
        assert "Recursion" not in out["Error"] and len(out["Error"]) < 1024
    assert elapsed < 20  # tens of milliseconds when quiet
    assert extender.proc.poll() is None and extender.call("GET", "/readyz")[0] == 200
