"""Client for the kernel's RDMA netlink device interface (NETLINK_RDMA, client "nldev").

The plugin needs four things from the RDMA core: the list of RDMA devices, the
port-to-netdev mapping (to find the RDMA device behind a VF netdev), the
system's netns mode (``exclusive`` or ``shared``), and moving a device into
another network namespace. All of them are nldev commands; the wire format is
a bare 16-byte ``nlmsghdr`` followed by netlink attributes (there is no family
header as in generic netlink).

Design choices:

* Messages are described with pyroute2's own ``nlmsg`` class (an ``nla_map``
  of ``(number, name, type)`` triples), which does the attribute encoding and
  decoding. Framing, sequence matching, ``NLMSG_ERROR``/``NLMSG_DONE``, dumps
  flagged NLM_F_DUMP_INTR, timeouts and extended-ACK text are the shared
  transport's (:class:`rdma_cni.kernel.nlsock.NlSocket`); errors are its
  :class:`~rdma_cni.kernel.nlsock.NetlinkError`, explained for RDMA here.
* The socket is a plain ``socket.socket(AF_NETLINK, SOCK_RAW, 20)``, not
  pyroute2's ``NetlinkSocket``. In pyroute2 0.9 that class is a synchronous
  wrapper around an asyncio event loop; its ``netns=`` option forks a helper
  process per socket and by default *creates* a missing namespace (wrong for
  DEL, where a vanished pod netns must stay vanished); and its ``Marshal``
  parser loops forever when asked to skip replies with a foreign sequence
  number. A plain socket also makes the test seam trivial: anything with
  ``send``/``recv``/``close``.
* pyroute2 is imported on the first encode or decode, through
  :func:`rdma_cni.kernel.nlsock.pyroute2_module`: a plain ``import pyroute2.netlink``
  runs the package ``__init__``, which imports the whole library (~130 ms).

Network namespaces: the kernel binds an nldev socket to the netns of the task
that creates it, and only shows and accepts devices of that netns. To move a
device out of a pod (on DEL), the socket must be opened inside the pod's
netns: ``RdmaClient(netns_path=...)`` does that by switching the calling
thread into the namespace just for the ``socket()`` call (with
:func:`rdma_cni.kernel.netns.in_netns`, the one place namespaces are switched).
A caller holding the namespace open passes its fd, so the path cannot be
swapped for another namespace between opening it and using it.
"""

from __future__ import annotations

import errno
import functools
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rdma_cni.kernel.nlsock import (
    DEFAULT_TIMEOUT,
    NLM_F_ACK,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    Frame,
    NetlinkError,
    NetlinkTransport,
    NlSocket,
    new_socket,
    split_frames,
)

if TYPE_CHECKING:
    from pyroute2.netlink import nlmsg

__all__ = [
    "DEFAULT_TIMEOUT",
    "NETLINK_RDMA",
    "NetlinkError",
    "NetlinkMessage",
    "NetlinkTransport",
    "RdmaClient",
    "RdmaDevice",
    "RdmaPort",
    "RdmaUnsupported",
    "decode_messages",
    "encode_get_devices",
    "encode_move",
    "encode_port_get_dump",
    "encode_sys_get",
    "open_rdma_socket",
]

NETLINK_RDMA = 20
RDMA_NL_NLDEV = 5


def _nldev_type(op: int) -> int:
    return (RDMA_NL_NLDEV << 10) + op


RDMA_NLDEV_CMD_GET = _nldev_type(1)
RDMA_NLDEV_CMD_SET = _nldev_type(2)
RDMA_NLDEV_CMD_PORT_GET = _nldev_type(5)
RDMA_NLDEV_CMD_SYS_GET = _nldev_type(6)

RDMA_NLDEV_ATTR_PAD = 0
RDMA_NLDEV_ATTR_DEV_INDEX = 1
RDMA_NLDEV_ATTR_DEV_NAME = 2
RDMA_NLDEV_ATTR_PORT_INDEX = 3
RDMA_NLDEV_ATTR_NODE_GUID = 6
RDMA_NLDEV_ATTR_NDEV_INDEX = 50
RDMA_NLDEV_ATTR_NDEV_NAME = 51
RDMA_NLDEV_SYS_ATTR_NETNS_MODE = 66
RDMA_NLDEV_NET_NS_FD = 68

