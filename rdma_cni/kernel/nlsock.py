"""A small synchronous netlink transport, bound to a chosen network namespace.

Why not pyroute2's IPRoute: importing the ``pyroute2`` package costs ~200 ms
(its ``__init__`` imports every protocol) and IPRoute pulls in asyncio (~95 ms),
while kubelet runs this binary for every pod. pyroute2's message classes
(``ifinfmsg``, ``ifaddrmsg``, ``rtmsg``, ``nlmsg``) do the encoding and
decoding; this module sends them over a plain AF_NETLINK socket and collects
the replies. :func:`pyroute2_module` imports a pyroute2 submodule without
running the package ``__init__`` (a full import still works later, lazily).

A netlink socket answers for the network namespace it was created in, so
:class:`NlSocket` creates its socket after switching the calling thread into
the target namespace with setns(2) and switches back at once: cheaper than
pyroute2's NetNS, which forks a helper process.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import importlib
import importlib.util
import os
import socket
import stat
import struct
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

CLONE_NEWNET = 0x40000000
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLM_F_CREATE = 0x400
NLM_F_EXCL = 0x200
_HDR = struct.Struct("=IHHII")


class NetlinkError(OSError):
    """A netlink request answered with an error; ``errno`` is the kernel's."""


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


_libc: Any = None


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def in_netns(target: str | int) -> Iterator[None]:
    """Run the body with the calling thread in the network namespace ``target`` (path or fd)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        fd = target if isinstance(target, int) else os.open(target, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(fd)
        finally:
            if not isinstance(target, int):
                os.close(fd)
        try:
            yield
        finally:
            # Failing to get back would leave every later operation in the wrong
            # namespace: there is no sane way to continue.
            try:
                _setns(own)
            except OSError as exc:  # pragma: no cover - kernel would have to refuse our own netns
                os.write(2, f"rdma-cni: cannot return to the original netns: {exc}\n".encode())
                os._exit(70)
    finally:
        os.close(own)


class NotAPodNetns(ValueError):
    """A CNI_NETNS path that opens, but is no network namespace other than this process's own."""


# ioctl(2) on an nsfs file: its namespace type (a CLONE_NEW* flag). Linux 4.11.
NS_GET_NSTYPE = 0xB703


def open_pod_netns(path: str) -> int:
    """Open ``path`` as a pod's network namespace and return the fd.

    Raises OSError when the path cannot be opened (missing, a deleted
    namespace), and :class:`NotAPodNetns` when it is something else: a FIFO,
    a device, a regular file, another kind of namespace, or the network
    namespace this process runs in (the host's: "configuring the pod" there
    would configure the node). Nothing is opened that could block or act on
    open: only nsfs files are opened, and never without O_NONBLOCK.
    """
    nsfs = os.stat("/proc/self/ns/net")
    before = os.stat(path)
    if not stat.S_ISREG(before.st_mode) or before.st_dev != nsfs.st_dev:
        raise NotAPodNetns(f"{path} is not a network namespace (not an nsfs file)")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        # Checked again on the fd: the path may have been swapped since the stat.
        st = os.fstat(fd)
        if st.st_dev != nsfs.st_dev:
            raise NotAPodNetns(f"{path} is not a network namespace (not an nsfs file)")
        try:
            kind = fcntl.ioctl(fd, NS_GET_NSTYPE)
        except OSError as exc:
            raise NotAPodNetns(f"{path} is not a namespace ({exc.strerror})") from exc
        if kind != CLONE_NEWNET:
            raise NotAPodNetns(f"{path} is a namespace, but not a network namespace")
        if (st.st_dev, st.st_ino) == (nsfs.st_dev, nsfs.st_ino):
            raise NotAPodNetns(f"{path} is the host's own network namespace (the plugin's), not a pod's")
    except BaseException:
        os.close(fd)
        raise
    return fd


def host_netns_fd() -> int:
    """An fd for the namespace this process started in (the host's, for a CNI plugin)."""
    return os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)


class NlSocket:
    """One netlink socket of ``protocol``, created in ``netns`` (a path or fd; None = current)."""

    def __init__(
        self, protocol: int, netns: str | int | None = None, sock_factory: Callable[[], Any] | None = None
    ) -> None:
        factory = sock_factory or (
            lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, protocol)
        )
        if netns is None:
            self._sock = factory()
        else:
            with in_netns(netns):
                self._sock = factory()
        if sock_factory is None:
            self._sock.bind((0, 0))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            # Extended ACKs give the kernel's reason string on errors.
            with contextlib.suppress(OSError):
                self._sock.setsockopt(270, 11, 1)  # SOL_NETLINK, NETLINK_EXT_ACK
        self._seq = (os.getpid() & 0xFFFF) << 12

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> NlSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, msg: Any, msg_type: int, flags: int, reply_class: Any | None = None) -> list[Any]:
        """Send a pyroute2 message; return the decoded replies (empty for an ACK).

        Raises :class:`NetlinkError` with the kernel's errno on NLMSG_ERROR.
        """
        self._seq += 1
        seq = self._seq
        msg["header"]["type"] = msg_type
        msg["header"]["flags"] = flags
        msg["header"]["sequence_number"] = seq
        msg.encode()
        self._sock.send(msg.data)
        return self.collect(seq, reply_class or type(msg))

    def collect(self, seq: int, reply_class: Any) -> list[Any]:
        """Read replies for ``seq`` until ACK, DONE or a single non-multipart answer."""
        replies: list[Any] = []
        while True:
            data = self._sock.recv(1 << 20)
            offset = 0
            finished = False
            while offset + _HDR.size <= len(data):
                length, mtype, mflags, mseq, _pid = _HDR.unpack_from(data, offset)
                if length < _HDR.size:
                    raise NetlinkError(errno.EBADMSG, "truncated netlink message")
                chunk = data[offset : offset + length]
                offset += (length + 3) & ~3
                if mseq != seq:
                    continue  # a late answer to an earlier request: not ours
                if mtype == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", chunk, _HDR.size)
                    if code:
                        reason = _ext_ack_message(chunk)
                        text = os.strerror(-code) + (f" ({reason})" if reason else "")
                        raise NetlinkError(-code, text)
                    finished = True
                elif mtype == NLMSG_DONE:
                    finished = True
                else:
                    reply = reply_class(chunk)
                    reply.decode()
                    replies.append(reply)
                    if not mflags & NLM_F_MULTI:
                        finished = True
            if finished:
                return replies


def _ext_ack_message(chunk: bytes) -> str:
    """The NLMSGERR_ATTR_MSG text of an extended ACK, if the kernel sent one."""
    # Layout: nlmsghdr, int error, the echoed request header (payload capped), TLVs.
    if len(chunk) < _HDR.size + 4 + _HDR.size:
        return ""
    (orig_len,) = struct.unpack_from("=I", chunk, _HDR.size + 4)
    flags = _HDR.unpack_from(chunk, 0)[2]
    capped = flags & 0x100  # NLM_F_CAPPED
    offset = _HDR.size + 4 + (_HDR.size if capped else ((orig_len + 3) & ~3))
    while offset + 4 <= len(chunk):
        nla_len, nla_type = struct.unpack_from("=HH", chunk, offset)
        if nla_len < 4:
            break
        if nla_type == 1:  # NLMSGERR_ATTR_MSG
            text = chunk[offset + 4 : offset + nla_len].split(b"\0", 1)[0].decode(errors="replace")
            if text:
                return text
        offset += (nla_len + 3) & ~3
    return ""
