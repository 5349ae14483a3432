"""A small synchronous netlink transport, bound to a chosen network namespace.

Why not pyroute2's IPRoute: importing the ``pyroute2`` package costs ~200 ms
(its ``__init__`` imports every protocol) and IPRoute pulls in asyncio (~95 ms),
while kubelet runs this binary for every pod. pyroute2's message classes
(``ifinfmsg``, ``ifaddrmsg``, ``rtmsg``, ``nlmsg``) do the encoding and
decoding; this module sends them over a plain AF_NETLINK socket and collects
the replies. :func:`pyroute2_module` imports a pyroute2 submodule without
running the package ``__init__`` (a full import still works later, lazily).

This is the one netlink transport: rtnetlink (:mod:`rdma_cni.kernel.netlink`)
and RDMA netlink (:mod:`rdma_cni.kernel.rdma`) both send through
:class:`NlSocket`. Framing, sequence matching, NLMSG_ERROR / NLMSG_DONE /
NLMSG_OVERRUN, extended-ACK messages, dumps the kernel flags NLM_F_DUMP_INTR
(retried), and a receive timeout are handled here once; every failure is a
:class:`NetlinkError` carrying the errno and the kernel's own explanation.

A netlink socket answers for the network namespace it was created in, so
:class:`NlSocket` creates its socket inside the target namespace
(:func:`rdma_cni.kernel.netns.in_netns`, which switches only the calling
thread and only for the ``socket()`` call): cheaper than pyroute2's NetNS,
which forks a helper process.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import importlib.util
import os
import socket
import struct
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from rdma_cni.kernel.netns import in_netns

# Socket options (linux/netlink.h): extended ACKs carry the kernel's reason for an error.
SOL_NETLINK = 270
NETLINK_EXT_ACK = 11

# nlmsghdr flags.
NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_ACK = 0x4
NLM_F_DUMP_INTR = 0x10
NLM_F_DUMP = 0x300
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
# Flags that only appear on NLMSG_ERROR / NLMSG_DONE replies.
NLM_F_CAPPED = 0x100
NLM_F_ACK_TLVS = 0x200

NLMSG_NOOP = 1
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLMSG_OVERRUN = 4

NLMSGERR_ATTR_MSG = 1
NLA_TYPE_MASK = 0x3FFF  # strips NLA_F_NESTED / NLA_F_NET_BYTEORDER

HDR = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence number, port id
_NLATTR = struct.Struct("=HH")
_ERRNO = struct.Struct("=i")

# Large enough for any datagram the kernel sends (a PF's link with all its VFs
# included); a datagram longer than the buffer would be silently cut short.
RECV_BUFSIZE = 1 << 20
DEFAULT_TIMEOUT = 10.0
# Dumps flagged NLM_F_DUMP_INTR raced with a change; retry this often.
DUMP_ATTEMPTS = 3

_GENERIC_REASONS: dict[int, str] = {
    errno.ETIMEDOUT: "the kernel did not answer in time",
    errno.EPROTO: "the kernel's reply could not be understood",
}


class NetlinkError(OSError):
    """A netlink request failed: ``errno`` is the kernel's (or the failed system call's).

    ``op`` says what was being attempted (empty when the caller adds that
    itself), ``reason`` what the errno means in that context, and
    ``kernel_message`` the kernel's extended-ACK text when it sent one.
    ``strerror`` and ``str()`` are the message for users.
    """

    def __init__(
        self,
        errno_: int,
        op: str = "",
        *,
        reason: str | None = None,
        kernel_message: str | None = None,
    ) -> None:
        self.op = op
        self.reason = reason or os.strerror(errno_)
        self.kernel_message = kernel_message
        if op:
            text = f"{op}: {self.reason} [{errno.errorcode.get(errno_, str(errno_))}]"
            if kernel_message:
                text += f" (kernel: {kernel_message})"
        else:
            text = self.reason + (f" ({kernel_message})" if kernel_message else "")
        super().__init__(errno_, text)

    def __str__(self) -> str:
        return self.strerror or ""


@dataclass(frozen=True)
class Frame:
    """One netlink message of a reply: its header fields and its bytes (header included).

    For NLMSG_ERROR and NLMSG_DONE, ``error`` is the kernel's (zero or
    negative) code and ``kernel_message`` the extended-ACK text, if any.
    """

    type: int
    flags: int
    seq: int
    pid: int
    data: bytes
    error: int | None = None
    kernel_message: str | None = None


def _align4(n: int) -> int:
    return (n + 3) & ~3


def _malformed(what: str) -> NetlinkError:
    return NetlinkError(errno.EPROTO, "decode netlink reply", reason=f"malformed reply: {what}")


def ext_ack_message(data: bytes, start: int, end: int) -> str | None:
    """The NLMSGERR_ATTR_MSG text among the TLVs in ``data[start:end]``, or None."""
    offset = start
    while offset + _NLATTR.size <= end:
        nla_len, nla_type = _NLATTR.unpack_from(data, offset)
        if nla_len < _NLATTR.size or offset + nla_len > end:
            break
        if nla_type & NLA_TYPE_MASK == NLMSGERR_ATTR_MSG:
            raw = data[offset + _NLATTR.size : offset + nla_len]
            return raw.split(b"\0", 1)[0].decode("utf-8", "replace") or None
        offset += _align4(nla_len)
    return None


def _error_frame(data: bytes, offset: int, length: int, fields: tuple[int, int, int, int]) -> Frame:
    mtype, flags, seq, pid = fields
    end = offset + length
    chunk = data[offset:end]
    if length < HDR.size + _ERRNO.size:
        if mtype == NLMSG_DONE:  # some senders end a dump with a bare header
            return Frame(mtype, flags, seq, pid, chunk, error=0)
        raise _malformed("NLMSG_ERROR too short")
    (error,) = _ERRNO.unpack_from(data, offset + HDR.size)
    kernel_message = None
    if flags & NLM_F_ACK_TLVS:
        tlv_start = offset + HDR.size + _ERRNO.size
        if mtype == NLMSG_ERROR:
            # The TLVs follow the echoed request: its header only when the
            # kernel capped the echo, otherwise the whole request.
            if tlv_start + HDR.size > end:
                raise _malformed("NLMSG_ERROR without the echoed request header")
            (orig_len,) = struct.unpack_from("=I", data, tlv_start)
            tlv_start += HDR.size if flags & NLM_F_CAPPED else _align4(orig_len)
        kernel_message = ext_ack_message(data, tlv_start, end)
    return Frame(mtype, flags, seq, pid, chunk, error=error, kernel_message=kernel_message)


def split_frames(data: bytes) -> list[Frame]:
    """Split one ``recv()`` datagram into its netlink messages.

    Raises :class:`NetlinkError` (EPROTO) on a truncated or malformed datagram.
    """
    frames: list[Frame] = []
    offset = 0
    while offset < len(data):
        if len(data) - offset < HDR.size:
            raise _malformed(f"{len(data) - offset} trailing bytes")
        length, mtype, flags, seq, pid = HDR.unpack_from(data, offset)
        if length < HDR.size or offset + length > len(data):
            raise _malformed(f"message length {length} at offset {offset} of {len(data)}")
        if mtype in (NLMSG_ERROR, NLMSG_DONE):
            frames.append(_error_frame(data, offset, length, (mtype, flags, seq, pid)))
        else:
            frames.append(Frame(mtype, flags, seq, pid, data[offset : offset + length]))
        # The last message of a datagram may omit its alignment padding.
        offset = min(offset + _align4(length), len(data))
    return frames


class NetlinkTransport(Protocol):
    """What :class:`NlSocket` needs from a socket (tests pass a fake)."""

    def send(self, data: bytes, /) -> int: ...

    def recv(self, bufsize: int, /) -> bytes: ...

    def close(self) -> None: ...


def new_socket(protocol: int) -> socket.socket:
    """A netlink socket of ``protocol`` in the calling thread's namespace, asking for extended ACKs."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, protocol)
    # Best effort: asks the kernel to explain its errors; old kernels lack it.
    with contextlib.suppress(OSError):
        sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
    return sock


