"""ttrpc (containerd/ttrpc ``channel.go``, ``request.proto``): framing and the Request and Response messages.

A message is a 10-byte header (payload length uint32, stream id uint32, both
big-endian; message type byte; flags byte) then the payload, at most 4 MiB.
A client opens odd stream ids, one per call; the response carries the same id.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from rdma_cni.agent.nri import pb

TTRPC_HEADER = struct.Struct(">IIBB")
MAX_MESSAGE = 4 << 20
TYPE_REQUEST = 1
TYPE_RESPONSE = 2
TYPE_DATA = 3

# google.rpc.Code values ttrpc uses in Response.status.
OK = 0
UNKNOWN = 2
INVALID_ARGUMENT = 3
UNIMPLEMENTED = 12


class ProtocolError(Exception):
    """The peer broke the protocol; the connection cannot be trusted any further."""


@dataclass
class Message:
    stream: int
    type: int
    flags: int
    payload: bytes


@dataclass
class Request:
    service: str
    method: str
    payload: bytes
    timeout_nano: int = 0


@dataclass
class Response:
    code: int
    message: str
    payload: bytes


def encode_message(stream: int, mtype: int, payload: bytes, flags: int = 0) -> bytes:
    """Header and payload of one ttrpc message; ProtocolError when it is too big to send."""
    if len(payload) > MAX_MESSAGE:
        raise ProtocolError(f"ttrpc message of {len(payload)} bytes exceeds {MAX_MESSAGE}")
    return TTRPC_HEADER.pack(len(payload), stream, mtype, flags) + payload


class Reader:
    """Cuts one connection's byte stream into messages (a message may span frames, or share one)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        """Messages completed by ``data``; ProtocolError for an oversize length."""
        self._buf += data
        out = []
        while len(self._buf) >= TTRPC_HEADER.size:
            size, stream, mtype, flags = TTRPC_HEADER.unpack_from(self._buf)
            if size > MAX_MESSAGE:
                raise ProtocolError(f"ttrpc message of {size} bytes on stream {stream} exceeds {MAX_MESSAGE}")
            end = TTRPC_HEADER.size + size
            if len(self._buf) < end:
                break
            out.append(Message(stream, mtype, flags, bytes(self._buf[TTRPC_HEADER.size : end])))
            del self._buf[:end]
        return out

    @property
    def pending(self) -> int:
        """Bytes of a message not yet complete."""
        return len(self._buf)


def encode_request(req: Request) -> bytes:
    return (
        pb.f_string(1, req.service)
        + pb.f_string(2, req.method)
        + pb.f_bytes(3, req.payload)
        + pb.f_varint(4, req.timeout_nano)
    )


def decode_request(payload: bytes) -> Request:
    """ProtocolError when the payload is no Request or names no method."""
    try:
        f = pb.decode(payload)
    except pb.DecodeError as exc:
        raise ProtocolError(f"malformed ttrpc request: {exc}") from exc
    req = Request(pb.string(f, 1), pb.string(f, 2), _last_bytes(f, 3), pb.integer(f, 4))
    if not req.service or not req.method:
        raise ProtocolError("ttrpc request without service or method")
    return req


def _last_bytes(f: pb.Fields, number: int) -> bytes:
    values = f.get(number)
    return values[-1] if values and isinstance(values[-1], bytes) else b""


def encode_response(resp: Response) -> bytes:
    status = pb.f_varint(1, resp.code) + pb.f_string(2, resp.message)
    return pb.f_bytes(1, status, keep_empty=True) + pb.f_bytes(2, resp.payload)


def decode_response(payload: bytes) -> Response:
    """ProtocolError when the payload is no Response."""
    try:
        f = pb.decode(payload)
        status = pb.message(f, 1)
    except pb.DecodeError as exc:
        raise ProtocolError(f"malformed ttrpc response: {exc}") from exc
    return Response(pb.integer(status, 1), pb.string(status, 2), _last_bytes(f, 2))
