"""ttrpc (containerd/ttrpc ``channel.go``, ``request.proto``): framing and the Request and Response messages.

A message is a 10-byte header (payload length uint32, stream id uint32, both
big-endian; message type byte; flags byte) then the payload, at most 4 MiB.
A client opens odd stream ids, one per call; the response carries the same id.
The Request and Response envelopes are protobuf messages generated from
``ttrpc.proto`` (``ttrpc_pb2``, see the Makefile); this module converts them
to and from the plain :class:`Request` and :class:`Response` the plugin uses.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from rdma_cni.agent.nri import ttrpc_pb2

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
    """The wire form of a ttrpc Request."""
    msg = ttrpc_pb2.Request(
        service=req.service, method=req.method, payload=req.payload, timeout_nano=req.timeout_nano
    )
    return msg.SerializeToString()


def decode_request(payload: bytes) -> Request:
    """ProtocolError when the payload is no Request or names no method."""
    msg = ttrpc_pb2.Request()
    try:
        msg.ParseFromString(payload)
    except DecodeError as exc:  # also invalid UTF-8 in service or method
        raise ProtocolError(f"malformed ttrpc request: {exc}") from exc
    req = Request(msg.service, msg.method, msg.payload, msg.timeout_nano)
    if not req.service or not req.method:
        raise ProtocolError("ttrpc request without service or method")
    return req


def encode_response(resp: Response) -> bytes:
    """The wire form of a ttrpc Response; its status is always sent, even an empty (OK) one."""
    msg = ttrpc_pb2.Response(payload=resp.payload)
    # Assigning the fields of a sub-message marks it present; an OK status has none, so mark it.
    msg.status.SetInParent()
    msg.status.code = resp.code
    msg.status.message = resp.message
    return msg.SerializeToString()


def decode_response(payload: bytes) -> Response:
    """ProtocolError when the payload is no Response."""
    msg = ttrpc_pb2.Response()
    try:
        msg.ParseFromString(payload)
    except DecodeError as exc:
        raise ProtocolError(f"malformed ttrpc response: {exc}") from exc
    return Response(msg.status.code, msg.status.message, msg.payload)
