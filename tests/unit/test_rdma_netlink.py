"""RDMA netlink (nldev) client: byte-exact requests, reply decoding, errors, netns switching.

Every reply here is built with ``struct`` (inline, or by the struct-only
builders in ``tests/support/fake_rdma.py``), never with the client's encoder,
so an encoder or decoder bug cannot hide behind a symmetric mistake.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdma_cni.kernel import rdma
from rdma_cni.kernel.nlsock import NetlinkError
from rdma_cni.kernel.rdma import (
    RdmaClient,
    RdmaDevice,
    RdmaPort,
    RdmaUnsupported,
    decode_messages,
    encode_get_devices,
    encode_move,
    encode_port_get_dump,
    encode_sys_get,
)

try:
    from tests.support import fake_rdma
except ModuleNotFoundError:  # pytest was started without the project root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.support import fake_rdma

FakeDevice = fake_rdma.FakeDevice
FakeMove = fake_rdma.FakeMove
FakeRdmaKernel = fake_rdma.FakeRdmaKernel

HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
PID = 4242
GUID_A = 0x0C42A10300AABB01
GUID_B = 0xB8CEF6FFFE123456
CLONE_NEWNET = 0x40000000


class ScriptedSocket:
    """Records what the client sends and hands out pre-built reply datagrams in order."""

    def __init__(self, *datagrams: bytes) -> None:
        self.replies: deque[bytes] = deque(datagrams)
        self.sent: list[bytes] = []
        self.closed = False

    def send(self, data: bytes) -> int:
        self.sent.append(bytes(data))
        return len(data)

    def recv(self, bufsize: int) -> bytes:
        if not self.replies:
            raise TimeoutError("no scripted reply left")
        return self.replies.popleft()[:bufsize]

    def close(self) -> None:
        self.closed = True

    def settimeout(self, timeout: float | None) -> None:
        pass


def header(length: int, msg_type: int, flags: int, seq: int, pid: int = PID) -> bytes:
    return HDR.pack(length, msg_type, flags, seq, pid)


def message(msg_type: int, flags: int, seq: int, payload: bytes) -> bytes:
    assert len(payload) % 4 == 0, "test bug: payload must already be padded"
    return header(16 + len(payload), msg_type, flags, seq) + payload


def error_reply(seq: int, err: int, request: bytes) -> bytes:
    """NLMSG_ERROR as the kernel sends it without NETLINK_CAP_ACK: -err, then the whole request."""
    return message(2, 0, seq, struct.pack("=i", -err) + request)


def ack(seq: int, request: bytes) -> bytes:
    """The success ACK: error 0 and only the request's header, flagged NLM_F_CAPPED."""
    return message(2, 0x100, seq, struct.pack("=i", 0) + request[:16])


def done(seq: int, err: int = 0, flags: int = 0x2) -> bytes:
    return message(3, flags, seq, struct.pack("=i", -err))


# A three-record GET dump in one datagram, with pad and unknown attributes in
# between, then NLMSG_DONE in a second datagram.
DEV_A = (
    struct.pack("=HHI", 8, 1, 1)  # DEV_INDEX 1
    + struct.pack("=HH", 11, 2) + b"mlx5_0\0" + b"\0"  # DEV_NAME, nla_len 11, one pad byte
    + struct.pack("=HH", 12, 5) + b"28.39.1\0"  # FW_VERSION: not mapped
    + struct.pack("=HH", 4, 0)  # pad attribute
    + struct.pack("=HHQ", 12, 6, GUID_A)  # NODE_GUID u64
    + struct.pack("=HHI", 8, 999, 0xDEADBEEF)  # unknown attribute type
)  # fmt: skip
DEV_B = (
    struct.pack("=HH", 4, 0)  # a pad before anything else
    + struct.pack("=HHI", 8, 1, 2)
    + struct.pack("=HH", 4, 0)
    + struct.pack("=HHQ", 12, 4, 0x1F)  # CAP_FLAGS u64: not mapped
    + struct.pack("=HH", 11, 2) + b"mlx5_1\0" + b"\0"
    + struct.pack("=HH", 5, 14) + b"\x01\0\0\0"  # NODE_TYPE u8: not mapped
    + struct.pack("=HHQ", 12, 6, GUID_B)
)  # fmt: skip
DEV_C = (
    struct.pack("=HHI", 8, 1, 7)
    + struct.pack("=HH", 9, 2) + b"rxe0\0" + b"\0\0\0"  # no NODE_GUID at all
)  # fmt: skip
DUMP_MULTI = 0x2


