"""The NRI plugin against a fake runtime speaking the real wire over a socketpair, on a sysfs tree in tmp."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdma_cni.agent.nri import mux, plugin, ttrpc
from rdma_cni.agent.nri import nri_api_pb2 as api
from rdma_cni.node import nristate
from rdma_cni.node.record import Attachment, RecordStore, VfRecord
from tests.support.waiting import wait_for

VF_A = "0000:3b:00.2"
VF_B = "0000:3b:00.3"


class Runtime:
    """The runtime's end: reads the plugin's frames, calls the Plugin service."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.readers = {1: ttrpc.Reader(), 2: ttrpc.Reader()}
        self.stream = 1

    def next(self) -> tuple[int, ttrpc.Message]:
        while True:
            conn, payload = mux.read_frame(self.sock)
            msgs = self.readers[conn].feed(payload)
            if msgs:
                assert len(msgs) == 1
                return conn, msgs[0]

    def call(self, method: str, payload: bytes, service: str = plugin.PLUGIN_SERVICE) -> ttrpc.Response:
        stream, self.stream = self.stream, self.stream + 2
        req = ttrpc.encode_request(ttrpc.Request(service, method, payload, 2_000_000_000))
        mux.send_frame(self.sock, mux.PLUGIN_CONN, ttrpc.encode_message(stream, ttrpc.TYPE_REQUEST, req))
        conn, msg = self.next()
        assert (conn, msg.stream, msg.type) == (mux.PLUGIN_CONN, stream, ttrpc.TYPE_RESPONSE)
        return ttrpc.decode_response(msg.payload)

    def expect_registration(self) -> tuple[ttrpc.Message, ttrpc.Request]:
        conn, msg = self.next()
        assert (conn, msg.type) == (mux.RUNTIME_CONN, ttrpc.TYPE_REQUEST)
        req = ttrpc.decode_request(msg.payload)
        assert (req.service, req.method) == (plugin.RUNTIME_SERVICE, "RegisterPlugin")
        return msg, req

    def answer_registration(self, msg: ttrpc.Message, code: int = 0) -> None:
        resp = ttrpc.encode_response(ttrpc.Response(code, "refused" if code else "", b""))
        mux.send_frame(
            self.sock, mux.RUNTIME_CONN, ttrpc.encode_message(msg.stream, ttrpc.TYPE_RESPONSE, resp)
        )

    def accept_registration(self, code: int = 0) -> ttrpc.Request:
        msg, req = self.expect_registration()
        self.answer_registration(msg, code)
        return req


def create_request(sandbox: str, container: str = "c1") -> bytes:
    return api.CreateContainerRequest(
        pod=api.PodSandbox(id=sandbox, name="web", namespace="default"),
        container=api.Container(id=container, pod_sandbox_id=sandbox, name="app"),
    ).SerializeToString()


def adjustment(
    resp: ttrpc.Response,
) -> tuple[list[tuple[str, str, int, int, int]], list[tuple[str, int, int]]]:
    assert resp.code == 0, resp.message
    adjust = api.CreateContainerResponse.FromString(resp.payload).adjust
    devices = [(d.path, d.type, d.major, d.minor, d.file_mode.value) for d in adjust.linux.devices]
    assert all(d.HasField("file_mode") for d in adjust.linux.devices)
    rlimits = [(r.type, r.hard, r.soft) for r in adjust.rlimits]
    return devices, rlimits


