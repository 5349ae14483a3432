"""Failure injected at every ADD step must leave the node as it was; RDMA isolation policy.

These run the plugin in-process so a step can be made to fail; the kernel
work (netns moves, renames, addresses, IPAM) stays real. RDMA netlink is
replaced at the socket boundary by tests.support.fake_rdma (this kernel has
no RDMA stack; the QEMU tier covers the real one).
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable
from typing import Any

import pytest

from rdma_cni.cni.errors import IOFailure, KernelError
from rdma_cni.kernel import linkscan, rdma
from rdma_cni.kernel.netns import Netns
from rdma_cni.node import attach, record
from rdma_cni.node.ipam import Ipam
from rdma_cni.node.isolation import RdmaIsolation
from rdma_cni.node.record import RecordStore
from tests.integration.conftest import Cluster, addresses_in, assert_node_pristine, ns_name
from tests.support.fake_rdma import FakeDevice, FakeRdmaKernel
from tests.support.simnode import SimPf, ip

RDMA_NODE = [SimPf("simpf0", 4, 25000, rdma=True), SimPf("simpf1", 4, 10000, rdma=True)]


class Injected(Exception):
    pass


def _fail_on_call(real: Callable[..., Any], n: int, after: bool) -> Callable[..., Any]:
    """Wrap ``real`` so its n-th call fails, before or after doing its work."""
    calls = {"count": 0}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls["count"] += 1
        if calls["count"] != n:
            return real(*args, **kwargs)
        if after:
            real(*args, **kwargs)
        raise KernelError(f"injected failure in call {n}")

    return wrapper


STEPS: dict[str, tuple[Any, str]] = {
    "pf settings": (attach, "apply_pf_settings"),
    "rdma move": (RdmaIsolation, "move_in"),
    "netdev move": (attach, "move_in"),  # moved, renamed, MAC and up in one request
    "ipam add": (Ipam, "finish_add"),
    "addresses": (attach, "apply_addresses"),
}


@pytest.fixture
def fake_rdma(monkeypatch: pytest.MonkeyPatch) -> FakeRdmaKernel:
    devices = [
        FakeDevice(index=k * 16 + i + 1, name=f"mlx5_{k * 16 + i}") for k in range(2) for i in range(4)
    ]
    kernel = FakeRdmaKernel(devices, mode="exclusive")
    monkeypatch.setattr(rdma, "open_rdma_socket", kernel.open_socket)
    return kernel


@pytest.mark.node(RDMA_NODE)
@pytest.mark.parametrize("after", [False, True], ids=["before-effect", "after-effect"])
@pytest.mark.parametrize("which", [1, 2], ids=["first-vf", "second-vf"])
@pytest.mark.parametrize("step", list(STEPS))
def test_failure_at_every_step_rolls_back(
    cluster: Cluster,
    monkeypatch: pytest.MonkeyPatch,
    fake_rdma: FakeRdmaKernel,
    step: str,
    which: int,
    after: bool,
) -> None:
    owner, name = STEPS[step]
    monkeypatch.setattr(owner, name, _fail_on_call(getattr(owner, name), which, after))
    pod = cluster.pod([{"min_tx_rate": 1000, "max_tx_rate": 2000}, {"max_tx_rate": 500}])
    out = cluster.run_inproc("ADD", pod, cluster.conf(vlan=12, trust=True))
    assert out.code == 1 and out.doc is not None and "injected" in out.doc["msg"], out.doc
    assert addresses_in(ns_name(pod)) == {"lo": []}
    assert_node_pristine(cluster)
    table = cluster.node.vf_state()["pfs"]
    for settings in (s for t in table.values() for s in t.values()):
        assert settings.get("vlan", [0, 0]) == [0, 0] and settings.get("trust", False) is False
    assert all(dev.netns == "host" for dev in fake_rdma.devices), fake_rdma.moves


@pytest.mark.node(RDMA_NODE)
def test_a_pod_that_has_the_name_already_is_told_so_and_the_vf_comes_home(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = cluster.pod([{}])
    ip("-n", ns_name(pod), "link", "add", "net1", "type", "veth", "peer", "name", "net1p")

    def walk(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the rollback walked the pod's links: it asks at the VF's index")

    monkeypatch.setattr(linkscan, "walk", walk)
    out = cluster.run_inproc("ADD", pod, cluster.conf(rdmaIsolation="off"))
    assert out.code == 1 and out.doc is not None and out.doc["code"] == KernelError.code, out.doc
    assert "the pod already has an interface named net1" in out.doc["msg"]
    # The kernel moved the VF before it refused the name: the rollback brought it home.
    assert_node_pristine(cluster)
    assert set(addresses_in(ns_name(pod))) == {"lo", "net1", "net1p"}


@pytest.mark.node(RDMA_NODE)
def test_failure_writing_the_final_record_rolls_back(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = RecordStore.write
    calls = {"n": 0}

    def flaky(self: RecordStore, att: Any, **how: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            assert how == {"new_name": False}  # the ready record, not a TypeError of this stand-in
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, att, **how)

    monkeypatch.setattr(RecordStore, "write", flaky)
    pod = cluster.pod([{}, {}])
    out = cluster.run_inproc("ADD", pod, cluster.conf(rdmaIsolation="off"))
    assert out.code == 1 and out.doc is not None and out.doc["code"] == 199, out.doc
    assert_node_pristine(cluster)


@pytest.mark.node(RDMA_NODE)
def test_rollback_that_fails_keeps_the_record_for_del(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attach, "apply_addresses", _fail_on_call(attach.apply_addresses, 1, True))
    real_restore = __import__("rdma_cni.node.attach", fromlist=["move_out"]).move_out
    monkeypatch.setattr(
        "rdma_cni.node.attach.move_out",
        lambda *a, **k: (_ for _ in ()).throw(KernelError("cannot move back")),
    )
    pod = cluster.pod([{}])
    conf = cluster.conf(rdmaIsolation="off")
    out = cluster.run_inproc("ADD", pod, conf)
    assert out.code == 1
    assert len(cluster.records) == 1, "a failed rollback must leave the record so DEL can finish"
    monkeypatch.setattr("rdma_cni.node.attach.move_out", real_restore)
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


@pytest.mark.node(RDMA_NODE)
def test_rdma_auto_exclusive_moves_device_with_netdev(cluster: Cluster, fake_rdma: FakeRdmaKernel) -> None:
    pod = cluster.pod([{}, {}])
    conf = cluster.conf()
    out = cluster.run_inproc("ADD", pod, conf)
    assert out.ok, out.doc
    label = fake_rdma.netns_label(pod["CNI_NETNS"])
    moved = {d.name for d in fake_rdma.devices if d.netns == label}
    assert len(moved) == 2
    store = RecordStore(cluster.state_dir)
    (att,) = store.all()
    assert {v.rdma_device for v in att.vfs} == moved and {v.rdma_action for v in att.vfs} == {"moved"}
    check = cluster.run_inproc("CHECK", pod, cluster.check_conf(conf, out.doc or {}))
    assert check.ok, check.doc
    # A device that strays back to the host fails CHECK.
    stray = fake_rdma.device(sorted(moved)[0])
    stray.netns = "host"
    bad = cluster.run_inproc("CHECK", pod, cluster.check_conf(conf, out.doc or {}))
    assert bad.doc is not None and bad.doc["code"] == 106 and stray.name in bad.doc["msg"]
    stray.netns = label
    assert cluster.run_inproc("DEL", pod, conf).ok
    assert all(d.netns == "host" for d in fake_rdma.devices)
    assert_node_pristine(cluster)


@pytest.mark.node(RDMA_NODE)
def test_rdma_del_after_netns_deleted_finds_device_in_host(
    cluster: Cluster, fake_rdma: FakeRdmaKernel
) -> None:
    pod = cluster.pod([{}])
    conf = cluster.conf()
    assert cluster.run_inproc("ADD", pod, conf).ok
    label = fake_rdma.netns_label(pod["CNI_NETNS"])
    # The kernel returns RDMA devices to the initial netns when a netns dies.
    for dev in fake_rdma.devices:
        if dev.netns == label:
            dev.netns = "host"
    os.system(f"ip netns del {ns_name(pod)}")
    assert cluster.run_inproc("DEL", pod, conf).ok
    assert cluster.records == []


@pytest.mark.node(RDMA_NODE)
def test_rdma_auto_shared_mode_leaves_devices_and_records_it(
    cluster: Cluster, fake_rdma: FakeRdmaKernel
) -> None:
    fake_rdma.mode = "shared"
    pod = cluster.pod([{}])
    conf = cluster.conf()
    out = cluster.run_inproc("ADD", pod, conf)
    assert out.ok, out.doc
    assert fake_rdma.moves == []
    (att,) = RecordStore(cluster.state_dir).all()
    assert att.vfs[0].rdma_action == "shared" and att.vfs[0].rdma_device.startswith("mlx5_")
    assert cluster.run_inproc("DEL", pod, conf).ok
    assert_node_pristine(cluster)


@pytest.mark.node(RDMA_NODE)
@pytest.mark.parametrize("problem", ["shared", "refused", "no-stack", "no-device"])
def test_rdma_required_fails_cleanly(
    cluster: Cluster, fake_rdma: FakeRdmaKernel, monkeypatch: pytest.MonkeyPatch, problem: str
) -> None:
    if problem == "shared":
        fake_rdma.mode = "shared"
    elif problem == "refused":
        fake_rdma.refuse_moves_with = errno.EOPNOTSUPP
    elif problem == "no-stack":

        def unsupported(netns_path: str | None = None, timeout: float | None = None) -> Any:
            raise rdma.RdmaUnsupported(errno.EPROTONOSUPPORT, "open RDMA netlink socket")

        monkeypatch.setattr(rdma, "open_rdma_socket", unsupported)
    else:
        import shutil

        for k, i in cluster.node.all_vfs():
            shutil.rmtree(
                os.path.join(
                    cluster.node.sysfs, "bus", "pci", "devices", cluster.node.vf_pci(k, i), "infiniband"
                )
            )
    pod = cluster.pod([{"max_tx_rate": 100}, {}])
    out = cluster.run_inproc("ADD", pod, cluster.conf(rdmaIsolation="required"))
    assert out.doc is not None and out.code == 1, out.doc
    expected = {
        "shared": "shared netns mode",
        "refused": "cannot be moved",
        "no-stack": "unavailable",
        "no-device": "no RDMA device",
    }[problem]
    assert out.doc["code"] in (100, 105) and expected in (out.doc["msg"] + out.doc.get("details", "")), (
        out.doc
    )
    assert all(d.netns == "host" for d in fake_rdma.devices)
    assert_node_pristine(cluster)


@pytest.mark.node(RDMA_NODE)
def test_rdma_off_never_touches_rdma(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("rdmaIsolation off must not open RDMA netlink")

    monkeypatch.setattr(rdma, "open_rdma_socket", forbidden)
    pod = cluster.pod([{}])
    conf = cluster.conf(rdmaIsolation="off")
    assert cluster.run_inproc("ADD", pod, conf).ok
    (att,) = RecordStore(cluster.state_dir).all()
    assert att.vfs[0].rdma_action == ""
    assert cluster.run_inproc("DEL", pod, conf).ok


@pytest.mark.node(RDMA_NODE)
def test_rdma_auto_without_rdma_stack_proceeds(cluster: Cluster) -> None:
    # The real kernel here has no RDMA netlink at all: auto must carry on without it.
    pod = cluster.pod([{}])
    conf = cluster.conf()
    out = cluster.run("ADD", pod, conf)
    assert out.ok, out.doc
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def test_netns_open_optional_handles_missing_path(tmp_path: Any) -> None:
    assert Netns.open_optional(str(tmp_path / "gone")) is None
    assert Netns.open_optional("") is None


@pytest.mark.node(RDMA_NODE)
def test_rollback_that_cannot_drop_the_record_reports_adds_own_error(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attach, "apply_addresses", _fail_on_call(attach.apply_addresses, 1, True))

    def no_delete(self: RecordStore, container_id: str, ifname: str) -> None:
        raise IOFailure("cannot remove allocation record: Read-only file system")

    real_delete = RecordStore.delete
    monkeypatch.setattr(RecordStore, "delete", no_delete)
    pod = cluster.pod([{}])
    conf = cluster.conf(rdmaIsolation="off")
    out = cluster.run_inproc("ADD", pod, conf)
    assert out.doc is not None and out.doc["code"] == 103 and "injected" in out.doc["msg"], out.doc
    assert len(cluster.records) == 1  # the record stays, listing VFs that are home: DEL drops it
    monkeypatch.setattr(RecordStore, "delete", real_delete)
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def _node_lock_free(lock_file: str) -> bool:
    """Whether the node lock (an flock of the whole file) could be taken right now."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing the only descriptor of this open file lets go of it
    return True


