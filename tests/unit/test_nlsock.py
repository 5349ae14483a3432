"""The netlink transport (nlsock): framing, errors and dumps against bytes the kernel really sent.

The replies below were captured once (Linux 6.x, this project's test machine)
by a short script that unshared a fresh network namespace, opened a
NETLINK_ROUTE socket with NETLINK_EXT_ACK, sent the requests described beside
each constant and printed every datagram ``recv()`` returned as hex. They are
pasted unchanged, so a framing bug cannot hide behind a test that builds its
replies with the code under test. Cases the kernel cannot be made to produce
on demand (an interrupted dump, an overrun) are flag edits of captured bytes,
said so where they are made.
"""

from __future__ import annotations

import errno
import struct
from collections import deque

import pytest

from rdma_cni.kernel.nlsock import (
    NLM_F_ACK,
    NLM_F_DUMP,
    NLM_F_DUMP_INTR,
    NLM_F_MULTI,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSG_NOOP,
    NLMSG_OVERRUN,
    NetlinkError,
    NlSocket,
    pyroute2_module,
    split_frames,
)

RTM_NEWLINK, RTM_GETLINK, RTM_NEWADDR = 16, 18, 20
HDR = struct.Struct("=IHHII")

# RTM_GETLINK dump (seq 1) in a fresh network namespace: lo's RTM_NEWLINK record, then NLMSG_DONE.
LO_RECORD = bytes.fromhex(
    "bc05000010000200010000003e48000000000403010000000800000000000000070003006c6f000008000d00e8030000"
    "050010000200000005001100000000000500430001000000080004000000010008003200000000000800330000000000"
    "08001b000000000008001e000000000008003d000000000008001f000100000008002800ffff00000800290000000100"
    "08003a000000010008003f0000000100080040000000010008003b00f8ff070008003c00ffff00000800420000000000"
    "08002000010000000500210001000000080023000000000008002f000000000008003000000000000600440000000000"
    "060045000000000005002700000000000a00010000000000000000000a0002000000000000000000cc00170000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000006400070000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "00000000000000000c002b000500020000000000090006006e6f6f700000000030031a008c0002008800010000000000"
    "000000000000000001000000010000000100000001000000000000000100000000000000000000000000000000000000"
    "000000000100000001000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "0000000010270000e80300000000000000000000000000000000000001000000a0020a00080001000000000014000500"
    "ffff000075b70b00dc950000e8030000f400020000000000400000000000010001000000010000000100000001000000"
    "ffffffffa00f0000e8030000ffffffff803a090080510100030000005802000010000000000000000100000001000000"
    "0100000060ea0000000000000000000000000000000000000000000000000000ffffffff000000000000000010270000"
    "e80300000100000000000000000000000100000000000000000000000100000000000000000000000000000000000000"
    "80ee360000000000000000000100000000000000000000000000000000000000000000000004000000000000ffff0000"
    "ffffffff0100000000000000000000000000000034010300260000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000003c00060007000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000001400070000000000000000000000000000000000050008000000000024000e00000000000000000000000000"
    "000000000000000000000000000000000000000004003e8004004180"
)

DUMP_DONE = bytes.fromhex("1400000003000200010000003e48000000000000")

# RTM_GETLINK of ifindex 999 with NLM_F_ACK (seq 2): ENODEV, the whole request echoed, no TLVs.
ENODEV_ERROR = bytes.fromhex(
    "3400000002000000020000003e480000edffffff2000000012000500020000000000000000000000e70300000000000000000000"
)

# RTM_NEWLINK setting lo up with NLM_F_ACK (seq 3): the ACK (error 0, NLM_F_CAPPED echo).
ACK = bytes.fromhex("2400000002000001030000003e4800000000000020000000100005000300000000000000")

# RTM_GETLINK dump (seq 4) with ifi_flags set, on a socket with NETLINK_GET_STRICT_CHK: the kernel
# refuses the dump in an NLMSG_DONE carrying EINVAL and an NLMSGERR_ATTR_MSG (flags MULTI|ACK_TLVS).
DUMP_REFUSED = bytes.fromhex(
    "480000000300020204000000c5e2a5f5eaffffff33000100496e76616c69642076616c75657320696e20686561646572"
    "20666f72206c696e6b2064756d7020726571756573740000"
)

# RTM_NEWADDR 10.0.0.1/40 on lo (seq 5): EINVAL with the echoed request and an ext-ack message.
BAD_PREFIX_ERROR = bytes.fromhex(
    "5400000002000002050000003e480000eaffffff20000000140005060500000000000000022800000100000008000200"
    "0a00000120000100697076343a20496e76616c696420707265666978206c656e67746800"
)


def request(mtype: int, flags: int, seq: int) -> bytes:
    """A request header plus an empty 16-byte family header, as the captures were asked."""
    return HDR.pack(32, mtype, flags, seq, 0) + bytes(16)


DUMP = NLM_F_REQUEST | NLM_F_DUMP
ACKED = NLM_F_REQUEST | NLM_F_ACK