def device_dump(seq: int) -> tuple[bytes, bytes]:
    first = message(0x1401, DUMP_MULTI, seq, DEV_A) + message(0x1401, DUMP_MULTI, seq, DEV_B)
    first += message(0x1401, DUMP_MULTI, seq, DEV_C)
    return first, done(seq)


EXPECTED_DEVICES = [
    RdmaDevice(1, "mlx5_0", GUID_A),
    RdmaDevice(2, "mlx5_1", GUID_B),
    RdmaDevice(7, "rxe0", None),
]


# --------------------------------------------------------------------------- requests


@pytest.mark.parametrize("seq", [1, 2, 0x12345678, 0xFFFFFFFF])
def test_device_dump_request_is_a_bare_16_byte_header(seq: int) -> None:
    assert encode_get_devices(seq) == struct.pack("=IHHII", 16, 0x1401, 0x305, seq, 0)


def test_move_request_is_32_bytes_with_dev_index_and_netns_fd() -> None:
    data = encode_move(9, dev_index=3, netns_fd=17)
    assert len(data) == 32
    assert data == (
        struct.pack("=IHHII", 32, 0x1402, 0x5, 9, 0)
        + struct.pack("=HHI", 8, 1, 3)  # RDMA_NLDEV_ATTR_DEV_INDEX
        + struct.pack("=HHI", 8, 68, 17)  # RDMA_NLDEV_NET_NS_FD
    )


def test_sys_get_request() -> None:
    assert encode_sys_get(5) == struct.pack("=IHHII", 16, 0x1406, 0x5, 5, 0)


def test_port_dump_request() -> None:
    assert encode_port_get_dump(6) == struct.pack("=IHHII", 16, 0x1405, 0x305, 6, 0)


