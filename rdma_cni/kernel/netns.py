"""Network namespaces: a pod's, opened once per verb, the host's, and switching between them.

Every namespace switch in rdma-cni goes through :func:`in_netns` here: it
moves only the calling thread, and only for as long as it takes to create a
socket bound to the target namespace (netlink and ioctl sockets answer for
the namespace they were created in).

The host's namespace is the one this process started in (a CNI plugin runs in
the host's). A pod's namespace is opened by path once and kept as an fd, so a
move names the same namespace however the path changes meanwhile, and an
:class:`~rdma_cni.kernel.netlink.Rtnl` bound to it answers for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import stat
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rdma_cni.cni.errors import InvalidEnvironment, UnknownContainer

if TYPE_CHECKING:
    from rdma_cni.kernel.netlink import Rtnl

log = logging.getLogger("rdma_cni.netns")

HOST_NETNS_PATH = "/proc/self/ns/net"
CLONE_NEWNET = 0x40000000
# Set by the agent's CNI server (rdma_cni.agent.cniserver) for the verbs it runs
# for the host's shim: CNI_NETNS is a path in the runtime's mount view, which the
# agent does not share, so the shim opened it and passed the fd; this names that
# fd (/proc/<server pid>/fd/<n>), or "errno:<n>" when the shim could not open it.
NETNS_VIA_ENV = "RDMA_CNI_NETNS_VIA"

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
    # The thread's own namespace, which may differ from the process's (HOST_NETNS_PATH).
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


def _opened_path(path: str) -> str:
    """What to open for ``path``: the namespace the shim passed when ``path`` is this verb's CNI_NETNS.

    Raises the shim's OSError when it could not open the path itself (the
    namespace is gone in the runtime's view: the plugin answers as it would
    for a missing path). Other paths (a record's) are opened as they are.
    """
    via = os.environ.get(NETNS_VIA_ENV, "")
    if not via or not path or path != os.environ.get("CNI_NETNS"):
        return path
    if via.startswith("errno:"):
        code = int(via[6:]) if via[6:].isdigit() else 2
        raise OSError(code, os.strerror(code), path)
    return via


def open_pod_netns(path: str) -> int:
    """Open ``path`` as a pod's network namespace and return the fd.

    Raises OSError when the path cannot be opened (missing, a deleted
    namespace), and :class:`NotAPodNetns` when it is something else: a FIFO,
    a device, a regular file, another kind of namespace, or the network
    namespace this process runs in (the host's: "configuring the pod" there
    would configure the node). Nothing is opened that could block or act on
    open: only nsfs files are opened, and never without O_NONBLOCK.
    """
    nsfs = os.stat(HOST_NETNS_PATH)
    before = os.stat(_opened_path(path))
    if not stat.S_ISREG(before.st_mode) or before.st_dev != nsfs.st_dev:
        raise NotAPodNetns(f"{path} is not a network namespace (not an nsfs file)")
    fd = os.open(_opened_path(path), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
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


class NetnsGone(UnknownContainer):
    """The pod's network namespace cannot be opened (deleted, rebooted, never there)."""


def host_netns_fd() -> int:
    """A new fd for the host's namespace (the caller closes it)."""
    return os.open(HOST_NETNS_PATH, os.O_RDONLY | os.O_CLOEXEC)


class Netns:
    """A pod's network namespace: an fd for moves and an Rtnl inside it."""

    def __init__(self, path: str) -> None:
        """Open ``path``: code 3 if it cannot be opened, code 4 if it is no pod's network namespace."""
        self.path = path
        try:
            self.fd = open_pod_netns(path)
        except OSError as exc:
            raise NetnsGone(f"cannot open CNI_NETNS {path}: {exc.strerror}") from exc
        except NotAPodNetns as exc:
            raise InvalidEnvironment(f"CNI_NETNS={path!r} is refused: {exc}") from exc
        # Imported here: the transport enters namespaces through this module.
        from rdma_cni.kernel.netlink import Rtnl

        try:
            self.rtnl: Rtnl = Rtnl(self.fd)
        except OSError as exc:
            os.close(self.fd)
            raise NetnsGone(f"CNI_NETNS {path} is not a network namespace: {exc.strerror}") from exc
        self._host_nsid: int | None = None
        self._host_nsid_known = False

    @classmethod
    def open_optional(cls, path: str) -> Netns | None:
        """The namespace, or None when it is gone (deleted netns, reboot)."""
        if not path:
            return None
        try:
            return cls(path)
        except NetnsGone as exc:
            log.info("pod netns is not available (%s): treating its interfaces as gone", exc.msg)
            return None
        except InvalidEnvironment as exc:
            # An unmounted namespace file may stay behind as an empty file: DEL must still succeed.
            log.warning("%s: treating the pod's interfaces as gone", exc.msg)
            return None

    def is_host(self) -> bool:
        """Is this the host's own namespace (a path naming it, such as /proc/self/ns/net)?"""
        mine = os.fstat(self.fd)
        host = os.stat(HOST_NETNS_PATH)
        return (mine.st_dev, mine.st_ino) == (host.st_dev, host.st_ino)

    def identity(self) -> list[int]:
        """[st_dev, st_ino] of the namespace's nsfs file: which namespace it is, as the kernel says.

        Unique among the namespaces alive; a number freed with its namespace may be given to a
        later one, so it proves a namespace is gone only by its absence, never that it lives.
        """
        st = os.fstat(self.fd)
        return [st.st_dev, st.st_ino]

    def host_nsid(self) -> int | None:
        """The id this namespace gives the host's (how its links name a peer in the host)."""
        if not self._host_nsid_known:
            fd = host_netns_fd()
            try:
                self._host_nsid = self.rtnl.nsid_of(fd)
            finally:
                os.close(fd)
            self._host_nsid_known = True
        return self._host_nsid

    def close(self) -> None:
        """Close the Rtnl and the fd."""
        self.rtnl.close()
        os.close(self.fd)