def pyroute2_module(name: str) -> ModuleType:
    """Import ``pyroute2.<...>`` without executing the heavy package ``__init__``."""
    if "pyroute2" not in sys.modules:
        spec = importlib.util.find_spec("pyroute2")
        if spec is None or spec.loader is None:
            raise ImportError("pyroute2 is not installed")
        package = importlib.util.module_from_spec(spec)
        loader = spec.loader

        def _full_init(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            # `from pyroute2 import config` asks for a submodule by attribute:
            # import just that one.
            if importlib.util.find_spec(f"pyroute2.{attr}") is not None:
                return importlib.import_module(f"pyroute2.{attr}")
            # Someone wants a top-level pyroute2 symbol: run the real __init__ now.
            del package.__getattr__
            loader.exec_module(package)
            return getattr(package, attr)

        package.__getattr__ = _full_init  # type: ignore[method-assign]
        sys.modules["pyroute2"] = package
    return importlib.import_module(name)


class NlSocket:
    """One netlink conversation: requests out, their replies collected and checked.

    ``NlSocket(protocol, netns)`` opens a socket of ``protocol`` in ``netns``
    (a path or an fd; None: the calling thread's namespace);
    ``NlSocket(protocol, sock=...)`` uses the given transport. ``reasons``
    maps errnos to what they mean for this protocol's requests, for the
    messages of :class:`NetlinkError`.
    """

    def __init__(
        self,
        protocol: int,
        netns: str | int | None = None,
        *,
        sock: NetlinkTransport | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        reasons: Mapping[int, str] | None = None,
    ) -> None:
        self._reasons = {**_GENERIC_REASONS, **(reasons or {})}
        if sock is None:
            if netns is None:
                created = new_socket(protocol)
            else:
                with in_netns(netns):
                    created = new_socket(protocol)
            created.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            created.settimeout(timeout)
            sock = created
        self._sock: NetlinkTransport | None = sock
        self._seq = 0  # the socket is this object's alone: no other sender shares its numbers

    def close(self) -> None:
        """Close the socket (idempotent)."""
        if self._sock is not None:
            sock, self._sock = self._sock, None
            sock.close()

    def __enter__(self) -> NlSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_seq(self) -> int:
        """A fresh sequence number for the next request."""
        self._seq = self._seq % 0xFFFFFFFF + 1
        return self._seq

    def error(
        self, code: int, op: str, *, reason: str | None = None, kernel_message: str | None = None
    ) -> NetlinkError:
        """A :class:`NetlinkError` for ``code``, explained with this socket's ``reasons``."""
        return NetlinkError(code, op, reason=reason or self._reasons.get(code), kernel_message=kernel_message)

    def request(self, msg: Any, msg_type: int, flags: int, reply_class: Any | None = None) -> list[Any]:
        """Send a pyroute2 message; return the decoded replies (empty for an ACK).

        A dump (NLM_F_DUMP) interrupted by a concurrent change is asked again.
        Raises :class:`NetlinkError` with the kernel's errno on NLMSG_ERROR.
        """

        def encode(seq: int) -> bytes:
            msg["header"]["type"] = msg_type
            msg["header"]["flags"] = flags
            msg["header"]["sequence_number"] = seq
            msg.encode()
            return bytes(msg.data)

        if flags & NLM_F_DUMP == NLM_F_DUMP:
            frames = self.dump("", encode)
        else:
            seq = self.next_seq()
            frames = self.exchange("", encode(seq), seq)
        decoder = reply_class or type(msg)
        replies = []
        for frame in frames:
            reply = decoder(frame.data)
            reply.decode()
            replies.append(reply)
        return replies

    def dump(self, op: str, encode: Callable[[int], bytes]) -> list[Frame]:
        """Send the dump request ``encode(seq)``; return its data messages.

        NLM_F_DUMP_INTR means the records changed while the kernel listed
        them: the whole dump is asked again, up to :data:`DUMP_ATTEMPTS` times.
        """
        for _ in range(DUMP_ATTEMPTS):
            seq = self.next_seq()
            frames = self.exchange(op, encode(seq), seq)
            if not any(frame.flags & NLM_F_DUMP_INTR for frame in frames):
                return [frame for frame in frames if frame.type != NLMSG_DONE]
        raise self.error(
            errno.EAGAIN, op, reason=f"the records kept changing during {DUMP_ATTEMPTS} attempts"
        )

    def stream(self, op: str, request: bytes, seq: int) -> Iterator[Frame]:
        """Send the dump request ``request`` and yield its messages one by one as they arrive.

        The last one yielded is the dump's NLMSG_DONE (its flags may carry
        NLM_F_DUMP_INTR). The kernel fills the next datagram only when this
        reads, so a caller that stops early (a bounded search) costs no more
        than what it read; it must then close the socket, since the rest of
        the dump would greet the next request. No retry here: the caller
        decides what an interrupted dump means.
        """
        self._send(op, request)
        for frame in self._recv(op, seq):
            yield frame
            if frame.type in (NLMSG_DONE, NLMSG_ERROR):
                return

    def exchange(self, op: str, request: bytes, seq: int) -> list[Frame]:
        """Send ``request`` (whose sequence number is ``seq``) and collect its replies.

        Collects up to NLMSG_DONE for a dump, up to the ACK when the request
        asked for one, else up to the first reply that is not multi-part.
        Returns the data messages (and a dump's DONE, whose flags may carry
        NLM_F_DUMP_INTR). Replies to other sequence numbers are leftovers of
        earlier requests and are skipped.
        """
        self._send(op, request)
        (req_flags,) = struct.unpack_from("=H", request, 6)
        dump = req_flags & NLM_F_DUMP == NLM_F_DUMP
        acked = bool(req_flags & NLM_F_ACK)
        replies: list[Frame] = []
        for frame in self._recv(op, seq):
            if frame.type == NLMSG_ERROR:  # the ACK: an error was raised by _recv
                return replies
            if frame.type == NLMSG_DONE:
                if dump:
                    replies.append(frame)  # its flags may carry NLM_F_DUMP_INTR
                    return replies
                continue
            replies.append(frame)
            if not dump and not acked and not frame.flags & NLM_F_MULTI:
                return replies
        raise AssertionError("unreachable: _recv never ends by itself")  # pragma: no cover

    def _send(self, op: str, request: bytes) -> None:
        if self._sock is None:
            raise ValueError("the netlink socket is closed")
        try:
            self._sock.send(request)
        except OSError as exc:
            raise self._os_error(op, exc) from exc

    def _recv(self, op: str, seq: int) -> Iterator[Frame]:
        """The replies to ``seq`` as they arrive, checked: without end, the caller stops reading.

        Skips leftovers of earlier requests (other sequence numbers) and
        NLMSG_NOOP; raises :class:`NetlinkError` for an NLMSG_ERROR or
        NLMSG_DONE carrying an error, an NLMSG_OVERRUN, a closed socket, a
        timeout or a failed ``recv``.
        """
        sock = self._sock
        if sock is None:
            raise ValueError("the netlink socket is closed")
        while True:
            try:
                data = sock.recv(RECV_BUFSIZE)
            except OSError as exc:
                raise self._os_error(op, exc) from exc
            if not data:
                raise self.error(errno.EPROTO, op, reason="the socket closed before the answer came")
            for frame in split_frames(data):
                if frame.seq != seq or frame.type == NLMSG_NOOP:
                    continue
                if frame.type in (NLMSG_ERROR, NLMSG_DONE) and frame.error:
                    raise self.error(-frame.error, op, kernel_message=frame.kernel_message)
                if frame.type == NLMSG_OVERRUN:
                    raise self.error(errno.ENOBUFS, op, reason="the kernel dropped part of the reply")
                yield frame

    def _os_error(self, op: str, exc: OSError) -> NetlinkError:
        if isinstance(exc, TimeoutError):
            return self.error(errno.ETIMEDOUT, op)
        return self.error(exc.errno or errno.EIO, op)
