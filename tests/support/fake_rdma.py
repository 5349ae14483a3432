"""A fake RDMA netlink kernel, plugged in at the socket boundary of ``rdma_cni.kernel.rdma``.

The fake parses requests and builds replies with ``struct`` alone, never with
the client's own encoder or decoder, so a wrong layout in either shows up as a
test failure instead of cancelling out.

Typical use in a data-path test::

    kernel = FakeRdmaKernel(
        [FakeDevice(3, "mlx5_3", node_guid=0x0C42A1030065F5C8, netdev_index=7, netdev_name="ens1f0v1")],
        mode="exclusive",
    )
    monkeypatch.setattr(rdma, "open_rdma_socket", kernel.open_socket)
    ...  # code under test calls RdmaClient() / RdmaClient(netns_path=...)
    assert kernel.moves == [FakeMove(3, fd, target=str(pod_netns), error=0)]
    assert kernel.device("mlx5_3").netns == str(pod_netns)

Network namespaces are identified like the kernel does, by the inode of the
namespace file: a socket opened with ``netns_path`` lives in the namespace
that path names, and a move's ``NET_NS_FD`` is resolved with ``fstat``. Each
namespace gets a label: :data:`HOST` for the test process's own, otherwise
the path it was first seen under (so plain files can stand in for pod netns
files). In exclusive mode a socket sees only the devices of its namespace; in
shared mode it sees all and moves are refused, as on a real kernel.
"""

from __future__ import annotations

import errno
import os
import struct
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rdma_cni.kernel.rdma import RdmaClient

HOST = "host"
FAKE_PORT_ID = 0x4D2  # the netlink port id replies are addressed to

# Wire constants, spelled out here rather than imported from the client.
NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_ACK = 0x4
NLM_F_DUMP_INTR = 0x10
NLM_F_DUMP = 0x300
NLM_F_CAPPED = 0x100
NLM_F_ACK_TLVS = 0x200
NLMSG_ERROR = 2
NLMSG_DONE = 3

CMD_GET = 0x1401
CMD_SET = 0x1402
CMD_PORT_GET = 0x1405
CMD_SYS_GET = 0x1406

ATTR_PAD = 0
ATTR_DEV_INDEX = 1
ATTR_DEV_NAME = 2
ATTR_PORT_INDEX = 3
ATTR_CAP_FLAGS = 4  # u64, not used by the client
ATTR_FW_VERSION = 5  # string, not used by the client
ATTR_NODE_GUID = 6
ATTR_SYS_IMAGE_GUID = 7  # u64, not used by the client
ATTR_PORT_STATE = 12  # u8, not used by the client
ATTR_NDEV_INDEX = 50
ATTR_NDEV_NAME = 51
ATTR_NETNS_MODE = 66
ATTR_NET_NS_FD = 68
ATTR_COPY_ON_FORK = 93  # u8, not used by the client

_MODES = {"exclusive": 0, "shared": 1}


# --------------------------------------------------------------------------- byte builders


def pad4(data: bytes) -> bytes:
    """``data`` followed by zero bytes up to a multiple of 4."""
    return data + b"\0" * (-len(data) % 4)


def nla(nla_type: int, payload: bytes) -> bytes:
    """One attribute: nla_len (header + payload, unpadded), nla_type, payload, padding."""
    return pad4(struct.pack("=HH", 4 + len(payload), nla_type) + payload)


def nla_u8(nla_type: int, value: int) -> bytes:
    """A u8 attribute: nla_len 5 and three padding bytes."""
    return nla(nla_type, struct.pack("=B", value))


def nla_u32(nla_type: int, value: int) -> bytes:
    """A u32 attribute: 8 bytes."""
    return nla(nla_type, struct.pack("=I", value))


def nla_u64(nla_type: int, value: int) -> bytes:
    """A u64 attribute: 12 bytes (no alignment pad; see :func:`nla_u64_aligned`)."""
    return nla(nla_type, struct.pack("=Q", value))


def nla_str(nla_type: int, value: str) -> bytes:
    """A NUL-terminated string attribute."""
    return nla(nla_type, value.encode() + b"\0")


def nla_pad() -> bytes:
    """An empty pad attribute (type 0), as the kernel puts before unaligned u64s."""
    return struct.pack("=HH", 4, ATTR_PAD)


