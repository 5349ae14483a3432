"""The one atomic file write every writer of the package uses, and the one durable move (stdlib only).

Readers see the old file or the new one, never a partial or a missing one,
and a crash leaves one of the two on disk: the data goes to a temporary file
in the same directory (a rename is atomic only within one file system), is
given its final mode, written, fsync'ed, renamed over the target, and the
directory is fsync'ed so that the rename itself survives a crash. Any
failure removes the temporary file and leaves the target untouched.

The temporary file is ``.tmp-<pid>-<name>``: hidden from listings that skip
dot files, and an orphan left by a killed writer names its writer (the node's
GC removes those, see :func:`rdma_cni.node.record.remove_orphaned_temporaries`).
It is opened close-on-exec and without following symbolic links.

:func:`move` is the same guarantee for a file that already exists and moves
(a corrupt record set aside): renamed, and both directories fsync'ed, so a
crash leaves it in one place or the other, never in neither.

Renames that stay outside this module are not file writes, and each says so
where it is: a listening socket put in place (the warm server's, the CNI
server's: nothing to flush, it does not outlive a boot), a log file rotated
while verbs still append to it (no durability wanted), and whole directory
trees published or moved aside (the launcher's unpack, launcher/launcher.c,
flushed with ``syncfs`` first; the cache pruner's aside).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import BinaryIO

TMP_PREFIX = ".tmp-"


def fsync_dir(directory: str) -> None:
    """Flush ``directory``'s entries (a rename or unlink in it) to disk."""
    _fsync(directory, os.O_DIRECTORY)


def fsync_file(path: str) -> None:
    """Flush the content of the file at ``path`` (written without its fsync) to disk."""
    _fsync(path, os.O_NOFOLLOW)


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: str) -> str:
    """The temporary file :func:`write_atomic` uses for ``path``."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{name}")


def write_atomic(
    path: str,
    data: bytes | str | Callable[[BinaryIO], object],
    *,
    mode: int = 0o600,
    sync_dir: bool = True,
    fsync: bool = True,
) -> None:
    """Replace ``path`` with ``data`` (bytes, text as UTF-8, or a function writing to the file).

    ``mode`` is the file's exact mode (the umask does not apply); 0600 unless
    told. ``sync_dir=False`` skips the directory fsync, for a file whose old
    version is as good as the new one after a crash; ``fsync=False`` skips the file's own fsync too,
    for a caller that flushes both later (:func:`fsync_file`, :func:`fsync_dir`) before anything
    depends on the file surviving a crash of the machine. Raises what failed
    (OSError, or whatever ``data`` raised); the temporary file is gone then
    and ``path`` is as it was.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = temporary_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_dir:
        fsync_dir(directory)


def move(path: str, target: str, *, sync_dir: bool = True) -> None:
    """Rename ``path`` to ``target`` (replacing it; same file system), then fsync the target's
    directory and, when another, the source's: after a crash the file is at one of the two names.

    Raises OSError from the rename (nothing moved) or from a directory fsync (moved, maybe not yet
    durable). ``sync_dir=False`` skips the fsyncs.
    """
    os.replace(path, target)
    if sync_dir:
        source, dest = os.path.dirname(os.path.abspath(path)), os.path.dirname(os.path.abspath(target))
        fsync_dir(dest)
        if source != dest:
            fsync_dir(source)