def with_header(
    datagram: bytes, *, seq: int | None = None, flags: int | None = None, mtype: int | None = None
) -> bytes:
    """A copy of a one-message datagram with header fields replaced (for cases the kernel will not stage)."""
    length, old_type, old_flags, old_seq, pid = HDR.unpack_from(datagram)
    new = HDR.pack(
        length,
        old_type if mtype is None else mtype,
        old_flags if flags is None else flags,
        old_seq if seq is None else seq,
        pid,
    )
    return new + datagram[HDR.size :]


class ScriptedSocket:
    """Hands out datagrams in order and records what was sent; an exception in the script is raised."""

    def __init__(self, *script: bytes | BaseException) -> None:
        self.script: deque[bytes | BaseException] = deque(script)
        self.sent: list[bytes] = []
        self.closed = False

    def send(self, data: bytes) -> int:
        self.sent.append(bytes(data))
        return len(data)

    def recv(self, bufsize: int) -> bytes:
        if not self.script:
            raise TimeoutError("timed out")
        item = self.script.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.closed = True


def nl(*script: bytes | BaseException) -> NlSocket:
    return NlSocket(0, sock=ScriptedSocket(*script))


# --------------------------------------------------------------------------- framing


def test_a_dump_record_and_its_done() -> None:
    (record,) = split_frames(LO_RECORD)
    assert (record.type, record.flags, record.seq) == (RTM_NEWLINK, NLM_F_MULTI, 1)
    assert record.data == LO_RECORD and record.error is None
    (done,) = split_frames(DUMP_DONE)
    assert (done.type, done.flags, done.seq, done.error, done.kernel_message) == (
        NLMSG_DONE,
        NLM_F_MULTI,
        1,
        0,
        None,
    )


def test_several_messages_in_one_datagram() -> None:
    frames = split_frames(LO_RECORD + DUMP_DONE)
    assert [f.type for f in frames] == [RTM_NEWLINK, NLMSG_DONE]


def test_error_without_ext_ack() -> None:
    (frame,) = split_frames(ENODEV_ERROR)
    assert (frame.type, frame.seq, frame.error, frame.kernel_message) == (NLMSG_ERROR, 2, -errno.ENODEV, None)


def test_error_with_ext_ack_message_after_the_echoed_request() -> None:
    (frame,) = split_frames(BAD_PREFIX_ERROR)
    assert (frame.error, frame.kernel_message) == (-errno.EINVAL, "ipv4: Invalid prefix length")


def test_done_with_ext_ack_message() -> None:
    (frame,) = split_frames(DUMP_REFUSED)
    assert (frame.type, frame.error) == (NLMSG_DONE, -errno.EINVAL)
    assert frame.kernel_message == "Invalid values in header for link dump request"


def test_ack_is_an_error_frame_with_code_zero() -> None:
    (frame,) = split_frames(ACK)
    assert (frame.type, frame.seq, frame.error) == (NLMSG_ERROR, 3, 0)


@pytest.mark.parametrize("cut", [1, 4, 15, len(LO_RECORD) - 1])
def test_truncated_datagram_is_a_protocol_error(cut: int) -> None:
    with pytest.raises(NetlinkError) as info:
        split_frames(LO_RECORD[:cut])
    assert info.value.errno == errno.EPROTO
    assert "malformed reply" in str(info.value)


def test_error_too_short_to_hold_its_code() -> None:
    short = HDR.pack(HDR.size + 2, NLMSG_ERROR, 0, 1, 0) + b"\0\0"
    with pytest.raises(NetlinkError) as info:
        split_frames(short)
    assert info.value.errno == errno.EPROTO


# --------------------------------------------------------------------------- exchanges


def test_dump_collects_records_up_to_done_and_decodes_them() -> None:
    sock = nl(LO_RECORD, DUMP_DONE)
    ifinfmsg = pyroute2_module("pyroute2.netlink.rtnl.ifinfmsg").ifinfmsg
    (link,) = sock.request(ifinfmsg(), RTM_GETLINK, DUMP)
    assert link.get_attr("IFLA_IFNAME") == "lo"
    assert link["index"] == 1


def test_ack_ends_an_acked_request_with_no_replies() -> None:
    assert nl(ACK).exchange("", request(RTM_NEWLINK, ACKED, 3), 3) == []


def test_error_reply_raises_netlink_error_with_errno() -> None:
    with pytest.raises(NetlinkError) as info:
        nl(ENODEV_ERROR).exchange("", request(RTM_GETLINK, ACKED, 2), 2)
    err = info.value
    assert isinstance(err, OSError)
    assert (err.errno, err.kernel_message, str(err)) == (errno.ENODEV, None, "No such device")


def test_error_reply_carries_the_kernels_message() -> None:
    with pytest.raises(NetlinkError) as info:
        nl(BAD_PREFIX_ERROR).exchange("add address", request(RTM_NEWADDR, ACKED, 5), 5)
    err = info.value
    assert (err.errno, err.kernel_message) == (errno.EINVAL, "ipv4: Invalid prefix length")
    assert str(err) == "add address: Invalid argument [EINVAL] (kernel: ipv4: Invalid prefix length)"
    assert err.strerror == str(err)