def nla_u64_aligned(offset_in_msg: int, nla_type: int, value: int) -> bytes:
    """A u64 attribute preceded by a pad attribute when its payload would be unaligned.

    Mirrors the kernel's ``nla_put_64bit``: ``offset_in_msg`` is where the
    attribute would start, counted from the start of the netlink message.
    """
    pad = nla_pad() if (offset_in_msg + 4) % 8 else b""
    return pad + nla_u64(nla_type, value)


def nlmsg(msg_type: int, flags: int, seq: int, payload: bytes = b"", pid: int = FAKE_PORT_ID) -> bytes:
    """One netlink message: a 16-byte header (length includes it) and the padded payload."""
    payload = pad4(payload)
    return struct.pack("=IHHII", 16 + len(payload), msg_type, flags, seq, pid) + payload


def nlmsg_ack(request: bytes, pid: int = FAKE_PORT_ID) -> bytes:
    """The ACK (NLMSG_ERROR, error 0) for ``request``: echoes only its header, flagged NLM_F_CAPPED."""
    seq = struct.unpack_from("=I", request, 8)[0]
    return nlmsg(NLMSG_ERROR, NLM_F_CAPPED, seq, struct.pack("=i", 0) + request[:16], pid)


def nlmsg_error(request: bytes, err: int, message: str | None = None, pid: int = FAKE_PORT_ID) -> bytes:
    """An error reply for ``request``: ``-err``, the whole request echoed, and an ext-ack text if given."""
    seq = struct.unpack_from("=I", request, 8)[0]
    payload = struct.pack("=i", -err) + pad4(request)
    flags = 0
    if message is not None:
        flags |= NLM_F_ACK_TLVS
        payload += nla(1, message.encode() + b"\0")  # NLMSGERR_ATTR_MSG
    return nlmsg(NLMSG_ERROR, flags, seq, payload, pid)


def nlmsg_done(seq: int, err: int = 0, flags: int = NLM_F_MULTI, pid: int = FAKE_PORT_ID) -> bytes:
    """The end of a dump: NLMSG_DONE carrying ``-err`` (0 for success)."""
    return nlmsg(NLMSG_DONE, flags, seq, struct.pack("=i", -err), pid)


# --------------------------------------------------------------------------- model


@dataclass
class FakeDevice:
    """An RDMA device with one port, optionally backed by a netdev."""

    index: int
    name: str
    node_guid: int | None = None
    port_index: int = 1
    netdev_index: int | None = None
    netdev_name: str | None = None
    netns: str = HOST
    movable: bool = True  # False: a driver without netns support (EOPNOTSUPP)
    # Where the port's netdev lives when not with the device (a soft device in shared mode).
    netdev_netns: str | None = None


@dataclass(frozen=True)
class FakeMove:
    """One move request the fake kernel received (``error`` 0 when it was done)."""

    dev_index: int
    netns_fd: int
    target: str
    error: int = 0


class FakeRdmaSocket:
    """One fake nldev socket, living in the namespace labelled ``netns``."""

    def __init__(self, kernel: FakeRdmaKernel, netns: str) -> None:
        self.kernel = kernel
        self.netns = netns
        self.sent: list[bytes] = []
        self.pending: deque[bytes] = deque()
        self.closed = False

    def queue(self, data: bytes) -> None:
        """Queue raw bytes for the next ``recv`` (e.g. a stale reply)."""
        self.pending.append(data)

    def send(self, data: bytes) -> int:
        """Take one request; its replies are queued for ``recv``."""
        if self.closed:
            raise OSError(errno.EBADF, "fake RDMA socket is closed")
        data = bytes(data)
        self.sent.append(data)
        self.pending.extend(self.kernel.handle(data, self.netns))
        return len(data)

    def recv(self, bufsize: int) -> bytes:
        """The next queued datagram, truncated to ``bufsize`` like a real datagram socket."""
        if self.closed:
            raise OSError(errno.EBADF, "fake RDMA socket is closed")
        if not self.pending:
            # A real socket would block until its timeout.
            raise TimeoutError("the fake RDMA kernel has nothing to send")
        return self.pending.popleft()[:bufsize]

    def close(self) -> None:
        """Mark the socket closed."""
        self.closed = True