def make_sysfs(root: Path) -> None:
    """Two VFs, each with an mlx5 RDMA device and its uverbs/umad/issm nodes, and rdma_cm."""
    for n, pci in enumerate((VF_A, VF_B)):
        pci_dir = root / "devices" / "pci0000:3a" / pci
        (pci_dir / "infiniband" / f"mlx5_{n}").mkdir(parents=True)
        (root / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
        os.symlink(pci_dir, root / "bus" / "pci" / "devices" / pci)
        ib = root / "class" / "infiniband" / f"mlx5_{n}"
        ib.mkdir(parents=True)
        os.symlink(pci_dir, ib / "device")
        for cls, name, minor in (
            ("infiniband_verbs", f"uverbs{n}", 192 + n),
            ("infiniband_mad", f"umad{n}", n),
            ("infiniband_mad", f"issm{n}", 64 + n),
        ):
            d = root / "class" / cls / name
            d.mkdir(parents=True)
            (d / "ibdev").write_text(f"mlx5_{n}\n")
            (d / "dev").write_text(f"231:{minor}\n")
    # A verbs node of a device that is no VF's: never injected.
    other = root / "class" / "infiniband_verbs" / "uverbs9"
    other.mkdir(parents=True)
    (other / "ibdev").write_text("rxe0\n")
    (other / "dev").write_text("231:201\n")
    cm = root / "class" / "misc" / "rdma_cm"
    cm.mkdir(parents=True)
    (cm / "dev").write_text("10:58\n")


def record(store: RecordStore, sandbox: str, *pcis: str, state: str = "ready") -> None:
    vfs = [
        VfRecord(pf="ens1f0", vf=i, pci=p, host_name=f"vf{i}", host_mac="", host_mtu=1500, pod_name="net1")
        for i, p in enumerate(pcis)
    ]
    store.write(
        Attachment(sandbox, "net1", "rdma", f"/var/run/netns/{sandbox}", "1.0.0", state=state, vfs=vfs)
    )


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RecordStore:
    monkeypatch.setenv("RDMA_CNI_SYSFS_ROOT", str(tmp_path / "sys"))
    make_sysfs(tmp_path / "sys")
    return RecordStore(str(tmp_path / "state"))


def proven(_att: Attachment, pcis: list[str]) -> dict[str, list[str]]:
    return {pci: [] for pci in pcis}


def serve(p: plugin.NriPlugin) -> tuple[Runtime, threading.Thread, threading.Event, list[BaseException]]:
    a, b = socket.socketpair()
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            p.session(a, stop)
        except BaseException as exc:  # collected for the test to look at
            errors.append(exc)
        finally:
            a.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    b.settimeout(5)
    return Runtime(b), t, stop, errors


def test_register_configure_synchronize_then_inject_exactly_the_pods_devices(node: RecordStore) -> None:
    record(node, "sandbox-a", VF_A)
    record(node, "sandbox-b", VF_B)
    p = plugin.NriPlugin("unused", plugin.PodDevices([os.path.dirname(node.dir)], prove=proven))
    rt, t, stop, errors = serve(p)
    reg_msg, req = rt.expect_registration()
    config = api.ConfigureRequest(
        runtime_name="containerd", runtime_version="1.7.24", registration_timeout=5000, request_timeout=2000
    )
    resp = rt.call("Configure", config.SerializeToString())
    assert api.ConfigureResponse.FromString(resp.payload).events == 1 << 3  # CreateContainer only
    # A runtime that splits synchronization (NRI >= 0.7: more) gets "more" echoed back.
    sync = rt.call("Synchronize", api.SynchronizeRequest(more=True).SerializeToString())
    assert (sync.code, api.SynchronizeResponse.FromString(sync.payload).more) == (0, True)
    rt.answer_registration(reg_msg)
    register = api.RegisterPluginRequest.FromString(req.payload)
    assert (register.plugin_name, register.plugin_idx) == ("rdma-cni", "50")

    devices, rlimits = adjustment(rt.call("CreateContainer", create_request("sandbox-a")))
    assert devices == [
        ("/dev/infiniband/issm0", "c", 231, 64, 0o666),
        ("/dev/infiniband/rdma_cm", "c", 10, 58, 0o666),
        ("/dev/infiniband/umad0", "c", 231, 0, 0o666),
        ("/dev/infiniband/uverbs0", "c", 231, 192, 0o666),
    ]
    assert rlimits == [("RLIMIT_MEMLOCK", plugin.RLIM_INFINITY, plugin.RLIM_INFINITY)]
    devices_b, _ = adjustment(rt.call("CreateContainer", create_request("sandbox-b")))
    assert [d[0] for d in devices_b] == [
        "/dev/infiniband/issm1",
        "/dev/infiniband/rdma_cm",
        "/dev/infiniband/umad1",
        "/dev/infiniband/uverbs1",
    ]
    assert p.state == "registered" and p.injected == 2

    # A pod without attachments: its container is left exactly as it is.
    plain = rt.call("CreateContainer", create_request("sandbox-plain"))
    assert (plain.code, plain.payload) == (0, b"")
    stop.set()
    t.join(5)
    assert not errors


def test_record_naming_another_pods_vf_yields_nothing_of_that_pod(node: RecordStore) -> None:
    record(node, "victim", VF_A)
    record(node, "thief", VF_A, VF_B)
    devices = plugin.PodDevices([os.path.dirname(node.dir)], prove=proven)
    assert [d.path for d in devices("thief")] == [
        "/dev/infiniband/issm1",
        "/dev/infiniband/rdma_cm",
        "/dev/infiniband/umad1",
        "/dev/infiniband/uverbs1",
    ]
    assert devices("victim") == []  # a claimed-twice VF is trusted for neither


def test_only_vfs_proven_in_the_pod_and_ready_records_count(node: RecordStore) -> None:
    record(node, "pod", VF_A, VF_B)
    record(node, "adding", VF_B.replace("3", "4", 1), state="adding")
    seen: list[list[str]] = []

    def only_b(_att: Attachment, pcis: list[str]) -> dict[str, list[str]]:
        seen.append(pcis)
        return {VF_B: [], "0000:99:00.0": ["mlx5_0"]}  # a prover can only narrow, never add

    devices = plugin.PodDevices([os.path.dirname(node.dir)], prove=only_b)
    assert [d.path for d in devices("pod")] == [
        "/dev/infiniband/issm1",
        "/dev/infiniband/rdma_cm",
        "/dev/infiniband/umad1",
        "/dev/infiniband/uverbs1",
    ]
    assert seen[0] == [VF_A, VF_B]
    assert devices("adding") == []


def test_an_rdma_device_not_pointing_back_to_the_vf_is_refused(node: RecordStore, tmp_path: Path) -> None:
    link = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "device"
    link.unlink()
    os.symlink(tmp_path / "sys" / "devices" / "pci0000:3a" / VF_B, link)
    assert plugin.vf_rdma_devices(VF_A) == []
    assert plugin.vf_rdma_devices(VF_B) == ["mlx5_1"]


def test_memlock_is_configurable_or_left_alone(node: RecordStore) -> None:
    record(node, "pod", VF_A)
    for memlock, want in ((1 << 30, [("RLIMIT_MEMLOCK", 1 << 30, 1 << 30)]), (None, [])):
        p = plugin.NriPlugin(
            "x", plugin.PodDevices([os.path.dirname(node.dir)], prove=proven), memlock=memlock
        )
        resp = p.handle(ttrpc.Request(plugin.PLUGIN_SERVICE, "CreateContainer", create_request("pod")))
        assert adjustment(resp)[1] == want


def test_other_calls_and_bad_input_never_fail_a_container(node: RecordStore) -> None:
    def broken(_sandbox: str) -> list[plugin.CharDevice]:
        raise RuntimeError("bug")

    p = plugin.NriPlugin("x", broken)
    assert (
        p.handle(ttrpc.Request(plugin.PLUGIN_SERVICE, "CreateContainer", create_request("s"))).payload == b""
    )
    assert p.handle(ttrpc.Request(plugin.PLUGIN_SERVICE, "StopContainer", b"")).code == 0
    assert p.handle(ttrpc.Request("other.Service", "Configure", b"")).code == ttrpc.UNIMPLEMENTED
    # Malformed payloads of every kind of method, and a string that is not UTF-8 (proto3 strings
    # must be): each answered INVALID_ARGUMENT, never an exception.
    not_utf8 = api.PodSandbox(id="x").SerializeToString().replace(b"x", b"\xff")
    for method, payload in (
        ("CreateContainer", b"\x0a\x05"),
        ("CreateContainer", b"\x0a" + bytes([len(not_utf8)]) + not_utf8),
        ("Configure", b"\x12\x09abc"),
        ("Synchronize", b"\x18"),
        ("Shutdown", b"\x0b"),
        ("StopContainer", b"\x08\xff"),
    ):
        resp = p.handle(ttrpc.Request(plugin.PLUGIN_SERVICE, method, payload))
        assert (resp.code, resp.payload) == (ttrpc.INVALID_ARGUMENT, b""), (method, payload)
        assert resp.message.startswith(f"{method}: ")


def test_hostile_runtime_frames(node: RecordStore) -> None:
    p = plugin.NriPlugin("x", plugin.PodDevices([os.path.dirname(node.dir)], prove=proven))
    rt, t, _stop, errors = serve(p)
    rt.accept_registration()
    # A frame for a connection nobody opened, and a response on an unknown stream: ignored.
    mux.send_frame(rt.sock, 7, b"junk")
    resp = ttrpc.encode_response(ttrpc.Response(0, "", b""))
    mux.send_frame(rt.sock, mux.RUNTIME_CONN, ttrpc.encode_message(99, ttrpc.TYPE_RESPONSE, resp))
    assert rt.call("Synchronize", b"").code == 0
    # An oversize ttrpc length ends the connection.
    rt.sock.sendall(
        mux.encode_frame(mux.PLUGIN_CONN, ttrpc.TTRPC_HEADER.pack(ttrpc.MAX_MESSAGE + 1, 1, 1, 0))
    )
    t.join(5)
    assert isinstance(errors[0], ttrpc.ProtocolError)


def test_refused_registration_and_shutdown_end_the_session(node: RecordStore) -> None:
    p = plugin.NriPlugin("x", lambda _s: [])
    rt, t, _stop, errors = serve(p)
    rt.accept_registration(code=9)
    t.join(5)
    assert "refused registration" in str(errors[0])
    rt, t, _stop, errors = serve(p)
    rt.accept_registration()
    assert rt.call("Shutdown", b"").code == 0
    t.join(5)
    assert not errors and not t.is_alive()


def test_missing_socket_is_logged_once_and_reconnects(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plugin, "RECONNECT_DELAY", 0.05)
    path = str(tmp_path / "nri.sock")
    lock_file = str(tmp_path / "rdma-cni.lock")
    p = plugin.NriPlugin(path, lambda _s: [], state_file=nristate.state_path(lock_file))
    stop = threading.Event()
    t = threading.Thread(target=p.run, args=(stop,), daemon=True)
    with caplog.at_level(logging.WARNING, logger="rdma_cni.agent.nri"):
        t.start()
        stop.wait(0.3)
        assert p.state.startswith("not injecting: no NRI socket")
        assert sum("no NRI socket" in r.getMessage() for r in caplog.records) == 1
        assert (nristate.read_state(lock_file) or "").startswith("not injecting: no NRI socket at")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    server.settimeout(5)
    for _restart in range(2):  # the runtime restarts: the plugin registers again
        conn, _ = server.accept()
        conn.settimeout(5)
        Runtime(conn).accept_registration()
        deadline = time.monotonic() + 5
        while nristate.read_state(lock_file) != "registered" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert nristate.read_state(lock_file) == "registered"
        conn.close()
    stop.set()
    t.join(5)
    server.close()


def _listen(path: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    server.settimeout(10)
    return server


@contextlib.contextmanager
def plugin_loop(path: str) -> Iterator[plugin.NriPlugin]:
    """The plugin's connect-serve-reconnect loop on ``path``, in a thread, stopped on the way out."""
    p = plugin.NriPlugin(path, lambda _s: [])
    stop = threading.Event()
    t = threading.Thread(target=p.run, args=(stop,), daemon=True)
    t.start()
    try:
        yield p
    finally:
        stop.set()
        t.join(5)


@pytest.mark.parametrize("ending", ["hang-up", "Shutdown"])
def test_a_restarted_runtime_is_registered_with_at_once_not_after_the_slow_delay(
    tmp_path: Path, ending: str
) -> None:
    # The slow delay stays 2 s: a container the new runtime creates before the plugin is back
    # gets no devices, so the plugin must not wait that long after a connection it served ends.
    assert plugin.RECONNECT_DELAY == 2.0
    path = str(tmp_path / "nri.sock")
    server = _listen(path)
    try:
        with plugin_loop(path) as p:
            conn, _ = server.accept()
            conn.settimeout(5)
            rt = Runtime(conn)
            rt.accept_registration()
            wait_for(lambda: p.state == nristate.REGISTERED, 5, "the plugin registered")
            # The runtime stops (sending Shutdown, as containerd does on SIGTERM, or just gone),
            # its socket is gone for half a second, then the new one listens.
            if ending == "Shutdown":
                assert rt.call("Shutdown", b"").code == 0
            conn.close()
            server.close()
            os.unlink(path)
            time.sleep(0.5)
            server = _listen(path)
            listening = time.monotonic()
            conn, _ = server.accept()
            waited = time.monotonic() - listening
            conn.close()
            assert waited < 1.0, f"the plugin came back {waited:.2f} s after the runtime listened again"
    finally:
        server.close()


def test_a_runtime_that_never_registered_the_plugin_is_retried_at_the_slow_pace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plugin, "RECONNECT_DELAY", 1.0)
    path = str(tmp_path / "nri.sock")
    with contextlib.closing(_listen(path)) as server, plugin_loop(path):
        accepted = []
        for _attempt in range(2):
            conn, _ = server.accept()
            accepted.append(time.monotonic())
            conn.settimeout(5)
            Runtime(conn).accept_registration(code=1)  # refused: never registered
            conn.close()
        assert accepted[1] - accepted[0] >= 0.9


def test_fast_retries_last_only_their_window() -> None:
    assert plugin.reconnect_delay(10.0, 0.0) == plugin.RECONNECT_DELAY
    assert plugin.reconnect_delay(10.0, 10.0 + plugin.FAST_RETRY_SECONDS) == plugin.FAST_RETRY_DELAY
    assert plugin.reconnect_delay(10.0 + plugin.FAST_RETRY_SECONDS, 10.0 + plugin.FAST_RETRY_SECONDS) == (
        plugin.RECONNECT_DELAY
    )
    assert plugin.FAST_RETRY_DELAY < plugin.RECONNECT_DELAY


@pytest.mark.parametrize(
    "text, want",
    [
        ("unlimited", plugin.RLIM_INFINITY),
        ("off", None),
        ("65536", 65536),
        (" Unlimited ", plugin.RLIM_INFINITY),
    ],
)
def test_parse_memlock(text: str, want: int | None) -> None:
    assert plugin.parse_memlock(text) == want


@pytest.mark.parametrize("text", ["lots", "0", "-1", ""])
def test_parse_memlock_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="--memlock"):
        plugin.parse_memlock(text)


