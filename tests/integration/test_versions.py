"""Upgrade and rollback on the simulated node: a record the next version wrote is released by this one."""

from __future__ import annotations

import json
import os

from rdma_cni.node import record
from tests.integration.conftest import Cluster, assert_node_pristine


def test_rollback_releases_what_the_next_version_allocated(cluster: Cluster) -> None:
    conf = cluster.conf()
    pod = cluster.pod([{"min_tx_rate": 1000}])
    assert cluster.run("ADD", pod, conf).ok
    [name] = cluster.records
    path = os.path.join(cluster.state_dir, "attachments", name)
    with open(path) as f:
        doc = json.load(f)
    # The record as the next version would have written it: its schema, keys this version lacks.
    doc["schema"] = record.NEXT_SCHEMA
    doc["added_by_next"] = {"x": 1}
    for vf in doc["vfs"]:
        vf["restore_queues"] = 8
    with open(path, "w") as f:
        json.dump(doc, f)
    assert cluster.run("CHECK", pod, cluster.check_conf(conf, doc["result"])).ok
    outcome = cluster.run("DEL", pod, conf)
    assert outcome.ok, outcome.stderr
    assert_node_pristine(cluster)
