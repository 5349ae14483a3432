"""containerd 1.7's NRI wire as recorded (``tests/unit/data/nri/containerd-1.7.24.jsonl``), and its replay.

The recording was made in the QEMU tier (``tests/e2e/scenarios/nri_record.py``) between the
agent and the nri.sock of Debian trixie's containerd 1.7.24: every chunk of the agent's first
connection, in order, one JSON line each (``dir`` names the receiver, ``hex`` the bytes).
:func:`replay_runtime` plays containerd's side of it to a live plugin on a real socket.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path

from rdma_cni.agent.nri import mux, plugin, ttrpc

CAPTURE = Path(__file__).resolve().parents[1] / "unit" / "data" / "nri" / "containerd-1.7.24.jsonl"


@dataclass
class Chunk:
    to: str  # "plugin" or "runtime": who received these bytes
    data: bytes


def chunks() -> list[Chunk]:
    """The first connection's chunks, in the order the relay moved them."""
    out = []
    for line in CAPTURE.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("conn") == 1 and "hex" in rec:
            out.append(Chunk(rec["dir"], bytes.fromhex(rec["hex"])))
    return out


def stream(to: str) -> bytes:
    return b"".join(c.data for c in chunks() if c.to == to)


def frames(data: bytes) -> list[tuple[int, bytes]]:
    """Multiplexer frames of a whole recorded direction, checked to end on a frame boundary."""
    out = []
    pos = 0
    while pos < len(data):
        conn, size = mux.HEADER.unpack_from(data, pos)
        assert size <= mux.MAX_PAYLOAD
        out.append((conn, data[pos + mux.HEADER.size : pos + mux.HEADER.size + size]))
        pos += mux.HEADER.size + size
    assert pos == len(data), "the recording ends inside a frame"
    return out


def messages(to: str) -> list[tuple[int, ttrpc.Message]]:
    readers: dict[int, ttrpc.Reader] = {}
    out = []
    for conn, payload in frames(stream(to)):
        out += [(conn, m) for m in readers.setdefault(conn, ttrpc.Reader()).feed(payload)]
    assert all(r.pending == 0 for r in readers.values())
    return out


def _next_messages(sock: socket.socket, readers: dict[int, ttrpc.Reader]) -> list[tuple[int, ttrpc.Message]]:
    conn, payload = mux.read_frame(sock)
    reader = readers.setdefault(conn, ttrpc.Reader())
    return [(conn, m) for m in reader.feed(payload)]


def replay_runtime(sock: socket.socket) -> tuple[ttrpc.Request, list[tuple[ttrpc.Request, ttrpc.Response]]]:
    """Be containerd on an accepted plugin connection: take the plugin's RegisterPlugin, then send
    the recorded runtime frames in order, each call waiting for the plugin's answer before the next
    (the plugin's answers may differ from the recorded ones: its records are not the recording's).
    Returns the registration request and each recorded call with the plugin's answer."""
    readers: dict[int, ttrpc.Reader] = {}
    pending: list[tuple[int, ttrpc.Message]] = []
    while not any(c == mux.RUNTIME_CONN and m.type == ttrpc.TYPE_REQUEST for c, m in pending):
        pending += _next_messages(sock, readers)
    (register,) = [ttrpc.decode_request(m.payload) for c, m in pending if c == mux.RUNTIME_CONN]
    assert (register.service, register.method) == (plugin.RUNTIME_SERVICE, "RegisterPlugin"), register
    answered: dict[int, ttrpc.Response] = {}
    calls: list[tuple[ttrpc.Request, ttrpc.Response]] = []
    sent = {mux.PLUGIN_CONN: ttrpc.Reader(), mux.RUNTIME_CONN: ttrpc.Reader()}
    for conn, payload in frames(stream("plugin")):
        mux.send_frame(sock, conn, payload)
        for msg in sent[conn].feed(payload):
            if conn != mux.PLUGIN_CONN or msg.type != ttrpc.TYPE_REQUEST:
                continue
            while msg.stream not in answered:
                for c, m in _next_messages(sock, readers):
                    if c == mux.PLUGIN_CONN and m.type == ttrpc.TYPE_RESPONSE:
                        answered[m.stream] = ttrpc.decode_response(m.payload)
            calls.append((ttrpc.decode_request(msg.payload), answered[msg.stream]))
    return register, calls
