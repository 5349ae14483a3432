"""NRI's wire as the agent speaks it: protobuf subset, ttrpc framing, the multiplexer, hostile peers."""

from __future__ import annotations

import socket
import struct

import pytest

from rdma_cni.agent.nri import mux, pb, ttrpc


def test_varints_and_fields_round_trip() -> None:
    buf = pb.f_string(1, "héllo") + pb.f_varint(2, 300) + pb.f_varint(3, -1)
    buf += pb.f_bytes(4, b"", keep_empty=True)
    f = pb.decode(buf)
    assert pb.string(f, 1) == "héllo"
    assert pb.integer(f, 2) == 300
    assert pb.integer(f, 3) == -1  # int64 -1 is ten bytes on the wire
    assert f[4] == [b""]
    assert pb.f_varint(5, 0) == b""  # proto3 leaves zeros out


def test_unknown_fields_of_every_wire_type_are_skipped() -> None:
    fixed64 = pb.enc_varint(9 << 3 | pb.I64) + bytes(8)
    fixed32 = pb.enc_varint(10 << 3 | pb.I32) + bytes(4)
    f = pb.decode(fixed64 + fixed32 + pb.f_string(1, "x"))
    assert pb.string(f, 1) == "x"


@pytest.mark.parametrize(
    "buf, message",
    [
        (b"\x0a\x05ab", "past the end"),
        (b"\x08\xff", "truncated varint"),
        (b"\x08" + b"\xff" * 11, "longer than 10"),
        (b"\x0b", "wire type 3"),
        (b"\x00\x01", "field number 0"),
        (b"\x09\x00", "truncated fixed"),
    ],
)
def test_malformed_protobuf_is_refused(buf: bytes, message: str) -> None:
    with pytest.raises(pb.DecodeError, match=message):
        pb.decode(buf)


def test_ttrpc_header_layout() -> None:
    msg = ttrpc.encode_message(7, ttrpc.TYPE_RESPONSE, b"abc", flags=1)
    assert msg == struct.pack(">IIBB", 3, 7, 2, 1) + b"abc"


def test_ttrpc_reader_joins_split_messages_and_splits_joined_ones() -> None:
    a = ttrpc.encode_message(1, ttrpc.TYPE_REQUEST, b"first")
    b = ttrpc.encode_message(3, ttrpc.TYPE_REQUEST, b"second")
    reader = ttrpc.Reader()
    assert reader.feed(a[:4]) == []
    assert reader.feed(a[4:12]) == []
    got = reader.feed(a[12:] + b)
    assert [(m.stream, m.payload) for m in got] == [(1, b"first"), (3, b"second")]
    assert reader.pending == 0


def test_ttrpc_oversize_length_is_refused_before_reading_it() -> None:
    with pytest.raises(ttrpc.ProtocolError, match="exceeds"):
        ttrpc.Reader().feed(struct.pack(">IIBB", ttrpc.MAX_MESSAGE + 1, 1, 1, 0))
    with pytest.raises(ttrpc.ProtocolError):
        ttrpc.encode_message(1, 1, bytes(ttrpc.MAX_MESSAGE + 1))


def test_request_and_response_round_trip() -> None:
    req = ttrpc.Request("svc", "Method", b"\x01\x02", 2_000_000_000)
    assert ttrpc.decode_request(ttrpc.encode_request(req)) == req
    resp = ttrpc.Response(ttrpc.UNIMPLEMENTED, "no", b"p")
    assert ttrpc.decode_response(ttrpc.encode_response(resp)) == resp
    ok = ttrpc.Response(0, "", b"")
    assert ttrpc.encode_response(ok) == b"\x0a\x00"  # an empty status is still sent
    assert ttrpc.decode_response(ttrpc.encode_response(ok)) == ok


@pytest.mark.parametrize("payload", [b"\x0a\x09abc", pb.f_string(2, "Method"), b""])
def test_malformed_request_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ttrpc.ProtocolError):
        ttrpc.decode_request(payload)


def test_mux_frame_layout_and_read() -> None:
    a, b = socket.socketpair()
    with a, b:
        mux.send_frame(a, mux.RUNTIME_CONN, b"xyz")
        assert b.recv(100) == struct.pack(">II", 2, 3) + b"xyz"
        a.sendall(struct.pack(">II", 1, 0))
        assert mux.read_frame(b) == (1, b"")


def test_mux_oversize_length_from_peer() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">II", 1, mux.MAX_PAYLOAD + 1))
        with pytest.raises(ttrpc.ProtocolError, match="exceeds"):
            mux.read_frame(b)
    with pytest.raises(ttrpc.ProtocolError):
        mux.encode_frame(1, bytes(mux.MAX_PAYLOAD + 1))


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "closed by the runtime"),
        (b"\x00\x00\x00", "inside a frame"),
        (struct.pack(">II", 1, 10) + b"abc", "inside a frame"),
    ],
)
def test_mux_truncated_frames(data: bytes, message: str) -> None:
    a, b = socket.socketpair()
    with b:
        a.sendall(data)
        a.close()
        with pytest.raises(mux.Closed, match=message):
            mux.read_frame(b)