# (number, pyroute2 name, pyroute2 type). Kernel attribute names without the
# common prefix; pad attributes decode to None and are dropped.
_NLA_MAP: tuple[tuple[int, str, str], ...] = (
    (RDMA_NLDEV_ATTR_PAD, "ATTR_PAD", "none"),
    (RDMA_NLDEV_ATTR_DEV_INDEX, "ATTR_DEV_INDEX", "uint32"),
    (RDMA_NLDEV_ATTR_DEV_NAME, "ATTR_DEV_NAME", "asciiz"),
    (RDMA_NLDEV_ATTR_PORT_INDEX, "ATTR_PORT_INDEX", "uint32"),
    (RDMA_NLDEV_ATTR_NODE_GUID, "ATTR_NODE_GUID", "uint64"),
    (RDMA_NLDEV_ATTR_NDEV_INDEX, "ATTR_NDEV_INDEX", "uint32"),
    (RDMA_NLDEV_ATTR_NDEV_NAME, "ATTR_NDEV_NAME", "asciiz"),
    (RDMA_NLDEV_SYS_ATTR_NETNS_MODE, "SYS_ATTR_NETNS_MODE", "uint8"),
    (RDMA_NLDEV_NET_NS_FD, "NET_NS_FD", "uint32"),
)
_NAME_TO_NUMBER = {name: number for number, name, _ in _NLA_MAP if number != RDMA_NLDEV_ATTR_PAD}
_NUMBER_TO_NAME = {number: name for name, number in _NAME_TO_NUMBER.items()}
_PY_TYPE = {
    number: (str if kind == "asciiz" else int)
    for number, _, kind in _NLA_MAP
    if number != RDMA_NLDEV_ATTR_PAD
}

_NETNS_MODES = {0: "exclusive", 1: "shared"}


# --------------------------------------------------------------------------- errors

_UNKNOWN_DEVICE = "unknown RDMA device, or it is not in the network namespace the request was sent from"
_EXPLANATIONS: dict[int, str] = {
    errno.EOPNOTSUPP: (
        "this RDMA device's driver cannot be moved between network namespaces, "
        "or the system is in shared netns mode"
    ),
    errno.EPERM: "permission denied: changing RDMA devices needs CAP_NET_ADMIN",
    errno.EACCES: "permission denied: changing RDMA devices needs CAP_NET_ADMIN",
    errno.EBUSY: "the RDMA device is busy (another change to it is in progress); try again",
    errno.EINVAL: _UNKNOWN_DEVICE,
    errno.ENODEV: _UNKNOWN_DEVICE,
    errno.EPROTONOSUPPORT: "the kernel has no RDMA netlink support (no RDMA stack loaded)",
    errno.EAFNOSUPPORT: "the kernel has no netlink support",
    errno.EBADF: "the target network namespace file descriptor is not open",
    errno.ETIMEDOUT: "the kernel did not answer in time",
    errno.EPROTO: "the kernel's reply could not be understood",
}


class RdmaUnsupported(NetlinkError):
    """The kernel has no RDMA netlink at all (socket creation failed).

    Raised for EPROTONOSUPPORT/EAFNOSUPPORT from ``socket()``: there is no RDMA
    stack on this node, which callers may treat as "nothing to do" rather
    than as a failure.
    """

    def __init__(self, errno_: int, op: str, *, reason: str | None = None) -> None:
        super().__init__(errno_, op, reason=reason or _EXPLANATIONS.get(errno_))


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class RdmaDevice:
    """An RDMA device as seen from the socket's network namespace."""

    index: int
    name: str
    node_guid: int | None


@dataclass(frozen=True)
class RdmaPort:
    """One port of an RDMA device and the netdev behind it.

    ``netdev_index``/``netdev_name`` are None when the port has no netdev, or
    when the netdev lives in a different network namespace than the socket
    (the kernel hides it then).
    """

    dev_index: int
    dev_name: str
    port_index: int
    netdev_index: int | None
    netdev_name: str | None


@dataclass
class NetlinkMessage:
    """One decoded netlink message.

    For nldev messages ``attrs`` maps attribute numbers (``RDMA_NLDEV_*``) to
    int or str values; pad and unknown attributes are left out. For
    ``NLMSG_ERROR`` and ``NLMSG_DONE``, ``error`` is the kernel's (zero or
    negative) error code and ``kernel_message`` the extended-ack text, if any.
    """

    type: int
    flags: int
    seq: int
    pid: int
    attrs: dict[int, int | str] = field(default_factory=dict)
    error: int | None = None
    kernel_message: str | None = None


