"""The same-boot release of attachments whose pod namespace is gone: every refusal of the decision.

:func:`rdma_cni.node.orphans.judge` releases only when the record is this boot's and no verb of it
is under way, its namespace is gone by kernel identity, and every VF (and a moved RDMA device) is
back in the host; the pass never judges a record it cannot read; the agent's screen runs the pass
only when some record's namespace left its path.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.agent import metrics, orphanpass
from rdma_cni.node import boot, orphans
from rdma_cni.node.record import Attachment, RecordStore, VfRecord
from rdma_cni.verbs import gc

BOOT_ID = "0f5c8a2e-4b1d-4c3e-9a7f-1e2d3c4b5a69"
OTHER_BOOT = "1e2d3c4b-5a69-4c3e-9a7f-0f5c8a2e4b1d"
NOW = boot.Boot(BOOT_ID, 1_000_000.0, 2_000_000.0)
NSFS_DEV = os.stat("/proc/self/ns/net").st_dev
GONE_INO = 4026539999


def record(tmp_path: Path, **change: Any) -> Attachment:
    vfs = [
        VfRecord("ens1f0", 3, "0000:5e:00.3", "ens1f0v3", "02:00:00:00:00:03", 1500, "net1"),
        VfRecord("ens1f0", 4, "0000:5e:00.4", "ens1f0v4", "02:00:00:00:00:04", 1500, "net2"),
    ]
    att = Attachment(
        "c" * 64,
        "net1",
        "rdma-net",
        str(tmp_path / "netns-gone"),
        "1.1.0",
        state="ready",
        created_at=NOW.now - 60,
        vfs=vfs,
        boot_id=BOOT_ID,
        netns_id=[NSFS_DEV, GONE_INO],
    )
    for key, value in change.items():
        setattr(att, key, value)
    return att


def judge(
    att: Attachment,
    *,
    home: set[str] | None = None,
    rdma: frozenset[str] = frozenset(),
    live: frozenset[int] = frozenset(),
) -> str | None:
    asked: list[str] = []
    everything = {vf.pci for vf in att.vfs}

    def vf_home(pci: str, name: str) -> bool:
        asked.append(pci)
        return pci in (everything if home is None else home)

    return orphans.judge(
        att,
        vf_home=vf_home,
        rdma_home=lambda d: d in rdma,
        live=lambda: set(live),
        now=NOW,
        nsfs_dev=NSFS_DEV,
    )


def test_released_when_the_namespace_is_gone_and_every_vf_home(tmp_path: Path) -> None:
    assert judge(record(tmp_path)) is None


def test_an_intent_record_of_a_dead_add_is_released_once_its_runtime_had_time(tmp_path: Path) -> None:
    att = record(tmp_path, state="adding", created_at=NOW.now - orphans.ADDING_SECONDS - 1)
    assert judge(att) is None


def test_a_leftover_file_at_the_path_is_no_namespace(tmp_path: Path) -> None:
    """What an unmounted namespace file leaves: an empty regular file on another file system."""
    att = record(tmp_path)
    Path(att.netns).write_text("")
    assert judge(att) is None


def test_refused_while_a_vf_is_not_back_in_the_host(tmp_path: Path) -> None:
    att = record(tmp_path)
    why = judge(att, home={"0000:5e:00.3"})
    assert why is not None and "VF 0000:5e:00.4 is not back in the host" in why


def test_refused_while_a_moved_rdma_device_is_not_back(tmp_path: Path) -> None:
    att = record(tmp_path)
    att.vfs[1].rdma_device, att.vfs[1].rdma_action = "mlx5_4", "moved"
    why = judge(att)
    assert why is not None and "RDMA device mlx5_4" in why
    assert judge(att, rdma=frozenset({"mlx5_4"})) is None


def test_refused_while_the_namespace_is_still_at_its_path(tmp_path: Path) -> None:
    att = record(tmp_path)
    Path(att.netns).write_text("")
    st = os.stat(att.netns)
    att.netns_id = [st.st_dev, st.st_ino]  # the path still opens the recorded namespace
    why = judge(att)
    assert why is not None and "still its network namespace" in why


def test_refused_while_a_namespace_with_its_inode_is_alive_elsewhere(tmp_path: Path) -> None:
    """Mounted at another path, or entered by a process: alive (an inode reused says "maybe")."""
    why = judge(record(tmp_path), live=frozenset({GONE_INO}))
    assert why is not None and "is alive" in why


def test_refused_for_a_record_without_identity_whose_path_is_a_namespace(tmp_path: Path) -> None:
    att = record(tmp_path, netns="/proc/self/ns/net", netns_id=[], schema=2)
    why = judge(att)
    assert why is not None and "keeps no identity" in why


def test_a_record_without_identity_whose_path_is_gone_is_released(tmp_path: Path) -> None:
    assert judge(record(tmp_path, netns_id=[], schema=2)) is None


def test_refused_while_its_add_may_be_under_way(tmp_path: Path) -> None:
    why = judge(record(tmp_path, state="adding", created_at=NOW.now - 5))
    assert why is not None and "under way" in why


@pytest.mark.parametrize(
    "change",
    [
        {"boot_id": OTHER_BOOT},
        {"boot_id": "", "created_at": NOW.time - 1},  # no boot id, a second before the boot: in doubt
        {"boot_id": "", "created_at": 10.0},  # no boot id, before this boot: the boot release's
    ],
)
def test_refused_when_not_surely_of_this_boot(tmp_path: Path, change: dict[str, Any]) -> None:
    why = judge(record(tmp_path, **change))
    assert why is not None and "boot" in why


def test_refused_without_a_vf(tmp_path: Path) -> None:
    assert judge(record(tmp_path, vfs=[])) == "the record lists no VF"


def test_refused_when_ipam_cannot_be_released_without_its_network(tmp_path: Path) -> None:
    att = record(tmp_path)
    att.vfs[0].ipam = {"ips": [{"address": "10.0.0.2/24"}]}
    why = judge(att)
    assert why is not None and "IPAM configuration" in why
    att.ipam_conf = {"cniVersion": "1.1.0", "name": "rdma-net", "ipam": {"type": "host-local"}}
    assert judge(att) is None


def test_the_namespace_check_comes_before_the_kernel_is_asked(tmp_path: Path) -> None:
    """A live pod's record costs a stat: its VFs are not looked up, no process is scanned."""
    att = record(tmp_path)
    Path(att.netns).write_text("")
    st = os.stat(att.netns)
    att.netns_id = [st.st_dev, st.st_ino]

    def fail(*_args: Any) -> Any:
        raise AssertionError("asked the kernel for a live pod")

    assert orphans.judge(att, vf_home=fail, rdma_home=fail, live=fail, now=NOW) is not None


