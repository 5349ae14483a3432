"""Fill a network namespace with thousands of links, fast: what a hostile pod can do to its own netns.

The links are made over one netlink socket opened inside the namespace, in
batches of RTM_NEWLINK requests sent together (one ``send`` per batch, then
the batch's ACKs read back), so 24,000 links take seconds, not the minutes
that one ``ip link add`` each would. This machine's kernel has no ``dummy``
driver; ``ifb`` links stand in (one device per request, no peer, no parent
device: nothing that could pass for a VF), and ``veth`` pairs when ifb is
missing too.

Test code only (the plugin never creates links).
"""

from __future__ import annotations

import errno
import os
import socket
import struct

from rdma_cni.kernel.netns import in_netns

RTM_NEWLINK = 16
RTM_DELLINK = 17
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
NLMSG_ERROR = 2
IFLA_ADDRESS, IFLA_IFNAME, IFLA_LINKINFO, IFLA_INFO_KIND, IFLA_INFO_DATA = 1, 3, 18, 1, 2
VETH_INFO_PEER = 1
NLA_F_NESTED = 0x8000
BATCH = 256


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _name(text: str) -> bytes:
    return _attr(IFLA_IFNAME, text.encode() + b"\0")


def newlink(seq: int, name: str, kind: str, *, peer: str = "", mac: bytes | None = None) -> bytes:
    """One RTM_NEWLINK (create, exclusive, acked) for a link ``name`` of ``kind``."""
    attrs = _name(name)
    if mac is not None:
        attrs += _attr(IFLA_ADDRESS, mac)
    info = _attr(IFLA_INFO_KIND, kind.encode())
    if peer:
        peer_msg = struct.pack("=BxHiII", 0, 0, 0, 0, 0) + _name(peer)
        info += _attr(IFLA_INFO_DATA | NLA_F_NESTED, _attr(VETH_INFO_PEER | NLA_F_NESTED, peer_msg))
    attrs += _attr(IFLA_LINKINFO | NLA_F_NESTED, info)
    body = struct.pack("=BxHiII", socket.AF_UNSPEC, 0, 0, 0, 0) + attrs
    flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
    return struct.pack("=IHHII", 16 + len(body), RTM_NEWLINK, flags, seq, 0) + body


def _acks(sock: socket.socket, want: int) -> None:
    seen = 0
    while seen < want:
        data = sock.recv(1 << 20)
        offset = 0
        while offset + 16 <= len(data):
            length, mtype = struct.unpack_from("=IH", data, offset)
            if mtype == NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", data, offset + 16)
                if code:
                    raise OSError(-code, f"RTM_NEWLINK: {os.strerror(-code)}")
                seen += 1
            offset += (length + 3) & ~3


def kind_available(netns: str) -> str:
    """ "ifb" if the kernel can make ifb links in ``netns``, else "veth"."""
    with in_netns(netns):
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    with sock:
        sock.send(newlink(1, "rcniprobe0", "ifb"))
        try:
            _acks(sock, 1)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOENT):
                return "veth"
            raise
        body = struct.pack("=BxHiII", socket.AF_UNSPEC, 0, 0, 0, 0) + _name("rcniprobe0")
        sock.send(struct.pack("=IHHII", 16 + len(body), RTM_DELLINK, NLM_F_REQUEST | NLM_F_ACK, 2, 0) + body)
        _acks(sock, 1)
    return "ifb"


def flood(netns: str, count: int, prefix: str = "x", *, macs: bool = False) -> int:
    """Create ``count`` links named ``<prefix><n>`` in the namespace at path ``netns``; returns how many.

    With ``macs``, each gets a locally administered MAC of its own.
    """
    kind = kind_available(netns)
    with in_netns(netns):
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    made = 0
    seq = 10
    with sock:
        while made < count:
            batch = []
            n = 0
            while n < BATCH and made + n < count:
                seq += 1
                k = made + n
                mac = (
                    bytes([0x02, 0x5E, (k >> 24) & 255, (k >> 16) & 255, (k >> 8) & 255, k & 255])
                    if macs
                    else None
                )
                if kind == "ifb":
                    batch.append(newlink(seq, f"{prefix}{k}", kind, mac=mac))
                    n += 1
                else:
                    batch.append(newlink(seq, f"{prefix}{k}", kind, peer=f"{prefix}{k + 1}", mac=mac))
                    n += 2
            sock.send(b"".join(batch))
            _acks(sock, len(batch))
            made += n
    return made
