"""Record writes: which ones fsync the directory (a new name) and which need not (a replaced one)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from rdma_cni.cni.errors import IOFailure
from rdma_cni.node import record
from rdma_cni.node.record import Attachment, RecordStore


def test_only_a_new_record_name_fsyncs_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = RecordStore(str(tmp_path))
    synced: list[str] = []
    monkeypatch.setattr(record, "_sync_dir", synced.append)
    att = Attachment(container_id="c1", ifname="net1", network="n", netns="/run/netns/x", cni_version="1.0.0")
    store.write(att)
    assert synced == [store.dir]
    att.state = "ready"
    store.write(att, new_name=False)
    assert synced == [store.dir]  # replacing an existing record: either version is safe after a crash
    path = Path(store.path("c1", "net1"))
    assert json.loads(path.read_text())["state"] == "ready"
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(os.listdir(store.dir)) == ["c1@net1.json"]  # no temporary left behind


def test_a_new_name_can_leave_its_directory_fsync_to_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RecordStore(str(tmp_path))
    synced: list[str] = []
    monkeypatch.setattr(record, "_sync_dir", synced.append)
    att = Attachment(container_id="c1", ifname="net1", network="n", netns="/run/netns/x", cni_version="1.0.0")
    store.write(att, sync_dir=False)  # ADD's intent record, under the node lock
    assert synced == []
    assert Path(store.path("c1", "net1")).exists()
    store.sync_dir()  # once the lock is released
    assert synced == [store.dir]


def test_a_failed_directory_fsync_is_code_5_naming_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RecordStore(str(tmp_path))
    store.ensure()

    def broken(directory: str) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(record, "_sync_dir", broken)
    with pytest.raises(IOFailure) as got:
        store.sync_dir()
    assert got.value.code == 5 and store.dir in got.value.msg and "Input/output error" in got.value.msg


def test_a_record_written_unflushed_is_flushed_file_first_by_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RecordStore(str(tmp_path))
    store.ensure()  # the directory exists already (making it fsyncs its parent)
    events: list[str] = []
    monkeypatch.setattr(record, "_sync_dir", lambda d: events.append(f"dir {d}"))
    monkeypatch.setattr(record, "_fsync_file", lambda p: events.append(f"file {p}"))
    fsyncs: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd)))
    att = Attachment(container_id="c1", ifname="net1", network="n", netns="/run/netns/x", cni_version="1.0.0")
    store.write(att, flush=False)  # ADD's intent record, under the node lock
    assert events == [] and fsyncs == []  # no fsync at all while the lock is held
    assert json.loads(Path(store.path("c1", "net1")).read_text())["container_id"] == "c1"  # readable at once
    store.flush("c1", "net1")  # once the lock is released, before anything acts on it
    assert events == [f"file {store.path('c1', 'net1')}", f"dir {store.dir}"]


def test_a_record_that_cannot_be_flushed_is_code_5_naming_it(tmp_path: Path) -> None:
    store = RecordStore(str(tmp_path))
    store.ensure()
    with pytest.raises(IOFailure) as got:
        store.flush("gone", "net1")
    assert got.value.code == 5 and store.path("gone", "net1") in got.value.msg
