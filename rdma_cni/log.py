"""Logging set-up: diagnostics go to stderr and to the config's ``logFile``.

stdout is reserved for the one CNI JSON document, so no handler here ever
writes to it. The ``logFile`` is rotated by size: past ``LOG_MAX_BYTES`` it
becomes ``<logFile>.1`` (replacing the previous one) and a new file starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"
_root = logging.getLogger("rdma_cni")
# The format names no process: without this every record asks multiprocessing
# for one, importing it (rdma_cni.startup defers it) into every cold start.
logging.logMultiprocessing = False

# "warm" when a warm server's child runs this invocation (rdma_cni.warm); the
# per-verb log line says which, so an operator can tell the two apart.
start_kind = "cold"

# One verb writes a line or two: 10 MiB is weeks of a busy node, and two files cap the disk use.
LOG_MAX_BYTES = 10 * 1024 * 1024


def rotate_if_full(path: str, max_bytes: int | None = None) -> bool:
    """Rename ``path`` to ``path.1`` once it holds ``max_bytes`` or more; True if this call did.

    Every verb is a process of its own and several may find the file full at
    once: each locks the file it found, and renames only if that file is still
    the one at ``path``; a later one finds the fresh file and leaves it alone,
    so a rotated file is never rotated over.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size < (LOG_MAX_BYTES if max_bytes is None else max_bytes):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX)
        mine = os.fstat(fd)
        with contextlib.suppress(OSError):
            now = os.stat(path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                os.rename(path, path + ".1")
                return True
        return False
    finally:
        os.close(fd)  # and with it the lock


def setup_stderr() -> None:
    """Send warnings and errors to stderr until the config says more."""
    if not _root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.setLevel(logging.WARNING)
        _root.addHandler(handler)
        _root.setLevel(logging.INFO)
        _root.propagate = False


def configure(log_file: str | None, level: str, context: str) -> None:
    """Apply the config's logFile and logLevel; ``context`` prefixes every line."""
    _root.setLevel(getattr(logging, level.upper(), logging.INFO))
    if log_file:
        try:
            os.makedirs(os.path.dirname(log_file) or "/", exist_ok=True)
            rotate_if_full(log_file)
            handler = logging.FileHandler(log_file, encoding="utf-8")
        except OSError as exc:
            _root.warning("cannot open logFile %s: %s", log_file, exc)
            return
        handler.setFormatter(logging.Formatter(_FORMAT.replace("%(name)s", f"%(name)s {context}")))
        _root.addHandler(handler)