def test_dump_refused_in_its_done() -> None:
    with pytest.raises(NetlinkError) as info:
        nl(DUMP_REFUSED).exchange("", request(RTM_GETLINK, DUMP, 4), 4)
    assert info.value.errno == errno.EINVAL
    assert info.value.kernel_message == "Invalid values in header for link dump request"


def test_replies_to_other_sequence_numbers_are_skipped() -> None:
    # Leftovers of request 1 (a dump record and an error) arrive before request 3's ACK.
    sock = nl(LO_RECORD, ENODEV_ERROR, ACK)
    assert sock.exchange("", request(RTM_NEWLINK, ACKED, 3), 3) == []


def test_noop_and_leftovers_are_skipped_alike_by_a_request_and_a_stream() -> None:
    # Type edit: a NOOP carrying the dump's own sequence number; and a leftover of request 7.
    noop = with_header(LO_RECORD, mtype=NLMSG_NOOP)
    leftover = with_header(LO_RECORD, seq=7)
    script = (noop, leftover, LO_RECORD, DUMP_DONE)
    (record, done) = nl(*script).exchange("", request(RTM_GETLINK, DUMP, 1), 1)
    assert (record.type, done.type) == (RTM_NEWLINK, NLMSG_DONE)
    streamed = list(nl(*script).stream("", request(RTM_GETLINK, DUMP, 1), 1))
    assert [frame.type for frame in streamed] == [RTM_NEWLINK, NLMSG_DONE]


def test_an_unacked_request_ends_at_its_single_reply() -> None:
    # Flag edit: lo's record without NLM_F_MULTI, as a plain RTM_GETLINK of one link answers.
    single = with_header(LO_RECORD, flags=0)
    (frame,) = nl(single).exchange("", request(RTM_GETLINK, NLM_F_REQUEST, 1), 1)
    assert frame.type == RTM_NEWLINK


def test_interrupted_dump_is_asked_again() -> None:
    # Flag edit: the kernel sets NLM_F_DUMP_INTR when links change mid-dump, which cannot be staged here.
    interrupted = with_header(LO_RECORD, flags=NLM_F_MULTI | NLM_F_DUMP_INTR)
    raw = ScriptedSocket(interrupted, DUMP_DONE, with_header(LO_RECORD, seq=2), with_header(DUMP_DONE, seq=2))
    frames = NlSocket(0, sock=raw).dump("list links", lambda seq: request(RTM_GETLINK, DUMP, seq))
    assert [f.seq for f in frames] == [2]
    assert [HDR.unpack_from(sent)[3] for sent in raw.sent] == [1, 2]


def test_a_dump_interrupted_every_time_gives_up_with_eagain() -> None:
    script: list[bytes] = []
    for seq in (1, 2, 3):
        script += [
            with_header(LO_RECORD, seq=seq, flags=NLM_F_MULTI | NLM_F_DUMP_INTR),
            with_header(DUMP_DONE, seq=seq),
        ]
    with pytest.raises(NetlinkError) as info:
        nl(*script).dump("list links", lambda seq: request(RTM_GETLINK, DUMP, seq))
    assert info.value.errno == errno.EAGAIN
    assert "3 attempts" in str(info.value)


def test_overrun_message_is_enobufs() -> None:
    # Type edit: NLMSG_OVERRUN in place of the DONE's type.
    overrun = with_header(DUMP_DONE, mtype=NLMSG_OVERRUN)
    with pytest.raises(NetlinkError) as info:
        nl(LO_RECORD, overrun).exchange("", request(RTM_GETLINK, DUMP, 1), 1)
    assert info.value.errno == errno.ENOBUFS


def test_receive_buffer_overrun_from_the_socket_is_enobufs() -> None:
    with pytest.raises(NetlinkError) as info:
        nl(LO_RECORD, OSError(errno.ENOBUFS, "No buffer space available")).exchange(
            "", request(RTM_GETLINK, DUMP, 1), 1
        )
    assert info.value.errno == errno.ENOBUFS


def test_silence_is_a_timeout() -> None:
    with pytest.raises(NetlinkError) as info:
        nl().exchange("ask", request(RTM_GETLINK, ACKED, 1), 1)
    assert info.value.errno == errno.ETIMEDOUT
    assert "did not answer in time" in str(info.value)


def test_closed_socket() -> None:
    raw = ScriptedSocket()
    sock = NlSocket(0, sock=raw)
    sock.close()
    sock.close()
    assert raw.closed
    with pytest.raises(ValueError, match="closed"):
        sock.exchange("", request(RTM_GETLINK, ACKED, 1), 1)


def test_reasons_explain_errnos_for_the_protocol() -> None:
    sock = NlSocket(0, sock=ScriptedSocket(ENODEV_ERROR), reasons={errno.ENODEV: "no such RDMA device"})
    with pytest.raises(NetlinkError, match="no such RDMA device"):
        sock.exchange("move", request(RTM_GETLINK, ACKED, 2), 2)
