"""One connection from the shim: who is calling, its request with the namespace fd, whether it hung up.

The request is read under one deadline however it trickles in, and every
length is checked (:mod:`rdma_cni.agent.shimwire`) before it is read.
"""

from __future__ import annotations

import array
import logging
import os
import select
import socket
import struct
import time

from rdma_cni.agent.shimwire import REQUEST_HEADER, Request, WireError, parse_env, parse_header

log = logging.getLogger("rdma_cni.agent.cniserver")

REQUEST_SECONDS = 10.0


class Knock(WireError):
    """The caller connected and closed without sending a byte: a probe (``rdma-cni doctor``), not a call."""


def peer_allowed(conn: socket.socket) -> bool:
    """Whether the peer (SO_PEERCRED) is root or this process's user; a refusal is logged."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    if uid in (0, os.geteuid()):
        return True
    log.warning("refused a call from uid %d (pid %d): only root may run CNI verbs", uid, pid)
    return False


def hung_up(conn: socket.socket) -> bool:
    """Whether the shim closed its end (it sends nothing after its request)."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN | select.POLLHUP | select.POLLRDHUP)
    return bool(poller.poll(0))


def _recv_exact(conn: socket.socket, n: int, deadline: float) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WireError(f"the request did not arrive within {REQUEST_SECONDS:.0f} s")
        conn.settimeout(left)
        chunk = conn.recv(min(n - len(chunks), 1 << 16))
        if not chunk:
            raise WireError("the caller closed the connection mid-request")
        chunks += chunk
    return bytes(chunks)


def read_request(conn: socket.socket) -> tuple[Request, int | None]:
    """The request and the namespace fd that came with it (the caller closes it).

    The whole request must arrive within REQUEST_SECONDS, however it trickles in.
    """
    deadline = time.monotonic() + REQUEST_SECONDS
    conn.settimeout(REQUEST_SECONDS)
    fds = array.array("i")
    raw, ancdata, _flags, _ = conn.recvmsg(REQUEST_HEADER.size, socket.CMSG_SPACE(4 * fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if not raw and not fds:
        raise Knock("the caller closed the connection without a request")
    try:
        if len(raw) < REQUEST_HEADER.size:
            raw += _recv_exact(conn, REQUEST_HEADER.size - len(raw), deadline)
        header = parse_header(raw)
        if len(fds) > (1 if header.has_netns else 0):
            raise WireError("more file descriptors than a request carries")
        env = parse_env(_recv_exact(conn, header.env_len, deadline))
        stdin = _recv_exact(conn, header.stdin_len, deadline)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    fd = fds[0] if fds else None
    return Request(env=env, stdin=stdin, netns_errno=header.netns_errno), fd
