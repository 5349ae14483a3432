"""The protobuf wire format by hand, just enough for the CRI messages the guest's driver sends (nri_cri.py).

It runs under the QEMU guest's python3, whose Debian protobuf runtime (4.21 in
trixie) is too old for the code the host's grpcio-tools generates (protobuf 6
gencode checks its runtime's version); the agent itself uses the messages
generated from ``rdma_cni/agent/nri/*.proto``.

Decoding keeps every field as a list of raw values by number; unknown fields
are skipped as protobuf requires. A malformed buffer raises :class:`DecodeError`.
"""

from __future__ import annotations

from collections.abc import Iterable

VARINT = 0
I64 = 1
LEN = 2
I32 = 5


class DecodeError(ValueError):
    """A buffer that is not a valid protobuf message."""


Fields = dict[int, list[int | bytes]]


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise DecodeError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise DecodeError("varint longer than 10 bytes")


def decode(buf: bytes) -> Fields:
    """Field number -> values (ints for varints and fixed fields, bytes for length-delimited ones)."""
    out: Fields = {}
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise DecodeError("field number 0")
        value: int | bytes
        if wire == VARINT:
            value, pos = _varint(buf, pos)
        elif wire == LEN:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise DecodeError(f"field {number}: length {size} past the end of the message")
            value = buf[pos : pos + size]
            pos += size
        elif wire in (I64, I32):
            width = 8 if wire == I64 else 4
            if pos + width > len(buf):
                raise DecodeError(f"field {number}: truncated fixed-width value")
            value = int.from_bytes(buf[pos : pos + width], "little")
            pos += width
        else:
            raise DecodeError(f"field {number}: unsupported wire type {wire}")
        out.setdefault(number, []).append(value)
    return out


def string(fields: Fields, number: int) -> str:
    """The last value of a string field ("" when absent)."""
    values = fields.get(number)
    if not values or not isinstance(values[-1], bytes):
        return ""
    return values[-1].decode("utf-8", errors="replace")


def integer(fields: Fields, number: int) -> int:
    """The last value of a varint field (0 when absent), as a signed 64-bit number."""
    values = fields.get(number)
    if not values or not isinstance(values[-1], int):
        return 0
    v = values[-1]
    return v - (1 << 64) if v >= 1 << 63 else v


def message(fields: Fields, number: int) -> Fields:
    """The embedded message in a field (empty when absent)."""
    values = fields.get(number)
    if not values or not isinstance(values[-1], bytes):
        return {}
    return decode(values[-1])


def messages(fields: Fields, number: int) -> list[Fields]:
    """Every embedded message of a repeated field."""
    return [decode(v) for v in fields.get(number, []) if isinstance(v, bytes)]


def enc_varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def f_varint(number: int, value: int) -> bytes:
    """A varint field; proto3 leaves a zero out."""
    return enc_varint(number << 3 | VARINT) + enc_varint(value) if value else b""


def f_bytes(number: int, value: bytes, *, keep_empty: bool = False) -> bytes:
    """A length-delimited field (string, bytes or embedded message); an empty one is left out unless kept."""
    if not value and not keep_empty:
        return b""
    return enc_varint(number << 3 | LEN) + enc_varint(len(value)) + value


def f_string(number: int, value: str) -> bytes:
    return f_bytes(number, value.encode())


def f_messages(number: int, values: Iterable[bytes]) -> bytes:
    """A repeated embedded-message field (empty messages are kept: they are elements)."""
    return b"".join(f_bytes(number, v, keep_empty=True) for v in values)
