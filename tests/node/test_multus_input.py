"""What Multus v4.3.0 (thick) really passes to rdma-cni, recorded and held to the fixture.

A pod selects the capture network twice (tests/support/node/capture.py): ``net1`` asks through
the pod-wide annotation, ``rail2`` through its selection's ``cni-args``. Every call Multus makes
for it is recorded (env and stdin), normalized, and must equal
tests/unit/data/multus/v4.3.0-thick.json, which the unit tier feeds to the plugin's own parsing
(tests/unit/test_multus_wire.py). A Multus that passes anything else fails here first:
``RDMA_CNI_NODE_RECORD=1`` rewrites the fixture from the run, to be read and committed.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from tests.node.conftest import wait_at_rest
from tests.support.node import capture, pods
from tests.support.node.node import CAPTURE_NETWORK, REPO, Node

FIXTURE = os.path.join(REPO, "tests", "unit", "data", "multus", "v4.3.0-thick.json")
SELECTIONS = [
    {"name": CAPTURE_NETWORK, "namespace": "default"},
    {
        "name": CAPTURE_NETWORK,
        "namespace": "default",
        "interface": "rail2",
        "cni-args": {pods.REQUEST: [{"min_tx_rate": 1000}]},
    },
]


def record_one_pod(node: Node, namespace: str, fixture: str, mode: str) -> list[dict[str, Any]]:
    """Run the wire pod through ADD and DEL and return what Multus passed, held to ``fixture``
    (rewritten from the run under ``RDMA_CNI_NODE_RECORD``)."""
    shutil.rmtree(capture.DIR, ignore_errors=True)
    pods.create(node, pods.pod_manifest(namespace, "wire", SELECTIONS, [{}, {}]))
    pod = pods.wait_running(node, namespace, ["wire"])["wire"]
    sandbox = node.sandbox(namespace, "wire")["status"]["id"]
    pods.delete(node, namespace, "wire")
    pods.wait_gone(node, namespace, ["wire"])
    wait_at_rest(node)

    got = [capture.normalized(c, sandbox, pod["metadata"]["uid"], namespace) for c in capture.calls()]
    if os.environ.get("RDMA_CNI_NODE_RECORD"):
        with open(fixture, "w") as f:
            json.dump({"multus": "v4.3.0", "mode": mode, "pod": SELECTIONS, "calls": got}, f, indent=1)
            f.write("\n")
    with open(fixture) as f:
        recorded = json.load(f)
    assert recorded["pod"] == SELECTIONS and recorded["mode"] == mode
    # In the annotation's order on ADD, the reverse on DEL; each with its own interface name.
    assert [(c["env"]["CNI_COMMAND"], c["env"]["CNI_IFNAME"]) for c in got] == [
        ("ADD", "net1"),
        ("ADD", "rail2"),
        ("DEL", "rail2"),
        ("DEL", "net1"),
    ]
    assert got == recorded["calls"]
    return got


def test_what_multus_passes_each_attachment_on_add_and_del(node: Node, namespace: str) -> None:
    record_one_pod(node, namespace, FIXTURE, "thick")
