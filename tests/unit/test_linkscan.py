"""The bounded link walk and the streamed dump under it, against bytes the kernel really sent.

``LO_RECORD`` and ``DUMP_DONE`` are the captured RTM_GETLINK dump of a fresh
namespace from test_nlsock.py; copies with another ifindex, sequence number or
flags are header edits, made where said. The walk on a real namespace full of
links is tests/integration/test_netns_links.py's.
"""

from __future__ import annotations

import errno
import struct

import pytest

from rdma_cni.kernel import linkscan
from rdma_cni.kernel.linkscan import Bound, decode_link, dump_request, walk
from rdma_cni.kernel.nlsock import (
    NLM_F_DUMP_INTR,
    NLM_F_MULTI,
    NLMSG_DONE,
    NLMSG_OVERRUN,
    NetlinkError,
    NlSocket,
)
from tests.unit.test_nlsock import DUMP_DONE, DUMP_REFUSED, HDR, LO_RECORD, ScriptedSocket, with_header


def numbered(index: int, seq: int = 1) -> bytes:
    """lo's captured record with its ifindex (ifinfomsg.ifi_index, after the 16-byte header) replaced."""
    record = bytearray(with_header(LO_RECORD, seq=seq))
    struct.pack_into("=i", record, HDR.size + 4, index)
    return bytes(record)


def test_decode_reads_what_identity_needs_from_the_kernels_bytes() -> None:
    link = decode_link(LO_RECORD)
    assert (link.index, link.name, link.mtu, link.up) == (1, "lo", 65536, False)
    assert link.mac == "00:00:00:00:00:00"
    assert (link.parent_dev, link.parent_bus, link.link_index, link.link_netnsid) == ("", "", 0, None)


def test_decode_refuses_a_message_without_its_ifinfomsg() -> None:
    with pytest.raises(ValueError, match="too short"):
        decode_link(LO_RECORD[:20])


def test_decode_reads_parent_device_link_and_netnsid() -> None:
    def attr(kind: int, payload: bytes) -> bytes:
        raw = struct.pack("=HH", 4 + len(payload), kind) + payload
        return raw + b"\0" * (-len(raw) % 4)

    body = struct.pack("=BxHiII", 0, 1, 7, 1, 0)
    body += attr(linkscan.IFLA_IFNAME, b"net1\0") + attr(linkscan.IFLA_PARENT_DEV_NAME, b"0000:3b:02.1\0")
    body += attr(linkscan.IFLA_PARENT_DEV_BUS_NAME, b"pci\0") + attr(linkscan.IFLA_LINK, struct.pack("=I", 9))
    body += attr(linkscan.IFLA_LINK_NETNSID, struct.pack("=i", 2)) + attr(linkscan.IFLA_IFALIAS, b"x\0")
    link = decode_link(HDR.pack(16 + len(body), 16, 0, 1, 0) + body)
    assert (link.index, link.name, link.up, link.alias) == (7, "net1", True, "x")
    assert (link.parent_dev, link.parent_bus, link.link_index, link.link_netnsid) == (
        "0000:3b:02.1",
        "pci",
        9,
        2,
    )


def test_the_request_asks_for_no_statistics() -> None:
    raw = dump_request(5)
    assert HDR.unpack_from(raw)[1:4] == (18, 0x301, 5)
    assert raw.endswith(struct.pack("=HHI", 8, linkscan.IFLA_EXT_MASK, linkscan.RTEXT_FILTER_SKIP_STATS))


def test_stream_yields_records_then_done() -> None:
    frames = list(NlSocket(0, sock=ScriptedSocket(LO_RECORD, DUMP_DONE)).stream("x", dump_request(1), 1))
    assert [f.type for f in frames] == [16, NLMSG_DONE]


@pytest.mark.parametrize(
    ("script", "code"),
    [
        ((DUMP_REFUSED,), errno.EINVAL),
        ((LO_RECORD, with_header(DUMP_DONE, mtype=NLMSG_OVERRUN)), errno.ENOBUFS),  # a type edit
        ((LO_RECORD, b""), errno.EPROTO),
        ((OSError(errno.ENOBUFS, "No buffer space available"),), errno.ENOBUFS),
    ],
    ids=["refused", "overrun", "closed", "socket-error"],
)
def test_stream_errors(script: tuple[bytes | BaseException, ...], code: int) -> None:
    seq = HDR.unpack_from(script[0])[3] if isinstance(script[0], bytes) else 1
    with pytest.raises(NetlinkError) as info:
        list(NlSocket(0, sock=ScriptedSocket(*script)).stream("list links", dump_request(seq), seq))
    assert info.value.errno == code


def test_stream_on_a_closed_socket_and_a_refused_send() -> None:
    sock = NlSocket(0, sock=ScriptedSocket())
    sock.close()
    with pytest.raises(ValueError, match="closed"):
        next(sock.stream("x", dump_request(1), 1))

    class Refusing(ScriptedSocket):
        def send(self, data: bytes) -> int:
            raise OSError(errno.EPERM, "Operation not permitted")

    with pytest.raises(NetlinkError) as info:
        next(NlSocket(0, sock=Refusing()).stream("x", dump_request(1), 1))
    assert info.value.errno == errno.EPERM


def test_walk_keeps_what_it_is_asked_to_and_says_it_saw_everything() -> None:
    raw = ScriptedSocket(numbered(1), numbered(2), numbered(2), numbered(3), DUMP_DONE)
    out = walk(None, lambda link: link.index != 2, sock=raw)
    assert [link.index for link in out.kept] == [1, 3]
    assert (out.examined, out.complete, out.stopped) == (3, True, "")  # index 2 listed twice, examined once
    assert raw.closed


def test_walk_stops_at_its_bound_on_links_and_leaves_the_rest_unread() -> None:
    raw = ScriptedSocket(*(numbered(n) for n in range(1, 11)), DUMP_DONE)
    out = walk(None, lambda link: True, Bound(links=4), sock=raw)
    assert (out.examined, out.complete, out.stopped) == (4, False, "4 links examined")
    assert len(raw.script) == 7 and raw.closed  # what the walk did not read died with its socket


def test_walk_stops_at_its_bound_on_time() -> None:
    raw = ScriptedSocket(*(numbered(n) for n in range(1, 11)), DUMP_DONE)
    out = walk(None, lambda link: True, Bound(seconds=0), sock=raw)
    assert (out.examined, out.complete, out.stopped) == (1, False, "0 s spent")


def test_a_silent_kernel_ends_the_walk_as_out_of_time() -> None:
    out = walk(None, lambda link: True, Bound(seconds=0.5), sock=ScriptedSocket(numbered(1)))
    assert (out.examined, out.complete, out.stopped) == (1, False, "0.5 s spent")


def test_an_interrupted_dump_is_an_incomplete_walk() -> None:
    # Flag edit: NLM_F_DUMP_INTR on the DONE, as the kernel sets it when links changed mid-dump.
    done = with_header(DUMP_DONE, flags=NLM_F_MULTI | NLM_F_DUMP_INTR)
    out = walk(None, lambda link: True, sock=ScriptedSocket(numbered(1), done))
    assert (out.examined, out.complete, out.stopped) == (1, False, "the links changed during the walk")


def test_other_errors_of_the_walk_are_raised() -> None:
    with pytest.raises(NetlinkError) as info:
        walk(None, lambda link: True, sock=ScriptedSocket(with_header(DUMP_REFUSED, seq=1)))
    assert info.value.errno == errno.EINVAL