# --------------------------------------------------------------------------- codec


@functools.cache
def _message_class() -> type[nlmsg]:
    # Built on first use so that importing this module does not import pyroute2,
    # and through pyroute2_module so that the package __init__ does not run.
    from rdma_cni.kernel.nlsock import pyroute2_module

    base: type[nlmsg] = pyroute2_module("pyroute2.netlink").nlmsg

    class NldevMessage(base):  # type: ignore[valid-type,misc]
        """An RDMA nldev netlink message: nlmsghdr + attributes, no family header."""

        __slots__ = ()
        nla_map = _NLA_MAP

    NldevMessage.__module__ = __name__
    NldevMessage.__qualname__ = "NldevMessage"
    return NldevMessage


def __getattr__(name: str) -> Any:
    # Exposes the pyroute2 message class as ``rdma.NldevMessage`` without
    # importing pyroute2 at module import time.
    if name == "NldevMessage":
        return _message_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _encode(msg_type: int, flags: int, seq: int, attrs: Iterable[tuple[int, int | str]] = ()) -> bytes:
    msg = _message_class()()
    msg["header"]["type"] = msg_type
    msg["header"]["flags"] = flags
    msg["header"]["sequence_number"] = seq
    msg["header"]["pid"] = 0
    msg["attrs"] = [(_NUMBER_TO_NAME[number], value) for number, value in attrs]
    msg.encode()
    return bytes(msg.data)


def encode_get_devices(seq: int) -> bytes:
    """The device-list dump request (RDMA_NLDEV_CMD_GET, flags 0x305): 16 bytes."""
    return _encode(RDMA_NLDEV_CMD_GET, NLM_F_REQUEST | NLM_F_ACK | NLM_F_DUMP, seq)


def encode_port_get_dump(seq: int, dev_index: int | None = None) -> bytes:
    """The port dump request (RDMA_NLDEV_CMD_PORT_GET, flags 0x305) for device ``dev_index``.

    The kernel answers EINVAL to a port dump without DEV_INDEX
    (``nldev_port_get_dumpit``): 24 bytes with it, 16 without.
    """
    attrs = [] if dev_index is None else [(RDMA_NLDEV_ATTR_DEV_INDEX, dev_index)]
    return _encode(RDMA_NLDEV_CMD_PORT_GET, NLM_F_REQUEST | NLM_F_ACK | NLM_F_DUMP, seq, attrs)


def encode_sys_get(seq: int) -> bytes:
    """The system attributes request (RDMA_NLDEV_CMD_SYS_GET, flags 0x5): 16 bytes."""
    return _encode(RDMA_NLDEV_CMD_SYS_GET, NLM_F_REQUEST | NLM_F_ACK, seq)


def encode_move(seq: int, dev_index: int, netns_fd: int) -> bytes:
    """The request moving device ``dev_index`` into the netns open as ``netns_fd``: 32 bytes."""
    return _encode(
        RDMA_NLDEV_CMD_SET,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        [(RDMA_NLDEV_ATTR_DEV_INDEX, dev_index), (RDMA_NLDEV_NET_NS_FD, netns_fd)],
    )


def _protocol_error(what: str) -> NetlinkError:
    return NetlinkError(errno.EPROTO, "decode RDMA netlink reply", reason=f"malformed reply: {what}")


def _decode_nldev(data: bytes, offset: int, length: int) -> dict[int, int | str]:
    msg = _message_class()(bytearray(data[offset : offset + length]))
    try:
        msg.decode()
        slots = [(slot.name, slot.value) for slot in msg["attrs"]]
    except Exception as exc:  # pyroute2 raises its own exception types plus struct.error
        raise _protocol_error(f"attributes of message type {msg['header'].get('type', '?'):#x}") from exc
    attrs: dict[int, int | str] = {}
    for name, value in slots:
        number = _NAME_TO_NUMBER.get(name)
        if number is None:
            continue  # pad, or an attribute this client does not use
        if isinstance(value, bytes) and _PY_TYPE[number] is str:
            value = value.decode("utf-8", "replace")
        # pyroute2 hands back raw bytes for an attribute too short for its
        # type; treat it as absent rather than guessing.
        if isinstance(value, _PY_TYPE[number]):
            attrs[number] = value
    return attrs