def test_the_intent_record_is_flushed_outside_the_node_lock_before_any_change(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = cluster.conf()
    pod = cluster.pod([{}])
    RecordStore(conf["stateDir"]).ensure()  # a node's first ADD makes the directory (and fsyncs that)
    seen: list[tuple[str, bool, list[str], dict[str, list[str]]]] = []
    real_dir, real_file = record._sync_dir, record._fsync_file
    fsyncs: list[int] = []
    real_fsync = os.fsync

    def observe(what: str) -> None:
        if len(seen) < 2:
            free = _node_lock_free(conf["lockFile"])
            seen.append((what, free, cluster.records, addresses_in(ns_name(pod))))

    def observe_dir(directory: str) -> None:
        observe("directory")
        real_dir(directory)

    def observe_file(path: str) -> None:
        observe("file")
        real_file(path)

    def counted_fsync(fd: int) -> None:
        if not seen:
            fsyncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(record, "_sync_dir", observe_dir)
    monkeypatch.setattr(record, "_fsync_file", observe_file)
    monkeypatch.setattr(os, "fsync", counted_fsync)
    out = cluster.run_inproc("ADD", pod, conf)
    assert out.ok, out.doc
    # The first flushes of the ADD, the record's content then its name: the intent record is
    # already there for every other verb to see, the node lock is free for them, and nothing is in
    # the pod yet; before them, no fsync at all (none under the node lock).
    name = f"{pod['CNI_CONTAINERID']}@net1.json"
    assert seen == [("file", True, [name], {"lo": []}), ("directory", True, [name], {"lo": []})]
    assert fsyncs == []
    assert cluster.run_inproc("DEL", pod, conf).ok
    assert_node_pristine(cluster)


def test_an_intent_record_that_cannot_be_flushed_fails_the_add_and_leaves_nothing(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = record._sync_dir
    failed: list[str] = []

    def broken_once(directory: str) -> None:
        if not failed:
            failed.append(directory)
            raise OSError(errno.EIO, "Input/output error")
        real(directory)

    monkeypatch.setattr(record, "_sync_dir", broken_once)
    pod = cluster.pod([{"min_tx_rate": 1000}])
    out = cluster.run_inproc("ADD", pod, cluster.conf())
    assert out.code == 1 and out.doc is not None and out.doc["code"] == 5, out.doc
    assert "cannot flush state directory" in out.doc["msg"] and failed[0] in out.doc["msg"], out.doc
    assert addresses_in(ns_name(pod)) == {"lo": []}
    assert_node_pristine(cluster)


def test_adds_in_one_process_parse_each_record_once(cluster: Cluster) -> None:
    # A verb worker runs many ADDs: under the node lock each reads every record file, but parses
    # only content it has not seen (node/record.ParsedRecords), and never serves a stale one.
    from rdma_cni.verbs import add

    conf = cluster.conf()
    pods = [cluster.pod([{"min_tx_rate": 1000}]) for _ in range(3)]
    assert cluster.run_inproc("ADD", pods[0], conf).ok
    before = add.HELD.parsed
    assert cluster.run_inproc("ADD", pods[1], conf).ok
    # The first pod's record changed once since the last read (adding -> ready): parsed once more.
    assert add.HELD.parsed == before + 1
    assert cluster.run_inproc("ADD", pods[2], conf).ok
    assert add.HELD.parsed == before + 2  # the second pod's, ready now; the first's is known
    assert cluster.run_inproc("DEL", pods[1], conf).ok
    again = cluster.pod([{"min_tx_rate": 1000}])
    assert cluster.run_inproc("ADD", again, conf).ok
    assert add.HELD.parsed == before + 3  # the third pod's; the deleted pod's VF is free again
    vfs = {pci for att in RecordStore(conf["stateDir"]).all() for pci in (v.pci for v in att.vfs)}
    assert len(vfs) == 3  # three pods, three VFs: none given twice
    for pod in (pods[0], pods[2], again):
        assert cluster.run_inproc("DEL", pod, conf).ok
    assert_node_pristine(cluster)
