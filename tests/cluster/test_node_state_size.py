"""A node state near the real annotation limit: the agent publishes it, the extender reads it.

kube-apiserver allows 256 KiB of annotations per object; the agent's budget
for its state is 192 KiB (rdma_cni/agent/publish.py), leaving the rest to
others. A state just under the budget goes through the agent's own publisher,
with a token bound to a pod on the node (so through the admission policy),
and the extender judges the node on it; past 256 KiB the API server refuses.
"""

from __future__ import annotations

import http.client
import json
import time
import uuid
from pathlib import Path

from rdma_cni.agent import publish
from rdma_cni.shared import nodestate
from tests.cluster.conftest import unique
from tests.support import sched_objects as so
from tests.support.kube.controlplane import ControlPlane
from tests.support.kube.objects import client_for_token, create, create_node, pod_doc
from tests.support.kube.rdmascheduler import RdmaScheduler

PFS = 16


def _large_state(pods: int) -> nodestate.NodeState:
    pfs = [(f"ens{i}f0", 100_000, 128) for i in range(PFS)]
    uses = [(str(uuid.uuid4()), [(f"ens{i % PFS}f0", 10, 0)]) for i in range(pods)]
    return so.state(pfs, uses)


def _filter(rs: RdmaScheduler, node: str, rate: int) -> dict[str, object]:
    pod = so.rdma_pod(unique("probe"), [(rate, 0)])
    conn = http.client.HTTPConnection("127.0.0.1", rs.extender_port, timeout=30)
    conn.request("POST", "/filter", body=json.dumps(so.args_names(pod, [node])))
    answer = json.loads(conn.getresponse().read())
    conn.close()
    return dict(answer)


def test_a_state_near_the_budget_is_published_and_read(
    applied: ControlPlane, rdma_scheduler: RdmaScheduler
) -> None:
    node = unique("large")
    create_node(applied, node)
    pod = unique("rdma-cni-large")
    create(applied, pod_doc("kube-system", pod, node=node, account="rdma-cni"))
    token = applied.token("kube-system", "rdma-cni", "--bound-object-kind=Pod", f"--bound-object-name={pod}")
    state = _large_state(1290)
    size = len(nodestate.encode(state))
    assert publish.MAX_STATE_BYTES - 4096 < size < publish.MAX_STATE_BYTES, size
    try:
        with client_for_token(applied, token, "large-agent") as client:
            publisher = publish.Publisher(client, node)
            publisher.offer(state)
            assert publisher.step(), publisher.last_error
        stored = applied.get("node", node)["metadata"]["annotations"][nodestate.ANNOTATION]
        assert len(stored) > size - 100 and nodestate.same_content(nodestate.decode(stored), state)
        assert len(nodestate.decode(stored).allocations) == 1290  # not trimmed
        # The extender judges the node on it: the most any PF has free fits, one more does not.
        free = max(p.capacity_tx_rate - p.used_tx_rate for p in state.pfs if p.capacity_tx_rate)
        deadline = time.monotonic() + 30
        while _filter(rdma_scheduler, node, free).get("NodeNames") != [node]:
            assert time.monotonic() < deadline, "the extender never read the large state"
            time.sleep(0.5)
        refused = _filter(rdma_scheduler, node, free + 1)
        assert refused["NodeNames"] == [] and "needs" in str(refused["FailedNodes"])
    finally:
        applied.kubectl("delete", "node", node, "--wait=false", check=False)


def test_annotations_past_256_kib_are_refused_by_the_api_server(
    applied: ControlPlane, tmp_path: Path
) -> None:
    node = unique("toolarge")
    create_node(applied, node)
    try:
        patch = tmp_path / "patch.json"
        patch.write_text(
            json.dumps({"metadata": {"annotations": {"example.com/filler": "x" * (256 * 1024)}}})
        )
        proc = applied.kubectl("patch", "node", node, "--type=merge", f"--patch-file={patch}", check=False)
        assert proc.returncode != 0 and "may not be more than 262144 bytes" in proc.stderr, proc.stderr
    finally:
        applied.kubectl("delete", "node", node, "--wait=false", check=False)