def test_live_namespaces_sees_this_process_and_nsfs_mounts(tmp_path: Path) -> None:
    own = os.stat("/proc/self/ns/net").st_ino
    assert own in orphans.live_namespaces()
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(
        "100 29 0:4 net:[4026532777] /run/netns/cni-1 rw shared:5 - nsfs nsfs rw\n"
        "101 29 0:4 mnt:[4026532778] /run/x rw - nsfs nsfs rw\n"
        "102 29 8:1 / / rw - ext4 /dev/sda1 rw\n"
    )
    (proc / "42" / "ns").mkdir(parents=True)
    (proc / "42" / "ns" / "net").symlink_to("net:[4026532779]")
    assert orphans.live_namespaces(str(proc)) == {4026532777, 4026532779}


def write(store: RecordStore, att: Attachment) -> None:
    store.write(att)


def test_the_pass_never_judges_an_unreadable_record(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = RecordStore(str(state))
    store.ensure()
    Path(store.path("d" * 64, "net1")).write_text("{not json")
    sweep = gc.release_orphans(str(state), str(tmp_path / "lock"))
    assert sweep.unreadable == 1 and not sweep.released and not sweep.kept
    assert os.path.exists(store.path("d" * 64, "net1"))  # not set aside either: left as found


def test_the_pass_keeps_a_record_whose_vfs_are_not_home(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = RecordStore(str(state))
    att = record(tmp_path, boot_id=boot.boot_id(), created_at=time.time() - 60)
    write(store, att)
    sweep = gc.release_orphans(str(state), str(tmp_path / "lock"))
    assert not sweep.released and "not back in the host" in sweep.kept[f"{att.container_id}/{att.ifname}"]
    assert os.path.exists(store.path(att.container_id, att.ifname))


def test_the_pass_gives_way_to_a_verb_holding_the_node_lock(tmp_path: Path) -> None:
    from rdma_cni.node.record import node_lock

    state = tmp_path / "state"
    store = RecordStore(str(state))
    write(store, record(tmp_path, boot_id=boot.boot_id(), created_at=time.time() - 60))
    lock = str(tmp_path / "lock")
    with node_lock(lock, 1):
        pid = os.fork()
        if pid == 0:  # another process: flock excludes open file descriptions, not processes
            sweep = gc.release_orphans(str(state), lock, lock_timeout=0.2)
            os._exit(0 if sweep.busy and not sweep.kept and not sweep.released else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# -- the agent's side: the screen, the pass through the plugin, the counter ----------------


def test_the_screen_lets_live_pods_be(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = RecordStore(str(state))
    alive = tmp_path / "alive"
    alive.write_text("")
    st = os.stat(alive)
    write(
        store,
        record(
            tmp_path,
            boot_id=boot.boot_id(),
            container_id="a" * 64,
            netns=str(alive),
            netns_id=[st.st_dev, st.st_ino],
        ),
    )
    assert orphanpass.suspects(str(state)) == []
    write(store, record(tmp_path, boot_id=boot.boot_id(), container_id="b" * 64))  # its path is gone
    write(
        store,
        record(
            tmp_path, boot_id=boot.boot_id(), container_id="e" * 64, netns="/proc/self/ns/net", netns_id=[]
        ),
    )  # old, alive
    write(
        store, record(tmp_path, boot_id=boot.boot_id(), container_id="f" * 64, netns=str(alive), netns_id=[])
    )  # old, a plain file
    Path(store.path("9" * 64, "net1")).write_text("{not json")
    write(store, record(tmp_path, boot_id=boot.boot_id(), container_id="7" * 64))  # this boot's, path gone
    write(store, record(tmp_path, container_id="8" * 64, boot_id=OTHER_BOOT))  # the boot release's
    assert orphanpass.suspects(str(state)) == [f"{'7' * 64}@net1", f"{'b' * 64}@net1", f"{'f' * 64}@net1"]


def fake_plugin(tmp_path: Path, answer: dict[str, Any]) -> list[str]:
    script = tmp_path / "plugin"
    script.write_text(
        f"#!{sys.executable}\nimport sys\nopen({str(tmp_path / 'argv')!r}, 'w').write(repr(sys.argv[1:]))\n"
        f"print({json.dumps(json.dumps(answer))})\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return [str(script)]


def released_total() -> float:
    return metrics.REGISTRY.get_sample_value("rdma_cni_agent_orphans_released_total") or 0.0


def test_the_agent_runs_the_pass_only_for_a_suspect_and_counts_each_release(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = RecordStore(str(state))
    plugin = fake_plugin(tmp_path, {"released": [f"{'b' * 64}/net1"], "kept": {}})
    agent = orphanpass.OrphanPass(plugin, {"PATH": "/usr/bin:/bin"}, [(str(state), "/run/lock-x")])
    before = released_total()
    assert agent.once() == []  # no record: the plugin is not run
    assert not (tmp_path / "argv").exists()
    write(store, record(tmp_path, boot_id=boot.boot_id(), container_id="b" * 64))
    assert agent.once() == [f"{'b' * 64}/net1"]
    assert released_total() == before + 1
    assert eval((tmp_path / "argv").read_text()) == [
        "release-orphans",
        f"--state-dir={state}",
        "--lock-file=/run/lock-x",
    ]


def counting_plugin(tmp_path: Path, answer: dict[str, Any]) -> tuple[list[str], Path]:
    """A plugin stand-in answering ``answer`` (from a file the test may rewrite); it counts its runs."""
    runs, said = tmp_path / "runs", tmp_path / "answer.json"
    said.write_text(json.dumps(answer))
    script = tmp_path / "counting-plugin"
    script.write_text(
        f"#!{sys.executable}\nopen({str(runs)!r}, 'a').write('x')\nprint(open({str(said)!r}).read())\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return [str(script)], said


def runs(tmp_path: Path) -> int:
    path = tmp_path / "runs"
    return len(path.read_text()) if path.exists() else 0


KEPT = {"released": [], "failed": [], "kept": {"x/net1": "a VF of it is not back in the host"}, "left": 0}


def suspect_kept(tmp_path: Path) -> tuple[RecordStore, orphanpass.OrphanPass, Path]:
    """A record whose namespace is gone, the agent's pass every 10 s, and a plugin keeping it (KEPT)."""
    state = tmp_path / "state"
    store = RecordStore(str(state))
    write(store, record(tmp_path, boot_id=boot.boot_id(), container_id="b" * 64))
    plugin, said = counting_plugin(tmp_path, KEPT)
    agent = orphanpass.OrphanPass(
        plugin, {"PATH": "/usr/bin:/bin"}, [(str(state), "/run/lock-x")], interval=10
    )
    return store, agent, said


def test_a_pass_that_changed_nothing_waits_twice_as_long_each_time_up_to_the_bound(tmp_path: Path) -> None:
    _store, agent, _said = suspect_kept(tmp_path)
    ran_at = []
    for t in range(0, 2000, 10):
        before = runs(tmp_path)
        agent.once(now=t)
        if runs(tmp_path) > before:
            ran_at.append(t)
    # Run at 0, then after 20, 40, 80, 160, 320 s, then every 320 s (MAX_BACKOFF).
    assert ran_at[:8] == [0, 20, 60, 140, 300, 620, 940, 1260], ran_at
    assert orphanpass.MAX_BACKOFF == 320


def test_a_new_suspect_or_a_pass_that_did_something_starts_over(tmp_path: Path) -> None:
    store, agent, said = suspect_kept(tmp_path)
    agent.once(now=0)
    agent.once(now=10)
    assert runs(tmp_path) == 1  # the same suspect, kept: not again before 20 s
    write(store, record(tmp_path, boot_id=boot.boot_id(), container_id="c" * 64))
    agent.once(now=10)
    assert runs(tmp_path) == 2  # a new suspect: at once
    for progress in ({"left": 1}, {"busy": True}, {"released": ["c/net1"]}):
        agent._quiet.clear()
        start = runs(tmp_path)
        said.write_text(json.dumps({**KEPT, **progress}))
        agent.once(now=100)
        agent.once(now=110)
        assert runs(tmp_path) == start + 2, progress  # both passes ran: nothing to wait for
        said.write_text(json.dumps(KEPT))
        agent.once(now=120)
        agent.once(now=130)
        assert runs(tmp_path) == start + 3, progress  # then kept again: the next one waits


def test_a_plugin_that_fails_each_time_is_run_at_the_slower_pace_too(tmp_path: Path) -> None:
    _store, agent, said = suspect_kept(tmp_path)
    said.write_text("not json")
    for t in (0, 10, 20, 30, 40, 50):
        agent.once(now=t)
    assert runs(tmp_path) == 2  # at 0 and 20; the next at 60
