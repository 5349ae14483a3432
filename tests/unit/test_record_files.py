"""Record files: atomic writes, setting corrupt records aside, orphaned temporary files."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from rdma_cni.cni.errors import IOFailure
from rdma_cni.node.record import (
    Attachment,
    ParsedRecords,
    RecordStore,
    remove_orphaned_temporaries,
    write_atomic,
)

DEAD_PID = 2**22 + 1  # above the kernel's largest pid_max


def test_write_atomic_is_0600_and_leaves_no_temporary(tmp_path: Path) -> None:
    write_atomic(str(tmp_path), "a@net1.json", "{}", "test file")
    assert os.listdir(tmp_path) == ["a@net1.json"]
    assert stat.S_IMODE(os.stat(tmp_path / "a@net1.json").st_mode) == 0o600


def test_corrupt_records_are_set_aside_only_when_asked(tmp_path: Path) -> None:
    store = RecordStore(str(tmp_path))
    store.write(Attachment(container_id="good", ifname="net1", network="n", netns="", cni_version="1.1.0"))
    Path(store.dir, "bad@net1.json").write_text("{")
    Path(store.dir, f".tmp-{DEAD_PID}-x@net1.json").write_text("{")  # never read as a record
    errors: list[str] = []
    assert [a.container_id for a in store.all(errors)] == ["good"]
    assert len(errors) == 1 and "bad@net1.json" in errors[0]
    assert store.quarantined() == []  # reading alone changes nothing (STATUS)
    assert [a.container_id for a in store.all(set_aside=True)] == ["good"]
    (kept,) = store.quarantined()
    assert kept.startswith("bad@net1.json.")
    Path(store.dir, "bad@net2.json").write_text("[]")
    assert store.get("bad", "net2", set_aside=True) is None
    assert len(store.quarantined()) == 2


def test_orphaned_temporaries(tmp_path: Path) -> None:
    live = os.getpid()
    names = {
        f".tmp-{DEAD_PID}-a@net1.json": True,  # writer gone
        f".tmp-{live}-b@net1.json": False,  # live writer, fresh
        f".tmp-{live}-c@net1.json": True,  # live pid but two minutes old
        ".tmp-notapid-d": True,
        "e@net1.json": False,  # not a temporary file
    }
    for name in names:
        (tmp_path / name).write_text("{")
    old = time.time() - 120
    os.utime(tmp_path / f".tmp-{live}-c@net1.json", (old, old))
    removed = remove_orphaned_temporaries(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == sorted(n for n, gone in names.items() if gone)
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, gone in names.items() if not gone)
    assert remove_orphaned_temporaries(str(tmp_path / "missing")) == []


def test_a_quarantine_that_cannot_be_made_is_an_io_error_naming_the_record(tmp_path: Path) -> None:
    store = RecordStore(str(tmp_path))
    store.ensure()
    Path(store.dir, "bad@net1.json").write_text("{")
    (tmp_path / "quarantine").write_text("a file where the directory should be")
    with pytest.raises(IOFailure) as info:
        store.all(set_aside=True)
    assert "bad@net1.json" in info.value.msg and "cannot set corrupt record" in info.value.msg
    assert Path(store.dir, "bad@net1.json").exists()  # kept where it was, for the next try


def test_temporaries_that_cannot_be_listed_or_removed_are_io_errors(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(IOFailure) as info:
        remove_orphaned_temporaries(str(not_a_dir))
    assert "cannot list" in info.value.msg
    # A directory named like an orphan cannot be unlinked.
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / f".tmp-{DEAD_PID}-x@net1.json").mkdir()
    with pytest.raises(IOFailure) as info:
        remove_orphaned_temporaries(str(tmp_path / "dir"))
    assert "cannot remove orphaned temporary file" in info.value.msg


def test_records_of_the_previous_version_have_no_pod_index_and_read_as_zero(tmp_path: Path) -> None:
    import json

    from rdma_cni.node.record import VfRecord, parse_attachment

    att = Attachment("c", "net1", "n", "/run/netns/p", "1.1.0", state="ready")
    att.vfs.append(VfRecord("pf0", 0, "0000:3b:02.1", "vf0", "", 1500, "net1", pod_index=41))
    doc = json.loads(att.to_json())
    assert parse_attachment(json.dumps(doc)).vfs[0].pod_index == 41
    del doc["vfs"][0]["pod_index"]  # as the version before wrote it
    assert parse_attachment(json.dumps(doc)).vfs[0].pod_index == 0


@pytest.mark.parametrize("value", ["41", -1, 1 << 31, True, 4.0, None])
def test_a_pod_index_that_is_no_ifindex_makes_the_record_corrupt(tmp_path: Path, value: object) -> None:
    import json

    from rdma_cni.node.record import VfRecord, parse_attachment

    att = Attachment("c", "net1", "n", "/run/netns/p", "1.1.0", state="ready")
    att.vfs.append(VfRecord("pf0", 0, "0000:3b:02.1", "vf0", "", 1500, "net1"))
    doc = json.loads(att.to_json())
    doc["vfs"][0]["pod_index"] = value
    with pytest.raises(TypeError, match="pod_index"):
        parse_attachment(json.dumps(doc))


def _owners(att: Attachment) -> tuple[str, str]:
    return (att.container_id, att.state)


def test_derived_parses_only_content_it_has_not_seen(tmp_path: Path) -> None:
    store = RecordStore(str(tmp_path))
    for cid in ("a", "b", "c"):
        store.write(Attachment(container_id=cid, ifname="net1", network="n", netns="", cni_version="1.1.0"))
    memo = ParsedRecords(_owners)
    assert store.derived(memo) == [("a", "adding"), ("b", "adding"), ("c", "adding")]
    assert memo.parsed == 3
    assert store.derived(memo) == [("a", "adding"), ("b", "adding"), ("c", "adding")]
    assert memo.parsed == 3  # the same bytes: nothing parsed again
    # A record changed in place (ADD marking it ready) is new content: parsed, never served stale.
    changed = Attachment(container_id="b", ifname="net1", network="n", netns="", cni_version="1.1.0")
    changed.state = "ready"
    store.write(changed, new_name=False)
    store.delete("c", "net1")
    store.write(Attachment(container_id="d", ifname="net1", network="n", netns="", cni_version="1.1.0"))
    assert store.derived(memo) == [("a", "adding"), ("b", "ready"), ("d", "adding")]
    assert memo.parsed == 5
    # Only the last read's values are kept: c's old content is parsed again if it comes back.
    store.write(Attachment(container_id="c", ifname="net1", network="n", netns="", cni_version="1.1.0"))
    assert store.derived(memo)[2] == ("c", "adding")
    assert memo.parsed == 6


def test_derived_sets_corrupt_records_aside_as_all_does(tmp_path: Path) -> None:
    store = RecordStore(str(tmp_path))
    store.write(Attachment(container_id="good", ifname="net1", network="n", netns="", cni_version="1.1.0"))
    Path(store.dir, "bad@net1.json").write_text("{")
    memo = ParsedRecords(_owners)
    with pytest.raises(IOFailure, match=r"bad@net1\.json"):
        store.derived(memo)
    assert store.quarantined() == []
    assert store.derived(memo, set_aside=True) == [("good", "adding")]
    (kept,) = store.quarantined()
    assert kept.startswith("bad@net1.json.")


def test_a_record_that_is_not_utf8_is_corrupt_and_set_aside(tmp_path: Path) -> None:
    store = RecordStore(str(tmp_path))
    Path(store.dir).mkdir(parents=True)
    Path(store.dir, "bad@net1.json").write_bytes(b'{"container_id": "\xff"}')
    with pytest.raises(IOFailure, match="is corrupt"):
        store.all()
    assert store.all(set_aside=True) == []
    assert store.derived(ParsedRecords(_owners), set_aside=True) == []
    (kept,) = store.quarantined()
    assert kept.startswith("bad@net1.json.")


def test_derived_sets_an_unreadable_record_aside_as_all_does(tmp_path: Path) -> None:
    # Reading it fails (a directory where a record should be), not parsing it: the same outcome.
    for read in ("all", "derived"):
        store = RecordStore(str(tmp_path / read))
        store.write(
            Attachment(container_id="good", ifname="net1", network="n", netns="", cni_version="1.1.0")
        )
        Path(store.dir, "odd@net1.json").mkdir()
        memo = ParsedRecords(_owners)
        with pytest.raises(IOFailure, match=r"cannot read allocation record .*odd@net1\.json"):
            store.all() if read == "all" else store.derived(memo)
        got = store.all(set_aside=True) if read == "all" else store.derived(memo, set_aside=True)
        assert len(got) == 1, read
        (kept,) = store.quarantined()
        assert kept.startswith("odd@net1.json."), read
