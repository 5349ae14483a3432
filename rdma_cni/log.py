"""Logging set-up: diagnostics go to stderr and to the config's ``logFile``.

stdout is reserved for the one CNI JSON document, so no handler here ever
writes to it. The ``logFile`` is rotated by the verbs themselves (nothing else
on a node knows it): once it reaches :data:`ROTATE_BYTES` the next verb renames
it to ``<logFile>.1`` (replacing the previous one) and starts a new file, so it
never holds more than twice that.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import sys
from collections.abc import Iterator

_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"
_root = logging.getLogger("rdma_cni")
# The format names no process: without this every record asks multiprocessing
# for one, importing it (rdma_cni.launch.startup defers it) into every cold start.
logging.logMultiprocessing = False

# "warm" when a warm server's child runs this invocation (rdma_cni.launch.warm); the
# per-verb log line says which, so an operator can tell the two apart.
start_kind = "cold"


def setup_stderr() -> None:
    """Send warnings and errors to stderr until the config says more."""
    if not _root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.setLevel(logging.WARNING)
        _root.addHandler(handler)
        _root.setLevel(logging.INFO)
        _root.propagate = False


ROTATE_BYTES = 16 << 20


def rotate_if_large(path: str, limit: int | None = None) -> bool:
    """Rename ``path`` to ``path.1`` once it holds ``limit`` (:data:`ROTATE_BYTES`) bytes; whether this
    call rotated it.

    Verbs run side by side, so exactly one may rotate a given file: the one that takes its
    ``flock`` and finds the name still on the file it locked (a verb that comes later finds the
    new file, small). Writers that still have the old file open append to ``path.1``, harmlessly.
    Never raises: a log that cannot be rotated must not fail a verb.
    """
    limit = ROTATE_BYTES if limit is None else limit
    try:
        # O_NONBLOCK: a FIFO by that name must not hold the verb here.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # none yet (or a symlink): nothing to rotate
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < limit:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
            return False  # another verb rotated it between our open and our lock
        # Not shared/atomicfile: nothing is written, verbs keep appending to the file under its new
        # name, and a rotation lost in a crash loses nothing (no fsync wanted on every verb's path).
        os.rename(path, f"{path}.1")
        return True
    except BlockingIOError:
        return False  # another verb is rotating it now
    except OSError as exc:
        _root.warning("cannot rotate logFile %s: %s", path, exc)
        return False
    finally:
        os.close(fd)


def configure(log_file: str | None, level: str, context: str) -> None:
    """Apply the config's logFile and logLevel; ``context`` prefixes every line."""
    _root.setLevel(getattr(logging, level.upper(), logging.INFO))
    if log_file:
        try:
            os.makedirs(os.path.dirname(log_file) or "/", exist_ok=True)
            rotate_if_large(log_file)
            handler = logging.FileHandler(log_file, encoding="utf-8")
        except OSError as exc:
            _root.warning("cannot open logFile %s: %s", log_file, exc)
            return
        handler.setFormatter(logging.Formatter(_FORMAT.replace("%(name)s", f"%(name)s {context}")))
        _root.addHandler(handler)


@contextlib.contextmanager
def verb_scope() -> Iterator[None]:
    """Undo a verb's logging set-up when it ends: for a process that runs many (the agent's workers).

    :func:`configure` adds the verb's ``logFile`` handler and sets its level; a plugin process
    ends with its verb, a worker must not take either into the next one.
    """
    handlers, level = list(_root.handlers), _root.level
    try:
        yield
    finally:
        for handler in [h for h in _root.handlers if h not in handlers]:
            _root.removeHandler(handler)
            handler.close()
        _root.setLevel(level)