def test_pyroute2_is_imported_late_and_only_in_part() -> None:
    code = (
        "import sys, rdma_cni.kernel.rdma as r\n"
        "print(any(m.split('.')[0] == 'pyroute2' for m in sys.modules))\n"
        "r.decode_messages(r.encode_move(1, 2, 3))\n"
        "print(*(m in sys.modules for m in ('pyroute2.netlink', 'pyroute2.iproute', 'asyncio')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # Nothing at import; on first use pyroute2.netlink but not the package's
    # eager __init__ (which would pull in iproute and asyncio, ~130 ms).
    assert out.stdout.split() == ["False", "True", "False", "False"]


def test_message_class_is_a_pyroute2_nlmsg() -> None:
    from pyroute2.netlink import nlmsg

    assert issubclass(rdma.NldevMessage, nlmsg)


# --------------------------------------------------------------------------- decoding


def test_multipart_device_dump_across_two_recvs() -> None:
    sock = ScriptedSocket(*device_dump(seq=1))
    client = RdmaClient(sock=sock)
    assert client.list_devices() == EXPECTED_DEVICES
    assert sock.sent == [struct.pack("=IHHII", 16, 0x1401, 0x305, 1, 0)]
    assert not sock.replies, "the client read past NLMSG_DONE"


def test_decode_messages_drops_pad_and_unknown_attributes() -> None:
    first, _ = device_dump(seq=4)
    msgs = decode_messages(first)
    assert [(m.type, m.flags, m.seq, m.pid) for m in msgs] == [(0x1401, DUMP_MULTI, 4, PID)] * 3
    assert msgs[0].attrs == {1: 1, 2: "mlx5_0", 6: GUID_A}
    assert msgs[1].attrs == {1: 2, 2: "mlx5_1", 6: GUID_B}
    assert msgs[2].attrs == {1: 7, 2: "rxe0"}


def test_decode_done_and_error_messages() -> None:
    request = struct.pack("=IHHII", 16, 0x1406, 5, 8, 0)
    msgs = decode_messages(done(8) + error_reply(8, errno.EBUSY, request) + ack(8, request))
    assert [(m.type, m.error) for m in msgs] == [(3, 0), (2, -errno.EBUSY), (2, 0)]


def test_decode_rejects_a_truncated_message() -> None:
    first, _ = device_dump(seq=1)
    with pytest.raises(NetlinkError) as info:
        decode_messages(first[:-6])
    assert info.value.errno == errno.EPROTO


def test_decode_rejects_a_length_below_the_header_size() -> None:
    with pytest.raises(NetlinkError):
        decode_messages(header(8, 0x1401, 2, 1) + b"\0" * 8)


def test_port_dump_with_and_without_netdev() -> None:
    with_netdev = (
        struct.pack("=HHI", 8, 1, 3)
        + struct.pack("=HH", 11, 2) + b"mlx5_3\0\0"
        + struct.pack("=HHI", 8, 3, 1)  # PORT_INDEX
        + struct.pack("=HH", 5, 12) + b"\x04\0\0\0"  # PORT_STATE u8: not mapped
        + struct.pack("=HHI", 8, 50, 12)  # NDEV_INDEX
        + struct.pack("=HH", 13, 51) + b"ens1f0v1\0" + b"\0\0\0"  # NDEV_NAME
    )  # fmt: skip
    without = struct.pack("=HHI", 8, 1, 4) + struct.pack("=HH", 9, 2) + b"ib_0\0\0\0\0"
    without += struct.pack("=HHI", 8, 3, 2)
    sock = ScriptedSocket(
        message(0x1405, DUMP_MULTI, 1, with_netdev),
        message(0x1405, DUMP_MULTI, 1, without) + done(1),
    )
    ports = RdmaClient(sock=sock).ports_of(3)
    assert ports == [RdmaPort(3, "mlx5_3", 1, 12, "ens1f0v1"), RdmaPort(4, "ib_0", 2, None, None)]
    # The kernel dumps one device's ports: DEV_INDEX is required.
    assert sock.sent == [struct.pack("=IHHII", 24, 0x1405, 0x305, 1, 0) + struct.pack("=HHI", 8, 1, 3)]


@pytest.mark.parametrize(("value", "mode"), [(0, "exclusive"), (1, "shared")])
def test_netns_mode(value: int, mode: str) -> None:
    request = struct.pack("=IHHII", 16, 0x1406, 5, 1, 0)
    reply = message(0x1406, 0, 1, struct.pack("=HHB3x", 5, 66, value) + struct.pack("=HHB3x", 5, 93, 1))
    sock = ScriptedSocket(reply, ack(1, request))
    assert RdmaClient(sock=sock).netns_mode() == mode
    assert sock.sent == [request]
    assert not sock.replies, "the client did not wait for the ACK"


def test_netns_mode_rejects_unknown_value_and_missing_attribute() -> None:
    request = struct.pack("=IHHII", 16, 0x1406, 5, 1, 0)
    odd = message(0x1406, 0, 1, struct.pack("=HHB3x", 5, 66, 7))
    with pytest.raises(NetlinkError, match="unknown netns mode 7"):
        RdmaClient(sock=ScriptedSocket(odd, ack(1, request))).netns_mode()
    empty = message(0x1406, 0, 1, b"")
    with pytest.raises(NetlinkError, match="no netns mode"):
        RdmaClient(sock=ScriptedSocket(empty, ack(1, request))).netns_mode()


def test_find_by_name() -> None:
    client = RdmaClient(sock=ScriptedSocket(*device_dump(1), *device_dump(2)))
    assert client.find_by_name("mlx5_1") == RdmaDevice(2, "mlx5_1", GUID_B)
    assert client.find_by_name("mlx5_9") is None


# --------------------------------------------------------------------------- errors and ACKs


def move_request(seq: int, dev_index: int, fd: int) -> bytes:
    return struct.pack("=IHHII", 32, 0x1402, 5, seq, 0) + struct.pack("=HHIHHI", 8, 1, dev_index, 8, 68, fd)


def test_move_ack_is_success() -> None:
    request = move_request(1, 3, 17)
    sock = ScriptedSocket(ack(1, request))
    with RdmaClient(sock=sock) as client:
        assert client.move_to_netns(3, 17) is None
    assert sock.sent == [request]
    assert sock.closed


@pytest.mark.parametrize(
    ("err", "phrase"),
    [
        (
            errno.EOPNOTSUPP,
            "cannot be moved between network namespaces, or the system is in shared netns mode",
        ),
        (errno.EPERM, "CAP_NET_ADMIN"),
        (errno.EBUSY, "busy"),
        (errno.EINVAL, "unknown RDMA device"),
        (errno.ENODEV, "not in the network namespace"),
    ],
)
def test_move_error_replies(err: int, phrase: str) -> None:
    request = move_request(1, 3, 17)
    client = RdmaClient(sock=ScriptedSocket(error_reply(1, err, request)))
    with pytest.raises(NetlinkError) as info:
        client.move_to_netns(3, 17)
    assert info.value.errno == err
    assert "move RDMA device 3" in info.value.op
    assert phrase in str(info.value)
    assert errno.errorcode[err] in str(info.value)
    assert type(info.value) is NetlinkError


def test_error_with_extended_ack_message_and_full_echo() -> None:
    request = move_request(1, 3, 17)
    tlv = struct.pack("=HH", 4 + 18, 1) + b"device is in use\0\0" + b"\0\0"  # NLMSGERR_ATTR_MSG
    reply = message(2, 0x200, 1, struct.pack("=i", -errno.EBUSY) + request + tlv)
    with pytest.raises(NetlinkError) as info:
        RdmaClient(sock=ScriptedSocket(reply)).move_to_netns(3, 17)
    assert info.value.errno == errno.EBUSY
    assert info.value.kernel_message == "device is in use"
    assert "kernel: device is in use" in str(info.value)


def test_error_with_extended_ack_message_and_capped_echo() -> None:
    request = move_request(1, 3, 17)
    tlv = struct.pack("=HH", 4 + 4, 1) + b"bad\0"
    reply = message(2, 0x300, 1, struct.pack("=i", -errno.EINVAL) + request[:16] + tlv)
    with pytest.raises(NetlinkError) as info:
        RdmaClient(sock=ScriptedSocket(reply)).move_to_netns(3, 17)
    assert (info.value.errno, info.value.kernel_message) == (errno.EINVAL, "bad")


def test_dump_refused_at_start() -> None:
    request = struct.pack("=IHHII", 16, 0x1401, 0x305, 1, 0)
    with pytest.raises(NetlinkError) as info:
        RdmaClient(sock=ScriptedSocket(error_reply(1, errno.EPERM, request))).list_devices()
    assert info.value.errno == errno.EPERM


def test_dump_ending_in_an_error() -> None:
    first, _ = device_dump(1)
    with pytest.raises(NetlinkError) as info:
        RdmaClient(sock=ScriptedSocket(first, done(1, errno.EMSGSIZE))).list_devices()
    assert info.value.errno == errno.EMSGSIZE


def test_interrupted_dump_is_retried() -> None:
    first, _ = device_dump(1)
    sock = ScriptedSocket(first, done(1, flags=0x2 | 0x10), *device_dump(2))
    assert RdmaClient(sock=sock).list_devices() == EXPECTED_DEVICES
    assert [struct.unpack_from("=I", sent, 8)[0] for sent in sock.sent] == [1, 2]


def test_replies_to_other_sequence_numbers_are_skipped() -> None:
    request = move_request(1, 3, 17)
    # Leftovers of an earlier request with seq 77, including an error that
    # must not be taken for the answer to this one.
    stale = message(0x1401, DUMP_MULTI, 77, DEV_A) + error_reply(77, errno.EPERM, request)
    sock = ScriptedSocket(stale, done(77), ack(1, request))
    RdmaClient(sock=sock).move_to_netns(3, 17)
    assert not sock.replies


def test_stale_records_do_not_leak_into_a_dump() -> None:
    first, last = device_dump(1)
    stale = message(0x1401, DUMP_MULTI, 0, DEV_C)
    sock = ScriptedSocket(stale + first, last)
    assert RdmaClient(sock=sock).list_devices() == EXPECTED_DEVICES


def test_sequence_numbers_increase_per_request() -> None:
    sock = ScriptedSocket(ack(1, move_request(1, 1, 5)), ack(2, move_request(2, 2, 5)))
    client = RdmaClient(sock=sock)
    client.move_to_netns(1, 5)
    client.move_to_netns(2, 5)
    assert sock.sent == [move_request(1, 1, 5), move_request(2, 2, 5)]


def test_timeout_and_send_failure_become_rdma_errors() -> None:
    with pytest.raises(NetlinkError) as info:
        RdmaClient(sock=ScriptedSocket()).netns_mode()
    assert info.value.errno == errno.ETIMEDOUT

    class Refusing(ScriptedSocket):
        def send(self, data: bytes) -> int:
            raise OSError(errno.ENOBUFS, "no buffer space")

    with pytest.raises(NetlinkError) as info:
        RdmaClient(sock=Refusing()).list_devices()
    assert info.value.errno == errno.ENOBUFS


def test_closed_client() -> None:
    sock = ScriptedSocket()
    client = RdmaClient(sock=sock)
    client.close()
    client.close()
    assert sock.closed
    with pytest.raises(ValueError, match="closed"):
        client.list_devices()


def test_sock_and_netns_path_are_exclusive() -> None:
    with pytest.raises(ValueError):
        RdmaClient("/proc/1/ns/net", sock=ScriptedSocket())


def test_error_hierarchy() -> None:
    err = RdmaUnsupported(errno.EPROTONOSUPPORT, "open RDMA netlink socket")
    assert isinstance(err, NetlinkError)
    assert "the kernel has no RDMA netlink support (no RDMA stack loaded)" in str(err)
    assert (err.errno, err.op) == (errno.EPROTONOSUPPORT, "open RDMA netlink socket")


# --------------------------------------------------------------------------- the real kernel


def test_real_socket_on_this_kernel() -> None:
    try:
        client = RdmaClient()
    except RdmaUnsupported as exc:
        assert exc.errno in (errno.EPROTONOSUPPORT, errno.EAFNOSUPPORT)
        assert "no RDMA stack" in str(exc) or "no netlink" in str(exc)
        return
    # This kernel has RDMA netlink: then the real exchange must work.
    with client:
        devices = client.list_devices()
        assert all(isinstance(dev, RdmaDevice) for dev in devices)
        assert client.netns_mode() in ("exclusive", "shared")


# --------------------------------------------------------------------------- netns switching


def thread_netns() -> int:
    return os.stat("/proc/thread-self/ns/net").st_ino


@pytest.fixture
def scratch_netns() -> Iterator[str]:
    """A fresh network namespace, held by a helper thread; yields a path to it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a network namespace")
    ready, finish = threading.Event(), threading.Event()
    box: dict[str, int] = {}

    def hold() -> None:
        # unshare() moves only this thread; the namespace dies with it.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNET) != 0:
            box["errno"] = ctypes.get_errno()
        else:
            box["tid"] = threading.get_native_id()
        ready.set()
        if "tid" in box:
            finish.wait()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert ready.wait(10)
    if "errno" in box:
        pytest.skip(f"cannot create a network namespace: {os.strerror(box['errno'])}")
    path = f"/proc/self/task/{box['tid']}/ns/net"
    assert os.stat(path).st_ino != thread_netns()
    yield path
    finish.set()
    thread.join(10)


@pytest.mark.root
def test_socket_in_netns_restores_thread_when_rdma_is_missing(scratch_netns: str) -> None:
    before = thread_netns()
    try:
        client = RdmaClient(netns_path=scratch_netns)
    except RdmaUnsupported:
        pass
    else:  # a kernel with RDMA netlink: the socket is bound to the scratch netns, which has no devices
        with client:
            assert client.list_devices() == []
    assert thread_netns() == before


@pytest.mark.root
def test_socket_is_created_inside_the_target_netns(
    scratch_netns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = thread_netns()
    target = os.stat(scratch_netns).st_ino
    seen: list[int] = []

    def fake_create() -> ScriptedSocket:
        seen.append(thread_netns())
        return ScriptedSocket()

    monkeypatch.setattr(rdma, "_create_socket", fake_create)
    with RdmaClient(netns_path=scratch_netns):
        assert thread_netns() == before
    assert seen == [target]


@pytest.mark.root
def test_thread_restored_when_socket_creation_fails(
    scratch_netns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = thread_netns()
    seen: list[int] = []

    def failing_create() -> ScriptedSocket:
        seen.append(thread_netns())
        raise RdmaUnsupported(errno.EPROTONOSUPPORT, "open RDMA netlink socket")

    monkeypatch.setattr(rdma, "_create_socket", failing_create)
    with pytest.raises(RdmaUnsupported):
        RdmaClient(netns_path=scratch_netns)
    assert seen == [os.stat(scratch_netns).st_ino]
    assert thread_netns() == before


def test_missing_netns_path(tmp_path: Path) -> None:
    before = thread_netns()
    with pytest.raises(NetlinkError) as info:
        RdmaClient(netns_path=str(tmp_path / "gone"))
    assert info.value.errno == errno.ENOENT
    assert "does not exist" in str(info.value)
    assert thread_netns() == before


@pytest.mark.root
def test_path_that_is_not_a_netns(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("setns() needs root")
    before = thread_netns()
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(NetlinkError) as info:
        RdmaClient(netns_path=str(plain))
    assert info.value.errno == errno.EINVAL
    assert "not a network namespace" in str(info.value)
    assert thread_netns() == before


# --------------------------------------------------------------------------- the reusable fake kernel


def test_fake_kernel_lists_devices_and_ports() -> None:
    kernel = FakeRdmaKernel(
        [
            FakeDevice(1, "mlx5_0", node_guid=GUID_A, netdev_index=4, netdev_name="ens1f0"),
            FakeDevice(2, "mlx5_1", node_guid=GUID_B, netdev_index=9, netdev_name="ens1f0v0"),
            FakeDevice(3, "mlx5_2", port_index=1),
        ],
        dump_batch=2,
    )
    with kernel.client() as client:
        assert client.list_devices() == [
            RdmaDevice(1, "mlx5_0", GUID_A),
            RdmaDevice(2, "mlx5_1", GUID_B),
            RdmaDevice(3, "mlx5_2", None),
        ]
        assert client.list_ports() == [
            RdmaPort(1, "mlx5_0", 1, 4, "ens1f0"),
            RdmaPort(2, "mlx5_1", 1, 9, "ens1f0v0"),
            RdmaPort(3, "mlx5_2", 1, None, None),
        ]
        assert client.netns_mode() == "exclusive"
    assert kernel.sockets[0].closed


def test_fake_kernel_moves_between_namespaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pod = tmp_path / "pod-netns"  # a plain file stands in for a bind-mounted netns
    pod.write_text("")
    kernel = FakeRdmaKernel([FakeDevice(2, "mlx5_1", node_guid=GUID_B)])
    monkeypatch.setattr(rdma, "open_rdma_socket", kernel.open_socket)

    pod_fd = os.open(pod, os.O_RDONLY)
    try:
        with RdmaClient() as host:
            host.move_to_netns(2, pod_fd)
            assert host.list_devices() == []
    finally:
        os.close(pod_fd)
    assert kernel.moves == [FakeMove(2, pod_fd, str(pod), 0)]
    assert kernel.device("mlx5_1").netns == str(pod)

    host_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        with RdmaClient(netns_path=str(pod)) as in_pod:
            assert in_pod.find_by_name("mlx5_1") == RdmaDevice(2, "mlx5_1", GUID_B)
            in_pod.move_to_netns(2, host_fd)
    finally:
        os.close(host_fd)
    assert kernel.device("mlx5_1").netns == fake_rdma.HOST
    assert [m.target for m in kernel.moves] == [str(pod), fake_rdma.HOST]


def test_fake_kernel_refuses_moves(tmp_path: Path) -> None:
    target = tmp_path / "ns"
    target.write_text("")
    fd = os.open(target, os.O_RDONLY)
    try:
        cases = [
            (FakeRdmaKernel([FakeDevice(1, "d")], refuse_moves_with=errno.EOPNOTSUPP), 1, errno.EOPNOTSUPP),
            (FakeRdmaKernel([FakeDevice(1, "d")], refuse_moves_with=errno.EPERM), 1, errno.EPERM),
            (FakeRdmaKernel([FakeDevice(1, "d")]), 5, errno.EINVAL),
            (FakeRdmaKernel([FakeDevice(1, "d")], mode="shared"), 1, errno.EOPNOTSUPP),
            (FakeRdmaKernel([FakeDevice(1, "d", movable=False)]), 1, errno.EOPNOTSUPP),
        ]
        for kernel, index, err in cases:
            with pytest.raises(NetlinkError) as info:
                kernel.client().move_to_netns(index, fd)
            assert info.value.errno == err
            assert kernel.moves == [FakeMove(index, fd, str(target), err)]
            assert all(dev.netns == fake_rdma.HOST for dev in kernel.devices)
    finally:
        os.close(fd)


def test_fake_kernel_refusal_message_reaches_the_error(tmp_path: Path) -> None:
    kernel = FakeRdmaKernel([FakeDevice(1, "d")], refuse_moves_with=errno.EBUSY, refuse_message="in use")
    (tmp_path / "ns").write_text("")
    fd = os.open(tmp_path / "ns", os.O_RDONLY)
    try:
        with pytest.raises(NetlinkError) as info:
            kernel.client().move_to_netns(1, fd)
    finally:
        os.close(fd)
    assert (info.value.errno, info.value.kernel_message) == (errno.EBUSY, "in use")


def test_fake_kernel_shared_mode_shows_every_device() -> None:
    kernel = FakeRdmaKernel([FakeDevice(1, "a"), FakeDevice(2, "b", netns="elsewhere")], mode="shared")
    with kernel.client() as client:
        assert client.netns_mode() == "shared"
        assert [d.name for d in client.list_devices()] == ["a", "b"]
    exclusive = FakeRdmaKernel([FakeDevice(1, "a"), FakeDevice(2, "b", netns="elsewhere")])
    assert [d.name for d in exclusive.client().list_devices()] == ["a"]


def test_fake_kernel_missing_netns_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = FakeRdmaKernel()
    monkeypatch.setattr(rdma, "open_rdma_socket", kernel.open_socket)
    with pytest.raises(NetlinkError) as info:
        RdmaClient(netns_path=str(tmp_path / "gone"))
    assert info.value.errno == errno.ENOENT


def test_fake_kernel_port_dump_needs_a_device_and_skips_a_vanished_one() -> None:
    kernel = FakeRdmaKernel([FakeDevice(1, "mlx5_0", netdev_index=4, netdev_name="ens1f0")])
    sock = kernel.socket()
    with pytest.raises(NetlinkError) as err:
        RdmaClient(sock=sock).ports_of(9)
    assert err.value.errno == errno.EINVAL
    sock.send(encode_port_get_dump(77))  # as nldev_port_get_dumpit: no DEV_INDEX, EINVAL
    assert struct.unpack_from("=i", sock.recv(4096), 16)[0] == -errno.EINVAL

    class Vanishing(FakeRdmaKernel):
        def handle(self, request: bytes, netns: str) -> list[bytes]:
            replies = super().handle(request, netns)
            if struct.unpack_from("=H", request, 4)[0] == 0x1401:
                self.devices = self.devices[1:]  # unregistered right after the device list
            return replies

    vanishing = Vanishing([FakeDevice(1, "rxe0"), FakeDevice(2, "rxe1", netdev_index=5, netdev_name="eth1")])
    with vanishing.client() as client:
        assert client.list_ports() == [RdmaPort(2, "rxe1", 1, 5, "eth1")]
