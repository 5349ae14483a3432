"""A bounded walk over a namespace's links: the fallback when a VF is not where its record says.

A pod can create any number of links in its own namespace (tens of
thousands take seconds), so nothing that runs for a pod may walk them all:
a full dump decoded by pyroute2 cost 0.5 ms and 29 KB per link, seconds
under the node lock and hundreds of MiB in the agent. The VF's own link is
asked for by the ifindex it got in the pod (:mod:`rdma_cni.kernel.identity`);
this walk only serves what that cannot answer (records from before the
index was kept, a VF the pod moved away and back, stray VFs no record
lists), and it stops after :data:`SCAN_LINKS` links or :data:`SCAN_SECONDS`,
whichever comes first.

The walk reads the dump as the kernel produces it (:meth:`NlSocket.stream`),
asks the kernel to leave the statistics out (RTEXT_FILTER_SKIP_STATS: most
of each message), decodes only the attributes identity needs, with no
pyroute2 objects, and keeps only the links the caller wants (those with a
VF identity, which a pod cannot forge): memory is bounded by what is kept,
not by what was walked. Stopping early closes the socket, which ends the
dump in the kernel.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rdma_cni.kernel.netlink import IFF_UP, RTM_GETLINK, Link
from rdma_cni.kernel.nlsock import (
    HDR,
    NLM_F_DUMP,
    NLM_F_DUMP_INTR,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NetlinkError,
    NetlinkTransport,
    NlSocket,
)

log = logging.getLogger("rdma_cni.linkscan")

# The bound of one walk. A pod's namespace normally holds a handful of links
# (lo, eth0, its VFs, a few VLANs); 4,096 is far beyond that, and walking
# them costs a few tens of milliseconds.
SCAN_LINKS = 4096
SCAN_SECONDS = 0.25

RTM_NEWLINK = 16
IFLA_EXT_MASK = 29
RTEXT_FILTER_SKIP_STATS = 1 << 3
_IFINFO = struct.Struct("=BxHiII")  # family, type, index, flags, change
_NLA = struct.Struct("=HH")
_U32 = struct.Struct("=I")
_S32 = struct.Struct("=i")
NLA_TYPE_MASK = 0x3FFF

# The attributes decoded (linux/if_link.h).
IFLA_ADDRESS = 1
IFLA_IFNAME = 3
IFLA_MTU = 4
IFLA_LINK = 5
IFLA_IFALIAS = 20
IFLA_LINK_NETNSID = 37
IFLA_PARENT_DEV_NAME = 56
IFLA_PARENT_DEV_BUS_NAME = 57
_TEXT = (IFLA_IFNAME, IFLA_IFALIAS, IFLA_PARENT_DEV_NAME, IFLA_PARENT_DEV_BUS_NAME)


@dataclass(frozen=True)
class Bound:
    """How far one walk may go: links examined and seconds spent."""

    links: int = SCAN_LINKS
    seconds: float = SCAN_SECONDS


@dataclass
class Scan:
    """What a walk found: the links kept, how many it examined, and whether that was all of them."""

    kept: list[Link] = field(default_factory=list)
    examined: int = 0
    complete: bool = False
    stopped: str = ""  # why it stopped short ("" when complete)


def decode_link(data: bytes) -> Link:
    """One RTM_NEWLINK message (header included) as a :class:`Link`, without its VF list.

    Raises ValueError on a message too short to hold an ifinfomsg.
    """
    start = HDR.size
    if len(data) < start + _IFINFO.size:
        raise ValueError("RTM_NEWLINK message too short")
    _family, _type, index, flags, _change = _IFINFO.unpack_from(data, start)
    text: dict[int, str] = {}
    mac = ""
    mtu = link_index = 0
    netnsid: int | None = None
    offset, end = start + _IFINFO.size, len(data)
    while offset + _NLA.size <= end:
        length, kind = _NLA.unpack_from(data, offset)
        if length < _NLA.size or offset + length > end:
            break
        kind &= NLA_TYPE_MASK
        payload = data[offset + _NLA.size : offset + length]
        if kind in _TEXT:
            text[kind] = payload.split(b"\0", 1)[0].decode("utf-8", "replace")
        elif kind == IFLA_ADDRESS:
            mac = ":".join(f"{b:02x}" for b in payload)
        elif len(payload) >= 4 and kind in (IFLA_MTU, IFLA_LINK, IFLA_LINK_NETNSID):
            if kind == IFLA_LINK_NETNSID:
                netnsid = _S32.unpack_from(payload)[0]
            elif kind == IFLA_MTU:
                mtu = _U32.unpack_from(payload)[0]
            else:
                link_index = _U32.unpack_from(payload)[0]
        offset += (length + 3) & ~3
    return Link(
        index=index,
        name=text.get(IFLA_IFNAME, ""),
        mac=mac,
        mtu=mtu,
        up=bool(flags & IFF_UP),
        alias=text.get(IFLA_IFALIAS, ""),
        parent_dev=text.get(IFLA_PARENT_DEV_NAME, ""),
        parent_bus=text.get(IFLA_PARENT_DEV_BUS_NAME, ""),
        link_index=link_index,
        link_netnsid=netnsid,
    )


def dump_request(seq: int) -> bytes:
    """RTM_GETLINK dump of every link, statistics left out."""
    body = _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + _NLA.pack(8, IFLA_EXT_MASK)
    body += _U32.pack(RTEXT_FILTER_SKIP_STATS)
    return HDR.pack(HDR.size + len(body), RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def walk(
    netns: str | int | None,
    keep: Callable[[Link], bool],
    bound: Bound | None = None,
    *,
    sock: NetlinkTransport | None = None,
) -> Scan:
    """The links of ``netns`` (a path or fd; None: this thread's) walked within ``bound``; ``keep`` picks.

    A link the kernel lists twice (a dump that raced a change) is examined
    once. The walk is incomplete when it hit the bound, or when the kernel
    flagged the dump as interrupted (links may have been skipped). ``sock``
    replaces the socket (tests); it is closed all the same.
    """
    bound = bound or Bound()
    deadline = time.monotonic() + bound.seconds
    out = Scan()
    seen: set[int] = set()
    if sock is None:
        nl = NlSocket(socket.NETLINK_ROUTE, netns, timeout=max(bound.seconds, 0.001))
    else:
        nl = NlSocket(socket.NETLINK_ROUTE, sock=sock)
    try:
        seq = nl.next_seq()
        for frame in nl.stream("list links", dump_request(seq), seq):
            if frame.type == NLMSG_DONE:
                out.complete = not frame.flags & NLM_F_DUMP_INTR
                out.stopped = "" if out.complete else "the links changed during the walk"
                break
            if frame.type != RTM_NEWLINK:
                continue
            link = decode_link(frame.data)
            if link.index not in seen:
                seen.add(link.index)
                out.examined += 1
                if keep(link):
                    out.kept.append(link)
            if out.examined >= bound.links:
                out.stopped = f"{bound.links} links examined"
                break
            if time.monotonic() >= deadline:
                out.stopped = f"{bound.seconds:g} s spent"
                break
    except NetlinkError as exc:
        if exc.errno != errno.ETIMEDOUT:
            raise
        out.stopped = f"{bound.seconds:g} s spent"
    finally:
        nl.close()  # also ends a dump left unread
    return out
