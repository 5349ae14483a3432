"""Multus' thin plugin on the same node: what it passes rdma-cni, against the thick plugin's.

The thick DaemonSet is deleted and Multus' own thin manifest (``multus-daemonset.yml``, its
image replaced) applied: its entry point writes ``00-multus.conflist`` of type ``multus`` with a
kubeconfig of its service account's, and containerd then runs ``/opt/cni/bin/multus`` itself,
which runs each delegate (no daemon, no chroot). The same pod as the thick test goes through
ADD and DEL; what Multus passed must equal tests/unit/data/multus/v4.3.0-thin.json. The thick
plugin is put back after.
"""

from __future__ import annotations

import contextlib
import json
import os

import yaml

from tests.node.test_multus_input import record_one_pod
from tests.support.node import multus
from tests.support.node.node import MULTUS_IMAGE, REPO, Node
from tests.support.waiting import wait_for

FIXTURE = os.path.join(REPO, "tests", "unit", "data", "multus", "v4.3.0-thin.json")
# The thick daemon writes a .conf, the thin entry point a .conflist (and each leaves its own).
CONFS = ("/etc/cni/net.d/00-multus.conf", "/etc/cni/net.d/00-multus.conflist")


def multus_type() -> str:
    """The ``type`` of the node's first Multus configuration ('' while there is none)."""
    for path in CONFS:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        return str((doc.get("plugins") or [doc])[0].get("type", ""))
    return ""


def switch(node: Node, docs: list[dict[str, object]], plugin: str) -> None:
    """Replace the node's Multus DaemonSet by ``docs``' and wait for its ``plugin`` configuration."""
    node.kubectl(
        "delete", "daemonset", "kube-multus-ds", "-n", "kube-system", "--wait=true", "--timeout=120s"
    )
    for path in CONFS:  # as an operator uninstalling one Multus removes its configuration
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    node.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    wait_for(lambda: multus_type() == plugin, 180, f"Multus' configuration of type {plugin}")

    def running() -> bool:
        items = node.get("pods", "-n", "kube-system", "-l", "app=multus")["items"]
        return len(items) == 1 and items[0]["status"].get("phase") == "Running"

    wait_for(running, 180, "Multus' pod running")


def test_what_multus_thin_passes_each_attachment(node: Node, namespace: str) -> None:
    thin, replaced = multus.thin_manifest(MULTUS_IMAGE)
    assert replaced == [multus.UPSTREAM_THIN_IMAGE] * 2
    switch(node, thin, "multus")
    try:
        thin_calls = record_one_pod(node, namespace, FIXTURE, "thin")
    finally:
        switch(node, multus.thick_manifest(MULTUS_IMAGE)[0], "multus-shim")
    with open(FIXTURE.replace("thin", "thick")) as f:
        thick_calls = json.load(f)["calls"]
    # What differs between the two for rdma-cni, call by call (empty: nothing).
    diff = {
        i: {k: (thick_calls[i][k], c[k]) for k in c if c[k] != thick_calls[i][k]}
        for i, c in enumerate(thin_calls)
    }
    print("thin vs thick:", json.dumps({i: d for i, d in diff.items() if d}, indent=1))
