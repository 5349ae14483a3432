"""A real reboot of a node with a pod on it: the record its ADD left is released by the first verb after.

The guest boots twice on one share. What a node keeps across a reboot (the plugin's
``stateDir``, host-local's leases) is on the share; everything else is new: the kernel
and its boot id, ``/run`` with the node lock, the VFs (created again), and no pod
namespace at all. No DEL and no GC is ever sent for the pod, as for a sandbox whose
spooled DEL the reboot lost. The first verb of the second boot (a STATUS, run as a
runtime runs the plugin) must release the record: no record, no lease, the VFs free.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from guest import BootFn, GuestRun
from test_plugin import ANNOTATION, APISERVER, BINARY, EXPECTED_VFS, SCENARIOS, Dump

pytestmark = pytest.mark.e2e

POD = {"namespace": "default", "name": "reboot", "uid": "uid-reboot"}
REQUEST = [{"max_tx_rate": 100}, {}]


def _boot(e2e_boot: BootFn, phase: int) -> GuestRun:
    if not BINARY.is_file():
        pytest.fail(f"{BINARY} is missing: run `make build` (make e2e does)", pytrace=False)
    pods = [{**POD, "annotations": {ANNOTATION: json.dumps(REQUEST)}}]
    files = {
        "rdma-cni": BINARY,
        "apiserver.py": APISERVER,
        "pods.json": json.dumps(pods).encode(),
        "scenarios": SCENARIOS,
        "phase": f"{phase}\n".encode(),
    }
    run = e2e_boot((SCENARIOS / "reboot.sh").read_text(), files=files, timeout=900.0)
    run.check()
    return run


def _text(path: Path) -> str:
    return path.read_text().strip()


def test_the_first_verb_after_a_real_reboot_releases_the_pod_it_never_saw_deleted(e2e_boot: BootFn) -> None:
    first = _boot(e2e_boot, 1)
    out1 = first.out / "reboot"
    assert _text(out1 / "add.rc") == "0", (out1 / "add.err").read_text()
    added = Dump(out1 / "dump-after-add")
    [record] = added.records
    assert record["boot_id"] == _text(out1 / "boot_id")
    assert len(record["vfs"]) == 2 and len(added.leases) == 2

    second = _boot(e2e_boot, 2)  # the share's persist/ is kept; out/ and in/ are new
    out2 = second.out / "reboot"
    assert _text(out2 / "boot_id") != record["boot_id"]  # a real reboot
    before = Dump(out2 / "dump-before-status")
    assert [r["container_id"] for r in before.records] == [record["container_id"]]
    assert len(before.leases) == 2 and "reboot" not in before.netns

    assert _text(out2 / "status.rc") == "0", (out2 / "status.json").read_text() + (
        out2 / "status.err"
    ).read_text()
    after = Dump(out2 / "dump-after-status")
    assert after.records == [] and after.leases == []
    assert sorted(after.vf_names) == EXPECTED_VFS  # every VF in the host
    assert all(rate == (0, 0) for rate in after.rates.values())
    assert _text(out2 / "boot-checked") == _text(out2 / "boot_id")
    log = (out2 / "plugin-reboot.log").read_text()
    assert "recorded in an earlier boot (exact)" in log, log