def test_installer_refuses_a_bad_memlock(capsys: pytest.CaptureFixture[str]) -> None:
    import io

    from rdma_cni.install import command

    with pytest.raises(SystemExit) as exc:
        command.main(["--watch", "--node-state", "--memlock", "lots"], io.StringIO())
    assert exc.value.code == 2
    assert "--memlock 'lots'" in capsys.readouterr().err


def test_agent_starts_the_plugin_on_the_socket_or_not_at_all(tmp_path: Path) -> None:
    from rdma_cni.agent.loop import start_nri
    from rdma_cni.agent.snapshot import NetworkView

    stop = threading.Event()
    views = [NetworkView("rdma", state_dir=str(tmp_path / "state"), lock_file=str(tmp_path / "lock"))]
    assert start_nri(views, "", None, stop) is None
    path = str(tmp_path / "nri.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    server.settimeout(5)
    thread = start_nri(views, path, None, stop)
    assert thread is not None
    conn, _ = server.accept()
    conn.settimeout(5)
    req = Runtime(conn).accept_registration()
    assert api.RegisterPluginRequest.FromString(req.payload).plugin_name == "rdma-cni"
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
    conn.close()
    server.close()


def test_status_says_when_pods_get_no_devices(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from rdma_cni.node.record import write_atomic
    from rdma_cni.verbs.status import report_nri

    lock_file = str(tmp_path / "rdma-cni.lock")
    with caplog.at_level(logging.WARNING, logger="rdma_cni.status"):
        report_nri(lock_file)  # no agent: nothing to say
        write_atomic(str(tmp_path), nristate.STATE_FILE, "registered\n", "t")
        report_nri(lock_file)
        assert not caplog.records
        write_atomic(str(tmp_path), nristate.STATE_FILE, "not injecting: no NRI socket at /x\n", "t")
        report_nri(lock_file)
    (rec,) = caplog.records
    assert "no RDMA character devices" in rec.getMessage() and "no NRI socket at /x" in rec.getMessage()


def test_a_runtime_stalling_inside_a_frame_ends_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "STALL_TIMEOUT", 0.2)
    p = plugin.NriPlugin("x", lambda _s: [])
    rt, t, _stop, errors = serve(p)
    rt.accept_registration()
    rt.sock.sendall(mux.HEADER.pack(mux.PLUGIN_CONN, 100) + b"partial")
    t.join(5)
    assert not t.is_alive()
    assert isinstance(errors[0], mux.Closed) and "timed out" in str(errors[0])


def test_char_devices_of_an_rdma_device_hidden_in_the_pods_namespace(
    node: RecordStore, tmp_path: Path
) -> None:
    # Exclusive mode: the RDMA device moved into the pod no longer shows in the host's sysfs, but its
    # char devices still do, parented on the VF.
    record(node, "pod", VF_A)
    sys_root = tmp_path / "sys"
    (sys_root / "devices" / "pci0000:3a" / VF_A / "infiniband" / "mlx5_0").rmdir()
    os.unlink(sys_root / "class" / "infiniband" / "mlx5_0" / "device")
    devices = plugin.PodDevices([os.path.dirname(node.dir)], prove=proven)
    assert devices("pod") == []  # nothing ties the char devices to the VF any more
    for cls, name in (
        ("infiniband_verbs", "uverbs0"),
        ("infiniband_mad", "umad0"),
        ("infiniband_mad", "issm1"),
    ):
        os.symlink(
            sys_root / "devices" / "pci0000:3a" / (VF_A if name != "issm1" else VF_B),
            sys_root / "class" / cls / name / "device",
        )
    assert [d.path for d in devices("pod")] == [
        "/dev/infiniband/rdma_cm",
        "/dev/infiniband/umad0",
        "/dev/infiniband/uverbs0",
    ]


def test_a_char_device_parented_elsewhere_is_refused_even_with_a_matching_name(
    node: RecordStore, tmp_path: Path
) -> None:
    # Another namespace's RDMA device may carry the same name as this VF's.
    record(node, "pod", VF_A)
    sys_root = tmp_path / "sys"
    os.symlink(
        sys_root / "devices" / "pci0000:3a" / VF_B,
        sys_root / "class" / "infiniband_verbs" / "uverbs0" / "device",
    )
    devices = plugin.PodDevices([os.path.dirname(node.dir)], prove=proven)
    assert "/dev/infiniband/uverbs0" not in [d.path for d in devices("pod")]
    assert "/dev/infiniband/umad0" in [d.path for d in devices("pod")]


def test_a_soft_device_on_the_pods_vf_is_injected_by_the_name_the_kernel_gave(node: RecordStore) -> None:
    # rxe0's uverbs9 has no device link (a soft device has no PCI parent): only the kernel's
    # port-to-netdev tie, found in the pod's namespace, makes it the pod's.
    record(node, "pod", VF_A)
    record(node, "other", VF_B)

    def soft_on_a(_att: Attachment, pcis: list[str]) -> dict[str, list[str]]:
        return {pci: (["rxe0"] if pci == VF_A else []) for pci in pcis}

    devices = plugin.PodDevices([os.path.dirname(node.dir)], prove=soft_on_a)
    paths = [d.path for d in devices("pod")]
    assert "/dev/infiniband/uverbs9" in paths and "/dev/infiniband/uverbs0" in paths
    assert next(d for d in devices("pod") if d.path.endswith("uverbs9")).minor == 201
    assert "/dev/infiniband/uverbs9" not in [d.path for d in devices("other")]
    # Without the tie (the device's netdev is not the pod's VF) it is nobody's.
    plain = plugin.PodDevices([os.path.dirname(node.dir)], prove=proven)
    assert "/dev/infiniband/uverbs9" not in [d.path for d in plain("pod")]


def test_a_soft_name_cannot_pull_in_a_pci_device_of_another_vf(node: RecordStore) -> None:
    # Even if the netlink answer named mlx5_1 (VF_B's, parented on VF_B), VF_A's pod does not get it.
    record(node, "pod", VF_A)

    def names_b(_att: Attachment, pcis: list[str]) -> dict[str, list[str]]:
        return {pci: ["mlx5_1"] for pci in pcis}

    devices = plugin.PodDevices([os.path.dirname(node.dir)], prove=names_b)
    sys_root = Path(os.environ["RDMA_CNI_SYSFS_ROOT"])
    for cls, name in (
        ("infiniband_verbs", "uverbs1"),
        ("infiniband_mad", "umad1"),
        ("infiniband_mad", "issm1"),
    ):
        os.symlink(sys_root / "devices" / "pci0000:3a" / VF_B, sys_root / "class" / cls / name / "device")
    assert [d.path for d in devices("pod")] == [
        "/dev/infiniband/issm0",
        "/dev/infiniband/rdma_cm",
        "/dev/infiniband/umad0",
        "/dev/infiniband/uverbs0",
    ]


def test_netdev_rdma_devices_asks_the_kernel_inside_the_pods_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rdma_cni.kernel import rdma
    from tests.support.fake_rdma import FakeDevice, FakeRdmaKernel

    pod, other = tmp_path / "pod-netns", tmp_path / "other-netns"
    pod.write_text("")
    other.write_text("")
    kernel = FakeRdmaKernel(
        [
            FakeDevice(1, "mlx5_0", netdev_index=4, netdev_name="ens1f0"),  # the host's
            # Shared mode: every device is visible everywhere; ports name their netdev only to a
            # socket in the netdev's namespace, where the index is that namespace's own.
            FakeDevice(2, "rxe_pod", netdev_index=7, netdev_name="net1", netdev_netns=str(pod)),
            FakeDevice(3, "rxe_other", netdev_index=7, netdev_name="net1", netdev_netns=str(other)),
            FakeDevice(4, "siw_pod", netdev_index=9, netdev_name="net2", netdev_netns=str(pod)),
        ],
        mode="shared",
    )
    kernel.netns_label(str(pod))
    kernel.netns_label(str(other))
    monkeypatch.setattr(rdma, "open_rdma_socket", kernel.open_socket)
    fd = os.open(pod, os.O_RDONLY)
    try:
        assert plugin.netdev_rdma_devices(fd) == {7: ["rxe_pod"], 9: ["siw_pod"]}
    finally:
        os.close(fd)
    assert kernel.sockets[0].netns == str(pod) and kernel.sockets[0].closed


def test_netdev_rdma_devices_without_rdma_or_with_a_failing_kernel_is_empty(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import errno

    from rdma_cni.kernel import rdma
    from rdma_cni.kernel.nlsock import NetlinkError

    def unsupported(*_a: object, **_k: object) -> None:
        raise rdma.RdmaUnsupported(errno.EPROTONOSUPPORT, "open RDMA netlink socket")

    monkeypatch.setattr(rdma, "open_rdma_socket", unsupported)
    with caplog.at_level(logging.WARNING, logger="rdma_cni.agent.nri"):
        assert plugin.netdev_rdma_devices(0) == {}
    assert not caplog.records  # a node without RDMA is normal, not worth a warning

    def gone(*_a: object, **_k: object) -> None:
        raise NetlinkError(errno.ENOENT, "enter network namespace 5")

    monkeypatch.setattr(rdma, "open_rdma_socket", gone)
    with caplog.at_level(logging.WARNING, logger="rdma_cni.agent.nri"):
        assert plugin.netdev_rdma_devices(5) == {}
    assert "soft devices left out" in caplog.text


def test_proofs_stop_after_their_time_and_inject_nothing_unproven(
    node: RecordStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    record(node, "sandbox-a", VF_A)
    second = VfRecord(
        pf="ens1f0", vf=1, pci=VF_B, host_name="vf1", host_mac="", host_mtu=1500, pod_name="net2"
    )
    node.write(
        Attachment(
            "sandbox-a", "net2", "rdma", "/var/run/netns/sandbox-a", "1.0.0", state="ready", vfs=[second]
        )
    )
    monkeypatch.setattr(plugin, "PROOF_SECONDS", 0.05)
    calls: list[str] = []

    def slow(att: Attachment, pcis: list[str]) -> dict[str, list[str]]:
        calls.append(att.ifname)
        time.sleep(0.1)  # a proof that used up the whole budget
        return {pci: [] for pci in pcis}

    devices = plugin.PodDevices([os.path.dirname(node.dir)], prove=slow)("sandbox-a")
    assert calls == ["net1"]
    assert [d.path for d in devices if "uverbs" in d.path] == ["/dev/infiniband/uverbs0"]
    assert "the devices of sandbox-a/net2 are not injected" in caplog.text