def decode_messages(data: bytes) -> list[NetlinkMessage]:
    """Split one ``recv()`` buffer into netlink messages and decode each.

    nldev messages (client 5) get their attributes decoded; NLMSG_ERROR and
    NLMSG_DONE get their error code and extended-ack text; anything else is
    returned with its header only. Raises :class:`NetlinkError` (EPROTO)
    on a malformed buffer.
    """
    messages = []
    for frame in split_frames(data):
        msg = NetlinkMessage(frame.type, frame.flags, frame.seq, frame.pid)
        if frame.type in (NLMSG_ERROR, NLMSG_DONE):
            msg.error, msg.kernel_message = frame.error, frame.kernel_message
        elif frame.type >> 10 == RDMA_NL_NLDEV:
            msg.attrs = _decode_nldev(frame.data, 0, len(frame.data))
        messages.append(msg)
    return messages


# --------------------------------------------------------------------------- transport


def _create_socket() -> socket.socket:
    op = "open RDMA netlink socket"
    try:
        return new_socket(NETLINK_RDMA)
    except OSError as exc:
        code = exc.errno or errno.EIO
        if code == errno.EPROTONOSUPPORT:
            raise RdmaUnsupported(code, op) from exc
        if code == errno.EAFNOSUPPORT:
            raise RdmaUnsupported(code, op, reason="the kernel has no netlink support") from exc
        raise NetlinkError(code, op, reason=_EXPLANATIONS.get(code)) from exc


def _create_socket_in(netns_path: str | int) -> socket.socket:
    from rdma_cni.kernel.netns import in_netns

    try:
        with in_netns(netns_path):
            return _create_socket()
    except NetlinkError:
        raise
    except OSError as exc:
        # Raised by in_netns itself: opening the path or entering the namespace.
        code = exc.errno or errno.EIO
        reason = {
            errno.ENOENT: "the network namespace does not exist",
            errno.EINVAL: "the path is not a network namespace",
            errno.EPERM: "permission denied: entering a network namespace needs CAP_SYS_ADMIN",
        }.get(code)
        raise NetlinkError(code, f"enter network namespace {netns_path}", reason=reason) from exc


def open_rdma_socket(
    netns_path: str | int | None = None, timeout: float | None = DEFAULT_TIMEOUT
) -> NetlinkTransport:
    """Open an RDMA netlink socket, in the network namespace ``netns_path`` (a path or an fd) if given.

    With ``netns_path``, only the calling thread is switched into that
    namespace, and only for the ``socket()`` call; it is switched back before
    this returns or raises. The socket stays bound to that namespace for its
    lifetime. Raises :class:`RdmaUnsupported` when the kernel has no RDMA
    netlink, :class:`NetlinkError` when the namespace cannot be entered.

    :class:`RdmaClient` looks this function up at call time, so tests can
    replace it (``monkeypatch.setattr(rdma, "open_rdma_socket", ...)``).
    """
    sock = _create_socket() if netns_path is None else _create_socket_in(netns_path)
    sock.settimeout(timeout)
    return sock


# --------------------------------------------------------------------------- client


