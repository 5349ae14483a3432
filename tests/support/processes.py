"""Processes as /proc shows them, and the built binary's cache id: what the warm start tests look for."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable


def cache_id(binary: str) -> str:
    """The content hash in the packed binary's trailer: the name of its tree in the cache."""
    with open(binary, "rb") as f:
        f.seek(-40, os.SEEK_END)
        trailer = f.read()
    assert trailer[:8] == b"RDMACNI\x01", f"{binary} is not a packed rdma-cni binary"
    return trailer[24:].decode()


def _argvs() -> Iterable[tuple[int, list[bytes]]]:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                yield int(entry), f.read().split(b"\0")
        except OSError:
            continue


def pids_mentioning(text: str) -> list[int]:
    """Processes whose command line contains ``text``."""
    needle = text.encode()
    return [pid for pid, argv in _argvs() if any(needle in arg for arg in argv)]


def warm_servers(tree: str | None = None) -> list[int]:
    """Running ``rdma-cni warm-server`` processes: of the tree ``tree``, or of any tree."""
    program = os.path.join(tree, "rdma-cni").encode() if tree else None
    return [
        pid
        for pid, argv in _argvs()
        if argv[1:2] == [b"warm-server"]
        and (argv[0] == program if program else argv[0].endswith(b"/rdma-cni"))
    ]


def children_of(parent: int) -> list[int]:
    """Direct children of ``parent``."""
    out = []
    for pid, _ in _argvs():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            out.append(pid)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return not f.read().rsplit(") ", 1)[1].startswith("Z")
    except OSError:
        return False


def wait_gone(pids: int | Iterable[int], timeout: float = 10) -> bool:
    """Wait until none of ``pids`` runs (a zombie counts as gone); False on timeout."""
    waiting = [pids] if isinstance(pids, int) else list(pids)
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in waiting):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
