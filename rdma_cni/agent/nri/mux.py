"""NRI's connection multiplexer (containerd/nri ``pkg/net/multiplex``): several byte streams on one socket.

Each frame is an 8-byte header, the connection id and the payload length
(both uint32, big-endian), then the payload. The plugin serves NRI's Plugin
service on connection 1 and calls the runtime's Runtime service on
connection 2. Frames for a connection nobody opened are dropped, as NRI's own
multiplexer does; a frame longer than a ttrpc message can be, or a trunk
that ends inside a frame, ends the connection.
"""

from __future__ import annotations

import socket
import struct

from rdma_cni.agent.nri.ttrpc import MAX_MESSAGE, TTRPC_HEADER, ProtocolError

PLUGIN_CONN = 1
RUNTIME_CONN = 2
HEADER = struct.Struct(">II")
MAX_PAYLOAD = TTRPC_HEADER.size + MAX_MESSAGE


class Closed(ConnectionError):
    """The runtime closed the socket (or it broke)."""


def encode_frame(conn_id: int, payload: bytes) -> bytes:
    """One multiplexer frame; ProtocolError for a payload NRI would refuse."""
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {len(payload)} bytes exceeds the multiplexer's {MAX_PAYLOAD}")
    return HEADER.pack(conn_id, len(payload)) + payload


def _read_exact(sock: socket.socket, size: int, what: str) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        try:
            chunk = sock.recv(min(size - len(chunks), 1 << 16))
        except OSError as exc:
            raise Closed(f"NRI socket failed reading {what}: {exc.strerror or exc}") from exc
        if not chunk:
            if chunks:
                raise Closed(f"NRI socket closed inside a frame ({what}: {len(chunks)} of {size} bytes)")
            raise Closed("NRI socket closed by the runtime")
        chunks += chunk
    return bytes(chunks)


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    """The next (connection id, payload) from the trunk; Closed or ProtocolError when it cannot go on."""
    conn_id, size = HEADER.unpack(_read_exact(sock, HEADER.size, "a frame header"))
    if size > MAX_PAYLOAD:
        raise ProtocolError(
            f"multiplexer frame of {size} bytes on connection {conn_id} exceeds {MAX_PAYLOAD}"
        )
    return conn_id, _read_exact(sock, size, "a frame payload") if size else b""


def send_frame(sock: socket.socket, conn_id: int, payload: bytes) -> None:
    """Write one frame whole (the only writer is the plugin's thread, so frames never interleave)."""
    try:
        sock.sendall(encode_frame(conn_id, payload))
    except OSError as exc:
        raise Closed(f"NRI socket failed writing: {exc.strerror or exc}") from exc
