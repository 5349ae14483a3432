"""The packed launcher's trailer (launcher/launcher.c): which build a launcher file carries.

Standard library only, so that the IPAM delegate can check its guard (see
rdma_cni.node.ipam) without importing the warm server and the entry points it
reaches.
"""

from __future__ import annotations

import os

# magic, offset, count, id (16 hex characters of the payload's content hash)
TRAILER_SIZE = 40
TRAILER_MAGIC = b"RDMACNI\x01"


def payload_id(path: str) -> str | None:
    """The payload id in the trailer of the packed launcher at ``path``, or None if it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return payload_id_of(fd)
    finally:
        os.close(fd)


def payload_id_of(fd: int) -> str | None:
    """:func:`payload_id` of the file open on ``fd`` (what runs from it cannot be swapped meanwhile)."""
    try:
        size = os.fstat(fd).st_size
        trailer = os.pread(fd, TRAILER_SIZE, size - TRAILER_SIZE) if size >= TRAILER_SIZE else b""
    except OSError:
        return None
    if len(trailer) != TRAILER_SIZE or not trailer.startswith(TRAILER_MAGIC):
        return None
    return trailer[24:].decode("ascii", "replace")
