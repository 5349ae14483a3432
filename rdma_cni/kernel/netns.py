"""Network namespaces: a pod's, opened once per verb, and the host's.

The host's namespace is the one this process started in (a CNI plugin runs in
the host's). A pod's namespace is opened by path once and kept as an fd, so a
move names the same namespace however the path changes meanwhile, and an
:class:`~rdma_cni.kernel.netlink.Rtnl` bound to it answers for it.
"""

from __future__ import annotations

import logging
import os

from rdma_cni.cni.errors import InvalidEnvironment, UnknownContainer
from rdma_cni.kernel.netlink import Rtnl
from rdma_cni.kernel.nlsock import NotAPodNetns, open_pod_netns

log = logging.getLogger("rdma_cni.netns")

HOST_NETNS_PATH = "/proc/self/ns/net"


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
        try:
            self.rtnl = Rtnl(self.fd)
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
