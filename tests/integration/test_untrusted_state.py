"""State the plugin does not own (issue 21, findings 6 and 7): code 5 naming path and owner, no change."""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Cluster, assert_node_pristine, expected_vf_names, host_names

NOBODY = 65534


def tree(root: str) -> dict[str, tuple[int, int, bytes | None]]:
    out: dict[str, tuple[int, int, bytes | None]] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            out[path] = (st.st_uid, st.st_mode, Path(path).read_bytes() if stat.S_ISREG(st.st_mode) else None)
    return out


@contextmanager
def nobody_state(cluster: Cluster) -> Iterator[tuple[dict[str, Any], str, str]]:
    # What the review did: nobody pre-creates stateDir and plants a record in it.
    state = Path(cluster.state_dir)
    (state / "attachments").mkdir(parents=True)
    (state / "attachments" / "planted@net1.json").write_text("{}")
    for p in (state, state / "attachments", state / "attachments" / "planted@net1.json"):
        os.chown(p, NOBODY, NOBODY)
    yield cluster.conf(), str(state), f"uid {NOBODY}"


@contextmanager
def world_writable_state(cluster: Cluster) -> Iterator[tuple[dict[str, Any], str, str]]:
    os.makedirs(cluster.state_dir)
    os.chmod(cluster.state_dir, 0o777)
    yield cluster.conf(), cluster.state_dir, "writable"


@contextmanager
def symlinked_state(cluster: Cluster) -> Iterator[tuple[dict[str, Any], str, str]]:
    real = os.path.join(cluster.tmp, "real-state")
    os.makedirs(real, mode=0o700)
    os.symlink(real, cluster.state_dir)
    yield cluster.conf(), cluster.state_dir, "symbolic link"


@contextmanager
def nobody_lock(cluster: Cluster) -> Iterator[tuple[dict[str, Any], str, str]]:
    # Owned and held by nobody: every verb used to wait out the lock timeout and fail with 11.
    conf = cluster.conf(lockTimeoutSeconds=30)
    Path(conf["lockFile"]).write_text("")
    os.chown(conf["lockFile"], NOBODY, NOBODY)
    with open(conf["lockFile"]) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield conf, conf["lockFile"], f"uid {NOBODY}"


@contextmanager
def proc_lock(cluster: Cluster) -> Iterator[tuple[dict[str, Any], str, str]]:
    yield cluster.conf(lockFile="/proc/self/status"), "/proc/self/status", "on procfs"


CASES: dict[str, Callable[[Cluster], Any]] = {
    "stateDir owned by nobody": nobody_state,
    "world-writable stateDir": world_writable_state,
    "symlinked stateDir": symlinked_state,
    "lockFile owned and flocked by nobody": nobody_lock,
    "lockFile under /proc": proc_lock,
}


@pytest.mark.parametrize("verb", ["ADD", "DEL", "GC"])
@pytest.mark.parametrize("case", list(CASES))
def test_untrusted_state_is_code_5_and_changes_nothing(cluster: Cluster, case: str, verb: str) -> None:
    pod = cluster.pod([{"max_tx_rate": 1000}]) if verb != "GC" else {}
    vf_table = cluster.node.vf_state()
    with CASES[case](cluster) as (conf, path, named):
        if verb == "GC":
            conf = {**conf, "cni.dev/valid-attachments": []}
        before = tree(cluster.tmp)
        out = cluster.run(verb, pod, conf, timeout=20)
        assert out.doc is not None and out.doc["code"] == 5, (out.doc, out.stderr)
        assert path in out.doc["msg"] and named in out.doc["msg"], out.doc
        assert tree(cluster.tmp) == before
    assert host_names(cluster) == expected_vf_names(cluster)  # every VF home, under its name
    assert cluster.node.vf_state() == vf_table
    if case != "stateDir owned by nobody":
        assert_node_pristine(cluster)
