"""NRI's wire as the agent speaks it: protobuf subset, ttrpc framing, the multiplexer, hostile peers."""

from __future__ import annotations

import socket
import struct

import pytest

from rdma_cni.agent.nri import mux, ttrpc


def test_the_envelopes_field_numbers_are_ttrpcs() -> None:
    # Hand-built bytes, numbered as containerd/ttrpc's request.proto (and google.rpc.Status
    # inside Response): the generated messages must read them as ttrpc wrote them.
    raw = b"\x0a\x03svc" + b"\x12\x01M" + b"\x1a\x02\x01\x02" + b"\x20\x05"
    assert ttrpc.decode_request(raw) == ttrpc.Request("svc", "M", b"\x01\x02", 5)
    assert ttrpc.encode_request(ttrpc.Request("svc", "M", b"\x01\x02", 5)) == raw
    raw = b"\x0a\x05\x08\x0c\x12\x01x" + b"\x12\x01p"
    assert ttrpc.decode_response(raw) == ttrpc.Response(12, "x", b"p")
    assert ttrpc.encode_response(ttrpc.Response(12, "x", b"p")) == raw


def test_unknown_fields_of_every_wire_type_are_skipped() -> None:
    # ttrpc's metadata (5, a KeyValue), and fixed64, fixed32 and varint fields nobody declared.
    unknown = b"\x2a\x04\x0a\x02ab" + b"\x49" + bytes(8) + b"\x55" + bytes(4) + b"\x58\x01"
    req = ttrpc.decode_request(unknown + b"\x0a\x01s\x12\x01m")
    assert (req.service, req.method) == ("s", "m")
    # A negative int64 is ten bytes on the wire.
    assert ttrpc.decode_request(ttrpc.encode_request(ttrpc.Request("s", "m", b"", -1))).timeout_nano == -1


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


@pytest.mark.parametrize(
    "payload",
    [
        b"\x0a\x09abc",  # a length past the end
        b"\x12\x06Method",  # no service
        b"",  # neither service nor method
        b"\x0a\x02\xff\xfe\x12\x01M",  # a service that is not UTF-8
        b"\x20\xff",  # a truncated varint
        b"\x20" + b"\xff" * 11,  # a varint longer than 10 bytes
        b"\x0b",  # a group that never ends
        b"\x00\x01",  # field number 0
        b"\x49\x00",  # a truncated fixed64
    ],
)
def test_malformed_request_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ttrpc.ProtocolError):
        ttrpc.decode_request(payload)


@pytest.mark.parametrize("payload", [b"\x0a\x09ab", b"\x0a\x02\x08", b"\x0a\x03\x12\x01\xff", b"\x12"])
def test_malformed_response_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ttrpc.ProtocolError, match="malformed ttrpc response"):
        ttrpc.decode_response(payload)


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