class RdmaClient:
    """A synchronous nldev client over one netlink socket.

    ``RdmaClient()`` opens a socket in the calling thread's netns;
    ``RdmaClient(netns_path)`` opens it in that netns (see
    :func:`open_rdma_socket`); ``RdmaClient(sock=...)`` uses the given
    transport, which tests use to script the kernel. Sequence numbers start
    at 1 and grow by one per request. Use as a context manager, or call
    :meth:`close`.
    """

    def __init__(
        self,
        netns_path: str | int | None = None,
        *,
        sock: NetlinkTransport | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> None:
        if sock is not None and netns_path is not None:
            raise ValueError("pass either netns_path or sock, not both")
        transport = sock if sock is not None else open_rdma_socket(netns_path, timeout)
        self._nl = NlSocket(NETLINK_RDMA, sock=transport, reasons=_EXPLANATIONS)
        self._closed = False

    def __enter__(self) -> RdmaClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket (idempotent)."""
        self._closed = True
        self._nl.close()

    # ------------------------------------------------------------------ requests

    def list_devices(self) -> list[RdmaDevice]:
        """All RDMA devices visible in the socket's network namespace."""
        devices = []
        for msg in self._dump("list RDMA devices", encode_get_devices):
            index, name = msg.attrs.get(RDMA_NLDEV_ATTR_DEV_INDEX), msg.attrs.get(RDMA_NLDEV_ATTR_DEV_NAME)
            if not isinstance(index, int) or not isinstance(name, str):
                continue  # not a device record; nothing sensible to report
            guid = msg.attrs.get(RDMA_NLDEV_ATTR_NODE_GUID)
            devices.append(RdmaDevice(index, name, guid if isinstance(guid, int) else None))
        return devices

    def list_ports(self) -> list[RdmaPort]:
        """All ports of the visible RDMA devices, with their netdevs where visible.

        One port dump per device (the kernel dumps the ports of one device
        only); a device gone between the two requests is skipped.
        """
        ports = []
        for dev in self.list_devices():
            try:
                ports.extend(self.ports_of(dev.index))
            except NetlinkError as exc:
                # EINVAL/ENODEV: unregistered or moved out of this namespace in between.
                if exc.errno not in (errno.EINVAL, errno.ENODEV):
                    raise
        return ports

    def ports_of(self, dev_index: int) -> list[RdmaPort]:
        """The ports of device ``dev_index``; each port's netdev only when it is in the socket's netns."""
        ports = []
        for msg in self._dump(
            f"list the ports of RDMA device {dev_index}", lambda seq: encode_port_get_dump(seq, dev_index)
        ):
            attrs = msg.attrs
            index, name = attrs.get(RDMA_NLDEV_ATTR_DEV_INDEX), attrs.get(RDMA_NLDEV_ATTR_DEV_NAME)
            port = attrs.get(RDMA_NLDEV_ATTR_PORT_INDEX)
            if not isinstance(index, int) or not isinstance(name, str) or not isinstance(port, int):
                continue
            ndev_index, ndev_name = (
                attrs.get(RDMA_NLDEV_ATTR_NDEV_INDEX),
                attrs.get(RDMA_NLDEV_ATTR_NDEV_NAME),
            )
            ports.append(
                RdmaPort(
                    index,
                    name,
                    port,
                    ndev_index if isinstance(ndev_index, int) else None,
                    ndev_name if isinstance(ndev_name, str) else None,
                )
            )
        return ports

    def find_by_name(self, name: str) -> RdmaDevice | None:
        """The visible RDMA device called ``name``, or None."""
        return next((dev for dev in self.list_devices() if dev.name == name), None)

    def netns_mode(self) -> str:
        """The RDMA subsystem's netns mode: ``"exclusive"`` or ``"shared"``."""
        op = "read RDMA netns mode"
        for msg in self._exchange(op, encode_sys_get):
            if RDMA_NLDEV_SYS_ATTR_NETNS_MODE in msg.attrs:
                value = msg.attrs[RDMA_NLDEV_SYS_ATTR_NETNS_MODE]
                mode = _NETNS_MODES.get(value) if isinstance(value, int) else None
                if mode is None:
                    raise NetlinkError(errno.EPROTO, op, reason=f"unknown netns mode {value!r}")
                return mode
        raise NetlinkError(errno.EPROTO, op, reason="the kernel's reply has no netns mode attribute")

    def move_to_netns(self, dev_index: int, netns_fd: int) -> None:
        """Move RDMA device ``dev_index`` into the network namespace open as ``netns_fd``.

        The fd is resolved by the kernel in this process; the device must be in
        the socket's namespace. Returns once the kernel has acknowledged the
        move; raises :class:`NetlinkError` if it refused.
        """
        self._exchange(
            f"move RDMA device {dev_index} to netns fd {netns_fd}",
            lambda seq: encode_move(seq, dev_index, netns_fd),
        )

    # ------------------------------------------------------------------ plumbing

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("RdmaClient is closed")

    def _exchange(self, op: str, encode: Callable[[int], bytes]) -> list[NetlinkMessage]:
        self._check_open()
        seq = self._nl.next_seq()
        return [_nldev_message(frame) for frame in self._nl.exchange(op, encode(seq), seq)]

    def _dump(self, op: str, encode: Callable[[int], bytes]) -> list[NetlinkMessage]:
        self._check_open()
        return [_nldev_message(frame) for frame in self._nl.dump(op, encode)]


def _nldev_message(frame: Frame) -> NetlinkMessage:
    attrs = _decode_nldev(frame.data, 0, len(frame.data)) if frame.type >> 10 == RDMA_NL_NLDEV else {}
    return NetlinkMessage(frame.type, frame.flags, frame.seq, frame.pid, attrs)
