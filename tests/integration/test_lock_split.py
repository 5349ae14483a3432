"""What the node lock covers, and what each attachment's lock covers (docs/protocol.md, "the node lock").

An ADD holds the node lock only while it chooses VFs and writes its intent
record, a DEL only while it reads the record (and looks for VFs no record
lists) and while it removes it: the namespace moves and IPAM, which are most
of a verb, run under the attachment's own lock. So one pod's slow IPAM no
longer keeps other pods waiting, while everything that touches the same
attachment (its DEL, GC, the IPAM guard of a killed ADD) still waits for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from typing import Any

from tests.integration.conftest import (
    Cluster,
    assert_node_pristine,
    plugin_command,
    start_add_until_ipam_runs,
    use_ipam,
)
from tests.support.fake_ipam import HOST_LOCAL


def records(cluster: Cluster) -> list[dict[str, Any]]:
    out = []
    for name in cluster.records:
        with open(os.path.join(cluster.state_dir, "attachments", name)) as f:
            out.append(json.load(f))
    return out


def finish(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    """Wait for a verb started by ``start_add_until_ipam_runs``: its exit status and output."""
    proc.wait(60)
    assert proc.stdout is not None and proc.stderr is not None
    return proc.returncode, proc.stdout.read().decode() + proc.stderr.read().decode()


def slow_for(cluster: Cluster, container_id: str, seconds: float) -> tuple[dict[str, Any], str]:
    """An IPAM that is slow (and marks its start) for one container only; host-local for the rest."""
    marker = os.path.join(cluster.tmp, f"ipam-started-{container_id}")
    slow = f'if [ "$CNI_CONTAINERID" = {container_id} ]; then touch {marker}; sleep {seconds}; fi; '
    slow += f"exec {HOST_LOCAL}"
    return use_ipam(cluster, "slow-for-one", {"ADD": slow, "DEL": slow}), marker


def test_a_slow_ipam_does_not_hold_other_pods_up(cluster: Cluster) -> None:
    slow_pod, fast_pod = cluster.pod([{}]), cluster.pod([{}])
    conf, marker = slow_for(cluster, slow_pod["CNI_CONTAINERID"], 4)
    slow = start_add_until_ipam_runs(cluster, slow_pod, conf, marker)
    try:
        started = time.monotonic()
        fast = cluster.run("ADD", fast_pod, conf)
        took = time.monotonic() - started
        assert fast.ok, fast.doc
        # It took the node lock while the slow ADD was in its IPAM call: it did not wait for it.
        assert took < 2.5, took
        assert slow.poll() is None, "the slow ADD should still be in its IPAM call"
    finally:
        code, said = finish(slow)
    assert code == 0, said
    assert cluster.records == sorted(f"{p['CNI_CONTAINERID']}@net1.json" for p in (slow_pod, fast_pod))
    for pod in (slow_pod, fast_pod):
        assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def test_a_del_waits_for_the_add_of_its_own_attachment(cluster: Cluster) -> None:
    pod = cluster.pod([{}])
    conf, marker = slow_for(cluster, pod["CNI_CONTAINERID"], 2)
    adding = start_add_until_ipam_runs(cluster, pod, conf, marker)
    try:
        # The runtime's DEL of the same attachment (as after a timed-out ADD) while the ADD runs:
        # it waits for the attachment's lock, then undoes everything the ADD did.
        deleted = cluster.run("DEL", pod, conf)
        assert deleted.ok, deleted.doc
    finally:
        code, said = finish(adding)
    assert code == 0, said
    assert_node_pristine(cluster)


def test_gc_leaves_an_attachment_whose_add_is_under_way(cluster: Cluster) -> None:
    pod = cluster.pod([{}])
    conf, marker = slow_for(cluster, pod["CNI_CONTAINERID"], 3)
    adding = start_add_until_ipam_runs(cluster, pod, conf, marker)
    gc_conf = {**cluster.conf(), "cniVersion": "1.1.0", "cni.dev/valid-attachments": []}
    gc_conf["ipam"] = conf["ipam"]
    try:
        # The runtime listed its attachments before this ADD began: GC must not release it now.
        collected = cluster.run("GC", {}, gc_conf)
        assert collected.ok, collected.doc
    finally:
        code, said = finish(adding)
    assert code == 0, said
    assert cluster.records == [f"{pod['CNI_CONTAINERID']}@net1.json"]
    # Once it is done, a GC that does not list it releases it.
    assert cluster.run("GC", {}, gc_conf).ok
    assert_node_pristine(cluster)


def test_a_burst_of_adds_and_dels_gives_every_pod_its_own_vf(cluster: Cluster) -> None:
    # Eight verbs at once on eight VFs: the moves of some run while others choose their VFs.
    conf = cluster.conf()
    pods = [cluster.pod([{}]) for _ in range(8)]
    outcomes: dict[str, Any] = {}

    def run(verb: str, pod: dict[str, str]) -> None:
        proc = subprocess.run(
            plugin_command(),
            input=json.dumps(conf).encode(),
            env=cluster.env(verb, pod),
            capture_output=True,
            timeout=120,
            check=False,
        )
        outcomes[pod["CNI_CONTAINERID"]] = (proc.returncode, proc.stdout.decode(), proc.stderr.decode())

    for verb in ("ADD", "DEL"):
        outcomes.clear()
        threads = [threading.Thread(target=run, args=(verb, pod)) for pod in pods]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(code == 0 for code, _, _ in outcomes.values()), outcomes
        if verb == "ADD":
            held = [vf["pci"] for r in records(cluster) for vf in r["vfs"]]
            assert len(held) == len(set(held)) == len(pods)
    assert_node_pristine(cluster)