class FakeRdmaKernel:
    """Simulates the nldev commands the plugin uses: GET, PORT_GET, SYS_GET and SET (move).

    ``refuse_moves_with`` makes every move fail with that errno (and
    ``refuse_message`` adds an extended-ack text). ``dump_batch`` is how many
    records go into one datagram; NLMSG_DONE comes in a datagram of its own.
    """

    def __init__(
        self,
        devices: Iterable[FakeDevice] = (),
        mode: str = "exclusive",
        *,
        refuse_moves_with: int | None = None,
        refuse_message: str | None = None,
        dump_batch: int = 2,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {sorted(_MODES)}")
        self.devices = list(devices)
        self.mode = mode
        self.refuse_moves_with = refuse_moves_with
        self.refuse_message = refuse_message
        self.dump_batch = dump_batch
        self.moves: list[FakeMove] = []
        self.sockets: list[FakeRdmaSocket] = []
        own = os.stat("/proc/thread-self/ns/net")
        self._labels: dict[tuple[int, int], str] = {(own.st_dev, own.st_ino): HOST}

    # ------------------------------------------------------------------ test API

    def device(self, name: str) -> FakeDevice:
        """The device called ``name`` (KeyError if none)."""
        for dev in self.devices:
            if dev.name == name:
                return dev
        raise KeyError(name)

    def socket(self, netns: str = HOST) -> FakeRdmaSocket:
        """A new socket in the namespace labelled ``netns``."""
        sock = FakeRdmaSocket(self, netns)
        self.sockets.append(sock)
        return sock

    def open_socket(self, netns_path: str | None = None, timeout: float | None = None) -> FakeRdmaSocket:
        """Drop-in replacement for ``rdma_cni.kernel.rdma.open_rdma_socket``."""
        if netns_path is None:
            return self.socket(HOST)
        try:
            return self.socket(self.netns_label(netns_path))
        except OSError as exc:
            from rdma_cni.kernel.nlsock import NetlinkError

            raise NetlinkError(exc.errno or errno.EIO, f"open network namespace {netns_path}") from exc

    def client(self, netns_path: str | None = None) -> RdmaClient:
        """An ``RdmaClient`` talking to this fake."""
        from rdma_cni.kernel.rdma import RdmaClient

        return RdmaClient(sock=self.open_socket(netns_path))

    def netns_label(self, path: str) -> str:
        """The label of the namespace (or stand-in file) at ``path``; OSError if it is missing."""
        st = os.stat(path)
        return self._labels.setdefault((st.st_dev, st.st_ino), str(path))

    def visible(self, netns: str) -> list[FakeDevice]:
        """The devices a socket in ``netns`` sees."""
        if self.mode == "shared":
            return list(self.devices)
        return [dev for dev in self.devices if dev.netns == netns]

    # ------------------------------------------------------------------ kernel side

    def handle(self, request: bytes, netns: str) -> list[bytes]:
        """The datagrams the kernel would send back for one request."""
        length, msg_type, flags, seq, _pid = struct.unpack_from("=IHHII", request)
        if length != len(request) or not flags & NLM_F_REQUEST:
            return [nlmsg_error(request, errno.EINVAL)]
        attrs = _parse_attrs(request[16:length])
        if flags & NLM_F_DUMP == NLM_F_DUMP:
            if msg_type == CMD_GET:
                return self._dump(seq, [self._device_record(dev) for dev in self.visible(netns)])
            if msg_type == CMD_PORT_GET:
                # As nldev_port_get_dumpit: the ports of one visible device, EINVAL otherwise.
                if ATTR_DEV_INDEX not in attrs:
                    return [nlmsg_error(request, errno.EINVAL)]
                dev_index = struct.unpack("=I", attrs[ATTR_DEV_INDEX][:4])[0]
                devs = [dev for dev in self.visible(netns) if dev.index == dev_index]
                if not devs:
                    return [nlmsg_error(request, errno.EINVAL)]
                return self._dump(seq, [self._port_record(dev, netns) for dev in devs])
            return [nlmsg_error(request, errno.EINVAL)]
        if msg_type == CMD_SYS_GET:
            body = nla_u8(ATTR_NETNS_MODE, _MODES[self.mode]) + nla_u8(ATTR_COPY_ON_FORK, 1)
            reply = nlmsg(CMD_SYS_GET, 0, seq, body)
            return [reply, nlmsg_ack(request)] if flags & NLM_F_ACK else [reply]
        if msg_type == CMD_SET:
            err = self._set(attrs, netns)
            if err:
                message = self.refuse_message if err == self.refuse_moves_with else None
                return [nlmsg_error(request, err, message)]
            return [nlmsg_ack(request)] if flags & NLM_F_ACK else []
        return [nlmsg_error(request, errno.EINVAL)]

    def _set(self, attrs: dict[int, bytes], netns: str) -> int:
        if ATTR_DEV_INDEX not in attrs or ATTR_NET_NS_FD not in attrs:
            return errno.EINVAL
        dev_index = struct.unpack("=I", attrs[ATTR_DEV_INDEX][:4])[0]
        fd = struct.unpack("=I", attrs[ATTR_NET_NS_FD][:4])[0]
        try:
            target = self._fd_label(fd)
        except OSError:
            self.moves.append(FakeMove(dev_index, fd, "?", errno.EBADF))
            return errno.EBADF
        dev = next((d for d in self.visible(netns) if d.index == dev_index), None)
        if self.refuse_moves_with is not None:
            err = self.refuse_moves_with
        elif dev is None:
            err = errno.EINVAL
        elif self.mode == "shared" or not dev.movable:
            err = errno.EOPNOTSUPP
        else:
            err = 0
            dev.netns = target
        self.moves.append(FakeMove(dev_index, fd, target, err))
        return err

    def _fd_label(self, fd: int) -> str:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        if key not in self._labels:
            self._labels[key] = os.readlink(f"/proc/self/fd/{fd}")
        return self._labels[key]

    def _dump(self, seq: int, records: list[tuple[int, bytes]]) -> list[bytes]:
        messages = [nlmsg(msg_type, NLM_F_MULTI, seq, body) for msg_type, body in records]
        batch = max(1, self.dump_batch)
        datagrams = [b"".join(messages[i : i + batch]) for i in range(0, len(messages), batch)]
        return [*datagrams, nlmsg_done(seq)]

    @staticmethod
    def _device_record(dev: FakeDevice) -> tuple[int, bytes]:
        body = nla_u32(ATTR_DEV_INDEX, dev.index) + nla_str(ATTR_DEV_NAME, dev.name)
        body += nla_u32(ATTR_PORT_INDEX, 1)  # in a GET reply: the number of ports
        body += nla_u64_aligned(16 + len(body), ATTR_CAP_FLAGS, 0x1)
        body += nla_str(ATTR_FW_VERSION, "28.39.1002")
        if dev.node_guid is not None:
            body += nla_u64_aligned(16 + len(body), ATTR_NODE_GUID, dev.node_guid)
        body += nla_u64_aligned(16 + len(body), ATTR_SYS_IMAGE_GUID, dev.node_guid or 0)
        return CMD_GET, body

    @staticmethod
    def _port_record(dev: FakeDevice, netns: str) -> tuple[int, bytes]:
        body = nla_u32(ATTR_DEV_INDEX, dev.index) + nla_str(ATTR_DEV_NAME, dev.name)
        body += nla_u32(ATTR_PORT_INDEX, dev.port_index)
        body += nla_u8(ATTR_PORT_STATE, 4)
        # As fill_port_info: the netdev only when it lives in the socket's namespace.
        if (dev.netdev_netns or dev.netns) == netns:
            if dev.netdev_index is not None:
                body += nla_u32(ATTR_NDEV_INDEX, dev.netdev_index)
            if dev.netdev_name is not None:
                body += nla_str(ATTR_NDEV_NAME, dev.netdev_name)
        return CMD_PORT_GET, body


def _parse_attrs(data: bytes) -> dict[int, bytes]:
    attrs: dict[int, bytes] = {}
    offset = 0
    while offset + 4 <= len(data):
        nla_len, nla_type = struct.unpack_from("=HH", data, offset)
        if nla_len < 4:
            break
        attrs[nla_type & 0x3FFF] = data[offset + 4 : offset + nla_len]
        offset += (nla_len + 3) & ~3
    return attrs
